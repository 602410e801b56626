//! Conversation-generation aging ("conv"): blocks of conversations that were continued more
//! often are kept longer, by one typical think time per continuation.
//!
//! In a multi-turn workload a conversation that has been continued is more likely to be
//! continued again, and every continuation comes after a human think time, far longer than LRU's
//! memory of a few hundred requests. So a block's eviction age is shifted by `tau` per class of
//! its conversation's generation, `tau` being the median gap between a turn and its continuation,
//! measured online. The rules, per request:
//! 1. *Generation* (at its match, [`Policy::request_started`]): if the deepest matched node has
//!    no children and carries the turn-end mark (the end of an earlier finished prompt), the
//!    request continues that conversation: generation = the node's + 1. Else, if the prompt's
//!    first block past the match is in the ghost table (rule 4), generation = the ghost's + 1
//!    (its slot is emptied). Else 1. A continuation records its gap (in release stamps) for rule 5.
//! 2. *Release* (the end of the request): every node it releases takes a fresh stamp (as LRU)
//!    and the request's generation; after a finish, the last node of its path is marked as a
//!    turn's end.
//! 3. *Class* (when a node joins a set): `min(5, max(generation, hit count)) - 1`, the hit count
//!    lifting a hot shared prefix (a system prompt) that the last request through it happened to
//!    release at generation 1.
//! 4. *Removal*: a marked node whose parent is not the root and has no other child passes the
//!    mark to the parent (now the end of the cached chain); any other marked node leaves a ghost
//!    (its key, stamp and generation) in a small table, so that a conversation evicted entirely
//!    is still recognised when it comes back.
//! 5. *tau*: a histogram of gaps in quarter-octave bins, halved every 256 observations; every 8th
//!    observation `tau` becomes the median bin's centre. 0 (plain LRU) until 32 gaps were seen.
//! 6. *Victim*: on the last tier (device without a host tier, else host) the member with the
//!    smallest `stamp + tau * class`, ties to the older stamp; the device tier above a host tier
//!    is plain LRU (evicting there writes back and loses nothing, and protecting continued chains
//!    on device only duplicates their host copies).
//!
//! Every parameter is fixed and none depends on the cache's size; the time scale is learned.
//!
//! Structures: per class, the recency lists of LRU ([`super::recency`]: device only, device and
//! host, host only), plus one claimable and one storage list; a set's first member is the best of
//! at most ten list heads, read from the lists' cached head stamps under a mask of the non-empty
//! lists. Per node one more byte: generation (3 bits), hits beyond the first (3 bits) and the
//! turn-end mark; a node's class is derived from it, so its list needs no field. The ghost table
//! has one 4-byte slot per four device blocks, in 4-way buckets (the oldest slot of a full bucket
//! is overwritten). Every operation is O(1) but a late joiner's placement (as LRU). Stamps are
//! `u32`, renumbered in order when they run out (the ghosts are then forgotten).

use std::ops::ControlFlow;

use super::recency::{
    kind_of, RecencyLists, CLAIMABLE, DEVICE_AND_HOST, DEVICE_ONLY, HOST_ONLY, NONE, STORAGE_ONLY,
};
use super::{Access, EvictSet, MatchEnd, Membership, Policy, TierShape};
use crate::hash::BlockHash;
use crate::tree::NodeId;

/// Classes of generation (rule 3).
const CLASSES: usize = 5;
/// Lists per class: the kinds of [`kind_of`] a class divides (device only, device and host, host
/// only), numbered as there.
const CLASS_KINDS: usize = 3;
/// The claimable list follows the class lists, then the storage list (storage-only leaves, by
/// recency alone); both are plain lists, not classed.
const CLAIMABLE_LIST: usize = CLASSES * CLASS_KINDS;
const STORAGE_LIST: usize = CLAIMABLE_LIST + 1;
const LISTS: usize = STORAGE_LIST + 1;

/// Per-node byte: generation in bits 0-2 (0: none yet, counted as 1), hits beyond the first in
/// bits 3-5, the turn-end mark in bit 7.
const GENERATION: u8 = 0b0000_0111;
const HITS_SHIFT: u8 = 3;
const HITS: u8 = 0b0011_1000;
const TURN_END: u8 = 0b1000_0000;
/// Generations and hits saturate here: anything from `CLASSES` up is the top class anyway.
const SATURATED: u8 = 7;

