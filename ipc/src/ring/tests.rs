//! Unit tests of the ring: order, wraparound, full and batch behaviour, and validation of
//! everything read from ring memory.

use super::*;

/// 64-byte aligned zeroed memory standing in for a mapped region.
struct AlignedMemory {
    lines: Vec<Line>,
}

#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

impl AlignedMemory {
    fn new(len: usize) -> Self {
        Self { lines: vec![Line([0; 64]); len.div_ceil(64)] }
    }

    fn base(&mut self) -> *mut u8 {
        self.lines.as_mut_ptr().cast()
    }

    fn len(&self) -> usize {
        self.lines.len() * 64
    }
}

/// Offsets of header words, as documented in layout.rs.
const ELEMENT_SIZE_OFFSET: usize = 8;
const CAPACITY_OFFSET: usize = 16;
const TAIL_OFFSET: usize = 128;
const HEAD_OFFSET: usize = 256;

/// Overwrites a u64 of ring memory, playing a faulty peer.
fn scribble(base: *mut u8, offset: usize, value: u64) {
    // SAFETY: tests pass offsets of header words inside memory they own; one thread, so no race;
    // the header words are atomics (UnsafeCell), so writing one through a raw pointer while a
    // ring end holds a shared reference to the header breaks no aliasing promise.
    unsafe { base.add(offset).cast::<u64>().write_volatile(value) };
}

fn initialised_ring<T: bytemuck::Pod>(capacity: usize) -> (AlignedMemory, *mut u8) {
    let mut memory = AlignedMemory::new(memory_size::<T>(capacity));
    let base = memory.base();
    // SAFETY: the memory is aligned, large enough and not attached yet.
    unsafe { init::<T>(base, capacity) };
    (memory, base)
}

#[test]
fn records_come_out_in_order_across_many_wraparounds() {
    let (mut producer, mut consumer) = heap::<u64>(4);
    let mut next_in = 0u64;
    let mut next_out = 0u64;
    let mut out = Vec::new();
    for round in 0..1000u64 {
        let batch: Vec<u64> = (next_in..next_in + round % 4 + 1).collect();
        producer.push_all(&batch).unwrap();
        next_in += batch.len() as u64;
        out.clear();
        consumer.pop_into(&mut out, 4).unwrap();
        for record in &out {
            assert_eq!(*record, next_out);
            next_out += 1;
        }
    }
    assert_eq!(next_out, next_in);
    assert!(next_in > 100 * 4, "the test must wrap the ring many times");
}

#[test]
fn push_fails_when_full_and_succeeds_after_a_pop() {
    let (mut producer, mut consumer) = heap::<u32>(2);
    producer.push(1).unwrap();
    producer.push(2).unwrap();
    assert_eq!(producer.push(3), Err(RingFull));
    assert_eq!(producer.free_slots(), 0);
    assert_eq!(consumer.pop().unwrap(), Some(1));
    assert_eq!(producer.free_slots(), 1);
    producer.push(3).unwrap();
    assert_eq!(consumer.pop().unwrap(), Some(2));
    assert_eq!(consumer.pop().unwrap(), Some(3));
    assert_eq!(consumer.pop().unwrap(), None);
}

#[test]
fn a_batch_that_does_not_fit_is_not_pushed_at_all() {
    let (mut producer, mut consumer) = heap::<u32>(8);
    producer.push_all(&[1, 2, 3, 4, 5]).unwrap();
    assert_eq!(producer.push_all(&[6, 7, 8, 9]), Err(RingFull));
    assert_eq!(consumer.len().unwrap(), 5);
    producer.push_all(&[6, 7, 8]).unwrap();
    let mut out = Vec::new();
    assert_eq!(consumer.pop_into(&mut out, 100).unwrap(), 8);
    assert_eq!(out, [1, 2, 3, 4, 5, 6, 7, 8]);
}

#[test]
fn a_batch_of_a_whole_capacity_fits_an_empty_ring() {
    let (mut producer, mut consumer) = heap::<u16>(16);
    let records: Vec<u16> = (0..16).collect();
    producer.push_all(&records).unwrap();
    producer.push_all(&[]).unwrap();
    assert_eq!(producer.push(99), Err(RingFull));
    let mut out = Vec::new();
    consumer.pop_into(&mut out, 16).unwrap();
    assert_eq!(out, records);
}

