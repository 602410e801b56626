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
//!    forgotten (the tiers are exclusive, as one cache of their combined size: the block is
//!    written back again if it leaves the host tier later);
//! 3. when it fails (a block missing or damaged on some rank, or the tier failing), every node
//!    of the LOAD is `Storage` again, its blocks are freed, its pair leaves the unissued swap-in,
//!    and the ticket fails: the request must be aborted, as for a failed swap-in.

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

    /// Counts one more block on the storage tier, first dropping the least recently used
    /// storage candidate when the tier is full. False when it is full and nothing can go.
    pub(super) fn reserve_storage_block(&mut self) -> bool {
        if self.storage_used >= self.config.storage_blocks {
            let Some(victim) = self.tree.first_storage_candidate() else { return false };
            self.drop_leaf(victim);
            self.stats.evictions.storage_dropped += 1;
        }
        self.storage_used += 1;
        true
    }

    /// The name the storage tier keeps node `id` under: hash, parent hash (0 under the root),
    /// depth. O(depth).
    fn storage_block(&self, id: NodeId) -> StorageBlock {
        let node = self.tree.node(id);
        let parent = match node.parent() {
            Some(parent) if parent != NodeId::ROOT => self.tree.node(parent).hash(),
            _ => BlockHash(0),
        };
        StorageBlock { hash: node.hash(), parent, depth: self.tree.depth(id) }
    }

    /// Starts writing `host_block`, node `id`'s host copy, to a reserved storage block (module
    /// flow, write step 2), within the current operation's STORE.
    pub(super) fn start_store(
        &mut self,
        id: NodeId,
        host_block: u32,
        mode: StoreOut,
    ) -> TransferId {
        let block = self.storage_block(id);
        let (transfer, flight) = self.open_transfer(TransferKind::HostToStorage);
        flight.pairs.push(BlockPair::new(host_block, host_block));
        flight.blocks.push(block);
        flight.nodes.push(id);
        self.stats.store_blocks_issued += 1;
        self.tree.update(id, |node| {
            if mode == StoreOut::Evict {
                node.set_host(None);
            }
            node.set_state(NodeState::HostToStorage(mode));
            node.set_transfer(Some(transfer.0));
        });
        transfer
    }

    /// Makes the open copy `transfer` wait for `store`, the STORE still reading a host block it
    /// writes.
    pub(super) fn order_after_store(&mut self, transfer: TransferId, store: Option<TransferId>) {
        let Some(store) = store else { return };
        let flight = self.flight_mut(transfer).expect("ordering a copy that is open");
        if !flight.after.contains(&store) {
            flight.after.push(store);
        }
    }

    /// Starts loading storage node `id` into `host_block`, and its swap-in from there into
    /// `device_block` behind the load (module flow, read step 1), within the current operation's
    /// LOAD and swap-in. Returns (LOAD, swap-in).
    pub(super) fn start_load(
        &mut self,
        id: NodeId,
        (host_block, store): (u32, Option<TransferId>),
        device_block: u32,
    ) -> (TransferId, TransferId) {
        let block = self.storage_block(id);
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
    /// the tier has room.
    pub(super) fn issue_stores(&mut self) {
        let mut queue = std::mem::take(&mut self.pending_stores);
        for &id in &queue {
            if !self.tree.is_live(id) {
                continue;
            }
            let node = self.tree.node(id);
            if node.state() != NodeState::Host || node.stored() || node.ref_count() > 0 {
                continue;
            }
            let host = node.host().expect("a host node has a host block");
            if !self.reserve_storage_block() {
                break;
            }
            self.start_store(id, host, StoreOut::Backup);
        }
        queue.clear();
        queue.append(&mut self.pending_stores);
        self.pending_stores = queue;
    }

    /// Queues node `id`, just settled on host, for a write-through STORE.
    pub(super) fn settled_on_host(&mut self, id: NodeId) {
        if self.storage_enabled()
            && self.config.storage_write_policy == super::StorageWritePolicy::WriteThrough
            && !self.tree.node(id).stored()
        {
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
            // (unheld: a match stops at a node being stored).
            self.drop_subtree(id);
        }
    }

    /// Applies a LOAD's outcome to node `id`, attached to it (module flow, read steps 2 and 3).
    /// `swap_in` is the copy behind the LOAD, unissued until the LOAD completes.
    pub(super) fn load_completed(&mut self, id: NodeId, swap_in: TransferId, landed: bool) {
        if landed {
            self.stats.loaded_blocks += 1;
            self.storage_used -= 1;
            self.tree.update(id, |node| {
                node.set_state(NodeState::SwapToDevice);
                node.set_transfer(Some(swap_in.0));
                node.set_stored(false);
            });
            return;
        }
        self.stats.load_failed_blocks += 1;
        self.back_to_storage(id, swap_in, None);
    }

    /// Takes node `id`, loading, back to `Storage` while its LOAD is still in flight: a swap-in
    /// above it failed, so device residency must end above it. The LOAD keeps writing the host
    /// block, so the block stays reserved by it until it completes; the node is detached.
    pub(super) fn abandon_load(&mut self, id: NodeId) {
        let load =
            TransferId(self.tree.node(id).transfer().expect("a node in flight names its copy"));
        let swap_in = self
            .flight_mut(load)
            .and_then(|flight| flight.then)
            .expect("a load names the swap-in behind it");
        self.back_to_storage(id, swap_in, Some(load));
    }

    /// Node `id` (loading) is `Storage` again: its pair leaves the unissued `swap_in` behind the
    /// LOAD, its device block goes back, and its host block too, or to the LOAD `still_writing`
    /// it.
    fn back_to_storage(
        &mut self,
        id: NodeId,
        swap_in: TransferId,
        still_writing: Option<TransferId>,
    ) {
        let node = self.tree.node(id);
        let (host, device) = (
            node.host().expect("a load has its destination"),
            node.device().expect("a load has its swap-in's destination"),
        );
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
        let after = flight.after.clone();
        if flight.pairs.is_empty() {
            let flight = self.in_flight.remove(&swap_in).expect("found just above");
            self.resolve_tickets(&flight.tickets, None);
            self.recycle_flight(flight);
        }
        match still_writing {
            Some(load) => {
                self.flight_mut(load).expect("the load is in flight").reserved_host.push(host)
            }
            None => self.free_host(host),
        }
        // The device block may have been claimed from a swap-out still reading it.
        self.release_swap_in_destination(&after, device);
        self.tree.update(id, |node| {
            node.set_host(None);
            node.set_device(None);
            node.set_state(NodeState::Storage);
            node.set_transfer(None);
        });
    }
}
