//! What an allocation would take, and whether it could get it, without changing anything: vLLM's
//! `can_fit_full_sequence`, SGLang's "free + evictable".
//!
//! 1. [`CacheManager::demand`] counts the device blocks `allocate` would take for a request: one
//!    per host hit not yet given a block, and the blocks for the new and lookahead tokens beyond
//!    what the block table covers (checked arithmetic: an absurd count is a typed error).
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
    /// Host hits that get a device block and a swap-in.
    pub swap_ins: usize,
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
        let needed = self.demand(request, record, new_tokens, lookahead)?.blocks();
        let available = self.obtainable_device_blocks(needed);
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

    /// The device blocks `allocate` takes for `record` (module flow, step 1).
    pub(super) fn demand(
        &self,
        request: RequestId,
        record: &Request,
        new_tokens: usize,
        lookahead: usize,
    ) -> Result<Demand, AllocateError> {
        let block_tokens = self.config.block_tokens as usize;
        let hits = record.path.get(record.table.len()..).unwrap_or_default();
        let swap_ins =
            hits.iter().filter(|&&id| self.tree.node(id).state() == NodeState::Host).count();
        let covered = record.table.len().max(record.path.len());
        let fresh = record
            .tokens
            .checked_add(new_tokens)
            .and_then(|tokens| tokens.checked_add(lookahead))
            .ok_or(AllocateError::TooManyTokens { request, new_tokens, lookahead })?
            .div_ceil(block_tokens)
            .saturating_sub(covered);
        Ok(Demand { swap_ins, fresh })
    }
}
