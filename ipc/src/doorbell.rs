//! Waiting across processes for a condition another process makes true: spin briefly, then sleep
//! on a shared futex, with no lost wake-ups.
//!
//! A [`Doorbell`] sits in shared memory next to the ring it announces (zeroed memory is an idle
//! doorbell). The publisher calls [`Doorbell::ring`] after publishing; the waiter calls
//! [`Doorbell::wait_until`] with its condition (e.g. "the ring is not empty") and a
//! [`WaitPolicy`]. `ring` costs one fence and one load while nobody sleeps.
//!
//! One wait:
//!
//! 1. spin: check `ready()` with a pause hint in between, for at most `policy.spin` (the clock is
//!    read every [`CHECKS_PER_CLOCK_READ`] checks);
//! 2. read the sequence word (the futex), then register: `sleepers += 1`;
//! 3. `fence(SeqCst)` (fence W), then check `ready()` once more; if it holds, deregister, done;
//! 4. sleep on the futex while it still holds the value read in 2, for at most
//!    `policy.sleep_slice` (and never past `policy.deadline`);
//! 5. deregister and go back to 2 (after checking `ready()` and the deadline).
//!
//! One ring: `fence(SeqCst)` (fence R), then if `sleepers != 0`: bump the sequence word and wake
//! every sleeper on the futex.
//!
//! Why no wake-up is lost. The publisher's store that makes `ready()` true comes before fence R;
//! the waiter's registration comes before fence W. Sequentially consistent fences are totally
//! ordered. If fence W comes first, the publisher's load of `sleepers` after fence R sees the
//! registration, so it bumps the word and wakes; and the waiter read the word in step 2, before
//! fence W, so that value cannot include this bump: the kernel either finds the word changed and
//! does not sleep, or queues the waiter before the wake (its compare and enqueue are atomic with
//! respect to the wake). If fence R comes first, the waiter's check in step 3, after fence W, sees
//! the publisher's store and never sleeps. `tests/loom.rs` checks exactly this, with timeouts taken
//! out of the futex model so that a lost wake-up would be a deadlock.
//!
//! The timeouts are a second line of defence and what lets a waiter notice that its peer died: a
//! caller that passes a deadline gets [`WaitOutcome::TimedOut`] and can check liveness. A waiter
//! that dies while registered leaves `sleepers` above zero, which costs every later ring a futex
//! wake system call (never correctness); the segment forgets those registrations when it
//! reclaims the rank of a worker doorbell, once no waiter of it can exist.
//!
//! # How long to spin
//!
//! A sleep is cheap for the sleeper's own CPU but expensive for the round trip: the ring becomes a
//! `FUTEX_WAKE`, and the kernel runs the woken waiter on the CPU it slept on. When that CPU has
//! gone idle (a quiet machine; in a VM without guest halt-polling the vCPU has halted), the wake is
//! an inter-processor interrupt and a CPU wake-up, tens of microseconds, where a pipe's write wakes
//! its reader synchronously and the scheduler may run it on the writer's CPU instead. The
//! syscalls themselves are no more than a pipe's (one wake, one wait per message). So kvshm's
//! waiters spin for [`DEFAULT_SPIN`] first, about the cost of such a wake-up: an answer that comes
//! within it costs neither side a system call (the ringer finds no sleeper), and a wait that
//! outlasts it costs at most twice what sleeping at once would have (the classic bound for
//! spin-then-block). The budget is time, not a count of checks, because a pause hint lasts from a
//! few to over a hundred cycles depending on the processor.
//!
//! Spinning only pays while the peer runs on another CPU. When the machine is crowded and the
//! kernel has put both processes on one CPU, a spinning waiter keeps its peer from running and
//! every answer waits out the whole spin. So every ring records the ringer's CPU in the doorbell
//! (a store only when it changes), and a waiter that finds itself on the CPU the last ring came
//! from sleeps at once: its peer then runs on the CPU it gives up, and the wake that follows is
//! a context switch on that CPU, the same as a pipe's.

mod futex;

use std::time::{Duration, Instant};

use futex::FutexWord;

use crate::sync::{fence, spin_loop, AtomicU32, Ordering};

