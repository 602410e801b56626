//! The shared tier's index (`SharedTierIndex`): several clients over one host tier, pins per
//! client, one eviction order, quotas, a client's release, its key table for the next owner;
//! and a randomized run against a naive model with `check_invariants` after every step.

use std::collections::{HashMap, HashSet};

use kvshm::offload::shared::{TierArenas, TierKeys, MAX_PINS, MAX_REQUESTS};
use kvshm::offload::{
    ClientId, LookupResult, OffloadConfig, OffloadKey, PreparedStore, SharedTierError,
    SharedTierIndex, TierIdentity,
};
use kvshm_ipc::name::SegmentName;

use crate::support::Rng;

/// The tier of the shared-tier tests (also `tier_owner`'s).
pub(crate) fn identity() -> TierIdentity {
    TierIdentity {
        model: "org/tiny-llama".into(),
        kv_dtype: "float16".into(),
        block_tokens: 16,
        block_bytes: 65_536,
        blocks_per_chunk: 1,
        layout: "groups [0..32]; tp 1 pp 1".into(),
    }
}

pub(crate) fn key(block: u32) -> OffloadKey {
    let mut bytes = [0u8; 16];
    bytes[..4].copy_from_slice(&block.to_le_bytes());
    bytes[4..].fill(0xa5);
    OffloadKey::new(&bytes).unwrap()
}

pub(crate) fn keys(blocks: &[u32]) -> Vec<OffloadKey> {
    blocks.iter().map(|&block| key(block)).collect()
}

fn block_of(key: &OffloadKey) -> u32 {
    u32::from_le_bytes(key.as_bytes()[..4].try_into().unwrap())
}

pub(crate) fn tier(chunks: u32) -> SharedTierIndex {
    SharedTierIndex::new(identity(), OffloadConfig::new(chunks)).unwrap()
}

/// A tier of `chunks` chunks keeping tier `name`'s key table (a new one, or with `adopt` the one
/// an earlier index left), and how many keys it took back from it.
fn tier_with_keys(name: &SegmentName, chunks: u32, adopt: bool) -> (SharedTierIndex, usize) {
    let (table, entries) = TierKeys::open(name, &identity(), chunks, adopt).unwrap();
    let mut index = tier(chunks);
    let restored = index.keep_key_table(table, entries);
    (index, restored)
}

pub(crate) fn check(index: &SharedTierIndex) {
    if let Err(violation) = index.check_invariants() {
        panic!("{violation}");
    }
}

/// `client` stores `blocks` for `request` and completes the store; returns the evicted blocks.
fn store(index: &mut SharedTierIndex, client: ClientId, request: &str, blocks: &[u32]) -> Vec<u32> {
    let keys = keys(blocks);
    let mut out = PreparedStore::default();
    assert!(index.prepare_store(client, request, &keys, &mut out).unwrap(), "refused {blocks:?}");
    check(index);
    let stored: Vec<OffloadKey> = out.to_store.iter().map(|&i| keys[i as usize]).collect();
    index.complete_store(client, &stored, true).unwrap();
    index.finish_request(client, request).unwrap();
    check(index);
    out.evicted.iter().map(block_of).collect()
}

/// The index takes a client for every client slot a tier's control object can have and one more,
/// the owner's storage tier: an owner never finds it full for a client that claimed a slot (it
/// would have to take the slot back from a live client, whose rings another could then share).
#[test]
fn every_control_slot_and_the_storage_tier_find_room_in_the_index() {
    use kvshm_ipc::tier_control::MAX_TIER_CLIENTS;

    let mut index = tier(64);
    for client in 0..=MAX_TIER_CLIENTS {
        index.attach(&identity(), &format!("engine-{client}"), None).unwrap();
    }
    assert_eq!(index.attach(&identity(), "one more", None), Err(SharedTierError::NoFreeSlot));
    check(&index);
}

