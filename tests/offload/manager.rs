//! The offload manager (vLLM's `OffloadingManager` contract over engine keys): lookups, stores,
//! loads, leaf-first LRU evictions, events, and a randomized run against a naive model.

use std::collections::HashMap;

use kvshm::offload::{
    EvictionOrder, KeyLayout, LookupResult, OffloadConfig, OffloadError, OffloadKey,
    OffloadManager, PreparedStore,
};

use crate::support::Rng;

/// A vLLM-shaped key: a 32-byte block hash and a 4-byte big-endian group index.
fn key(block: u32, group: u32) -> OffloadKey {
    let mut bytes = [0u8; 36];
    bytes[..4].copy_from_slice(&block.to_le_bytes());
    bytes[4..32].fill(0x5a);
    bytes[32..].copy_from_slice(&group.to_be_bytes());
    OffloadKey::new(&bytes).unwrap()
}

fn keys(blocks: &[u32]) -> Vec<OffloadKey> {
    blocks.iter().map(|&block| key(block, 0)).collect()
}

fn manager(chunks: u32, order: EvictionOrder) -> OffloadManager {
    let mut config = OffloadConfig::new(chunks);
    config.layout = KeyLayout { tag_bytes: 4 };
    config.order = order;
    config.events = true;
    OffloadManager::new(config).unwrap()
}

fn check(manager: &OffloadManager) {
    if let Err(violation) = manager.check_invariants() {
        panic!("{violation}");
    }
}

/// Offers `blocks` for storing on behalf of `request` and completes the store.
fn store(manager: &mut OffloadManager, request: &str, blocks: &[u32]) -> PreparedStore {
    let keys = keys(blocks);
    let mut out = PreparedStore::default();
    assert!(manager.prepare_store(request, &keys, &mut out), "store of {blocks:?} refused");
    check(manager);
    let stored: Vec<OffloadKey> = out.to_store.iter().map(|&i| keys[i as usize]).collect();
    manager.complete_store(&stored, true);
    check(manager);
    out
}

fn evicted_blocks(out: &PreparedStore) -> Vec<u32> {
    out.evicted
        .iter()
        .map(|key| u32::from_le_bytes(key.as_bytes()[..4].try_into().unwrap()))
        .collect()
}

#[test]
fn a_key_is_missing_then_pending_then_loadable() {
    let mut manager = manager(4, EvictionOrder::LeafFirst);
    let k = keys(&[1]);
    manager.on_new_request("r");
    assert_eq!(manager.lookup("r", &k[0]), LookupResult::Miss);
    let mut out = PreparedStore::default();
    assert!(manager.prepare_store("r", &k, &mut out));
    assert_eq!((out.to_store.as_slice(), out.chunks.len()), (&[0][..], 1));
    assert_eq!(manager.lookup("r", &k[0]), LookupResult::HitPending);
    assert_eq!(
        manager.prepare_load("r", &k, &mut Vec::new()),
        Err(OffloadError::NotReady { key: k[0] }),
        "a block being written cannot be read"
    );
    manager.complete_store(&k, true);
    assert_eq!(manager.lookup("r", &k[0]), LookupResult::Hit);
    let mut chunks = Vec::new();
    manager.prepare_load("r", &k, &mut chunks).unwrap();
    assert_eq!(chunks, out.chunks);
    manager.complete_load(&k).unwrap();
    assert_eq!(manager.complete_load(&k), Err(OffloadError::NotPinned { key: k[0] }));
    check(&manager);
}

#[test]
fn keys_already_cached_are_left_out_of_a_store() {
    let mut manager = manager(8, EvictionOrder::LeafFirst);
    store(&mut manager, "a", &[1, 2]);
    let out = store(&mut manager, "b", &[1, 2, 3]);
    assert_eq!(out.to_store, vec![2]);
    assert_eq!(manager.len(), 3);
}

