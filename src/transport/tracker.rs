//! Which commands of which job are outstanding on which rank.
//!
//! Every job (a transfer of the owner's, a direct copy) goes to every rank, possibly split into
//! several commands per rank; the tracker calls it a transfer and names it with any key. It owns
//! the bookkeeping that turns per-rank completions into one outcome per transfer:
//!
//! 1. [`CommandTracker::begin`] registers one command of a transfer on one rank (queued or
//!    already in the ring: either way it is outstanding).
//! 2. [`CommandTracker::complete`] takes one completion record of one rank; when the last outstanding
//!    command of a transfer completes, it returns the transfer's outcome: success when every command
//!    on every rank succeeded, else the first failure.
//! 3. [`CommandTracker::fail_rank`] fails every command outstanding on a rank whose worker died, and
//!    returns the outcomes of the transfers that this finished.
//!
//! An outcome is reported only once no rank can still touch the transfer's blocks: a failure on
//! rank 0 waits for rank 1's copy to end (or for rank 1 to be declared dead) before the scheduler
//! rolls the transfer back and reuses its blocks.
//!
//! Credits (how many commands may sit in a rank's rings) are the rank channel's business, not the
//! tracker's: a command is outstanding from the moment it is queued.

use std::collections::HashMap;
use std::hash::Hash;

use kvshm_ipc::record::{CommandError, Completion};

/// A transfer whose last command completed, with its outcome over all ranks.
pub type TransferOutcome<K> = (K, Result<(), RankFailure>);

/// Why a transfer failed: the first failure reported by any rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankFailure {
    pub rank: usize,
    pub command_id: u64,
    /// The decoded error, or `None` when the worker wrote an error code this build does not know.
    pub error: Option<CommandError>,
    pub detail: u64,
}

impl std::fmt::Display for RankFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.error {
            Some(error) => {
                write!(f, "command {} failed on rank {}: {error:?}", self.command_id, self.rank)?
            }
            None => write!(
                f,
                "command {} failed on rank {}: an unknown error",
                self.command_id, self.rank
            )?,
        }
        write!(f, " (detail {})", self.detail)
    }
}

impl std::error::Error for RankFailure {}

/// A completion that does not match anything the scheduler issued to that rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CompletionMismatch {
    #[error("rank {rank} completed command {command_id}, which is not in flight there")]
    UnknownCommand { rank: usize, command_id: u64 },
}

#[derive(Debug)]
struct TransferProgress {
    /// (rank, command id) of every command not yet completed.
    outstanding: Vec<(usize, u64)>,
    failure: Option<RankFailure>,
}

/// Outstanding commands per rank and per transfer, for transfers named `K`.
#[derive(Debug)]
pub struct CommandTracker<K> {
    /// Per rank: command id -> the transfer it serves.
    ranks: Vec<HashMap<u64, K>>,
    transfers: HashMap<K, TransferProgress>,
}

impl<K: Copy + Eq + Hash> CommandTracker<K> {
    pub fn new(ranks: usize) -> Self {
        Self { ranks: vec![HashMap::new(); ranks], transfers: HashMap::new() }
    }

    /// Commands outstanding on `rank`.
    pub fn outstanding_on(&self, rank: usize) -> usize {
        self.ranks[rank].len()
    }

    pub fn is_idle(&self) -> bool {
        self.transfers.is_empty()
    }

    /// Records that `command_id` of `rank` serves `transfer`.
    ///
    /// # Panics
    ///
    /// If the command id is already outstanding on that rank: ids only grow, so that is a
    /// programming error.
    pub fn begin(&mut self, transfer: K, rank: usize, command_id: u64) {
        let previous = self.ranks[rank].insert(command_id, transfer);
        assert!(previous.is_none(), "reusing a command id in flight is a programming error");
        self.transfers
            .entry(transfer)
            .or_insert(TransferProgress { outstanding: Vec::new(), failure: None })
            .outstanding
            .push((rank, command_id));
    }

