//! The eviction order of the offload manager: a min-heap of (recency rank, entry) with lazy
//! invalidation.
//!
//! Ranks come from one counter and are never reused, so `(rank, entry)` names one version of an
//! entry: when an entry is touched it gets a new rank and a new heap record, and the old record
//! goes stale; a stale record (or one of an entry that is not a candidate right now) is dropped
//! when it reaches the top. A plain list would not do: an entry becomes a candidate again with
//! the rank it had (its last child left, its load completed), which puts it in the middle of
//! the order, not at an end.
//!
//! Records beyond twice the live entries are compacted away by a rebuild.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A position in the eviction order: smaller ranks go first.
pub type Rank = u64;

/// The heap of candidate records.
#[derive(Debug, Default)]
pub struct Candidates {
    heap: BinaryHeap<Reverse<(Rank, u32)>>,
    next_rank: Rank,
}

impl Candidates {
    /// A rank newer than every rank handed out before.
    pub fn next_rank(&mut self) -> Rank {
        self.next_rank += 1;
        self.next_rank
    }

    pub fn push(&mut self, rank: Rank, entry: u32) {
        self.heap.push(Reverse((rank, entry)));
    }

    /// The record with the smallest rank.
    pub fn pop(&mut self) -> Option<(Rank, u32)> {
        self.heap.pop().map(|Reverse(record)| record)
    }

    pub fn len(&self) -> usize {
        self.heap.len()
    }

    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// Replaces the records with exactly `live` (the current candidates) once stale records
    /// outnumber live entries twice over.
    pub fn compact_if_bloated(&mut self, entries: usize, live: impl FnOnce() -> Vec<(Rank, u32)>) {
        if self.heap.len() <= 64.max(2 * entries) {
            return;
        }
        self.heap = live().into_iter().map(Reverse).collect();
    }

    /// Every record, in no order (for invariant checks).
    pub fn records(&self) -> impl Iterator<Item = (Rank, u32)> + '_ {
        self.heap.iter().map(|Reverse(record)| *record)
    }

    /// Forgets every record; ranks keep growing.
    pub fn clear(&mut self) {
        self.heap.clear();
    }
}
