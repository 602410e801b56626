//! One worker slot per rank: who serves the rank, and whether it still lives.
//!
//! [`WorkerSlot`] lies in the control segment, one cache line per rank. Its owner word
//! ([`OwnerWord`]: state, pid, version) changes only by CAS from one word to its successor, and
//! every transition is that one CAS: no party ever stores a state blindly, so no transition can
//! undo another's. States: EMPTY, ATTACHED (a worker holds the rank), DEAD (the scheduler is
//! reclaiming the rank). The claimant's identity, heartbeat and attach time follow the owner word
//! in the slot, valid for the word named by `fields_of`; `serving_of` names the claim whose worker
//! finished setting up (its copy engine built, its storage opened) and serves its rings.
//!
//! Worker side (`Segment::claim_rank`, [`RankClaim`](crate::segment::RankClaim)):
//! 1. [`WorkerSlot::claim`]: CAS the owner word from EMPTY to ATTACHED with its pid (refused
//!    while another worker holds the rank, and while the scheduler has not reclaimed a dead one);
//! 2. store its start time, attach time and a first heartbeat, then `fields_of` = its word;
//! 3. [`WorkerSlot::heartbeat`] every [`HEARTBEAT_INTERVAL`] while its word still owns the slot,
//!    from the claim on; while it sets up (a copy engine over tens of GB takes seconds), after
//!    each step of its set-up, judged by the longer [`SETUP_HEARTBEAT_TIMEOUT`]
//!    ([`HeartbeatLimits`]);
//! 4. [`WorkerSlot::mark_serving`] once it is ready to answer commands: until then the scheduler
//!    keeps the rank out of service (no copies reach a worker still mapping its tiers);
//! 5. [`WorkerSlot::release`] on clean exit: CAS its word to EMPTY (nothing if the word changed).
//!
//! Scheduler side ([`WorkerWatch`](crate::worker_watch::WorkerWatch) decides, the slot executes):
//! 1. [`WorkerSlot::verdict`] judges the owner word of one load ([`SlotVerdict`]);
//! 2. [`WorkerSlot::begin_reclaim`] CASes exactly the judged word to DEAD (failing if the slot
//!    changed since), which returns the [`Reclaim`] guard: no worker can claim the rank meanwhile;
//! 3. the caller resets the rank's rings; [`Reclaim::finish`] CASes its own DEAD word to EMPTY.
//!    Only the holder of the guard can finish, and only the reclaim it began.

mod owner;
#[cfg(all(test, not(loom)))]
mod tests;

use std::time::Duration;

use thiserror::Error;

use crate::liveness::{monotonic_ns, ProcessIdentity};
use crate::sync::{fence, step_point, AtomicU64, Ordering};

pub use owner::{OwnerWord, WorkerState};

/// How often an idle worker should heartbeat.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_millis(10);
/// A heartbeat older than this declares a worker dead even if its process exists (hung, stopped).
/// Ten intervals: a worker starved of CPU for a while is not killed by mistake, and a dead process
/// is noticed at once anyway through its pid.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_millis(100);
/// The heartbeat limit of a worker still setting up (claimed its rank, not serving yet). Its
/// set-up heartbeats between steps (a slice of its tiers mapped in, the CUDA driver's work), and
/// on a CPU shared with busy processes one step can take a hundred milliseconds or more; a set-up
/// that makes no step for this long is stuck or stopped, and its worker is fenced.
pub const SETUP_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(2);

/// The heartbeat ages past which a worker counts as dead: one for a worker that serves its
/// rings, a longer one for a worker still setting up. The rule lives in
/// [`ClaimFields::stale_heartbeat`]; the scheduler's watch, claims and kvctl all judge by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeartbeatLimits {
    pub serving: Duration,
    pub setting_up: Duration,
}

impl HeartbeatLimits {
    /// [`HEARTBEAT_TIMEOUT`] once serving, [`SETUP_HEARTBEAT_TIMEOUT`] before.
    pub const DEFAULT: HeartbeatLimits =
        HeartbeatLimits { serving: HEARTBEAT_TIMEOUT, setting_up: SETUP_HEARTBEAT_TIMEOUT };

    /// The same limit whether serving or not (tests and models).
    pub const fn uniform(limit: Duration) -> HeartbeatLimits {
        HeartbeatLimits { serving: limit, setting_up: limit }
    }
}

impl Default for HeartbeatLimits {
    fn default() -> Self {
        HeartbeatLimits::DEFAULT
    }
}