/// A spin-then-sleep wake-up signal that works across processes sharing its memory.
///
/// `#[repr(C)]`, 64 bytes, one cache line; all-zero bytes are a valid idle doorbell, so it can be
/// embedded in a zero-initialised shared-memory header.
#[repr(C, align(64))]
pub struct Doorbell {
    /// Bumped by every ring that finds a sleeper; the futex word sleepers wait on.
    sequence: FutexWord,
    /// Waiters between registering (step 2) and deregistering (step 5).
    sleepers: AtomicU32,
    /// 1 + the CPU the last ring came from; 0 while unknown. A hint for waiters: whether to spin
    /// (module documentation, "How long to spin").
    ringer_cpu: AtomicU32,
    /// The rest of the cache line, as atomics: other processes map these bytes too, and no plain
    /// byte (not even padding) may sit behind a shared reference to it.
    _unused: [AtomicU32; 13],
}

#[cfg(not(loom))]
const _: () = assert!(size_of::<Doorbell>() == 64 && align_of::<Doorbell>() == 64);
#[cfg(not(loom))]
const _: () = assert!(size_of::<Doorbell>() == 16 * size_of::<AtomicU32>());

// SAFETY: every field is a u32 atomic (the futex word is a transparent AtomicU32), for which zero
// is a valid value, and zero is the idle state: no sleeper, sequence 0.
#[cfg(not(loom))]
unsafe impl bytemuck::Zeroable for Doorbell {}

// SAFETY: sixteen u32 atomics and no padding (asserted above); any bits are a valid doorbell (a
// wrong sleeper count costs a wake system call, a wrong sequence one spurious wake-up).
#[cfg(not(loom))]
unsafe impl crate::shm::SharedArea for Doorbell {}

/// The longest single sleep on the futex; longer sleep slices are cut to it (the waiter checks its
/// condition and sleeps again). Far below what the kernel accepts, far above any useful slice.
pub const MAX_SLEEP: Duration = Duration::from_secs(3600);

/// How long kvshm's waiters spin before they sleep (module documentation, "How long to spin").
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// Condition checks between two reads of the clock while spinning: a check and a pause take tens
/// of nanoseconds, a clock read about 25, so the budget is kept to within a few microseconds at a
/// cost of well under 1% of the spin.
pub const CHECKS_PER_CLOCK_READ: u32 = 64;

/// How a waiter waits: how long it spins, how long one sleep lasts, when it gives up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WaitPolicy {
    /// How long to keep checking the condition before the first sleep (`Duration::ZERO`: sleep
    /// at once; `Duration::MAX`: spin until ready or the deadline, never sleeping).
    pub spin: Duration,
    /// The longest single sleep; the condition is re-checked after each. Any value is accepted;
    /// one sleep lasts at most [`MAX_SLEEP`].
    pub sleep_slice: Duration,
    /// When to give up with [`WaitOutcome::TimedOut`]; `None` waits until ready.
    pub deadline: Option<Instant>,
}

impl WaitPolicy {
    /// Spin for `spin`, then sleep in slices of `sleep_slice`, without a deadline.
    pub const fn new(spin: Duration, sleep_slice: Duration) -> Self {
        Self { spin, sleep_slice, deadline: None }
    }

    /// The same policy giving up at `deadline`.
    pub fn until(self, deadline: Instant) -> Self {
        Self { deadline: Some(deadline), ..self }
    }

    /// The same policy giving up `timeout` from now (see [`deadline_after`]).
    pub fn within(self, timeout: Duration) -> Self {
        self.until(deadline_after(timeout))
    }
}

/// `timeout` from now. A timeout beyond what an `Instant` can hold (`Duration::MAX` for "wait
/// forever", a user's `--timeout 1e19`) gives a deadline a century away instead of overflowing.
pub fn deadline_after(timeout: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    let now = Instant::now();
    now.checked_add(timeout.min(CENTURY)).unwrap_or(now)
}

impl Default for WaitPolicy {
    /// [`DEFAULT_SPIN`] of spinning, then sleeps of 10 ms, no deadline.
    fn default() -> Self {
        Self::new(DEFAULT_SPIN, Duration::from_millis(10))
    }
}

/// How a wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitOutcome {
    /// The condition held.
    Ready,
    /// The deadline passed with the condition still false.
    TimedOut,
}

