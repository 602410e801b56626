//! One worker slot per rank: who serves the rank, and whether it still lives.
//!
//! [`WorkerSlot`] lies in the control segment, one cache line per rank. Its `owner` word packs
//! `(state << 32) | pid`, so that claiming a rank and naming the claimant is one CAS and no reader
//! ever sees a state without its pid. States: [`WorkerState::Empty`], [`WorkerState::Attached`],
//! [`WorkerState::Dead`] (being reclaimed, or left behind by a worker; a claim refuses it).
//!
//! Worker side (`Segment::claim_rank`, [`RankClaim`](crate::segment::RankClaim)):
//! 1. CAS `owner` from EMPTY to `ATTACHED | pid` (refused while another worker holds the rank, and
//!    while a dead one has not been reclaimed by the scheduler);
//! 2. store its start time and a first heartbeat; then heartbeat every [`HEARTBEAT_INTERVAL`];
//! 3. on clean exit: CAS to `DEAD | pid`, clear the fields, store EMPTY.
//!
//! Scheduler side ([`WorkerSlot::status`], [`WorkerSlot::begin_reclaim`]):
//! 1. a worker is dead if its process is gone, a zombie or its pid reused (start time), or if its
//!    heartbeat is older than [`HEARTBEAT_TIMEOUT`];
//! 2. reclaiming CASes the observed word to `DEAD | pid` (no claim can interleave), the caller
//!    resets the rank's rings, then [`WorkerSlot::finish_reclaim`] clears the slot and stores EMPTY.

use std::time::Duration;

use thiserror::Error;

use crate::liveness::{monotonic_ns, ProcessIdentity};
use crate::sync::{AtomicU64, Ordering};

/// How often an idle worker should heartbeat.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_millis(10);
/// A heartbeat older than this declares a worker dead even if its process exists (hung, stopped).
/// Ten intervals: a worker starved of CPU for a while is not killed by mistake, and a dead process
/// is noticed at once anyway through its pid.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_millis(100);

const STATE_EMPTY: u32 = 0;
const STATE_ATTACHED: u32 = 1;
const STATE_DEAD: u32 = 2;

/// The state word of a worker slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WorkerState {
    Empty,
    Attached,
    Dead,
    /// A value this layout does not know (corrupt memory); treated as dead.
    Unknown(u32),
}

impl WorkerState {
    fn from_wire(code: u32) -> WorkerState {
        match code {
            STATE_EMPTY => WorkerState::Empty,
            STATE_ATTACHED => WorkerState::Attached,
            STATE_DEAD => WorkerState::Dead,
            other => WorkerState::Unknown(other),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WorkerState::Empty => "empty",
            WorkerState::Attached => "attached",
            WorkerState::Dead => "dead",
            WorkerState::Unknown(_) => "unknown",
        }
    }
}

/// Whether a rank has a live worker, as judged by the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RankStatus {
    Empty,
    Alive { pid: u32 },
    Dead { pid: u32 },
}

/// Why a worker cannot claim a rank.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ClaimError {
    #[error("rank {rank} is outside 0..{tp_size}")]
    RankOutOfRange { rank: u32, tp_size: u32 },
    #[error("rank is served by live worker pid {pid}")]
    Occupied { pid: u32 },
    #[error("the previous worker of this rank (pid {pid}) died and the scheduler has not reclaimed the rank yet")]
    NotReclaimed { pid: u32 },
}

/// Why the scheduler cannot reclaim a rank.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ReclaimError {
    #[error("rank {rank} is outside 0..{tp_size}")]
    RankOutOfRange { rank: u32, tp_size: u32 },
    #[error("rank is served by live worker pid {pid}")]
    WorkerAlive { pid: u32 },
}

/// The scheduler took the rank away from this worker (it judged it dead); the worker must stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("this worker no longer holds its rank (slot now {state:?}, pid {pid})")]
pub struct ClaimLost {
    pub state: WorkerState,
    pub pid: u32,
}

