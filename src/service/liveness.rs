//! Watching the workers: noticing a rank's worker attach, leave or die, and taking a lost rank
//! back so that a new worker can serve it.
//!
//! [`Service::poll`] calls `check_workers` at most every [`LIVENESS_INTERVAL`]. For each rank it
//! reads the worker slot's verdict (pid, start time, heartbeat) and:
//!
//! 1. a live worker on a down rank (or a new pid on an up one) brings the rank up;
//! 2. a dead worker whose process still runs (it stopped heartbeating: stopped or starved, and
//!    maybe in the middle of a copy) is killed first (`fence_worker`); its rank is lost on a later
//!    check, once the process is gone, so that no copy of it can touch blocks the rollback hands
//!    out again. The live worker of a rank whose command or completion ring is corrupt cannot be
//!    heard any more and is fenced the same way (`drop_broken_rank`);
//! 3. a dead worker, or an empty slot on an up rank (the worker left), loses the rank
//!    (`lose_worker`): the completions the worker pushed are applied, the segment reclaims the
//!    rank (resetting its rings), the commands still outstanding there fail with `WorkerDied`,
//!    and the rank is down until a worker attaches again.

use std::time::{Duration, Instant};

use kvshm_ipc::ring::RingError;
use kvshm_ipc::worker_slot::{RankStatus, WorkerState};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tracing::{info, warn};

use super::{failure_of, RankState, Service};
use crate::manager::TransferId;

/// How often `poll` checks that the workers are alive (SPEC: a death is noticed within 100 ms).
const LIVENESS_INTERVAL: Duration = Duration::from_millis(5);

impl Service {
    /// Brings ranks up and loses them as their workers attach, leave and die (module flow).
    pub(super) fn check_workers(&mut self) {
        let now = Instant::now();
        if self.liveness_checked_at.is_some_and(|at| now - at < LIVENESS_INTERVAL) {
            return;
        }
        self.liveness_checked_at = Some(now);
        for index in 0..self.ranks.len() {
            let rank = index as u32;
            let status = self.segment.rank_status(rank).expect("a rank of the segment has a slot");
            match (status, self.ranks[index].state()) {
                (RankStatus::Alive { pid }, RankState::Down) => {
                    match self.ranks[index].set_up(&self.segment, pid) {
                        Ok(()) => info!(rank, pid, "worker attached"),
                        Err(error) => {
                            warn!(rank, pid, %error, "rank stays down: its rings are bad")
                        }
                    }
                }
                (RankStatus::Alive { pid }, RankState::Up { pid: known }) if pid != known => {
                    info!(rank, pid, "a new worker holds the rank");
                    self.ranks[index]
                        .set_up(&self.segment, pid)
                        .expect("an up rank with stale ring ends is a programming error");
                }
                (RankStatus::Dead { pid }, _) if self.fence_worker(rank) => {
                    self.lose_worker(index, Some(pid));
                }
                (RankStatus::Empty, RankState::Up { pid }) => {
                    info!(rank, pid, "worker detached");
                    self.lose_worker(index, None);
                }
                _ => {}
            }
        }
    }

    /// The worker of rank `index` died or left: apply the completions it pushed, reclaim the rank
    /// so a new worker can attach, fail what it had in flight, and start the rank over as down.
    ///
    /// The reclaim comes first: while it is refused (the worker is alive after all) that worker may
    /// still execute the commands in its ring, so they stay in flight; failing them would roll
    /// their transfers back and hand their blocks out again under a running copy.
    pub(super) fn lose_worker(&mut self, index: usize, pid: Option<u32>) {
        let rank = index as u32;
        // What the worker answered before it went is final: apply it before the reclaim empties
        // the ring. A corrupt ring yields nothing; its commands fail below.
        if self.ranks[index].is_up() {
            let _ = self.reap_rank(index);
        }
        if let Err(error) = self.segment.reclaim_rank(rank) {
            warn!(rank, %error, "could not reclaim the rank yet; its copies stay in flight");
            return;
        }
        let outcomes = self.tracker.fail_rank(index);
        if pid.is_some() || !outcomes.is_empty() {
            self.stats.worker_deaths += 1;
            warn!(rank, ?pid, failed_transfers = outcomes.len(), "worker lost; failing its copies");
        }
        for (transfer, outcome) in outcomes {
            self.settle(TransferId(transfer), outcome.map_err(failure_of));
        }
        if let Err(error) = self.ranks[index].reset_after_reclaim(&self.segment) {
            warn!(rank, %error, "rank reclaimed, but its rings are bad; it stays down");
        }
    }

    /// A ring of rank `index` is corrupt: its worker can no longer be heard, or told which
    /// command slots are free. The worker is stopped, then the rank taken back (module flow).
    pub(super) fn drop_broken_rank(&mut self, index: usize, ring: &'static str, error: RingError) {
        warn!(rank = index, ring, %error, "ring is corrupt; dropping the rank");
        if self.fence_worker(index as u32) {
            self.lose_worker(index, None);
        }
    }

    /// Step 2 of the module flow: whether the process of `rank`'s worker is gone; if it still
    /// runs, it is sent SIGKILL and this says no (a later poll sees it gone).
    ///
    /// The identity (pid and start time) comes from the slot, so a recycled pid is not killed; a
    /// pid that is no valid process id, or this very process (a test playing the worker), is left
    /// alone and counts as gone.
    fn fence_worker(&self, rank: u32) -> bool {
        let view = self.segment.worker_slot(rank).expect("a rank of the segment has a slot").view();
        let worker = view.worker;
        let Some(pid) = i32::try_from(worker.pid).ok().filter(|&pid| pid > 0) else {
            return true;
        };
        if view.state != WorkerState::Attached
            || worker.pid == std::process::id()
            || !worker.is_alive()
        {
            return true;
        }
        warn!(rank, pid, "worker stopped heartbeating but still runs; killing it first");
        if let Err(error) = kill(Pid::from_raw(pid), Signal::SIGKILL) {
            warn!(rank, pid, %error, "could not kill the worker; its copies stay in flight");
        }
        false
    }
}
