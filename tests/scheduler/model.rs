//! The eviction engine against a small reference model.
//!
//! A seeded workload over a tiny vocabulary (so that prompts share prefixes, collide and come
//! back) drives a `CacheManager` and [`Model`], which says what the manager must do, written the
//! naive way: blocks in a map by hash, every candidate found by a scan, each victim's fate
//! decided by the rule of DESIGN §4.3 restated here. Copies complete as soon as they are handed
//! out, so the model has no copy in flight. After every step `check_invariants()` must hold.
//!
//! Under LRU the model also picks the victims itself (the least recently released candidate; a
//! release stamps a request's path tail first), and the two must then agree after every step on
//! everything: which tiers hold each block, who holds it, its hits, the free blocks of each pool,
//! the storage tier's used blocks and every eviction counter. The other policies order victims by
//! rules of their own (tested with them): the model takes the manager's tree as it is after each
//! step, and checks what does not depend on the order: each match, and whether each allocation
//! fits (its count of what evictions could free).
//!
//! Every eviction policy (the offline optimum with the workload's future) runs over every tier
//! combination: the device alone, a host tier, a host and a storage tier; with a host tier,
//! every write policy. A request's blocks are committed in one call or in several: how a commit
//! is cut must not change what is cached.

use std::collections::{HashMap, HashSet};

use kvshm::hash::{BlockHash, BlockHasher, Namespace};
use kvshm::manager::{
    CacheConfig, CacheManager, EvictionPolicy, Evictions, PrefixMatch, RequestId, WritePolicy,
};
use kvshm::tree::{FutureUses, NodeId, NodeState};

use crate::support::scheduler::{check, complete_all};
use crate::support::Rng;

const BLOCK_TOKENS: usize = 2;
const VOCABULARY: u64 = 3;
const MAX_LIVE: usize = 3;

/// One cached block as the model sees it.
#[derive(Clone, Debug, PartialEq)]
struct Block {
    parent: Option<BlockHash>,
    device: bool,
    host: bool,
    /// The storage tier holds it.
    stored: bool,
    holders: u32,
    /// 1 + the matches that hit it.
    hits: u32,
    /// When the end of a request last released it (LRU's order).
    stamp: u64,
    /// The manager's node id, which names it in the manager's queue of write-through backups.
    node: NodeId,
    backup_queued: bool,
}

impl Block {
    fn upper(&self) -> bool {
        self.device || self.host
    }
}

/// What the manager must do (module documentation).
struct Model {
    blocks: HashMap<BlockHash, Block>,
    device_free: usize,
    host_free: usize,
    storage_used: u32,
    host_tier: bool,
    storage_blocks: u32,
    write_policy: WritePolicy,
    clock: u64,
    /// Nodes queued for a write-through backup, in the manager's order.
    backups: Vec<NodeId>,
    /// Blocks whose copy the current step started (a write-back, a store, a backup): no victims
    /// until it lands, at the step's end.
    in_flight: HashSet<BlockHash>,
    /// Host blocks of blocks dropped while their copy was in flight: the copy frees them when it
    /// lands.
    freed_on_landing: usize,
    evictions: Evictions,
    backups_issued: u64,
}

impl Model {
    fn new(config: &CacheConfig) -> Model {
        Model {
            blocks: HashMap::new(),
            device_free: config.device_blocks as usize,
            host_free: config.host_blocks as usize,
            storage_used: 0,
            host_tier: config.host_blocks > 0,
            storage_blocks: config.storage_blocks,
            write_policy: config.write_policy,
            clock: 0,
            backups: Vec::new(),
            in_flight: HashSet::new(),
            freed_on_landing: 0,
            evictions: Evictions::default(),
            backups_issued: 0,
        }
    }

    fn children(&self, of: BlockHash) -> Vec<BlockHash> {
        self.blocks.iter().filter(|(_, b)| b.parent == Some(of)).map(|(&h, _)| h).collect()
    }

    /// DESIGN §4.4: a device copy, unheld, no child with one.
    fn device_candidate(&self, hash: BlockHash) -> bool {
        let b = &self.blocks[&hash];
        b.device && b.holders == 0 && self.children(hash).iter().all(|c| !self.blocks[c].device)
    }

