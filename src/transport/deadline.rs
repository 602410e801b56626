//! The command deadline: a rank that owes answers and gives none for too long is treated like a
//! crashed one (its worker is fenced and its commands fail), so that no transfer stays in flight
//! forever.
//!
//! Core type: [`AnswerClocks`], per rank the moment since which the transport has been waiting
//! for an answer. A rank *owes answers* while a command of it has left the backlog for the command
//! ring and has not completed. Per [`Transport::poll`]:
//!
//! 1. reaping: every completion that matches an outstanding command restarts its rank's clock;
//! 2. `check_command_deadlines`: the clock of an up rank that owes nothing restarts; a rank that
//!    owes answers and whose clock is older than the configured `command_deadline`
//!    ([`TransportConfig`]) is dropped like a crashed one through the transport's stopping path
//!    (`stop_worker`): its worker is fenced and, once its process is gone, the rank is lost
//!    (`lose_worker`): its commands fail with `WorkerDied`, the rank is reclaimed and a new
//!    worker may attach;
//! 3. issuing: a rank that owed nothing restarts its clock as commands enter its ring.
//!
//! A rank whose worker still sets up (`Starting`) is sent nothing: its commands wait in the
//! backlog, and the deadline bounds that wait too. Once commands have waited there for
//! `command_deadline` they fail, unsent, with `WorkerNotServing`, and the worker is left to
//! finish setting up (a large tier may take longer than that to map in): a worker stuck in its
//! set-up, heartbeating all along, costs each copy queued for it one deadline. Two waits stay
//! unbounded, by design: commands a predecessor that exited cleanly left in the ring wait for
//! its successor (they cannot fail while a worker may still run them), and direct copies, which
//! vLLM takes failed for fatal, wait for every rank to serve before they are queued (`direct`).
//!
//! What trips it: an answer that never comes while the worker lives and heartbeats. A command or
//! completion id corrupted in a ring is one case (the completion matches nothing, the worker goes
//! idle, the command stays outstanding; had the worker answered a later command of the lane, the
//! lost one would have failed then, `rank::Answered`); a worker stuck in a loop that heartbeats is
//! another. A worker that stops or dies is caught earlier, by its heartbeat and its pid.
//!
//! Why a healthy worker never trips it. A worker runs its rank's commands one at a time in ring
//! order and publishes each completion as soon as the command ends, so while a rank owes answers
//! the time between two answers is at most the time of one command. The transport splits copies
//! into commands of at most `max_command_bytes` per rank ([`TransportConfig`], 64 MiB by
//! default), so one command takes at most that many bytes at the worker's bandwidth: 6.7 s at a
//! crawling 10 MB/s, 7 ms at 10 GB/s; the default deadline (10 s) is above the first. The clock
//! measures from answers the transport has *reaped*, not from when the worker pushed them, and
//! reaping comes before the check in every poll, so an engine that did not poll for a while finds the answers
//! that piled up meanwhile before it judges anyone: only the worker's silence counts, never the
//! scheduler's.

use std::time::{Duration, Instant};

use tracing::warn;

#[cfg(doc)]
use super::TransportConfig;
use kvshm_ipc::record::{CommandError, Completion};

use super::rank::RankState;
use super::{Job, Transport};

/// How long a rank may owe answers without giving any, unless configured otherwise.
pub const DEFAULT_COMMAND_DEADLINE: Duration = Duration::from_secs(10);

/// Per rank: since when the transport waits for an answer, and since when commands wait for a
/// worker that sets up (module documentation).
#[derive(Debug)]
pub(super) struct AnswerClocks {
    since: Vec<Instant>,
    /// `None` while no command waits for the rank's worker to set up.
    setting_up_since: Vec<Option<Instant>>,
}

impl AnswerClocks {
    pub(super) fn new(ranks: usize) -> AnswerClocks {
        AnswerClocks { since: vec![Instant::now(); ranks], setting_up_since: vec![None; ranks] }
    }

    /// Rank `index` answered a command, or owes nothing: the wait starts over.
    pub(super) fn restart(&mut self, index: usize, now: Instant) {
        self.since[index] = now;
    }

    /// How long rank `index` has gone without answering, as of `now`.
    pub(super) fn waited(&self, index: usize, now: Instant) -> Duration {
        now.saturating_duration_since(self.since[index])
    }
}

impl<J: Job> Transport<J> {
    /// Whether rank `index` owes answers: a command of it left the backlog and has not completed.
    pub(crate) fn owes_answers(&self, index: usize) -> bool {
        self.tracker.outstanding_on(index) > self.ranks[index].backlog_len()
    }

    /// Step 2 of the module flow.
    pub(super) fn check_command_deadlines(&mut self) {
        let now = Instant::now();
        for index in 0..self.ranks.len() {
            self.check_setting_up(index, now);
            if !self.ranks[index].is_up() || !self.owes_answers(index) {
                self.answer_clocks.restart(index, now);
                continue;
            }
            let waited = self.answer_clocks.waited(index, now);
            if waited > self.command_deadline {
                self.drop_silent_rank(index, waited, now);
            }
        }
    }

    /// The wait of rank `index`'s backlog for a worker that sets up (module documentation):
    /// past the deadline, the backlog fails unsent.
    fn check_setting_up(&mut self, index: usize, now: Instant) {
        let rank = &self.ranks[index];
        let waiting = matches!(rank.state(), RankState::Starting { .. }) && rank.backlog_len() > 0;
        let clock = &mut self.answer_clocks.setting_up_since[index];
        if !waiting {
            *clock = None;
            return;
        }
        let waited = now.saturating_duration_since(*clock.get_or_insert(now));
        if waited <= self.command_deadline {
            return;
        }
        *clock = None;
        let unsent = self.ranks[index].drop_backlog();
        warn!(
            rank = index,
            ?waited,
            commands = unsent.len(),
            "the rank's worker is still setting up past the command deadline; failing its backlog"
        );
        self.stats.setup_waits_failed += 1;
        let generation = self.segment.generation();
        for command_id in unsent {
            let failed =
                Completion::failed(command_id, generation, CommandError::WorkerNotServing, 0);
            self.apply_answer(index, &failed);
        }
    }

    /// Rank `index` owes answers and has given none for `waited`: fence its worker like a crashed
    /// one. Its commands fail once its process is gone (this poll or a later one).
    fn drop_silent_rank(&mut self, index: usize, waited: Duration, now: Instant) {
        warn!(
            rank = index,
            ?waited,
            outstanding = self.tracker.outstanding_on(index),
            "no answer from the rank past the command deadline; fencing its worker"
        );
        self.stats.command_deadlines_missed += 1;
        // Give the fence a whole deadline before warning again.
        self.answer_clocks.restart(index, now);
        self.stop_worker(index);
    }
}
