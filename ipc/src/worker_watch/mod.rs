//! The scheduler's watch over one rank's worker: the worker it saw attach, and what to do now.
//!
//! A worker slot is memory that any process of the user can write, so the scheduler acts on
//! nothing the slot says alone. [`WorkerWatch`] records the worker it saw attach: the owner word
//! of its claim, its pid, and a handle opened then ([`ProcessHandle`]: a pidfd, after checking
//! that the process maps the segment and started when its claim says). It judges that worker's
//! liveness through the handle, fences only through the handle, and never signals a process it
//! did not record. Process questions go through a [`ProcessProbe`] ([`SystemProbe`] in
//! production), so that models can run this very logic.
//!
//! [`WorkerWatch::observe`], on one load of the owner word `w`, with the recorded worker `r`:
//! 1. `r` runs and `w` is its word: heartbeat fresh: [`Observation::Alive`] once `r` marked itself
//!    serving, [`Observation::Starting`] while it still sets up; stale (stopped, stuck):
//!    [`Observation::MustFence`];
//! 2. `r` runs and `w` is not its word: EMPTY or another claim looks like a clean exit (and a
//!    successor), so `r` gets [`WatchTiming::exit_grace`] to exit ([`Observation::Waiting`]) and
//!    is fenced after it; DEAD or garbage is fenced at once. Nothing fails while `r` runs;
//! 3. `r` is gone (or none was recorded), `w` is a claim: a claim still being set up is waited
//!    for while its process lives and maps the segment; a complete one is verified and recorded
//!    ([`Observation::Alive`] with `attached`, or [`Observation::Starting`]); a claimant that is gone, or a stranger (a process
//!    that does not map the segment, named by whatever wrote the slot), makes the rank lost;
//! 4. `r` is gone, `w` is `r`'s word, EMPTY, DEAD or garbage: [`Observation::Lost`] with exactly
//!    `w`, to reclaim from. Nothing recorded and EMPTY: [`Observation::Empty`].
//!
//! [`WorkerWatch::fence`] sends SIGKILL to the recorded worker through its handle; this very
//! process (a test playing a worker) is never signalled and counts as gone once fenced.

#[cfg(all(test, not(loom)))]
mod tests;

use std::time::Duration;

use nix::errno::Errno;

use crate::liveness::ProcessIdentity;
use crate::process_handle::{maps_object, ObjectId, OpenError, ProcessHandle};
use crate::worker_slot::{HeartbeatLimits, OwnerWord, WorkerSlot, WorkerState, HEARTBEAT_TIMEOUT};

/// How long a worker that let go of its slot may take to exit before it is fenced like a stuck
/// one: a clean exit takes milliseconds.
pub const EXIT_GRACE: Duration = HEARTBEAT_TIMEOUT;

/// The time limits of a watch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchTiming {
    /// A heartbeat older than these (the serving or the setting-up limit) gets a running worker
    /// fenced.
    pub heartbeat: HeartbeatLimits,
    /// How long a running worker the slot no longer names may take to exit.
    pub exit_grace: Duration,
}

impl Default for WatchTiming {
    fn default() -> Self {
        WatchTiming { heartbeat: HeartbeatLimits::DEFAULT, exit_grace: EXIT_GRACE }
    }
}

/// What a probe found about a process named by a complete claim.
#[derive(Debug)]
pub enum Probed<H> {
    /// It runs and maps the segment: a worker, with a handle on it.
    Worker(H),
    /// It exited, or its pid now names a process that started at another time.
    Gone,
    /// It runs but does not map the segment: the slot was written by something else.
    Stranger,
    /// The question could not be answered now (e.g. out of descriptors); ask again later.
    Retry,
}

/// What [`WorkerWatch`] asks about processes (module documentation).
pub trait ProcessProbe {
    /// What the watch keeps of a recorded worker.
    type Handle;
    /// The claimant `identity` (its start time known): a handle if it is a worker of ours.
    fn open(&self, identity: ProcessIdentity) -> Probed<Self::Handle>;
    /// A claimant whose start time is not known yet: `None` if no process has `pid`, else
    /// whether that process maps the segment.
    fn maps_segment(&self, pid: u32) -> Option<bool>;
    fn is_alive(&self, handle: &Self::Handle) -> bool;
    fn kill(&self, handle: &Self::Handle) -> Result<(), Errno>;
    /// Whether `handle` names the calling process.
    fn is_self(&self, handle: &Self::Handle) -> bool;
}

/// The production probe: pidfds, `/proc/PID/stat` and `/proc/PID/maps`.
#[derive(Debug, Clone, Copy)]
pub struct SystemProbe {
    /// The segment's control object, which every worker maps.
    segment: ObjectId,
}

impl SystemProbe {
    pub fn new(segment: ObjectId) -> Self {
        SystemProbe { segment }
    }
}

impl ProcessProbe for SystemProbe {
    type Handle = ProcessHandle;

