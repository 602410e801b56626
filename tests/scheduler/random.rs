//! A seeded randomized test: 100k operations over a tiny vocabulary (so prefixes collide a lot)
//! against every write policy and every online eviction policy, with and without a storage tier,
//! with `check_invariants()` after every step and random copy failures injected (and, on the
//! storage tier, blocks that vanish, as from a shared Redis).
//!
//! The test plays the engine and the workers, and simulates the data plane: every device and host
//! block holds the hash of the block whose KV it contains, and the storage tier maps a block hash
//! to what was stored under it. Copies move those values when they complete (a failed copy
//! poisons its destinations; a LOAD of a block the tier lacks misses that block, which shortens
//! the hits of the requests waiting on it), and the engine writes its computed blocks only once
//! its ticket is ready. So every hit the manager reports is checked to hold the right
//! data, which catches a block reused too early, a ticket ready too soon or a copy issued too
//! early. Hits are compared against a reference model: the set of blocks committed since the
//! last reset. Every hit must be in it, and where the device tier never needs to evict, a
//! lookup must find exactly the longest prefix in it that the last-token rule lets hit.

use std::collections::{HashMap, HashSet};

use kvshm::hash::{BlockHash, BlockHasher, Namespace};
use kvshm::manager::{
    AllocateError, BlockOutcome, CacheConfig, CacheManager, EvictionPolicy, RequestId,
    StorageQuery, StorageWritePolicy, TicketId, TicketStatus, Transfer, TransferKind, WritePolicy,
};
use kvshm::tree::{NodeId, NodeState, SnapshotNode, StoreOut, SwapOut};

use crate::support::scheduler::{check, failure, tier_failure};
use crate::support::Rng;

const BLOCK_TOKENS: usize = 2;
const POISON: BlockHash = BlockHash(u128::MAX);

struct Live {
    tokens: Vec<u32>,
    hashes: Vec<BlockHash>,
    matched_blocks: usize,
    /// Blocks of the request's path: cached nodes it holds.
    held_blocks: usize,
    /// Tokens the block table covers.
    allocated_tokens: usize,
    ticket: Option<TicketId>,
}

struct Engine {
    cache: CacheManager,
    hasher: BlockHasher,
    rng: Rng,
    vocabulary: u32,
    max_prompt_blocks: usize,
    exact: bool,
    /// Percent of completion steps that complete a copy (lower: more copies in flight at once).
    completion_percent: usize,
    device_data: Vec<Option<BlockHash>>,
    host_data: Vec<Option<BlockHash>>,
    storage_data: HashMap<BlockHash, Option<BlockHash>>,
    /// Percent of steps on which the storage tier loses a random block.
    vanish_percent: usize,
    /// Whether the tier is shared (as Redis is): it keeps the blocks the tree forgets, so that
    /// prefetches find them again by QUERY.
    shared_tier: bool,
    live: HashMap<u64, Live>,
    copies: Vec<Transfer>,
    committed: HashSet<BlockHash>,
    next_request: u64,
    hits_checked: u64,
    /// Allocations refused for want of host blocks, whose count was checked.
    host_shortfalls_checked: u64,
    /// Prefetch: the queries not answered yet, the tickets not read yet, and each block hash's
    /// parent (to find a forgotten block's node).
    queries: Vec<StorageQuery>,
    prefetch_tickets: Vec<TicketId>,
    parents: HashMap<BlockHash, BlockHash>,
    forgotten_checked: u64,
}

impl Engine {
    fn new(
        config: CacheConfig,
        seed: u64,
        vocabulary: u32,
        max_prompt_blocks: usize,
        exact: bool,
    ) -> Engine {
        let device = config.device_blocks as usize;
        let host = config.host_blocks as usize;
        Engine {
            cache: CacheManager::new(config).unwrap(),
            hasher: BlockHasher::new(Namespace::new("random", None, None), BLOCK_TOKENS).unwrap(),
            rng: Rng::new(seed + seed_offset()),
            vocabulary,
            max_prompt_blocks,
            exact,
            completion_percent: 100,
            device_data: vec![None; device * 2],
            host_data: vec![None; host],
            storage_data: HashMap::new(),
            vanish_percent: 0,
            shared_tier: false,
            live: HashMap::new(),
            copies: Vec::new(),
            committed: HashSet::new(),
            next_request: 0,
            hits_checked: 0,
            host_shortfalls_checked: 0,
            queries: Vec::new(),
            prefetch_tickets: Vec::new(),
            parents: HashMap::new(),
            forgotten_checked: 0,
        }
    }