#[test]
fn a_block_stored_by_one_client_is_a_hit_for_another() {
    let mut index = tier(8);
    let a = index.attach(&identity(), "engine-a", None).unwrap();
    let b = index.attach(&identity(), "engine-b", None).unwrap();
    store(&mut index, a, "r1", &[1, 2, 3]);
    let mut chunks = Vec::new();
    let hits = index.acquire_prefix(b, "r2", &keys(&[1, 2, 3, 4]), &mut chunks).unwrap();
    assert_eq!((hits, chunks.len()), (3, 3));
    assert_eq!(index.owner_of(&key(2)), Some(a), "the chunk stays charged to who stored it");
    check(&index);
    index.release_loads(b, &keys(&[1, 2, 3])).unwrap();
    check(&index);
}

#[test]
fn an_attach_with_another_model_dtype_or_layout_is_refused_by_name() {
    let mut index = tier(4);
    let mut other = identity();
    other.kv_dtype = "bfloat16".into();
    let refused = index.attach(&other, "engine-b", None).unwrap_err();
    assert!(matches!(refused, SharedTierError::Mismatch { field: "kv_dtype", .. }), "{refused}");
    assert!(refused.to_string().contains("bfloat16"), "{refused}");
    let mut other = identity();
    other.block_tokens = 32;
    assert!(matches!(
        index.attach(&other, "engine-c", None),
        Err(SharedTierError::Mismatch { field: "block_tokens", .. })
    ));
    assert_ne!(other.tier_name(), identity().tier_name(), "another layout is another tier");
    assert!(identity().tier_name().starts_with("kvshm-tier-tiny-llama-"));
}

#[test]
fn a_client_releases_only_its_own_pins() {
    let mut index = tier(4);
    let a = index.attach(&identity(), "a", None).unwrap();
    let b = index.attach(&identity(), "b", None).unwrap();
    store(&mut index, a, "r", &[1]);
    index.acquire_prefix(a, "ra", &keys(&[1]), &mut Vec::new()).unwrap();
    let refused = index.release_loads(b, &keys(&[1])).unwrap_err();
    assert!(matches!(refused, SharedTierError::NotPinnedByClient { .. }), "{refused}");
    check(&index);
    index.release_loads(a, &keys(&[1])).unwrap();
    check(&index);
}

/// A client holds at most `MAX_PINS` loads at once: a lookup past them is refused with a typed
/// error and pins nothing, so no client can carry a key's pin count past `u32` (the owner
/// panicked when a client left after such a wrap); a release makes room again.
#[test]
fn a_client_past_its_pins_is_refused_and_pins_nothing() {
    let mut index = tier(4);
    let a = index.attach(&identity(), "a", None).unwrap();
    let b = index.attach(&identity(), "b", None).unwrap();
    store(&mut index, a, "r", &[1]);
    let many = keys(&[1]).repeat(MAX_PINS as usize);
    assert_eq!(index.acquire_prefix(a, "ra", &many, &mut Vec::new()).unwrap(), many.len());
    let refused = index.acquire_prefix(a, "ra", &keys(&[1]), &mut Vec::new()).unwrap_err();
    assert!(matches!(refused, SharedTierError::TooManyPins { more: 1, .. }), "{refused}");
    let refused = index.pin_to_read(a, &keys(&[1]), &mut Vec::new()).unwrap_err();
    assert!(matches!(refused, SharedTierError::TooManyPins { .. }), "the storage tier's pins too");
    assert_eq!(index.client_summary(a).unwrap().pins, MAX_PINS);
    assert_eq!(index.acquire_prefix(b, "rb", &keys(&[1]), &mut Vec::new()).unwrap(), 1);
    check(&index);
    index.release_loads(a, &keys(&[1])).unwrap();
    assert_eq!(index.acquire_prefix(a, "ra", &keys(&[1]), &mut Vec::new()).unwrap(), 1);
    check(&index);
    let released = index.release_client(a).unwrap();
    assert_eq!(released.pins, MAX_PINS);
    index.release_loads(b, &keys(&[1])).unwrap();
    check(&index);
}

