//! The writing side of a ring.
//!
//! The producer owns the tail: it keeps the authoritative copy locally and only ever stores it to
//! shared memory. It caches the consumer's head and re-reads it only when the cached value says the
//! ring has too little room. Pushing a batch:
//!
//! 1. if the batch does not fit by the cached head, load the head (Acquire) and cache it;
//! 2. if it still does not fit, fail with [`RingFull`] having written nothing;
//! 3. copy every record into its slot;
//! 4. store the new tail once (Release): the consumer sees the whole batch or none of it.
//!
//! All index arithmetic wraps (see the ring module's index rule). A head read from shared memory
//! that does not make sense (behind the cached one, or ahead of the tail) is ignored: the producer keeps its older, smaller view of the free
//! space, so it never overwrites a slot the consumer has not released, and reports the fault
//! through [`Producer::consumer_fault`].

use bytemuck::Pod;

use super::error::{RingError, RingFull};
use super::layout::RingView;
use crate::sync::Ordering;

/// Pushes records into a single-producer single-consumer ring.
#[derive(Debug)]
pub struct Producer<T> {
    view: RingView<T>,
    /// Records published so far; the shared tail is a copy of it.
    tail: u64,
    /// The consumer's head as last read; `tail - cached_head <= capacity` always holds.
    cached_head: u64,
    /// The last nonsensical head read from shared memory, if any.
    fault: Option<RingError>,
}

// SAFETY: a Producer is the only writer of its ring's tail and of unpublished slots, wherever it is
// moved; the records it copies are Pod (plain bytes), so sending it to another thread is sound.
unsafe impl<T: Pod> Send for Producer<T> {}

impl<T: Pod> Producer<T> {
    /// Attaches the producing side of the ring that [`init`](super::init) set up at `base`.
    ///
    /// # Safety
    ///
    /// 1. `base` is valid for reads and writes of `len` bytes for as long as the producer lives.
    /// 2. At most one producer is attached to the ring at a time, and the memory is otherwise used
    ///    only by at most one consumer (possibly in another process).
    ///
    /// # Errors
    ///
    /// A [`RingError`] if the memory is misaligned, too short, not an initialised ring of `T`, or
    /// its indices do not make sense.
    #[cfg(not(loom))]
    pub unsafe fn attach(base: *mut u8, len: usize) -> Result<Self, RingError> {
        // SAFETY: premises 1 and 2 of this function are those of RingView::attach.
        let view = unsafe { RingView::attach(base, len)? };
        Self::from_view(view)
    }

    pub(crate) fn from_view(view: RingView<T>) -> Result<Self, RingError> {
        // Relaxed: this side's own index; what handed the ring to this producer (the scheduler's
        // own thread, which also reset it) orders a predecessor's last store or a reset before
        // this load.
        let tail = view.header().tail.value.load(Ordering::Relaxed);
        // SYNC: pairs with the Release store of head in Consumer::release().
        let head = view.header().head.value.load(Ordering::Acquire);
        view.occupancy_at_attach(head, tail)?;
        Ok(Self { view, tail, cached_head: head, fault: None })
    }

    /// How many records the ring holds when full.
    pub fn capacity(&self) -> usize {
        self.view.capacity() as usize
    }

    /// Free slots now: re-reads the consumer's head.
    pub fn free_slots(&mut self) -> usize {
        self.refresh_head();
        self.cached_free() as usize
    }

    /// Publishes one record.
    ///
    /// # Errors
    ///
    /// [`RingFull`] if the consumer has not released a slot for it.
    pub fn push(&mut self, record: T) -> Result<(), RingFull> {
        self.push_all(std::slice::from_ref(&record))
    }

    /// Publishes all `records` with one Release store, or none of them.
    ///
    /// # Errors
    ///
    /// [`RingFull`] if fewer than `records.len()` slots are free; nothing was written. A batch
    /// larger than [`capacity`](Self::capacity) never fits: split it first.
    pub fn push_all(&mut self, records: &[T]) -> Result<(), RingFull> {
        let count = records.len() as u64;
        if count > self.cached_free() {
            self.refresh_head();
            if count > self.cached_free() {
                return Err(RingFull);
            }
        }
        for (offset, record) in (0u64..).zip(records) {
            self.view.slot(self.tail.wrapping_add(offset)).with_mut(|slot| {
                // SAFETY: 1. in bounds and aligned (RingView::slot); 2. no data race: the slot
                // lies between tail and head + capacity, so the consumer has released it and
                // reads it only after the tail store below publishes it (trusted peer: a
                // consumer process reading it early anyway races this write, and gets a torn
                // record); 3. a volatile store of a Pod, written exactly once.
                unsafe { slot.write_volatile(*record) }
            });
        }
        self.tail = self.tail.wrapping_add(count);
        // SYNC: pairs with the Acquire load of tail in Consumer::refresh_tail(), which then sees
        // every slot written above.
        self.view.header().tail.value.store(self.tail, Ordering::Release);
        Ok(())
    }

    /// The last head read from shared memory that made no sense, if the consumer ever wrote one.
    pub fn consumer_fault(&self) -> Option<RingError> {
        self.fault
    }

    fn cached_free(&self) -> u64 {
        self.view.capacity() - self.tail.wrapping_sub(self.cached_head)
    }

    fn refresh_head(&mut self) {
        // SYNC: pairs with the Release store of head in Consumer::release(): slots below the head
        // have been read and may be overwritten.
        let head = self.view.header().head.value.load(Ordering::Acquire);
        // The head may only move forwards, and not past the tail: it must lie in
        // `cached_head..=tail` (modulo 2^64), which also keeps `tail - head <= capacity`.
        let released = head.wrapping_sub(self.cached_head);
        if released <= self.tail.wrapping_sub(self.cached_head) {
            self.cached_head = head;
        } else {
            self.fault = Some(self.view.corrupt(head, self.tail));
        }
    }
}
