//! The word a doorbell's sleepers wait on: a process-shared Linux futex, or its loom model.
//!
//! Both versions offer the same four operations: `load`, `bump` (add one), `sleep(expected,
//! timeout)` (sleep unless the word differs from `expected`, until woken or the timeout passes)
//! and `wake_all`.
//!
//! The loom model keeps the one property the doorbell relies on: checking the word and starting
//! to sleep are atomic with respect to `wake_all` (the kernel holds its hash-bucket lock for both;
//! the model holds a mutex). It ignores timeouts, so that a lost wake-up leaves the sleeper blocked
//! forever and loom reports the deadlock.

#[cfg(not(loom))]
pub(super) use real::FutexWord;

#[cfg(loom)]
pub(super) use model::FutexWord;

#[cfg(not(loom))]
mod real {
    use std::time::Duration;

    use linux_futex::{Futex, Shared};

    use crate::sync::Ordering;

    /// A `FUTEX_WAIT`/`FUTEX_WAKE` word without `FUTEX_PRIVATE_FLAG`, so that processes mapping the
    /// same memory at different addresses wake each other. Zeroed memory is a valid word.
    #[repr(transparent)]
    pub(in crate::doorbell) struct FutexWord(Futex<Shared>);

    impl FutexWord {
        pub(in crate::doorbell) const fn new() -> Self {
            Self(Futex::new(0))
        }

        /// The current value. Relaxed: the value carries no data; it only lets the kernel tell
        /// whether a bump came between this load and the sleep.
        pub(in crate::doorbell) fn load(&self) -> u32 {
            self.0.value.load(Ordering::Relaxed)
        }

        /// Adds one (wrapping). Relaxed for the same reason as `load`.
        pub(in crate::doorbell) fn bump(&self) {
            self.0.value.fetch_add(1, Ordering::Relaxed);
        }

        /// Sleeps unless the word differs from `expected`, until woken, the timeout passes or a
        /// signal arrives; the caller re-checks its condition in every case.
        ///
        /// The timeout is clamped to [`MAX_SLEEP`](crate::doorbell::MAX_SLEEP): the kernel
        /// refuses a `timespec` whose seconds do not fit an `i64` (`Duration::MAX` would become
        /// -1 seconds, `EINVAL`, which linux-futex turns into a panic).
        pub(in crate::doorbell) fn sleep(&self, expected: u32, timeout: Duration) {
            // Every outcome (woken, value changed, timed out, interrupted) sends the caller back
            // to its checks, so the error carries nothing it needs.
            let _ = self.0.wait_for(expected, timeout.min(crate::doorbell::MAX_SLEEP));
        }

        pub(in crate::doorbell) fn wake_all(&self) {
            self.0.wake(i32::MAX);
        }
    }
}

#[cfg(loom)]
mod model {
    use std::time::Duration;

    use loom::sync::{Condvar, Mutex};

    use crate::sync::{AtomicU32, Ordering};

    /// A futex modelled with a loom mutex and condition variable.
    pub(in crate::doorbell) struct FutexWord {
        value: AtomicU32,
        /// Plays the kernel's hash-bucket lock.
        bucket: Mutex<()>,
        sleepers: Condvar,
    }

    impl FutexWord {
        pub(in crate::doorbell) fn new() -> Self {
            Self { value: AtomicU32::new(0), bucket: Mutex::new(()), sleepers: Condvar::new() }
        }

        pub(in crate::doorbell) fn load(&self) -> u32 {
            self.value.load(Ordering::Relaxed)
        }

        pub(in crate::doorbell) fn bump(&self) {
            self.value.fetch_add(1, Ordering::Relaxed);
        }

        /// Like FUTEX_WAIT without a timeout: the model must expose a lost wake-up as a deadlock.
        pub(in crate::doorbell) fn sleep(&self, expected: u32, _timeout: Duration) {
            let bucket = self.bucket.lock().expect("the model's bucket lock is never poisoned");
            if self.value.load(Ordering::Relaxed) != expected {
                return;
            }
            drop(self.sleepers.wait(bucket).expect("the model's bucket lock is never poisoned"));
        }

        pub(in crate::doorbell) fn wake_all(&self) {
            let _bucket = self.bucket.lock().expect("the model's bucket lock is never poisoned");
            self.sleepers.notify_all();
        }
    }
}
