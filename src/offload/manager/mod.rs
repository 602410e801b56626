//! [`OffloadManager`]: vLLM's `OffloadingManager` contract over engine keys, for a host tier of
//! fixed-size chunks.
//!
//! The engine keeps its own device prefix cache and hands kvshm opaque keys (one per chunk of
//! KV blocks). The manager decides which keys live in the host tier, in which chunk, and which
//! leave it; the bytes are moved by the host tier ([`crate::offload::HostTier`]). Each key is one entry in
//! an arena: its chunk, whether its store has completed, how many loads read it, its parent key
//! (rebuilt from the order in which each request presents its keys) and its recency rank.
//!
//! The life of a key:
//! 1. `lookup` finds it missing; the engine computes the block and offers it to `prepare_store`,
//!    which takes a free chunk (evicting if it must) and inserts the key as pending (`HitPending`
//!    to lookups, never evicted);
//! 2. `complete_store(success)` makes it loadable (`Hit`), or drops it;
//! 3. `prepare_load` pins it for a load until `complete_load`;
//! 4. it leaves when an eviction picks it: leaf-first LRU, the least recently used key that is
//!    loadable, unpinned, without cached children and not among the keys of the store being
//!    prepared ([`EvictionOrder::Flat`] drops the leaf rule, which is vLLM's own LRU).
//!
//! Its parts: `config` (what a manager is built from, and its refusals), `entries` (the arena
//! of keys and their index), `eviction` (the candidates and the atomic eviction), `requests`
//! (what each live request presented), `taken` (chunks handed out before their keys are
//! known: a shared tier's leases), `invariants`.
//!
//! Recency follows vLLM's LRU policy exactly: a key gets a new rank when inserted, when touched
//! (the keys of one call in reverse order, so a prefix's head is the most recent) and when the
//! request that used it finishes (its keys in prefix order, reversed). An eviction is atomic:
//! victims are chosen first (with the parents they expose), and nothing changes when there are
//! too few.

use std::collections::{HashMap, HashSet};

use serde::Serialize;

mod config;
mod entries;
mod eviction;
mod invariants;
mod requests;
mod taken;

pub use config::{EvictionOrder, OffloadConfig, OffloadError, MAX_TAG_BYTES};
use entries::{find, pin, Entry};
pub use eviction::EvictionScope;
use requests::request_state;

use super::candidates::{Candidates, Rank};
use super::key::{BuildPassThrough, OffloadKey, RequestName};
use crate::pool::BlockPool;

const NONE: u32 = u32::MAX;

/// What `lookup` says about one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LookupResult {
    Miss,
    /// Stored and loadable.
    Hit,
    /// Being stored: not readable yet.
    HitPending,
}

/// What `prepare_store` decided; reused between calls so that they allocate nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PreparedStore {
    /// Indices into the keys given of those to store now (the others are cached already).
    pub to_store: Vec<u32>,
    /// The chunk of each key to store, in the same order.
    pub chunks: Vec<u32>,
    /// Keys evicted to make room, in eviction order.
    pub evicted: Vec<OffloadKey>,
    /// The chunk each evicted key held, in the same order.
    pub evicted_chunks: Vec<u32>,
}

impl PreparedStore {
    fn clear(&mut self) {
        self.to_store.clear();
        self.chunks.clear();
        self.evicted.clear();
        self.evicted_chunks.clear();
    }
}

/// Keys that entered or left the host tier, for the engine's KV events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffloadEvent {
    pub keys: Vec<OffloadKey>,
    /// Left the tier (evicted) rather than stored.
    pub removed: bool,
}

/// The manager's counters and gauges.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct OffloadStats {
    pub chunks: u32,
    /// Chunks holding a key (stored or being stored).
    pub chunks_used: u32,
    /// Chunks being written (stores not completed).
    pub chunks_storing: u32,
    /// Chunks pinned by loads in progress.
    pub chunks_loading: u32,
    pub lookups: u64,
    pub lookup_hits: u64,
    pub keys_stored: u64,
    pub stores_refused: u64,
    pub stores_failed: u64,
    pub keys_loaded: u64,
    pub evictions: u64,
    pub resets: u64,
    /// Keys taken back from a persistent tier at start ([`OffloadManager::restore`]).
    pub keys_restored: u64,
}

