//! What an allocation would take, and whether it could get it, without changing anything: vLLM's
//! `can_fit_full_sequence`, SGLang's "free + evictable".
//!
//! 1. [`CacheManager::demand`] counts the device blocks `allocate` would take for a request: one
//!    per host or storage hit not yet given a block (a storage hit also takes a host block), and the blocks for the new and lookahead tokens beyond
//!    what the block table covers ([`CacheManager::fresh_blocks`], checked arithmetic: an absurd
//!    count is a typed error; an allocation without a host tier, whose hits are all on device,
//!    counts only these).
//! 2. [`CacheManager::obtainable_device_blocks`] counts free blocks, then what claims and
//!    evictions could free, up to a limit (the count is O(limit), never a scan of the tree).
//! 3. [`CacheManager::can_allocate`] puts the two together.

use serde::Serialize;

use super::{AllocateError, CacheManager, Request, RequestId};
use crate::tree::NodeState;

/// What `allocate` would need and what it could get, counted without changing anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct AllocationCheck {
    /// Device blocks the allocation would take.
    pub needed: usize,
    /// Device blocks it could get (free, claimable, evictable), counted up to `needed`: when it
    /// fits, this equals `needed` even if more could be had.
    pub available: usize,
}

impl AllocationCheck {
    /// Whether `allocate` with the same arguments would succeed now.
    pub fn fits(&self) -> bool {
        self.available >= self.needed
    }
}

/// The device blocks one allocation takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Demand {
    /// Host and storage hits that get a device block and a swap-in.
    pub swap_ins: usize,
    /// Storage hits, which also get a host block and a load.
    pub loads: usize,
    /// Blocks for the new and lookahead tokens.
    pub fresh: usize,
}

impl Demand {
    pub fn blocks(&self) -> usize {
        self.swap_ins + self.fresh
    }
}

impl CacheManager {
    /// Whether `allocate(request, new_tokens, lookahead)` would succeed now, and how many blocks it
    /// needs; changes nothing (module flow).
    pub fn can_allocate(
        &mut self,
        request: RequestId,
        new_tokens: usize,
        lookahead: usize,
    ) -> Result<AllocationCheck, AllocateError> {
        let record = self.requests.get(&request).ok_or(AllocateError::UnknownRequest(request))?;
        if record.failed {
            return Err(AllocateError::RequestFailed(request));
        }
        let hits_end = self.hits_end(record);
        let demand = self.demand(request, record, hits_end, new_tokens, lookahead)?;
        let needed = demand.blocks();
        let available = self.obtainable_device_blocks(needed);
        if available >= needed && self.obtainable_host_blocks(demand.loads) < demand.loads {
            // The loads cannot get their host blocks: it does not fit, whatever the device has.
            return Ok(AllocationCheck { needed, available: needed - 1 });
        }
        Ok(AllocationCheck { needed, available })
    }

    /// Device blocks an allocation could get now: the free ones, then those that claims of blocks
    /// being swapped out and evictions of unheld cached blocks would free, counted up to `limit`.
    /// Changes nothing.
    pub fn obtainable_device_blocks(&mut self, limit: usize) -> usize {
        let free = self.device.free_count();
        if free >= limit {
            return limit;
        }
        free + self.reclaimable_up_to(limit - free)
    }

    /// Host blocks an allocation's loads could get now, counted up to `limit`: free ones, then
    /// what evictions of host candidates could give (the cascade included). Changes nothing.
    pub(super) fn obtainable_host_blocks(&mut self, limit: usize) -> usize {
        let free = self.host.free_count();
        if free >= limit {
            return limit;
        }
        let (gone, exposed) = &mut self.scratch_reclaim;
        free + super::evict::count_host_obtainable(&self.tree, gone, exposed, limit - free)
    }

    /// Where `record`'s hits end for an allocation: its path's end, or the first block of it the
    /// storage tier reported missing (still held by some request: no hit, DESIGN §9), or its
    /// first storage-only block while the tier is down (`tier_health`).
    pub(super) fn hits_end(&self, record: &Request) -> usize {
        if self.unloadable.is_empty() && !self.tier.is_down() {
            return record.path.len();
        }
        self.first_lost_hit(record).unwrap_or(record.path.len())
    }

    /// The device blocks `allocate` takes for `record` (module flow, step 1), its hits ending at
    /// path position `hits_end`.
    #[inline]
    pub(super) fn demand(
        &self,
        request: RequestId,
        record: &Request,
        hits_end: usize,
        new_tokens: usize,
        lookahead: usize,
    ) -> Result<Demand, AllocateError> {
        let hits = record.path.get(record.table.len()..hits_end).unwrap_or_default();
        let (mut swap_ins, mut loads) = (0, 0);
        for &id in hits {
            match self.tree.node(id).state() {
                NodeState::Host => swap_ins += 1,
                NodeState::Storage => loads += 1,
                // A prefetch brings it to host; it needs a device block to go on.
                NodeState::StorageToHost => {
                    swap_ins += usize::from(self.tree.node(id).device().is_none());
                }
                _ => {}
            }
        }
        swap_ins += loads;
        let covered = record.table.len().max(hits_end);
        let fresh = self.fresh_blocks(request, record, covered, new_tokens, lookahead)?;
        Ok(Demand { swap_ins, loads, fresh })
    }

    /// The fresh blocks of [`CacheManager::demand`]: those that `new_tokens` and `lookahead`
    /// more tokens need past the `covered` positions of `record`'s block table and hits.
    #[inline]
    pub(super) fn fresh_blocks(
        &self,
        request: RequestId,
        record: &Request,
        covered: usize,
        new_tokens: usize,
        lookahead: usize,
    ) -> Result<usize, AllocateError> {
        let block_tokens = self.config.block_tokens as usize;
        Ok(record
            .tokens
            .checked_add(new_tokens)
            .and_then(|tokens| tokens.checked_add(lookahead))
            .ok_or(AllocateError::TooManyTokens { request, new_tokens, lookahead })?
            .div_ceil(block_tokens)
            .saturating_sub(covered))
    }
}