impl Doorbell {
    /// An idle doorbell (the same as zeroed memory).
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        Self {
            sequence: FutexWord::new(),
            sleepers: AtomicU32::new(0),
            ringer_cpu: AtomicU32::new(0),
            _unused: [const { AtomicU32::new(0) }; 13],
        }
    }

    /// An idle doorbell built from loom primitives.
    #[cfg(loom)]
    pub fn new() -> Self {
        Self {
            sequence: FutexWord::new(),
            sleepers: AtomicU32::new(0),
            ringer_cpu: AtomicU32::new(0),
            _unused: std::array::from_fn(|_| AtomicU32::new(0)),
        }
    }

    /// Wakes every waiter; call it after publishing what they wait for.
    ///
    /// Near-free when nobody sleeps: one fence and two loads (and a store when the ringing
    /// process moved to another CPU).
    pub fn ring(&self) {
        self.note_ringer_cpu();
        // SYNC: fence R of the module documentation; pairs with fence W in wait_until(): it
        // orders the caller's publishing stores before the load of `sleepers`.
        fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::Relaxed) != 0 {
            self.sequence.bump();
            self.sequence.wake_all();
        }
    }

    /// Waits until `ready()` returns true or the policy's deadline passes.
    ///
    /// `ready` must read what the publisher stores before calling [`ring`](Self::ring) (with
    /// Acquire loads if it then reads data published behind them).
    pub fn wait_until(&self, mut ready: impl FnMut() -> bool, policy: WaitPolicy) -> WaitOutcome {
        if !policy.spin.is_zero() && !self.ringer_shares_this_cpu() {
            let spin_until = policy.deadline.map_or(policy.spin, |deadline| {
                policy.spin.min(deadline.saturating_duration_since(Instant::now()))
            });
            let started = Instant::now();
            loop {
                for _ in 0..CHECKS_PER_CLOCK_READ {
                    if ready() {
                        return WaitOutcome::Ready;
                    }
                    spin_loop();
                }
                if started.elapsed() >= spin_until {
                    break;
                }
            }
        }
        loop {
            if ready() {
                return WaitOutcome::Ready;
            }
            let slice = match policy.deadline {
                None => policy.sleep_slice,
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return WaitOutcome::TimedOut;
                    }
                    policy.sleep_slice.min(deadline - now)
                }
            };
            let seen = self.sequence.load();
            self.sleepers.fetch_add(1, Ordering::Relaxed);
            // SYNC: fence W of the module documentation; pairs with fence R in ring(): it orders
            // the registration above before the check below.
            fence(Ordering::SeqCst);
            if ready() {
                self.sleepers.fetch_sub(1, Ordering::Relaxed);
                return WaitOutcome::Ready;
            }
            count_sleep();
            self.sequence.sleep(seen, slice);
            self.sleepers.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Waiters registered now (between deciding to sleep and waking up).
    pub fn sleepers(&self) -> u32 {
        self.sleepers.load(Ordering::Relaxed)
    }

    /// Forgets every registration: for a caller that knows no waiter can exist (the rank's
    /// worker is gone and the rank is being reclaimed), so that registrations of waiters killed
    /// in their sleep stop costing every later [`ring`](Self::ring) a wake system call.
    #[cfg(not(loom))]
    pub(crate) fn forget_sleepers(&self) {
        // Relaxed: the count is only a hint for ring(); the reclaim that calls this publishes
        // the rank's reset state with its own Release.
        self.sleepers.store(0, Ordering::Relaxed);
    }

    /// Records the calling CPU as the last ringer's, storing only when it changed (so that a
    /// ringer that stays on its CPU never writes the line).
    fn note_ringer_cpu(&self) {
        #[cfg(not(loom))]
        if let Some(cpu) = current_cpu() {
            let tag = cpu.wrapping_add(1);
            // Relaxed, both: a hint that publishes nothing; any value, even a stale or scribbled
            // one, only changes whether a waiter spins.
            if self.ringer_cpu.load(Ordering::Relaxed) != tag {
                self.ringer_cpu.store(tag, Ordering::Relaxed);
            }
        }
    }

    /// Whether the last ring came from the CPU this thread runs on: the ringer then most likely
    /// runs here too, and a spin would only keep it from the CPU (module documentation).
    fn ringer_shares_this_cpu(&self) -> bool {
        #[cfg(not(loom))]
        {
            // Relaxed: a hint (see note_ringer_cpu).
            let tag = self.ringer_cpu.load(Ordering::Relaxed);
            tag != 0 && current_cpu().map(|cpu| cpu.wrapping_add(1)) == Some(tag)
        }
        #[cfg(loom)]
        {
            false
        }
    }
}