/// A client has at most `MAX_REQUESTS` requests live in the tier: a call naming one more is
/// refused with a typed error, one of its live requests still served, and a finished request
/// makes room.
#[test]
fn a_client_past_its_live_requests_is_refused_a_new_one() {
    let mut index = tier(4);
    let a = index.attach(&identity(), "a", None).unwrap();
    let miss = keys(&[1]);
    for request in 0..MAX_REQUESTS {
        let name = request.to_string();
        assert_eq!(index.acquire_prefix(a, &name, &miss, &mut Vec::new()).unwrap(), 0);
    }
    let refused = index.acquire_prefix(a, "one more", &miss, &mut Vec::new()).unwrap_err();
    assert!(matches!(refused, SharedTierError::TooManyRequests { .. }), "{refused}");
    index.finish_request(a, "never named").unwrap();
    assert_eq!(index.acquire_prefix(a, "7", &miss, &mut Vec::new()).unwrap(), 0, "live: served");
    index.finish_request(a, "7").unwrap();
    assert_eq!(index.acquire_prefix(a, "one more", &miss, &mut Vec::new()).unwrap(), 0);
    check(&index);
    index.release_client(a).unwrap();
    check(&index);
}

/// A client that goes ends its requests oldest first, so the keys of its newest request become
/// the most recently used of the tier (the order the owner keeps in a map, by first call).
#[test]
fn a_released_client_ends_its_requests_oldest_first() {
    let mut index = tier(4);
    let a = index.attach(&identity(), "a", None).unwrap();
    let b = index.attach(&identity(), "b", None).unwrap();
    for (request, block) in [("first", 1), ("second", 2)] {
        let mut out = PreparedStore::default();
        assert!(index.prepare_store(a, request, &keys(&[block]), &mut out).unwrap());
        index.complete_store(a, &keys(&[block]), true).unwrap();
    }
    store(&mut index, b, "rb", &[3]);
    index.release_client(a).unwrap();
    check(&index);
    // Least recently used now: 3, then 1 (its request ended first), then 2.
    assert_eq!(store(&mut index, b, "r4", &[4]), Vec::<u32>::new());
    assert_eq!(store(&mut index, b, "r5", &[5]), vec![3]);
    assert_eq!(store(&mut index, b, "r6", &[6]), vec![1]);
}

#[test]
fn one_eviction_order_over_the_tier_takes_the_least_recently_used_of_any_client() {
    let mut index = tier(4);
    let a = index.attach(&identity(), "a", None).unwrap();
    let b = index.attach(&identity(), "b", None).unwrap();
    store(&mut index, a, "r1", &[1, 2]);
    store(&mut index, b, "r2", &[5, 6]);
    // a's chain is the oldest: its leaf goes first, then its head, though b stores.
    assert_eq!(store(&mut index, b, "r3", &[7, 8]), vec![2, 1]);
    assert_eq!(store(&mut index, a, "r4", &[9]), vec![6]);
}

/// A tier keeps a 256th of its chunks free ahead of demand (at most `DEFAULT_FREE_CHUNKS`): the
/// least recently used keys go, uncharged from their client, and a store of as many new keys
/// then evicts nothing.
#[test]
fn a_tier_keeps_chunks_free_ahead_of_the_stores_that_need_them() {
    let mut index = tier(512);
    assert_eq!(index.free_target(), 2);
    assert_eq!(tier(255).free_target(), 0, "a small tier keeps none");
    let a = index.attach(&identity(), "a", None).unwrap();
    let b = index.attach(&identity(), "b", None).unwrap();
    for request in 0..8 {
        let blocks: Vec<u32> = (request * 64..(request + 1) * 64).collect();
        let client = if request == 0 { a } else { b };
        store(&mut index, client, &format!("r{request}"), &blocks);
    }
    assert_eq!(index.evict_ahead(usize::MAX), 2);
    check(&index);
    // a's chain is the oldest: its leaf and the block before it went.
    assert_eq!(index.peek(&key(63)), LookupResult::Miss);
    assert_eq!(index.peek(&key(62)), LookupResult::Miss);
    assert_eq!(index.client_summary(a).unwrap().chunks, 62);
    assert_eq!(index.evict_ahead(usize::MAX), 0, "two are free");
    assert!(store(&mut index, b, "s", &[1000, 1001]).is_empty(), "the store evicted");
    index.keep_free(0);
    assert_eq!(index.evict_ahead(usize::MAX), 0);
}

