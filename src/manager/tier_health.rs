//! The storage tier's health: a circuit breaker that stops routing work to a tier that failed
//! (DESIGN §9, docs/STORAGE.md "When the tier is down").
//!
//! Core type: [`TierHealth`], the manager's record of whether the tier is up. The manager holds
//! no clock (a replay must stay deterministic): it marks the tier down itself, from a
//! completion, and only its owner (the service, which owns time) brings it back up, after a
//! probe that reached the tier on every rank.
//!
//! 1. The breaker trips on a failure of the tier, not of one block ([`tier_failed`]): a STORE
//!    or LOAD with a block some rank could not reach the tier for (`BlockOutcome::Unreachable`:
//!    a connection refused or dropped, no answer in time), whose every block the tier failed
//!    for (`BlockOutcome::Unavailable`: an I/O error; not `Missing`, an ordinary miss), or whose
//!    whole command the owner reports failed for the tier (`CommandError::StorageMiss`,
//!    [`is_tier_failure`]), marks the tier down (counted once per outage in
//!    `storage_outages`); none of its blocks is then taken as gone. A command where some blocks
//!    landed (or were missing) and others came back unavailable, none unreachable, shows a tier
//!    that answers: the unavailable blocks are a per-block fault (one bad slot, one refused
//!    key), so a LOAD's are lost as missing ones are ([`super::load_outcome`]) and a STORE's are
//!    not written, and the tier stays up. (A one-block command cannot tell the two apart: it
//!    trips the breaker.)
//! 2. The moment it goes down, the storage copies made but not yet handed out (the outbox, and
//!    copies held back behind others) are settled as if the tier had answered "unavailable":
//!    a LOAD's tickets end `Shortened`, a STORE's blocks are given back as a failed STORE's are.
//!    No request then waits behind a tier that is down.
//! 3. While it is down, nothing routes work to it:
//!    - a match (`match_prefix`, `lookup`, `rematch`) ends before the first storage-only block
//!      (no hit counted; the block stays known, as an unavailable block always did);
//!    - an allocation whose request matched storage blocks before the tier went down cuts its
//!      hits there, issues no LOAD, and its ticket ends `Shortened` (as for a block the tier
//!      reported missing);
//!    - a host eviction of a block the tier does not hold drops it instead of writing it back
//!      (`storage_down_dropped_blocks`): the host block is needed now, and a STORE would only
//!      fail. Its storage-only children the tier holds intact are not forgotten: they leave the
//!      tree as orphans waiting for the dropped block to be cached again
//!      ([`CacheManager::orphan_stored_children`]); so do those of a block whose eviction STORE
//!      failed as the tier went down. A block the tier holds already becomes storage-only as
//!      usual (metadata only, nothing is lost);
//!    - queued write-through STOREs are skipped (`storage_down_skipped_stores`);
//!    - a prefetch does nothing (`storage_down_skipped_prefetches`): no LOAD, no QUERY;
//!    - the service holds the FORGETs back until the tier is up.
//! 4. The owner probes the tier out of band after a back-off, and calls
//!    [`CacheManager::storage_tier_recovered`] once a probe reached it on every rank: storage
//!    hits, write-backs and prefetches resume.

use super::load_outcome::{BlockOutcome, LoadOutcome};
use super::{CacheManager, TransferFailure, TransferId};
use crate::tree::{NodeId, NodeState};
use kvshm_ipc::record::CommandError;

/// Whether the storage tier is up (module flow).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct TierHealth {
    down: bool,
}

impl TierHealth {
    #[inline]
    pub(super) fn is_down(self) -> bool {
        self.down
    }
}

/// Whether a whole storage command failing with `error` says the tier failed (module flow, step 1).
/// A worker never fails a whole STORE or LOAD for its back-end: a back-end error comes back per
/// block (failed bits, `Unavailable`), a timeout or an unreachable server flagged so
/// (`Unreachable`). Its whole-command errors say something else: a refusal (`Malformed`,
/// `UnknownOp`, `StaleGeneration`, an id out of range), a worker without a tier (`NoStorage`: a
/// configuration), a dead or reclaimed worker (`WorkerDied`, synthesised by the service), an answer
/// overtaken in the ring (`AnswerLost`) or a worker still setting up (`WorkerNotServing`, both
/// synthesised by the transport), and `CopyFailed` only from a code this build does not know. So
/// only `StorageMiss`, the code an owner without per-block results reports for "the tier failed
/// this command", trips it. (The service marks the tier down itself when such a failure hides
/// another rank's unreachable blocks: `storage_tier_failed`.)
pub(super) fn is_tier_failure(error: CommandError) -> bool {
    error == CommandError::StorageMiss
}

/// Whether storage copy outcome `outcome` says the tier failed (module flow, step 1): a block a
/// rank could not reach the tier for, every block unavailable, or a whole command that failed
/// for the tier; not some blocks unavailable.
pub(super) fn outcome_trips_breaker(outcome: &LoadOutcome<'_>) -> bool {
    match outcome {
        LoadOutcome::AllLanded => false,
        LoadOutcome::Blocks(blocks) => tier_failed(blocks),
        LoadOutcome::Unavailable(failure) => is_tier_failure(failure.error),
    }
}

/// Whether a per-block outcome says the tier failed: some block unreachable, or every block
/// unavailable (and there is one).
pub(super) fn tier_failed(blocks: &[BlockOutcome]) -> bool {
    blocks.contains(&BlockOutcome::Unreachable)
        || (!blocks.is_empty() && blocks.iter().all(|&block| block == BlockOutcome::Unavailable))
}

