//! The storage tier below host: writes (STORE), reads (LOAD) and the room the tier has.
//!
//! The tier holds blocks by hash, so the manager keeps no pool for it: it counts the blocks the
//! tier holds or is being written (`storage_used`: nodes with their `stored` flag, and nodes in
//! `HostToStorage`) against `storage_blocks`, and drops storage-only leaves, least recently used
//! first, to make room. Only the workers touch block bytes.
//!
//! A write (STORE), issued by a host eviction (write-back) or by `poll` (write-through):
//! 1. a storage block is reserved ([`CacheManager::reserve_storage_block`]);
//! 2. the node becomes `HostToStorage(evict)`, its host block claimed by whoever needed it (a
//!    copy into that block is ordered after the STORE), or `HostToStorage(backup)`, keeping it;
//! 3. when the STORE lands the node is `Storage` (or `Host` again) with its `stored` flag; when
//!    it fails the reservation is given back, and an evicted node, left with no copy, leaves the
//!    tree with the storage-only nodes below it.
//!
//! A read (LOAD), issued by `allocate` for a storage hit:
//! 1. the node gets a host block and a device block and becomes `StorageToHost`; the LOAD
//!    writes the host block, and a swap-in (held back until the LOAD lands) copies it on to the
//!    device block, both in the allocation's ticket;
//! 2. when the LOAD lands the node is `SwapToDevice` under that swap-in, and the tier's copy is
//!    no longer counted (no FORGET: a disk slab keeps it, so that the block's next write-back
//!    writes nothing; it is forgotten if the node leaves the tree); when the swap-in lands the host block is freed too (the tiers are exclusive, as
//!    one cache of their combined size: the block is written back to host, then storage, when
//!    it leaves the device; a host backup kept instead would pin host blocks under every loaded
//!    prefix);
//! 3. a block that misses (missing or damaged on some rank, or the tier failing) is a miss for
//!    that block and those below it, never a failure of the request: the hits of the requests
//!    waiting are shortened there ([`super::load_outcome`]). A LOAD of blocks below a block
//!    another LOAD brings is ordered after that one (so that storage-only nodes keep
//!    storage-only children), and is cancelled with it, unissued, when that block misses.
//!
//! A prefetch LOAD ([`super::prefetch`]) has no swap-in behind it: its nodes land on host and keep
//! their storage copy; an allocation that meets one of them gives it a swap-in ordered after the
//! LOAD (`swap_in_behind` finds it). A node whose swap-in above failed while it was still loading
//! goes back to `Storage` with its LOAD running (`abandon_load`), and so do the prefetch nodes
//! loading below it (detached: their LOAD keeps their host blocks until it completes), so that
//! nothing lands on host under a storage-only parent. Blocks the tree drops are told to the tier
//! ([`super::forget`]).

use super::transfer::StorageBlock;
use super::{CacheManager, TransferId, TransferKind};
use crate::hash::BlockHash;
use crate::tree::{NodeId, NodeState, StoreOut};
use kvshm_ipc::record::BlockPair;

impl CacheManager {
    pub(super) fn storage_enabled(&self) -> bool {
        self.config.storage_blocks > 0
    }

    /// Blocks the storage tier holds or is being written.
    pub fn storage_used_blocks(&self) -> u32 {
        self.storage_used
    }

    /// Counts one more block on the storage tier, first evicting its first candidate when the
    /// tier is full ([`CacheManager::make_storage_room`]). False when it is full and nothing can
    /// go.
    pub(super) fn reserve_storage_block(&mut self) -> bool {
        if !self.make_storage_room() {
            return false;
        }
        self.storage_used += 1;
        true
    }

    /// The name the storage tier keeps node `id` under: hash, parent hash (0 under the root),
    /// and `depth` (0 for a prompt's first block), which the caller knows.
    fn storage_block(&self, id: NodeId, depth: u32) -> StorageBlock {
        let node = self.tree.node(id);
        let parent = match node.parent() {
            Some(parent) if parent != NodeId::ROOT => self.tree.node(parent).hash(),
            _ => BlockHash(0),
        };
        debug_assert_eq!(depth + 1, self.tree.depth(id), "the depth a caller passes is the node's");
        StorageBlock { hash: node.hash(), parent, depth }
    }