#[test]
fn a_client_at_its_quota_evicts_its_own_blocks_and_never_the_others() {
    let mut index = tier(6);
    let greedy = index.attach(&identity(), "greedy", Some(2)).unwrap();
    let other = index.attach(&identity(), "other", None).unwrap();
    store(&mut index, other, "o", &[100, 101]);
    store(&mut index, greedy, "g1", &[1, 2]);
    // Free chunks remain, but greedy is at its quota: it evicts its own oldest leaf.
    assert_eq!(store(&mut index, greedy, "g2", &[3]), vec![2]);
    assert_eq!(store(&mut index, greedy, "g3", &[10, 11]), vec![1, 3]);
    assert_eq!(index.peek(&key(100)), LookupResult::Hit, "the other client's blocks stay");
    let listed: HashMap<String, u32> =
        index.clients().into_iter().map(|client| (client.name, client.chunks)).collect();
    assert_eq!((listed["greedy"], listed["other"]), (2, 2));
    // More than its quota in one store cannot fit: refused, nothing changes.
    let mut out = PreparedStore::default();
    assert!(!index.prepare_store(greedy, "g4", &keys(&[20, 21, 22]), &mut out).unwrap());
    check(&index);
}

#[test]
fn releasing_a_dead_client_frees_its_pins_and_drops_its_partial_stores() {
    let mut index = tier(4);
    let a = index.attach(&identity(), "a", None).unwrap();
    let b = index.attach(&identity(), "b", None).unwrap();
    store(&mut index, b, "r", &[1, 2]);
    index.acquire_prefix(a, "ra", &keys(&[1, 2]), &mut Vec::new()).unwrap();
    let mut out = PreparedStore::default();
    assert!(index.prepare_store(a, "ra", &keys(&[1, 2, 3, 4]), &mut out).unwrap());
    // Full, and every key is pinned or pending: b cannot store.
    assert!(!index.prepare_store(b, "rb", &keys(&[9]), &mut out).unwrap());
    let released = index.release_client(a).unwrap();
    assert_eq!((released.pins, released.stores), (2, 2));
    check(&index);
    assert_eq!(index.peek(&key(3)), LookupResult::Miss, "a partial store is never a hit");
    assert_eq!(index.peek(&key(1)), LookupResult::Hit, "b's blocks stay");
    assert_eq!(store(&mut index, b, "rb", &[9]), Vec::<u32>::new());
    assert!(matches!(
        index.release_loads(a, &keys(&[1])),
        Err(SharedTierError::UnknownClient { .. })
    ));
    // The slot is reused under a new generation; the old id stays refused.
    let c = index.attach(&identity(), "c", None).unwrap();
    assert_eq!(c.slot, a.slot);
    assert_ne!(c, a);
    assert!(index.acquire_prefix(a, "x", &keys(&[1]), &mut Vec::new()).is_err());
}

/// A naive model of the same rules: every decision by scanning every key.
#[derive(Default)]
struct Model {
    chunks: usize,
    /// key -> its state
    keys: HashMap<u32, ModelKey>,
    rank: u64,
    /// (client slot, request) -> (accesses in order, last key presented)
    requests: HashMap<(usize, u32), (Vec<u32>, Option<u32>)>,
    clients: Vec<Option<ModelClient>>,
}

/// A client of the model: its quota, the keys it is storing, its requests in the order first
/// used.
#[derive(Clone, Default)]
struct ModelClient {
    quota: Option<u32>,
    storing: HashSet<u32>,
    requests: Vec<u32>,
}

struct ModelKey {
    rank: u64,
    ready: bool,
    pins: HashMap<usize, u32>,
    parent: Option<u32>,
    owner: Option<usize>,
}

