//! The synchronisation primitives every shared-memory type uses: std normally, loom under `cfg(loom)`.
//!
//! Code that touches memory another thread or process can see names its atomics and cells through
//! this module (clippy's `disallowed-types` enforces it), so that `RUSTFLAGS="--cfg loom"` swaps in
//! loom's model-checked versions without changing a line of the ring or doorbell code.
//!
//! - [`AtomicU32`], [`AtomicU64`], [`AtomicBool`], [`Ordering`], [`fence`]: std or loom.
//! - [`UnsafeCell`]: loom's tracked cell, or a `#[repr(transparent)]` std wrapper with the same
//!   closure API (`with`, `with_mut`), so that a slot in mapped memory can be viewed as a cell.
//! - [`spin_loop`]: a CPU pause hint; under loom a yield, so that a spinning thread lets the model
//!   schedule the thread it waits for.
//!
//! Std atomics have the in-memory representation of the plain integer, which is what lets the ring
//! and the doorbell place them in mapped memory. Loom's do not, so under loom only the heap-backed
//! constructors exist.

#[cfg(not(loom))]
pub use std::sync::atomic::{fence, Ordering};

#[cfg(not(loom))]
#[allow(clippy::disallowed_types)]
pub use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};

#[cfg(loom)]
pub use loom::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};

#[cfg(loom)]
pub use loom::cell::UnsafeCell;

/// Tells the processor that the caller is in a spin-wait loop.
#[cfg(not(loom))]
#[inline]
pub fn spin_loop() {
    std::hint::spin_loop();
}

/// Under loom a spin-wait iteration must yield, or the model would explore the spinning thread forever.
#[cfg(loom)]
#[inline]
pub fn spin_loop() {
    loom::thread::yield_now();
}

#[cfg(not(loom))]
pub use std_cell::UnsafeCell;

#[cfg(not(loom))]
#[allow(clippy::disallowed_types)] // the one place that wraps std's cell
mod std_cell {
    /// `std::cell::UnsafeCell` behind loom's closure API.
    ///
    /// `#[repr(transparent)]`: a `T` in mapped memory may be viewed as an `UnsafeCell<T>`.
    #[repr(transparent)]
    #[derive(Debug, Default)]
    pub struct UnsafeCell<T: ?Sized>(std::cell::UnsafeCell<T>);

    impl<T> UnsafeCell<T> {
        pub const fn new(value: T) -> Self {
            Self(std::cell::UnsafeCell::new(value))
        }

        pub fn into_inner(self) -> T {
            self.0.into_inner()
        }
    }

    impl<T: ?Sized> UnsafeCell<T> {
        /// Runs `f` with a shared pointer to the contents; the caller upholds aliasing rules.
        #[inline]
        pub fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
            f(self.0.get())
        }

        /// Runs `f` with a mutable pointer to the contents; the caller upholds aliasing rules.
        #[inline]
        pub fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
            f(self.0.get())
        }
    }
}