    /// The depth of node `id`, about to be stored: from the block the current STORE took last
    /// when it is `id`'s child or parent (write-backs go leaf first, so a chain costs O(1) per
    /// block), else by walking to the root.
    fn depth_for_store(&self, id: NodeId) -> u32 {
        let parent = self.tree.node(id).parent();
        if let Some((_, flight)) = &self.open_host_to_storage {
            if let (Some(&last), Some(block)) = (flight.nodes.last(), flight.blocks.last()) {
                if self.tree.is_live(last) {
                    if self.tree.node(last).parent() == Some(id) {
                        return block.depth - 1;
                    }
                    if parent == Some(last) {
                        return block.depth + 1;
                    }
                }
            }
        }
        self.tree.depth(id) - 1
    }

    /// Starts writing `host_block`, node `id`'s host copy, to a reserved storage block (module
    /// flow, write step 2), within the current operation's STORE.
    pub(super) fn start_store(
        &mut self,
        id: NodeId,
        host_block: u32,
        mode: StoreOut,
    ) -> TransferId {
        let transfer = self.open_store(id, host_block);
        self.tree.update(id, |node| {
            if mode == StoreOut::Evict {
                node.set_host(None);
            }
            node.set_state(NodeState::HostToStorage(mode));
            node.set_transfer(Some(transfer.0));
        });
        transfer
    }

    /// Adds the pair of node `id` (its host block `host_block`, named by the node's storage
    /// name) to the current operation's STORE.
    fn open_store(&mut self, id: NodeId, host_block: u32) -> TransferId {
        let block = self.storage_block(id, self.depth_for_store(id));
        self.counted_on_storage(block.hash);
        let (transfer, flight) = self.open_transfer(TransferKind::HostToStorage);
        flight.pairs.push(BlockPair::new(host_block, host_block));
        flight.blocks.push(block);
        flight.nodes.push(id);
        self.stats.store_blocks_issued += 1;
        transfer
    }

    /// Makes the open copy `transfer` wait for `store`, the STORE still reading a host block it
    /// writes.
    #[inline]
    pub(super) fn order_after_store(&mut self, transfer: TransferId, store: Option<TransferId>) {
        let Some(store) = store else { return };
        let flight = self.flight_mut(transfer).expect("ordering a copy that is open");
        if !flight.after.contains(&store) {
            flight.after.push(store);
        }
    }

    /// Starts loading storage node `id`, at `depth` in its prompt (0 first), into `host_block`,
    /// and its swap-in from there into `device_block` behind the load (module flow, read step
    /// 1), within the current operation's LOAD and swap-in. Returns (LOAD, swap-in).
    pub(super) fn start_load(
        &mut self,
        id: NodeId,
        (host_block, store): (u32, Option<TransferId>),
        device_block: u32,
        depth: u32,
    ) -> (TransferId, TransferId) {
        let block = self.storage_block(id, depth);
        let (swap_in, flight) = self.open_transfer(TransferKind::HostToDevice);
        flight.pairs.push(BlockPair::new(host_block, device_block));
        flight.nodes.push(id);
        let (load, flight) = self.open_transfer(TransferKind::StorageToHost);
        flight.pairs.push(BlockPair::new(host_block, host_block));
        flight.blocks.push(block);
        flight.nodes.push(id);
        flight.then = Some(swap_in);
        self.order_after_store(load, store);
        self.stats.load_blocks_issued += 1;
        self.tree.update(id, |node| {
            node.set_host(Some(host_block));
            node.set_device(Some(device_block));
            node.set_state(NodeState::StorageToHost);
            node.set_transfer(Some(load.0));
        });
        (load, swap_in)
    }