impl Model {
    fn next_rank(&mut self) -> u64 {
        self.rank += 1;
        self.rank
    }

    fn pinned(&self, key: u32) -> bool {
        self.keys[&key].pins.values().any(|&count| count > 0)
    }

    fn candidate(&self, key: u32, gone: &[u32]) -> bool {
        let state = &self.keys[&key];
        let has_child = self
            .keys
            .iter()
            .any(|(child, other)| other.parent == Some(key) && !gone.contains(child));
        state.ready && !self.pinned(key) && !has_child
    }

    fn remove(&mut self, key: u32) {
        self.keys.remove(&key);
        for other in self.keys.values_mut() {
            if other.parent == Some(key) {
                other.parent = None;
            }
        }
    }

    fn touch_request(&mut self, client: usize, request: u32) {
        let state = self.clients[client].as_mut().unwrap();
        if !state.requests.contains(&request) {
            state.requests.push(request);
        }
        self.requests.entry((client, request)).or_default();
    }

    fn acquire(&mut self, client: usize, request: u32, blocks: &[u32]) -> usize {
        self.touch_request(client, request);
        let hits = blocks.iter().take_while(|b| self.keys.get(b).is_some_and(|k| k.ready)).count();
        for block in &blocks[..hits] {
            *self.keys.get_mut(block).unwrap().pins.entry(client).or_insert(0) += 1;
            let state = self.requests.get_mut(&(client, request)).unwrap();
            if !state.0.contains(block) {
                state.0.push(*block);
            }
            state.1 = Some(*block);
        }
        hits
    }

    fn prepare_store(
        &mut self,
        client: usize,
        request: u32,
        offered: &[u32],
    ) -> Option<(Vec<u32>, Vec<u32>)> {
        self.touch_request(client, request);
        let mut to_store: Vec<u32> = Vec::new();
        for &key in offered {
            if !self.keys.contains_key(&key) && !to_store.contains(&key) {
                to_store.push(key);
            }
        }
        let state = self.requests.get_mut(&(client, request)).unwrap();
        for key in offered {
            let record = self.keys.get(key).is_none_or(|k| k.ready);
            if record && !state.0.contains(key) {
                state.0.push(*key);
            }
        }
        if to_store.is_empty() {
            for key in offered {
                if self.keys.contains_key(key) {
                    self.requests.get_mut(&(client, request)).unwrap().1 = Some(*key);
                }
            }
            return Some((to_store, Vec::new()));
        }
        let quota = self.clients[client].as_ref().unwrap().quota;
        let charged = self.keys.values().filter(|k| k.owner == Some(client)).count();
        let over = quota.map_or(0, |q| (charged + to_store.len()).saturating_sub(q as usize));
        let needed = (self.keys.len() + to_store.len()).saturating_sub(self.chunks).max(over);
        let mut evicted = Vec::new();
        while evicted.len() < needed {
            let victim = self
                .keys
                .iter()
                .filter(|(key, _)| !offered.contains(key) && !evicted.contains(*key))
                .filter(|(_, state)| over == 0 || state.owner == Some(client))
                .filter(|(key, _)| self.candidate(**key, &evicted))
                .min_by_key(|(_, state)| state.rank)
                .map(|(&key, _)| key);
            evicted.push(victim?);
        }
        for key in &evicted {
            self.remove(*key);
        }
        for key in offered {
            if to_store.contains(key) && !self.keys.contains_key(key) {
                let parent =
                    self.requests[&(client, request)].1.filter(|p| self.keys.contains_key(p));
                let rank = self.next_rank();
                let state = ModelKey {
                    rank,
                    ready: false,
                    pins: HashMap::new(),
                    parent,
                    owner: Some(client),
                };
                self.keys.insert(*key, state);
                self.clients[client].as_mut().unwrap().storing.insert(*key);
            }
            if self.keys.contains_key(key) {
                self.requests.get_mut(&(client, request)).unwrap().1 = Some(*key);
            }
        }
        Some((to_store, evicted))
    }

