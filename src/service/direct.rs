//! Direct copies: block pairs that an engine asks the workers to copy itself, outside the cache
//! manager. vLLM's offloading worker moves blocks between its own KV tensors and the host tier;
//! kvshm's manager does not own those blocks, it only carries the copies out.
//!
//! vLLM treats a failed transfer as fatal, so a worker crash must not fail a direct copy:
//! 1. [`Service::submit_direct_copy`] queues the copy on every rank, or keeps it waiting while a
//!    rank has no worker;
//! 2. when a worker dies with the copy in flight, its commands fail with `WorkerDied` (once the
//!    worker is gone, so no copy of it can still run); the copy goes back to waiting and is
//!    issued again, whole, once every rank has a worker again (the engine restarts it; copying a
//!    block twice is harmless, its source is unchanged);
//! 3. an error a live worker reports (a bad command, a failed copy) is retried up to
//!    [`MAX_ATTEMPTS`] times in all, then reported;
//! 4. outcomes are handed out by [`Service::take_direct_outcomes`].
//!
//! Direct copies share the command tracker with the manager's transfers; their ids have the top
//! bit set, which the manager's (counted from 1) never reach.

use std::collections::{HashMap, VecDeque};

use kvshm_ipc::record::{BlockPair, CommandError};
use tracing::{info, warn};

use super::Service;
use crate::manager::{TransferFailure, TransferKind};

/// Tries of a direct copy that live workers fail (worker deaths are not counted).
pub const MAX_ATTEMPTS: u32 = 3;

const DIRECT_BIT: u64 = 1 << 63;

/// Whether tracker id `id` names a direct copy.
pub(super) fn is_direct(id: u64) -> bool {
    id & DIRECT_BIT != 0
}

/// Names one direct copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DirectCopyId(pub u64);

/// How a direct copy ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DirectCopyOutcome {
    pub id: DirectCopyId,
    pub result: Result<(), TransferFailure>,
    /// Times it was issued (a worker death adds one).
    pub issued: u32,
    /// Bytes copied by all ranks together (0 on failure).
    pub bytes: u64,
}

struct DirectCopy {
    kind: TransferKind,
    pairs: Vec<BlockPair>,
    issued: u32,
    /// Tries that live workers failed.
    failures: u32,
}

/// The direct copies not yet handed back.
#[derive(Default)]
pub(super) struct DirectCopies {
    next: u64,
    copies: HashMap<u64, DirectCopy>,
    /// Copies to issue once every rank has a worker, oldest first.
    waiting: VecDeque<u64>,
    finished: Vec<DirectCopyOutcome>,
}

impl Service {
    /// Copies `pairs` (`src`, `dst` per `kind`) on every rank, outside the cache manager
    /// (module flow). The copy waits while a rank has no worker, and survives worker deaths.
    pub fn submit_direct_copy(
        &mut self,
        kind: TransferKind,
        pairs: Vec<BlockPair>,
    ) -> DirectCopyId {
        let direct = &mut self.direct;
        direct.next += 1;
        let id = DIRECT_BIT | direct.next;
        if pairs.is_empty() {
            let outcome =
                DirectCopyOutcome { id: DirectCopyId(id), result: Ok(()), issued: 0, bytes: 0 };
            direct.finished.push(outcome);
            return DirectCopyId(id);
        }
        direct.copies.insert(id, DirectCopy { kind, pairs, issued: 0, failures: 0 });
        direct.waiting.push_back(id);
        self.issue_transfers();
        DirectCopyId(id)
    }

    /// Moves the outcomes of the direct copies that ended into `out`.
    pub fn take_direct_outcomes(&mut self, out: &mut Vec<DirectCopyOutcome>) {
        out.append(&mut self.direct.finished);
    }

    /// Direct copies not ended yet (waiting for a worker or in flight).
    pub fn direct_copies_pending(&self) -> usize {
        self.direct.copies.len()
    }

    /// Issues the waiting direct copies if every rank has a worker (module flow, steps 1, 2).
    pub(super) fn issue_waiting_direct(&mut self) {
        if self.direct.waiting.is_empty() || self.ranks.iter().any(|rank| !rank.is_up()) {
            return;
        }
        while let Some(id) = self.direct.waiting.pop_front() {
            let Some(copy) = self.direct.copies.get_mut(&id) else { continue };
            copy.issued += 1;
            let (kind, pairs) = (copy.kind, std::mem::take(&mut copy.pairs));
            self.queue_commands(id, kind, &pairs);
            self.direct.copies.get_mut(&id).expect("found just above").pairs = pairs;
        }
    }

    /// Applies the outcome of direct copy `id` on every rank (module flow, steps 2 to 4).
    pub(super) fn settle_direct(&mut self, id: u64, outcome: Result<(), TransferFailure>) {
        let meta = self.transfers.remove(&id);
        let Some(copy) = self.direct.copies.get_mut(&id) else {
            warn!(id, "an outcome for a direct copy that is not pending");
            return;
        };
        let retry = match outcome {
            Ok(()) => false,
            Err(failure) if failure.error == CommandError::WorkerDied => {
                info!(
                    id,
                    rank = failure.rank,
                    "a worker died under a direct copy; it will be issued again"
                );
                true
            }
            Err(failure) => {
                self.stats.copy_failures += 1;
                copy.failures += 1;
                warn!(id, %failure, tries = copy.failures, "a direct copy failed");
                copy.failures < MAX_ATTEMPTS
            }
        };
        if retry {
            self.direct.waiting.push_back(id);
            return;
        }
        let copy = self.direct.copies.remove(&id).expect("found just above");
        let bytes = match (outcome, meta) {
            (Ok(()), Some(meta)) => {
                meta.pairs as u64 * self.geometry.block_bytes() * self.ranks.len() as u64
            }
            _ => 0,
        };
        self.stats.bytes_copied += bytes;
        self.direct.finished.push(DirectCopyOutcome {
            id: DirectCopyId(id),
            result: outcome,
            issued: copy.issued,
            bytes,
        });
    }
}
