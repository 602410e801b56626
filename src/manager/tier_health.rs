//! The storage tier's health: a circuit breaker that stops routing work to a tier that failed
//! (DESIGN §9, docs/STORAGE.md "When the tier is down").
//!
//! Core type: [`TierHealth`], the manager's record of whether the tier is up. The manager holds
//! no clock (a replay must stay deterministic): it marks the tier down itself, from a
//! completion, and only its owner (the service, which owns time) brings it back up, after a
//! probe that reached the tier on every rank.
//!
//! 1. A STORE or LOAD completes with a block the tier failed for (`BlockOutcome::Unavailable`:
//!    unreachable, timed out, an I/O error; not `Missing`, an ordinary miss), or the whole
//!    command failed for a reason of the tier (`CommandError::CopyFailed` or `StorageMiss`; a
//!    dead worker or a refused command says nothing about the tier): the tier is marked down
//!    (counted once per outage in `storage_outages`).
//! 2. While it is down, nothing routes work to it:
//!    - a match (`match_prefix`, `lookup`, `rematch`) ends before the first storage-only block
//!      (no hit counted; the block stays known, as an unavailable block always did);
//!    - an allocation whose request matched storage blocks before the tier went down cuts its
//!      hits there, issues no LOAD, and its ticket ends `Shortened` (as for a block the tier
//!      reported missing);
//!    - a host eviction of a block the tier does not hold drops it (with its storage-only
//!      children) instead of writing it back (`storage_down_dropped_blocks`): the host block is
//!      needed now, and a STORE would only fail; a block the tier holds already becomes
//!      storage-only as usual (metadata only, nothing is lost);
//!    - queued write-through STOREs are skipped (`storage_down_skipped_stores`);
//!    - a prefetch does nothing (`storage_down_skipped_prefetches`): no LOAD, no QUERY;
//!    - the service holds the FORGETs back until the tier is up.
//! 3. The owner probes the tier out of band after a back-off, and calls
//!    [`CacheManager::storage_tier_recovered`] once a probe reached it on every rank: storage
//!    hits, write-backs and prefetches resume.

use super::CacheManager;
use crate::tree::NodeState;
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

/// Whether a whole storage command failing with `error` says the tier failed (module flow,
/// step 1): the worker ran it and the back-end failed, as opposed to a worker that died or
/// refused the command.
pub(super) fn is_tier_failure(error: CommandError) -> bool {
    matches!(error, CommandError::CopyFailed | CommandError::StorageMiss)
}

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

    /// Marks the storage tier down (module flow, step 1): the manager does so itself when a
    /// completion says the tier failed; an owner that learns it otherwise may too. Returns
    /// whether this started an outage (false if it was down already or there is no tier).
    pub fn storage_tier_failed(&mut self) -> bool {
        if self.tier.down || !self.storage_enabled() {
            return false;
        }
        self.tier.down = true;
        self.stats.storage_outages += 1;
        // Write-throughs queued meanwhile are skipped (counted) by `poll`, not kept for later:
        // a block still on host is written back when it leaves host, if the tier is up again.
        true
    }

    /// Marks the storage tier up again (module flow, step 3): its owner calls this once a probe
    /// reached the tier on every rank. Returns whether it was down.
    pub fn storage_tier_recovered(&mut self) -> bool {
        std::mem::replace(&mut self.tier.down, false)
    }
}