#[test]
fn pop_into_takes_at_most_max_and_appends() {
    let (mut producer, mut consumer) = heap::<u8>(8);
    producer.push_all(&[1, 2, 3, 4, 5]).unwrap();
    let mut out = vec![0];
    assert_eq!(consumer.pop_into(&mut out, 0).unwrap(), 0);
    assert_eq!(consumer.pop_into(&mut out, 3).unwrap(), 3);
    assert_eq!(out, [0, 1, 2, 3]);
    assert_eq!(producer.free_slots(), 6);
    assert_eq!(consumer.pop_into(&mut out, 3).unwrap(), 2);
    assert_eq!(consumer.pop_into(&mut out, 3).unwrap(), 0);
    assert_eq!(out, [0, 1, 2, 3, 4, 5]);
    assert!(consumer.is_empty().unwrap());
}

#[test]
fn a_ring_of_one_alternates_full_and_empty() {
    let (mut producer, mut consumer) = heap::<u64>(1);
    for value in 0..10 {
        producer.push(value).unwrap();
        assert_eq!(producer.push(value), Err(RingFull));
        assert_eq!(consumer.pop().unwrap(), Some(value));
        assert_eq!(consumer.pop().unwrap(), None);
    }
}

#[test]
fn multi_slot_records_keep_their_bytes() {
    use crate::record::{encode_command, BlockPair, CommandHeader, CommandSlot, Op};
    let (mut producer, mut consumer) = heap::<CommandSlot>(8);
    let pairs: Vec<BlockPair> = (0..20).map(|i| BlockPair::new(i, i + 1000)).collect();
    let header = CommandHeader::new(Op::CopyDeviceToHost, 77, 3, pairs.len() as u32);
    let mut slots = Vec::new();
    encode_command(&header, &pairs, &mut slots);
    producer.push_all(&slots).unwrap();
    let mut out = Vec::new();
    consumer.pop_into(&mut out, 8).unwrap();
    assert_eq!(out, slots);
}

#[test]
fn memory_size_covers_header_and_slots_in_whole_lines() {
    assert_eq!(memory_size::<u64>(1), 384 + 64);
    assert_eq!(memory_size::<u64>(16), 384 + 128);
    assert_eq!(memory_size::<crate::record::CommandSlot>(1024), 384 + 64 * 1024);
    assert_eq!(memory_size::<[u8; 3]>(2) % 64, 0);
    assert!(capacity_is_valid(1) && capacity_is_valid(MAX_CAPACITY));
    assert!(
        !capacity_is_valid(0) && !capacity_is_valid(12) && !capacity_is_valid(2 * MAX_CAPACITY)
    );
}

#[test]
#[should_panic(expected = "not a valid capacity")]
fn memory_size_refuses_a_capacity_that_is_not_a_power_of_two() {
    let _ = memory_size::<u64>(12);
}

#[test]
fn both_sides_attach_to_initialised_memory_and_exchange_records() {
    let (memory, base) = initialised_ring::<u64>(8);
    // SAFETY: the memory outlives both sides; one producer and one consumer.
    let mut producer = unsafe { Producer::<u64>::attach(base, memory.len()) }.unwrap();
    // SAFETY: as above.
    let mut consumer = unsafe { Consumer::<u64>::attach(base, memory.len()) }.unwrap();
    assert_eq!((producer.capacity(), consumer.capacity()), (8, 8));
    producer.push_all(&[10, 20]).unwrap();
    assert_eq!(consumer.pop().unwrap(), Some(10));
    assert_eq!(consumer.pop().unwrap(), Some(20));
}

#[test]
fn a_reattached_consumer_continues_where_the_last_one_stopped() {
    let (memory, base) = initialised_ring::<u64>(4);
    // SAFETY: the memory outlives both sides; one side of each kind at a time.
    let mut producer = unsafe { Producer::<u64>::attach(base, memory.len()) }.unwrap();
    producer.push_all(&[1, 2, 3]).unwrap();
    {
        // SAFETY: as above.
        let mut consumer = unsafe { Consumer::<u64>::attach(base, memory.len()) }.unwrap();
        assert_eq!(consumer.pop().unwrap(), Some(1));
    }
    // SAFETY: as above; the previous consumer is gone.
    let mut consumer = unsafe { Consumer::<u64>::attach(base, memory.len()) }.unwrap();
    assert_eq!(consumer.pop().unwrap(), Some(2));
    assert_eq!(consumer.pop().unwrap(), Some(3));
}

