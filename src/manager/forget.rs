//! Telling the storage tier which blocks the tree dropped (FORGET, DESIGN §9), and giving up
//! stored blocks whose parent never came back.
//!
//! The tier's own room must follow the scheduler's count: a disk slab that keeps blocks the tree
//! dropped fills with them, and its own LRU then drops blocks the tree still counts, which a later
//! LOAD misses. So every block that leaves the tree while the tier may hold it is queued here:
//! 1. a node dropped from the tree (`drop_leaf`: a capacity drop, a failed LOAD, an eviction
//!    with no room below, a failed write-back's subtree) is queued at once, unless its STORE or
//!    LOAD is still in flight: then it is queued when that copy completes, detached, so that
//!    the FORGET follows the STORE in each rank's ring, and not at all if a node of the same
//!    block was stored or adopted meanwhile (the tier's copy is counted again);
//! 2. a STORE that failed (on some rank: the others may hold the block) is queued;
//! 3. a reset queues every block of the tree and of the storage copies in flight;
//! 4. stored blocks beyond the tier's capacity at adoption (or when their parent arrives), and
//!    orphans that expire, are queued;
//! 5. the service takes the queue ([`CacheManager::take_forgotten_blocks`]) before it issues
//!    the copies of the same step, and sends FORGET commands to every rank (a rank without a
//!    worker gets them once it has one; a failed FORGET is sent once more: `storage_meta`).
//!
//! A back-end that owns its room (disk) frees each block; a shared one (Redis) keeps it, since
//! another service may count it.

use std::collections::HashSet;

use super::{CacheManager, TransferKind};
use crate::hash::BlockHash;
use crate::tree::NodeState;

impl CacheManager {
    /// Hands out (appending to `out`) the hashes of blocks the tree dropped that the storage tier
    /// may hold (module flow), oldest first. Empty without a storage tier.
    pub fn take_forgotten_blocks(&mut self, out: &mut Vec<BlockHash>) {
        out.append(&mut self.forgotten);
    }

    /// Keeps of `hashes` (blocks a FORGET is to be sent again for: it failed, or was never
    /// sent) those the tier may drop: not the ones a node is counted on storage with now, or
    /// whose STORE is in flight. A STORE of the block issued after the first FORGET would
    /// otherwise be freed by the second, behind it in the ring. Scans the tree: for the rare
    /// FORGET sent again.
    pub fn keep_forgettable(&self, hashes: &mut Vec<BlockHash>) {
        if hashes.is_empty() {
            return;
        }
        let asked: HashSet<BlockHash> = hashes.iter().copied().collect();
        let tree = &self.tree;
        let counted = tree
            .ids()
            .map(|id| tree.node(id))
            .filter(|node| node.stored() || matches!(node.state(), NodeState::HostToStorage(_)));
        // A STORE of an older generation counts nothing: the reset forgot its blocks.
        let stores = self.in_flight.values().filter(|flight| {
            flight.kind == TransferKind::HostToStorage && flight.generation == self.generation
        });
        let kept: HashSet<BlockHash> = counted
            .map(|node| node.hash())
            .chain(stores.flat_map(|flight| flight.blocks.iter().map(|block| block.hash)))
            .filter(|hash| asked.contains(hash))
            .collect();
        hashes.retain(|hash| !kept.contains(hash));
    }

    /// Blocks queued for a FORGET and not taken yet.
    pub fn forgotten_blocks_waiting(&self) -> usize {
        self.forgotten.len()
    }

    /// Node `hash`, in `state`, leaves the tree (module flow, step 1).
    pub(super) fn forget_dropped(&mut self, hash: BlockHash, state: NodeState) {
        if matches!(state, NodeState::HostToStorage(_) | NodeState::StorageToHost) {
            self.forget_after_copy.insert(hash);
        } else {
            self.push_forgotten(hash);
        }
    }

    /// A STORE or LOAD completed (or was cancelled) for a block whose node left the tree
    /// meanwhile (module flow, step 1): forgotten now, unless a node of the same block got a
    /// storage copy since (a STORE issued after this copy, or an adoption): the tier's copy is
    /// then counted again.
    pub(super) fn forget_detached(&mut self, hash: BlockHash) {
        if self.forget_after_copy.remove(&hash) {
            self.push_forgotten(hash);
        }
    }

    /// A node of block `hash` gets a storage copy (a STORE, an adoption): a FORGET waiting for
    /// an older copy of the same block is called off.
    #[inline]
    pub(super) fn counted_on_storage(&mut self, hash: BlockHash) {
        if !self.forget_after_copy.is_empty() {
            self.forget_after_copy.remove(&hash);
        }
    }

    /// A block some rank may hold that the tree does not count (a failed STORE, a block beyond
    /// the capacity at adoption): forgotten now (module flow, steps 2 and 4).
    pub(super) fn forget_now(&mut self, hash: BlockHash) {
        if self.storage_enabled() {
            self.push_forgotten(hash);
        }
    }

    fn push_forgotten(&mut self, hash: BlockHash) {
        self.forgotten.push(hash);
        self.prefetch.forgotten(hash);
    }

    /// Before a reset clears the tree (module flow, step 3).
    pub(super) fn forget_everything(&mut self) {
        if !self.storage_enabled() {
            return;
        }
        let tree = &self.tree;
        self.forgotten.extend(tree.ids().map(|id| tree.node(id).hash()));
        for flight in self.in_flight.values().filter(|flight| flight.kind.is_storage()) {
            self.forgotten.extend(flight.blocks.iter().map(|block| block.hash));
        }
        let orphans = std::mem::take(&mut self.orphans);
        self.forgotten.extend(orphans.into_values().flatten().map(|(hash, _)| hash));
        self.orphan_count = 0;
        self.forget_after_copy.clear();
    }

    /// Gives up the stored blocks still waiting for their parent once as many blocks as the tier
    /// holds were committed since they were adopted (module flow, step 4): their parent did not
    /// come back, and they would otherwise slow every commit and hold the tier's room.
    pub(super) fn expire_orphans(&mut self) {
        if self.stats.committed_blocks < self.orphans_expire_at {
            return;
        }
        let orphans = std::mem::take(&mut self.orphans);
        let expired = self.orphan_count;
        for hash in orphans.into_values().flatten().map(|(hash, _)| hash) {
            self.push_forgotten(hash);
        }
        self.orphan_count = 0;
        self.stats.expired_orphans += expired as u64;
    }
}
