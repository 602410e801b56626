//! What an engine asks of a prompt (DESIGN §4.5): how much of it is cached (`lookup`), holding
//! that (`match_prefix`), and, for a request that waits, letting go or matching again.
//!
//! The last-token rule (DESIGN §4.5): a match never covers the whole prompt. Of a prompt of `T`
//! tokens at most `(T - 1) / block_tokens` leading blocks hit, so the engine always computes at
//! least the last prompt token (it needs that token's logits to sample the first output token), and
//! the block that token lands in is never a shared cached block: a prefill cannot write into a
//! block another request reads. A block-aligned prompt thus recomputes its whole last block, as
//! vLLM and SGLang do. The rule needs the prompt's length in tokens, which block hashes alone do
//! not tell (a prompt of 8 blocks and one of 8 blocks and 100 tokens have the same full-block
//! hashes), so both operations take it, and refuse a length that cannot go with the hashes given.
//!
//! Matching walks from the root by (parent, hash) and stops at the first block that is not
//! cached, or at the rule's bound. Device hits come first (device residency is prefix-closed),
//! then host hits, then storage hits (below a storage-only node all nodes are storage-only):
//! - `Device`, `SwapToHost(backup | evict)` and `SwapToDevice` nodes are device hits (the last
//!   one waits on the copy already in flight; a hit on an evicting node cancels the eviction);
//! - `Host` nodes are host hits (a swap-in at allocation);
//! - `Storage` nodes are storage hits (a load, then a swap-in, at allocation), and so are
//!   `StorageToHost` nodes (a LOAD of another request or of a prefetch is bringing them up:
//!   the allocation shares it, and its swap-in follows it);
//! - a `SwapToHost(claimed)` node ends the match: its device block already serves another
//!   request and its host copy is not written yet; so does a node being written to storage
//!   (`HostToStorage`): its one copy in flight is taken.
//!
//! `match_prefix` then walks, tells the policy where the match ended, and holds the path
//! (`hold_hits`: one more holder and hit each, touched now).
//!
//! Requests that wait (`rematch`, `release_match`): giving back a match whose allocation failed,
//! and matching again to pick up blocks other requests cached meanwhile.
//!
//! An engine that cannot allocate for a request (the device tier is full of blocks in use) keeps
//! it waiting. Its held prefix stays pinned meanwhile, which is right for a short wait and wrong
//! for a long one; and other requests may cache more of its prompt in the meantime. So:
//! - [`CacheManager::release_match`] gives back what a request that has not allocated holds and
//!   forgets it (neither finished nor aborted): `match_prefix` it again when it is scheduled.
//! - [`CacheManager::rematch`] extends the held prefix of a request that has not allocated:
//!   1. check that the held nodes are the leading hashes given;
//!   2. walk on from the last held node as `match_prefix` does, at most to the last-token limit;
//!   3. hold the new nodes (one more hit each, touched now) and count their hits.
//!
//! And a question about the live requests' matches: how many leading blocks they all share
//! (`common_prefix_blocks`, for cascade attention).

use serde::Serialize;

use super::{CacheManager, MatchError, PromptError, RequestId, UnknownRequest, WritePolicy};
use crate::hash::BlockHash;
use crate::tree::policy::Access;
use crate::tree::{NodeId, NodeState, SwapOut, Tree};

/// How many leading blocks of a prompt are cached, per tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Lookup {
    pub device_blocks: usize,
    pub host_blocks: usize,
    pub storage_blocks: usize,
}

impl Lookup {
    pub fn blocks(&self) -> usize {
        self.device_blocks + self.host_blocks + self.storage_blocks
    }
}

/// What `match_prefix` found and now holds for the request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PrefixMatch {
    pub device_blocks: usize,
    pub host_blocks: usize,
    /// Hits on the storage tier: `allocate` loads them into host blocks, then the device.
    pub storage_blocks: usize,
    /// Prompt tokens covered by the hits: `hit blocks * block_tokens`, always less than the
    /// prompt's tokens (the last-token rule).
    pub cached_tokens: usize,
}

impl PrefixMatch {
    pub fn blocks(&self) -> usize {
        self.device_blocks + self.host_blocks + self.storage_blocks
    }
}