    /// A host copy, unheld, no child above storage.
    fn host_candidate(&self, hash: BlockHash) -> bool {
        let b = &self.blocks[&hash];
        b.host && b.holders == 0 && self.children(hash).iter().all(|c| !self.blocks[c].upper())
    }

    /// Storage-only, unheld, no children.
    fn storage_candidate(&self, hash: BlockHash) -> bool {
        let b = &self.blocks[&hash];
        !b.upper() && b.holders == 0 && self.children(hash).is_empty()
    }

    /// The least recently released block `candidate` admits.
    fn first(&self, candidate: impl Fn(&Model, BlockHash) -> bool) -> Option<BlockHash> {
        let mut found: Vec<BlockHash> = (self.blocks.keys().copied())
            .filter(|&h| !self.in_flight.contains(&h) && candidate(self, h))
            .collect();
        found.sort_by_key(|h| self.blocks[h].stamp);
        found.first().copied()
    }

    /// Device blocks evictions could free below and at `hash`: its device copy once every child
    /// with one has left the device, unless held.
    fn evictable_device(&self, hash: BlockHash) -> (usize, bool) {
        let (mut count, mut all_gone) = (0, true);
        for child in self.children(hash).into_iter().filter(|c| self.blocks[c].device) {
            let (below, gone) = self.evictable_device(child);
            count += below;
            all_gone &= gone;
        }
        let b = &self.blocks[&hash];
        let counts = b.device && b.holders == 0 && all_gone;
        (count + usize::from(counts), counts)
    }

    /// Host blocks evictions could free below and at `hash`: its host copy once every child
    /// above storage has left the host tier (a child with a device copy never does).
    fn evictable_host(&self, hash: BlockHash) -> (usize, bool) {
        let b = &self.blocks[&hash];
        let (mut count, mut all_gone) = (0, true);
        for child in self.children(hash).into_iter().filter(|c| self.blocks[c].upper()) {
            let (below, gone) = self.evictable_host(child);
            count += below;
            all_gone &= gone && !self.blocks[&child].device;
        }
        let counts = b.host && b.holders == 0 && all_gone;
        (count + usize::from(counts), counts)
    }

    fn obtainable(&self) -> (usize, usize) {
        let roots: Vec<BlockHash> =
            self.blocks.iter().filter(|(_, b)| b.parent.is_none()).map(|(&h, _)| h).collect();
        let device: usize = roots.iter().map(|&h| self.evictable_device(h).0).sum();
        let host: usize = roots.iter().map(|&h| self.evictable_host(h).0).sum();
        (self.device_free + device, self.host_free + host)
    }

    /// Removes `hash`'s subtree below it (host-only and storage-only nodes), giving their
    /// blocks back, then `hash` itself, whose block of the tier it was evicted from the caller
    /// takes.
    fn drop_victim(&mut self, hash: BlockHash) {
        for child in self.children(hash) {
            self.drop_subtree(child);
        }
        let b = self.blocks.remove(&hash).expect("a victim is cached");
        self.storage_used -= u32::from(b.stored);
    }

    fn drop_subtree(&mut self, hash: BlockHash) {
        for child in self.children(hash) {
            self.drop_subtree(child);
        }
        let b = self.blocks.remove(&hash).expect("a child is cached");
        assert!(!b.device, "a dropped victim has no device copy below it");
        if self.in_flight.contains(&hash) {
            self.freed_on_landing += usize::from(b.host);
        } else {
            self.host_free += usize::from(b.host);
        }
        self.storage_used -= u32::from(b.stored);
    }

    /// A device block by evicting the first device candidate (DESIGN §4.3).
    fn evict_device(&mut self) {
        let victim = self.first(Model::device_candidate).expect("counted before");
        let hits = self.blocks[&victim].hits;
        if self.blocks[&victim].host {
            self.blocks.get_mut(&victim).unwrap().device = false;
            self.evictions.device_to_host_metadata += 1;
        } else if self.host_tier && self.keeps(hits) && self.obtain_host() {
            let b = self.blocks.get_mut(&victim).unwrap();
            (b.device, b.host) = (false, true);
            self.in_flight.insert(victim);
            self.evictions.device_written_back += 1;
        } else {
            self.drop_victim(victim);
            self.evictions.device_dropped += 1;
        }
    }

