//! The reading side of a ring.
//!
//! The consumer owns the head: it keeps the authoritative copy locally and only ever stores it to
//! shared memory. It caches the producer's tail and re-reads it only when the cached value does not
//! cover what the caller asks for. Popping a batch:
//!
//! 1. if the cached tail covers fewer records than asked, load the tail (Acquire) and check that
//!    `tail - head` lies in `0..=capacity` and that the tail did not move backwards (all index
//!    arithmetic wraps: see the ring module's index rule);
//! 2. copy up to `max` published records out of their slots;
//! 3. store the new head once (Release), handing all those slots back to the producer.
//!
//! A tail that fails the check is a [`RingError::Corrupt`]; nothing is read and nothing panics.

use bytemuck::Pod;

use super::error::RingError;
use super::layout::RingView;
use crate::sync::Ordering;

/// Pops records from a single-producer single-consumer ring.
#[derive(Debug)]
pub struct Consumer<T> {
    view: RingView<T>,
    /// Records consumed so far; the shared head is a copy of it.
    head: u64,
    /// The producer's tail as last read and checked; `cached_tail - head <= capacity` always holds.
    cached_tail: u64,
}

// SAFETY: a Consumer is the only reader of published slots and the only writer of its ring's head,
// wherever it is moved; the records are Pod, so sending it to another thread is sound.
unsafe impl<T: Pod> Send for Consumer<T> {}

impl<T: Pod> Consumer<T> {
    /// Attaches the consuming side of the ring that [`init`](super::init) set up at `base`.
    ///
    /// # Safety
    ///
    /// 1. `base` is valid for reads and writes of `len` bytes for as long as the consumer lives.
    /// 2. At most one consumer is attached to the ring at a time, and the memory is otherwise used
    ///    only by at most one producer (possibly in another process).
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
        // Relaxed: this side's own index; what handed the ring to this consumer (a claim's
        // Acquire of the owner word, or this thread) orders a predecessor's last store or a
        // reset before this load.
        let head = view.header().head.value.load(Ordering::Relaxed);
        // SYNC: pairs with the Release store of tail in Producer::push_all().
        let tail = view.header().tail.value.load(Ordering::Acquire);
        view.occupancy_at_attach(head, tail)?;
        Ok(Self { view, head, cached_tail: tail })
    }

    /// How many records the ring holds when full.
    pub fn capacity(&self) -> usize {
        self.view.capacity() as usize
    }

    /// Published records not yet popped: re-reads the producer's tail.
    ///
    /// # Errors
    ///
    /// [`RingError::Corrupt`] if the tail in shared memory makes no sense.
    pub fn len(&mut self) -> Result<usize, RingError> {
        self.refresh_tail().map(|len| len as usize)
    }

    /// Whether no published record is waiting: re-reads the producer's tail.
    ///
    /// # Errors
    ///
    /// [`RingError::Corrupt`] if the tail in shared memory makes no sense.
    pub fn is_empty(&mut self) -> Result<bool, RingError> {
        self.len().map(|len| len == 0)
    }

    /// Pops one record, or `None` if none is published.
    ///
    /// # Errors
    ///
    /// [`RingError::Corrupt`] if the tail in shared memory makes no sense.
    pub fn pop(&mut self) -> Result<Option<T>, RingError> {
        if self.cached_tail == self.head && self.refresh_tail()? == 0 {
            return Ok(None);
        }
        let record = self.read(self.head);
        self.release(1);
        Ok(Some(record))
    }

    /// Appends up to `max` published records to `out` and releases their slots with one store.
    ///
    /// Returns how many records were appended (0 if none is published or `max` is 0).
    ///
    /// # Errors
    ///
    /// [`RingError::Corrupt`] if the tail in shared memory makes no sense; nothing was appended.
    pub fn pop_into(&mut self, out: &mut Vec<T>, max: usize) -> Result<usize, RingError> {
        let wanted = max as u64;
        let mut available = self.cached_available();
        if available < wanted {
            available = self.refresh_tail()?;
        }
        let count = available.min(wanted);
        if count == 0 {
            return Ok(0);
        }
        out.reserve(count as usize);
        let head = self.head;
        out.extend((0..count).map(|offset| self.read(head.wrapping_add(offset))));
        self.release(count);
        Ok(count as usize)
    }

    /// Published records not yet popped, as of the cached tail (at most the capacity).
    fn cached_available(&self) -> u64 {
        self.cached_tail.wrapping_sub(self.head)
    }

    /// Copies record `index` out of its slot; `index` is in `head..cached_tail` (modulo 2^64).
    fn read(&self, index: u64) -> T {
        debug_assert!(index.wrapping_sub(self.head) < self.cached_available());
        self.view.slot(index).with(|slot| {
            // SAFETY: 1. in bounds and aligned (RingView::slot); 2. no data race: the producer
            // published this slot (index < cached_tail, loaded with Acquire) and writes it again
            // only after our head moves past it; that holds as long as the peer keeps the ring
            // protocol (trusted peer: a producer process writing a published slot anyway races
            // this read, and gets a torn record that the reader validates like any other);
            // 3. a volatile copy of a Pod: any bytes are a valid T, read exactly once, so the
            // checks on the copy hold for the value used.
            unsafe { slot.read_volatile() }
        })
    }

    /// Hands `count` read slots back to the producer.
    fn release(&mut self, count: u64) {
        self.head = self.head.wrapping_add(count);
        // SYNC: pairs with the Acquire load of head in Producer::refresh_head(), which may then
        // overwrite the slots read before this store.
        self.view.header().head.value.store(self.head, Ordering::Release);
    }

    /// Loads and checks the producer's tail; returns the records available.
    fn refresh_tail(&mut self) -> Result<u64, RingError> {
        // SYNC: pairs with the Release store of tail in Producer::push_all(): every slot below the
        // tail is written.
        let tail = self.view.header().tail.value.load(Ordering::Acquire);
        let available = self.view.occupancy(self.head, tail)?;
        // The tail may only move forwards: `available` counts from the same head as the cache.
        if available < self.cached_available() {
            return Err(self.view.corrupt(self.head, tail));
        }
        self.cached_tail = tail;
        Ok(available)
    }
}