/// The tier a node hits on, or `None` where a match stops at it (module documentation).
#[inline]
pub(super) fn hit_tier(state: NodeState) -> Option<HitTier> {
    match state {
        NodeState::Device
        | NodeState::SwapToHost(SwapOut::Backup | SwapOut::Evict)
        | NodeState::SwapToDevice => Some(HitTier::Device),
        NodeState::Host => Some(HitTier::Host),
        // Being loaded (by an allocation or a prefetch): `allocate` shares the LOAD.
        NodeState::Storage | NodeState::StorageToHost => Some(HitTier::Storage),
        NodeState::SwapToHost(SwapOut::Claimed) | NodeState::HostToStorage(_) => None,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum HitTier {
    Device,
    Host,
    Storage,
}

impl Lookup {
    pub(super) fn count(&mut self, tier: HitTier) {
        match tier {
            HitTier::Device => self.device_blocks += 1,
            HitTier::Host => self.host_blocks += 1,
            HitTier::Storage => self.storage_blocks += 1,
        }
    }
}

impl CacheManager {
    /// What [`CacheManager::match_prefix`] would hold for this prompt right now, per tier, under
    /// the same last-token rule and with the same errors, but without holding, touching or
    /// counting anything: no side effects.
    pub fn lookup(
        &self,
        hashes: &[BlockHash],
        prompt_tokens: usize,
    ) -> Result<Lookup, PromptError> {
        let matchable = self.matchable(hashes, prompt_tokens)?;
        Ok(self.walk_hits(matchable, self.tier.is_down(), &mut |_| {}))
    }

    /// How many leading blocks of `hashes` are cached, per tier, with no last-token rule: a
    /// question about the cache's contents (inspection, tests), not about a prompt. Engines
    /// deciding what to compute use [`CacheManager::lookup`]. The storage-only blocks of a tier
    /// that is down count: they are still cached, only not used until it is back. No side
    /// effects.
    pub fn cached_prefix(&self, hashes: &[BlockHash]) -> Lookup {
        self.walk_hits(hashes, false, &mut |_| {})
    }

    /// Walks the cached prefix of `hashes`, visiting each node that hits; a block the storage
    /// tier reported missing ends it (it waits for its holders to let go, DESIGN §9), and so
    /// does a storage-only block when `tier_down` ([`super::tier_health`]).
    fn walk_hits(
        &self,
        hashes: &[BlockHash],
        tier_down: bool,
        visit: &mut dyn FnMut(NodeId),
    ) -> Lookup {
        if self.unloadable.is_empty() && !tier_down {
            walk(&self.tree, hashes, |_| false, visit)
        } else {
            walk_before_lost(&self.tree, &self.unloadable, tier_down, hashes, visit)
        }
    }

    /// Looks up the prompt of a new request and holds its cached prefix (`ref_count += 1`, one
    /// more hit, touched now).
    ///
    /// `hashes` are the chained hashes of the prompt's leading blocks (see
    /// [`crate::hash::BlockHasher::hash_prompt`]: full blocks only; a trailing partial block's
    /// hash is accepted and never hits), and `prompt_tokens` is the prompt's length in tokens.
    /// At most `(prompt_tokens - 1) / block_tokens` blocks hit (the last-token rule, module
    /// documentation), so `cached_tokens < prompt_tokens` always: the engine computes at least
    /// the last prompt token, into a block of its own.
    ///
    /// # Errors
    /// [`MatchError::DuplicateRequest`] for a live request; [`MatchError::Prompt`] when there are
    /// more hashes than `prompt_tokens` make blocks (a wrong length). Nothing changes on error.
    pub fn match_prefix(
        &mut self,
        request: RequestId,
        hashes: &[BlockHash],
        prompt_tokens: usize,
    ) -> Result<PrefixMatch, MatchError> {
        let matchable = self.matchable(hashes, prompt_tokens)?;
        let selective = self.selective_backup_threshold();
        let block_tokens = self.config.block_tokens as usize;
        let CacheManager { requests, tree, pending_backups, stats, unloadable, tier, .. } = self;
        let record = requests.start(request).ok_or(MatchError::DuplicateRequest(request))?;
        let found = if unloadable.is_empty() && !tier.is_down() {
            walk(tree, matchable, |_| false, |id| record.path.push(id))
        } else {
            let visit = &mut |id| record.path.push(id);
            walk_before_lost(tree, unloadable, tier.is_down(), matchable, visit)
        };
        record.policy_tag = tree
            .request_started(record.path.last().copied(), hashes.get(record.path.len()).copied());
        hold_hits(tree, &record.path, selective, pending_backups);
        Ok(matched(stats, record, hashes.len(), found, block_tokens))
    }

    /// The hit count at which a device node without a host copy is queued for a backup: the
    /// threshold of selective write-through with a host tier, `None` otherwise.
    pub(super) fn selective_backup_threshold(&self) -> Option<u32> {
        match self.config.write_policy {
            WritePolicy::WriteThroughSelective { threshold } if self.host_enabled() => {
                Some(threshold)
            }
            _ => None,
        }
    }

    /// The leading hashes the last-token rule lets hit: at most `(prompt_tokens - 1) /
    /// block_tokens` of them. Refuses more hashes than the prompt has blocks.
    pub(super) fn matchable<'h>(
        &self,
        hashes: &'h [BlockHash],
        prompt_tokens: usize,
    ) -> Result<&'h [BlockHash], PromptError> {
        let block_tokens = self.config.block_tokens as usize;
        let blocks = prompt_tokens.div_ceil(block_tokens);
        if hashes.len() > blocks {
            return Err(PromptError {
                hashes: hashes.len(),
                prompt_tokens,
                block_tokens: self.config.block_tokens,
                blocks,
            });
        }
        let bound = prompt_tokens.saturating_sub(1) / block_tokens;
        Ok(&hashes[..hashes.len().min(bound)])
    }
}

