//! The back-end's slots in memory: what each slot holds ([`Slot`]) and what its index record
//! says ([`OnDisk`]), the LRU list of used slots threaded through the slot array (ids, not
//! pointers; [`NONE`] ends it), the free slots, and the map from block hash to slot.
//!
//! A slot is free, or set aside (its last write failed), or used (in the map and the list), or
//! taken by the batch being run (pinned, never evicted by it). [`DiskBackend::take_slot`] gives
//! a new block a free slot, else the least recently used one not pinned: that block is
//! forgotten (its record is zeroed by the batch before the slot's bytes are overwritten); else
//! a slot set aside. A slot whose write failed is set aside for a while
//! ([`DiskBackend::note_writes`]); while every write fails, slots set aside are taken again
//! before most victims ([`DiskBackend::take_slot`]).
//! `check_invariants` checks the lists and the map against each other.

use super::DiskBackend;
use crate::storage::backend::Failure;
use crate::storage::direct_io::failure_of;
use crate::storage::disk_index::{RecordState, SlotRecord};

/// "No slot" in the LRU links.
pub(super) const NONE: u32 = u32::MAX;

/// What the index file says about a slot, as far as this process knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum OnDisk {
    Empty,
    Valid,
    /// A write of its record failed: zero it before reusing the slot.
    Unknown,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Slot {
    pub(super) record: SlotRecord,
    pub(super) on_disk: OnDisk,
    /// In the map and the LRU list.
    pub(super) used: bool,
    /// Failures of this slot's writes since it last landed one: its first, then those in a
    /// batch that landed a block or that followed one ([`DiskBackend::note_writes`]).
    pub(super) failures: u8,
    /// Taken by the batch being run (never evicted by it).
    pub(super) pinned: bool,
    prev: u32,
    next: u32,
}

impl Slot {
    /// A slot holding nothing, in no list, with an empty record.
    pub(super) const FREE: Slot = Slot {
        record: SlotRecord::EMPTY,
        on_disk: OnDisk::Empty,
        used: false,
        failures: 0,
        pinned: false,
        prev: NONE,
        next: NONE,
    };
}

impl DiskBackend {
    /// Checks the in-memory structures against each other.
    ///
    /// # Panics
    ///
    /// On any disagreement: a programming error.
    pub fn check_invariants(&self) {
        let mut seen = 0;
        let mut at = self.head;
        let mut prev = NONE;
        while at != NONE {
            let slot = &self.slots[at as usize];
            assert!(slot.used, "slot {at} is in the LRU list but not used");
            assert_eq!(slot.prev, prev, "slot {at} has a broken back link");
            assert_eq!(
                self.by_hash.get(&slot.record.hash()),
                Some(&at),
                "slot {at} is not in the map"
            );
            assert_eq!(slot.record.state(at), RecordState::Valid);
            assert_eq!(slot.on_disk, OnDisk::Valid);
            prev = at;
            at = slot.next;
            seen += 1;
        }
        assert_eq!(self.tail, prev, "the LRU tail is not the last slot of the list");
        assert_eq!(seen, self.by_hash.len(), "the LRU list and the map disagree");
        assert_eq!(
            seen + self.free.len() + self.failed.len(),
            self.slots.len(),
            "slots are lost or counted twice"
        );
        for &slot in self.free.iter().chain(self.failed.iter().map(|(slot, _)| slot)) {
            assert!(!self.slots[slot as usize].used, "free slot {slot} is used");
        }
        assert!(self.slots.iter().all(|slot| !slot.pinned), "a slot stayed pinned");
    }

