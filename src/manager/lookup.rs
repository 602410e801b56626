//! `lookup` and `match_prefix` (SPEC 5.1 and 5.2): how much of a prompt is cached, and holding it.
//!
//! Matching walks from the root by (parent, hash) and stops at the first block that is not
//! cached. Device hits come first (device residency is prefix-closed), then host hits:
//! - `Device`, `SwapToHost(backup | evict)` and `SwapToDevice` nodes are device hits (the last
//!   one waits on the copy already in flight; a hit on an evicting node cancels the eviction);
//! - `Host` nodes are host hits (a swap-in at allocation);
//! - a `SwapToHost(claimed)` node ends the match: its device block already serves another
//!   request and its host copy is not written yet.

use serde::Serialize;

use super::{CacheManager, MatchError, Request, RequestId, WritePolicy};
use crate::hash::BlockHash;
use crate::tree::{NodeId, NodeState, SwapOut};

/// How many leading blocks of a prompt are cached, per tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Lookup {
    pub device_blocks: usize,
    pub host_blocks: usize,
}

impl Lookup {
    pub fn blocks(&self) -> usize {
        self.device_blocks + self.host_blocks
    }
}

/// What `match_prefix` found and now holds for the request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PrefixMatch {
    pub device_blocks: usize,
    pub host_blocks: usize,
    /// Prompt tokens covered by the hits: `min(hit blocks * block_tokens, prompt_tokens)`.
    pub cached_tokens: usize,
}

impl PrefixMatch {
    pub fn blocks(&self) -> usize {
        self.device_blocks + self.host_blocks
    }
}

impl CacheManager {
    /// How many leading blocks of `hashes` hit on device and on host. No side effects.
    pub fn lookup(&self, hashes: &[BlockHash]) -> Lookup {
        self.walk(hashes, |_| {})
    }

    /// Looks up the prompt of a new request and holds its cached prefix (`ref_count += 1`, one
    /// more hit, touched now). `prompt_tokens` bounds the cached tokens reported (the last hash
    /// may name a partial block when hashes come from a trace).
    pub fn match_prefix(
        &mut self,
        request: RequestId,
        hashes: &[BlockHash],
        prompt_tokens: usize,
    ) -> Result<PrefixMatch, MatchError> {
        if self.requests.contains_key(&request) {
            return Err(MatchError::DuplicateRequest(request));
        }
        let mut path = Vec::new();
        let found = self.walk(hashes, |id| path.push(id));
        let clock = self.tick();
        let selective = match self.config.write_policy {
            WritePolicy::WriteThroughSelective { threshold } if self.host_enabled() => {
                Some(threshold)
            }
            _ => None,
        };
        for &id in &path {
            let queue = self.tree.update(id, |node| {
                node.hold();
                node.count_hit();
                node.touch(clock);
                if node.node().state() == NodeState::SwapToHost(SwapOut::Evict) {
                    node.set_state(NodeState::SwapToHost(SwapOut::Backup));
                }
                let wants_backup = selective
                    .is_some_and(|threshold| node.node().hit_count() >= threshold)
                    && node.node().state() == NodeState::Device
                    && node.node().host().is_none()
                    && !node.node().backup_queued();
                if wants_backup {
                    node.set_backup_queued(true);
                }
                wants_backup
            });
            if queue {
                self.pending_backups.push(id);
            }
        }
        let block_tokens = self.config.block_tokens as usize;
        let cached_tokens = (found.blocks() * block_tokens).min(prompt_tokens);
        let device_tokens = (found.device_blocks * block_tokens).min(prompt_tokens);
        self.stats.record_match(hashes.len(), found, device_tokens, cached_tokens - device_tokens);
        self.requests
            .insert(request, Request { path, tokens: cached_tokens, ..Request::default() });
        Ok(PrefixMatch {
            device_blocks: found.device_blocks,
            host_blocks: found.host_blocks,
            cached_tokens,
        })
    }

    fn walk(&self, hashes: &[BlockHash], mut visit: impl FnMut(NodeId)) -> Lookup {
        let mut found = Lookup::default();
        let mut parent = NodeId::ROOT;
        for &hash in hashes {
            let Some(id) = self.tree.child(parent, hash) else { break };
            match self.tree.node(id).state() {
                NodeState::Device
                | NodeState::SwapToHost(SwapOut::Backup | SwapOut::Evict)
                | NodeState::SwapToDevice => found.device_blocks += 1,
                NodeState::Host => found.host_blocks += 1,
                NodeState::SwapToHost(SwapOut::Claimed) => break,
            }
            visit(id);
            parent = id;
        }
        found
    }
}
