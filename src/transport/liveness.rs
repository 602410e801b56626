//! Watching the workers: noticing a rank's worker attach, leave or die, fencing one that must
//! stop, and taking a lost rank back so that a new worker can serve it.
//!
//! Each rank has a [`kvshm_ipc::worker_watch::WorkerWatch`]: the worker the transport saw
//! attach (its owner word, pid, start time and a pidfd opened then). Nothing the worker slot
//! says is acted on alone: the slot is memory any process of the user can write.
//! [`Transport::poll`] calls `check_workers` at most every [`LIVENESS_INTERVAL`]; for each rank
//! the watch observes the slot and:
//!
//! 1. a worker seen attaching (verified: it runs, started when its claim says, and maps the
//!    segment) makes the rank Starting while it sets up (its copies wait in the backlog, at most
//!    the command deadline: `deadline`) and Up once it marked itself serving, or takes the rank
//!    over from a predecessor that exited cleanly the same way;
//! 2. a recorded worker that still runs but must stop (stale heartbeat: stopped or stuck; its
//!    slot written over; it let go of the slot and did not exit) is killed first through its
//!    pidfd (`fence_worker`), and nothing of it fails until it is gone, so that no copy of it can
//!    touch blocks the rollback hands out again. The live worker of a rank whose command or
//!    completion ring is corrupt cannot be heard any more and is stopped the same way
//!    (`stop_worker`);
//! 3. a rank whose recorded worker is gone (or whose slot names no worker of ours) is lost
//!    (`lose_worker`): the completions the worker pushed are applied, the segment reclaims the
//!    rank from exactly the owner word judged (resetting its rings), the commands still
//!    outstanding there fail with `WorkerDied`, and the rank is down until a worker attaches.

use std::time::{Duration, Instant};

use kvshm_ipc::liveness::monotonic_ns;
use kvshm_ipc::ring::RingError;
use kvshm_ipc::worker_watch::{FenceOutcome, FenceReason, LostRank, Observation};
use tracing::{info, warn};

use super::{Job, RankState, Transport};

/// How often `poll` checks that the workers are alive (a death is noticed within 100 ms:
/// DESIGN §7.2).
const LIVENESS_INTERVAL: Duration = Duration::from_millis(5);

impl<J: Job> Transport<J> {
    /// Brings ranks up and loses them as their workers attach, leave and die (module flow).
    pub(super) fn check_workers(&mut self) {
        let now = Instant::now();
        if self.liveness_checked_at.is_some_and(|at| now - at < LIVENESS_INTERVAL) {
            return;
        }
        self.liveness_checked_at = Some(now);
        for index in 0..self.ranks.len() {
            self.check_worker(index);
        }
    }

    /// One rank's step of the module flow.
    fn check_worker(&mut self, index: usize) {
        let mut observation = self.observe_worker(index);
        if let Observation::MustFence { pid, reason } = observation {
            if reason != FenceReason::AlreadyFenced {
                warn!(rank = index, pid, %reason, "killing the worker before its rank is taken back");
            }
            if self.fence_worker(index as u32) {
                observation = self.observe_worker(index);
            }
        }
        let state = match observation {
            Observation::Alive { pid, .. } => RankState::Up { pid },
            Observation::Starting { pid } => RankState::Starting { pid },
            Observation::Lost(lost) => return self.lose_worker(index, lost),
            _ => return,
        };
        let known = self.ranks[index].state();
        if state == known {
            return;
        }
        match self.ranks[index].set_worker(&self.segment, state) {
            Ok(()) => info!(rank = index, ?state, was = ?known, "worker state changed"),
            Err(error) => warn!(rank = index, %error, "rank stays down: its rings are bad"),
        }
    }

    pub(crate) fn observe_worker(&mut self, index: usize) -> Observation {
        let slot =
            self.segment.worker_slot(index as u32).expect("a rank of the segment has a slot");
        self.watches[index].observe(slot, monotonic_ns())
    }

    /// The worker of rank `index` died or left (step 3 of the module flow): apply the completions
    /// it pushed, reclaim the rank from exactly the owner word judged so a new worker can attach,
    /// fail what it had in flight, and start the rank over as down.
    ///
    /// The reclaim comes first: if the slot changed since it was judged (a worker claimed it
    /// meanwhile), the rank is judged again on the next check and nothing fails now.
    pub(crate) fn lose_worker(&mut self, index: usize, lost: LostRank) {
        let rank = index as u32;
        // What the worker answered before it went is final: apply it before the reclaim empties
        // the ring. A corrupt ring yields nothing; its commands fail below.
        if !self.ranks[index].is_down() {
            let _ = self.reap_rank(index);
        }
        if let Err(error) = self.segment.reclaim_rank(rank, lost.word()) {
            warn!(rank, %error, "could not reclaim the rank yet; its copies stay in flight");
            return;
        }
        self.watches[index].forget();
        let outcomes = self.tracker.fail_rank(index);
        self.storage_commands.retain(|&(rank, _), _| rank != index);
        if lost.worker().is_some() || !outcomes.is_empty() {
            self.stats.worker_deaths += 1;
            warn!(
                rank,
                pid = ?lost.worker(),
                failed_transfers = outcomes.len(),
                "worker lost; failing its copies"
            );
        }
        for (issuer, outcome) in outcomes {
            self.settle(issuer, outcome);
        }
        if let Err(error) = self.ranks[index].reset_after_reclaim(&self.segment) {
            warn!(rank, %error, "rank reclaimed, but its rings are bad; it stays down");
        }
    }

    /// A ring of rank `index` is corrupt: its worker can no longer be heard, or told which
    /// command slots are free. The worker is stopped, then the rank taken back.
    pub(super) fn drop_broken_rank(&mut self, index: usize, ring: &'static str, error: RingError) {
        warn!(rank = index, ring, %error, "ring is corrupt; dropping the rank");
        self.stop_worker(index);
    }

    /// Stops the recorded worker of rank `index` and, once it is gone, loses the rank: at once
    /// if it already is, else on the check that sees it gone. The path for any verdict that a
    /// worker must stop while its process may run (a corrupt ring, a command past its deadline).
    pub(super) fn stop_worker(&mut self, index: usize) {
        if self.fence_worker(index as u32) {
            if let Observation::Lost(lost) = self.observe_worker(index) {
                self.lose_worker(index, lost);
            }
        }
    }

    /// Step 2 of the module flow: whether the recorded worker of `rank` is gone; if it still
    /// runs, it is sent SIGKILL through the pidfd taken when it attached, and this says no.
    ///
    /// Only the process the transport saw attach is ever signalled, never a pid the slot names
    /// now; this very process (a test playing the worker) is left alone and counts as gone.
    pub(super) fn fence_worker(&mut self, rank: u32) -> bool {
        match self.watches[rank as usize].fence() {
            FenceOutcome::Gone => true,
            FenceOutcome::Signalled { .. } => false,
            FenceOutcome::Failed { pid, errno } => {
                warn!(rank, pid, %errno, "could not kill the worker; its copies stay in flight");
                false
            }
        }
    }
}
