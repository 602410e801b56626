//! The storage commands that move no block bytes: QUERY (which blocks does every rank's tier hold,
//! for a prefetch, or whether it answers at all, for a probe of a tier that is down: `tier_probe`)
//! and FORGET (the scheduler dropped these blocks), DESIGN §9.
//!
//! Core type: [`MetaCommands`], the service's record of those in flight, each named by a
//! [`MetaId`]: the transport carries them as jobs of their own ([`ServiceJob::Meta`]), beside the
//! manager's transfers, and joins their per-rank completions like any other.
//!
//! 1. Before the copies of a step are issued, the service takes the manager's forgotten blocks
//!    and sends them as FORGET commands to every rank that has a worker (at most
//!    `max_storage_entries` per command), so that a FORGET precedes, in each rank's ring, the
//!    STOREs the same step issues. While the storage tier is down (`tier_probe`) they are held
//!    (at most [`MAX_FORGET_BACKLOG`] blocks) and sent once it is up, and a query waiting to go
//!    is answered as failed (it finds nothing). A rank without a worker keeps them in a backlog
//!    of its own (at most [`MAX_FORGET_BACKLOG`] blocks; beyond, they are dropped and counted),
//!    sent once a worker holds it again; one whose worker still sets up takes them in order with
//!    its STOREs, and a FORGET that waited the command deadline there unsent
//!    (`WorkerNotServing`) is sent again on the next step, as new (at most
//!    [`MAX_FORGET_BACKLOG`] blocks kept so); a FORGET that failed (a worker that died with it, an error) is
//!    sent once more on the next step, then dropped and counted. A FORGET sent again leaves out
//!    the blocks stored again since ([`crate::manager::CacheManager::keep_forgettable`]). A
//!    worker runs a FORGET whatever its generation, so those queued before a reset still free
//!    their blocks;
//! 2. then it takes the manager's QUERYs and sends each to every rank in the same way, keeping
//!    per command where its entries start;
//! 3. each QUERY command's result bits are ANDed into the query's per-block presence (a
//!    block the tier could not tell about counts as absent); the blocks a FORGET completion
//!    says the back-end failed to forget are sent once more, as for a failed FORGET;
//! 4. when every command of a QUERY completed on every rank, the manager gets the leading run
//!    of blocks present everywhere (or the failure, when a command failed or a rank died).

use std::collections::HashMap;

use kvshm_ipc::record::{CommandError, Op};
use kvshm_ipc::storage_record::{StorageEntry, StorageResults, NO_HOST_BLOCK};
use tracing::warn;

use super::{Service, ServiceJob};
use crate::hash::BlockHash;
use crate::manager::{StorageQuery, TransferFailure};

/// Names one QUERY, FORGET or probe in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MetaId(pub u64);

/// Blocks kept at most, per rank without a worker, for the FORGETs it missed (16 bytes each).
pub const MAX_FORGET_BACKLOG: usize = 1 << 16;

/// What one QUERY or FORGET in flight is.
#[derive(Debug)]
enum Meta {
    Forget {
        hashes: Vec<BlockHash>,
        /// Whether this is the second sending (a failure is then final).
        retried: bool,
        /// Per block: queued to be sent again, or given up, already (by one rank's failed bit):
        /// another rank's failure of it, or the whole command's, counts it no more.
        failed: Vec<bool>,
    },
    Query {
        /// The manager's query id.
        query: u64,
        /// Per block: present on every rank that answered so far.
        present: Vec<bool>,
    },
    /// A probe of a storage tier that is down (`tier_probe`): one block, asked of every rank.
    Probe {
        /// No rank that answered so far said its tier failed.
        reached: bool,
    },
}