    fn random_tokens(&mut self, count: usize) -> Vec<u32> {
        (0..count).map(|_| self.rng.below(self.vocabulary as usize) as u32).collect()
    }

    fn pick_live(&mut self) -> Option<u64> {
        if self.live.is_empty() {
            return None;
        }
        let mut ids: Vec<u64> = self.live.keys().copied().collect();
        ids.sort_unstable();
        Some(ids[self.rng.below(ids.len())])
    }

    fn reference_prefix(&self, hashes: &[BlockHash]) -> usize {
        hashes.iter().take_while(|hash| self.committed.contains(hash)).count()
    }

    fn step(&mut self) {
        match self.rng.below(100) {
            0..=19 => self.start_request(),
            20..=34 => self.allocate(),
            35..=49 => self.take_copies(),
            50..=69 => self.complete_copy(),
            70..=79 => self.commit(),
            80..=84 => self.extend(),
            85..=93 => self.end_request(),
            94..=97 => self.cache.poll(),
            98 => self.resize(),
            _ => self.reset(),
        }
        if self.cache.config().storage_blocks > 0 {
            // Only with a storage tier, so that the runs without one draw the same numbers.
            // The service sends the FORGETs of a step before its QUERYs.
            self.forget();
            if self.rng.chance(5) {
                self.prefetch();
                self.forget();
            }
            if !self.queries.is_empty() && self.rng.chance(30) {
                self.answer_query();
            }
            self.forget();
            // A tier marked down by an unavailable block comes back (a probe reached it), so
            // that the run goes on through both states.
            if self.cache.storage_tier_down() && self.rng.chance(20) {
                self.cache.storage_tier_recovered();
            }
        }
        if self.vanish_percent > 0 && self.rng.chance(self.vanish_percent) {
            let mut keys: Vec<BlockHash> = self.storage_data.keys().copied().collect();
            keys.sort_unstable();
            if !keys.is_empty() {
                self.storage_data.remove(&keys[self.rng.below(keys.len())]);
            }
        }
        check(&self.cache);
    }

    /// Records each block's parent, to find the node of a hash later.
    fn remember_chain(&mut self, hashes: &[BlockHash]) {
        let mut parent = BlockHash(0);
        for &hash in hashes {
            self.parents.insert(hash, parent);
            parent = hash;
        }
    }

    /// The node of block `hash` in the tree, if its whole chain is there.
    fn node_of(&self, hash: BlockHash) -> Option<NodeId> {
        let mut chain = vec![hash];
        while let Some(&parent) = self.parents.get(chain.last().unwrap()) {
            if parent == BlockHash(0) {
                break;
            }
            chain.push(parent);
        }
        let mut node = NodeId::ROOT;
        for hash in chain.iter().rev() {
            node = self.cache.tree().child(node, *hash)?;
        }
        Some(node)
    }

    /// A prefetch of a random prompt (often one a live request has, so that it loads, and is
    /// shared by that request's allocation).
    fn prefetch(&mut self) {
        let hashes = match self.pick_live() {
            Some(id) if self.rng.chance(50) => self.live[&id].hashes.clone(),
            _ => {
                let prompt_len = self.rng.below(self.max_prompt_blocks * BLOCK_TOKENS + 1);
                let tokens = self.random_tokens(prompt_len);
                self.hasher.hash_prompt(&tokens, &[])
            }
        };
        self.remember_chain(&hashes);
        if let Some(ticket) = self.cache.prefetch(&hashes).unwrap() {
            self.prefetch_tickets.push(ticket);
        }
        self.cache.take_storage_queries(&mut self.queries);
        if self.prefetch_tickets.len() > 8 {
            let ticket = self.prefetch_tickets.remove(0);
            // Known, or forgotten by a reset.
            let _ = self.cache.prefetch_status(ticket);
        }
    }