    fn keeps(&self, hits: u32) -> bool {
        match self.write_policy {
            WritePolicy::WriteBack | WritePolicy::WriteThrough => true,
            WritePolicy::WriteThroughSelective { threshold } => hits >= threshold,
        }
    }

    /// A host block, free or by evicting the first host candidate.
    fn obtain_host(&mut self) -> bool {
        if self.host_free > 0 {
            self.host_free -= 1;
            return true;
        }
        let Some(victim) = self.first(Model::host_candidate) else { return false };
        let b = &self.blocks[&victim];
        if b.device {
            self.blocks.get_mut(&victim).unwrap().host = false;
            self.evictions.host_dropped += 1;
        } else if b.stored {
            self.blocks.get_mut(&victim).unwrap().host = false;
            self.evictions.host_to_storage_metadata += 1;
        } else if self.storage_blocks > 0 && self.reserve_storage() {
            let b = self.blocks.get_mut(&victim).unwrap();
            (b.host, b.stored) = (false, true);
            self.in_flight.insert(victim);
            self.evictions.host_written_back += 1;
        } else {
            self.drop_victim(victim);
            self.evictions.host_dropped += 1;
        }
        true
    }

    /// Room for one more block on the storage tier, by dropping its first candidate if full.
    fn reserve_storage(&mut self) -> bool {
        if self.storage_used >= self.storage_blocks {
            let Some(victim) = self.first(Model::storage_candidate) else { return false };
            self.drop_victim(victim);
            self.evictions.storage_dropped += 1;
        }
        self.storage_used += 1;
        true
    }

    /// A match: the hits by tier, each held and counted.
    fn match_prefix(&mut self, request: &mut Live) -> (usize, usize, usize) {
        let bound = (request.prompt_tokens - 1) / BLOCK_TOKENS;
        let mut found = (0, 0, 0);
        for &hash in &request.hashes[..request.prompt_blocks().min(bound)] {
            let Some(b) = self.blocks.get_mut(&hash) else { break };
            match (b.device, b.host) {
                (true, _) => found.0 += 1,
                (false, true) => found.1 += 1,
                (false, false) => found.2 += 1,
            }
            b.holders += 1;
            b.hits += 1;
            if let WritePolicy::WriteThroughSelective { threshold } = self.write_policy {
                if self.host_tier && b.hits >= threshold && b.device && !b.host && !b.backup_queued
                {
                    b.backup_queued = true;
                    self.backups.push(b.node);
                }
            }
            request.path.push(hash);
        }
        found
    }

    /// An allocation for the whole request, all or nothing; its copies land at once.
    fn allocate(&mut self, request: &mut Live) -> bool {
        let swap_ins = request.path.iter().filter(|h| !self.blocks[h].device).count();
        let loads = request.path.iter().filter(|h| !self.blocks[h].upper()).count();
        let fresh = request.tokens.len().div_ceil(BLOCK_TOKENS) - request.path.len();
        let (device, host) = self.obtainable();
        if swap_ins + fresh > device || loads > host {
            return false;
        }
        for _ in 0..loads {
            assert!(self.obtain_host(), "counted before");
        }
        let from_pool = (swap_ins + fresh).min(self.device_free);
        self.device_free -= from_pool;
        for _ in from_pool..swap_ins + fresh {
            self.evict_device();
        }
        for hash in &request.path {
            let b = self.blocks.get_mut(hash).unwrap();
            if !b.upper() {
                // Loaded: its host block only passed through; the tier no longer counts it.
                (b.stored, self.host_free, self.storage_used) =
                    (false, self.host_free + 1, self.storage_used - 1);
            }
            b.device = true;
        }
        request.table = request.path.len() + fresh;
        self.land();
        true
    }

    /// The copies of the step land.
    fn land(&mut self) {
        self.in_flight.clear();
        self.host_free += std::mem::take(&mut self.freed_on_landing);
    }

