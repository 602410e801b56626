//! The back-end's slots in memory: what each slot holds ([`Slot`]) and what its index record
//! says ([`OnDisk`]), the LRU list of used slots threaded through the slot array (ids, not
//! pointers; [`NONE`] ends it), the free slots, and the map from block hash to slot.
//!
//! A slot is free, or set aside (its last write failed), or used (in the map and the list), or
//! taken by the batch being run (pinned, never evicted by it). [`DiskBackend::take_slot`] gives
//! a new block a free slot, else the least recently used one not pinned: that block is
//! forgotten (its record is zeroed by the batch before the slot's bytes are overwritten); else
//! a slot set aside. A slot whose write failed is set aside for a while
//! ([`DiskBackend::note_write`]), and taken first again while every write fails.
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
    /// Writes of this slot that failed in a row, other than for room.
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

    /// A slot for a new block (module documentation): a free one, else the least recently used
    /// one not pinned by this batch (its block is forgotten here; its record is zeroed in step
    /// 2), else one set aside. While writes fail one after another, a slot set aside is taken
    /// before a victim but at the first, second, fourth, ... failure in a row: the trouble may
    /// be the disk's (a full file system), where a retry costs no block, and each victim taken
    /// tells whether other slots still write (a bad sector), at the cost of a few blocks.
    pub(super) fn take_slot(&mut self) -> Option<u32> {
        if let Some(slot) = self.free.pop() {
            return Some(slot);
        }
        let failing = self.failures_in_a_row;
        if failing > 0 && !failing.is_power_of_two() {
            if let Some((slot, _)) = self.failed.pop() {
                return Some(slot);
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

    /// Notes the outcome of a block's write into `slot` (step 5): a success ends any failures
    /// in a row; a failure sets the slot aside.
    pub(super) fn note_write(&mut self, slot: u32, succeeded: bool) {
        if succeeded {
            self.slots[slot as usize].failures = 0;
            self.successful_writes += 1;
            self.failures_in_a_row = 0;
            return;
        }
        // A slot failing right after a write succeeded may be at fault itself: each such failure
        // doubles its rest. One failing among failures may be failing with the disk: it keeps
        // the rest of one success.
        let entry = &mut self.slots[slot as usize];
        if self.failures_in_a_row == 0 || entry.failures == 0 {
            entry.failures = entry.failures.saturating_add(1);
        }
        self.failures_in_a_row += 1;
        self.failed.push((slot, u64::from(entry.failures)));
    }

    /// Ends a batch's notes ([`DiskBackend::note_write`]): the slots it set aside rest until
    /// `2^(failures - 1)` writes of other slots have succeeded from now (the batch's own
    /// successes count not).
    pub(super) fn rest_set_aside(&mut self, from: usize) {
        let writes = self.successful_writes;
        for (_, back_at) in &mut self.failed[from..] {
            *back_at = writes + (1u64 << (*back_at - 1).min(32));
        }
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

    /// Fails the next store of one block, as a write that fails does (step 5).
    fn fail_one(backend: &mut DiskBackend) {
        let slot = backend.take_slot().expect("a slot");
        let before = backend.failed.len();
        backend.note_write(slot, false);
        backend.rest_set_aside(before);
    }

    /// While every write fails, few blocks are evicted for slots (at the 1st, 2nd, 3rd and 5th
    /// failure in a row), the slots set aside taken again instead; once a write succeeds, they
    /// come back after one success.
    #[test]
    fn a_run_of_failures_takes_few_victims_and_its_slots_come_back() {
        let dir = std::env::temp_dir().join(format!("kvshm-set-aside-{}", std::process::id()));
        let options = DiskOptions {
            dir: dir.clone(),
            namespace: "test".into(),
            rank: 0,
            layout: BlockLayout::new(4096, 1, 1).unwrap(),
            capacity_blocks: 8,
            prefer_direct: false,
            crash: None,
        };
        let mut backend = DiskBackend::open(&options).unwrap();
        assert!((1..=8).all(|tag| store(&mut backend, tag)));
        let evictions = backend.stats.evictions;
        for _ in 0..8 {
            fail_one(&mut backend);
            backend.check_invariants();
        }
        assert_eq!(backend.stats.evictions - evictions, 4);
        assert_eq!(backend.len(), 4);
        // The first success takes a victim (8 failures in a row); then the 4 slots are back.
        assert!(store(&mut backend, 20));
        assert_eq!(backend.failed.len(), 4);
        assert!((21..=24).all(|tag| store(&mut backend, tag)));
        assert_eq!((backend.len(), backend.failed.len()), (8, 0));
        backend.check_invariants();
        drop(backend);
        let _ = std::fs::remove_dir_all(dir);
    }
}