    /// Answers a QUERY from the simulated tier (what it holds of blocks committed since the
    /// last reset, so that every hit stays checkable), or fails it.
    fn answer_query(&mut self) {
        let query = self.queries.swap_remove(self.rng.below(self.queries.len()));
        let outcome = if self.rng.chance(10) {
            Err(failure())
        } else {
            Ok(query
                .hashes
                .iter()
                .take_while(|hash| {
                    self.committed.contains(hash)
                        && self.storage_data.get(hash).is_some_and(|data| data.is_some())
                })
                .count())
        };
        // A reset forgets the queries in flight: their answers are refused.
        let _ = self.cache.complete_storage_query(query.id, outcome);
    }

    /// Takes the blocks the tree dropped: the tier forgets them (as a disk slab does), and the
    /// tree must count none of them.
    fn forget(&mut self) {
        let mut forgotten = Vec::new();
        self.cache.take_forgotten_blocks(&mut forgotten);
        for hash in forgotten {
            if let Some(id) = self.node_of(hash) {
                let node = self.cache.tree().node(id);
                assert!(
                    !node.stored()
                        && !matches!(
                            node.state(),
                            NodeState::HostToStorage(_) | NodeState::StorageToHost
                        ),
                    "block {hash:?} forgotten while the tree counts it on storage ({:?})",
                    node.state()
                );
            }
            if !self.shared_tier {
                self.storage_data.remove(&hash);
            }
            self.forgotten_checked += 1;
        }
    }

    fn start_request(&mut self) {
        if self.live.len() >= 6 {
            return;
        }
        let prompt_len = self.rng.below(self.max_prompt_blocks * BLOCK_TOKENS + 1);
        let tokens = self.random_tokens(prompt_len);
        let hashes = self.hasher.hash_prompt(&tokens, &[]);
        self.remember_chain(&hashes);
        // The last-token rule: at most (prompt - 1) / block_tokens blocks may hit.
        let reference =
            self.reference_prefix(&hashes).min(prompt_len.saturating_sub(1) / BLOCK_TOKENS);
        let lookup = self.cache.lookup(&hashes, tokens.len()).unwrap();
        let id = self.next_request;
        self.next_request += 1;
        let found = self.cache.match_prefix(RequestId(id), &hashes, tokens.len()).unwrap();
        assert_eq!(
            (found.device_blocks, found.host_blocks, found.storage_blocks),
            (lookup.device_blocks, lookup.host_blocks, lookup.storage_blocks)
        );
        assert!(found.blocks() <= reference, "a hit on a block never committed");
        assert!(found.cached_tokens < tokens.len().max(1), "the last prompt token is computed");
        if self.exact {
            assert_eq!(
                found.blocks(),
                reference,
                "with room for everything every committed block hits"
            );
        }
        self.live.insert(
            id,
            Live {
                tokens,
                hashes,
                matched_blocks: found.blocks(),
                held_blocks: found.blocks(),
                allocated_tokens: found.cached_tokens,
                ticket: None,
            },
        );
    }

    fn allocate(&mut self) {
        let Some(id) = self.pick_live() else { return };
        if self.live[&id].ticket.is_some() {
            return;
        }
        self.take_copies();
        let generated = self.rng.below(5);
        let lookahead = self.rng.below(3);
        let live = &self.live[&id];
        let new_tokens = live.tokens.len() - live.allocated_tokens + generated;
        let before = (
            self.cache.free_device_blocks(),
            self.cache.free_host_blocks(),
            self.cache.stats().cached_blocks,
        );
        match self.cache.allocate(RequestId(id), new_tokens, lookahead) {
            Ok(allocation) => {
                let ticket = allocation.ticket;
                self.record_allocation(id, ticket, generated);
            }
            Err(AllocateError::OutOfBlocks { needed, available }) => {
                let free = self.cache.free_device_blocks();
                let expected = free + reclaimable_by_brute_force(&self.cache).min(needed - free);
                assert_eq!(
                    available, expected,
                    "the dry run counts every block evictions could give"
                );
                let after = (
                    self.cache.free_device_blocks(),
                    self.cache.free_host_blocks(),
                    self.cache.stats().cached_blocks,
                );
                assert_eq!(before, after, "a failed allocation changes nothing");
                assert!(self.cache.take_transfers().is_empty());
            }
            Err(AllocateError::OutOfHostBlocks { needed, available }) => {
                let free = self.cache.free_host_blocks();
                let expected =
                    free + host_obtainable_by_brute_force(&self.cache).min(needed - free);
                assert_eq!(
                    available, expected,
                    "the host dry run counts every block host evictions could give"
                );
                self.host_shortfalls_checked += 1;
                let after = (
                    self.cache.free_device_blocks(),
                    self.cache.free_host_blocks(),
                    self.cache.stats().cached_blocks,
                );
                assert_eq!(before, after, "a failed allocation changes nothing");
                assert!(self.cache.take_transfers().is_empty());
            }
            Err(error) => panic!("unexpected {error}"),
        }
    }

