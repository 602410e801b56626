//! Sharing one Rust object between Python threads: taking its lock without holding the GIL, and
//! waiting without holding the lock.
//!
//! `Service` and `HostTier` keep their Rust object behind a `Mutex`. Two rules keep two Python
//! threads from deadlocking on it, or one from shutting the other out:
//! - [`lock`] never blocks on the mutex with the GIL held: a thread that finds it taken lets go of
//!   the GIL first (else the holder, needing the GIL back to finish, would wait for it forever);
//! - [`wait_unlocked`] holds the mutex only for one poll at a time and sleeps without it, on the
//!   object's [`CompletionBell`], so that another thread's calls run while a wait goes on.
//!
//! One wait ([`wait_unlocked`]): 1. note the completion rings' tails; 2. take the lock, run one
//! step (poll and check); 3. let go of the lock; return if the step is done or time is up;
//! 4. with the GIL released, sleep until a tail moves or a short slice passes; 5. let Python
//! handle pending signals (Ctrl-C ends a long wait), then go back to 1.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvshm::service::{CompletionBell, SegmentError, WaitPolicy, WAIT_SLICE, WAIT_SPIN};
use pyo3::prelude::*;
use pyo3::sync::MutexExt;

/// Takes `mutex` without blocking on it while holding the GIL (module documentation).
pub fn lock<'a, T>(py: Python<'_>, mutex: &'a Mutex<T>) -> MutexGuard<'a, T> {
    // A panic inside a call (a bug) does not make the object unusable for the next one.
    mutex.lock_py_attached(py).unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Runs `step` on the object under `mutex` (opened by `open`) until it returns `Some`, sleeping
/// between steps without the lock or the GIL (module documentation); `None` after `timeout`.
pub fn wait_unlocked<S: HasBell, T>(
    py: Python<'_>,
    mutex: &Mutex<Option<S>>,
    open: impl Fn(&mut Option<S>) -> PyResult<&mut S>,
    timeout: Duration,
    mut step: impl FnMut(&mut S) -> PyResult<Option<T>>,
) -> PyResult<Option<T>> {
    let deadline = kvshm_ipc::doorbell::deadline_after(timeout);
    let bell = {
        let mut guard = lock(py, mutex);
        open(&mut guard)?.bell().map_err(crate::errors::ToPyErr::to_py)?
    };
    let mut seen = Vec::new();
    loop {
        bell.tails(&mut seen);
        let done = {
            let mut guard = lock(py, mutex);
            step(open(&mut guard)?)?
        };
        if done.is_some() {
            return Ok(done);
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(None);
        }
        let policy = WaitPolicy::new(WAIT_SPIN, WAIT_SLICE).until(deadline.min(now + WAIT_SLICE));
        py.detach(|| bell.wait_for_answers(&seen, policy));
        py.check_signals()?;
    }
}

/// An object a thread can wait on with [`wait_unlocked`].
pub trait HasBell {
    fn bell(&self) -> Result<CompletionBell, SegmentError>;
}

impl HasBell for kvshm::service::Service {
    fn bell(&self) -> Result<CompletionBell, SegmentError> {
        self.completion_bell()
    }
}

impl HasBell for kvshm::offload::HostTier {
    fn bell(&self) -> Result<CompletionBell, SegmentError> {
        self.completion_bell()
    }
}
