//! The back-end's slots in memory: what each slot holds ([`Slot`]) and what its index record
//! says ([`OnDisk`]), the LRU list of used slots threaded through the slot array (ids, not
//! pointers; [`NONE`] ends it), the free slots, and the map from block hash to slot.
//!
//! A slot is free, or failed (free, but its last write failed), or used (in the map and the
//! list), or taken by the batch being run (pinned, never evicted by it).
//! [`DiskBackend::take_slot`] gives a new block a free slot, else the least recently used one
//! not pinned: that block is forgotten (its record is zeroed by the batch before the slot's
//! bytes are overwritten); else a failed slot, tried again. `check_invariants` checks the lists
//! and the map against each other.

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
        for &slot in self.free.iter().chain(&self.failed) {
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
            return self.failed.pop();
        }
        self.forget(victim);
        self.stats.evictions += 1;
        self.free.pop()
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