/// The end of a match that found `found` for `record` (a prompt of `queried` blocks): the
/// record's tokens, the counters, and what the engine hears.
#[inline]
fn matched(
    stats: &mut super::stats::CacheCounters,
    record: &mut super::request::Request,
    queried: usize,
    found: Lookup,
    block_tokens: usize,
) -> PrefixMatch {
    let cached_tokens = found.blocks() * block_tokens;
    stats.record_match(queried, found, block_tokens);
    record.tokens = cached_tokens;
    PrefixMatch {
        device_blocks: found.device_blocks,
        host_blocks: found.host_blocks,
        storage_blocks: found.storage_blocks,
        cached_tokens,
    }
}

/// Holds each node of `path`, a match's hits, in order, after the walk ([`hold_hit`] each).
fn hold_hits(
    tree: &mut Tree,
    path: &[NodeId],
    selective: Option<u32>,
    pending_backups: &mut Vec<NodeId>,
) {
    for &id in path {
        hold_hit(tree, id, selective, pending_backups);
    }
}

/// Holds hit `id` for a request: one more holder, one more hit, touched now. A hit on a node
/// being evicted to host cancels the eviction (its copy lands as a backup); under selective
/// write-through (`selective`: its threshold), a device node without a host copy that reaches
/// the threshold is queued for a backup in `pending_backups`.
pub(super) fn hold_hit(
    tree: &mut Tree,
    id: NodeId,
    selective: Option<u32>,
    pending_backups: &mut Vec<NodeId>,
) {
    let queue = tree.update(id, |node| {
        node.hold();
        node.count_hit();
        node.access(Access::Hit);
        if node.node().state() == NodeState::SwapToHost(SwapOut::Evict) {
            node.set_state(NodeState::SwapToHost(SwapOut::Backup));
        }
        let wants_backup = selective.is_some_and(|threshold| node.node().hit_count() >= threshold)
            && node.node().state() == NodeState::Device
            && node.node().host().is_none()
            && !node.node().backup_queued();
        if wants_backup {
            node.set_backup_queued(true);
        }
        wants_backup
    });
    if queue {
        pending_backups.push(id);
    }
}

/// [`walk`] stopping before a block the storage tier reported missing (one of `unloadable`), and
/// before any storage-only block when `tier_down`. Only while such a block is still held, or while the
/// tier is down.
fn walk_before_lost(
    tree: &Tree,
    unloadable: &[(NodeId, BlockHash)],
    tier_down: bool,
    hashes: &[BlockHash],
    visit: &mut dyn FnMut(NodeId),
) -> Lookup {
    walk(tree, hashes, |id| ends_hits(tree, unloadable, tier_down, id), visit)
}

/// Whether live node `id` ends a request's hits although it is cached: a block the tier
/// reported missing ([`is_lost`]), or, while the tier is down (`tier_down`), a block only the
/// tier holds or a LOAD is bringing up ([`super::tier_health`]).
pub(super) fn ends_hits(
    tree: &Tree,
    unloadable: &[(NodeId, BlockHash)],
    tier_down: bool,
    id: NodeId,
) -> bool {
    (tier_down && super::tier_health::waits_on_tier(tree.node(id).state()))
        || (!unloadable.is_empty() && is_lost(tree, unloadable, id))
}

/// Whether live node `id` is a block the storage tier reported missing, still held (DESIGN §9):
/// storage-only and listed in `unloadable` under its hash.
pub(super) fn is_lost(tree: &Tree, unloadable: &[(NodeId, BlockHash)], id: NodeId) -> bool {
    let node = tree.node(id);
    node.state() == NodeState::Storage
        && unloadable.iter().any(|&(lost, hash)| lost == id && node.hash() == hash)
}

/// Walks the cached prefix of `hashes` from the root, visiting each node that hits, until `stop`
/// says a node ends it.
fn walk(
    tree: &Tree,
    hashes: &[BlockHash],
    stop: impl Fn(NodeId) -> bool,
    mut visit: impl FnMut(NodeId),
) -> Lookup {
    let mut found = Lookup::default();
    let mut parent = NodeId::ROOT;
    for &hash in hashes {
        let Some(id) = tree.child(parent, hash) else { break };
        let Some(tier) = hit_tier(tree.node(id).state()) else { break };
        if stop(id) {
            break;
        }
        found.count(tier);
        visit(id);
        parent = id;
    }
    found
}

