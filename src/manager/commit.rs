//! `commit` (DESIGN §4.5): caching a request's computed full blocks under its path.
//!
//! For each full block past the request's path, in order:
//! 1. not cached: a new node takes the request's block (the node is held by the request); every
//!    block after it is then new too (a new node has no children), and the rest of the run is
//!    inserted as one chain ([`crate::tree::Tree::insert_chain`]);
//! 2. cached on device already (another request computed it meanwhile): the request holds that
//!    node and keeps its own copy privately until it ends, so one copy stays cached;
//! 3. cached on host only: the request's copy becomes the node's device copy (the host copy stays
//!    as a backup);
//! 4. cached on storage only: the same, the storage copy staying (a block-aligned prompt
//!    recomputes its last block, often one that went down to storage, and its decode blocks go
//!    on under it);
//! 5. cached but in flight: the commit stops here; the rest stays the request's own.
//!
//! A node of step 3 or 4 whose block the tier reported missing (still held when its LOAD
//! missed, so not dropped yet) is then no longer counted on storage, and the tier is told to
//! forget its copy.
//!
//! A block is inserted only under a parent with a valid device copy, so device residency stays
//! prefix-closed.

use serde::Serialize;

use super::{CacheManager, CommitError, RequestId, WritePolicy};
use crate::hash::BlockHash;
use crate::tree::policy::Access;
use crate::tree::{NodeId, NodeMut, NodeState, SwapOut};

/// What a commit did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Committed {
    /// Blocks newly cached from the request's own copies.
    pub inserted: usize,
    /// Blocks that were cached already (the cached copy is kept, the request's is private or
    /// became the node's device copy).
    pub duplicates: usize,
}

impl CacheManager {
    /// Caches the full blocks among the request's first `computed_tokens` tokens (prompt and
    /// generated). `hashes` are the request's block hashes from block 0, at least one per full
    /// block (see [`crate::hash::BlockHasher::extend`]). Commit after the allocation's ticket is
    /// ready.
    pub fn commit(
        &mut self,
        request: RequestId,
        computed_tokens: usize,
        hashes: &[BlockHash],
    ) -> Result<Committed, CommitError> {
        // One lookup: the record is read and changed through its slot.
        let slot = self.requests.slot(&request).ok_or(CommitError::UnknownRequest(request))?;
        let record = self.requests.at(slot);
        if record.failed {
            return Err(CommitError::RequestFailed(request));
        }
        if record.pending_tickets > 0 {
            return Err(CommitError::TicketPending(request));
        }
        let blocks = computed_tokens / self.config.block_tokens as usize;
        if blocks > record.table.len() {
            return Err(CommitError::NotAllocated { blocks, allocated: record.table.len() });
        }
        if blocks > hashes.len() {
            return Err(CommitError::MissingHashes { blocks, given: hashes.len() });
        }
        let start = record.path.len();
        if blocks <= start {
            return Ok(Committed::default());
        }
        // A chained hash names its whole prefix: checking the last held block checks them all.
        if let Some(&last) = record.path.last() {
            if self.tree.node(last).hash() != hashes[start - 1] {
                return Err(CommitError::PrefixMismatch { block: start - 1 });
            }
        }

        // A new node has one hit: selective write-through with a threshold of 1 backs it up at once.
        let back_up = self.host_enabled()
            && match self.config.write_policy {
                WritePolicy::WriteBack => false,
                WritePolicy::WriteThrough => true,
                WritePolicy::WriteThroughSelective { threshold } => threshold <= 1,
            };
        let CacheManager { requests, tree, pending_backups, .. } = self;
        let record = requests.at_mut(slot);
        let mut parent = record.path.last().copied().unwrap_or(NodeId::ROOT);
        let mut done = Committed::default();
        let new_hashes = &hashes[start..blocks];
        let new_blocks = &record.table[start..blocks];
        for (index, (&hash, &block)) in new_hashes.iter().zip(new_blocks).enumerate() {
            let parent_valid = parent == NodeId::ROOT
                || matches!(
                    tree.node(parent).state(),
                    NodeState::Device | NodeState::SwapToHost(SwapOut::Backup)
                );
            let id = match tree.child(parent, hash) {
                None if parent_valid => {
                    // Step 1, and every block after it is new too: a node just inserted has no
                    // children. The rest is inserted as one chain.
                    let (chain, chain_blocks) = (&new_hashes[index..], &new_blocks[index..]);
                    let path_start = record.path.len();
                    let init = move |at: usize, node: &mut NodeMut<'_>| {
                        node.set_device(Some(chain_blocks[at]));
                        node.hold();
                        node.access(Access::Commit);
                        node.set_backup_queued(back_up);
                    };
                    tree.insert_chain(parent, chain, init, &mut record.path);
                    done.inserted += chain.len();
                    if back_up {
                        pending_backups.extend_from_slice(&record.path[path_start..]);
                    }
                    break;
                }
                None => break,
                Some(existing) => match tree.node(existing).state() {
                    NodeState::Device | NodeState::SwapToHost(SwapOut::Backup | SwapOut::Evict) => {
                        tree.update(existing, |node| {
                            node.hold();
                            node.access(Access::Commit);
                            if node.node().state() == NodeState::SwapToHost(SwapOut::Evict) {
                                node.set_state(NodeState::SwapToHost(SwapOut::Backup));
                            }
                        });
                        record.private.push(block);
                        done.duplicates += 1;
                        existing
                    }
                    NodeState::Host | NodeState::Storage if parent_valid => {
                        tree.update(existing, |node| {
                            node.set_device(Some(block));
                            node.set_state(NodeState::Device);
                            node.hold();
                            node.access(Access::Commit);
                        });
                        done.duplicates += 1;
                        existing
                    }
                    _ => break,
                },
            };
            record.path.push(id);
            parent = id;
        }
        if !self.unloadable.is_empty() {
            self.uncount_lost_copies(request, start);
        }
        if !self.orphans.is_empty() {
            // Blocks a restarted service found on storage whose parent was not cached: they hang
            // under it now (see `adopt_stored_blocks`).
            let path = self.requests[&request].path[start..].to_vec();
            for id in path {
                self.adopt_orphans_under(id);
            }
        }
        self.stats.committed_blocks += done.inserted as u64;
        self.stats.duplicate_blocks += done.duplicates as u64;
        Ok(done)
    }
}