/// Whether a rank has a live worker, as judged from the slot alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RankStatus {
    Empty,
    Alive { pid: u32 },
    Dead { pid: u32 },
}

/// The judgement of one owner word, with the word it judged (reclaim from exactly that word).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotVerdict {
    pub word: OwnerWord,
    pub status: RankStatus,
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
    /// The slot no longer holds the word the reclaim was judged on (or began with): a worker
    /// released or claimed it meanwhile, or something wrote it. Judge it again.
    #[error("the worker slot changed since it was judged (judged {judged}, now {found})")]
    Changed { judged: OwnerWord, found: OwnerWord },
}

/// The scheduler took the rank away from this worker (it judged it dead); the worker must stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("this worker no longer holds its rank (slot now {state:?}, pid {pid})")]
pub struct ClaimLost {
    pub state: WorkerState,
    pub pid: u32,
}

/// What a claimant stored after its claim (step 2 of the module flow).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimFields {
    /// The claimant's start time (clock ticks since boot, `/proc/PID/stat`).
    pub start_time: u64,
    /// `CLOCK_MONOTONIC` ns of the last heartbeat.
    pub heartbeat_ns: u64,
    pub attached_at_ns: u64,
    /// The claimant finished setting up and serves its rings ([`WorkerSlot::mark_serving`]).
    pub serving: bool,
}

impl ClaimFields {
    /// The heartbeat limit that applies to this claim's worker: `limits.serving` once it serves,
    /// `limits.setting_up` while it sets up.
    pub fn heartbeat_limit(&self, limits: HeartbeatLimits) -> Duration {
        if self.serving {
            limits.serving
        } else {
            limits.setting_up
        }
    }

    /// The heartbeat's age at `now_ns` if it is past [`heartbeat_limit`](Self::heartbeat_limit)
    /// (the worker counts as dead), else `None`. A heartbeat that far *ahead* of `now_ns` counts
    /// the same: workers write the machine's monotonic clock, so no worker wrote it, and a worker
    /// stopped under it could never be found stale otherwise.
    pub fn stale_heartbeat(&self, now_ns: u64, limits: HeartbeatLimits) -> Option<Duration> {
        let age = Duration::from_nanos(now_ns.abs_diff(self.heartbeat_ns));
        (age > self.heartbeat_limit(limits)).then_some(age)
    }
}

/// Everything a slot says, copied out at one moment (for kvctl).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerSlotView {
    pub owner: OwnerWord,
    pub state: WorkerState,
    /// The claimant; its start time is 0 while the claim is being set up.
    pub worker: ProcessIdentity,
    /// `CLOCK_MONOTONIC` ns of the last heartbeat; 0 when not attached.
    pub heartbeat_ns: u64,
    pub attached_at_ns: u64,
    /// The claimant serves its rings (false while it sets up, and when not attached).
    pub serving: bool,
    /// How many times any worker claimed this rank.
    pub attach_count: u64,
}

/// One rank's slot as it lies in the segment. Zeroed memory is an empty slot.
///
/// Every field is an atomic: other processes write them at any time, so no byte of the slot may
/// sit behind a plain reference.
#[repr(C, align(64))]
pub struct WorkerSlot {
    /// [`OwnerWord`].
    owner: AtomicU64,
    /// The owner word whose claimant stored the fields below; another value: a claim being set up.
    fields_of: AtomicU64,
    start_time: AtomicU64,
    heartbeat_ns: AtomicU64,
    attached_at_ns: AtomicU64,
    attach_count: AtomicU64,
    /// The owner word whose claimant marked itself serving; another value: not serving (yet).
    serving_of: AtomicU64,
    _reserved: AtomicU64,
}

#[cfg(not(loom))]
const _: () = assert!(size_of::<WorkerSlot>() == 8 * size_of::<AtomicU64>());

// SAFETY: eight AtomicU64 fields filling 64 bytes (asserted above): no plain byte, no padding,
// and any bits are a valid slot (an unknown owner word is judged, never trusted).
#[cfg(not(loom))]
unsafe impl crate::shm::SharedArea for WorkerSlot {}

impl Default for WorkerSlot {
    fn default() -> Self {
        Self::new()
    }
}