    fn open(&self, identity: ProcessIdentity) -> Probed<ProcessHandle> {
        let handle = match ProcessHandle::open(identity) {
            Ok(handle) => handle,
            Err(OpenError::Gone { .. }) => return Probed::Gone,
            Err(error @ OpenError::Os { .. }) => {
                tracing::warn!(%error, "cannot take a handle on a worker yet");
                return Probed::Retry;
            }
        };
        match maps_object(identity.pid, self.segment) {
            Ok(true) => Probed::Worker(handle),
            Ok(false) if handle.is_alive() => Probed::Stranger,
            Ok(false) => Probed::Gone,
            Err(_) if !handle.is_alive() => Probed::Gone,
            Err(error) => {
                // Hidden from us (a /proc mounted with hidepid, a process made undumpable): its
                // start time matched, so the claim is taken at its word.
                tracing::warn!(
                    pid = identity.pid,
                    %error,
                    "cannot check that a worker maps the segment; trusting its claim"
                );
                Probed::Worker(handle)
            }
        }
    }

    fn maps_segment(&self, pid: u32) -> Option<bool> {
        match maps_object(pid, self.segment) {
            Ok(mapped) => Some(mapped),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => None,
            // Unreadable: the claim gets the benefit of the doubt while its pid exists.
            Err(_) => ProcessIdentity::new(pid, 0).is_alive().then_some(true),
        }
    }

    fn is_alive(&self, handle: &ProcessHandle) -> bool {
        handle.is_alive()
    }

    fn kill(&self, handle: &ProcessHandle) -> Result<(), Errno> {
        handle.kill()
    }

    fn is_self(&self, handle: &ProcessHandle) -> bool {
        handle.identity().pid == std::process::id()
    }
}

/// Why a running worker must be stopped before its rank can be reclaimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceReason {
    /// Its heartbeat is older than the limit: stopped, or stuck.
    HeartbeatStale { age: Duration },
    /// The slot no longer names it, and it did not exit within the grace.
    DidNotExit { slot: OwnerWord },
    /// The slot holds a word no worker writes (DEAD, garbage), or fields not its own.
    SlotWrittenOver { slot: OwnerWord },
    /// It was fenced already and is not gone yet.
    AlreadyFenced,
}

impl std::fmt::Display for FenceReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FenceReason::HeartbeatStale { age } => write!(f, "no heartbeat for {age:?}"),
            FenceReason::DidNotExit { slot } => {
                write!(f, "it let go of the rank (slot now {slot}) but did not exit")
            }
            FenceReason::SlotWrittenOver { slot } => {
                write!(f, "its worker slot was written over (now {slot})")
            }
            FenceReason::AlreadyFenced => write!(f, "it was fenced and still runs"),
        }
    }
}

/// A rank that no worker can serve or touch any more: reclaim it from exactly [`word`](Self::word).
/// Only [`WorkerWatch::observe`] makes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LostRank {
    word: OwnerWord,
    worker: Option<u32>,
}

impl LostRank {
    /// The owner word judged: the reclaim must start from it.
    pub fn word(&self) -> OwnerWord {
        self.word
    }

    /// The pid of the recorded worker that was lost, if one was recorded.
    pub fn worker(&self) -> Option<u32> {
        self.worker
    }
}

/// What the scheduler should do about a rank (module flow).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observation {
    /// No worker holds the rank, and none is recorded.
    Empty,
    /// The recorded worker runs, heartbeats and serves its rings; `attached`: it was recorded
    /// just now.
    Alive { pid: u32, attached: bool },
    /// The recorded worker runs and heartbeats but is still setting up (mapping its tiers,
    /// registering memory, opening storage): it must get no commands yet.
    Starting { pid: u32 },
    /// Nothing to do yet: a claim being set up, or a worker the slot no longer names that may be
    /// exiting.
    Waiting { pid: u32 },
    /// The recorded worker runs but must be stopped first: [`WorkerWatch::fence`].
    MustFence { pid: u32, reason: FenceReason },
    /// No worker can touch the rank's rings any more: reclaim it.
    Lost(LostRank),
}

/// How a fence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceOutcome {
    /// No worker is recorded, the recorded one is gone, or it is this very process.
    Gone,
    /// SIGKILL was sent; the worker is gone once an observation says so.
    Signalled {
        pid: u32,
    },
    Failed {
        pid: u32,
        errno: Errno,
    },
}

#[derive(Debug)]
struct Recorded<H> {
    word: OwnerWord,
    pid: u32,
    handle: H,
    is_self: bool,
    /// Since when (ns) the slot no longer names this running worker.
    unnamed_since: Option<u64>,
    fenced: bool,
}

/// The scheduler's record of one rank's worker (module documentation).
#[derive(Debug)]
pub struct WorkerWatch<P: ProcessProbe = SystemProbe> {
    probe: P,
    timing: WatchTiming,
    recorded: Option<Recorded<P::Handle>>,
}

impl<P: ProcessProbe> WorkerWatch<P> {
    pub fn new(probe: P, timing: WatchTiming) -> Self {
        WorkerWatch { probe, timing, recorded: None }
    }

    /// The pid of the recorded worker.
    pub fn recorded_pid(&self) -> Option<u32> {
        self.recorded.as_ref().map(|recorded| recorded.pid)
    }