    /// After a successful allocation: the request's `generated` new tokens and its ticket.
    fn record_allocation(&mut self, id: u64, ticket: TicketId, generated: usize) {
        let extra = self.random_tokens(generated);
        let live = self.live.get_mut(&id).unwrap();
        live.tokens.extend(extra);
        live.allocated_tokens = live.tokens.len();
        live.ticket = Some(ticket);
    }

    /// Decode: one more allocation for a request whose earlier blocks are ready.
    fn extend(&mut self) {
        let Some(id) = self.pick_live() else { return };
        let Some(ticket) = self.live[&id].ticket else { return };
        match self.cache.ticket_status(ticket) {
            Ok(TicketStatus::Ready) => {}
            Ok(TicketStatus::Shortened { cached_blocks }) => self.shorten(id, cached_blocks),
            _ => return,
        }
        let generated = 1 + self.rng.below(3);
        if let Ok(allocation) = self.cache.allocate(RequestId(id), generated, 0) {
            let ticket = allocation.ticket;
            self.record_allocation(id, ticket, generated);
        }
    }

    fn take_copies(&mut self) {
        let transfers = self.cache.take_transfers();
        self.copies.extend(transfers);
    }

    fn complete_copy(&mut self) {
        if self.copies.is_empty() || !self.rng.chance(self.completion_percent) {
            return;
        }
        let copy = self.copies.swap_remove(self.rng.below(self.copies.len()));
        let fails = self.rng.chance(if copy.kind.is_storage() { 3 } else { 10 });
        if copy.kind.is_storage() {
            self.complete_storage_copy(copy, fails);
            return;
        }
        for pair in &copy.pairs {
            let (src, dst) = (pair.src as usize, pair.dst as usize);
            match copy.kind {
                TransferKind::DeviceToHost => {
                    self.host_data[dst] = if fails { Some(POISON) } else { self.device_data[src] };
                }
                TransferKind::HostToDevice => {
                    self.device_data[dst] = if fails { Some(POISON) } else { self.host_data[src] };
                }
                TransferKind::HostToStorage | TransferKind::StorageToHost => {
                    unreachable!("storage copies complete in complete_storage_copy")
                }
            }
        }
        let outcome = if fails { Err(failure()) } else { Ok(()) };
        self.cache.complete_transfer(copy.id, outcome).unwrap();
    }

    /// Completes a STORE or LOAD block by block: a whole command fails when `fails` (every
    /// block unavailable), else each block lands unless the tier lost it (LOAD: missing) or,
    /// about one time in seven, misses on its own (a damaged record or a full tier: missing; an
    /// I/O error: unavailable; a tier that timed out: unreachable).
    fn complete_storage_copy(&mut self, copy: Transfer, fails: bool) {
        let mut outcomes = Vec::with_capacity(copy.pairs.len());
        for (pair, block) in copy.pairs.iter().zip(&copy.blocks) {
            let src = pair.src as usize;
            let mut outcome = match self.rng.below(20) {
                0 => BlockOutcome::Missing,
                1 => BlockOutcome::Unavailable,
                2 => BlockOutcome::Unreachable,
                _ => BlockOutcome::Landed,
            };
            match copy.kind {
                TransferKind::HostToStorage => {
                    // A failed write leaves nothing; a hash already stored keeps its bytes.
                    if outcome == BlockOutcome::Landed {
                        self.storage_data.insert(block.hash, self.host_data[src]);
                    }
                }
                TransferKind::StorageToHost => {
                    let stored = self.storage_data.get(&block.hash).copied();
                    if stored.is_none() {
                        outcome = BlockOutcome::Missing;
                    }
                    let lands = !fails && outcome == BlockOutcome::Landed;
                    self.host_data[src] = if lands { stored.flatten() } else { Some(POISON) };
                }
                kind => unreachable!("{kind:?} is not a storage copy"),
            }
            outcomes.push(outcome);
        }
        // A whole storage command fails for the tier (`StorageMiss`), which marks it down.
        let outcome = if fails { Err(tier_failure()) } else { Ok(Some(outcomes.as_slice())) };
        self.cache.complete_storage_transfer(copy.id, outcome).unwrap();
    }

