//! The back-end's slots in memory: what each slot holds ([`Slot`]) and what its index record
//! says ([`OnDisk`]), the LRU list of used slots threaded through the slot array (ids, not
//! pointers; [`NONE`] ends it), the free slots, and the map from block hash to slot.
//!
//! A slot is free, or set aside (its last write failed), or used (in the map and the list), or
//! taken by the batch being run (pinned, never evicted by it). [`DiskBackend::take_slot`] gives
//! a new block a free slot, else the least recently used one not pinned: that block is
//! forgotten (its record is zeroed by the batch before the slot's bytes are overwritten); else
//! a slot set aside. A slot whose write failed for room goes back to the free list at once, one
//! that failed otherwise is set aside for a while ([`DiskBackend::set_aside`]).
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
    /// 2), else one whose last write failed.
    pub(super) fn take_slot(&mut self) -> Option<u32> {
        if let Some(slot) = self.free.pop() {
            return Some(slot);
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

    /// Takes back `slot`, whose write just failed with `failure`. A full file system fails every
    /// slot alike: the slot is taken first again, and a retry costs no other block. Another
    /// failure may be the slot's own (a bad sector): it is set aside until more writes of other
    /// slots have succeeded (one, then twice as many after each failure in a row), so that it
    /// fails no other store meanwhile, and a burst of errors does not shrink the slab for good.
    pub(super) fn set_aside(&mut self, slot: u32, failure: &Failure) {
        if *failure == Failure::NoSpace {
            self.free.push(slot);
            return;
        }
        let entry = &mut self.slots[slot as usize];
        entry.failures = entry.failures.saturating_add(1);
        let wait = 1u64 << (entry.failures - 1).min(32);
        self.failed.push((slot, self.successful_writes + wait));
    }

    /// Puts the slots set aside whose wait is over back on the free list, below its other
    /// slots (module documentation).
    pub(super) fn return_rested_slots(&mut self) {
        let (free, writes) = (&mut self.free, self.successful_writes);
        self.failed.retain(|&(slot, back_at)| {
            let rested = back_at <= writes;
            if rested {
                free.insert(0, slot);
            }
            !rested
        });
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

    /// A slot set aside after an I/O error is taken after the free slots and the victims, and
    /// goes back to the free list once a write of another slot succeeded; one full for room
    /// is taken first again.
    #[test]
    fn a_slot_that_failed_waits_its_turn_and_one_without_room_goes_first() {
        let dir = std::env::temp_dir().join(format!("kvshm-set-aside-{}", std::process::id()));
        let options = DiskOptions {
            dir: dir.clone(),
            namespace: "test".into(),
            rank: 0,
            layout: BlockLayout::new(4096, 1, 1).unwrap(),
            capacity_blocks: 2,
            prefer_direct: false,
            crash: None,
        };
        let mut backend = DiskBackend::open(&options).unwrap();
        assert!(store(&mut backend, 1) && store(&mut backend, 2));
        // A store evicting block 1 fails on its slot with an I/O error.
        let bad = backend.take_slot().unwrap();
        backend.set_aside(bad, &Failure::Io("EIO".into()));
        backend.check_invariants();
        // The next store takes a victim (block 2's slot), not the slot set aside...
        assert!(store(&mut backend, 3));
        assert_eq!(backend.by_hash.get(&BlockHash(3)), Some(&(1 - bad)));
        // ...which is back once that write succeeded, and taken before a victim.
        assert!(store(&mut backend, 4));
        assert_eq!(backend.by_hash.get(&BlockHash(4)), Some(&bad));
        assert_eq!(backend.len(), 2);
        // A slot that failed for room is taken first again.
        let full = backend.take_slot().unwrap();
        backend.set_aside(full, &Failure::NoSpace);
        assert_eq!(backend.take_slot(), Some(full));
        drop(backend);
        let _ = std::fs::remove_dir_all(dir);
    }
}