/// The QUERYs and FORGETs in flight (module flow).
#[derive(Debug, Default)]
pub(super) struct MetaCommands {
    next: u64,
    by_id: HashMap<MetaId, Meta>,
    /// Blocks forgotten while the storage tier was down, sent once it is up (module flow,
    /// step 1).
    held_while_down: Vec<BlockHash>,
    /// Scratch for the manager's forgotten blocks and queries.
    forgotten: Vec<BlockHash>,
    queries: Vec<StorageQuery>,
    /// Per rank index: blocks its missing worker was not told about (module flow, step 1).
    backlogs: Vec<Vec<BlockHash>>,
    /// Blocks of failed FORGETs, sent once more on the next step.
    retries: Vec<BlockHash>,
    /// Blocks of FORGETs that were never sent (they waited the command deadline for a worker
    /// that sets up, `WorkerNotServing`): sent again on the next step, as new, not as failed.
    unsent: Vec<BlockHash>,
}

impl MetaCommands {
    fn new_id(&mut self, meta: Meta) -> MetaId {
        let id = MetaId(self.next);
        self.next += 1;
        self.by_id.insert(id, meta);
        id
    }

    /// A probe of the storage tier (`tier_probe`), to be sent to every rank.
    pub(super) fn new_probe(&mut self) -> MetaId {
        self.new_id(Meta::Probe { reached: true })
    }

    /// Keeps `hashes` until the storage tier is up again; returns how many did not fit.
    fn hold_while_down(&mut self, hashes: &[BlockHash]) -> usize {
        let kept = hashes.len().min(MAX_FORGET_BACKLOG - self.held_while_down.len());
        self.held_while_down.extend_from_slice(&hashes[..kept]);
        hashes.len() - kept
    }

    /// Step 3: folds the result bits of one rank's QUERY command (entries `first..first +
    /// entries` of `id`) into its query's presence; the blocks a FORGET command's back-end failed
    /// to forget are sent once more (step 1). Returns how many blocks were given up (failed a
    /// second time). A command that failed as a whole is `settle_meta`'s.
    pub(super) fn note_answer(
        &mut self,
        id: MetaId,
        first: usize,
        entries: usize,
        results: StorageResults,
    ) -> usize {
        match self.by_id.get_mut(&id) {
            Some(Meta::Query { present, .. }) => {
                for (offset, slot) in present[first..first + entries].iter_mut().enumerate() {
                    *slot &= results.is_done(offset);
                }
                0
            }
            Some(Meta::Probe { reached }) => {
                *reached &= !results.is_failed(0);
                0
            }
            Some(Meta::Forget { hashes, retried, failed }) => {
                let newly = (first..first + entries).filter(|&index| {
                    results.is_failed(index - first) && !std::mem::replace(&mut failed[index], true)
                });
                if *retried {
                    return newly.count();
                }
                self.retries.extend(newly.map(|index| hashes[index]));
                0
            }
            None => 0,
        }
    }

    /// Keeps `hashes` for rank `index`, which has no worker; returns how many did not fit.
    fn keep_for_rank(&mut self, index: usize, hashes: &[BlockHash]) -> usize {
        if self.backlogs.len() <= index {
            self.backlogs.resize_with(index + 1, Vec::new);
        }
        let backlog = &mut self.backlogs[index];
        let kept = hashes.len().min(MAX_FORGET_BACKLOG - backlog.len());
        backlog.extend_from_slice(&hashes[..kept]);
        hashes.len() - kept
    }

    /// Blocks waiting, over all ranks, for a FORGET (backlogs of ranks without a worker, and
    /// retries).
    pub(super) fn forgets_waiting(&self) -> usize {
        self.backlogs.iter().map(Vec::len).sum::<usize>()
            + self.retries.len()
            + self.unsent.len()
            + self.held_while_down.len()
    }

    /// Keeps `hashes`, of a FORGET that waited the command deadline unsent, for the next step;
    /// returns how many did not fit ([`MAX_FORGET_BACKLOG`] blocks in all).
    fn keep_unsent(&mut self, hashes: &[BlockHash]) -> usize {
        let kept = hashes.len().min(MAX_FORGET_BACKLOG.saturating_sub(self.unsent.len()));
        self.unsent.extend_from_slice(&hashes[..kept]);
        hashes.len() - kept
    }
}