    /// Write-through: issues the queued STOREs of nodes settled on host (module flow), as far as
    /// the tier has free room and is up; the others are skipped (counted) and written back when
    /// they leave the host tier.
    pub(super) fn issue_stores(&mut self) {
        let mut queue = std::mem::take(&mut self.pending_stores);
        let tier_down = self.tier.is_down();
        for &id in &queue {
            if !self.tree.is_live(id) {
                continue;
            }
            let node = self.tree.node(id);
            if node.state() != NodeState::Host || node.stored() || node.ref_count() > 0 {
                continue;
            }
            let host = node.host().expect("a host node has a host block");
            if tier_down {
                // Written back when it leaves host, if the tier is up by then (`tier_health`).
                self.stats.storage_down_skipped_stores += 1;
                continue;
            }
            // A backup takes free room only: dropping a storage-only block (its only copy) to
            // back up a block the host tier still holds would lose a block for nothing. It is
            // written back when it leaves the host tier instead.
            if self.storage_used >= self.config.storage_blocks {
                self.stats.write_through_skipped += 1;
                continue;
            }
            self.storage_used += 1;
            self.start_store(id, host, StoreOut::Backup);
        }
        queue.clear();
        queue.append(&mut self.pending_stores);
        self.pending_stores = queue;
    }

    /// Queues node `id`, just settled on host, for a write-through STORE (every such node, or
    /// under the selective policy those with enough hits).
    #[inline]
    pub(super) fn settled_on_host(&mut self, id: NodeId) {
        if !self.storage_enabled() {
            return;
        }
        let node = self.tree.node(id);
        if self.config.storage_write_policy.writes_through(node.hit_count()) && !node.stored() {
            self.pending_stores.push(id);
        }
    }

    /// Applies a STORE's outcome to node `id`, attached to it (module flow, write step 3).
    pub(super) fn store_completed(&mut self, id: NodeId, landed: bool) {
        let NodeState::HostToStorage(mode) = self.tree.node(id).state() else {
            unreachable!("a node attached to a STORE is being stored")
        };
        if landed {
            self.stats.stored_blocks += 1;
        } else {
            self.stats.store_failed_blocks += 1;
            self.storage_used -= 1;
            // Some rank may have stored it: the tier must not keep what the tree does not count.
            self.forget_now(self.tree.node(id).hash());
        }
        let state = match mode {
            StoreOut::Backup => NodeState::Host,
            StoreOut::Evict => NodeState::Storage,
        };
        self.tree.update(id, |node| {
            node.set_state(state);
            node.set_transfer(None);
            node.set_stored(landed);
        });
        if !landed && mode == StoreOut::Evict {
            // No copy left anywhere: the node leaves, with the storage-only nodes below it
            // (unheld: a match stops at a node being stored). With the tier down (this STORE may
            // have tripped the breaker), those the tier holds intact wait as orphans instead, as
            // below a host victim dropped while it is down (`tier_health`).
            if self.tier.is_down() {
                self.orphan_stored_children(id);
            }
            self.drop_subtree(id);
        }
    }

    /// LOAD node `id`, attached to it, landed (module flow, read step 2). `swap_in` is the copy
    /// behind the LOAD, unissued until the LOAD completes; `None` for a prefetch LOAD no
    /// allocation shared (the node lands on host and keeps its storage copy).
    pub(super) fn load_landed(&mut self, id: NodeId, swap_in: Option<TransferId>) {
        self.stats.loaded_blocks += 1;
        let Some(swap_in) = swap_in else {
            self.tree.update(id, |node| {
                node.set_state(NodeState::Host);
                node.set_transfer(None);
            });
            return;
        };
        self.storage_used -= 1;
        self.tree.update(id, |node| {
            node.set_state(NodeState::SwapToDevice);
            node.set_transfer(Some(swap_in.0));
            node.set_stored(false);
            node.set_passing_through_host(true);
        });
    }

    /// Drops the storage-only nodes whose LOAD failed, with the storage-only nodes below them,
    /// once no request holds them (`poll`); those still held wait.
    pub(super) fn drop_unloadable(&mut self) {
        let mut waiting = std::mem::take(&mut self.unloadable);
        waiting.retain(|&(id, hash)| {
            // An id whose node went (and was perhaps reused) is done with.
            if !self.tree.is_live(id) || self.tree.node(id).hash() != hash {
                return false;
            }
            let node = self.tree.node(id);
            if node.state() != NodeState::Storage {
                return false;
            }
            if node.ref_count() > 0 {
                return true;
            }
            // A tier's loss, not an eviction: counted apart, per block.
            let before = self.tree.len();
            self.drop_subtree(id);
            self.stats.lost_blocks_dropped += (before - self.tree.len()) as u64;
            false
        });
        waiting.append(&mut self.unloadable);
        self.unloadable = waiting;
    }