#[test]
fn reset_empties_the_ring_and_restores_its_description_for_the_next_attach() {
    let (memory, base) = initialised_ring::<u64>(4);
    {
        // SAFETY: the memory outlives the producer.
        let mut producer = unsafe { Producer::<u64>::attach(base, memory.len()) }.unwrap();
        producer.push_all(&[1, 2, 3, 4]).unwrap();
    }
    // A departed end scribbled over the description: a capacity of 1, then a wrong magic.
    // SAFETY: the header is atomics only, in memory this test owns.
    let header = unsafe { &*base.cast::<crate::ring::layout::RingHeader>() };
    header.description.capacity.store(1, std::sync::atomic::Ordering::Relaxed);
    header.description.magic.store(7, std::sync::atomic::Ordering::Relaxed);
    // SAFETY: as above.
    assert!(unsafe { Producer::<u64>::attach(base, memory.len()) }.is_err());
    // SAFETY: an initialised ring of 4 nobody is attached to.
    unsafe { reset::<u64>(base, 4) };
    // SAFETY: the memory outlives both sides.
    let mut producer = unsafe { Producer::<u64>::attach(base, memory.len()) }.unwrap();
    // SAFETY: as above.
    let mut consumer = unsafe { Consumer::<u64>::attach(base, memory.len()) }.unwrap();
    assert_eq!(producer.free_slots(), 4);
    assert_eq!(consumer.pop().unwrap(), None);
}

#[test]
fn attach_rejects_memory_that_was_never_initialised() {
    let mut memory = AlignedMemory::new(memory_size::<u64>(4));
    // SAFETY: owned memory of the given length.
    let result = unsafe { Consumer::<u64>::attach(memory.base(), memory.len()) };
    assert!(matches!(result, Err(RingError::BadMagic { found: 0, .. })));
}

#[test]
fn attach_rejects_misaligned_memory() {
    let (memory, base) = initialised_ring::<u64>(4);
    // SAFETY: the shifted pointer stays inside owned memory; attach must refuse before reading.
    let result = unsafe { Producer::<u64>::attach(base.add(8), memory.len() - 8) };
    assert!(matches!(result, Err(RingError::Misaligned { required: 64, .. })));
    // SAFETY: attach refuses a null pointer before reading.
    let result = unsafe { Producer::<u64>::attach(std::ptr::null_mut(), memory.len()) };
    assert!(matches!(result, Err(RingError::Misaligned { address: 0, .. })));
}

#[test]
fn attach_rejects_memory_shorter_than_the_header_or_the_slots() {
    let (memory, base) = initialised_ring::<u64>(64);
    // SAFETY: a shorter length than owned; attach must not read past it.
    let result = unsafe { Consumer::<u64>::attach(base, 100) };
    assert_eq!(result.err(), Some(RingError::Truncated { len: 100, needed: 384 }));
    let needed = memory_size::<u64>(64);
    // SAFETY: as above.
    let result = unsafe { Consumer::<u64>::attach(base, needed - 64) };
    assert_eq!(result.err(), Some(RingError::Truncated { len: needed - 64, needed }));
    // A corrupt, huge capacity must not make the slot area overflow into a passing check.
    scribble(base, CAPACITY_OFFSET, 1 << 32);
    // SAFETY: as above.
    let result = unsafe { Consumer::<u64>::attach(base, memory.len()) };
    assert!(matches!(result, Err(RingError::Truncated { .. })));
}

#[test]
fn attach_rejects_a_ring_of_another_element_type() {
    let (memory, base) = initialised_ring::<u64>(4);
    // SAFETY: owned memory of the given length.
    let result = unsafe { Consumer::<u32>::attach(base, memory.len()) };
    assert_eq!(result.err(), Some(RingError::ElementSizeMismatch { found: 8, expected: 4 }));
    scribble(base, ELEMENT_SIZE_OFFSET, 0);
    // SAFETY: as above.
    let result = unsafe { Consumer::<u64>::attach(base, memory.len()) };
    assert_eq!(result.err(), Some(RingError::ElementSizeMismatch { found: 0, expected: 8 }));
}