impl Service {
    /// Blocks waiting for a FORGET: kept for ranks without a worker, or to be sent again after
    /// a failure (module flow, step 1).
    pub fn storage_forgets_waiting(&self) -> usize {
        self.meta.forgets_waiting()
    }

    /// Steps 1 and 2 of the module flow.
    pub(super) fn issue_storage_meta(&mut self) {
        if self.manager.config().storage_blocks == 0 {
            return;
        }
        let mut forgotten = std::mem::take(&mut self.meta.forgotten);
        self.manager.take_forgotten_blocks(&mut forgotten);
        if self.manager.storage_tier_down() {
            // Nothing goes to a tier that is down (`tier_probe`): FORGETs wait for it, and
            // queries made before it went down find nothing.
            let dropped = self.meta.hold_while_down(&forgotten);
            self.stats.storage_forgets_dropped += dropped as u64;
            forgotten.clear();
            self.meta.forgotten = forgotten;
            let mut queries = std::mem::take(&mut self.meta.queries);
            self.manager.take_storage_queries(&mut queries);
            for query in queries.drain(..) {
                let failure =
                    TransferFailure { rank: 0, error: CommandError::StorageMiss, detail: 0 };
                self.answer_query(query.id, Err(failure));
            }
            self.meta.queries = queries;
            return;
        }
        if !self.meta.held_while_down.is_empty() {
            let held = std::mem::take(&mut self.meta.held_while_down);
            self.send_forgets(&held, false);
        }
        if !forgotten.is_empty() {
            self.send_forgets(&forgotten, false);
            forgotten.clear();
        }
        // Sent again: not for a block stored again since (a FORGET behind its STORE would free
        // what the tree counts). Backlogs need no such care: no STORE is issued while a rank
        // is down, nor while the tier is.
        if !self.meta.retries.is_empty() {
            let mut retries = std::mem::take(&mut self.meta.retries);
            self.manager.keep_forgettable(&mut retries);
            if !retries.is_empty() {
                self.send_forgets(&retries, true);
            }
        }
        if !self.meta.unsent.is_empty() {
            let mut unsent = std::mem::take(&mut self.meta.unsent);
            self.manager.keep_forgettable(&mut unsent);
            if !unsent.is_empty() {
                self.send_forgets(&unsent, false);
            }
        }
        for index in 0..self.meta.backlogs.len() {
            if !self.meta.backlogs[index].is_empty() && !self.transport.is_down(index) {
                let backlog = std::mem::take(&mut self.meta.backlogs[index]);
                self.send_forgets_to(&backlog, &[index], false);
            }
        }
        self.meta.forgotten = forgotten;
        let mut queries = std::mem::take(&mut self.meta.queries);
        self.manager.take_storage_queries(&mut queries);
        for query in queries.drain(..) {
            self.send_query(query);
        }
        self.meta.queries = queries;
    }

    /// Step 1: FORGETs of `hashes` to every rank with a worker; the others keep them. A rank
    /// whose worker still sets up takes them into the transport's backlog, in order with the
    /// STOREs queued there (a FORGET kept aside until it serves would overtake a later STORE of
    /// the same block, and free what the scheduler counts).
    fn send_forgets(&mut self, hashes: &[BlockHash], retried: bool) {
        let mut live = Vec::with_capacity(self.transport.ranks());
        for index in 0..self.transport.ranks() {
            if !self.transport.is_down(index) {
                live.push(index);
                continue;
            }
            // A rank without a worker is told once one serves it again.
            let dropped = self.meta.keep_for_rank(index, hashes);
            self.stats.storage_forgets_dropped += dropped as u64;
        }
        if !live.is_empty() {
            self.send_forgets_to(hashes, &live, retried);
        }
    }