    /// Gives back `block`, the host block of a LOAD that never ran and waited on the copies
    /// `after`: to the STORE still reading it if it was claimed from one, else to the pool.
    pub(super) fn release_host_block(&mut self, after: &[TransferId], block: u32) {
        let reader = after.iter().copied().find(|before| {
            self.in_flight.get(before).is_some_and(|flight| {
                flight.kind == TransferKind::HostToStorage
                    && flight.pairs.iter().any(|pair| pair.src == block)
            })
        });
        match reader {
            Some(reader) => {
                self.in_flight.get_mut(&reader).expect("found just above").reserved_host.push(block)
            }
            None => self.free_host(block),
        }
    }

    /// Takes node `id`, loading, back to `Storage` while its LOAD is still in flight: a swap-in
    /// above it failed, so device residency must end above it. The LOAD keeps writing the host
    /// block, so the block stays reserved by it until it completes; the node is detached.
    pub(super) fn abandon_load(&mut self, id: NodeId) {
        let load =
            TransferId(self.tree.node(id).transfer().expect("a node in flight names its copy"));
        let then = self.flight(load).and_then(|flight| flight.then);
        let swap_in = self
            .swap_in_behind(load, then, id)
            .expect("a node with a device block being loaded has a swap-in behind it");
        self.back_to_storage(id, swap_in, Some(load), &[]);
        self.detach_prefetch_loads_below(id);
    }

    /// Node `id` just went back to `Storage` with its LOAD still running: the nodes below it
    /// that a prefetch is loading with no swap-in behind them (no device block: those with one
    /// are taken back by the caller's walk) would land on host under a storage-only parent, so
    /// they are `Storage` again now (they keep their storage copy), detached from their LOAD,
    /// which keeps their host blocks reserved until it completes or is cancelled.
    fn detach_prefetch_loads_below(&mut self, id: NodeId) {
        let mut below: Vec<NodeId> = self.tree.children(id).collect();
        while let Some(node_id) = below.pop() {
            let node = self.tree.node(node_id);
            if node.state() != NodeState::StorageToHost || node.device().is_some() {
                continue;
            }
            let load = TransferId(node.transfer().expect("a node in flight names its copy"));
            let host = node.host().expect("a load has its destination");
            self.flight_mut(load).expect("the load is in flight").reserved_host.push(host);
            self.prefetch_back_to_storage(node_id);
            below.extend(self.tree.children(node_id));
        }
    }

    /// Node `id` (loading) is `Storage` again: its pair leaves the unissued `swap_in` behind the
    /// LOAD and its device block goes back; its host block goes to the LOAD `still_writing` it,
    /// or, with none, is the caller's to give back. A swap-in left with no pairs is forgotten
    /// (`load_after`: the copies the LOAD in front of it waited on, see
    /// [`CacheManager::forget_empty_swap_in`]).
    pub(super) fn back_to_storage(
        &mut self,
        id: NodeId,
        swap_in: TransferId,
        still_writing: Option<TransferId>,
        load_after: &[TransferId],
    ) {
        let node = self.tree.node(id);
        // No device block: a request shortened at this node took it (see `load_outcome`).
        let (host, device) = (node.host().expect("a load has its destination"), node.device());
        let flight =
            self.in_flight.get_mut(&swap_in).expect("the swap-in behind a load is in flight");
        assert!(!flight.issued, "a swap-in behind a load in flight was issued");
        let index = flight
            .nodes
            .iter()
            .position(|&node| node == id)
            .expect("the swap-in behind a load serves its nodes");
        flight.nodes.swap_remove(index);
        flight.pairs.swap_remove(index);
        let (after, empty) = (flight.after.clone(), flight.pairs.is_empty());
        if empty {
            self.forget_empty_swap_in(swap_in, load_after);
        }
        if let Some(load) = still_writing {
            self.flight_mut(load).expect("the load is in flight").reserved_host.push(host);
        }
        // The device block may have been claimed from a swap-out still reading it.
        if let Some(device) = device {
            self.release_swap_in_destination(&after, device);
        }
        self.tree.update(id, |node| {
            node.set_host(None);
            node.set_device(None);
            node.set_state(NodeState::Storage);
            node.set_transfer(None);
        });
    }