    fn commit(&mut self) {
        let Some(id) = self.pick_live() else { return };
        let Some(ticket) = self.live[&id].ticket else { return };
        match self.cache.ticket_status(ticket).unwrap() {
            TicketStatus::Pending => return,
            TicketStatus::Failed(_) => {
                self.live.remove(&id);
                self.cache.abort(RequestId(id)).unwrap();
                return;
            }
            TicketStatus::Ready => {}
            TicketStatus::Shortened { cached_blocks } => self.shorten(id, cached_blocks),
        }
        let table = self.cache.block_table(RequestId(id)).unwrap().to_vec();
        let live = self.live.get_mut(&id).unwrap();
        self.hasher.extend(&mut live.hashes, &live.tokens, &[]);
        let hashes = live.hashes.clone();
        self.remember_chain(&hashes);
        let live = self.live.get_mut(&id).unwrap();
        for (position, &block) in table.iter().enumerate().take(live.matched_blocks) {
            assert_eq!(
                self.device_data[block as usize],
                Some(live.hashes[position]),
                "hit {position} holds other data"
            );
            self.hits_checked += 1;
        }
        let computed = if self.rng.chance(30) { live.tokens.len() / 2 } else { live.tokens.len() };
        let computed_blocks = computed / BLOCK_TOKENS;
        for (&block, &hash) in
            table.iter().zip(&live.hashes).take(computed_blocks).skip(live.matched_blocks)
        {
            self.device_data[block as usize] = Some(hash);
        }
        let committed = self.cache.commit(RequestId(id), computed, &live.hashes).unwrap();
        live.held_blocks += committed.inserted + committed.duplicates;
        for hash in &live.hashes[..live.held_blocks] {
            self.committed.insert(*hash);
        }
    }

    /// A storage miss shortened request `id`'s hit to `cached_blocks`: the hits from there on are
    /// computed like new blocks.
    fn shorten(&mut self, id: u64, cached_blocks: u32) {
        let live = self.live.get_mut(&id).unwrap();
        let cached = cached_blocks as usize;
        assert!(cached <= live.matched_blocks, "a shortened hit is shorter");
        if cached == live.matched_blocks {
            // Applied already: the ticket stays `Shortened` while the request commits (a cut
            // is always before the end of the hits, so a first one shortens them).
            return;
        }
        live.matched_blocks = cached;
        live.held_blocks = live.held_blocks.min(cached);
    }

    fn end_request(&mut self) {
        let Some(id) = self.pick_live() else { return };
        self.live.remove(&id);
        if self.rng.chance(50) {
            self.cache.finish(RequestId(id)).unwrap();
        } else {
            self.cache.abort(RequestId(id)).unwrap();
        }
    }

    fn resize(&mut self) {
        let capacity = self.cache.stats().device_blocks;
        let target = if self.rng.chance(50) { capacity + 1 } else { capacity.saturating_sub(1) };
        if target as usize <= self.device_data.len() && target >= 4 {
            let _ = self.cache.resize_device(target);
        }
    }

    fn reset(&mut self) {
        if !self.rng.chance(20) {
            return;
        }
        let force = self.rng.chance(50);
        if self.cache.reset(force).is_ok() {
            self.committed.clear();
            self.live.retain(|_, live| live.matched_blocks == 0 && live.ticket.is_none());
        }
    }
}