impl WorkerSlot {
    /// An empty slot (on the heap, for tests and models; the segment's slots are zeroed memory).
    pub fn new() -> WorkerSlot {
        WorkerSlot {
            owner: AtomicU64::new(0),
            fields_of: AtomicU64::new(0),
            start_time: AtomicU64::new(0),
            heartbeat_ns: AtomicU64::new(0),
            attached_at_ns: AtomicU64::new(0),
            attach_count: AtomicU64::new(0),
            serving_of: AtomicU64::new(0),
            _reserved: AtomicU64::new(0),
        }
    }

    /// The owner word now.
    pub fn owner(&self) -> OwnerWord {
        // Relaxed: a judgement only; the CAS that acts on it (claim, begin_reclaim) acquires.
        OwnerWord::from_raw(self.owner.load(Ordering::Relaxed))
    }

    /// The slot's fields at one moment (each field atomically; the claimant's fields only if
    /// they belong to the owner word read).
    pub fn view(&self) -> WorkerSlotView {
        let owner = self.owner();
        let fields = self.claim_fields(owner);
        WorkerSlotView {
            owner,
            state: owner.state(),
            worker: ProcessIdentity::new(owner.pid(), fields.map_or(0, |f| f.start_time)),
            heartbeat_ns: fields.map_or(0, |f| f.heartbeat_ns),
            attached_at_ns: fields.map_or(0, |f| f.attached_at_ns),
            serving: fields.is_some_and(|f| f.serving),
            // Relaxed: a statistic, read on its own.
            attach_count: self.attach_count.load(Ordering::Relaxed),
        }
    }

    /// The fields the claimant of `word` stored, if `word` is an ATTACHED word whose claim is
    /// complete and still owns the slot.
    pub fn claim_fields(&self, word: OwnerWord) -> Option<ClaimFields> {
        if word.state() != WorkerState::Attached {
            return None;
        }
        // SYNC: pairs with the Release store of fields_of in claim(): the fields read below are
        // at least the ones that claim stored.
        if self.fields_of.load(Ordering::Acquire) != word.to_raw() {
            return None;
        }
        // Relaxed: ordered by the fence below (a later claimant's value makes the check fail).
        let fields = ClaimFields {
            start_time: self.start_time.load(Ordering::Relaxed),
            heartbeat_ns: self.heartbeat_ns.load(Ordering::Relaxed),
            attached_at_ns: self.attached_at_ns.load(Ordering::Relaxed),
            // Relaxed: the mark publishes no data, and only the claimant of `word` ever stores
            // `word` here (versions make every claim's word new), so a match is that claim's own.
            serving: self.serving_of.load(Ordering::Relaxed) == word.to_raw(),
        };
        // SYNC: pairs with the Release fence in claim(): if a load above saw a field of a later
        // claim, the load of the owner word below sees that claim's CAS (or something later).
        fence(Ordering::Acquire);
        // Relaxed: ordered by the fence above.
        (self.owner.load(Ordering::Relaxed) == word.to_raw()).then_some(fields)
    }

    /// Judges the worker of this slot at `now_ns` (`CLOCK_MONOTONIC`), with heartbeats past
    /// `limits` counting as death.
    pub fn status(&self, now_ns: u64, limits: HeartbeatLimits) -> RankStatus {
        self.verdict(now_ns, limits, |identity| identity.is_alive()).status
    }

    /// As [`status`](Self::status), asking `is_alive` about the worker process (e.g. through a
    /// [`LivenessCache`](crate::liveness::LivenessCache)).
    pub fn status_with(
        &self,
        now_ns: u64,
        limits: HeartbeatLimits,
        is_alive: impl FnOnce(ProcessIdentity) -> bool,
    ) -> RankStatus {
        self.verdict(now_ns, limits, is_alive).status
    }

    /// Judges the owner word of one load, from what the slot says alone: a worker is dead if its
    /// process is gone, a zombie or its pid reused, or if its heartbeat is older than `timeout`;
    /// a DEAD or unknown word is dead. (The scheduler acts on [`WorkerWatch`], which trusts
    /// none of this; this is the view kvctl and tests take.)
    ///
    /// [`WorkerWatch`]: crate::worker_watch::WorkerWatch
    pub fn verdict(
        &self,
        now_ns: u64,
        limits: HeartbeatLimits,
        is_alive: impl FnOnce(ProcessIdentity) -> bool,
    ) -> SlotVerdict {
        let word = self.owner();
        let status = self.judge(word, now_ns, limits, is_alive);
        SlotVerdict { word, status }
    }