    pub(super) fn unlink(&mut self, slot: u32) {
        let Slot { prev, next, .. } = self.slots[slot as usize];
        if prev == NONE {
            self.head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NONE {
            self.tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
        self.slots[slot as usize].prev = NONE;
        self.slots[slot as usize].next = NONE;
    }

    pub(super) fn push_front(&mut self, slot: u32) {
        self.slots[slot as usize].prev = NONE;
        self.slots[slot as usize].next = self.head;
        if self.head != NONE {
            self.slots[self.head as usize].prev = slot;
        } else {
            self.tail = slot;
        }
        self.head = slot;
    }

    pub(super) fn touch(&mut self, slot: u32) {
        self.unlink(slot);
        self.push_front(slot);
    }

    /// A slot for a new block (module documentation), the batch having taken `taken` before it:
    /// a free one, else the least recently used one not pinned by this batch (its block is
    /// forgotten here; its record is zeroed in step 2), else one set aside. While writes fail
    /// one after another, a slot set aside is taken before a victim, but for the 1st, 2nd, 4th,
    /// 8th, ... write of the run (counting this batch's takes before it as failing too): the
    /// trouble may be the disk's (a full file system), where a retry costs no block, and each
    /// victim taken tells whether other slots still write (a bad sector), at the cost of a few
    /// blocks.
    pub(super) fn take_slot(&mut self, taken: usize) -> Option<u32> {
        if let Some(slot) = self.free.pop() {
            return Some(slot);
        }
        if self.failures_in_a_row > 0 {
            let write_of_run = self.failures_in_a_row + taken as u64 + 1;
            if !write_of_run.is_power_of_two() {
                if let Some((slot, _)) = self.failed.pop() {
                    return Some(slot);
                }
            }
        }
        let mut victim = self.tail;
        while victim != NONE && self.slots[victim as usize].pinned {
            victim = self.slots[victim as usize].prev;
        }
        if victim == NONE {
            return self.failed.pop().map(|(slot, _)| slot);
        }
        self.forget(victim);
        self.stats.evictions += 1;
        self.free.pop()
    }

    /// Notes the outcomes of a batch's block writes, `written` as (slot, whether it landed)
    /// (step 5). A failed slot is set aside: it rests until `2^(failures - 1)` writes of other
    /// slots have succeeded from now (the batch's own successes count not), its `failures`
    /// growing with each failure while the disk writes (in this batch, or in the one before),
    /// where the slot may be at fault itself; a failure within a run of failures may be the
    /// disk's, and leaves it as it is. A batch that landed a block ends the run of failures.
    pub(super) fn note_writes(&mut self, written: &[(u32, bool)]) {
        let landed = written.iter().filter(|&&(_, ok)| ok).count() as u64;
        let disk_writes = landed > 0 || self.failures_in_a_row == 0;
        // Rests count from the end of the batch.
        self.successful_writes += landed;
        for &(slot, ok) in written {
            let entry = &mut self.slots[slot as usize];
            if ok {
                entry.failures = 0;
                continue;
            }
            if disk_writes || entry.failures == 0 {
                entry.failures = entry.failures.saturating_add(1);
            }
            let rest = 1u64 << (entry.failures - 1).min(32);
            self.failed.push((slot, self.successful_writes + rest));
        }
        let failed = written.len() as u64 - landed;
        self.failures_in_a_row = if landed > 0 { 0 } else { self.failures_in_a_row + failed };
    }

    /// Puts the slots set aside whose rest is over back on the free list, below its other
    /// slots (module documentation).
    pub(super) fn return_rested_slots(&mut self) {
        let writes = self.successful_writes;
        let rested: Vec<u32> = self
            .failed
            .iter()
            .filter(|&&(_, back_at)| back_at <= writes)
            .map(|&(s, _)| s)
            .collect();
        if rested.is_empty() {
            return;
        }
        self.failed.retain(|&(_, back_at)| back_at > writes);
        self.free.splice(0..0, rested);
    }

    /// Drops a used slot from the map and the LRU list into the free list; its index record
    /// is still on disk (`on_disk` says so) until it is zeroed.
    pub(super) fn forget(&mut self, slot: u32) {
        let hash = self.slots[slot as usize].record.hash();
        self.by_hash.remove(&hash);
        self.unlink(slot);
        let entry = &mut self.slots[slot as usize];
        entry.used = false;
        entry.record = SlotRecord::EMPTY;
        self.free.push(slot);
    }

    /// Zeroes the index record of `slot` (and notes what the file now says).
    pub(super) fn zero_record(&mut self, slot: u32) -> Result<(), Failure> {
        self.unsynced = true;
        match self.index.write_records(slot, &[SlotRecord::EMPTY]) {
            Ok(()) => {
                self.slots[slot as usize].on_disk = OnDisk::Empty;
                Ok(())
            }
            Err(error) => {
                self.slots[slot as usize].on_disk = OnDisk::Unknown;
                Err(failure_of(&error))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::BlockHash;
    use crate::storage::backend::{BlockKey, BlockLayout, PutBlock, StorageBackend};
    use crate::storage::block_bytes::BlockBytes;
    use crate::storage::disk::DiskOptions;

    /// Stores block `tag` alone; whether it was stored.
    fn store(backend: &mut DiskBackend, tag: u128) -> bool {
        let bytes = vec![tag as u8; 4096];
        let key = BlockKey::new(BlockHash(tag), BlockHash(0), 0);
        let mut outcomes = Vec::new();
        backend.put(&[PutBlock { key, bytes: BlockBytes::new(&bytes) }], &mut outcomes);
        outcomes[0].is_ok()
    }

    /// Fails a store of `blocks` blocks, as step 5 notes writes that failed.
    fn fail_batch(backend: &mut DiskBackend, blocks: usize) {
        let slots: Vec<u32> = (0..blocks)
            .map(|taken| {
                let slot = backend.take_slot(taken).expect("a slot");
                backend.slots[slot as usize].pinned = true;
                slot
            })
            .collect();
        for &slot in &slots {
            backend.slots[slot as usize].pinned = false;
        }
        let written: Vec<(u32, bool)> = slots.iter().map(|&slot| (slot, false)).collect();
        backend.note_writes(&written);
    }

    fn open_slab(tag: &str, capacity: u64) -> (DiskBackend, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("kvshm-{tag}-{}", std::process::id()));
        let options = DiskOptions {
            dir: dir.clone(),
            namespace: "test".into(),
            rank: 0,
            layout: BlockLayout::new(4096, 1, 1).unwrap(),
            capacity_blocks: capacity,
            prefer_direct: false,
            crash: None,
        };
        (DiskBackend::open(&options).unwrap(), dir)
    }

    /// While every write fails, few blocks are evicted for slots (for the 1st, 2nd, 4th and 8th
    /// write of the run), the slots set aside taken again instead; once a write lands, they
    /// come back after one success.
    #[test]
    fn a_run_of_failures_takes_few_victims_and_its_slots_come_back() {
        let (mut backend, dir) = open_slab("run", 8);
        assert!((1..=8).all(|tag| store(&mut backend, tag)));
        let evictions = backend.stats.evictions;
        for _ in 0..8 {
            fail_batch(&mut backend, 1);
            backend.check_invariants();
        }
        assert_eq!(backend.stats.evictions - evictions, 4);
        assert_eq!(backend.len(), 4);
        // The 9th write of the run takes a slot set aside, and lands: the others are back.
        assert!(store(&mut backend, 20));
        assert_eq!((backend.len(), backend.failed.len()), (5, 3));
        assert!((21..=23).all(|tag| store(&mut backend, tag)));
        assert_eq!((backend.len(), backend.failed.len()), (8, 0));
        assert_eq!(backend.stats.evictions - evictions, 4);
        backend.check_invariants();
        drop(backend);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A batch's takes count as writes of the run: two failing batches of 4 evict 5 blocks (all
    /// of the first, which starts the run, and the 8th write of the run), not 8.
    #[test]
    fn failing_batches_take_few_victims_too() {
        let (mut backend, dir) = open_slab("batches", 8);
        assert!((1..=8).all(|tag| store(&mut backend, tag)));
        fail_batch(&mut backend, 4);
        fail_batch(&mut backend, 4);
        backend.check_invariants();
        assert_eq!(backend.len(), 3);
        drop(backend);
        let _ = std::fs::remove_dir_all(dir);
    }
}