#[test]
fn keys_of_any_length_up_to_64_bytes_are_distinct_entries() {
    let mut manager = OffloadManager::new(OffloadConfig::new(8)).unwrap();
    let sha = OffloadKey::new(&[7u8; 36]).unwrap();
    let xx = OffloadKey::new(&[7u8; 20]).unwrap();
    let widest = OffloadKey::new(&[7u8; 64]).unwrap();
    let mut out = PreparedStore::default();
    assert!(manager.prepare_store("r", &[sha, xx, widest], &mut out));
    assert_eq!(out.to_store.len(), 3, "a prefix of a key is another key");
    assert!(OffloadKey::new(&[7u8; 65]).is_err());
}

#[test]
fn eviction_takes_the_least_recently_used_leaf_and_reports_it() {
    let mut manager = manager(4, EvictionOrder::LeafFirst);
    store(&mut manager, "a", &[1, 2]);
    manager.on_request_finished("a", None).unwrap();
    store(&mut manager, "b", &[3, 4]);
    manager.on_request_finished("b", None).unwrap();
    // Request a's chain 1 -> 2 is older; its tail goes first.
    let out = store(&mut manager, "c", &[5]);
    assert_eq!(evicted_blocks(&out), vec![2]);
    let events = manager.take_events();
    assert!(events.iter().any(|event| event.removed && event.keys == keys(&[2])));
    assert!(events.iter().any(|event| !event.removed && event.keys == keys(&[5])));
    assert!(manager.take_events().is_empty());
}

#[test]
fn a_parent_stays_while_its_child_is_cached_where_flat_lru_would_orphan_the_child() {
    // Stored in one call, 1 is older than 2 (vLLM ranks insertions in order); with the request
    // still running, flat LRU evicts 1 and leaves 2 unreachable.
    let mut leaf_first = manager(2, EvictionOrder::LeafFirst);
    let mut flat = manager(2, EvictionOrder::Flat);
    for manager in [&mut leaf_first, &mut flat] {
        store(manager, "a", &[1, 2]);
    }
    assert_eq!(evicted_blocks(&store(&mut leaf_first, "b", &[9])), vec![2]);
    assert_eq!(evicted_blocks(&store(&mut flat, "b", &[9])), vec![1]);
    assert_eq!(leaf_first.parent_of(&key(2, 0)), None, "evicted");
    assert_eq!(leaf_first.peek(&key(1, 0)), LookupResult::Hit);
}

#[test]
fn chains_are_per_group_and_a_key_links_under_the_last_key_its_request_loaded_or_stored() {
    let mut manager = manager(16, EvictionOrder::LeafFirst);
    let request = "r";
    let group_keys = [key(1, 0), key(2, 0), key(1, 1), key(2, 1)];
    let mut out = PreparedStore::default();
    assert!(manager.prepare_store(request, &group_keys, &mut out));
    manager.complete_store(&group_keys, true);
    assert_eq!(manager.parent_of(&key(2, 0)), Some(key(1, 0)));
    assert_eq!(manager.parent_of(&key(2, 1)), Some(key(1, 1)));
    assert_eq!(manager.parent_of(&key(1, 1)), None);
    // Another request loads 1 and 2 and stores 3 after them.
    manager.on_new_request("s");
    assert_eq!(manager.lookup("s", &key(3, 0)), LookupResult::Miss);
    manager.prepare_load("s", &[key(1, 0), key(2, 0)], &mut Vec::new()).unwrap();
    assert!(manager.prepare_store("s", &[key(3, 0)], &mut out));
    assert_eq!(manager.parent_of(&key(3, 0)), Some(key(2, 0)));
    check(&manager);
}

#[test]
fn keys_of_the_store_being_prepared_and_pinned_keys_are_never_evicted() {
    let mut manager = manager(3, EvictionOrder::Flat);
    store(&mut manager, "a", &[1]);
    store(&mut manager, "b", &[2]);
    store(&mut manager, "c", &[3]);
    let mut chunks = Vec::new();
    manager.prepare_load("d", &keys(&[2]), &mut chunks).unwrap();
    // 1 is offered again with 4: protected. 2 is being loaded. Only 3 can go.
    let mut out = PreparedStore::default();
    assert!(manager.prepare_store("e", &keys(&[1, 4]), &mut out));
    assert_eq!(evicted_blocks(&out), vec![3]);
    check(&manager);
}