    /// A commit of `request`'s first `blocks` blocks (DESIGN §4.5); `nodes` names the manager's
    /// node of each block of the request's hashes, once committed.
    fn commit(&mut self, request: &mut Live, blocks: usize, nodes: &[NodeId]) {
        let back_up = self.host_tier
            && match self.write_policy {
                WritePolicy::WriteBack => false,
                WritePolicy::WriteThrough => true,
                WritePolicy::WriteThroughSelective { threshold } => threshold <= 1,
            };
        let start = request.path.len();
        for (index, &hash) in request.hashes.iter().enumerate().take(blocks).skip(start) {
            let parent = request.path.last().copied();
            let parent_valid = parent.is_none_or(|parent| self.blocks[&parent].device);
            match self.blocks.get_mut(&hash) {
                None if parent_valid => {
                    let node = *nodes.get(index).expect("the manager caches it too");
                    let block = Block {
                        parent,
                        device: true,
                        host: false,
                        stored: false,
                        holders: 1,
                        hits: 1,
                        stamp: 0,
                        node,
                        backup_queued: back_up,
                    };
                    self.blocks.insert(hash, block);
                    if back_up {
                        self.backups.push(node);
                    }
                }
                Some(b) if b.device => {
                    b.holders += 1;
                    request.private += 1;
                }
                Some(b) if parent_valid => {
                    (b.device, b.holders) = (true, b.holders + 1);
                }
                _ => break,
            }
            request.path.push(hash);
        }
    }

    /// The end of `request`: its path released tail first, its own blocks given back.
    fn end(&mut self, request: &Live) {
        for hash in request.path.iter().rev() {
            self.clock += 1;
            let b = self.blocks.get_mut(hash).unwrap();
            (b.holders, b.stamp) = (b.holders - 1, self.clock);
        }
        self.device_free += request.private + request.table.saturating_sub(request.path.len());
    }

    /// `poll`: the queued backups, each with a host block if one can be had.
    fn poll(&mut self) {
        let mut out_of_host = false;
        for node in std::mem::take(&mut self.backups) {
            let Some(hash) = self.blocks.iter().find(|(_, b)| b.node == node).map(|(&h, _)| h)
            else {
                continue;
            };
            let b = self.blocks.get_mut(&hash).unwrap();
            if !b.backup_queued {
                continue;
            }
            b.backup_queued = false;
            if out_of_host || !b.device || b.host {
                continue;
            }
            if self.obtain_host() {
                self.blocks.get_mut(&hash).unwrap().host = true;
                self.in_flight.insert(hash);
                self.backups_issued += 1;
            } else {
                out_of_host = true;
            }
        }
        self.land();
    }

    /// The manager's tree as it is, for a policy whose order the model does not follow.
    fn take_tree(&mut self, cache: &CacheManager) {
        let tree = cache.tree();
        self.blocks = tree
            .ids()
            .map(|id| {
                let node = tree.node(id);
                let parent =
                    node.parent().filter(|&p| p != NodeId::ROOT).map(|p| tree.node(p).hash());
                let block = Block {
                    parent,
                    device: node.device().is_some(),
                    host: node.host().is_some(),
                    stored: node.stored(),
                    holders: node.ref_count(),
                    hits: node.hit_count(),
                    stamp: 0,
                    node: id,
                    backup_queued: node.backup_queued(),
                };
                (node.hash(), block)
            })
            .collect();
        let stats = cache.stats();
        (self.device_free, self.host_free, self.storage_used) =
            (stats.device_free, stats.host_free, stats.storage_used);
        (self.evictions, self.backups_issued) =
            (stats.counters.evictions, stats.counters.backups_issued);
        self.backups.retain(|&node| tree.is_live(node) && tree.node(node).backup_queued());
    }

    /// The manager holds what the model says, block for block and counter for counter.
    fn agrees(&self, cache: &CacheManager, what: &str) {
        check(cache);
        let tree = cache.tree();
        assert_eq!(tree.len(), self.blocks.len(), "{what}: cached blocks");
        for id in tree.ids() {
            let node = tree.node(id);
            let b = self.blocks.get(&node.hash()).unwrap_or_else(|| panic!("{what}: {id:?}"));
            let state = match (b.device, b.host) {
                (true, _) => NodeState::Device,
                (false, true) => NodeState::Host,
                (false, false) => NodeState::Storage,
            };
            let seen = (node.state(), node.host().is_some(), node.stored(), node.ref_count());
            assert_eq!(seen, (state, b.host, b.stored, b.holders), "{what}: {id:?}");
            assert_eq!(
                (node.hit_count(), id, node.backup_queued()),
                (b.hits, b.node, b.backup_queued)
            );
            let parent = node.parent().filter(|&p| p != NodeId::ROOT).map(|p| tree.node(p).hash());
            assert_eq!(parent, b.parent, "{what}: parent of {id:?}");
        }
        let stats = cache.stats();
        assert_eq!(
            (stats.device_free, stats.host_free, stats.storage_used),
            (self.device_free, self.host_free, self.storage_used),
            "{what}: free device and host blocks, used storage blocks"
        );
        assert_eq!(stats.counters.evictions, self.evictions, "{what}: evictions");
        assert_eq!(stats.counters.backups_issued, self.backups_issued, "{what}: backups");
    }
}