    fn judge(
        &self,
        word: OwnerWord,
        now_ns: u64,
        limits: HeartbeatLimits,
        is_alive: impl FnOnce(ProcessIdentity) -> bool,
    ) -> RankStatus {
        let pid = word.pid();
        match word.state() {
            WorkerState::Empty => RankStatus::Empty,
            WorkerState::Dead | WorkerState::Unknown(_) => RankStatus::Dead { pid },
            WorkerState::Attached => {
                // A claim being set up (no fields yet) is judged by its pid alone.
                let (start_time, stale) = self.claim_fields(word).map_or((0, false), |fields| {
                    (fields.start_time, fields.stale_heartbeat(now_ns, limits).is_some())
                });
                if stale || !is_alive(ProcessIdentity::new(pid, start_time)) {
                    RankStatus::Dead { pid }
                } else {
                    RankStatus::Alive { pid }
                }
            }
        }
    }

    /// Claims the slot for `worker` (steps 1 and 2 of the module flow); on success the caller's
    /// word owns the slot. Usually reached through `Segment::claim_rank`.
    pub fn claim(&self, worker: ProcessIdentity) -> Result<OwnerWord, ClaimError> {
        loop {
            // Relaxed: only chooses the CAS below, which acquires.
            let current = OwnerWord::from_raw(self.owner.load(Ordering::Relaxed));
            match self.judge(current, monotonic_ns(), HeartbeatLimits::DEFAULT, |id| id.is_alive())
            {
                RankStatus::Empty => {}
                RankStatus::Alive { pid } => return Err(ClaimError::Occupied { pid }),
                RankStatus::Dead { pid } => return Err(ClaimError::NotReclaimed { pid }),
            }
            let mine = current.successor(WorkerState::Attached, worker.pid);
            // SYNC: the Acquire pairs with the Release CAS in release() and Reclaim::finish():
            // the previous worker's ring accesses and a reclaim's ring reset happen before this
            // worker's first ring access.
            if self
                .owner
                .compare_exchange(
                    current.to_raw(),
                    mine.to_raw(),
                    Ordering::Acquire,
                    Ordering::Relaxed,
                )
                .is_err()
            {
                continue;
            }
            step_point("claim: owner word written");
            let now = monotonic_ns();
            // SYNC: pairs with the Acquire fence in claim_fields(): a reader that sees any field
            // stored below also sees the CAS above, so it cannot take them for an older claim's.
            fence(Ordering::Release);
            // Relaxed: published by the fence above and the Release store of fields_of below.
            self.start_time.store(worker.start_time, Ordering::Relaxed);
            self.attached_at_ns.store(now, Ordering::Relaxed);
            self.heartbeat_ns.store(now, Ordering::Relaxed);
            self.attach_count.fetch_add(1, Ordering::Relaxed);
            // SYNC: pairs with the Acquire load of fields_of in claim_fields().
            self.fields_of.store(mine.to_raw(), Ordering::Release);
            return Ok(mine);
        }
    }

    /// Refreshes the heartbeat if `mine` still owns the slot.
    ///
    /// A heartbeat that passed the check just before the scheduler took the slot may land after
    /// a successor's claim; it then stores a time as recent as the successor's own, which cannot
    /// make anyone look dead.
    pub fn heartbeat(&self, mine: OwnerWord) -> Result<(), ClaimLost> {
        // Relaxed: only compared; the worker learns nothing else from it.
        let current = OwnerWord::from_raw(self.owner.load(Ordering::Relaxed));
        if current != mine {
            return Err(ClaimLost { state: current.state(), pid: current.pid() });
        }
        // Relaxed: a timestamp read on its own; nothing is published behind it.
        self.heartbeat_ns.store(monotonic_ns(), Ordering::Relaxed);
        Ok(())
    }

    /// Marks the claim of `mine` as serving (step 4): its worker finished setting up and answers
    /// commands from now on. Fails, changing nothing the scheduler would believe, if `mine` no
    /// longer owns the slot.
    pub fn mark_serving(&self, mine: OwnerWord) -> Result<(), ClaimLost> {
        self.heartbeat(mine)?;
        // Relaxed: the mark publishes no data (the rings synchronise what they carry), and a
        // word stored after the claim was taken names a claim that no longer exists.
        self.serving_of.store(mine.to_raw(), Ordering::Relaxed);
        step_point("serving: marked");
        Ok(())
    }