#[test]
fn attach_rejects_a_corrupt_capacity() {
    let (memory, base) = initialised_ring::<u64>(4);
    for capacity in [0, 3, 6, u64::MAX, 1 << 40] {
        scribble(base, CAPACITY_OFFSET, capacity);
        // SAFETY: owned memory of the given length.
        let result = unsafe { Producer::<u64>::attach(base, memory.len()) };
        assert!(
            matches!(result, Err(RingError::BadCapacity { capacity: found, .. }) if found == capacity),
            "capacity {capacity}: {result:?}"
        );
    }
}

#[test]
fn attach_rejects_indices_more_than_a_capacity_apart() {
    let (memory, base) = initialised_ring::<u64>(4);
    scribble(base, TAIL_OFFSET, 5);
    // SAFETY: owned memory of the given length.
    let result = unsafe { Consumer::<u64>::attach(base, memory.len()) };
    assert_eq!(result.err(), Some(RingError::Corrupt { head: 0, tail: 5, capacity: 4 }));
    scribble(base, TAIL_OFFSET, 3);
    scribble(base, HEAD_OFFSET, 4);
    // SAFETY: as above.
    let result = unsafe { Producer::<u64>::attach(base, memory.len()) };
    assert_eq!(result.err(), Some(RingError::Corrupt { head: 4, tail: 3, capacity: 4 }));
}

#[test]
fn consumer_reports_a_corrupt_tail_instead_of_reading() {
    let (memory, base) = initialised_ring::<u64>(4);
    // SAFETY: owned memory of the given length, one consumer.
    let mut consumer = unsafe { Consumer::<u64>::attach(base, memory.len()) }.unwrap();
    for bad_tail in [5, u64::MAX, 1 << 63] {
        scribble(base, TAIL_OFFSET, bad_tail);
        let expected = RingError::Corrupt { head: 0, tail: bad_tail, capacity: 4 };
        assert_eq!(consumer.pop(), Err(expected));
        assert_eq!(consumer.pop_into(&mut Vec::new(), 4), Err(expected));
        assert_eq!(consumer.len(), Err(expected));
    }
}

#[test]
fn consumer_reports_a_tail_that_moves_backwards() {
    let (memory, base) = initialised_ring::<u64>(4);
    // SAFETY: owned memory of the given length, one side of each kind.
    let mut producer = unsafe { Producer::<u64>::attach(base, memory.len()) }.unwrap();
    // SAFETY: as above.
    let mut consumer = unsafe { Consumer::<u64>::attach(base, memory.len()) }.unwrap();
    producer.push_all(&[1, 2, 3]).unwrap();
    assert_eq!(consumer.len().unwrap(), 3);
    scribble(base, TAIL_OFFSET, 2);
    assert_eq!(consumer.len(), Err(RingError::Corrupt { head: 0, tail: 2, capacity: 4 }));
}

#[test]
fn producer_keeps_its_safe_view_when_the_head_is_corrupt() {
    let (memory, base) = initialised_ring::<u64>(4);
    // SAFETY: owned memory of the given length, one producer.
    let mut producer = unsafe { Producer::<u64>::attach(base, memory.len()) }.unwrap();
    producer.push_all(&[1, 2, 3, 4]).unwrap();
    assert_eq!(producer.consumer_fault(), None);
    // A head beyond the tail would claim more than a capacity of free slots.
    scribble(base, HEAD_OFFSET, 9);
    assert_eq!(producer.free_slots(), 0);
    assert_eq!(producer.push(5), Err(RingFull));
    assert_eq!(
        producer.consumer_fault(),
        Some(RingError::Corrupt { head: 9, tail: 4, capacity: 4 })
    );
    // A head that moves backwards is refused too; a sane one is taken again.
    scribble(base, HEAD_OFFSET, 2);
    assert_eq!(producer.free_slots(), 2);
    scribble(base, HEAD_OFFSET, 1);
    assert_eq!(producer.free_slots(), 2);
    assert_eq!(
        producer.consumer_fault(),
        Some(RingError::Corrupt { head: 1, tail: 4, capacity: 4 })
    );
}

