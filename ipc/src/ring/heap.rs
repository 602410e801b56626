//! Rings in ordinary heap memory, for tests and loom models, driven by the same producer and
//! consumer code as rings in shared memory.
//!
//! Normally [`heap`] allocates zeroed, 64-byte aligned memory of [`memory_size`] bytes and goes
//! through exactly the shared-memory path: [`init`], then `attach` of each side. Under loom, whose
//! atomics cannot be conjured from raw bytes, it builds the header with loom atomics and the slots
//! as loom cells, so that loom tracks every slot access.
//!
//! [`memory_size`]: super::memory_size
//! [`init`]: super::init

use std::sync::Arc;

use bytemuck::Pod;

use super::consumer::Consumer;
use super::producer::Producer;

/// A fresh empty ring of `capacity` records on the heap, split into its two sides.
///
/// The memory lives until both sides are dropped.
///
/// # Panics
///
/// If `capacity` is not a power of two up to [`MAX_CAPACITY`](super::MAX_CAPACITY) (a programming
/// error: heap rings are built by tests and benchmarks with constant capacities).
#[cfg(not(loom))]
pub fn heap<T: Pod>(capacity: usize) -> (Producer<T>, Consumer<T>) {
    use super::layout::{init, memory_size, RingView};

    let len = memory_size::<T>(capacity);
    let memory = Arc::new(HeapMemory::zeroed(len));
    let base = memory.base.as_ptr();
    let attach_error = "a fresh heap ring failing validation is a programming error";
    // SAFETY: 1. `base` is aligned to 64 and valid for `len` bytes, `len` being
    // memory_size(capacity); 2. nobody else has seen the memory yet.
    unsafe { init::<T>(base, capacity) };
    // SAFETY: the memory is valid for `len` bytes while the views keep `memory` alive, and it is
    // used by exactly this one producer and one consumer.
    let producer_view = unsafe { RingView::attach(base, len) }.expect(attach_error);
    // SAFETY: as above.
    let consumer_view = unsafe { RingView::attach(base, len) }.expect(attach_error);
    let producer = Producer::from_view(producer_view.keeping(memory.clone())).expect(attach_error);
    let consumer = Consumer::from_view(consumer_view.keeping(memory)).expect(attach_error);
    (producer, consumer)
}

/// Zeroed heap memory aligned for a ring; freed on drop.
#[cfg(not(loom))]
#[derive(Debug)]
struct HeapMemory {
    base: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

// SAFETY: the memory is only accessed through ring views, whose protocol (atomics on the indices,
// slots owned by one side at a time) makes concurrent use from two threads sound.
#[cfg(not(loom))]
unsafe impl Send for HeapMemory {}
// SAFETY: as for Send.
#[cfg(not(loom))]
unsafe impl Sync for HeapMemory {}

#[cfg(not(loom))]
impl HeapMemory {
    fn zeroed(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len, super::RING_ALIGN)
            .expect("a ring size that is no valid layout is a programming error");
        // SAFETY: `len` is at least the header size, so the layout is not zero-sized.
        let base = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(base) = std::ptr::NonNull::new(base) else {
            std::alloc::handle_alloc_error(layout)
        };
        Self { base, layout }
    }
}

#[cfg(not(loom))]
impl Drop for HeapMemory {
    fn drop(&mut self) {
        // SAFETY: allocated in zeroed() with this very layout, freed once.
        unsafe { std::alloc::dealloc(self.base.as_ptr(), self.layout) };
    }
}

/// A fresh empty ring of `capacity` records built from loom primitives, split into its two sides.
///
/// # Panics
///
/// If `capacity` is not a power of two up to [`MAX_CAPACITY`](super::MAX_CAPACITY).
#[cfg(loom)]
pub fn heap<T: Pod>(capacity: usize) -> (Producer<T>, Consumer<T>) {
    use std::ptr::NonNull;

    use super::layout::{capacity_is_valid, RingHeader, RingView, RING_MAGIC};
    use crate::sync::UnsafeCell;

    assert!(capacity_is_valid(capacity), "ring capacity {capacity} is not a valid capacity");
    let ring = Arc::new(LoomRing {
        header: RingHeader::new(RING_MAGIC, size_of::<T>(), capacity),
        slots: (0..capacity).map(|_| UnsafeCell::new(T::zeroed())).collect(),
    });
    let header = NonNull::from(&ring.header);
    let slots = NonNull::from(&ring.slots[0]);
    let attach_error = "a fresh heap ring failing validation is a programming error";
    // SAFETY: header and slots point into `ring`, an Arc allocation that never moves and that each
    // view keeps alive; the slice holds `capacity` cells, a power of two.
    let producer_view =
        unsafe { RingView::from_parts(header, slots, capacity as u64, ring.clone()) };
    // SAFETY: as above.
    let consumer_view = unsafe { RingView::from_parts(header, slots, capacity as u64, ring) };
    let producer = Producer::from_view(producer_view).expect(attach_error);
    let consumer = Consumer::from_view(consumer_view).expect(attach_error);
    (producer, consumer)
}

#[cfg(loom)]
struct LoomRing<T> {
    header: super::layout::RingHeader,
    slots: Box<[crate::sync::UnsafeCell<T>]>,
}

// SAFETY: the slots are only accessed through ring views, whose protocol is what the loom models
// check; the header is atomics; the records are Pod, plain bytes that may cross threads.
#[cfg(loom)]
unsafe impl<T: Pod> Sync for LoomRing<T> {}
// SAFETY: as for Sync.
#[cfg(loom)]
unsafe impl<T: Pod> Send for LoomRing<T> {}