    /// Keeps stored block `hash` (at storage depth `depth`) as an orphan waiting for block
    /// `parent` to be cached: it joins the tree under it then (`adopt_orphans_under`), or expires
    /// once as many blocks as the tier holds were committed from now without it (`forget`).
    /// Callers check the orphans' cap (the tier's capacity) first.
    pub(super) fn keep_orphan(&mut self, parent: BlockHash, hash: BlockHash, depth: u32) {
        self.orphans.entry(parent).or_default().push((hash, depth));
        self.orphan_count += 1;
        self.orphans_expire_at =
            self.stats.committed_blocks + u64::from(self.config.storage_blocks);
    }

    /// Puts blocks the storage tier already holds into the tree as storage-only nodes (a
    /// restarted service finding its disk blocks): `blocks` as (hash, parent hash, depth from 0),
    /// parents before children. A first block (depth 0, parent 0) hangs under the root, a block
    /// whose parent is cached (named before it, or in the tree already) under its parent (if
    /// that parent may have storage-only children);
    /// a block whose parent is not cached waits, and joins the tree when its parent does
    /// (a prompt's first blocks are usually hot and never reach storage), or is given up once
    /// as many blocks as the tier holds were committed without its parent. Blocks already cached
    /// (found under their parent: the root, or a block of `blocks` before them) are left alone;
    /// those beyond the tier's capacity are skipped and forgotten (a disk slab frees them).
    /// Returns how many joined the tree now.
    pub fn adopt_stored_blocks(
        &mut self,
        blocks: impl IntoIterator<Item = (BlockHash, BlockHash, u32)>,
    ) -> usize {
        let mut by_hash: std::collections::HashMap<BlockHash, NodeId> =
            std::collections::HashMap::new();
        // Every cached node by hash, made once a block's parent is not among the blocks before
        // it (a listing that leaves hot parents out, or names cached blocks again).
        let mut cached_by_hash: Option<std::collections::HashMap<BlockHash, NodeId>> = None;
        let mut adopted = 0;
        // Adopted here, in order: the orphans waiting for them join after the listing's blocks.
        let mut new_nodes = Vec::new();
        let capacity = self.config.storage_blocks as usize;
        for (hash, parent, depth) in blocks {
            let parent_id = if depth == 0 && parent == BlockHash(0) {
                Some(NodeId::ROOT)
            } else if let Some(&id) = by_hash.get(&parent) {
                Some(id)
            } else {
                let tree = &self.tree;
                let cached = cached_by_hash.get_or_insert_with(|| {
                    let nodes = tree.ids().filter(|&id| id != NodeId::ROOT);
                    nodes.map(|id| (tree.node(id).hash(), id)).collect()
                });
                cached.get(&parent).copied()
            }
            .filter(|&id| self.tree.is_live(id));
            let full = self.storage_used as usize >= capacity;
            let Some(parent_id) = parent_id else {
                // Orphans do not count against the capacity (they may never join), but there
                // are never more of them than the tier holds, and they expire (`forget`).
                if full || self.orphan_count >= capacity {
                    self.forget_now(hash);
                    continue;
                }
                self.keep_orphan(parent, hash, depth);
                continue;
            };
            if let Some(cached) = self.tree.child(parent_id, hash) {
                // Cached already: left alone, and its children in `blocks` are looked for under
                // it. A copy on the tier the tree does not count (the node not stored, no STORE
                // of it in flight) is forgotten when the tier is full, as any block past its
                // capacity is.
                let node = self.tree.node(cached);
                if full && !node.stored() && !matches!(node.state(), NodeState::HostToStorage(_)) {
                    self.forget_now(hash);
                }
                by_hash.insert(hash, cached);
                continue;
            }
            if full {
                // Beyond the tier's capacity: the scheduler will never count it, so the tier
                // must not keep it either (a disk slab frees it; a shared tier keeps it).
                self.forget_now(hash);
                continue;
            }
            if let Some(id) = self.adopt_or_forget(parent_id, hash) {
                by_hash.insert(hash, id);
                adopted += 1;
                new_nodes.push(id);
            }
        }
        for id in new_nodes {
            adopted += self.adopt_orphans_under(id);
        }
        adopted
    }

