//! Chunks a shared tier keeps free ahead of demand (DESIGN §12.5): its owner evicts between
//! batches, once it has answered them, so that a store finds its chunks free rather than evicting
//! for them while its client waits.
//!
//! 1. [`SharedTierIndex::keep_free`] sets how many (by default [`DEFAULT_FREE_CHUNKS`], never
//!    more than a 256th of the tier, so that the keys it costs stay few: a tier of fewer than 256
//!    chunks keeps none);
//! 2. [`SharedTierIndex::evict_ahead`], after each turn of the owner's loop, in slices of
//!    [`EVICT_AHEAD_SLICE`] keys until a client asks (and after each request in `kvshm replay
//!    --instances`, which serves as the owner does), evicts the least recently used keys of the
//!    whole tier toward that many free chunks, or fewer when fewer can go; their chunks are
//!    uncharged from the clients that stored them, and their key-table slots cleared (a new owner
//!    restores no key evicted here).
//!
//! A store that needs more than are free evicts the rest itself, as without this: the free
//! chunks only move evictions off the wait, and a batch that comes during a slice waits for that
//! slice at most. They cost the tier as many cached keys.

use super::SharedTierIndex;

/// Chunks a tier keeps free by default: the stores of a step of a few requests.
pub const DEFAULT_FREE_CHUNKS: u32 = 64;

/// The most keys the owner evicts ahead of demand before it looks for a batch again.
pub const EVICT_AHEAD_SLICE: usize = 8;

impl SharedTierIndex {
    /// Keeps `chunks` chunks free ahead of the stores that need them (module flow, step 1); 0
    /// keeps none.
    pub fn keep_free(&mut self, chunks: u32) {
        self.free_target = (chunks as usize).min(self.owners.len() / 256);
    }

    /// The chunks [`SharedTierIndex::evict_ahead`] keeps free.
    pub fn free_target(&self) -> usize {
        self.free_target
    }

    /// Module flow, step 2: evicts at most `most` keys; returns how many it evicted. Chunks
    /// held back for a dead client (`release.rs`) count as free: they are within seconds, and
    /// evicting cached keys for them now would lose those keys for nothing.
    pub fn evict_ahead(&mut self, most: usize) -> usize {
        let mut evicted = std::mem::take(&mut self.evicted_ahead);
        let target = self.free_target.saturating_sub(self.held_back_chunks().count());
        self.manager.evict_ahead(target, most, &mut evicted);
        for &chunk in &evicted.evicted_chunks {
            self.discharge(chunk);
            if let Some(table) = &self.keys {
                table.cleared(chunk);
            }
        }
        let count = evicted.evicted.len();
        self.evicted_ahead = evicted;
        count
    }
}