/// The snapshot's nodes by parent (`None`: the root's children), as positions in `nodes`.
fn children_by_parent(nodes: &[SnapshotNode]) -> HashMap<Option<NodeId>, Vec<usize>> {
    let mut children: HashMap<Option<NodeId>, Vec<usize>> = HashMap::new();
    for (index, node) in nodes.iter().enumerate() {
        children.entry(node.parent).or_default().push(index);
    }
    children
}

/// Device blocks that claims and cascading evictions could free, from a scan of the whole tree:
/// an unheld node with a device block whose copy is an eviction in flight (claimable), or that is
/// idle on device with every device child reclaimable too.
fn reclaimable_by_brute_force(cache: &CacheManager) -> usize {
    let nodes = cache.tree_snapshot(u32::MAX).nodes;
    let children = children_by_parent(&nodes);
    fn reclaimable(
        nodes: &[SnapshotNode],
        children: &HashMap<Option<NodeId>, Vec<usize>>,
        index: usize,
    ) -> bool {
        let node = &nodes[index];
        let device_children = children
            .get(&Some(node.id))
            .into_iter()
            .flatten()
            .filter(|&&child| nodes[child].device.is_some());
        node.device.is_some()
            && node.ref_count == 0
            && (node.state == NodeState::SwapToHost(SwapOut::Evict)
                || (node.state == NodeState::Device
                    && device_children
                        .into_iter()
                        .all(|&child| reclaimable(nodes, children, child))))
    }
    (0..nodes.len()).filter(|&index| reclaimable(&nodes, &children, index)).count()
}

/// Host blocks that evictions of host candidates could give, from a scan of the whole tree: an
/// unheld node with a valid host copy (`Device` or `Host`) each of whose children above storage
/// has no device copy (evicted, it leaves the host tier) and gives a host block too.
fn host_obtainable_by_brute_force(cache: &CacheManager) -> usize {
    let nodes = cache.tree_snapshot(u32::MAX).nodes;
    let children = children_by_parent(&nodes);
    fn obtainable(
        nodes: &[SnapshotNode],
        children: &HashMap<Option<NodeId>, Vec<usize>>,
        index: usize,
    ) -> bool {
        let node = &nodes[index];
        let storage_only =
            |state| matches!(state, NodeState::Storage | NodeState::HostToStorage(StoreOut::Evict));
        node.host.is_some()
            && node.ref_count == 0
            && matches!(node.state, NodeState::Device | NodeState::Host)
            && children
                .get(&Some(node.id))
                .into_iter()
                .flatten()
                .filter(|&&child| !storage_only(nodes[child].state))
                .all(|&child| nodes[child].device.is_none() && obtainable(nodes, children, child))
    }
    (0..nodes.len()).filter(|&index| obtainable(&nodes, &children, index)).count()
}

/// `KVSHM_TEST_SEED=N` shifts every seed by N, for soak runs beyond the fixed seeds.
fn seed_offset() -> u64 {
    std::env::var("KVSHM_TEST_SEED").ok().and_then(|value| value.parse().ok()).unwrap_or(0)
}

fn run(
    config: CacheConfig,
    seed: u64,
    steps: usize,
    vocabulary: u32,
    max_prompt_blocks: usize,
    exact: bool,
) -> Engine {
    run_engine(Engine::new(config, seed, vocabulary, max_prompt_blocks, exact), steps)
}

fn run_engine(mut engine: Engine, steps: usize) -> Engine {
    for _ in 0..steps {
        engine.step();
    }
    engine
}

const STEPS: usize = 100_000;

/// `config` once with each registered online eviction policy (the offline optimum needs a
/// trace's future: `tests/replay_figures.rs` runs it, with `check_invariants` at its end).
fn every_policy(config: CacheConfig) -> impl Iterator<Item = CacheConfig> {
    EvictionPolicy::online().map(move |policy| config.clone().with_eviction(policy))
}

#[test]
fn random_operations_keep_every_invariant_without_a_host_tier() {
    for config in every_policy(CacheConfig::new(BLOCK_TOKENS as u32, 12)) {
        let engine = run(config, 1, STEPS, 3, 6, false);
        assert!(engine.hits_checked > 1000, "only {} hits checked", engine.hits_checked);
        assert!(engine.cache.stats().counters.evictions.device_dropped > 0);
    }
}