    /// Blocks of the storage tier waiting for their parent to be cached (see
    /// [`CacheManager::adopt_stored_blocks`]).
    pub fn storage_blocks_waiting_for_parent(&self) -> usize {
        self.orphan_count
    }

    /// Inserts storage-only node `hash` under `parent`, if it is not there, there is room, and
    /// `parent` may have storage-only children (the root, or a node that is not storage-only).
    /// The blocks waiting for it as their parent are the caller's to adopt
    /// ([`CacheManager::adopt_orphans_under`]).
    pub(super) fn adopt_one(&mut self, parent: NodeId, hash: BlockHash) -> Option<NodeId> {
        // Any node may have storage-only children but one whose write-back is in flight (it
        // may fail and leave the tree).
        let parent_ok = parent == NodeId::ROOT
            || self.tree.node(parent).state() != NodeState::HostToStorage(StoreOut::Evict);
        if !parent_ok
            || self.storage_used >= self.config.storage_blocks
            || self.tree.child(parent, hash).is_some()
        {
            return None;
        }
        self.counted_on_storage(hash);
        let id = self.tree.insert(parent, hash, |node| {
            node.set_state(NodeState::Storage);
            node.set_stored(true);
        });
        self.storage_used += 1;
        self.stop_waiting(parent, hash);
        Some(id)
    }

    /// Block `hash` joined the tree under `parent`: if it waited as an orphan (a QUERY, or a
    /// later listing, found its parent), it waits no more, and never expires (`forget`) while
    /// the tree counts it.
    fn stop_waiting(&mut self, parent: NodeId, hash: BlockHash) {
        if self.orphans.is_empty() {
            return;
        }
        let parent_hash = self.tree.node(parent).hash();
        let Some(waiting) = self.orphans.get_mut(&parent_hash) else { return };
        let before = waiting.len();
        waiting.retain(|&(orphan, _)| orphan != hash);
        self.orphan_count -= before - waiting.len();
        if waiting.is_empty() {
            self.orphans.remove(&parent_hash);
        }
    }

    /// As [`CacheManager::adopt_one`] for a block the tier holds; one that cannot join (no room,
    /// or a parent that may not have storage-only children) is forgotten, since the tree will
    /// not count it (one already cached is left alone).
    fn adopt_or_forget(&mut self, parent: NodeId, hash: BlockHash) -> Option<NodeId> {
        let adopted = self.adopt_one(parent, hash);
        if adopted.is_none() && self.tree.child(parent, hash).is_none() {
            self.forget_now(hash);
        }
        adopted
    }

    /// Node `id` just joined the tree (committed, or adopted from the tier: a QUERY, a listing):
    /// the stored blocks waiting for it as their parent join the tree under it, and theirs under
    /// them (those that cannot are forgotten). Every way into the tree calls it, once the blocks
    /// it brings in themselves have joined (so that none of them is forgotten here for room).
    /// Returns how many joined.
    pub(super) fn adopt_orphans_under(&mut self, id: NodeId) -> usize {
        if self.orphans.is_empty() {
            return 0;
        }
        let (mut stack, mut adopted) = (vec![id], 0);
        while let Some(parent) = stack.pop() {
            let hash = self.tree.node(parent).hash();
            let Some(children) = self.orphans.remove(&hash) else { continue };
            self.orphan_count -= children.len();
            for (child, _depth) in children {
                if let Some(child) = self.adopt_or_forget(parent, child) {
                    stack.push(child);
                    adopted += 1;
                }
            }
        }
        adopted
    }
}
