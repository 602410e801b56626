//! Chunks handed out before their keys are known: a tier shared by several engines leases each
//! engine a few free chunks, so that the engine answers a store at once and tells the tier's
//! owner later which keys it wrote where (DESIGN §12.3, [`crate::offload::SharedTierIndex`]).
//!
//! 1. [`OffloadManager::take_chunks`]: chunks leave the free pool holding no key (evicting as a
//!    store would when fewer are free); no lookup finds them, and no eviction picks them;
//! 2. [`OffloadManager::store_into`]: keys go into taken chunks as pending stores, as
//!    [`OffloadManager::prepare_store`] would have stored them; the chunks of the keys it would
//!    not have stored (in the tier already, or offered twice) stay taken;
//! 3. [`OffloadManager::return_chunks`]: taken chunks go back to the free pool (a chunk its
//!    engine wrote for a key the tier had, once that copy is over; a lease its engine gave up).

use super::{EvictionScope, OffloadEvent, OffloadManager, PreparedStore};
use crate::offload::key::OffloadKey;

impl OffloadManager {
    /// Module flow, step 1: `count` chunks into `out.chunks`, evicting within `scope` when fewer
    /// are free (the keys evicted in `out.evicted`). All or nothing: `false`, and nothing
    /// taken, when not enough can be evicted.
    pub fn take_chunks(
        &mut self,
        count: usize,
        scope: EvictionScope<'_>,
        out: &mut PreparedStore,
    ) -> bool {
        out.clear();
        let needed = count.saturating_sub(self.pool.free_count()).max(scope.at_least);
        if needed > 0 {
            if !self.evict(needed, &[], scope, out) {
                return false;
            }
            if self.config.events {
                self.events.push(OffloadEvent { keys: out.evicted.clone(), removed: true });
            }
        }
        self.pool
            .allocate_into(count, &mut out.chunks)
            .expect("evictions freed enough chunks: a programming error otherwise");
        self.taken += count as u32;
        true
    }

    /// Module flow, step 2: stores `keys` for `request`, the key at index `i` in the taken
    /// chunk `chunks[i]` (one chunk per key). `out.to_store` and `out.chunks` say which were
    /// stored where, as [`OffloadManager::prepare_store`]'s would; the indices of the others,
    /// whose chunks stay taken, are written to `spare`.
    pub fn store_into(
        &mut self,
        request: &str,
        keys: &[OffloadKey],
        chunks: &[u32],
        out: &mut PreparedStore,
        spare: &mut Vec<u32>,
    ) {
        assert_eq!(keys.len(), chunks.len(), "one taken chunk per key: a programming error");
        out.clear();
        spare.clear();
        self.choose_stores(request, keys, out);
        let mut to_store = out.to_store.iter().copied().peekable();
        for (index, &chunk) in chunks.iter().enumerate().take(keys.len()) {
            if to_store.peek() == Some(&(index as u32)) {
                to_store.next();
                out.chunks.push(chunk);
            } else {
                spare.push(index as u32);
            }
        }
        self.taken -= out.chunks.len() as u32;
        if out.to_store.is_empty() {
            self.link_presented(request, keys);
            return;
        }
        self.insert_stores(request, keys, out);
    }

    /// Module flow, step 3: taken chunks go back to the free pool.
    pub fn return_chunks(&mut self, chunks: &[u32]) {
        for &chunk in chunks {
            self.pool.free(chunk).expect("a taken chunk is in use: a programming error otherwise");
        }
        self.taken -= chunks.len() as u32;
    }

    /// Takes `chunks`, free now (the chunks of stores just dropped), out of the free pool as
    /// taken chunks, which no store gets until they are returned.
    pub fn take_free(&mut self, chunks: &[u32]) {
        for &chunk in chunks {
            self.pool
                .take(chunk)
                .expect("a chunk just freed is free: a programming error otherwise");
        }
        self.taken += chunks.len() as u32;
    }

    /// Chunks free now.
    pub fn free_chunks(&self) -> usize {
        self.pool.free_count()
    }

    /// Chunks taken and not yet stored into or returned.
    pub fn taken_chunks(&self) -> usize {
        self.taken as usize
    }
}
