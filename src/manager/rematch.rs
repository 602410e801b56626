//! Requests that wait: giving back a match whose allocation failed, and matching again to pick up
//! blocks other requests cached meanwhile.
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

use super::lookup::hit_tier;
use super::{CacheManager, Lookup, MatchError, PrefixMatch, RequestId};
use crate::hash::BlockHash;
use crate::tree::NodeId;

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
                || super::lookup::ends_hits(&self.tree, &self.unloadable, self.tier.is_down(), id)
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
        super::lookup::hold_hit(&mut self.tree, id, selective, &mut self.pending_backups);
    }
}
