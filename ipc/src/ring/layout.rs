//! The bytes of one ring and the checked view both sides hold of them.
//!
//! A ring is a [`RingHeader`] followed by `capacity` slots of `T`:
//!
//! ```text
//! offset   0  description line: magic, element size, capacity (written by init, and by reset)
//! offset 128  tail line: the producer's free-running u64 count of published records
//! offset 256  head line: the consumer's free-running u64 count of consumed records
//! offset 384  slot[0] .. slot[capacity - 1]; record i lives in slot[i % capacity]
//! ```
//!
//! Tail and head sit 128 bytes apart (an empty line between them and after the head), so that the
//! two sides never write the same cache line, nor the same pair of lines that an adjacent-line
//! prefetcher moves together.
//!
//! Setting up a ring in mapped memory takes two phases: [`memory_size`] tells the creator how many
//! bytes to reserve; [`init`] writes the description and stores the magic last with Release. Then
//! each side builds a [`RingView`] with [`RingView::attach`], which validates everything it reads
//! (alignment, length, magic, element size, capacity, indices) and afterwards trusts only its own
//! copy of the capacity, so every slot access is masked into bounds whatever the peer writes.

use std::any::Any;
use std::ptr::NonNull;
use std::sync::Arc;

use bytemuck::Pod;

use super::error::RingError;
#[cfg(not(loom))]
use crate::sync::Ordering;
use crate::sync::{AtomicU64, UnsafeCell};

/// "KVSHRNG1": marks initialised ring memory of this layout version.
pub(crate) const RING_MAGIC: u64 = u64::from_le_bytes(*b"KVSHRNG1");

/// Alignment the ring's memory must have; slot types may not be aligned more strictly.
pub const RING_ALIGN: usize = 64;

/// The largest capacity a ring may have (records, not bytes).
pub const MAX_CAPACITY: usize = 1 << 32;

/// Bytes before the first slot.
pub(crate) const HEADER_SIZE: usize = 384;

/// The description of a ring, written by [`init`] and again, the same, by [`reset`].
///
/// Atomics although nobody changes them after `init`: the memory is shared with another process,
/// and an atomic read of a field a faulty peer scribbles over is still a defined read.
#[repr(C, align(64))]
pub(crate) struct Description {
    pub(crate) magic: AtomicU64,
    pub(crate) element_size: AtomicU64,
    pub(crate) capacity: AtomicU64,
    _unused: [AtomicU64; 5],
}

/// One free-running index alone on its cache line.
#[repr(C, align(64))]
pub(crate) struct IndexLine {
    pub(crate) value: AtomicU64,
    _unused: [AtomicU64; 7],
}

/// A cache line nobody touches, keeping the indices 128 bytes apart.
#[repr(C, align(64))]
struct EmptyLine([AtomicU64; 8]);

fn unused_words<const N: usize>() -> [AtomicU64; N] {
    std::array::from_fn(|_| AtomicU64::new(0))
}

/// The start of ring memory. See the module documentation for the offsets.
///
/// Every byte is an atomic, padding lines included: both ends hold a shared reference to the
/// header while the other process writes its indices, so no plain byte may sit behind it.
pub(crate) struct RingHeader {
    // Under loom rings are built already described (heap()), and nothing reads the description.
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) description: Description,
    _gap_after_description: EmptyLine,
    /// Written only by the producer (Release), read by the consumer (Acquire).
    pub(crate) tail: IndexLine,
    _gap_after_tail: EmptyLine,
    /// Written only by the consumer (Release), read by the producer (Acquire).
    pub(crate) head: IndexLine,
    _gap_after_head: EmptyLine,
}

