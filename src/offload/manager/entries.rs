//! The manager's arena of entries and its index of keys.
//!
//! Each cached key is one [`Entry`] in `entries`, reused through `free_entries`; an entry links
//! to its parent and its children (first child, siblings) and to the next entry whose key has the
//! same 64-bit hash. `heads` maps a hash to the first entry of that chain, and [`find`] walks the
//! chain comparing whole keys.
//!
//! 1. [`OffloadManager::insert`] takes a slot, links the entry under its parent and at the head of
//!    its hash chain, and counts it as storing;
//! 2. [`OffloadManager::remove`] orphans its children (they become chain heads), unlinks it from
//!    its parent (which may become an eviction candidate), frees its chunk and takes it out of its
//!    hash chain.

use std::collections::HashMap;

use super::{OffloadManager, NONE};
use crate::offload::candidates::Rank;
use crate::offload::key::{BuildPassThrough, OffloadKey};

/// One cached key: its chunk, its place in the prefix chains and the hash chain, its recency
/// rank and its state.
#[derive(Clone, Copy, Debug)]
pub(super) struct Entry {
    pub(super) key: OffloadKey,
    pub(super) chunk: u32,
    pub(super) parent: u32,
    pub(super) first_child: u32,
    pub(super) next_sibling: u32,
    pub(super) prev_sibling: u32,
    pub(super) children: u32,
    pub(super) rank: Rank,
    pub(super) pins: u32,
    pub(super) ready: bool,
    /// The next entry whose key has the same hash, or `NONE`.
    pub(super) same_hash: u32,
    /// In the index (a freed slot keeps its last contents until reused).
    pub(super) live: bool,
}

/// Pins entry `id` once more (a load of its chunk starts), `loading` counting the entries
/// pinned; returns its chunk.
pub(super) fn pin(entries: &mut [Entry], loading: &mut u32, id: u32) -> u32 {
    let entry = &mut entries[id as usize];
    if entry.pins == 0 {
        *loading += 1;
    }
    entry.pins += 1;
    entry.chunk
}

impl OffloadManager {
    pub(super) fn insert(&mut self, key: OffloadKey, chunk: u32, parent: u32) {
        let rank = self.candidates.next_rank();
        let entry = Entry {
            key,
            chunk,
            parent,
            first_child: NONE,
            next_sibling: NONE,
            prev_sibling: NONE,
            children: 0,
            rank,
            pins: 0,
            ready: false,
            same_hash: NONE,
            live: true,
        };
        let id = match self.free_entries.pop() {
            Some(id) => {
                self.entries[id as usize] = entry;
                id
            }
            None => {
                self.entries.push(entry);
                (self.entries.len() - 1) as u32
            }
        };
        if parent != NONE {
            let first = self.entries[parent as usize].first_child;
            self.entries[id as usize].next_sibling = first;
            if first != NONE {
                self.entries[first as usize].prev_sibling = id;
            }
            let parent_entry = &mut self.entries[parent as usize];
            parent_entry.first_child = id;
            parent_entry.children += 1;
        }
        let next = self.heads.insert(key.hash64(), id).unwrap_or(NONE);
        self.entries[id as usize].same_hash = next;
        self.live += 1;
        self.storing += 1;
    }

    /// Removes entry `id`: its chunk goes back to the pool, its children become chain heads,
    /// and its parent may become a candidate.
    pub(super) fn remove(&mut self, id: u32) {
        let entry = self.entries[id as usize];
        let mut child = entry.first_child;
        while child != NONE {
            let next = self.entries[child as usize].next_sibling;
            let orphan = &mut self.entries[child as usize];
            orphan.parent = NONE;
            orphan.prev_sibling = NONE;
            orphan.next_sibling = NONE;
            child = next;
        }
        if entry.parent != NONE {
            if entry.prev_sibling != NONE {
                self.entries[entry.prev_sibling as usize].next_sibling = entry.next_sibling;
            } else {
                self.entries[entry.parent as usize].first_child = entry.next_sibling;
            }
            if entry.next_sibling != NONE {
                self.entries[entry.next_sibling as usize].prev_sibling = entry.prev_sibling;
            }
            self.entries[entry.parent as usize].children -= 1;
            self.offer_candidate(entry.parent);
        }
        self.pool
            .free(entry.chunk)
            .expect("an entry's chunk is in use: a programming error otherwise");
        self.unindex(id);
        self.entries[id as usize].live = false;
        self.live -= 1;
        self.free_entries.push(id);
    }

    /// Loads in progress on `key` (0 when it is not cached).
    pub fn pins_of(&self, key: &OffloadKey) -> u32 {
        self.find(key).map_or(0, |id| self.entries[id as usize].pins)
    }

    /// The entry holding `key`.
    pub(super) fn find(&self, key: &OffloadKey) -> Option<u32> {
        find(&self.heads, &self.entries, key)
    }

    /// Takes entry `id` out of its hash chain.
    pub(super) fn unindex(&mut self, id: u32) {
        let hash = self.entries[id as usize].key.hash64();
        let next = self.entries[id as usize].same_hash;
        let head = self.heads[&hash];
        if head == id {
            if next == NONE {
                self.heads.remove(&hash);
            } else {
                self.heads.insert(hash, next);
            }
            return;
        }
        let mut previous = head;
        while self.entries[previous as usize].same_hash != id {
            previous = self.entries[previous as usize].same_hash;
            assert_ne!(
                previous, NONE,
                "an indexed entry is in its hash chain: a programming error"
            );
        }
        self.entries[previous as usize].same_hash = next;
    }
}

/// The entry holding `key` in the hash chains `heads` (module documentation of the index).
pub(super) fn find(
    heads: &HashMap<u64, u32, BuildPassThrough>,
    entries: &[Entry],
    key: &OffloadKey,
) -> Option<u32> {
    let mut id = *heads.get(&key.hash64())?;
    while id != NONE {
        let entry = &entries[id as usize];
        if entry.key == *key {
            return Some(id);
        }
        id = entry.same_hash;
    }
    None
}