/// The CPU the calling thread runs on, if the kernel says (a vDSO or rseq read, a few ns).
#[cfg(not(loom))]
fn current_cpu() -> Option<u32> {
    // SAFETY: sched_getcpu has no preconditions.
    u32::try_from(unsafe { libc::sched_getcpu() }).ok()
}

/// Futex sleeps that waits on the calling thread have begun, on any doorbell: how often a wait
/// really slept (benchmarks report it per round trip).
pub fn futex_sleeps() -> u64 {
    SLEEPS.with(std::cell::Cell::get)
}

thread_local! {
    static SLEEPS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

fn count_sleep() {
    SLEEPS.with(|sleeps| sleeps.set(sleeps.get() + 1));
}

impl Default for Doorbell {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Doorbell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Doorbell")
            .field("sequence", &self.sequence.load())
            .field("sleepers", &self.sleepers())
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::Arc;
    use std::thread;

    use super::*;
    use crate::sync::AtomicBool;

    #[test]
    fn zeroed_memory_is_an_idle_doorbell() {
        let doorbell: Doorbell = bytemuck::Zeroable::zeroed();
        doorbell.ring();
        assert_eq!(doorbell.sleepers(), 0);
        assert_eq!(doorbell.sequence.load(), 0, "a ring with no sleeper must not touch the futex");
        assert_eq!(doorbell.wait_until(|| true, WaitPolicy::default()), WaitOutcome::Ready);
    }

    #[test]
    fn a_wait_for_a_condition_that_already_holds_returns_at_once() {
        let doorbell = Doorbell::new();
        let policy = WaitPolicy::new(Duration::ZERO, Duration::from_secs(60));
        assert_eq!(doorbell.wait_until(|| true, policy), WaitOutcome::Ready);
        assert_eq!(doorbell.sleepers(), 0);
    }

    #[test]
    fn a_timeout_too_long_for_an_instant_is_a_long_wait_not_an_overflow() {
        let policy = WaitPolicy::default().within(Duration::MAX);
        let far = policy.deadline.expect("a deadline");
        assert!(far > Instant::now() + Duration::from_secs(365 * 24 * 3600));
        assert_eq!(
            Doorbell::new().wait_until(|| true, policy),
            WaitOutcome::Ready,
            "a wait with such a deadline still ends when its condition holds"
        );
    }

    #[test]
    fn a_sleep_slice_too_long_for_the_kernel_is_a_long_sleep_not_a_panic() {
        let doorbell = Arc::new(Doorbell::new());
        let published = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (doorbell, published) = (doorbell.clone(), published.clone());
            // No deadline: every sleep asks the kernel for the whole slice.
            thread::spawn(move || {
                // SYNC: pairs with the Release store of `published` below.
                doorbell.wait_until(
                    || published.load(Ordering::Acquire),
                    WaitPolicy::new(Duration::ZERO, Duration::MAX),
                )
            })
        };
        while doorbell.sleepers() == 0 && !waiter.is_finished() {
            thread::yield_now();
        }
        // Let the waiter reach the futex itself, not only the registration before it.
        thread::sleep(Duration::from_millis(20));
        // SYNC: pairs with the Acquire load of `published` in the waiter's condition.
        published.store(true, Ordering::Release);
        doorbell.ring();
        assert_eq!(waiter.join().expect("the waiter does not panic"), WaitOutcome::Ready);
    }

    #[test]
    fn a_condition_met_while_spinning_costs_no_sleep() {
        let doorbell = Doorbell::new();
        let sleeps = futex_sleeps();
        let mut checks = 0;
        let policy = WaitPolicy::new(Duration::from_secs(60), Duration::from_secs(60));
        let ready = || {
            checks += 1;
            checks == 1000
        };
        assert_eq!(doorbell.wait_until(ready, policy), WaitOutcome::Ready);
        assert_eq!(futex_sleeps(), sleeps);
        assert_eq!(doorbell.sleepers(), 0);
    }

    #[test]
    fn a_wait_sleeps_once_its_spin_budget_is_spent() {
        let doorbell = Doorbell::new();
        let sleeps = futex_sleeps();
        let policy = WaitPolicy::new(Duration::from_millis(1), Duration::from_millis(5))
            .within(Duration::from_millis(30));
        assert_eq!(doorbell.wait_until(|| false, policy), WaitOutcome::TimedOut);
        assert!(futex_sleeps() > sleeps, "the waiter never slept");
    }

    #[test]
    fn a_waiter_on_the_cpu_the_last_ring_came_from_sleeps_at_once() {
        // Pin this thread, so that the ring and the wait happen on one CPU.
        let cpu = current_cpu().expect("the kernel tells the CPU");
        // SAFETY: the set is a local the calls below only read and write; pid 0 is this thread,
        // which libtest runs for this test alone.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu as usize, &mut set);
            assert_eq!(libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set), 0);
        }
        let doorbell = Doorbell::new();
        doorbell.ring();
        let sleeps = futex_sleeps();
        // A spin as long as the deadline would time out without ever sleeping.
        let policy = WaitPolicy::new(Duration::from_secs(60), Duration::from_millis(5))
            .within(Duration::from_millis(30));
        assert_eq!(doorbell.wait_until(|| false, policy), WaitOutcome::TimedOut);
        assert!(futex_sleeps() > sleeps, "the waiter spun on its peer's CPU");
    }

    #[test]
    fn a_spin_without_end_still_gives_up_at_the_deadline() {
        let doorbell = Doorbell::new();
        let sleeps = futex_sleeps();
        let policy = WaitPolicy::new(Duration::MAX, Duration::from_millis(5))
            .within(Duration::from_millis(30));
        assert_eq!(doorbell.wait_until(|| false, policy), WaitOutcome::TimedOut);
        assert!(futex_sleeps() <= sleeps + 1, "a busy waiter sleeps at most once, at its end");
    }

    #[test]
    fn a_wait_gives_up_at_its_deadline() {
        let doorbell = Doorbell::new();
        let started = Instant::now();
        let policy = WaitPolicy::new(Duration::from_micros(10), Duration::from_millis(5))
            .within(Duration::from_millis(30));
        assert_eq!(doorbell.wait_until(|| false, policy), WaitOutcome::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(30));
        assert_eq!(doorbell.sleepers(), 0, "a waiter deregisters after each sleep");
    }

    #[test]
    fn a_ring_wakes_a_registered_sleeper() {
        let doorbell = Arc::new(Doorbell::new());
        let published = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (doorbell, published) = (doorbell.clone(), published.clone());
            thread::spawn(move || {
                let policy = WaitPolicy::new(Duration::ZERO, Duration::from_secs(60))
                    .within(Duration::from_secs(60));
                // SYNC: pairs with the Release store of `published` below.
                doorbell.wait_until(|| published.load(Ordering::Acquire), policy)
            })
        };
        while doorbell.sleepers() == 0 {
            thread::yield_now();
        }
        // SYNC: pairs with the Acquire load of `published` in the waiter's condition.
        published.store(true, Ordering::Release);
        doorbell.ring();
        assert_eq!(waiter.join().unwrap(), WaitOutcome::Ready);
        assert_eq!(doorbell.sleepers(), 0);
    }

    #[test]
    fn ping_pong_through_two_doorbells_never_stalls() {
        let to_peer = Arc::new((Doorbell::new(), crate::sync::AtomicU64::new(0)));
        let to_me = Arc::new((Doorbell::new(), crate::sync::AtomicU64::new(0)));
        let policy = WaitPolicy::new(Duration::from_micros(1), Duration::from_secs(60))
            .within(Duration::from_secs(60));
        let peer = {
            let (to_peer, to_me) = (to_peer.clone(), to_me.clone());
            thread::spawn(move || {
                for round in 1..=2000u64 {
                    // SYNC: pairs with the Release store of the counter by the main thread.
                    let outcome =
                        to_peer.0.wait_until(|| to_peer.1.load(Ordering::Acquire) >= round, policy);
                    assert_eq!(outcome, WaitOutcome::Ready);
                    // SYNC: pairs with the Acquire load of the counter in the main thread's wait.
                    to_me.1.store(round, Ordering::Release);
                    to_me.0.ring();
                }
            })
        };
        for round in 1..=2000u64 {
            // SYNC: pairs with the Acquire load of the counter in the peer thread's wait.
            to_peer.1.store(round, Ordering::Release);
            to_peer.0.ring();
            // SYNC: pairs with the Release store of the counter by the peer thread.
            let outcome = to_me.0.wait_until(|| to_me.1.load(Ordering::Acquire) >= round, policy);
            assert_eq!(outcome, WaitOutcome::Ready);
        }
        peer.join().unwrap();
    }
}