#[cfg(not(loom))]
const _: () = assert!(size_of::<RingHeader>() == HEADER_SIZE);
#[cfg(not(loom))]
const _: () = assert!(HEADER_SIZE == 48 * size_of::<AtomicU64>(), "a header of atomics only");
#[cfg(not(loom))]
const _: () = assert!(std::mem::offset_of!(RingHeader, tail) == 128);
#[cfg(not(loom))]
const _: () = assert!(std::mem::offset_of!(RingHeader, head) == 256);
const _: () = assert!(HEADER_SIZE % RING_ALIGN == 0);

impl RingHeader {
    /// A header with empty indices. `magic` is 0 when [`init`] writes it, so that the magic can be
    /// published last.
    pub(crate) fn new(magic: u64, element_size: usize, capacity: usize) -> Self {
        Self {
            description: Description {
                magic: AtomicU64::new(magic),
                element_size: AtomicU64::new(element_size as u64),
                capacity: AtomicU64::new(capacity as u64),
                _unused: unused_words(),
            },
            _gap_after_description: EmptyLine(unused_words()),
            tail: IndexLine { value: AtomicU64::new(0), _unused: unused_words() },
            _gap_after_tail: EmptyLine(unused_words()),
            head: IndexLine { value: AtomicU64::new(0), _unused: unused_words() },
            _gap_after_head: EmptyLine(unused_words()),
        }
    }
}

/// Whether `capacity` is one a ring may have: a power of two up to [`MAX_CAPACITY`].
pub fn capacity_is_valid(capacity: usize) -> bool {
    capacity.is_power_of_two() && capacity <= MAX_CAPACITY
}

/// Bytes a ring of `capacity` records of `T` occupies: the header and the slots, a multiple of 64.
///
/// # Panics
///
/// If `capacity` is not valid (see [`capacity_is_valid`]) or the size overflows `usize`: the
/// creator checks its configuration before sizing memory, so either is a programming error.
pub fn memory_size<T: Pod>(capacity: usize) -> usize {
    const { assert!(align_of::<T>() <= RING_ALIGN, "ring slots may be aligned to 64 bytes at most") };
    assert!(capacity_is_valid(capacity), "ring capacity {capacity} is not a valid capacity");
    checked_memory_size::<T>(capacity as u64)
        .expect("a ring too large for the address space is a programming error")
}

fn checked_memory_size<T>(capacity: u64) -> Option<usize> {
    let slots = usize::try_from(capacity).ok()?.checked_mul(size_of::<T>())?;
    HEADER_SIZE.checked_add(slots)?.checked_next_multiple_of(RING_ALIGN)
}

/// Writes an empty ring of `capacity` records of `T` at `base`, publishing its magic last.
///
/// # Safety
///
/// 1. `base` is aligned to [`RING_ALIGN`] and valid for writes of `memory_size::<T>(capacity)`
///    bytes.
/// 2. No producer or consumer is attached to this memory while it is initialised.
///
/// # Panics
///
/// As [`memory_size`], on an invalid capacity.
#[cfg(not(loom))]
pub unsafe fn init<T: Pod>(base: *mut u8, capacity: usize) {
    let _ = memory_size::<T>(capacity);
    assert!(base as usize % RING_ALIGN == 0, "unaligned ring memory is a programming error");
    let header = base.cast::<RingHeader>();
    // SAFETY: premise 1 of this function: `base` is aligned and valid for writes of at least
    // HEADER_SIZE bytes; premise 2: no ring end reads or writes it meanwhile (no race).
    unsafe { header.write(RingHeader::new(0, size_of::<T>(), capacity)) };
    // SAFETY: just initialised above; the header is atomics only, byte for byte, so the reference
    // stays sound whatever other processes write (the same reference attach() takes).
    let header = unsafe { &*header };
    // SYNC: pairs with the Acquire load of magic in RingView::attach(), which then sees the
    // description and the zeroed indices.
    header.description.magic.store(RING_MAGIC, Ordering::Release);
}