/// What the manager remembers of a live request.
#[derive(Debug, Default)]
struct RequestKeys {
    /// Keys recorded as this request's accesses (vLLM's rule: loads, and the stores it offered
    /// that were new or loadable), in the order first seen.
    seen: Vec<OffloadKey>,
    seen_set: HashSet<OffloadKey, BuildPassThrough>,
    /// Per chain tag, the last key of that chain this request presented that was cached: the
    /// parent of the next key it stores in that chain.
    chain_last: Vec<(OffloadKey, OffloadKey)>,
}

/// The host tier's keys, chunks and eviction order (module flow).
#[derive(Debug)]
pub struct OffloadManager {
    config: OffloadConfig,
    /// Key hash -> the first entry with that hash; entries sharing a hash are chained through
    /// `Entry::same_hash` and told apart by their whole keys. 16 bytes a bucket, so lookups
    /// stay in cache where a table of whole keys would not.
    heads: HashMap<u64, u32, BuildPassThrough>,
    /// Live entries.
    live: usize,
    entries: Vec<Entry>,
    free_entries: Vec<u32>,
    pool: BlockPool,
    candidates: Candidates,
    requests: HashMap<RequestName, RequestKeys, BuildPassThrough>,
    events: Vec<OffloadEvent>,
    stats: OffloadStats,
    /// Keys whose store has not completed.
    storing: u32,
    /// Keys pinned by loads.
    loading: u32,
    /// Chunks taken for keys that come later (`taken.rs`).
    taken: u32,
    /// Scratch of the eviction dry run: children counted as gone, per entry.
    gone_children: HashMap<u32, u32, BuildPassThrough>,
    selected: Vec<(Rank, u32)>,
    deferred: Vec<(Rank, u32)>,
    selected_set: HashSet<u32, BuildPassThrough>,
    /// Scratch of one call: the entries of its keys (`prepare_load`, `complete_load`), the new
    /// keys it chose to store (`prepare_store`), the entries an eviction must spare (`evict`).
    call_ids: Vec<u32>,
    call_new_keys: HashSet<OffloadKey, BuildPassThrough>,
    protected: HashSet<u32, BuildPassThrough>,
}

impl OffloadManager {
    pub fn new(config: OffloadConfig) -> Result<OffloadManager, OffloadError> {
        if config.layout.tag_bytes > MAX_TAG_BYTES {
            return Err(OffloadError::TagTooLong { tag_bytes: config.layout.tag_bytes });
        }
        let pool = BlockPool::new(config.chunks)?;
        Ok(OffloadManager {
            config,
            heads: HashMap::default(),
            live: 0,
            entries: Vec::new(),
            free_entries: Vec::new(),
            pool,
            candidates: Candidates::default(),
            requests: HashMap::default(),
            events: Vec::new(),
            stats: OffloadStats { chunks: config.chunks, ..OffloadStats::default() },
            storing: 0,
            loading: 0,
            taken: 0,
            gone_children: HashMap::default(),
            selected: Vec::new(),
            deferred: Vec::new(),
            selected_set: HashSet::default(),
            call_ids: Vec::new(),
            call_new_keys: HashSet::default(),
            protected: HashSet::default(),
        })
    }

    pub fn config(&self) -> &OffloadConfig {
        &self.config
    }