    /// Judges `slot` at `now_ns` (`CLOCK_MONOTONIC`) against the recorded worker (module flow).
    pub fn observe(&mut self, slot: &WorkerSlot, now_ns: u64) -> Observation {
        let word = slot.owner();
        let timing = self.timing;
        if let Some(recorded) = &mut self.recorded {
            let gone =
                (recorded.is_self && recorded.fenced) || !self.probe.is_alive(&recorded.handle);
            if !gone {
                if let Some(observation) = judge_running(recorded, slot, word, now_ns, timing) {
                    return observation;
                }
            }
            if word == recorded.word || word.state() != WorkerState::Attached {
                return Observation::Lost(LostRank { word, worker: Some(recorded.pid) });
            }
        }
        let worker = self.recorded_pid();
        match word.state() {
            WorkerState::Empty if worker.is_none() => Observation::Empty,
            WorkerState::Attached => self.judge_claimant(slot, word),
            _ => Observation::Lost(LostRank { word, worker }),
        }
    }

    /// Stops the recorded worker: SIGKILL through its handle (module documentation).
    pub fn fence(&mut self) -> FenceOutcome {
        let Some(recorded) = &mut self.recorded else { return FenceOutcome::Gone };
        recorded.fenced = true;
        if recorded.is_self || !self.probe.is_alive(&recorded.handle) {
            return FenceOutcome::Gone;
        }
        match self.probe.kill(&recorded.handle) {
            Ok(()) => FenceOutcome::Signalled { pid: recorded.pid },
            Err(errno) => FenceOutcome::Failed { pid: recorded.pid, errno },
        }
    }

    /// Forgets the recorded worker, after the rank was reclaimed.
    pub fn forget(&mut self) {
        self.recorded = None;
    }

    /// Step 3 of the module flow: `word` is a claim by a process not recorded.
    fn judge_claimant(&mut self, slot: &WorkerSlot, word: OwnerWord) -> Observation {
        let pid = word.pid();
        let lost = Observation::Lost(LostRank { word, worker: self.recorded_pid() });
        let Some(fields) = slot.claim_fields(word) else {
            // Being set up (its claim returns only after its fields are stored, so it has not
            // touched the rings): wait while a process of ours has the pid.
            return match self.probe.maps_segment(pid) {
                Some(true) => Observation::Waiting { pid },
                Some(false) | None => lost,
            };
        };
        match self.probe.open(ProcessIdentity::new(pid, fields.start_time)) {
            Probed::Worker(handle) => {
                if slot.owner() != word {
                    // It let go meanwhile; judge the slot afresh next time.
                    return Observation::Waiting { pid };
                }
                let is_self = self.probe.is_self(&handle);
                self.recorded = Some(Recorded {
                    word,
                    pid,
                    handle,
                    is_self,
                    unnamed_since: None,
                    fenced: false,
                });
                if fields.serving {
                    Observation::Alive { pid, attached: true }
                } else {
                    Observation::Starting { pid }
                }
            }
            Probed::Gone => lost,
            Probed::Stranger => {
                tracing::warn!(
                    pid,
                    slot = %word,
                    "a worker slot names a process that is not attached to the segment; \
                     taking the rank back without touching that process"
                );
                lost
            }
            Probed::Retry => Observation::Waiting { pid },
        }
    }
}

/// Steps 1 and 2 of the module flow: the recorded worker runs. `None`: it counts as gone (this
/// very process, no longer named by the slot).
fn judge_running<H>(
    recorded: &mut Recorded<H>,
    slot: &WorkerSlot,
    word: OwnerWord,
    now_ns: u64,
    timing: WatchTiming,
) -> Option<Observation> {
    let pid = recorded.pid;
    if recorded.fenced {
        return Some(Observation::MustFence { pid, reason: FenceReason::AlreadyFenced });
    }
    if word == recorded.word {
        recorded.unnamed_since = None;
        return Some(match slot.claim_fields(word) {
            Some(fields) => {
                if let Some(age) = fields.stale_heartbeat(now_ns, timing.heartbeat) {
                    Observation::MustFence { pid, reason: FenceReason::HeartbeatStale { age } }
                } else if fields.serving {
                    Observation::Alive { pid, attached: false }
                } else {
                    Observation::Starting { pid }
                }
            }
            None => {
                Observation::MustFence { pid, reason: FenceReason::SlotWrittenOver { slot: word } }
            }
        });
    }
    if recorded.is_self {
        return None;
    }
    match word.state() {
        WorkerState::Empty | WorkerState::Attached => {
            let since = *recorded.unnamed_since.get_or_insert(now_ns);
            if Duration::from_nanos(now_ns.saturating_sub(since)) <= timing.exit_grace {
                Some(Observation::Waiting { pid })
            } else {
                Some(Observation::MustFence { pid, reason: FenceReason::DidNotExit { slot: word } })
            }
        }
        WorkerState::Dead | WorkerState::Unknown(_) => Some(Observation::MustFence {
            pid,
            reason: FenceReason::SlotWrittenOver { slot: word },
        }),
    }
}