/// Everything a slot says, copied out at one moment (for kvctl).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerSlotView {
    pub state: WorkerState,
    pub worker: ProcessIdentity,
    /// `CLOCK_MONOTONIC` ns of the last heartbeat; 0 before the first.
    pub heartbeat_ns: u64,
    pub attached_at_ns: u64,
    /// How many times any worker claimed this rank.
    pub attach_count: u64,
}

/// One rank's slot as it lies in the segment. Zeroed memory is an empty slot.
#[repr(C, align(64))]
pub struct WorkerSlot {
    /// `(state << 32) | pid`.
    owner: AtomicU64,
    start_time: AtomicU64,
    heartbeat_ns: AtomicU64,
    attached_at_ns: AtomicU64,
    attach_count: AtomicU64,
    _reserved: [u64; 3],
}

const _: () = assert!(size_of::<WorkerSlot>() == 64);

fn pack(state: u32, pid: u32) -> u64 {
    (u64::from(state) << 32) | u64::from(pid)
}

fn unpack(word: u64) -> (WorkerState, u32) {
    (WorkerState::from_wire((word >> 32) as u32), word as u32)
}

impl WorkerSlot {
    /// The slot's fields at one moment (each field atomically; the set is not a snapshot).
    pub fn view(&self) -> WorkerSlotView {
        // SYNC: pairs with the Release store of owner in finish_reclaim() and the Release half of
        // the CAS in claim().
        let (state, pid) = unpack(self.owner.load(Ordering::Acquire));
        WorkerSlotView {
            state,
            worker: ProcessIdentity::new(pid, self.start_time.load(Ordering::Relaxed)),
            heartbeat_ns: self.heartbeat_ns.load(Ordering::Relaxed),
            attached_at_ns: self.attached_at_ns.load(Ordering::Relaxed),
            attach_count: self.attach_count.load(Ordering::Relaxed),
        }
    }

    /// Judges the worker of this slot at `now_ns` (`CLOCK_MONOTONIC`), with heartbeats older than
    /// `timeout` counting as death.
    pub fn status(&self, now_ns: u64, timeout: Duration) -> RankStatus {
        self.status_with(now_ns, timeout, |identity| identity.is_alive())
    }

    /// As [`status`](Self::status), asking `is_alive` about the worker process (e.g. through a
    /// [`LivenessCache`](crate::liveness::LivenessCache)).
    pub fn status_with(
        &self,
        now_ns: u64,
        timeout: Duration,
        is_alive: impl FnOnce(ProcessIdentity) -> bool,
    ) -> RankStatus {
        // SYNC: pairs with the Release stores of owner in finish_reclaim() and the AcqRel CAS in claim().
        self.judge(self.owner.load(Ordering::Acquire), now_ns, timeout, is_alive)
    }

    fn judge(
        &self,
        word: u64,
        now_ns: u64,
        timeout: Duration,
        is_alive: impl FnOnce(ProcessIdentity) -> bool,
    ) -> RankStatus {
        let (state, pid) = unpack(word);
        match state {
            WorkerState::Empty => RankStatus::Empty,
            WorkerState::Dead | WorkerState::Unknown(_) => RankStatus::Dead { pid },
            WorkerState::Attached => {
                // The start time is 0 until the claimant stores it (then only the pid is checked);
                // it is never a previous worker's, because release and reclaim clear it before the
                // Release store of EMPTY that the claimant's CAS read.
                // SYNC: pairs with the Release store of start_time in claim().
                let identity = ProcessIdentity::new(pid, self.start_time.load(Ordering::Acquire));
                // SYNC: pairs with the Release stores of heartbeat_ns in claim() and heartbeat().
                let heartbeat = self.heartbeat_ns.load(Ordering::Acquire);
                let stale =
                    heartbeat != 0 && now_ns.saturating_sub(heartbeat) > timeout.as_nanos() as u64;
                if stale || !is_alive(identity) {
                    RankStatus::Dead { pid }
                } else {
                    RankStatus::Alive { pid }
                }
            }
        }
    }

