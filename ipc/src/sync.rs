//! The synchronisation primitives every shared-memory type uses: std normally, loom under `cfg(loom)`.
//!
//! Code that touches memory another thread or process can see names its atomics and cells through
//! this module (clippy's `disallowed-types` enforces it), so that `RUSTFLAGS="--cfg loom"` swaps in
//! loom's model-checked versions without changing a line of the ring or doorbell code.
//!
//! - [`AtomicU8`], [`AtomicU32`], [`AtomicU64`], [`AtomicBool`], [`Ordering`], [`fence`]: std or loom. The std
//!   atomics are wrapped in `#[repr(transparent)]` newtypes with std's methods, because clippy's
//!   `disallowed-types` sees through a plain re-export.
//! - [`UnsafeCell`]: loom's tracked cell, or a `#[repr(transparent)]` std wrapper with the same
//!   closure API (`with`, `with_mut`), so that a slot in mapped memory can be viewed as a cell.
//! - [`spin_loop`]: a CPU pause hint; under loom a yield, so that a spinning thread lets the model
//!   schedule the thread it waits for.
//! - `step_point`: a named point between two steps of a protocol where a unit test can pause the
//!   calling thread, to force one interleaving deterministically (a no-op outside unit tests).
//!
//! Std atomics have the in-memory representation of the plain integer, which is what lets the ring
//! and the doorbell place them in mapped memory. Loom's do not, so under loom only the heap-backed
//! constructors exist.

#[cfg(not(loom))]
pub use std::sync::atomic::{fence, Ordering};

#[cfg(not(loom))]
pub use std_atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8};

#[cfg(loom)]
pub use loom::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};

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

/// Marks the point `name` between two steps of a shared-memory protocol. A unit test may pause
/// the calling thread here (`step_hook::install`, in unit tests only) to force one interleaving
/// with another thread; everywhere else this compiles to nothing.
#[inline(always)]
pub(crate) fn step_point(name: &'static str) {
    #[cfg(all(test, not(loom)))]
    step_hook::reached(name);
    #[cfg(not(all(test, not(loom))))]
    let _ = name;
}

/// The per-thread hooks behind [`step_point`] (unit tests only).
#[cfg(all(test, not(loom)))]
pub(crate) mod step_hook {
    use std::cell::RefCell;