/// Gaps seen before `tau` follows them (rule 5).
const WARMUP: u32 = 32;
/// Observations between two halvings of the histogram.
const HALVING_PERIOD: u32 = 256;
/// `tau` is recomputed every this many observations.
const RECOMPUTE_EVERY: u32 = 8;
/// Quarter-octave bins up to a gap of 2^24 stamps.
const BINS: usize = 96;
/// The weight of one observation in the histogram (halvings keep fractions this fine).
const WEIGHT: u32 = 256;

/// Ghost slots per device block, as a divisor, and per bucket.
const DEVICE_BLOCKS_PER_GHOST: u32 = 4;
const WAYS: usize = 4;
/// A ghost slot: generation (3 bits, 0: empty), tag (11 bits), stamp / 64 modulo 2^18.
const GHOST_TAG_BITS: u32 = 11;
const GHOST_TAG_MASK: u32 = (1 << GHOST_TAG_BITS) - 1;
const GHOST_STAMP_BITS: u32 = 18;
const GHOST_STAMP_SHIFT: u32 = 6;
const GHOST_STAMP_MASK: u32 = (1 << GHOST_STAMP_BITS) - 1;

/// The conversation-generation aging policy.
#[derive(Debug)]
pub struct Conv {
    lists: RecencyLists<LISTS>,
    /// Generation, hits and mark of each node (module constants).
    meta: Vec<u8>,
    /// Bit `list`: that class list has members.
    nonempty: u16,
    /// The stamp of each class list's head, where `nonempty`.
    head_stamps: [u32; CLAIMABLE_LIST],
    /// The generation of the request whose releases come now.
    releasing: u8,
    /// The age credited per class, in stamps.
    tau: u64,
    gaps: GapHistogram,
    /// Ghost buckets of `WAYS` slots each (empty without a configured device tier).
    ghosts: Vec<[u32; WAYS]>,
    /// Whether a host tier sits below the device tier (which is then plain LRU).
    host_tier: bool,
}

impl Default for Conv {
    fn default() -> Conv {
        Conv {
            lists: RecencyLists::default(),
            meta: Vec::new(),
            nonempty: 0,
            head_stamps: [0; CLAIMABLE_LIST],
            releasing: 1,
            tau: 0,
            gaps: GapHistogram::default(),
            ghosts: Vec::new(),
            host_tier: false,
        }
    }
}

/// Gaps between a turn and its continuation, in quarter-octave bins (rule 5).
#[derive(Debug)]
struct GapHistogram {
    bins: [u32; BINS],
    /// The sum of `bins` (at most twice `HALVING_PERIOD * WEIGHT`).
    total: u32,
    /// Observations, saturating: only compared with `WARMUP`.
    observed: u32,
    since_halving: u32,
}

impl Default for GapHistogram {
    fn default() -> GapHistogram {
        GapHistogram { bins: [0; BINS], total: 0, observed: 0, since_halving: 0 }
    }
}

impl GapHistogram {
    /// Counts `gap`; returns the new median gap when it is time to recompute it.
    fn observe(&mut self, gap: u32) -> Option<u64> {
        let bin = ((4.0 * (f64::from(gap) + 1.0).log2()) as usize).min(BINS - 1);
        self.bins[bin] += WEIGHT;
        self.total += WEIGHT;
        self.observed = self.observed.saturating_add(1);
        self.since_halving += 1;
        if self.since_halving == HALVING_PERIOD {
            self.since_halving = 0;
            for count in &mut self.bins {
                *count /= 2;
            }
            self.total = self.bins.iter().sum();
        }
        if self.observed < WARMUP || self.since_halving % RECOMPUTE_EVERY != 0 {
            return None;
        }
        let mut below = 0;
        let median = self.bins.iter().position(|&count| {
            below += count;
            2 * below >= self.total
        })?;
        Some((2f64.powf((median as f64 + 0.5) / 4.0) - 1.0) as u64)
    }
}

/// The class of a node with per-node byte `meta` (rule 3).
#[inline]
fn class_of(meta: u8) -> usize {
    let generation = (meta & GENERATION).max(1);
    let hits = ((meta & HITS) >> HITS_SHIFT) + 1;
    usize::from(generation.max(hits)).min(CLASSES) - 1
}

/// The one unclassed list of `set`'s members (claimable, storage), if it is not classed.
fn plain_list(set: EvictSet) -> Option<usize> {
    match set {
        EvictSet::Claimable => Some(CLAIMABLE_LIST),
        EvictSet::Storage => Some(STORAGE_LIST),
        EvictSet::Device | EvictSet::Host => None,
    }
}

