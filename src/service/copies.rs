//! The manager's transfers handed to the transport, and their outcomes handed back.
//!
//! Each step of the service ([`Service::poll`], and the engine calls that queue copies):
//!
//! 1. `issue_transfers` sends the storage tier's QUERYs and FORGETs ([`super::storage_meta`]),
//!    takes the manager's transfers and queues each on the transport as one job
//!    ([`ServiceJob::Transfer`]): a block copy as copy commands, a STORE or LOAD as storage
//!    commands of at most as many blocks as one command's result bits hold; a transfer is failed
//!    at once while a rank has no worker, and an empty one succeeds at once. Then the transport
//!    pumps the commands into the rings;
//! 2. `apply_events` takes what the transport reports, in order, and decides by the job what it
//!    belongs to: a storage command's per-block results go into its transfer's `storage_landed`
//!    (a block missed on one rank missed) or its QUERY's or FORGET's record; an ended job goes to
//!    the manager (`settle`: the transition, or its rollback) or to the storage meta commands.

use kvshm_ipc::record::{CommandError, Op};
use kvshm_ipc::storage_record::{StorageEntry, StorageResults};
use tracing::warn;

use super::{Service, ServiceJob};
use crate::manager::{BlockOutcome, Transfer, TransferFailure, TransferId, TransferKind};
use crate::transport::{CopyKind, Event, RankFailure};

impl Service {
    /// Step 1 of the module flow.
    pub(super) fn issue_transfers(&mut self) {
        self.issue_storage_meta();
        let mut transfers = std::mem::take(&mut self.transfer_scratch);
        self.manager.take_transfers_into(&mut transfers);
        for transfer in transfers.drain(..) {
            self.issue(transfer);
        }
        self.transfer_scratch = transfers;
        self.transport.pump();
        // A rank whose command ring broke while pumping was dropped: its copies failed.
        self.apply_events();
    }

    fn issue(&mut self, transfer: Transfer) {
        if let Some(rank) = self.transport.first_rank_down() {
            let failure = TransferFailure { rank, error: CommandError::WorkerDied, detail: 0 };
            self.settle(transfer.id, Err(failure));
            return;
        }
        if transfer.pairs.is_empty() {
            self.settle(transfer.id, Ok(()));
            return;
        }
        let job = ServiceJob::Transfer(transfer.id);
        let op = match transfer.kind {
            TransferKind::DeviceToHost => {
                return self.transport.queue_copy(job, CopyKind::DeviceToHost, &transfer.pairs)
            }
            TransferKind::HostToDevice => {
                return self.transport.queue_copy(job, CopyKind::HostToDevice, &transfer.pairs)
            }
            TransferKind::HostToStorage => Op::StorageStore,
            TransferKind::StorageToHost => Op::StorageLoad,
        };
        let entries: Vec<StorageEntry> = transfer
            .pairs
            .iter()
            .zip(&transfer.blocks)
            .map(|(pair, block)| {
                StorageEntry::new(block.hash.0, block.parent.0, block.depth, pair.src)
            })
            .collect();
        self.storage_landed.insert(transfer.id, vec![BlockOutcome::Landed; entries.len()]);
        self.transport.queue_storage(job, op, &entries, None);
    }

    /// Step 2 of the module flow: every event the transport reported, in order.
    pub(super) fn apply_events(&mut self) {
        let mut events = std::mem::take(&mut self.event_scratch);
        self.transport.take_events(&mut events);
        for event in events.drain(..) {
            match event {
                Event::StorageAnswered {
                    job: ServiceJob::Transfer(id),
                    first,
                    entries,
                    results,
                    unreachable,
                } => {
                    self.record_storage_results(id, first, entries, results, unreachable);
                }
                // A QUERY's or FORGET's failed entries are failed whatever the cause.
                Event::StorageAnswered {
                    job: ServiceJob::Meta(id),
                    first,
                    entries,
                    results,
                    ..
                } => {
                    let given_up = self.meta.note_answer(id, first, entries, results);
                    self.stats.storage_forgets_dropped += given_up as u64;
                }
                Event::Ended { job: ServiceJob::Transfer(id), outcome } => {
                    self.settle(id, outcome.map_err(failure_of));
                }
                Event::Ended { job: ServiceJob::Meta(id), outcome } => {
                    self.settle_meta(id, outcome.map_err(failure_of));
                }
            }
        }
        self.event_scratch = events;
    }

    /// Applies the result bits of one rank's storage command to its transfer's blocks: a block
    /// the rank did not report done missed (per block, not a failure of the command): it is
    /// missing; or, when the rank says its tier failed for it, unreachable if the rank could not
    /// reach the tier (`unreachable`), else unavailable. Over the ranks, unreachable wins, then
    /// missing: a rank that could not reach the tier must trip the breaker whatever another
    /// found (a block kept so and missing is dropped at its next LOAD).
    fn record_storage_results(
        &mut self,
        transfer: TransferId,
        first: usize,
        entries: usize,
        results: StorageResults,
        unreachable: bool,
    ) {
        let Some(landed) = self.storage_landed.get_mut(&transfer) else { return };
        for (entry, outcome) in landed.iter_mut().skip(first).take(entries).enumerate() {
            if results.is_done(entry) {
                continue;
            }
            self.stats.storage_misses += 1;
            *outcome = match (*outcome, results.is_failed(entry), unreachable) {
                (BlockOutcome::Unreachable, ..) | (_, true, true) => BlockOutcome::Unreachable,
                (BlockOutcome::Missing, ..) | (_, false, _) => BlockOutcome::Missing,
                (_, true, false) => BlockOutcome::Unavailable,
            };
        }
    }

    /// Hands a transfer's outcome to the manager.
    fn settle(&mut self, transfer: TransferId, outcome: Result<(), TransferFailure>) {
        if let Err(failure) = &outcome {
            self.stats.copy_failures += 1;
            warn!(transfer = transfer.0, %failure, "copy failed; rolling back");
        }
        let completed = match self.storage_landed.remove(&transfer) {
            Some(landed) => {
                // A rank that could not reach the tier is heard even when another rank's command
                // failed whole (a dead worker, a lost answer), which settles the copy as failed.
                if outcome.is_err() && landed.contains(&BlockOutcome::Unreachable) {
                    self.manager.storage_tier_failed();
                }
                self.manager
                    .complete_storage_transfer(transfer, outcome.map(|()| Some(landed.as_slice())))
            }
            None => self.manager.complete_transfer(transfer, outcome),
        };
        if let Err(error) = completed {
            warn!(transfer = transfer.0, %error, "the cache manager refused a completion");
        }
    }
}

/// A transport's failure as the manager takes it.
pub(super) fn failure_of(failure: RankFailure) -> TransferFailure {
    TransferFailure {
        rank: failure.rank as u32,
        // A code this build does not know is still a failed copy.
        error: failure.error.unwrap_or(CommandError::CopyFailed),
        detail: failure.detail,
    }
}