    /// The (rank, command id) pairs of `transfer` not yet completed; none once it has ended.
    pub fn outstanding_commands(&self, transfer: K) -> impl Iterator<Item = (usize, u64)> + '_ {
        self.transfers
            .get(&transfer)
            .into_iter()
            .flat_map(|progress| progress.outstanding.iter().copied())
    }

    /// Whether a command of `transfer`, still in flight on some rank, already failed on another:
    /// its outcome will be that failure, whatever the other ranks still do.
    pub fn has_failed(&self, transfer: K) -> bool {
        self.transfers.get(&transfer).is_some_and(|progress| progress.failure.is_some())
    }

    /// Applies one completion read from `rank`'s completion ring.
    ///
    /// Returns the transfer's outcome when this was its last outstanding command.
    pub fn complete(
        &mut self,
        rank: usize,
        completion: &Completion,
    ) -> Result<Option<TransferOutcome<K>>, CompletionMismatch> {
        let failure = (!completion.is_ok()).then(|| RankFailure {
            rank,
            command_id: completion.command_id,
            error: CommandError::from_wire(completion.error),
            detail: completion.detail,
        });
        self.finish_command(rank, completion.command_id, failure)
    }

    /// Fails every command outstanding on `rank` (its worker died) and returns the outcomes of the
    /// transfers that this finished, in command order.
    pub fn fail_rank(&mut self, rank: usize) -> Vec<TransferOutcome<K>> {
        let mut command_ids: Vec<u64> = self.ranks[rank].keys().copied().collect();
        command_ids.sort_unstable();
        let mut finished = Vec::new();
        for command_id in command_ids {
            let failure =
                RankFailure { rank, command_id, error: Some(CommandError::WorkerDied), detail: 0 };
            let outcome = self
                .finish_command(rank, command_id, Some(failure))
                .expect("a command listed as outstanding is outstanding");
            finished.extend(outcome);
        }
        finished
    }

    fn finish_command(
        &mut self,
        rank: usize,
        command_id: u64,
        failure: Option<RankFailure>,
    ) -> Result<Option<TransferOutcome<K>>, CompletionMismatch> {
        let Some(commands) = self.ranks.get_mut(rank) else {
            return Err(CompletionMismatch::UnknownCommand { rank, command_id });
        };
        let transfer = commands
            .remove(&command_id)
            .ok_or(CompletionMismatch::UnknownCommand { rank, command_id })?;
        let progress = self
            .transfers
            .get_mut(&transfer)
            .expect("a command in flight belongs to a transfer in flight");
        progress.outstanding.retain(|&entry| entry != (rank, command_id));
        if progress.failure.is_none() {
            progress.failure = failure;
        }
        if !progress.outstanding.is_empty() {
            return Ok(None);
        }
        let progress = self.transfers.remove(&transfer).expect("present above");
        Ok(Some((transfer, progress.failure.map_or(Ok(()), Err))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(command_id: u64) -> Completion {
        Completion::failed(command_id, 0, CommandError::CopyFailed, 9)
    }

    #[test]
    fn a_transfer_succeeds_only_when_every_rank_has_completed_it() {
        let mut in_flight = CommandTracker::new(2);
        in_flight.begin(7, 0, 1);
        in_flight.begin(7, 1, 1);
        assert_eq!(in_flight.complete(1, &Completion::ok(1, 0)), Ok(None));
        assert_eq!(in_flight.complete(0, &Completion::ok(1, 0)), Ok(Some((7, Ok(())))));
        assert!(in_flight.is_idle());
    }

    #[test]
    fn a_failure_is_reported_after_the_other_ranks_finish_touching_the_blocks() {
        let mut in_flight = CommandTracker::new(2);
        in_flight.begin(3, 0, 10);
        in_flight.begin(3, 1, 10);
        assert_eq!(in_flight.complete(0, &failed(10)), Ok(None));
        let (transfer, outcome) = in_flight.complete(1, &Completion::ok(10, 0)).unwrap().unwrap();
        assert_eq!(transfer, 3);
        let failure = outcome.unwrap_err();
        assert_eq!(
            (failure.rank, failure.error, failure.detail),
            (0, Some(CommandError::CopyFailed), 9)
        );
    }

    #[test]
    fn a_transfer_split_into_several_commands_ends_with_its_last_command() {
        let mut in_flight = CommandTracker::new(1);
        in_flight.begin(1, 0, 1);
        in_flight.begin(1, 0, 2);
        assert_eq!(in_flight.outstanding_on(0), 2);
        assert_eq!(in_flight.outstanding_commands(1).collect::<Vec<_>>(), [(0, 1), (0, 2)]);
        assert_eq!(in_flight.complete(0, &Completion::ok(1, 0)), Ok(None));
        assert_eq!(in_flight.complete(0, &Completion::ok(2, 0)), Ok(Some((1, Ok(())))));
        assert_eq!(in_flight.outstanding_commands(1).count(), 0);
    }

    #[test]
    fn an_unknown_or_repeated_completion_is_a_typed_error_and_changes_nothing() {
        let mut in_flight = CommandTracker::new(1);
        in_flight.begin(1, 0, 5);
        let unknown = CompletionMismatch::UnknownCommand { rank: 0, command_id: 6 };
        assert_eq!(in_flight.complete(0, &Completion::ok(6, 0)), Err(unknown));
        assert_eq!(
            in_flight.complete(3, &Completion::ok(5, 0)),
            Err(CompletionMismatch::UnknownCommand { rank: 3, command_id: 5 })
        );
        assert_eq!(in_flight.outstanding_on(0), 1);
        assert_eq!(in_flight.complete(0, &Completion::ok(5, 0)), Ok(Some((1, Ok(())))));
        assert!(in_flight.complete(0, &Completion::ok(5, 0)).is_err());
    }

    #[test]
    fn a_dead_rank_fails_its_commands_and_finishes_transfers_the_others_completed() {
        let mut in_flight = CommandTracker::new(2);
        in_flight.begin(1, 0, 1);
        in_flight.begin(1, 1, 1);
        in_flight.begin(2, 0, 2);
        in_flight.begin(2, 1, 2);
        assert_eq!(in_flight.complete(0, &Completion::ok(1, 0)), Ok(None));
        let finished = in_flight.fail_rank(1);
        assert_eq!(finished.len(), 1, "transfer 2 still waits for rank 0");
        assert_eq!(finished[0].0, 1);
        assert_eq!(finished[0].1.unwrap_err().error, Some(CommandError::WorkerDied));
        assert_eq!(in_flight.outstanding_on(1), 0);
        let (transfer, outcome) = in_flight.complete(0, &Completion::ok(2, 0)).unwrap().unwrap();
        assert_eq!(transfer, 2);
        assert_eq!(outcome.unwrap_err().rank, 1);
    }
}