    fn send_forgets_to(&mut self, hashes: &[BlockHash], ranks: &[usize], retried: bool) {
        let failed = vec![false; hashes.len()];
        let id = self.meta.new_id(Meta::Forget { hashes: hashes.to_vec(), retried, failed });
        let entries: Vec<StorageEntry> =
            hashes.iter().map(|hash| StorageEntry::new(hash.0, 0, 0, NO_HOST_BLOCK)).collect();
        self.transport.queue_storage(
            ServiceJob::Meta(id),
            Op::StorageForget,
            &entries,
            Some(ranks),
        );
        self.stats.storage_forgets_sent += hashes.len() as u64;
    }

    fn send_query(&mut self, query: StorageQuery) {
        if let Some(rank) = self.transport.first_rank_down() {
            let failure = TransferFailure { rank, error: CommandError::WorkerDied, detail: 0 };
            self.answer_query(query.id, Err(failure));
            return;
        }
        if query.hashes.is_empty() {
            self.answer_query(query.id, Ok(0));
            return;
        }
        let id = self
            .meta
            .new_id(Meta::Query { query: query.id, present: vec![true; query.hashes.len()] });
        let entries: Vec<StorageEntry> = query
            .hashes
            .iter()
            .map(|hash| StorageEntry::new(hash.0, 0, 0, NO_HOST_BLOCK))
            .collect();
        self.transport.queue_storage(ServiceJob::Meta(id), Op::StorageQuery, &entries, None);
    }

    /// Step 4: every command of QUERY or FORGET `id` completed on every rank.
    pub(super) fn settle_meta(&mut self, id: MetaId, outcome: Result<(), TransferFailure>) {
        match self.meta.by_id.remove(&id) {
            Some(Meta::Forget { hashes, retried, failed }) => {
                if let Err(failure) = outcome {
                    // Not the blocks one rank's failed bits queued again or gave up already.
                    let left: Vec<BlockHash> = hashes
                        .iter()
                        .zip(&failed)
                        .filter(|&(_, &counted)| !counted)
                        .map(|(&hash, _)| hash)
                        .collect();
                    if failure.error == CommandError::WorkerNotServing {
                        // Never sent: not a failure of the tier's. It goes again, in order with
                        // the STOREs of the steps after it.
                        let dropped = self.meta.keep_unsent(&left);
                        self.stats.storage_forgets_dropped += dropped as u64;
                        return;
                    }
                    self.stats.storage_forget_failures += 1;
                    if retried {
                        self.stats.storage_forgets_dropped += left.len() as u64;
                        warn!(%failure, "a FORGET failed twice; the tier keeps those blocks");
                    } else {
                        // Sent again (to every rank: it is idempotent) on the next step, once
                        // the ranks' states are settled.
                        self.meta.retries.extend(left);
                    }
                }
            }
            Some(Meta::Query { query, present }) => {
                let outcome = outcome.map(|()| present.iter().take_while(|&&held| held).count());
                self.answer_query(query, outcome);
            }
            Some(Meta::Probe { reached })
                if reached
                    && outcome.as_ref().is_err_and(|failure| never_asked_a_tier(failure.error)) =>
            {
                self.probe_unanswered(id);
            }
            Some(Meta::Probe { reached }) => self.probe_answered(id, reached && outcome.is_ok()),
            None => warn!(?id, "a storage query or forget completed twice"),
        }
    }

    fn answer_query(&mut self, query: u64, outcome: Result<usize, TransferFailure>) {
        if let Err(error) = self.manager.complete_storage_query(query, outcome) {
            warn!(query, %error, "the cache manager refused a query's answer");
        }
    }
}

/// Whether a storage command that failed with `error` failed before any worker asked its tier:
/// refused as of an older generation (a reset since it was queued), or never sent to a worker
/// still setting up. A worker lost with the command (fenced for owing answers past the deadline,
/// as on a hung tier) or an answer lost is not such a failure.
fn never_asked_a_tier(error: CommandError) -> bool {
    matches!(error, CommandError::StaleGeneration | CommandError::WorkerNotServing)
}