    /// Claims the slot for `worker`; on success the caller owns the returned owner word.
    pub(crate) fn claim(&self, worker: ProcessIdentity) -> Result<u64, ClaimError> {
        let mine = pack(STATE_ATTACHED, worker.pid);
        loop {
            // SYNC: pairs with the Release store of EMPTY in finish_reclaim(), like the CAS below.
            let current = self.owner.load(Ordering::Acquire);
            match self.judge(current, monotonic_ns(), HEARTBEAT_TIMEOUT, |id| id.is_alive()) {
                RankStatus::Alive { pid } => return Err(ClaimError::Occupied { pid }),
                RankStatus::Dead { pid } => return Err(ClaimError::NotReclaimed { pid }),
                RankStatus::Empty => {}
            }
            // SYNC: the Acquire half pairs with the Release store of EMPTY in release() and
            // finish_reclaim(), so the cleared fields and reset rings are visible to this worker.
            if self
                .owner
                .compare_exchange(current, mine, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                let now = monotonic_ns();
                // SYNC: pairs with the Acquire load of start_time in judge().
                self.start_time.store(worker.start_time, Ordering::Release);
                self.attached_at_ns.store(now, Ordering::Relaxed);
                self.attach_count.fetch_add(1, Ordering::Relaxed);
                // SYNC: pairs with the Acquire load of heartbeat_ns in judge().
                self.heartbeat_ns.store(now, Ordering::Release);
                return Ok(mine);
            }
        }
    }

    /// Refreshes the heartbeat if `owner_word` still owns the slot.
    pub(crate) fn heartbeat(&self, owner_word: u64) -> Result<(), ClaimLost> {
        let current = self.owner.load(Ordering::Relaxed);
        if current != owner_word {
            let (state, pid) = unpack(current);
            return Err(ClaimLost { state, pid });
        }
        // SYNC: pairs with the Acquire load of heartbeat_ns in judge().
        self.heartbeat_ns.store(monotonic_ns(), Ordering::Release);
        Ok(())
    }

    /// Gives the slot back after a clean exit; does nothing if the scheduler already took it.
    pub(crate) fn release(&self, owner_word: u64) {
        let (_, pid) = unpack(owner_word);
        // SYNC: the Acquire pairs only with this worker's own claim() CAS (which wrote owner_word);
        // what the release publishes, finish_reclaim()'s Release store of EMPTY publishes.
        if self
            .owner
            .compare_exchange(
                owner_word,
                pack(STATE_DEAD, pid),
                Ordering::Acquire,
                Ordering::Relaxed,
            )
            .is_ok()
        {
            self.finish_reclaim();
        }
    }

    /// Scheduler: takes a slot whose worker is gone (dead or departed) so that it can be reset.
    /// On success the slot is DEAD and no worker can claim it until [`finish_reclaim`](Self::finish_reclaim).
    pub fn begin_reclaim(&self, now_ns: u64, timeout: Duration) -> Result<(), ReclaimError> {
        loop {
            // SYNC: pairs with the Release half of the CAS in claim() and the Release store of
            // EMPTY in finish_reclaim(), as in status_with().
            let current = self.owner.load(Ordering::Acquire);
            let pid = match self.judge(current, now_ns, timeout, |id| id.is_alive()) {
                RankStatus::Alive { pid } => return Err(ReclaimError::WorkerAlive { pid }),
                RankStatus::Dead { pid } => pid,
                RankStatus::Empty => 0,
            };
            // SYNC: pairs with the Release half of the claimant's CAS in claim(); the Acquire also
            // keeps the caller's ring reset (Segment::reclaim_rank()) below the DEAD mark, and
            // finish_reclaim()'s Release store of EMPTY publishes that reset to the next claimant.
            if self
                .owner
                .compare_exchange(
                    current,
                    pack(STATE_DEAD, pid),
                    Ordering::Acquire,
                    Ordering::Relaxed,
                )
                .is_ok()
            {
                return Ok(());
            }
        }
    }