#[test]
fn random_operations_keep_every_invariant_under_write_back() {
    let config =
        CacheConfig::new(BLOCK_TOKENS as u32, 12).with_host_blocks(16).with_free_watermark(2);
    for config in every_policy(config) {
        let engine = run(config, 2, STEPS, 3, 6, false);
        let stats = engine.cache.stats();
        assert!(
            stats.counters.hits.host_blocks > 100 && stats.counters.swap_in_blocks > 100,
            "{stats:?}"
        );
        assert!(
            stats.counters.failed_transfers > 10 && stats.counters.stale_completions > 0,
            "{stats:?}"
        );
        assert!(engine.hits_checked > 1000);
    }
}

#[test]
fn random_operations_keep_every_invariant_under_write_through() {
    let config = CacheConfig::new(BLOCK_TOKENS as u32, 12)
        .with_host_blocks(12)
        .with_write_policy(WritePolicy::WriteThrough);
    for config in every_policy(config) {
        let engine = run(config, 3, STEPS, 3, 6, false);
        let stats = engine.cache.stats();
        assert!(
            stats.counters.backup_blocks > 100
                && stats.counters.evictions.device_to_host_metadata > 100,
            "{stats:?}"
        );
    }
}

#[test]
fn random_operations_keep_every_invariant_under_selective_write_through() {
    let policy = WritePolicy::WriteThroughSelective { threshold: 2 };
    let config =
        CacheConfig::new(BLOCK_TOKENS as u32, 12).with_host_blocks(12).with_write_policy(policy);
    for config in every_policy(config) {
        let engine = run(config, 4, STEPS, 3, 6, false);
        let stats = engine.cache.stats();
        assert!(
            stats.counters.backup_blocks > 10 && stats.counters.evictions.device_dropped > 10,
            "{stats:?}"
        );
    }
}

#[test]
fn random_operations_keep_every_invariant_with_many_swap_ins_in_flight() {
    // Two tokens and many copies in flight: requests often share a swap-in already in flight and
    // swap in more behind it, and failures then cancel those.
    let config = CacheConfig::new(BLOCK_TOKENS as u32, 10).with_host_blocks(40);
    for config in every_policy(config) {
        let mut engine = Engine::new(config, 6, 2, 6, false);
        engine.completion_percent = 10;
        let engine = run_engine(engine, STEPS);
        let stats = engine.cache.stats();
        assert!(
            stats.counters.swap_in_blocks > 100 && stats.counters.failed_transfers > 10,
            "{stats:?}"
        );
    }
}

#[test]
fn random_operations_keep_every_invariant_with_a_storage_tier_that_fails_and_loses_blocks() {
    let config = CacheConfig::new(BLOCK_TOKENS as u32, 10)
        .with_host_blocks(8)
        .with_storage_blocks(24)
        .with_free_watermark(2);
    let mut orphaned_while_down = 0;
    for config in every_policy(config) {
        let mut engine = Engine::new(config, 7, 3, 6, false);
        engine.vanish_percent = 2;
        engine.shared_tier = true;
        let engine = run_engine(engine, STEPS);
        let counters = engine.cache.stats().counters;
        assert!(
            counters.hits.storage_blocks > 100
                && counters.loaded_blocks > 100
                && counters.stored_blocks > 100
                && counters.evictions.storage_dropped > 10
                && counters.evictions.host_written_back > 100,
            "{counters:?}"
        );
        assert!(
            counters.load_failed_blocks > 10
                && counters.store_failed_blocks > 10
                && counters.load_missing_blocks > 10
                && counters.shortened_tickets > 10,
            "{counters:?}"
        );
        assert!(
            counters.prefetches > 100
                && counters.prefetch_load_blocks > 100
                && counters.prefetch_found_blocks > 10
                && engine.forgotten_checked > 100,
            "{counters:?} forgotten {}",
            engine.forgotten_checked
        );
        assert!(engine.hits_checked > 1000);
        // The run goes through outages: copies settled unissued, stored children kept.
        assert!(
            counters.storage_outages > 10 && counters.storage_down_settled_copies > 10,
            "{counters:?}"
        );
        orphaned_while_down += counters.storage_down_orphaned_blocks;
        assert!(engine.host_shortfalls_checked > 5, "{}", engine.host_shortfalls_checked);
    }
    assert!(orphaned_while_down > 0, "no stored block was kept as an orphan while down");
}