/// Empties the ring at `base` and describes it again as [`init`] did (`T`'s size, `capacity`),
/// so that whatever a departed ring end wrote into the header (its indices, or a description it
/// scribbled over: a capacity of 1, a wrong magic) the next attach finds the ring its creator
/// made.
///
/// # Safety
///
/// 1. `base` points to memory that [`init`] set up as a ring of `capacity` records of `T`, still
///    mapped.
/// 2. No producer or consumer uses the ring meanwhile (the scheduler reclaims a rank, or a tier's
///    owner a client slot, whose peer is gone); the next attach sees the reset through its
///    Acquire load of the magic.
///
/// # Panics
///
/// As [`memory_size`], on an invalid capacity.
#[cfg(not(loom))]
pub unsafe fn reset<T: Pod>(base: *mut u8, capacity: usize) {
    let _ = memory_size::<T>(capacity);
    // SAFETY: premise 1: an initialised, aligned ring header lives at `base`; it is atomics only,
    // so the reference stays sound whatever other processes write, and every store below is
    // atomic (premise 2 is what makes them meaningful, not what makes them race-free).
    let header = unsafe { &*base.cast::<RingHeader>() };
    let description = &header.description;
    // Relaxed: published by the Release store of the magic below.
    description.element_size.store(size_of::<T>() as u64, Ordering::Relaxed);
    description.capacity.store(capacity as u64, Ordering::Relaxed);
    header.tail.value.store(0, Ordering::Relaxed);
    header.head.value.store(0, Ordering::Relaxed);
    // SYNC: pairs with the Acquire load of magic in RingView::attach(), which then sees the
    // description and the zeroed indices above.
    description.magic.store(RING_MAGIC, Ordering::Release);
}

/// One side's checked view of a ring: where the header and slots are, and the validated capacity.
///
/// The capacity is read once, at attach, and never again from shared memory, so that slot
/// indices (`index & mask`) stay in bounds whatever the peer writes later.
#[derive(Debug)]
pub(crate) struct RingView<T> {
    header: NonNull<RingHeader>,
    slots: NonNull<UnsafeCell<T>>,
    capacity: u64,
    mask: u64,
    /// Keeps heap-backed ring memory alive while a side uses it; `None` for mapped memory, whose
    /// lifetime the caller of `attach` guarantees.
    _keep_alive: Option<Arc<dyn Any + Send + Sync>>,
}

impl<T: Pod> RingView<T> {
    /// Validates the ring at `base` and returns a view of it.
    ///
    /// # Safety
    ///
    /// `base` is valid for reads and writes of `len` bytes for as long as the view lives, and is
    /// used only through ring views (one producer, one consumer; the peer may be another process).
    #[cfg(not(loom))]
    pub(crate) unsafe fn attach(base: *mut u8, len: usize) -> Result<Self, RingError> {
        const { assert!(align_of::<T>() <= RING_ALIGN, "ring slots may be aligned to 64 bytes at most") };
        if base.is_null() || base as usize % RING_ALIGN != 0 {
            return Err(RingError::Misaligned { address: base as usize, required: RING_ALIGN });
        }
        if len < HEADER_SIZE {
            return Err(RingError::Truncated { len, needed: HEADER_SIZE });
        }
        // SAFETY: `base` is non-null (checked above).
        let header = unsafe { NonNull::new_unchecked(base.cast::<RingHeader>()) };
        // SAFETY: aligned for RingHeader (align 64) and valid for HEADER_SIZE bytes (checked
        // above, validity by this function's contract); the header is atomics only, byte for
        // byte, and any bits are a valid value, so the reference stays sound while the peer
        // process writes its index, and every access through it is atomic.
        let description = unsafe { &header.as_ref().description };
        // SYNC: pairs with the Release store of magic in init() and in reset(): the description
        // below is complete.
        let magic = description.magic.load(Ordering::Acquire);
        if magic != RING_MAGIC {
            return Err(RingError::BadMagic { found: magic, expected: RING_MAGIC });
        }
        let element_size = description.element_size.load(Ordering::Relaxed);
        if element_size != size_of::<T>() as u64 {
            return Err(RingError::ElementSizeMismatch {
                found: element_size,
                expected: size_of::<T>() as u64,
            });
        }
        let capacity = description.capacity.load(Ordering::Relaxed);
        if !capacity.is_power_of_two() || capacity > MAX_CAPACITY as u64 {
            return Err(RingError::BadCapacity { capacity, max: MAX_CAPACITY as u64 });
        }
        let needed = checked_memory_size::<T>(capacity).unwrap_or(usize::MAX);
        if len < needed {
            return Err(RingError::Truncated { len, needed });
        }
        // SAFETY: HEADER_SIZE < len, so the offset stays inside the valid region and is non-null;
        // it is a multiple of 64, so the slots are aligned for T (align <= 64).
        let slots =
            unsafe { NonNull::new_unchecked(base.add(HEADER_SIZE).cast::<UnsafeCell<T>>()) };
        Ok(Self { header, slots, capacity, mask: capacity - 1, _keep_alive: None })
    }