/// An eviction ahead of demand frees chunks up to its target, least recently used first,
/// fewer when fewer can go (a key pinned or being stored stays), and reports what it evicted.
#[test]
fn an_eviction_ahead_frees_what_it_can_up_to_its_target() {
    let mut manager = manager(4, EvictionOrder::LeafFirst);
    for (request, block) in [("a", 1), ("b", 2), ("c", 3), ("d", 4)] {
        store(&mut manager, request, &[block]);
    }
    manager.take_events();
    let mut out = PreparedStore::default();
    manager.evict_ahead(1, usize::MAX, &mut out);
    assert_eq!(evicted_blocks(&out), vec![1]);
    manager.evict_ahead(1, usize::MAX, &mut out);
    assert!(out.evicted.is_empty(), "one is free already");
    // 5 takes the free chunk and is being stored, 2 is pinned: of the four asked for, only 3
    // and 4 can go.
    assert!(manager.prepare_store("e", &keys(&[5]), &mut out));
    manager.prepare_load("f", &keys(&[2]), &mut Vec::new()).unwrap();
    manager.evict_ahead(4, usize::MAX, &mut out);
    assert_eq!(evicted_blocks(&out), vec![3, 4]);
    check(&manager);
    let removed: Vec<usize> = manager.take_events().iter().map(|event| event.keys.len()).collect();
    assert_eq!(removed, vec![1, 2], "each eviction ahead is an event of its keys");
}

#[test]
fn a_store_that_cannot_evict_enough_is_refused_and_changes_nothing() {
    let mut manager = manager(2, EvictionOrder::LeafFirst);
    store(&mut manager, "a", &[1]);
    let mut out = PreparedStore::default();
    assert!(manager.prepare_store("b", &keys(&[2]), &mut out));
    // 2 is still being stored; 1 is pinned: nothing can go.
    manager.prepare_load("c", &keys(&[1]), &mut Vec::new()).unwrap();
    let before: Vec<_> = manager.keys().collect();
    assert!(!manager.prepare_store("d", &keys(&[3]), &mut out));
    assert!(out.to_store.is_empty() && out.evicted.is_empty());
    let mut after: Vec<_> = manager.keys().collect();
    let mut before = before;
    before.sort_by_key(|(key, _)| key.as_bytes().to_vec());
    after.sort_by_key(|(key, _)| key.as_bytes().to_vec());
    assert_eq!(before, after);
    assert_eq!(manager.stats().stores_refused, 1);
    check(&manager);
    manager.complete_load(&keys(&[1])).unwrap();
    assert!(manager.prepare_store("d", &keys(&[3]), &mut out));
    assert_eq!(evicted_blocks(&out), vec![1]);
    check(&manager);
}

#[test]
fn an_eviction_may_take_a_leaf_and_then_the_parent_it_exposed() {
    let mut manager = manager(3, EvictionOrder::LeafFirst);
    store(&mut manager, "a", &[1, 2, 3]);
    manager.on_request_finished("a", None).unwrap();
    let mut out = PreparedStore::default();
    assert!(manager.prepare_store("b", &keys(&[7, 8]), &mut out));
    assert_eq!(evicted_blocks(&out), vec![3, 2]);
    check(&manager);
}

#[test]
fn a_failed_store_drops_its_keys_and_their_children_become_chain_heads() {
    let mut manager = manager(4, EvictionOrder::LeafFirst);
    let k = keys(&[1, 2]);
    let mut out = PreparedStore::default();
    assert!(manager.prepare_store("a", &k, &mut out));
    manager.complete_store(&k[1..], true);
    manager.complete_store(&k[..1], false);
    assert_eq!(manager.peek(&k[0]), LookupResult::Miss);
    assert_eq!(manager.parent_of(&k[1]), None);
    assert_eq!(manager.stats().stores_failed, 1);
    check(&manager);
    manager.complete_store(&k, false);
    assert_eq!(manager.peek(&k[1]), LookupResult::Hit, "a loadable key is not dropped");
}