    fn complete_store(&mut self, client: usize, keys: &[u32], success: bool) {
        for key in keys {
            if !self.clients[client].as_mut().unwrap().storing.remove(key) {
                continue;
            }
            if success {
                self.keys.get_mut(key).unwrap().ready = true;
            } else {
                self.remove(*key);
            }
        }
    }

    fn finish(&mut self, client: usize, request: u32) {
        self.clients[client].as_mut().unwrap().requests.retain(|&live| live != request);
        if let Some((seen, _)) = self.requests.remove(&(client, request)) {
            for key in seen.iter().rev() {
                if self.keys.contains_key(key) {
                    let rank = self.next_rank();
                    self.keys.get_mut(key).unwrap().rank = rank;
                }
            }
        }
    }

    /// Returns (pins released, stores dropped).
    fn release(&mut self, client: usize) -> (u32, u32) {
        let mut pins = 0;
        for state in self.keys.values_mut() {
            pins += state.pins.remove(&client).unwrap_or(0);
        }
        let ModelClient { storing: stores, requests, .. } = self.clients[client].clone().unwrap();
        for key in &stores {
            self.remove(*key);
        }
        for request in requests {
            self.finish(client, request);
        }
        for state in self.keys.values_mut() {
            if state.owner == Some(client) {
                state.owner = None;
            }
        }
        self.clients[client] = None;
        (pins, stores.len() as u32)
    }
}

fn run_against_model(seed: u64) {
    let chunks = 24;
    let mut index = tier(chunks);
    let mut model = Model { chunks: chunks as usize, ..Model::default() };
    let mut rng = Rng::new(seed);
    let mut ids: Vec<ClientId> = Vec::new();
    for slot in 0..3 {
        let quota = [None, Some(6), Some(12)][slot];
        ids.push(index.attach(&identity(), &format!("c{slot}"), quota).unwrap());
        model.clients.push(Some(ModelClient { quota, ..ModelClient::default() }));
    }
    // Per client: stores and loads not completed yet.
    let mut pending: Vec<Vec<Vec<u32>>> = vec![Vec::new(); 3];
    let mut loading: Vec<Vec<Vec<u32>>> = vec![Vec::new(); 3];
    let mut out = PreparedStore::default();
    let (mut evictions, mut refusals, mut releases, mut hits) = (0, 0, 0, 0);
    for step in 0..30_000 {
        let client = rng.below(3);
        let id = ids[client];
        let request = rng.below(4) as u32;
        let name = request.to_string();
        // A path of a few conversations that share their heads.
        let root = rng.below(6) as u32 * 100;
        let len = 1 + rng.below(8) as u32;
        let blocks: Vec<u32> = (0..len).map(|i| root + i).collect();
        match rng.below(12) {
            0..=1 => {
                let mut chunks = Vec::new();
                let got = index.acquire_prefix(id, &name, &keys(&blocks), &mut chunks).unwrap();
                assert_eq!(got, model.acquire(client, request, &blocks), "step {step}");
                assert_eq!(chunks.len(), got);
                if got > 0 {
                    hits += got;
                    loading[client].push(blocks[..got].to_vec());
                }
            }
            2..=4 => {
                let from = rng.below(blocks.len());
                let offered = &blocks[from..];
                let accepted = index.prepare_store(id, &name, &keys(offered), &mut out).unwrap();
                match model.prepare_store(client, request, offered) {
                    None => {
                        assert!(!accepted, "step {step}: the model refused {offered:?}");
                        refusals += 1;
                    }
                    Some((to_store, evicted)) => {
                        assert!(accepted, "step {step}: the model stored {offered:?}");
                        let stored: Vec<u32> =
                            out.to_store.iter().map(|&i| offered[i as usize]).collect();
                        assert_eq!(stored, to_store, "step {step}");
                        let got: Vec<u32> = out.evicted.iter().map(block_of).collect();
                        assert_eq!(got, evicted, "step {step}: victims");
                        evictions += evicted.len();
                        if !stored.is_empty() {
                            pending[client].push(stored);
                        }
                    }
                }
            }
            5..=6 if !pending[client].is_empty() => {
                let at = rng.below(pending[client].len());
                let job = pending[client].swap_remove(at);
                let success = !rng.chance(10);
                index.complete_store(id, &keys(&job), success).unwrap();
                model.complete_store(client, &job, success);
            }
            7..=8 if !loading[client].is_empty() => {
                let at = rng.below(loading[client].len());
                let job = loading[client].swap_remove(at);
                index.release_loads(id, &keys(&job)).unwrap();
                for block in &job {
                    *model.keys.get_mut(block).unwrap().pins.get_mut(&client).unwrap() -= 1;
                }
            }
            9..=10 => {
                index.finish_request(id, &name).unwrap();
                model.finish(client, request);
            }
            11 if rng.chance(5) => {
                // The client dies: everything it held goes; a new one takes the slot.
                let released = index.release_client(id).unwrap();
                assert_eq!((released.pins, released.stores), model.release(client), "step {step}");
                pending[client].clear();
                loading[client].clear();
                let quota = [None, Some(6), Some(12)][client];
                ids[client] = index.attach(&identity(), "again", quota).unwrap();
                model.clients[client] = Some(ModelClient { quota, ..ModelClient::default() });
                releases += 1;
            }
            _ => {}
        }
        check(&index);
        assert_eq!(index.len(), model.keys.len(), "step {step}");
        for (block, state) in &model.keys {
            let owner = index.owner_of(&key(*block)).map(|id| id.slot as usize);
            assert_eq!(owner, state.owner, "step {step}: owner of {block}");
        }
    }
    eprintln!(
        "seed {seed}: {evictions} evictions, {refusals} refusals, {releases} releases, {hits} hits"
    );
    assert!(
        evictions > 1_000 && refusals > 10 && releases > 5 && hits > 1_000,
        "the run exercised it"
    );
}

