//! The service's half of the storage tier's circuit breaker: the back-off and the probe that
//! bring a tier that is down back up (the manager's half, which holds no clock, is
//! `manager::tier_health`).
//!
//! Core types: [`TierBackoff`] (the configured waits), `TierWatch` (the outage under way).
//!
//! 1. After each step's completions, [`Service::watch_storage_tier`] sees the manager mark the
//!    tier down: the outage begins (logged once), and the first probe waits `backoff.first`, or
//!    twice the last outage's wait when the tier went down again less than `backoff.max` after
//!    it came back (a flapping tier is probed less and less often), at most `backoff.max`.
//! 2. While it is down no request waits on it (the manager routes nothing to it), and the
//!    service holds back its FORGETs (`storage_meta`).
//! 3. Once the wait is over, and every rank has a worker, a probe goes out of band: a QUERY of
//!    one block to every rank, through the same storage commands as a prefetch's. A QUERY
//!    tells "absent" (done and failed bits clear) from "the tier failed" (failed bit set), so
//!    the answer, not the block, is what counts. The probe queues behind the storage commands
//!    issued before it on each rank, so those have completed by the time it answers.
//! 4. A probe that every rank answered without a failed bit brings the tier back up (logged
//!    once, with the outage's length and probes); any other outcome (a failed bit, a failed
//!    command, a rank lost) doubles the wait, up to `backoff.max`, and step 3 comes again, but
//!    for a probe that reached no tier (refused as of an older generation after a reset, or
//!    never sent to a worker still setting up): the next goes out on the next poll.

use std::time::{Duration, Instant};

use kvshm_ipc::liveness::monotonic_ns;
use kvshm_ipc::record::Op;
use kvshm_ipc::storage_record::{StorageEntry, NO_HOST_BLOCK};
use tracing::{debug, info, warn};

use super::storage_meta::MetaId;
use super::{Service, ServiceJob};

/// How long the service waits before probing a storage tier that is down: `first` for the first
/// probe of an outage, doubling after each probe that fails, never more than `max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierBackoff {
    pub first: Duration,
    pub max: Duration,
}

/// One second, doubling up to thirty.
pub const DEFAULT_TIER_BACKOFF: TierBackoff =
    TierBackoff { first: Duration::from_secs(1), max: Duration::from_secs(30) };

impl Default for TierBackoff {
    fn default() -> Self {
        DEFAULT_TIER_BACKOFF
    }
}

/// Why a back-off was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TierBackoffError {
    #[error("the storage back-off must be at least 1 ms (got {0:?})")]
    TooShort(Duration),
    #[error("the storage back-off's maximum {max:?} is below its first wait {first:?}")]
    MaxBelowFirst { first: Duration, max: Duration },
    #[error("the storage back-off's maximum {0:?} is more than a day")]
    TooLong(Duration),
}

impl TierBackoff {
    /// The wait before the first probe of an outage (module flow, step 1): `first`, or twice
    /// `last_wait` (the previous outage's last wait) when the tier came back less than `max`
    /// ago (`up_for`; `None` for a first outage).
    pub fn first_wait(&self, last_wait: Duration, up_for: Option<Duration>) -> Duration {
        match up_for {
            Some(up_for) if up_for < self.max => self.doubled(last_wait),
            _ => self.first,
        }
    }

    /// The wait after a probe that failed (module flow, step 4): twice `wait`, within
    /// `first..=max`.
    pub fn doubled(&self, wait: Duration) -> Duration {
        wait.saturating_mul(2).clamp(self.first, self.max)
    }

    pub fn validate(&self) -> Result<(), TierBackoffError> {
        if self.first < Duration::from_millis(1) {
            return Err(TierBackoffError::TooShort(self.first));
        }
        if self.max < self.first {
            return Err(TierBackoffError::MaxBelowFirst { first: self.first, max: self.max });
        }
        if self.max > Duration::from_secs(24 * 3600) {
            return Err(TierBackoffError::TooLong(self.max));
        }
        Ok(())
    }
}

/// The storage tier's outage under way, as the service sees it (module flow).
#[derive(Debug, Default)]
pub(super) struct TierWatch {
    /// When the current outage began (`None` while the tier is up), and the same moment in
    /// `CLOCK_MONOTONIC` ns for kvctl.
    down_since: Option<Instant>,
    down_since_ns: u64,
    /// When the last outage ended.
    up_since: Option<Instant>,
    /// The wait before the next probe (the last outage's while up).
    wait: Duration,
    /// When the next probe may go.
    next_probe: Option<Instant>,
    /// The probe in flight.
    probe: Option<MetaId>,
    /// Probes of the current outage.
    probes_this_outage: u64,
}

impl TierWatch {
    /// `CLOCK_MONOTONIC` ns when the current outage began; 0 while the tier is up.
    pub(super) fn down_since_ns(&self) -> u64 {
        if self.down_since.is_some() {
            self.down_since_ns
        } else {
            0
        }
    }

    /// Whether `id` is the probe in flight.
    pub(super) fn is_probe(&self, id: MetaId) -> bool {
        self.probe == Some(id)
    }
}