    type Hook = Box<dyn FnMut(&'static str)>;

    thread_local! {
        static HOOK: RefCell<Option<Hook>> = const { RefCell::new(None) };
    }

    /// Calls `hook` with the name of every step point the calling thread reaches from now on.
    pub(crate) fn install(hook: impl FnMut(&'static str) + 'static) {
        HOOK.with(|slot| *slot.borrow_mut() = Some(Box::new(hook)));
    }

    pub(super) fn reached(name: &'static str) {
        HOOK.with(|slot| {
            if let Some(hook) = slot.borrow_mut().as_mut() {
                hook(name);
            }
        });
    }
}

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

#[cfg(not(loom))]
#[allow(clippy::disallowed_types)] // the one place that wraps std's atomics
mod std_atomic {
    use std::sync::atomic::Ordering;

    /// Defines a `#[repr(transparent)]` wrapper of a std atomic integer with std's methods.
    macro_rules! atomic_integer {
        ($name:ident, $std:ty, $int:ty) => {
            #[doc = concat!("`", stringify!($std), "` with the same methods and in-memory representation.")]
            #[repr(transparent)]
            #[derive(Debug, Default)]
            pub struct $name($std);

            impl $name {
                pub const fn new(value: $int) -> Self {
                    Self(<$std>::new(value))
                }
                #[inline]
                pub fn load(&self, order: Ordering) -> $int {
                    self.0.load(order)
                }
                #[inline]
                pub fn store(&self, value: $int, order: Ordering) {
                    self.0.store(value, order)
                }
                #[inline]
                pub fn swap(&self, value: $int, order: Ordering) -> $int {
                    self.0.swap(value, order)
                }
                #[inline]
                pub fn compare_exchange(
                    &self,
                    current: $int,
                    new: $int,
                    success: Ordering,
                    failure: Ordering,
                ) -> Result<$int, $int> {
                    self.0.compare_exchange(current, new, success, failure)
                }
                #[inline]
                pub fn compare_exchange_weak(
                    &self,
                    current: $int,
                    new: $int,
                    success: Ordering,
                    failure: Ordering,
                ) -> Result<$int, $int> {
                    self.0.compare_exchange_weak(current, new, success, failure)
                }
                #[inline]
                pub fn fetch_add(&self, value: $int, order: Ordering) -> $int {
                    self.0.fetch_add(value, order)
                }
                #[inline]
                pub fn fetch_sub(&self, value: $int, order: Ordering) -> $int {
                    self.0.fetch_sub(value, order)
                }
                #[inline]
                pub fn fetch_or(&self, value: $int, order: Ordering) -> $int {
                    self.0.fetch_or(value, order)
                }
                #[inline]
                pub fn fetch_and(&self, value: $int, order: Ordering) -> $int {
                    self.0.fetch_and(value, order)
                }
                #[inline]
                pub fn fetch_max(&self, value: $int, order: Ordering) -> $int {
                    self.0.fetch_max(value, order)
                }
                #[inline]
                pub fn fetch_min(&self, value: $int, order: Ordering) -> $int {
                    self.0.fetch_min(value, order)
                }
                #[inline]
                pub fn get_mut(&mut self) -> &mut $int {
                    self.0.get_mut()
                }
                #[inline]
                pub fn into_inner(self) -> $int {
                    self.0.into_inner()
                }
            }

            impl From<$int> for $name {
                fn from(value: $int) -> Self {
                    Self::new(value)
                }
            }
        };
    }

    atomic_integer!(AtomicU8, std::sync::atomic::AtomicU8, u8);
    atomic_integer!(AtomicU32, std::sync::atomic::AtomicU32, u32);
    atomic_integer!(AtomicU64, std::sync::atomic::AtomicU64, u64);

    /// `std::sync::atomic::AtomicBool` with the same methods and in-memory representation.
    #[repr(transparent)]
    #[derive(Debug, Default)]
    pub struct AtomicBool(std::sync::atomic::AtomicBool);

    impl AtomicBool {
        pub const fn new(value: bool) -> Self {
            Self(std::sync::atomic::AtomicBool::new(value))
        }
        #[inline]
        pub fn load(&self, order: Ordering) -> bool {
            self.0.load(order)
        }
        #[inline]
        pub fn store(&self, value: bool, order: Ordering) {
            self.0.store(value, order)
        }
        #[inline]
        pub fn swap(&self, value: bool, order: Ordering) -> bool {
            self.0.swap(value, order)
        }
        #[inline]
        pub fn compare_exchange(
            &self,
            current: bool,
            new: bool,
            success: Ordering,
            failure: Ordering,
        ) -> Result<bool, bool> {
            self.0.compare_exchange(current, new, success, failure)
        }
        #[inline]
        pub fn fetch_or(&self, value: bool, order: Ordering) -> bool {
            self.0.fetch_or(value, order)
        }
        #[inline]
        pub fn fetch_and(&self, value: bool, order: Ordering) -> bool {
            self.0.fetch_and(value, order)
        }
        #[inline]
        pub fn get_mut(&mut self) -> &mut bool {
            self.0.get_mut()
        }
        #[inline]
        pub fn into_inner(self) -> bool {
            self.0.into_inner()
        }
    }

    impl From<bool> for AtomicBool {
        fn from(value: bool) -> Self {
            Self::new(value)
        }
    }

    const _: () = assert!(size_of::<AtomicU64>() == 8 && align_of::<AtomicU64>() == 8);
    const _: () = assert!(size_of::<AtomicU32>() == 4 && align_of::<AtomicU32>() == 4);
    const _: () = assert!(size_of::<AtomicBool>() == 1);
    const _: () = assert!(size_of::<AtomicU8>() == 1);
}