/// The key table (`TierKeys`) gives the next owner's index the keys whose stores completed with
/// success, in their chunks and under their parents, and nothing else: not a failed store, not
/// one left pending (its chunk may be half written).
#[test]
fn a_new_index_takes_back_what_the_key_table_names_and_nothing_else() {
    let name = SegmentName::new(&format!("t-tierkeys-{}", std::process::id())).unwrap();
    let (mut index, restored) = tier_with_keys(&name, 3, false);
    assert_eq!(restored, 0);
    let a = index.attach(&identity(), "a", None).unwrap();
    store(&mut index, a, "r1", &[1, 2]);
    let mut out = PreparedStore::default();
    assert!(index.prepare_store(a, "r2", &keys(&[7]), &mut out).unwrap());
    index.complete_store(a, &keys(&[7]), false).unwrap();
    assert!(index.prepare_store(a, "r3", &keys(&[8]), &mut out).unwrap());
    check(&index);
    drop(index);

    let (mut next, restored) = tier_with_keys(&name, 3, true);
    assert_eq!(restored, 2);
    check(&next);
    let found: Vec<LookupResult> =
        [1, 2, 7, 8].iter().map(|&block| next.peek(&key(block))).collect();
    assert_eq!(
        found,
        [LookupResult::Hit, LookupResult::Hit, LookupResult::Miss, LookupResult::Miss]
    );
    // Key 2 came back under key 1: the leaf goes first when room is made.
    let b = next.attach(&identity(), "b", None).unwrap();
    assert_eq!(store(&mut next, b, "r4", &[9, 10]), [2]);
    drop(next);

    let (_, entries) = TierKeys::open(&name, &identity(), 3, false).unwrap();
    assert!(entries.is_empty(), "a new tier clears the table");
    TierArenas::unlink(&name, 0);
}