    /// A view of a ring whose header and slots live in `keep_alive`, an allocation it keeps alive.
    ///
    /// # Safety
    ///
    /// `header` and `slots[..capacity]` point into `keep_alive`'s allocation, which never moves;
    /// `capacity` is a power of two.
    #[cfg(loom)]
    pub(crate) unsafe fn from_parts(
        header: NonNull<RingHeader>,
        slots: NonNull<UnsafeCell<T>>,
        capacity: u64,
        keep_alive: Arc<dyn Any + Send + Sync>,
    ) -> Self {
        debug_assert!(capacity.is_power_of_two());
        Self { header, slots, capacity, mask: capacity - 1, _keep_alive: Some(keep_alive) }
    }

    /// Makes the view keep `memory` alive (heap-backed rings).
    #[cfg(not(loom))]
    pub(crate) fn keeping(mut self, memory: Arc<dyn Any + Send + Sync>) -> Self {
        self._keep_alive = Some(memory);
        self
    }

    pub(crate) fn header(&self) -> &RingHeader {
        // SAFETY: validated at attach (or by from_parts' contract) and valid while the view lives;
        // atomics only, so sound to share with a peer that writes it (see attach()).
        unsafe { self.header.as_ref() }
    }

    /// The slot that record `index` (a free-running index) lives in; always in bounds.
    pub(crate) fn slot(&self, index: u64) -> &UnsafeCell<T> {
        let position = (index & self.mask) as usize;
        // SAFETY: position < capacity, and the slots hold `capacity` cells (checked against the
        // memory length at attach, or by from_parts' contract). The reference is to an
        // UnsafeCell, which promises nothing about its contents: the two ends access the
        // record through raw pointers, under the ring protocol.
        unsafe { self.slots.add(position).as_ref() }
    }

    pub(crate) fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Records between `head` and `tail` counted modulo 2^64 (see [`super`]'s index rule), or
    /// `Corrupt` if that is not in `0..=capacity`.
    pub(crate) fn occupancy(&self, head: u64, tail: u64) -> Result<u64, RingError> {
        let used = tail.wrapping_sub(head);
        if used > self.capacity {
            return Err(self.corrupt(head, tail));
        }
        Ok(used)
    }

    /// As [`occupancy`](Self::occupancy), for indices found at attach: these must also satisfy
    /// `head <= tail` as plain integers. Indices that hold only modulo 2^64 would mean the ring has
    /// carried 2^64 records (centuries at any rate a ring sustains): the peer scribbled them.
    pub(crate) fn occupancy_at_attach(&self, head: u64, tail: u64) -> Result<u64, RingError> {
        if head > tail {
            return Err(self.corrupt(head, tail));
        }
        self.occupancy(head, tail)
    }

    pub(crate) fn corrupt(&self, head: u64, tail: u64) -> RingError {
        RingError::Corrupt { head, tail, capacity: self.capacity }
    }
}