impl CacheManager {
    /// Gives back the holds of a request that has not allocated, and forgets it: its allocation
    /// failed and it waits. Counted neither finished nor aborted. A request that has allocated
    /// ends with `finish` or `abort`.
    pub fn release_match(&mut self, request: RequestId) -> Result<(), MatchError> {
        let record = self.requests.get(&request).ok_or(MatchError::UnknownRequest(request))?;
        if !record.table.is_empty() {
            return Err(MatchError::AlreadyAllocated(request));
        }
        let CacheManager { requests, tree, .. } = self;
        let record = requests.remove(&request).expect("found just above");
        tree.request_ending(record.policy_tag);
        for &id in record.path.iter().rev() {
            tree.release(id);
        }
        Ok(())
    }

    /// Extends the held prefix of a live request that has not allocated with the blocks cached
    /// since it was matched (module flow); returns the whole match, as `match_prefix` would.
    /// `hashes` are the request's block hashes from block 0, as given to `match_prefix`.
    pub fn rematch(
        &mut self,
        request: RequestId,
        hashes: &[BlockHash],
        prompt_tokens: usize,
    ) -> Result<PrefixMatch, MatchError> {
        let record = self.requests.get(&request).ok_or(MatchError::UnknownRequest(request))?;
        if !record.table.is_empty() {
            return Err(MatchError::AlreadyAllocated(request));
        }
        let held = record.path.len();
        let mismatch = record
            .path
            .iter()
            .zip(hashes)
            .position(|(&id, &hash)| self.tree.node(id).hash() != hash)
            .or((hashes.len() < held).then_some(hashes.len()));
        if let Some(block) = mismatch {
            return Err(MatchError::PrefixMismatch { request, block });
        }
        let block_tokens = self.config.block_tokens as usize;
        // The last-token rule, as `match_prefix` applies it (and refuses a wrong length).
        let limit = self.matchable(hashes, prompt_tokens)?.len();
        let mut parent = record.path.last().copied().unwrap_or(NodeId::ROOT);
        let mut added = Vec::new();
        for &hash in hashes.get(held..limit).unwrap_or_default() {
            let Some(id) = self.tree.child(parent, hash) else { break };
            if hit_tier(self.tree.node(id).state()).is_none()
                || ends_hits(&self.tree, &self.unloadable, self.tier.is_down(), id)
            {
                break;
            }
            added.push(id);
            parent = id;
        }
        for &id in &added {
            self.hold_rematched(id);
        }
        let record = self.requests.get_mut(&request).expect("found just above");
        record.path.extend_from_slice(&added);
        let path_blocks = record.path.len();
        record.tokens = (path_blocks * block_tokens).min(prompt_tokens);
        let cached_tokens = record.tokens;
        let mut new = Lookup::default();
        for &id in &added {
            new.count(hit_tier(self.tree.node(id).state()).expect("a held node hits"));
        }
        // Looked up again: the blocks it finds now are queried anew, so that the misses counted
        // at the match stay counted (a published counter never falls).
        self.stats.queried_blocks += added.len() as u64;
        self.stats.record_hits(new, block_tokens);
        let found = self.cached_prefix(&hashes[..path_blocks]);
        Ok(PrefixMatch {
            device_blocks: found.device_blocks,
            host_blocks: found.host_blocks,
            storage_blocks: found.storage_blocks,
            cached_tokens,
        })
    }

    /// Holds one more node for a request, as `match_prefix` holds the nodes it matches: one more
    /// hit, touched now, a pending eviction cancelled, a hot node queued for a selective backup.
    fn hold_rematched(&mut self, id: NodeId) {
        let selective = self.selective_backup_threshold();
        hold_hit(&mut self.tree, id, selective, &mut self.pending_backups);
    }
}

impl CacheManager {
    /// How many leading blocks of `request`'s block table every live request shares: cached
    /// blocks it has on device that every live request holds, the prefix that cascade attention
    /// computes once (vLLM's `get_num_common_prefix_blocks`). O(blocks of the prefix).
    pub fn common_prefix_blocks(&self, request: RequestId) -> Result<usize, UnknownRequest> {
        let record = self.requests.get(&request).ok_or(UnknownRequest(request))?;
        let live = self.requests.len() as u64;
        let on_device = record.path.len().min(record.table.len());
        Ok(record.path[..on_device]
            .iter()
            .take_while(|&&id| u64::from(self.tree.node(id).ref_count()) == live)
            .count())
    }
}