/// A key evicted ahead of demand leaves the key table at once: a new owner does not take it
/// back, though its chunk, still free, holds its bytes (the key may be stored again elsewhere
/// meanwhile, and the table would name it twice).
#[test]
fn a_key_evicted_ahead_is_not_taken_back_by_a_new_index() {
    let name = SegmentName::new(&format!("t-aheadkeys-{}", std::process::id())).unwrap();
    let (mut index, restored) = tier_with_keys(&name, 256, false);
    assert_eq!(restored, 0);
    let a = index.attach(&identity(), "a", None).unwrap();
    for block in 0..256 {
        store(&mut index, a, &format!("r{block}"), &[block]);
    }
    assert_eq!(index.evict_ahead(usize::MAX), 1);
    assert_eq!(index.peek(&key(0)), LookupResult::Miss, "the oldest went");
    drop(index);

    let (next, restored) = tier_with_keys(&name, 256, true);
    assert_eq!(restored, 255);
    assert_eq!(next.peek(&key(0)), LookupResult::Miss);
    check(&next);
    drop(next);
    TierArenas::unlink(&name, 0);
}

#[test]
fn randomized_decisions_of_several_clients_match_a_naive_model() {
    for seed in 1..=3 {
        run_against_model(seed);
    }
}

#[test]
fn an_identity_decodes_to_itself_and_cut_or_padded_bytes_to_nothing() {
    let encoded = identity().encode();
    assert_eq!(TierIdentity::decode(&encoded), Some(identity()));
    for cut in 0..encoded.len() {
        assert_eq!(TierIdentity::decode(&encoded[..cut]), None, "cut at {cut}");
    }
    let mut padded = encoded.clone();
    padded.push(0);
    assert_eq!(TierIdentity::decode(&padded), None);
    let mut huge = encoded;
    huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert_eq!(TierIdentity::decode(&huge), None, "a length past the end is refused");
}

/// A chunk whose slot names a key, evicted and handed to a store left pending, does not come
/// back under the evicted key (its bytes may be half written): its slot was cleared.
#[test]
fn a_reused_chunk_is_not_restored_under_its_evicted_key() {
    let name = SegmentName::new(&format!("t-tierkeys-reuse-{}", std::process::id())).unwrap();
    let (mut index, _) = tier_with_keys(&name, 2, false);
    let a = index.attach(&identity(), "a", None).unwrap();
    store(&mut index, a, "r1", &[1]);
    store(&mut index, a, "r2", &[2]);
    let mut out = PreparedStore::default();
    assert!(index.prepare_store(a, "r3", &keys(&[3]), &mut out).unwrap());
    assert_eq!(out.evicted.len(), 1, "one key evicted for the pending store");
    let evicted = out.evicted[0];
    drop(index);
    let (next, restored) = tier_with_keys(&name, 2, true);
    let back = next.peek(&evicted);
    TierArenas::unlink(&name, 0);
    assert_eq!(restored, 1);
    assert_eq!(back, LookupResult::Miss, "restored over a chunk being written");
}

/// A key table another process scribbled on (a slot's sequence number at its largest) is read
/// without a panic, and the tier goes on storing.
#[test]
fn a_key_table_with_the_largest_sequence_number_is_taken_back_without_a_panic() {
    use kvshm_ipc::arena::{Arena, ArenaKind};

    let name = SegmentName::new(&format!("t-tierkeys-seq-{}", std::process::id())).unwrap();
    let (mut index, _) = tier_with_keys(&name, 2, false);
    let a = index.attach(&identity(), "a", None).unwrap();
    store(&mut index, a, "r1", &[1]);
    drop(index);
    // Slot 0 (after the table's 64-byte header): its sequence number, 8 bytes in.
    let keys = Arena::open(&name, ArenaKind::Keys, 0).unwrap();
    keys.write_data(64 + 8, &u64::MAX.to_le_bytes()).unwrap();

    let (mut next, restored) = tier_with_keys(&name, 2, true);
    assert_eq!(restored, 1);
    let b = next.attach(&identity(), "b", None).unwrap();
    store(&mut next, b, "r2", &[2]);
    drop((next, keys));
    TierArenas::unlink(&name, 0);
}