/// A request of the workload.
#[derive(Clone)]
struct Live {
    id: RequestId,
    /// Prompt and output.
    tokens: Vec<u32>,
    prompt_tokens: usize,
    /// The hash of every full block of `tokens`.
    hashes: Vec<BlockHash>,
    /// Held blocks, from the root.
    path: Vec<BlockHash>,
    /// Blocks of its table.
    table: usize,
    /// Blocks it computed that were cached already (it keeps its own).
    private: usize,
}

impl Live {
    fn prompt_blocks(&self) -> usize {
        self.prompt_tokens / BLOCK_TOKENS
    }
}

/// Prompts that come back: each the start of an earlier one, or fresh, and an output.
fn workload(rng: &mut Rng, count: usize) -> Vec<Live> {
    let hasher = BlockHasher::new(Namespace::new("model", None, None), BLOCK_TOKENS).unwrap();
    let mut requests: Vec<Live> = Vec::new();
    for id in 0..count {
        let mut tokens = match requests.len() {
            0 => Vec::new(),
            n => {
                let earlier = &requests[rng.below(n)].tokens;
                earlier[..rng.below(earlier.len() + 1)].to_vec()
            }
        };
        for _ in 0..1 + rng.below(10) {
            tokens.push((rng.next_u64() % VOCABULARY) as u32);
        }
        let prompt_tokens = tokens.len();
        for _ in 0..rng.below(5) {
            tokens.push((rng.next_u64() % VOCABULARY) as u32);
        }
        let hashes = hasher.hash_prompt(&tokens, &[]);
        let (path, table, private) = (Vec::new(), 0, 0);
        let id = RequestId(id as u64);
        requests.push(Live { id, tokens, prompt_tokens, hashes, path, table, private });
    }
    requests
}

/// What a replay would hand the offline optimum: the blocks of each prompt that may hit.
fn future_of(requests: &[Live]) -> FutureUses {
    let mut future = FutureUses::default();
    for request in requests {
        let bound = (request.prompt_tokens - 1) / BLOCK_TOKENS;
        future.push_request(request.hashes[..request.prompt_blocks().min(bound)].iter().copied());
    }
    future
}

/// The manager's node of each of `hashes` it caches along the chain from the root.
fn nodes_of(cache: &CacheManager, hashes: &[BlockHash]) -> Vec<NodeId> {
    let tree = cache.tree();
    let mut parent = NodeId::ROOT;
    let mut nodes = Vec::new();
    for &hash in hashes {
        let Some(id) = tree.child(parent, hash) else { break };
        nodes.push(id);
        parent = id;
    }
    nodes
}