    /// Clears a slot this process moved to DEAD and makes it EMPTY again.
    pub fn finish_reclaim(&self) {
        self.start_time.store(0, Ordering::Relaxed);
        self.heartbeat_ns.store(0, Ordering::Relaxed);
        self.attached_at_ns.store(0, Ordering::Relaxed);
        // SYNC: publishes the cleared fields (and a reclaim's ring reset) to the Acquire half of
        // the CAS in claim().
        self.owner.store(pack(STATE_EMPTY, 0), Ordering::Release);
    }

    /// Resets everything, attach count included (segment creation).
    pub(crate) fn clear(&self) {
        self.attach_count.store(0, Ordering::Relaxed);
        self.finish_reclaim();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot() -> Box<WorkerSlot> {
        Box::new(WorkerSlot {
            owner: AtomicU64::new(0),
            start_time: AtomicU64::new(0),
            heartbeat_ns: AtomicU64::new(0),
            attached_at_ns: AtomicU64::new(0),
            attach_count: AtomicU64::new(0),
            _reserved: [0; 3],
        })
    }

    #[test]
    fn a_live_claim_is_alive_and_refuses_a_second_claim() {
        let slot = slot();
        let me = ProcessIdentity::current();
        let word = slot.claim(me).unwrap();
        assert_eq!(
            slot.status(monotonic_ns(), HEARTBEAT_TIMEOUT),
            RankStatus::Alive { pid: me.pid }
        );
        assert_eq!(slot.claim(me), Err(ClaimError::Occupied { pid: me.pid }));
        slot.heartbeat(word).unwrap();
        slot.release(word);
        assert_eq!(slot.status(monotonic_ns(), HEARTBEAT_TIMEOUT), RankStatus::Empty);
        assert_eq!(slot.view().attach_count, 1);
    }

    #[test]
    fn a_stale_heartbeat_is_death() {
        let slot = slot();
        let me = ProcessIdentity::current();
        slot.claim(me).unwrap();
        let later = monotonic_ns() + HEARTBEAT_TIMEOUT.as_nanos() as u64 + 1_000_000;
        assert_eq!(slot.status(later, HEARTBEAT_TIMEOUT), RankStatus::Dead { pid: me.pid });
    }

    #[test]
    fn a_dead_worker_blocks_claims_until_reclaimed() {
        let slot = slot();
        let me = ProcessIdentity::current();
        // A pid above any pid_max: no such process exists.
        let ghost = ProcessIdentity::new(2_000_000_000, 1);
        let ghost_word = slot.claim(ghost).unwrap();
        assert_eq!(slot.claim(me), Err(ClaimError::NotReclaimed { pid: ghost.pid }));
        slot.begin_reclaim(monotonic_ns(), HEARTBEAT_TIMEOUT).unwrap();
        assert_eq!(slot.claim(me), Err(ClaimError::NotReclaimed { pid: ghost.pid }));
        assert_eq!(
            slot.heartbeat(ghost_word),
            Err(ClaimLost { state: WorkerState::Dead, pid: ghost.pid })
        );
        slot.finish_reclaim();
        slot.claim(me).unwrap();
        // The ghost's late release must not free the new worker's slot.
        slot.release(ghost_word);
        assert_eq!(
            slot.status(monotonic_ns(), HEARTBEAT_TIMEOUT),
            RankStatus::Alive { pid: me.pid }
        );
    }

    #[test]
    fn a_live_worker_cannot_be_reclaimed() {
        let slot = slot();
        let me = ProcessIdentity::current();
        slot.claim(me).unwrap();
        assert_eq!(
            slot.begin_reclaim(monotonic_ns(), HEARTBEAT_TIMEOUT),
            Err(ReclaimError::WorkerAlive { pid: me.pid })
        );
    }
}