/// Random operations over a storage tier written under `policy`, under every eviction policy,
/// with copies left in flight and blocks vanishing from the tier.
fn run_with_storage_written(policy: StorageWritePolicy) {
    let config = CacheConfig::new(BLOCK_TOKENS as u32, 10)
        .with_host_blocks(12)
        .with_storage_blocks(30)
        .with_storage_write_policy(policy);
    for config in every_policy(config) {
        let mut engine = Engine::new(config, 8, 3, 6, false);
        engine.completion_percent = 20;
        engine.vanish_percent = 1;
        let engine = run_engine(engine, STEPS);
        let counters = engine.cache.stats().counters;
        assert!(counters.hits.storage_blocks > 100 && counters.stored_blocks > 100, "{counters:?}");
        assert!(engine.hits_checked > 500, "{} hits checked", engine.hits_checked);
        assert!(engine.host_shortfalls_checked > 5, "{}", engine.host_shortfalls_checked);
    }
}

#[test]
fn random_operations_keep_every_invariant_with_a_write_through_storage_tier_and_copies_in_flight() {
    run_with_storage_written(StorageWritePolicy::WriteThrough);
}

#[test]
fn random_operations_keep_every_invariant_with_a_selective_write_through_storage_tier() {
    run_with_storage_written(StorageWritePolicy::WriteThroughSelective { threshold: 2 });
}

#[test]
fn random_operations_hit_exactly_the_committed_prefixes_when_nothing_is_evicted() {
    // Two tokens, two-token blocks and prompts of at most four blocks: at most 340 distinct
    // blocks, plus what live requests own, fit in 600 device blocks, so nothing is ever evicted.
    for config in every_policy(CacheConfig::new(BLOCK_TOKENS as u32, 600)) {
        let engine = run(config, 5, STEPS, 2, 4, true);
        assert_eq!(engine.cache.stats().counters.evictions.device_total(), 0);
        assert!(engine.hits_checked > 1000);
    }
}

/// Random operations with the device-to-host write policy `policy` over a storage tier (the
/// other storage runs write back to host): an allocation's evictions then mix copies to host,
/// drops of device nodes with host-only nodes below them (prefetched, or left by an earlier
/// copy), write-backs to storage and storage evictions, under every eviction policy, with the
/// tier shared (prefetches find forgotten blocks again) and losing blocks.
fn run_with_host_written_over_storage(policy: WritePolicy, seed: u64) -> Vec<Engine> {
    let config = CacheConfig::new(BLOCK_TOKENS as u32, 10)
        .with_host_blocks(8)
        .with_storage_blocks(24)
        .with_write_policy(policy);
    every_policy(config)
        .map(|config| {
            let mut engine = Engine::new(config, seed, 3, 6, false);
            engine.completion_percent = 30;
            engine.vanish_percent = 1;
            engine.shared_tier = true;
            let engine = run_engine(engine, STEPS);
            let counters = engine.cache.stats().counters;
            assert!(
                counters.hits.storage_blocks > 50
                    && counters.evictions.host_written_back > 100
                    && counters.evictions.device_written_back > 30
                    && counters.prefetch_load_blocks > 20,
                "{counters:?}"
            );
            assert!(engine.hits_checked > 500, "{} hits checked", engine.hits_checked);
            engine
        })
        .collect()
}

#[test]
fn random_operations_keep_every_invariant_with_selective_write_through_to_host_over_storage() {
    let policy = WritePolicy::WriteThroughSelective { threshold: 2 };
    for engine in run_with_host_written_over_storage(policy, 9) {
        let counters = engine.cache.stats().counters;
        assert!(counters.evictions.device_dropped > 100, "{counters:?}");
    }
}

#[test]
fn random_operations_keep_every_invariant_with_write_through_to_host_over_storage() {
    for engine in run_with_host_written_over_storage(WritePolicy::WriteThrough, 10) {
        let counters = engine.cache.stats().counters;
        assert!(counters.evictions.device_to_host_metadata > 100, "{counters:?}");
    }
}