    /// Keys in the host tier (stored or being stored).
    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Whether `key` is in the host tier, and loadable. (`request` names the asker; the keys a
    /// request loads and stores, not those it looks up, make its chains.)
    pub fn lookup(&mut self, request: &str, key: &OffloadKey) -> LookupResult {
        let _ = request;
        self.stats.lookups += 1;
        let Some(id) = self.find(key) else { return LookupResult::Miss };
        self.stats.lookup_hits += 1;
        if self.entries[id as usize].ready {
            LookupResult::Hit
        } else {
            LookupResult::HitPending
        }
    }

    /// The state of `key` without counting a lookup (for tests and tools).
    pub fn peek(&self, key: &OffloadKey) -> LookupResult {
        match self.find(key) {
            None => LookupResult::Miss,
            Some(id) if self.entries[id as usize].ready => LookupResult::Hit,
            Some(_) => LookupResult::HitPending,
        }
    }

    /// Starts tracking a request (vLLM `on_new_request`). Calling it again for a live request
    /// keeps what it recorded.
    pub fn on_new_request(&mut self, request: &str) {
        if !self.requests.contains_key(request) {
            self.requests.insert(RequestName::new(request), RequestKeys::default());
        }
    }

    /// Pins `keys` for a load (all or none) and writes their chunks to `chunks`. A key named
    /// twice is pinned twice.
    pub fn prepare_load(
        &mut self,
        request: &str,
        keys: &[OffloadKey],
        chunks: &mut Vec<u32>,
    ) -> Result<(), OffloadError> {
        self.call_ids.clear();
        for key in keys {
            let id = find(&self.heads, &self.entries, key)
                .ok_or(OffloadError::UnknownKey { key: *key })?;
            if !self.entries[id as usize].ready {
                return Err(OffloadError::NotReady { key: *key });
            }
            self.call_ids.push(id);
        }
        chunks.clear();
        let tag_bytes = self.config.layout.tag_bytes;
        let state = request_state(&mut self.requests, request);
        for (key, &id) in keys.iter().zip(&self.call_ids) {
            chunks.push(pin(&mut self.entries, &mut self.loading, id));
            state.record(*key);
            state.set_chain_last(key.chain_tag(tag_bytes), *key);
        }
        self.stats.keys_loaded += keys.len() as u64;
        Ok(())
    }

    /// Pins the leading keys of `keys` that are loadable (up to the first missing or still
    /// being stored), as a load does, for a reader that is not a request: no lookup or load is
    /// counted and no access recorded (a write of the blocks to another tier is no use of
    /// them). Writes their chunks to `chunks` and returns how many;
    /// [`OffloadManager::complete_load`] lets go of them.
    pub fn pin_loadable(&mut self, keys: &[OffloadKey], chunks: &mut Vec<u32>) -> usize {
        chunks.clear();
        for key in keys {
            match find(&self.heads, &self.entries, key) {
                Some(id) if self.entries[id as usize].ready => {
                    chunks.push(pin(&mut self.entries, &mut self.loading, id));
                }
                _ => break,
            }
        }
        chunks.len()
    }

    /// Ends the loads of `keys` (one pin each, all or none: a key named twice needs two pins).
    pub fn complete_load(&mut self, keys: &[OffloadKey]) -> Result<(), OffloadError> {
        self.call_ids.clear();
        for key in keys {
            let id = find(&self.heads, &self.entries, key);
            let refusal = match id {
                None => Some(OffloadError::UnknownKey { key: *key }),
                Some(id) if self.entries[id as usize].pins == 0 => {
                    Some(OffloadError::NotPinned { key: *key })
                }
                Some(_) => None,
            };
            if let Some(refusal) = refusal {
                // Give back the pins taken so far: nothing changed.
                for &id in &self.call_ids {
                    pin(&mut self.entries, &mut self.loading, id);
                }
                return Err(refusal);
            }
            let id = id.expect("refused above when missing");
            let entry = &mut self.entries[id as usize];
            entry.pins -= 1;
            if entry.pins == 0 {
                self.loading -= 1;
            }
            self.call_ids.push(id);
        }
        let ids = std::mem::take(&mut self.call_ids);
        for &id in &ids {
            self.offer_candidate(id);
        }
        self.call_ids = ids;
        Ok(())
    }

    /// Marks `keys` recently used: the last one least, the first one most (a prefix's head).
    /// Unknown keys are skipped.
    pub fn touch(&mut self, keys: &[OffloadKey]) {
        for key in keys.iter().rev() {
            if let Some(id) = self.find(key) {
                self.rerank(id);
            }
        }
    }

    /// Prepares `keys` (offered by `request`) to be stored (module flow, step 1): keys cached
    /// already are left out, the others get chunks, evicting least recently used keys when the
    /// free chunks do not suffice; a key offered twice is stored once, at its first place.
    /// Returns `false` (and changes nothing but the request's record of what it offered) when
    /// not enough can be evicted.
    pub fn prepare_store(
        &mut self,
        request: &str,
        keys: &[OffloadKey],
        out: &mut PreparedStore,
    ) -> bool {
        self.prepare_store_within(request, keys, EvictionScope::default(), out)
    }

    /// [`OffloadManager::prepare_store`], evicting only within `scope` (and at least as many
    /// keys as it asks when there is anything to store).
    pub fn prepare_store_within(
        &mut self,
        request: &str,
        keys: &[OffloadKey],
        scope: EvictionScope<'_>,
        out: &mut PreparedStore,
    ) -> bool {
        out.clear();
        self.choose_stores(request, keys, out);
        if out.to_store.is_empty() {
            self.link_presented(request, keys);
            return true;
        }
        let needed = out.to_store.len().saturating_sub(self.pool.free_count()).max(scope.at_least);
        if needed > 0 {
            if !self.evict(needed, keys, scope, out) {
                self.stats.stores_refused += 1;
                out.to_store.clear();
                return false;
            }
            if self.config.events {
                self.events.push(OffloadEvent { keys: out.evicted.clone(), removed: true });
            }
        }
        self.pool
            .allocate_into(out.to_store.len(), &mut out.chunks)
            .expect("evictions freed enough chunks: a programming error otherwise");
        self.insert_stores(request, keys, out);
        true
    }

    /// Which of `keys` to store (`out.to_store`): those the tier lacks, each at its first place.
    /// The new keys and the loadable ones are recorded as the request's accesses, in the order
    /// offered (a key another request is still storing is not this one's access).
    fn choose_stores(&mut self, request: &str, keys: &[OffloadKey], out: &mut PreparedStore) {
        let state = request_state(&mut self.requests, request);
        self.call_new_keys.clear();
        for (index, key) in keys.iter().enumerate() {
            match find(&self.heads, &self.entries, key) {
                None => {
                    if self.call_new_keys.insert(*key) {
                        out.to_store.push(index as u32);
                    }
                    state.record(*key);
                }
                Some(id) if self.entries[id as usize].ready => state.record(*key),
                Some(_) => {}
            }
        }
    }

    /// Inserts the keys `out.to_store` names into `out.chunks` as pending stores, in order, each
    /// under the last key of its chain the request presented.
    fn insert_stores(&mut self, request: &str, keys: &[OffloadKey], out: &PreparedStore) {
        let tag_bytes = self.config.layout.tag_bytes;
        let mut to_store = out.to_store.iter().copied().peekable();
        let mut chunks = out.chunks.iter().copied();
        for (index, key) in keys.iter().enumerate() {
            let tag = key.chain_tag(tag_bytes);
            if to_store.peek() == Some(&(index as u32)) {
                to_store.next();
                let chunk = chunks.next().expect("one chunk per key to store");
                let parent = self.requests[request]
                    .chain_last(tag)
                    .and_then(|parent| self.find(&parent))
                    .unwrap_or(NONE);
                self.insert(*key, chunk, parent);
            }
            if self.find(key).is_some() {
                request_state(&mut self.requests, request).set_chain_last(tag, *key);
            }
        }
        self.stats.keys_stored += out.to_store.len() as u64;
    }

    /// Takes `key` back into `chunk` as stored and loadable, chained under `parent` if that is
    /// cached (a persistent host tier that outlived its manager: restore older keys first, so
    /// that the newest end up the most recent), and announced as stored to `take_events`.
    /// Refused, changing nothing, when the key is cached or the chunk is not free.
    pub fn restore(
        &mut self,
        key: OffloadKey,
        chunk: u32,
        parent: Option<&OffloadKey>,
    ) -> Result<(), OffloadError> {
        if self.find(&key).is_some() {
            return Err(OffloadError::AlreadyCached { key });
        }
        self.pool.take(chunk).map_err(|_| OffloadError::ChunkTaken { chunk })?;
        let parent = parent.and_then(|parent| self.find(parent)).unwrap_or(NONE);
        self.insert(key, chunk, parent);
        let id = self.find(&key).expect("inserted just above");
        self.storing -= 1;
        self.entries[id as usize].ready = true;
        self.offer_candidate(id);
        self.stats.keys_restored += 1;
        if self.config.events {
            // Announced as stored: the restarted engine holds it. Consecutive stored keys share
            // one event.
            match self.events.last_mut() {
                Some(last) if !last.removed => last.keys.push(key),
                _ => self.events.push(OffloadEvent { keys: vec![key], removed: false }),
            }
        }
        Ok(())
    }

    /// Makes stored keys loadable (`success`), or drops the keys whose store failed. Keys not
    /// being stored are skipped (a duplicate completion changes nothing).
    pub fn complete_store(&mut self, keys: &[OffloadKey], success: bool) {
        let mut stored = Vec::new();
        for key in keys {
            let Some(id) = self.find(key) else { continue };
            if self.entries[id as usize].ready {
                continue;
            }
            self.storing -= 1;
            if success {
                self.entries[id as usize].ready = true;
                self.offer_candidate(id);
                if self.config.events {
                    stored.push(*key);
                }
            } else {
                self.stats.stores_failed += 1;
                self.remove(id);
            }
        }
        if !stored.is_empty() {
            self.events.push(OffloadEvent { keys: stored, removed: false });
        }
    }

    /// Ends a request (vLLM `on_request_finished`): the keys it used become the most recently
    /// used, in prefix order reversed (the head most recent). `positions` (one per key the
    /// request presented, see [`OffloadManager::request_keys`]) give that order when keys were
    /// presented out of order; without them the order presented is used. Unknown requests are
    /// skipped.
    pub fn on_request_finished(
        &mut self,
        request: &str,
        positions: Option<&[u64]>,
    ) -> Result<(), OffloadError> {
        let Some(state) = self.requests.get(request) else { return Ok(()) };
        if let Some(positions) = positions {
            if positions.len() != state.seen.len() {
                return Err(OffloadError::PositionCount {
                    request: request.to_owned(),
                    given: positions.len(),
                    keys: state.seen.len(),
                });
            }
        }
        let state = self.requests.remove(request).expect("found just above");
        let mut order: Vec<usize> = (0..state.seen.len()).collect();
        if let Some(positions) = positions {
            // Stable: keys at one position keep the order presented (vLLM sorts the same way).
            order.sort_by_key(|&index| positions[index]);
        }
        for &index in order.iter().rev() {
            if let Some(id) = self.find(&state.seen[index]) {
                self.rerank(id);
            }
        }
        Ok(())
    }

    /// The keys a live request has presented, in the order `on_request_finished` positions
    /// refer to.
    pub fn request_keys(&self, request: &str) -> &[OffloadKey] {
        self.requests.get(request).map(|state| state.seen.as_slice()).unwrap_or_default()
    }

    /// Live requests.
    pub fn request_count(&self) -> usize {
        self.requests.len()
    }

    /// Hands out the events collected since the last call.
    pub fn take_events(&mut self) -> Vec<OffloadEvent> {
        std::mem::take(&mut self.events)
    }

    /// Drops every key and request (vLLM `reset_cache`); completions of earlier stores and
    /// loads are not expected any more.
    pub fn reset(&mut self) {
        self.heads.clear();
        self.live = 0;
        self.entries.clear();
        self.free_entries.clear();
        self.pool.clear();
        self.candidates.clear();
        self.requests.clear();
        self.storing = 0;
        self.loading = 0;
        self.taken = 0;
        self.stats.resets += 1;
    }

    pub fn stats(&self) -> OffloadStats {
        OffloadStats {
            chunks_used: self.pool.used_count() as u32,
            chunks_storing: self.storing,
            chunks_loading: self.loading,
            ..self.stats
        }
    }

    /// The chunk of `key`, if cached.
    pub fn chunk_of(&self, key: &OffloadKey) -> Option<u32> {
        self.find(key).map(|id| self.entries[id as usize].chunk)
    }

    /// The key `key` was linked under when stored, if it is cached and has one.
    pub fn parent_of(&self, key: &OffloadKey) -> Option<OffloadKey> {
        let id = self.find(key)?;
        let parent = self.entries[id as usize].parent;
        (parent != NONE).then(|| self.entries[parent as usize].key)
    }

    /// Every cached key with whether it is loadable (for tests and differential checks).
    pub fn keys(&self) -> impl Iterator<Item = (OffloadKey, bool)> + '_ {
        self.entries.iter().filter(|entry| entry.live).map(|entry| (entry.key, entry.ready))
    }
}

#[cfg(test)]
mod tests;