/// Runs `steps` steps of the workload on a manager built from `config` and the model.
fn run(config: CacheConfig, seed: u64, steps: usize) -> Evictions {
    let mut rng = Rng::new(seed);
    let requests = workload(&mut rng, steps);
    let mut cache = if config.eviction.is_offline() {
        CacheManager::with_future(config.clone(), future_of(&requests)).unwrap()
    } else {
        CacheManager::new(config.clone()).unwrap()
    };
    let follows_order = config.eviction == EvictionPolicy::Lru;
    let mut model = Model::new(&config);
    let (mut next, mut live) = (0, Vec::<Live>::new());
    for step in 0..steps {
        let what = format!("{} {} seed {seed} step {step}", config.eviction, config.write_policy);
        if !follows_order {
            model.take_tree(&cache);
        }
        if next < requests.len() && live.len() < MAX_LIVE && (live.is_empty() || rng.chance(55)) {
            let mut request = requests[next].clone();
            next += 1;
            let prompt = &request.hashes[..request.prompt_blocks()];
            let found = cache.match_prefix(request.id, prompt, request.prompt_tokens).unwrap();
            let PrefixMatch { device_blocks, host_blocks, storage_blocks, cached_tokens } = found;
            let expected = model.match_prefix(&mut request);
            assert_eq!((device_blocks, host_blocks, storage_blocks), expected, "{what}: match");
            let new_tokens = request.tokens.len() - cached_tokens;
            let allocated = cache.allocate(request.id, new_tokens, 0).is_ok();
            assert_eq!(allocated, model.allocate(&mut request), "{what}: allocation");
            complete_all(&mut cache);
            if allocated {
                live.push(request);
            } else {
                cache.abort(request.id).unwrap();
                model.end(&request);
            }
        } else if !live.is_empty() {
            let mut request = live.swap_remove(rng.below(live.len()));
            if rng.chance(80) {
                // Committed in one call, or cut in pieces at random blocks.
                let blocks = request.tokens.len() / BLOCK_TOKENS;
                let mut done = request.path.len();
                while done < blocks {
                    done =
                        if rng.chance(50) { blocks } else { done + 1 + rng.below(blocks - done) };
                    cache.commit(request.id, done * BLOCK_TOKENS, &request.hashes).unwrap();
                }
                let nodes = nodes_of(&cache, &request.hashes[..blocks]);
                model.commit(&mut request, blocks, &nodes);
                cache.finish(request.id).unwrap();
            } else {
                cache.abort(request.id).unwrap();
            }
            model.end(&request);
        }
        if rng.chance(20) {
            cache.poll();
            complete_all(&mut cache);
            model.poll();
        }
        if follows_order {
            model.agrees(&cache, &what);
        } else {
            check(&cache);
        }
    }
    cache.stats().counters.evictions
}

/// Every tier combination and, with a host tier, every write policy.
fn configurations() -> Vec<CacheConfig> {
    let device = CacheConfig::new(BLOCK_TOKENS as u32, 8);
    let mut configs = vec![device.clone()];
    for policy in [
        WritePolicy::WriteBack,
        WritePolicy::WriteThrough,
        WritePolicy::WriteThroughSelective { threshold: 2 },
    ] {
        let host = device.clone().with_host_blocks(6).with_write_policy(policy);
        configs.push(host.clone());
        configs.push(host.with_storage_blocks(10));
    }
    configs
}

/// Runs every configuration under `eviction`, and checks that each fate was met where it can be.
fn run_policy(eviction: EvictionPolicy) {
    for config in configurations() {
        let config = config.with_eviction(eviction);
        let mut met = Evictions::default();
        for seed in 1..=6 {
            let evictions = run(config.clone(), seed, 400);
            met.device_dropped += evictions.device_dropped;
            met.device_to_host_metadata += evictions.device_to_host_metadata;
            met.device_written_back += evictions.device_written_back;
            met.host_dropped += evictions.host_dropped;
            met.host_to_storage_metadata += evictions.host_to_storage_metadata;
            met.host_written_back += evictions.host_written_back;
            met.storage_dropped += evictions.storage_dropped;
        }
        let (host, storage) = (config.host_blocks > 0, config.storage_blocks > 0);
        let selective = matches!(config.write_policy, WritePolicy::WriteThroughSelective { .. });
        let fates = [
            ("device copies dropped", met.device_dropped, !host || selective),
            ("device copies dropped over a backup", met.device_to_host_metadata, host),
            ("device copies written back", met.device_written_back, host),
            ("host copies dropped", met.host_dropped, host),
            ("host copies stored", met.host_written_back, storage),
            ("host copies dropped over a stored copy", met.host_to_storage_metadata, storage),
            ("storage blocks dropped", met.storage_dropped, storage),
        ];
        for (fate, count, expected) in fates {
            assert!(count > 0 || !expected, "{config:?}: no {fate} ({met:?})");
        }
    }
}

#[test]
fn the_engine_does_what_the_model_says_under_lru_in_every_configuration() {
    run_policy(EvictionPolicy::Lru);
}

#[test]
fn matches_and_allocations_agree_with_the_model_under_conv_in_every_configuration() {
    run_policy(EvictionPolicy::Conv);
}

#[test]
fn matches_and_allocations_agree_with_the_model_under_the_optimum_in_every_configuration() {
    run_policy(EvictionPolicy::Optimal);
}