#[test]
fn a_finished_request_makes_its_prefix_head_the_most_recent() {
    let mut manager = manager(4, EvictionOrder::Flat);
    store(&mut manager, "a", &[1, 2]);
    store(&mut manager, "b", &[3, 4]);
    // Presented out of order; positions restore the prefix order 4, 3.
    manager.touch(&keys(&[3, 4]));
    let presented: Vec<OffloadKey> = manager.request_keys("b").to_vec();
    assert_eq!(presented, keys(&[3, 4]));
    manager.on_request_finished("b", Some(&[20, 10])).unwrap();
    let mut out = PreparedStore::default();
    assert!(manager.prepare_store("c", &keys(&[5, 6, 7]), &mut out));
    // 1 and 2 are older than request b's keys; of those, 3 (position 20, the tail) goes first.
    assert_eq!(evicted_blocks(&out), vec![1, 2, 3]);
    assert_eq!(
        manager.on_request_finished("c", Some(&[1])),
        Err(OffloadError::PositionCount { request: "c".into(), given: 1, keys: 3 })
    );
    check(&manager);
}

#[test]
fn reset_drops_every_key_and_request() {
    let mut manager = manager(4, EvictionOrder::LeafFirst);
    store(&mut manager, "a", &[1, 2]);
    manager.reset();
    check(&manager);
    assert!(manager.is_empty());
    assert_eq!(manager.request_count(), 0);
    assert_eq!(manager.stats().chunks_used, 0);
    store(&mut manager, "b", &[1, 2, 3, 4]);
}

/// A naive model of the same rules: every decision by scanning every key.
#[derive(Default)]
struct Model {
    chunks: usize,
    flat: bool,
    /// key -> (rank, ready, pins, parent)
    keys: HashMap<u32, (u64, bool, u32, Option<u32>)>,
    rank: u64,
    /// request -> (accesses in order, last key presented)
    requests: HashMap<u32, (Vec<u32>, Option<u32>)>,
}

impl Model {
    fn next_rank(&mut self) -> u64 {
        self.rank += 1;
        self.rank
    }

    fn candidate(&self, key: u32, gone: &[u32]) -> bool {
        let (_, ready, pins, _) = self.keys[&key];
        let has_child = self
            .keys
            .iter()
            .any(|(child, &(_, _, _, parent))| parent == Some(key) && !gone.contains(child));
        ready && pins == 0 && (self.flat || !has_child)
    }

    /// The least recently used candidate not in `spared`, counting `gone` as evicted.
    fn victim(&self, spared: &[u32], gone: &[u32]) -> Option<u32> {
        self.keys
            .iter()
            .filter(|(key, _)| !spared.contains(key) && !gone.contains(*key))
            .filter(|(key, _)| self.candidate(**key, gone))
            .min_by_key(|(_, &(rank, ..))| rank)
            .map(|(&key, _)| key)
    }

    fn remove(&mut self, evicted: &[u32]) {
        for key in evicted {
            self.keys.remove(key);
            for entry in self.keys.values_mut() {
                if entry.3 == Some(*key) {
                    entry.3 = None;
                }
            }
        }
    }

    /// Evicts toward `free_target` free chunks, at most `most` keys, fewer when fewer can go.
    fn evict_ahead(&mut self, free_target: usize, most: usize) -> Vec<u32> {
        let wanted = (free_target + self.keys.len()).saturating_sub(self.chunks).min(most);
        let mut evicted = Vec::new();
        while evicted.len() < wanted {
            match self.victim(&[], &evicted) {
                Some(key) => evicted.push(key),
                None => break,
            }
        }
        self.remove(&evicted);
        evicted
    }

    fn prepare_store(&mut self, request: u32, offered: &[u32]) -> Option<(Vec<u32>, Vec<u32>)> {
        // A key offered twice is stored once, at its first place.
        let mut to_store: Vec<u32> = Vec::new();
        for &key in offered {
            if !self.keys.contains_key(&key) && !to_store.contains(&key) {
                to_store.push(key);
            }
        }
        let state = self.requests.entry(request).or_default();
        for key in offered {
            let record = match self.keys.get(key) {
                None => true,
                Some(&(_, ready, _, _)) => ready,
            };
            if record && !state.0.contains(key) {
                state.0.push(*key);
            }
        }
        let mut evicted = Vec::new();
        let needed = (self.keys.len() + to_store.len()).saturating_sub(self.chunks);
        while evicted.len() < needed {
            match self.victim(offered, &evicted) {
                Some(key) => evicted.push(key),
                None => return None,
            }
        }
        self.remove(&evicted);
        for key in offered {
            if to_store.contains(key) && !self.keys.contains_key(key) {
                let parent = self.requests[&request].1.filter(|p| self.keys.contains_key(p));
                let rank = self.next_rank();
                self.keys.insert(*key, (rank, false, 0, parent));
            }
            if self.keys.contains_key(key) {
                self.requests.get_mut(&request).unwrap().1 = Some(*key);
            }
        }
        Some((to_store, evicted))
    }