impl Service {
    /// Steps 1 and 3 of the module flow; called on every poll, after the completions.
    pub(super) fn watch_storage_tier(&mut self) {
        let down = self.manager.storage_tier_down();
        if !down {
            if self.tier_watch.down_since.is_some() {
                // Brought up by someone else (the manager's owner may): the outage is over.
                self.tier_watch.down_since = None;
                self.tier_watch.next_probe = None;
                self.tier_watch.up_since = Some(Instant::now());
            }
            return;
        }
        let now = Instant::now();
        let backoff = self.tier_backoff;
        let watch = &mut self.tier_watch;
        if watch.down_since.is_none() {
            let up_for = watch.up_since.map(|up| now.duration_since(up));
            watch.wait = backoff.first_wait(watch.wait, up_for);
            watch.down_since = Some(now);
            watch.down_since_ns = monotonic_ns();
            watch.next_probe = Some(now + watch.wait);
            watch.probes_this_outage = 0;
            warn!(
                first_probe_in = ?watch.wait,
                "storage tier down: no storage hits, write-backs or prefetches until a probe \
                 reaches it on every rank"
            );
            return;
        }
        if watch.probe.is_some() || watch.next_probe.is_some_and(|at| now < at) {
            return;
        }
        if self.transport.first_rank_down().is_some() {
            // A probe must reach every rank's tier: wait for the worker to come back.
            self.tier_watch.next_probe = Some(now + self.tier_watch.wait);
            return;
        }
        let id = self.meta.new_probe();
        let probe = [StorageEntry::new(0, 0, 0, NO_HOST_BLOCK)];
        self.transport.queue_storage(ServiceJob::Meta(id), Op::StorageQuery, &probe, None);
        self.tier_watch.probe = Some(id);
        self.tier_watch.probes_this_outage += 1;
        self.stats.storage_tier_probes += 1;
        debug!(probe = ?id, "probing the storage tier");
    }

    /// Probe `id` reached no tier: its command was refused as of an older generation (a reset
    /// since it was queued) or never sent to a worker still setting up, and no rank said its tier
    /// failed. Nothing was learnt of the tier: the next probe goes out on the next step, no
    /// failure counted and the wait not doubled.
    pub(super) fn probe_unanswered(&mut self, id: MetaId) {
        if self.tier_watch.is_probe(id) {
            self.tier_watch.probe = None;
            self.tier_watch.next_probe = None;
        }
    }

    /// Step 4 of the module flow: probe `id` answered on every rank; `reached` when none said
    /// its tier failed.
    pub(super) fn probe_answered(&mut self, id: MetaId, reached: bool) {
        if !self.tier_watch.is_probe(id) {
            return;
        }
        let now = Instant::now();
        let watch = &mut self.tier_watch;
        watch.probe = None;
        if reached {
            self.manager.storage_tier_recovered();
            let down_for = watch.down_since.map(|since| now.duration_since(since));
            info!(?down_for, probes = watch.probes_this_outage, "storage tier up again");
            watch.down_since = None;
            watch.next_probe = None;
            watch.up_since = Some(now);
            return;
        }
        self.stats.storage_tier_probes_failed += 1;
        watch.wait = self.tier_backoff.doubled(watch.wait);
        watch.next_probe = Some(now + watch.wait);
        debug!(next_probe_in = ?watch.wait, "the storage tier probe failed; still down");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn failed_probes_double_the_wait_up_to_the_maximum() {
        let backoff = DEFAULT_TIER_BACKOFF;
        let mut wait = backoff.first_wait(Duration::ZERO, None);
        let mut waits = vec![wait];
        for _ in 0..7 {
            wait = backoff.doubled(wait);
            waits.push(wait);
        }
        let seconds: Vec<u64> = waits.iter().map(Duration::as_secs).collect();
        assert_eq!(seconds, [1, 2, 4, 8, 16, 30, 30, 30]);
    }

    #[test]
    fn a_tier_that_fails_again_soon_after_it_came_back_is_probed_later() {
        let backoff = TierBackoff { first: SECOND, max: 30 * SECOND };
        assert_eq!(backoff.first_wait(4 * SECOND, None), SECOND, "a first outage");
        assert_eq!(backoff.first_wait(4 * SECOND, Some(10 * SECOND)), 8 * SECOND, "flapping");
        assert_eq!(backoff.first_wait(20 * SECOND, Some(SECOND)), 30 * SECOND, "at most max");
        assert_eq!(backoff.first_wait(4 * SECOND, Some(31 * SECOND)), SECOND, "up long enough");
    }

    #[test]
    fn a_back_off_of_no_time_or_upside_down_is_refused() {
        assert!(DEFAULT_TIER_BACKOFF.validate().is_ok());
        let backoff = |first, max| TierBackoff { first, max };
        assert!(matches!(
            backoff(Duration::ZERO, SECOND).validate(),
            Err(TierBackoffError::TooShort(_))
        ));
        assert!(matches!(
            backoff(2 * SECOND, SECOND).validate(),
            Err(TierBackoffError::MaxBelowFirst { .. })
        ));
        assert!(matches!(
            backoff(SECOND, Duration::MAX).validate(),
            Err(TierBackoffError::TooLong(_))
        ));
    }
}