    /// Gives the slot back after a clean exit (step 5): one CAS from `mine` to EMPTY. Returns
    /// false, changing nothing, if the slot no longer holds `mine` (the scheduler took it).
    pub fn release(&self, mine: OwnerWord) -> bool {
        // SYNC: the Release pairs with the Acquire CAS in claim() and begin_reclaim(): this
        // worker's ring accesses happen before the next claimant's and before a reclaim's reset.
        let released = self
            .owner
            .compare_exchange(
                mine.to_raw(),
                mine.successor(WorkerState::Empty, 0).to_raw(),
                Ordering::Release,
                Ordering::Relaxed,
            )
            .is_ok();
        step_point("release: owner word written");
        released
    }

    /// Scheduler: takes the slot from exactly the word `judged` (step 2), so that the rank's rings
    /// can be reset; fails with [`ReclaimError::Changed`] if the slot holds another word now.
    ///
    /// The caller has judged that no worker can touch the rank's rings any more: the one that
    /// held `judged` is gone (a [`WorkerWatch`](crate::worker_watch::WorkerWatch) verdict), or
    /// `judged` is an empty or unclaimable word.
    pub fn begin_reclaim(&self, judged: OwnerWord) -> Result<Reclaim<'_>, ReclaimError> {
        let mark = judged.successor(WorkerState::Dead, judged.pid());
        // SYNC: the Acquire pairs with the Release CAS in release(): a worker that left cleanly
        // did its last ring access before the reset that follows. (A worker that died published
        // nothing; its death, observed through its process, is what orders its accesses.)
        self.owner
            .compare_exchange(judged.to_raw(), mark.to_raw(), Ordering::Acquire, Ordering::Relaxed)
            .map_err(|found| ReclaimError::Changed { judged, found: OwnerWord::from_raw(found) })?;
        step_point("reclaim: began");
        Ok(Reclaim { slot: self, mark })
    }

    /// Writes `word` over the owner word, as a process scribbling over the segment would.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn overwrite_owner(&self, word: OwnerWord) {
        self.owner.store(word.to_raw(), Ordering::Relaxed);
    }

    /// Writes `ns` over the heartbeat, as a stalled worker (or a scribbler) would leave it.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn overwrite_heartbeat(&self, ns: u64) {
        self.heartbeat_ns.store(ns, Ordering::Relaxed);
    }

    /// Resets everything, attach count included (segment creation, before anyone sees it).
    #[cfg(not(loom))]
    pub(crate) fn clear(&self) {
        // Relaxed: the segment's Release store of READY publishes the whole area.
        for word in [
            &self.owner,
            &self.fields_of,
            &self.start_time,
            &self.heartbeat_ns,
            &self.attached_at_ns,
            &self.attach_count,
            &self.serving_of,
        ] {
            word.store(0, Ordering::Relaxed);
        }
    }
}

/// A reclaim in progress: the slot is DEAD with this guard's own word, and only
/// [`finish`](Self::finish) makes it EMPTY again. Dropped unfinished, it leaves the slot DEAD
/// (no worker can claim it) until the scheduler judges it again and reclaims it anew.
#[must_use = "the slot stays DEAD until the reclaim is finished"]
pub struct Reclaim<'a> {
    slot: &'a WorkerSlot,
    /// The DEAD word begin_reclaim() wrote.
    mark: OwnerWord,
}

impl std::fmt::Debug for Reclaim<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reclaim").field("mark", &self.mark).finish()
    }
}

impl std::fmt::Debug for WorkerSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerSlot").field("owner", &self.owner()).finish_non_exhaustive()
    }
}

impl Reclaim<'_> {
    /// The DEAD word this reclaim wrote.
    pub fn mark(&self) -> OwnerWord {
        self.mark
    }

    /// Makes the slot EMPTY (step 3), after the caller reset the rank's rings. Fails with
    /// [`ReclaimError::Changed`], changing nothing, if something wrote the slot meanwhile.
    pub fn finish(self) -> Result<(), ReclaimError> {
        let empty = self.mark.successor(WorkerState::Empty, 0);
        // SYNC: the Release pairs with the Acquire CAS in claim(): the ring reset happens before
        // the next worker's first ring access.
        let result = self
            .slot
            .owner
            .compare_exchange(
                self.mark.to_raw(),
                empty.to_raw(),
                Ordering::Release,
                Ordering::Relaxed,
            )
            .map(drop)
            .map_err(|found| ReclaimError::Changed {
                judged: self.mark,
                found: OwnerWord::from_raw(found),
            });
        step_point("reclaim: finished");
        result
    }
}
