//! Eviction: leaf-first LRU over the loadable, unpinned keys (module flow of the manager, step 4).
//!
//! Candidates are kept in [`Candidates`], a heap of (recency rank, entry) records with lazy
//! invalidation: a key that is touched gets a new rank and a new record, and a record that no
//! longer names its entry as it is now is dropped when it reaches the top. One eviction
//! ([`OffloadManager::evict`]) is a dry run first: it pops candidates, counting the children each
//! parent would lose so that a parent left without children joins the candidates within the same
//! eviction (under [`EvictionOrder::LeafFirst`]), and sets aside the keys it must spare (the
//! store's own keys, and keys outside its [`EvictionScope`]); only when
//! it found enough are the victims removed, else every record goes back and nothing changes.
//! An eviction ahead of demand ([`OffloadManager::evict_ahead`], a shared tier's owner between
//! batches) removes what it found, enough or not.

use super::{find, EvictionOrder, OffloadEvent, OffloadManager, PreparedStore, NONE};
#[cfg(doc)]
use crate::offload::candidates::Candidates;
use crate::offload::candidates::Rank;
use crate::offload::key::OffloadKey;

/// Which keys a store may evict, and how many at least: the whole tier by default; a tier shared
/// by several engines narrows it to one engine's chunks when that engine is at its quota
/// ([`crate::offload::SharedTierIndex`]).
#[derive(Clone, Copy, Default)]
pub struct EvictionScope<'a> {
    /// Evict at least this many keys, even when free chunks would do.
    pub at_least: usize,
    /// Evict only keys whose chunk this accepts (`None`: any key).
    pub only: Option<&'a dyn Fn(u32) -> bool>,
    /// Evict what was found when it is fewer than asked, rather than nothing.
    pub partial: bool,
}

impl EvictionScope<'_> {
    fn allows(&self, chunk: u32) -> bool {
        self.only.is_none_or(|only| only(chunk))
    }
}

impl std::fmt::Debug for EvictionScope<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EvictionScope")
            .field("at_least", &self.at_least)
            .field("narrowed", &self.only.is_some())
            .field("partial", &self.partial)
            .finish()
    }
}

impl OffloadManager {
    /// A new rank for entry `id`, and a new candidate record if it is one.
    pub(super) fn rerank(&mut self, id: u32) {
        self.entries[id as usize].rank = self.candidates.next_rank();
        self.offer_candidate(id);
    }

    pub(super) fn is_candidate(&self, id: u32, gone_children: u32) -> bool {
        let entry = &self.entries[id as usize];
        entry.ready
            && entry.pins == 0
            && (self.config.order == EvictionOrder::Flat || entry.children == gone_children)
    }

    /// Pushes a candidate record for entry `id` if it is a candidate now.
    pub(super) fn offer_candidate(&mut self, id: u32) {
        if self.is_candidate(id, 0) {
            self.candidates.push(self.entries[id as usize].rank, id);
        }
        let entries = &self.entries;
        let order = self.config.order;
        self.candidates.compact_if_bloated(self.live, || {
            (0u32..)
                .zip(entries)
                .filter_map(|(id, entry)| {
                    let candidate = entry.live
                        && entry.ready
                        && entry.pins == 0
                        && (order == EvictionOrder::Flat || entry.children == 0);
                    candidate.then_some((entry.rank, id))
                })
                .collect()
        });
    }

    /// Whether heap record `(rank, id)` names entry `id` as it is now.
    pub(super) fn record_is_current(&self, rank: Rank, id: u32) -> bool {
        self.entries.get(id as usize).is_some_and(|entry| entry.live && entry.rank == rank)
    }

    /// Evicts `count` candidates within `scope` and not among `protected` (module flow, step 4),
    /// appending their keys and chunks to `out`; all or nothing, unless `scope.partial`.
    pub(super) fn evict(
        &mut self,
        count: usize,
        protected: &[OffloadKey],
        scope: EvictionScope<'_>,
        out: &mut PreparedStore,
    ) -> bool {
        self.selected.clear();
        self.deferred.clear();
        self.selected_set.clear();
        self.gone_children.clear();
        self.protected.clear();
        for key in protected {
            if let Some(id) = find(&self.heads, &self.entries, key) {
                self.protected.insert(id);
            }
        }
        while self.selected.len() < count {
            let Some((rank, id)) = self.candidates.pop() else { break };
            if !self.record_is_current(rank, id) || self.selected_set.contains(&id) {
                continue;
            }
            let gone = self.gone_children.get(&id).copied().unwrap_or(0);
            if !self.is_candidate(id, gone) {
                continue;
            }
            if self.protected.contains(&id) || !scope.allows(self.entries[id as usize].chunk) {
                self.deferred.push((rank, id));
                continue;
            }
            self.selected.push((rank, id));
            self.selected_set.insert(id);
            // Its parent may now be a leaf, with the rank it already has.
            let parent = self.entries[id as usize].parent;
            if parent != NONE && self.config.order == EvictionOrder::LeafFirst {
                let gone = self.gone_children.entry(parent).or_insert(0);
                *gone += 1;
                let gone = *gone;
                if self.is_candidate(parent, gone) {
                    self.candidates.push(self.entries[parent as usize].rank, parent);
                }
            }
        }
        let enough = self.selected.len() == count;
        for &(rank, id) in &self.deferred {
            self.candidates.push(rank, id);
        }
        if !enough && !scope.partial {
            for &(rank, id) in &self.selected {
                self.candidates.push(rank, id);
            }
            return false;
        }
        let selected = std::mem::take(&mut self.selected);
        for &(_, id) in &selected {
            out.evicted.push(self.entries[id as usize].key);
            out.evicted_chunks.push(self.entries[id as usize].chunk);
            self.remove(id);
        }
        self.stats.evictions += selected.len() as u64;
        self.selected = selected;
        true
    }

    /// Evicts least recently used keys toward `free_target` free chunks, ahead of the stores
    /// that will need them: at most `most`, and fewer when fewer can go (pinned, or being
    /// stored). What it evicted is in `out` (cleared first).
    pub fn evict_ahead(&mut self, free_target: usize, most: usize, out: &mut PreparedStore) {
        out.clear();
        let wanted = free_target.saturating_sub(self.pool.free_count()).min(most);
        if wanted == 0 {
            return;
        }
        let scope = EvictionScope { partial: true, ..EvictionScope::default() };
        self.evict(wanted, &[], scope, out);
        if self.config.events && !out.evicted.is_empty() {
            self.events.push(OffloadEvent { keys: out.evicted.clone(), removed: true });
        }
    }
}