#[test]
fn sides_move_to_other_threads() {
    let (mut producer, mut consumer) = heap::<u64>(64);
    let writer = std::thread::spawn(move || {
        let mut next = 0u64;
        while next < 100_000 {
            let batch: Vec<u64> = (next..next + 1 + next % 7).collect();
            if producer.push_all(&batch).is_ok() {
                next += batch.len() as u64;
            } else {
                std::thread::yield_now();
            }
        }
        next
    });
    let mut expected = 0u64;
    let mut out = Vec::new();
    let total = loop {
        out.clear();
        if consumer.pop_into(&mut out, 16).unwrap() == 0 {
            if writer.is_finished() && consumer.is_empty().unwrap() {
                break writer.join().unwrap();
            }
            std::thread::yield_now();
        }
        for record in &out {
            assert_eq!(*record, expected);
            expected += 1;
        }
    };
    assert_eq!(expected, total);
}

#[test]
fn attach_rejects_indices_that_make_sense_only_modulo_2_to_the_64() {
    // tail - head wraps to 3: a ring would have to carry 2^64 records to get here.
    let (memory, base) = initialised_ring::<u64>(4);
    scribble(base, TAIL_OFFSET, 1);
    scribble(base, HEAD_OFFSET, u64::MAX - 1);
    let expected = RingError::Corrupt { head: u64::MAX - 1, tail: 1, capacity: 4 };
    // SAFETY: owned memory of the given length.
    let result = unsafe { Consumer::<u64>::attach(base, memory.len()) };
    assert_eq!(result.err(), Some(expected));
    // SAFETY: as above.
    let result = unsafe { Producer::<u64>::attach(base, memory.len()) };
    assert_eq!(result.err(), Some(expected));
}

#[test]
fn records_cross_the_2_to_the_64_wrap_of_the_indices_in_order() {
    let (memory, base) = initialised_ring::<u64>(4);
    scribble(base, TAIL_OFFSET, u64::MAX - 2);
    scribble(base, HEAD_OFFSET, u64::MAX - 2);
    // SAFETY: owned memory of the given length, one side of each kind.
    let mut producer = unsafe { Producer::<u64>::attach(base, memory.len()) }.unwrap();
    // SAFETY: as above.
    let mut consumer = unsafe { Consumer::<u64>::attach(base, memory.len()) }.unwrap();
    let mut out = Vec::new();
    let mut next = 0u64;
    for round in 0..8u64 {
        let batch: Vec<u64> = (next..next + 1 + round % 4).collect();
        producer.push_all(&batch).unwrap();
        next += batch.len() as u64;
        assert_eq!(consumer.len().unwrap(), batch.len());
        assert_eq!(consumer.pop_into(&mut out, 4).unwrap(), batch.len());
        assert_eq!(producer.free_slots(), 4);
    }
    assert_eq!(out, (0..next).collect::<Vec<_>>());
    assert_eq!(producer.consumer_fault(), None);
}

#[test]
fn a_tail_scribbled_across_the_wrap_yields_exactly_the_records_whose_slots_it_releases() {
    let (memory, base) = initialised_ring::<u64>(4);
    scribble(base, TAIL_OFFSET, u64::MAX - 1);
    scribble(base, HEAD_OFFSET, u64::MAX - 1);
    // SAFETY: owned memory of the given length, one consumer.
    let mut consumer = unsafe { Consumer::<u64>::attach(base, memory.len()) }.unwrap();
    // The peer claims three records, counting across the wrap: whatever the slots hold is read,
    // and exactly as many slots are handed back as records were returned.
    scribble(base, TAIL_OFFSET, 1);
    let mut out = Vec::new();
    assert_eq!(consumer.pop_into(&mut out, 8).unwrap(), 3);
    assert_eq!(out.len(), 3);
    // SAFETY: reading a header word of owned memory; no other thread.
    let head = unsafe { base.add(HEAD_OFFSET).cast::<u64>().read_volatile() };
    assert_eq!(head, 1);
    // A tail that then moves back across the wrap is refused.
    scribble(base, TAIL_OFFSET, u64::MAX);
    assert_eq!(consumer.len(), Err(RingError::Corrupt { head: 1, tail: u64::MAX, capacity: 4 }));
}