    fn complete_store(&mut self, keys: &[u32], success: bool) {
        for key in keys {
            match self.keys.get_mut(key) {
                Some(entry) if !entry.1 => {
                    if success {
                        entry.1 = true;
                    } else {
                        self.keys.remove(key);
                        for entry in self.keys.values_mut() {
                            if entry.3 == Some(*key) {
                                entry.3 = None;
                            }
                        }
                    }
                }
                _ => {}
            }
        }
    }

    fn finish(&mut self, request: u32) {
        if let Some((seen, _)) = self.requests.remove(&request) {
            for key in seen.iter().rev() {
                if self.keys.contains_key(key) {
                    let rank = self.next_rank();
                    self.keys.get_mut(key).unwrap().0 = rank;
                }
            }
        }
    }
}

fn run_against_model(order: EvictionOrder, seed: u64) {
    let chunks = 24;
    let mut manager = manager(chunks, order);
    let mut model =
        Model { chunks: chunks as usize, flat: order == EvictionOrder::Flat, ..Model::default() };
    let mut rng = Rng::new(seed);
    let mut pending: Vec<Vec<u32>> = Vec::new();
    let mut loading: Vec<Vec<u32>> = Vec::new();
    let mut out = PreparedStore::default();
    for step in 0..20_000 {
        let request = rng.below(6) as u32;
        let name = request.to_string();
        match rng.below(10) {
            0..=3 => {
                // A request offers a run of a prefix: a few conversations share heads.
                let root = rng.below(4) as u32 * 100;
                let start = rng.below(6) as u32;
                let len = 1 + rng.below(4) as u32;
                let mut blocks: Vec<u32> = (start..start + len).map(|i| root + i).collect();
                if rng.chance(8) {
                    // An engine offering a key twice in one call.
                    let twice = blocks[rng.below(blocks.len())];
                    blocks.insert(rng.below(blocks.len() + 1), twice);
                }
                // Lookups first, as vLLM does, up to the first miss.
                manager.on_new_request(&name);
                model.requests.entry(request).or_default();
                for &block in &blocks {
                    if manager.lookup(&name, &key(block, 0)) == LookupResult::Miss {
                        break;
                    }
                }
                let accepted = manager.prepare_store(&name, &keys(&blocks), &mut out);
                let expected = model.prepare_store(request, &blocks);
                match expected {
                    None => assert!(!accepted, "step {step}: the model refused {blocks:?}"),
                    Some((to_store, evicted)) => {
                        assert!(accepted, "step {step}: the model stored {blocks:?}");
                        let stored: Vec<u32> =
                            out.to_store.iter().map(|&i| blocks[i as usize]).collect();
                        assert_eq!(stored, to_store, "step {step}");
                        assert_eq!(evicted_blocks(&out), evicted, "step {step}");
                        if !stored.is_empty() {
                            pending.push(stored);
                        }
                    }
                }
            }
            4..=5 if !pending.is_empty() => {
                let job = pending.swap_remove(rng.below(pending.len()));
                let success = !rng.chance(10);
                manager.complete_store(&keys(&job), success);
                model.complete_store(&job, success);
            }
            6 => {
                let mut ready: Vec<u32> = model
                    .keys
                    .iter()
                    .filter(|(_, entry)| entry.1)
                    .map(|(&key, _)| key)
                    .take(1 + rng.below(2))
                    .collect();
                if !ready.is_empty() && rng.chance(8) {
                    // A load naming a key twice pins it twice.
                    ready.push(ready[0]);
                }
                if !ready.is_empty() {
                    manager.prepare_load(&name, &keys(&ready), &mut Vec::new()).unwrap();
                    let state = model.requests.entry(request).or_default();
                    for key in &ready {
                        if !state.0.contains(key) {
                            state.0.push(*key);
                        }
                        state.1 = Some(*key);
                        model.keys.get_mut(key).unwrap().2 += 1;
                    }
                    loading.push(ready);
                }
            }
            7 if !loading.is_empty() => {
                let job = loading.swap_remove(rng.below(loading.len()));
                manager.complete_load(&keys(&job)).unwrap();
                for key in &job {
                    model.keys.get_mut(key).unwrap().2 -= 1;
                }
            }
            8 => {
                manager.on_request_finished(&name, None).unwrap();
                model.finish(request);
            }
            _ => {
                // A shared tier's owner between batches: toward a few free chunks, in slices.
                let (target, most) = (rng.below(6), 1 + rng.below(3));
                manager.evict_ahead(target, most, &mut out);
                let evicted = model.evict_ahead(target, most);
                assert_eq!(evicted_blocks(&out), evicted, "step {step}");
            }
        }
        check(&manager);
        assert_eq!(manager.len(), model.keys.len(), "step {step}");
    }
    let stats = manager.stats();
    eprintln!("{order:?} seed {seed}: {stats:?}");
    assert!(stats.evictions > 1_000 && stats.stores_refused > 10, "the run exercised evictions");
}

