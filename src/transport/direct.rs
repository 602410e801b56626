//! Direct copies: block pairs that an engine asks the workers to copy itself, outside any cache.
//! vLLM's offloading worker moves blocks between its own KV tensors and the host tier; kvshm does
//! not own those blocks, it only carries the copies out.
//!
//! vLLM treats a failed transfer as fatal, so a worker crash must not fail a direct copy:
//! 1. [`Transport::submit_direct_copy`] queues the copy on every rank, or keeps it waiting while a
//!    rank has no worker;
//! 2. when a worker dies with the copy in flight, its commands fail with `WorkerDied` (once the
//!    worker is gone, so no copy of it can still run); the copy goes back to waiting and is
//!    issued again, whole, once every rank has a worker again (the engine restarts it; copying a
//!    block twice is harmless, its source is unchanged); so it does when its commands waited the
//!    command deadline for a worker that sets up again (`WorkerNotServing`, never sent; a copy
//!    is queued only once every rank serves, so only a rank that went back to setting up after
//!    that has such a backlog);
//! 3. an error a live worker reports (a bad command, a failed copy) is retried up to
//!    [`MAX_ATTEMPTS`] times in all, then reported;
//! 4. outcomes are handed out by [`Transport::take_direct_outcomes`].
//!
//! Direct copies share the command tracker with the owner's jobs under their own
//! [`Issuer::Direct`] ids, so that no id of one can be taken for the other.

use std::collections::{HashMap, VecDeque};

use kvshm_ipc::record::{BlockPair, CommandError, Op};
use tracing::{info, warn};

use super::{Issuer, Job, RankFailure, Transport};

/// Tries of a direct copy that live workers fail (worker deaths are not counted).
pub const MAX_ATTEMPTS: u32 = 3;

/// The direction of a block copy between a rank's device blocks and its host tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CopyKind {
    /// Device blocks (src) to host blocks (dst).
    DeviceToHost,
    /// Host blocks (src) to device blocks (dst).
    HostToDevice,
}

impl CopyKind {
    pub(super) fn op(self) -> Op {
        match self {
            CopyKind::DeviceToHost => Op::CopyDeviceToHost,
            CopyKind::HostToDevice => Op::CopyHostToDevice,
        }
    }
}

/// Names one direct copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DirectCopyId(pub u64);

/// How a direct copy ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DirectCopyOutcome {
    pub id: DirectCopyId,
    pub result: Result<(), RankFailure>,
    /// Times it was issued (a worker death adds one).
    pub issued: u32,
    /// Bytes copied by all ranks together (0 on failure).
    pub bytes: u64,
}

struct DirectCopy {
    kind: CopyKind,
    pairs: Vec<BlockPair>,
    issued: u32,
    /// Tries that live workers failed.
    failures: u32,
}

/// The direct copies not yet handed back.
#[derive(Default)]
pub(super) struct DirectCopies {
    next: u64,
    copies: HashMap<DirectCopyId, DirectCopy>,
    /// Copies to issue once every rank has a worker, oldest first.
    waiting: VecDeque<DirectCopyId>,
    finished: Vec<DirectCopyOutcome>,
}

impl<J: Job> Transport<J> {
    /// Copies `pairs` (`src`, `dst` per `kind`) on every rank (module flow). The copy waits
    /// while a rank has no worker, and survives worker deaths.
    pub fn submit_direct_copy(&mut self, kind: CopyKind, pairs: Vec<BlockPair>) -> DirectCopyId {
        let direct = &mut self.direct;
        direct.next += 1;
        let id = DirectCopyId(direct.next);
        if pairs.is_empty() {
            direct.finished.push(DirectCopyOutcome { id, result: Ok(()), issued: 0, bytes: 0 });
            return id;
        }
        direct.copies.insert(id, DirectCopy { kind, pairs, issued: 0, failures: 0 });
        direct.waiting.push_back(id);
        self.pump();
        id
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
        if self.direct.waiting.is_empty() || self.first_rank_not_up().is_some() {
            return;
        }
        while let Some(id) = self.direct.waiting.pop_front() {
            let Some(copy) = self.direct.copies.get_mut(&id) else { continue };
            copy.issued += 1;
            let (kind, pairs) = (copy.kind, std::mem::take(&mut copy.pairs));
            self.queue_pairs(Issuer::Direct(id), kind, &pairs);
            self.direct.copies.get_mut(&id).expect("found just above").pairs = pairs;
        }
    }

    /// Applies the outcome of direct copy `id` on every rank, which copied `bytes` (module flow,
    /// steps 2 to 4).
    pub(super) fn settle_direct(
        &mut self,
        id: DirectCopyId,
        outcome: Result<(), RankFailure>,
        bytes: u64,
    ) {
        let Some(copy) = self.direct.copies.get_mut(&id) else {
            warn!(?id, "an outcome for a direct copy that is not pending");
            return;
        };
        let retry = match outcome {
            Ok(()) => false,
            Err(failure)
                if matches!(
                    failure.error,
                    Some(CommandError::WorkerDied | CommandError::WorkerNotServing)
                ) =>
            {
                info!(
                    ?id,
                    rank = failure.rank,
                    %failure,
                    "a worker died under a direct copy, or never served it; it will be issued again"
                );
                true
            }
            Err(failure) => {
                self.stats.copy_failures += 1;
                copy.failures += 1;
                warn!(?id, %failure, tries = copy.failures, "a direct copy failed");
                copy.failures < MAX_ATTEMPTS
            }
        };
        if retry {
            self.direct.waiting.push_back(id);
            return;
        }
        let copy = self.direct.copies.remove(&id).expect("found just above");
        self.direct.finished.push(DirectCopyOutcome {
            id,
            result: outcome,
            issued: copy.issued,
            bytes,
        });
    }
}