/// What a storage copy settled without running because the tier went down reports: a whole
/// command the tier failed (module flow, step 2).
const SETTLED_WHILE_DOWN: TransferFailure =
    TransferFailure { rank: 0, error: CommandError::StorageMiss, detail: 0 };

/// Whether a match stops at a node in `state` while the tier is down: storage-only nodes, and
/// those a LOAD is bringing up (sharing that LOAD would wait on the tier).
#[inline]
pub(super) fn waits_on_tier(state: NodeState) -> bool {
    matches!(state, NodeState::Storage | NodeState::StorageToHost)
}

impl CacheManager {
    /// Whether the storage tier is marked down (module flow): matches end before storage-only
    /// blocks, evictions drop instead of writing back, and prefetches do nothing, until
    /// [`CacheManager::storage_tier_recovered`]. Always false without a tier.
    pub fn storage_tier_down(&self) -> bool {
        self.tier.is_down()
    }

    /// Marks the storage tier down (module flow, step 1) and settles the storage copies not yet
    /// handed out (step 2): the manager does so itself when a completion says the tier failed;
    /// an owner that learns it otherwise may too. Returns whether this started an outage (false
    /// if it was down already or there is no tier).
    pub fn storage_tier_failed(&mut self) -> bool {
        if !self.mark_tier_down() {
            return false;
        }
        self.settle_unissued_storage_copies();
        true
    }

    /// The first half of [`CacheManager::storage_tier_failed`]: marks the tier down, settling
    /// nothing yet (a completion that trips the breaker applies itself first).
    pub(super) fn mark_tier_down(&mut self) -> bool {
        if self.tier.down || !self.storage_enabled() {
            return false;
        }
        self.tier.down = true;
        self.stats.storage_outages += 1;
        // Write-throughs queued meanwhile are skipped (counted) by `poll`, not kept for later:
        // a block still on host is written back when it leaves host, if the tier is up again.
        true
    }

    /// Settles every storage copy made but not handed out yet (module flow, step 2) as a whole
    /// command the tier failed: a LOAD's nodes go back to storage-only and its tickets end
    /// `Shortened` (the LOADs held back behind it with them); a STORE's reservation is given
    /// back and a write-back's node, with no copy left, leaves the tree. Oldest first, as they
    /// would have been handed out.
    pub(super) fn settle_unissued_storage_copies(&mut self) {
        let unissued: Vec<TransferId> = self
            .outbox
            .iter()
            .copied()
            .filter(|id| {
                self.in_flight
                    .get(id)
                    .is_some_and(|flight| flight.kind.is_storage() && !flight.issued)
            })
            .collect();
        for id in unissued {
            // Settling an earlier LOAD cancels the LOADs held back below its blocks.
            let Some(mut flight) = self.in_flight.remove(&id) else { continue };
            // Host blocks it keeps (of loads abandoned below) may have been claimed from a
            // STORE still reading them: that STORE frees them once it has, as for a LOAD
            // cancelled unissued (`load_outcome`).
            for block in std::mem::take(&mut flight.reserved_host) {
                self.release_host_block(&flight.after, block);
            }
            self.stats.storage_down_settled_copies += 1;
            self.complete_storage(id, flight, LoadOutcome::Unavailable(SETTLED_WHILE_DOWN));
        }
        let in_flight = &self.in_flight;
        self.outbox.retain(|id| in_flight.contains_key(id));
        self.close_transfers();
    }

    /// Marks the storage tier up again (module flow, step 4): its owner calls this once a probe
    /// reached the tier on every rank. Returns whether it was down.
    pub fn storage_tier_recovered(&mut self) -> bool {
        std::mem::replace(&mut self.tier.down, false)
    }

    /// Host-only `victim`, evicted while the tier is down (or whose eviction STORE failed with the
    /// tier down), is about to leave the tree (module flow, step 3): the storage-only nodes below
    /// it that the tier holds intact leave with it (nothing hangs below a node that is gone) but
    /// are not forgotten: they wait as orphans for `victim`'s block to join the tree again
    /// (committed, or adopted from the tier), and join it under that block then
    /// (`adopt_orphans_under`), or expire as restart orphans do (`forget`). Like those they are not
    /// counted against the tier's room meanwhile. A node below with a copy in flight, and
    /// everything past the orphans' cap (the tier's capacity), is dropped as before.
    pub(super) fn orphan_stored_children(&mut self, victim: NodeId) {
        let capacity = self.config.storage_blocks as usize;
        // Storage depth (0 for a prompt's first block) of the victim's children.
        let child_depth = self.tree.depth(victim);
        let mut stack: Vec<(NodeId, u32)> =
            self.tree.children(victim).map(|child| (child, child_depth)).collect();
        // Parents before children: removed in reverse, children first.
        let mut kept: Vec<NodeId> = Vec::new();
        while let Some((id, depth)) = stack.pop() {
            let node = self.tree.node(id);
            let intact = node.state() == NodeState::Storage && node.stored();
            if !intact || self.orphan_count >= capacity {
                self.drop_subtree(id);
                continue;
            }
            let parent = node.parent().expect("a node below the victim has a parent");
            let parent_hash = self.tree.node(parent).hash();
            let hash = node.hash();
            self.keep_orphan(parent_hash, hash, depth);
            kept.push(id);
            stack.extend(self.tree.children(id).map(|child| (child, depth + 1)));
        }
        if kept.is_empty() {
            return;
        }
        self.stats.storage_down_orphaned_blocks += kept.len() as u64;
        for id in kept.into_iter().rev() {
            // Out of the tier's count, as any orphan; the tier keeps the block.
            self.storage_used -= 1;
            self.tree.remove(id);
        }
    }
}