#[test]
fn randomized_leaf_first_decisions_match_a_naive_model() {
    for seed in 1..=3 {
        run_against_model(EvictionOrder::LeafFirst, seed);
    }
}

#[test]
fn randomized_flat_decisions_match_a_naive_model() {
    for seed in 1..=3 {
        run_against_model(EvictionOrder::Flat, seed);
    }
}

#[test]
fn a_key_offered_twice_in_one_store_is_stored_once() {
    let mut manager = manager(4, EvictionOrder::LeafFirst);
    let twice = keys(&[1, 2, 1]);
    let mut out = PreparedStore::default();
    assert!(manager.prepare_store("a", &twice, &mut out));
    assert_eq!((out.to_store.as_slice(), out.chunks.len()), (&[0, 1][..], 2));
    check(&manager);
    manager.complete_store(&keys(&[1, 2]), true);
    let stats = manager.stats();
    assert_eq!((stats.chunks_used, stats.chunks_storing), (2, 0), "no chunk is left behind");
    assert_eq!(manager.parent_of(&key(2, 0)), Some(key(1, 0)));
    check(&manager);
}

#[test]
fn a_load_completion_naming_a_key_more_often_than_it_is_pinned_changes_nothing() {
    let mut manager = manager(4, EvictionOrder::LeafFirst);
    store(&mut manager, "a", &[1, 2]);
    manager.prepare_load("b", &keys(&[1, 2, 2]), &mut Vec::new()).unwrap();
    assert_eq!(manager.stats().chunks_loading, 2);
    assert_eq!(
        manager.complete_load(&keys(&[2, 1, 1])),
        Err(OffloadError::NotPinned { key: key(1, 0) })
    );
    assert_eq!(manager.stats().chunks_loading, 2, "the pins taken back are restored");
    check(&manager);
    manager.complete_load(&keys(&[2, 1, 2])).unwrap();
    assert_eq!(manager.stats().chunks_loading, 0);
    check(&manager);
}

/// Keys a persistent tier gave back at a warm restart are announced as stored, like keys stored
/// now: the engine's KV events (and a router listening to them) learn that the restarted engine
/// holds them, in the order they came back.
#[test]
fn restored_keys_are_announced_as_stored() {
    let mut manager = manager(4, EvictionOrder::LeafFirst);
    manager.restore(key(1, 0), 2, None).unwrap();
    manager.restore(key(2, 0), 0, Some(&key(1, 0))).unwrap();
    check(&manager);
    let events = manager.take_events();
    let stored: Vec<OffloadKey> =
        events.iter().filter(|event| !event.removed).flat_map(|event| event.keys.clone()).collect();
    assert_eq!(stored, keys(&[1, 2]));
    assert!(events.iter().all(|event| !event.removed), "nothing left the tier");
    // A refused restore announces nothing.
    assert!(manager.restore(key(1, 0), 1, None).is_err());
    assert!(manager.take_events().is_empty());
}