/// The bits of `nonempty` of the lists of `set`'s members (all classes).
const fn set_mask(set: EvictSet) -> u16 {
    let kinds: [usize; 2] = match set {
        EvictSet::Device => [DEVICE_ONLY, DEVICE_AND_HOST],
        EvictSet::Host => [HOST_ONLY, DEVICE_AND_HOST],
        EvictSet::Claimable | EvictSet::Storage => return 0,
    };
    let mut mask = 0;
    let mut class = 0;
    while class < CLASSES {
        mask |= 1 << (class * CLASS_KINDS + kinds[0]);
        mask |= 1 << (class * CLASS_KINDS + kinds[1]);
        class += 1;
    }
    mask
}

/// The ghost slot of a removed chain end, or its tag, from its key: a bucket and an 11-bit tag
/// from independent bits of a mix of the key.
fn ghost_position(key: BlockHash, buckets: usize) -> (usize, u32) {
    let mixed = ((key.0 as u64) ^ ((key.0 >> 64) as u64)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let bucket = ((u128::from(mixed) * buckets as u128) >> 64) as usize;
    let tag = (mixed as u32) & GHOST_TAG_MASK;
    (bucket, tag)
}

impl Conv {
    /// The list `node` is in when in `sets`.
    #[inline]
    fn list_of(&self, node: u32, sets: Membership) -> Option<usize> {
        kind_of(sets).map(|kind| match kind {
            CLAIMABLE => CLAIMABLE_LIST,
            STORAGE_ONLY => STORAGE_LIST,
            kind => class_of(self.meta[node as usize]) * CLASS_KINDS + kind,
        })
    }

    fn generation(&self, node: u32) -> u8 {
        (self.meta[node as usize] & GENERATION).max(1)
    }

    /// Whether `set` is ordered by plain recency (the device tier above a host tier).
    fn plain(&self, set: EvictSet) -> bool {
        set == EvictSet::Device && self.host_tier
    }

    /// The eviction score of a member of `list`: smaller goes first (rule 6).
    fn score(&self, stamp: u32, list: usize, plain: bool) -> u64 {
        let class = if plain || list >= CLAIMABLE_LIST { 0 } else { (list / CLASS_KINDS) as u64 };
        u64::from(stamp) + self.tau * class
    }

    /// Links `node` into `list`, keeping the head stamp and the mask of a class list.
    #[inline]
    fn insert(&mut self, list: usize, node: u32) {
        self.lists.insert(list, node);
        if list < CLAIMABLE_LIST {
            self.nonempty |= 1 << list;
            if self.lists.head(list) == node {
                self.head_stamps[list] = self.lists.stamp(node);
            }
        }
    }

    /// Unlinks `node` from `list`, keeping the head stamp and the mask of a class list.
    #[inline]
    fn unlink(&mut self, list: usize, node: u32) {
        let was_head = self.lists.head(list) == node;
        self.lists.unlink(list, node);
        if list < CLAIMABLE_LIST {
            match self.lists.head(list) {
                NONE => self.nonempty &= !(1 << list),
                head if was_head => self.head_stamps[list] = self.lists.stamp(head),
                _ => {}
            }
        }
    }

    /// Caches the head stamps anew (the stamps were renumbered).
    fn refresh_head_stamps(&mut self) {
        for list in 0..CLAIMABLE_LIST {
            let head = self.lists.head(list);
            if head != NONE {
                self.head_stamps[list] = self.lists.stamp(head);
            }
        }
    }

    fn observe_gap(&mut self, gap: u32) {
        if let Some(tau) = self.gaps.observe(gap) {
            self.tau = tau;
        }
    }

    /// Leaves a ghost of a removed chain end keyed `key` (rule 4).
    fn remember(&mut self, key: BlockHash, stamp: u32, generation: u8) {
        if self.ghosts.is_empty() {
            return;
        }
        let (bucket, tag) = ghost_position(key, self.ghosts.len());
        let coarse = (stamp >> GHOST_STAMP_SHIFT) & GHOST_STAMP_MASK;
        let slot = u32::from(generation) << (GHOST_TAG_BITS + GHOST_STAMP_BITS)
            | tag << GHOST_STAMP_BITS
            | coarse;
        let now = (self.lists.clock() >> GHOST_STAMP_SHIFT) & GHOST_STAMP_MASK;
        let age = |slot: u32| match slot {
            0 => u32::MAX,
            slot => now.wrapping_sub(slot & GHOST_STAMP_MASK) & GHOST_STAMP_MASK,
        };
        let ways = &mut self.ghosts[bucket];
        let same = ways
            .iter()
            .position(|&way| way != 0 && (way >> GHOST_STAMP_BITS) & GHOST_TAG_MASK == tag);
        let way = same.unwrap_or_else(|| {
            (0..WAYS).max_by_key(|&way| age(ways[way])).expect("a bucket has ways")
        });
        ways[way] = slot;
    }

    /// Takes the ghost keyed `key`, if any: its generation and the gap since its stamp.
    fn recall(&mut self, key: BlockHash) -> Option<(u8, u32)> {
        if self.ghosts.is_empty() {
            return None;
        }
        let (bucket, tag) = ghost_position(key, self.ghosts.len());
        let ways = &mut self.ghosts[bucket];
        let way = ways
            .iter()
            .position(|&way| way != 0 && (way >> GHOST_STAMP_BITS) & GHOST_TAG_MASK == tag)?;
        let slot = std::mem::take(&mut ways[way]);
        let generation = (slot >> (GHOST_TAG_BITS + GHOST_STAMP_BITS)) as u8;
        let now = (self.lists.clock() >> GHOST_STAMP_SHIFT) & GHOST_STAMP_MASK;
        let gap =
            (now.wrapping_sub(slot & GHOST_STAMP_MASK) & GHOST_STAMP_MASK) << GHOST_STAMP_SHIFT;
        Some((generation, gap))
    }

    #[cfg(test)]
    fn with_clock(clock: u32) -> Conv {
        Conv { lists: RecencyLists::with_clock(clock), ..Conv::default() }
    }
}

impl Policy for Conv {
    fn reserve_nodes(&mut self, nodes: usize) {
        self.lists.reserve_nodes(nodes);
        if nodes > self.meta.len() {
            self.meta.resize(nodes, 0);
        }
    }

    fn configure(&mut self, tiers: TierShape) {
        self.host_tier = tiers.host_blocks > 0;
        let slots = tiers.device_blocks.div_ceil(DEVICE_BLOCKS_PER_GHOST) as usize;
        let buckets = slots.div_ceil(WAYS).max(1);
        if buckets != self.ghosts.len() {
            self.ghosts = vec![[0; WAYS]; buckets];
        }
    }

    fn request_started(&mut self, matched: MatchEnd) -> u8 {
        if let Some((node, true)) = matched.deepest {
            if self.meta[node.index()] & TURN_END != 0 {
                let gap = self.lists.clock().saturating_sub(self.lists.stamp(node.0));
                self.observe_gap(gap);
                return (self.generation(node.0) + 1).min(SATURATED);
            }
        }
        if let Some((generation, gap)) = matched.next_key.and_then(|key| self.recall(key)) {
            self.observe_gap(gap);
            return (generation + 1).min(SATURATED);
        }
        1
    }

    const HEARS_REQUEST_STARTS: bool = true;

    fn request_ending(&mut self, tag: u8) {
        self.releasing = tag.clamp(1, SATURATED);
    }

    fn turn_ended(&mut self, last: NodeId) {
        self.meta[last.index()] |= TURN_END;
    }

    const HEARS_REMOVALS: bool = true;

    fn removing(&mut self, node: NodeId, key: BlockHash, sole_child_of: Option<NodeId>) {
        let meta = std::mem::take(&mut self.meta[node.index()]);
        if meta & TURN_END == 0 {
            return;
        }
        match sole_child_of {
            Some(parent) => self.meta[parent.index()] |= TURN_END,
            None => self.remember(key, self.lists.stamp(node.0), (meta & GENERATION).max(1)),
        }
    }

    #[inline]
    fn wants(&self, access: Access) -> bool {
        access != Access::Commit
    }

    #[inline]
    fn touch(&mut self, node: NodeId, _key: BlockHash, access: Access) {
        match access {
            Access::Release => {
                if self.lists.stamp_now(node.0) {
                    // The stamps were renumbered: the ghosts' mean nothing now.
                    self.ghosts.fill([0; WAYS]);
                    self.refresh_head_stamps();
                }
                let meta = &mut self.meta[node.index()];
                *meta = (*meta & !GENERATION) | self.releasing;
            }
            Access::Hit => {
                let meta = &mut self.meta[node.index()];
                let hits = ((*meta & HITS) >> HITS_SHIFT).saturating_add(1).min(SATURATED);
                *meta = (*meta & !HITS) | hits << HITS_SHIFT;
            }
            Access::Commit => {}
        }
    }

    #[inline]
    fn enter(&mut self, node: NodeId, sets: Membership) {
        if let Some(list) = self.list_of(node.0, sets) {
            self.insert(list, node.0);
        }
    }

    #[inline]
    fn leave(&mut self, node: NodeId, sets: Membership) {
        if let Some(list) = self.list_of(node.0, sets) {
            self.unlink(list, node.0);
        }
    }

    #[inline]
    fn first(&self, set: EvictSet) -> Option<NodeId> {
        if let Some(list) = plain_list(set) {
            return Some(self.lists.head(list)).filter(|&node| node != NONE).map(NodeId);
        }
        let plain = self.plain(set);
        let mut mask = self.nonempty & set_mask(set);
        let mut best = (u64::MAX, u32::MAX, LISTS);
        while mask != 0 {
            let list = mask.trailing_zeros() as usize;
            mask &= mask - 1;
            let stamp = self.head_stamps[list];
            let score = self.score(stamp, list, plain);
            if (score, stamp) < (best.0, best.1) {
                best = (score, stamp, list);
            }
        }
        (best.2 != LISTS).then(|| NodeId(self.lists.head(best.2)))
    }

    fn len(&self, set: EvictSet) -> usize {
        if let Some(list) = plain_list(set) {
            return self.lists.len(list) as usize;
        }
        let mask = set_mask(set);
        (0..CLAIMABLE_LIST)
            .filter(|&list| mask & 1 << list != 0)
            .map(|list| self.lists.len(list) as usize)
            .sum()
    }

    fn visit(&self, set: EvictSet, visit: &mut dyn FnMut(NodeId) -> ControlFlow<()>) {
        let plain = self.plain(set);
        let mask = match plain_list(set) {
            Some(list) => 1 << list,
            None => u32::from(set_mask(set)),
        };
        let mut cursors = [NONE; LISTS];
        for (list, cursor) in cursors.iter_mut().enumerate() {
            if mask & 1 << list != 0 {
                *cursor = self.lists.head(list);
            }
        }
        loop {
            let mut best: Option<(u64, u32, usize)> = None;
            for (list, &node) in cursors.iter().enumerate() {
                if node == NONE {
                    continue;
                }
                let stamp = self.lists.stamp(node);
                let key = (self.score(stamp, list, plain), stamp, list);
                if best.is_none_or(|best| (key.0, key.1) < (best.0, best.1)) {
                    best = Some(key);
                }
            }
            let Some((_, _, list)) = best else { return };
            let node = cursors[list];
            cursors[list] = self.lists.next(node);
            if visit(NodeId(node)).is_break() {
                return;
            }
        }
    }

    fn stamp(&self, node: NodeId) -> u64 {
        u64::from(self.lists.stamp(node.0))
    }

    fn clear(&mut self) {
        let (host_tier, buckets) = (self.host_tier, self.ghosts.len());
        *self = Conv { host_tier, ghosts: vec![[0; WAYS]; buckets], ..Conv::default() };
    }

    fn check(&self, membership: &dyn Fn(NodeId) -> Option<Membership>) -> Result<(), String> {
        self.lists.check("conv", &|node| match membership(NodeId(node)) {
            Some(sets) => Ok(self.list_of(node, sets)),
            None => Err(format!("{node} is not a live node")),
        })?;
        for (node, &meta) in self.meta.iter().enumerate() {
            if meta != 0 && membership(NodeId(node as u32)).is_none() {
                return Err(format!("removed node {node} keeps conv state"));
            }
        }
        for list in 0..CLAIMABLE_LIST {
            let nonempty = self.nonempty & 1 << list != 0;
            if nonempty != (self.lists.len(list) > 0) {
                return Err(format!("conv list {list}: the mask of non-empty lists is wrong"));
            }
            if nonempty && self.head_stamps[list] != self.lists.stamp(self.lists.head(list)) {
                return Err(format!("conv list {list}: the cached head stamp is stale"));
            }
        }
        Ok(())
    }

    fn heap_bytes(&self) -> usize {
        self.lists.heap_bytes()
            + self.meta.capacity()
            + self.ghosts.capacity() * size_of::<[u32; WAYS]>()
    }
}

#[cfg(test)]
mod tests;
