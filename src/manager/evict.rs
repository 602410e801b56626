//! Finding device and host blocks when the pools run short (DESIGN §4.3, §4.4).
//!
//! Device blocks come, in this order, from the free pool, from nodes being swapped out whose
//! block no allocation has claimed yet (the claimer's ticket then covers that copy), and from
//! evicting the least recently used device candidate under the write policy:
//! 1. a node with a valid host copy just drops its device copy (metadata only; in an
//!    allocation the parent comes back unfiled when it is the next victim, as in step 3:
//!    [`Tree::drop_device_copy_exposing`]);
//! 2. else, if the policy wants a copy (write-back; write-through for a node whose backup has
//!    not happened; selective for a node hit `threshold` times) and a host block can be had, it
//!    starts a swap-out, and the block becomes claimable at once (an allocation, which would
//!    claim it next, takes it as the swap-out starts, and gets the parent back unfiled when it
//!    is the next victim, as in step 3: [`Tree::start_claimed_swap_out`]);
//! 3. else the node is dropped, with the host-only nodes under it (a match could never reach
//!    them again), and its block is free. When an allocation drops a leaf whose parent becomes
//!    the device candidate the policy gives up next (a chain evicted tail first), the tree hands
//!    the parent back unfiled as the next victim ([`Tree::remove_exposing`]).
//!
//! An allocation takes the device block that steps 1 and 3 free at once, without passing it
//! through the pool (which would hand the same block back: it gives out the block freed last).
//! Without a host tier (so without a storage tier) every eviction is step 3 of a leaf on device
//! alone: an allocation has the tree drop them in one loop ([`Tree::drop_device_leaves`]).
//! With a host tier and no storage tier, an allocation has the tree evict its victims in runs
//! ([`Tree::write_back_run`]): step 1, and step 2 with a host block from the pool or from a
//! host-only leaf, in one loop that hands the pairs to the open swap-out; a victim of any other
//! kind ends the run, goes through the per-victim path below, and the next run goes on.
//!
//! Host blocks come from the free host pool, then from the least recently used host candidate:
//! a backup is dropped; a host-only node the storage tier holds becomes storage-only (metadata
//! only); with a storage tier, any other host-only node is written back: a STORE starts, the node
//! becomes `HostToStorage(evict)` and its host block is claimed at once, the caller's copy into
//! it waiting for the STORE (see [`super::storage`]); without one, a host-only node leaves the
//! tree. In an allocation, when a host-only node leaves the host tier (to storage, or out of
//! the tree) and its host-only parent becomes a host candidate, the parent is handed back
//! unfiled to the next host eviction, which takes it if it comes first and files it otherwise
//! ([`Tree::remove_exposing_host`], [`Tree::update_exposing_host`]).
//!
//! An allocation first counts what it could get without changing anything
//! ([`count_reclaimable`]), so that a shortfall fails with the manager untouched. Every claimable
//! node and every device candidate gives one block, so when there are enough of them the count
//! is O(1); only a shortfall walks the candidates to add the parents their evictions expose,
//! following each cascade as it is found and stopping once there are enough.

use std::mem::MaybeUninit;
use std::ops::ControlFlow;

use super::ids::IdMap;
use super::transfer::{BlockPair, InFlight};
use super::{CacheManager, TransferId, TransferKind, WritePolicy};
use crate::pool::BlockPool;
use crate::tree::policy::EvictSet;
use crate::tree::{
    NodeId, NodeMut, NodeState, RunEnd, StoreOut, SwapOut, Tree, WriteBackRun, WriteBackSink,
};

/// What evicting one device candidate gave.
enum Evicted {
    /// Its device block is back in the pool (an eviction ahead of demand).
    Freed,
    /// The caller, an allocation, took its device block `block` at once: the block changes
    /// owner without passing through the pool (which would hand the same block back, the one
    /// freed last). `exposed`: its parent, left unfiled as the next device candidate (see
    /// [`Tree::remove_exposing`]).
    Taken { block: u32, exposed: Option<NodeId> },
    /// A swap-out started; the node's block is claimable.
    SwappingOut,
    /// A swap-out started and the caller took the node's block at once: `block`, still read by
    /// `transfer`; `exposed` as for `Taken`.
    Claimed { block: u32, transfer: TransferId, exposed: Option<NodeId> },
}

/// The manager's side of an allocation's write-back run ([`Tree::write_back_run`]): the host
/// pool, and slots for what the run gives, one per block it may take, in the spare capacity of
/// the vectors it goes to: the device blocks taken (`obtain_device_blocks`'s `out`) and the
/// pairs and nodes of the swap-out opened for the run ([`spare_slots`]). A write into a slot keeps the
/// slot's address in a register, where a push would reload the vector's header after every
/// write to the tree (which the optimizer cannot tell apart), and growing the vectors by
/// filler values first would cost as much as the pushes.
struct AllocationBlocks<'a> {
    host: &'a mut BlockPool,
    out: Slots<'a, (u32, Option<TransferId>)>,
    /// The open swap-out, its pair slots and node slots.
    swap_out: (TransferId, Slots<'a, BlockPair>, Slots<'a, NodeId>),
}

/// Spare slots at the end of a vector, handed out in order by [`spare_slots`].
type Slots<'a, T> = std::slice::IterMut<'a, MaybeUninit<T>>;

/// The first `count` spare slots of `vec` (reserved now), to write in order and then append
/// with [`append_written`].
fn spare_slots<T>(vec: &mut Vec<T>, count: usize) -> Slots<'_, T> {
    vec.reserve(count);
    vec.spare_capacity_mut()[..count].iter_mut()
}

/// Appends to `vec` the first `written` of its spare slots.
///
/// # Safety
/// Those slots must hold values: written through the slots [`spare_slots`] handed out, each
/// written as it was taken from the iterator (so the first `written` taken are the ones
/// written), and the vector not changed since.
unsafe fn append_written<T>(vec: &mut Vec<T>, written: usize) {
    // SAFETY: the caller's premise: the slots up to `len + written` are initialized, and they
    // are within the capacity `spare_slots` reserved.
    unsafe { vec.set_len(vec.len() + written) };
}

impl WriteBackSink for AllocationBlocks<'_> {
    fn free_host_blocks(&self) -> usize {
        self.host.free_count()
    }

    fn take_free_host_block(&mut self) -> u32 {
        self.host.allocate_one().expect("taking a free block that is there")
    }

    #[inline(always)] // once per write-back, in the run's loop
    fn written_back(&mut self, id: NodeId, device: u32, host: u32) {
        const SLOTS: &str = "a run takes no more blocks than it has slots for";
        let (transfer, pairs, nodes) = &mut self.swap_out;
        pairs.next().expect(SLOTS).write(BlockPair::new(device, host));
        nodes.next().expect(SLOTS).write(id);
        self.out.next().expect(SLOTS).write((device, Some(*transfer)));
    }

    #[inline(always)]
    fn device_copy_dropped(&mut self, device: u32) {
        let slot = self.out.next().expect("a run takes no more blocks than it has slots for");
        slot.write((device, None));
    }
}

impl CacheManager {
    /// How many device blocks beyond the free ones evictions and claims could provide, counted up
    /// to `limit`. Changes nothing.
    pub(super) fn reclaimable_up_to(&mut self, limit: usize) -> usize {
        let (gone, exposed) = &mut self.scratch_reclaim;
        count_reclaimable(&self.tree, gone, exposed, limit)
    }

    /// Takes `count` device blocks, each with the swap-out still reading it when it was claimed.
    ///
    /// # Panics
    /// If fewer can be had: callers check with [`CacheManager::reclaimable_up_to`] first.
    pub(super) fn obtain_device_blocks(
        &mut self,
        count: usize,
        out: &mut Vec<(u32, Option<TransferId>)>,
    ) {
        let from_pool = count.min(self.device.free_count());
        let start = out.len();
        for _ in 0..from_pool {
            out.push((
                self.device.allocate_one().expect("taking free blocks that are there"),
                None,
            ));
        }
        // Claims first: the evictions below start no claimable swap-out (an allocation takes
        // the block of the swap-out it starts at once), so none is left once they begin.
        while out.len() - start < count {
            let Some(id) = self.tree.first_claimable() else { break };
            out.push(self.claim(id));
        }
        // The parents evictions left unfiled (the next device victim, and the host-only parent
        // that is the next host victim if no host candidate comes before it), and the counts.
        let mut run = WriteBackRun::default();
        // Without a storage tier the usual victims go in the tree's write-back run; the others,
        // and every victim with a storage tier (or in a differential test's general manager),
        // one by one below.
        let in_runs = self.host_enabled() && !self.storage_enabled() && !self.general_forms_only();
        let min_hits = match self.config.write_policy {
            WritePolicy::WriteBack | WritePolicy::WriteThrough => 0,
            WritePolicy::WriteThroughSelective { threshold } => threshold,
        };
        // The swap-out the runs' write-backs join, opened now (before the first run, so that one
        // run does the whole allocation) unless open; taken back below if nothing joins it.
        let opened_here =
            in_runs && out.len() - start < count && self.open_device_to_host.is_none();
        if opened_here {
            self.open_transfer(TransferKind::DeviceToHost);
        }
        while out.len() - start < count {
            debug_assert!(
                self.tree.first_claimable().is_none(),
                "an eviction left a claimable node"
            );
            if in_runs {
                let left = count - (out.len() - start);
                let CacheManager { tree, host, open_device_to_host, .. } = self;
                let (id, flight) =
                    open_device_to_host.as_mut().expect("the runs' swap-out is open");
                let InFlight { pairs, nodes, .. } = &mut **flight;
                let swap_out = (*id, spare_slots(pairs, left), spare_slots(nodes, left));
                let mut sink = AllocationBlocks { host, out: spare_slots(out, left), swap_out };
                let end = tree.write_back_run(&mut run, left, min_hits, id.0, &mut sink);
                let taken = left - sink.out.len();
                let written_back = left - sink.swap_out.1.len();
                // SAFETY: the sink wrote each slot it took from its iterators at once (see
                // `AllocationBlocks`): the first `taken` of `out` and the first `written_back`
                // of the swap-out's pairs and of its nodes (one of each per write-back); nothing
                // else touched the vectors since `spare_slots`.
                unsafe {
                    append_written(out, taken);
                    append_written(pairs, written_back);
                    append_written(nodes, written_back);
                }
                if end == RunEnd::Done {
                    break;
                }
            }
            let taken = self.evict_one_for_allocation(&mut run);
            out.push(taken);
        }
        if opened_here {
            self.take_back_if_empty(TransferKind::DeviceToHost);
        }
        let evictions = &mut self.stats.evictions;
        evictions.device_written_back += run.written_back;
        evictions.device_to_host_metadata += run.device_copies_dropped;
        evictions.host_dropped += run.host_dropped;
        if let Some(parent) = run.exposed {
            self.tree.file_exposed(parent, EvictSet::Device);
        }
        // A node the dry run's evictions then dropped (below a dropped device node) is gone.
        if let Some(parent) = run.exposed_host.filter(|&parent| self.tree.is_live(parent)) {
            self.tree.file_exposed(parent, EvictSet::Host);
        }
    }

    /// One eviction of [`CacheManager::obtain_device_blocks`] by the per-victim path: of the
    /// parent the last one left unfiled (in `run`), else of the first device candidate. Returns
    /// its device block, with the swap-out still reading it if it was written back.
    // Out of line: without a storage tier it evicts only the victims a write-back run leaves,
    // and the allocation's hot code stays compact (the run and its loop).
    #[inline(never)]
    fn evict_one_for_allocation(&mut self, run: &mut WriteBackRun) -> (u32, Option<TransferId>) {
        let victim = run.exposed.take().unwrap_or_else(|| {
            self.tree
                .first_device_candidate()
                .expect("evicting past what the dry run counted is a programming error")
        });
        // No node is claimable here, so a swap-out the eviction starts would be the next
        // claim: it takes the block at once.
        match self.evict_device(victim, Some(&mut run.exposed_host)) {
            Evicted::Taken { block, exposed: parent } => {
                run.exposed = parent;
                (block, None)
            }
            Evicted::Claimed { block, transfer, exposed: parent } => {
                run.exposed = parent;
                (block, Some(transfer))
            }
            Evicted::Freed | Evicted::SwappingOut => {
                unreachable!("an allocation's eviction takes the block it frees")
            }
        }
    }

    /// [`CacheManager::obtain_device_blocks`] without a host tier, the blocks appended to
    /// `table`: nothing is claimable and no eviction writes back, so each one drops its victim
    /// ([`CacheManager::evict_device`]'s branch for that, which the order of victims follows).
    /// Without a host tier there is no storage tier either (a configuration with one is
    /// refused), so every cached node is on device alone and a device candidate is a leaf with
    /// nothing but its device block to give up: the tree drops them ([`Tree::drop_device_leaves`]).
    ///
    /// # Panics
    /// If fewer can be had: callers check with [`CacheManager::reclaimable_up_to`] first.
    pub(super) fn obtain_device_blocks_without_host(&mut self, count: usize, table: &mut Vec<u32>) {
        debug_assert!(!self.host_enabled(), "a host tier may write back or claim");
        debug_assert!(!self.storage_enabled(), "a storage tier needs a host tier");
        table.reserve(count);
        let from_pool = count.min(self.device.free_count());
        for _ in 0..from_pool {
            table.push(self.device.allocate_one().expect("taking free blocks that are there"));
        }
        let evicted = count - from_pool;
        if evicted > 0 {
            self.stats.evictions.device_dropped += evicted as u64;
            self.tree.drop_device_leaves(evicted, table);
        }
    }

    /// Evicts device candidates until `target` blocks are free or on their way to free, or no
    /// candidate is left; for the watermark of `poll`.
    #[inline(never)] // off the request path (`poll` inline)
    pub(super) fn evict_toward(&mut self, target: usize) {
        while self.device.free_count() + self.tree.claimable_count() < target {
            let Some(victim) = self.tree.first_device_candidate() else { break };
            self.evict_device(victim, None);
        }
    }

    /// Takes the device block of a node being swapped out, leaving the copy in flight.
    fn claim(&mut self, id: NodeId) -> (u32, Option<TransferId>) {
        let node = self.tree.node(id);
        let block = node.device().expect("a claimable node has its device block");
        let transfer =
            TransferId(node.transfer().expect("a claimable node has its copy in flight"));
        self.tree.update(id, |node| {
            node.set_device(None);
            node.set_state(NodeState::SwapToHost(SwapOut::Claimed));
        });
        (block, Some(transfer))
    }

    /// Evicts one device candidate under the write policy (module flow, steps 1 to 3).
    /// `allocation` (the host parent a host eviction left unfiled, see
    /// [`CacheManager::obtain_host_block_exposing`]) when the caller takes the block now and no
    /// node is claimable: a swap-out is claimed as it starts (what the next claim would do,
    /// without filing the node as claimable in between), and a drop of a leaf or of a device
    /// copy, or a swap-out, may leave its parent unfiled as the next victim (see [`Evicted`]).
    // Inline, so that each caller keeps only its own branches (an allocation's write-back path
    // runs straight) and the `Evicted` it returns is matched without being built.
    #[inline(always)]
    fn evict_device(&mut self, id: NodeId, allocation: Option<&mut Option<NodeId>>) -> Evicted {
        let for_allocation = allocation.is_some();
        let node = self.tree.node(id);
        let block = node.device().expect("a device candidate has a device block");
        if node.has_valid_host() {
            let exposed = if for_allocation {
                self.tree.drop_device_copy_exposing(id)
            } else {
                self.tree.update(id, |node| {
                    node.set_device(None);
                    node.set_state(NodeState::Host);
                });
                None
            };
            self.stats.evictions.device_to_host_metadata += 1;
            self.settled_on_host(id);
            if for_allocation {
                return Evicted::Taken { block, exposed };
            }
            self.free_device(block);
            return Evicted::Freed;
        }
        let wants_copy = self.host_enabled()
            && match self.config.write_policy {
                WritePolicy::WriteBack | WritePolicy::WriteThrough => true,
                WritePolicy::WriteThroughSelective { threshold } => node.hit_count() >= threshold,
            };
        if wants_copy {
            let host = match allocation {
                Some(exposed_host) => self.obtain_host_block_exposing(exposed_host),
                None => self.obtain_host_block(),
            };
            if let Some((host_block, store)) = host {
                self.stats.evictions.device_written_back += 1;
                if for_allocation {
                    let (transfer, exposed) = self.start_claimed_swap_out(id, block, host_block);
                    self.order_after_store(transfer, store);
                    return Evicted::Claimed { block, transfer, exposed };
                }
                let transfer = self.start_swap_out(id, host_block, SwapOut::Evict);
                self.order_after_store(transfer, store);
                return Evicted::SwappingOut;
            }
        }
        self.stats.evictions.device_dropped += 1;
        if !for_allocation {
            self.drop_subtree(id);
            return Evicted::Freed;
        }
        if !self.tree.node(id).has_children() {
            let exposed = self.drop_device_leaf_exposing(id);
            return Evicted::Taken { block, exposed };
        }
        // Host-only nodes below it go too: its block is the one device block the drop frees.
        self.drop_subtree(id);
        let taken = self.device.allocate_one().expect("a block was just freed");
        debug_assert_eq!(taken, block, "the pool hands out the block freed last");
        Evicted::Taken { block: taken, exposed: None }
    }

    /// A host block, from the pool or by evicting the least recently used host candidate
    /// (module documentation), with the STORE still reading it when it was claimed from a
    /// write-back: the caller's copy into the block must wait for that STORE.
    pub(super) fn obtain_host_block(&mut self) -> Option<(u32, Option<TransferId>)> {
        if let Some(block) = self.host.allocate_one() {
            return Some((block, None));
        }
        let victim = self.tree.first_host_candidate()?;
        Some(self.evict_host(victim, None))
    }

    /// [`CacheManager::obtain_host_block`] for an allocation that goes on evicting: `exposed` is
    /// the host-only parent that the previous host eviction left unfiled (see
    /// [`Tree::remove_exposing_host`]), evicted now if it comes before every host candidate
    /// and filed otherwise; this eviction may leave the next one there.
    fn obtain_host_block_exposing(
        &mut self,
        exposed: &mut Option<NodeId>,
    ) -> Option<(u32, Option<TransferId>)> {
        if let Some(block) = self.host.allocate_one() {
            return Some((block, None));
        }
        let victim = match exposed.take() {
            Some(parent) if self.tree.is_next_host_victim(parent) => parent,
            parent => {
                if let Some(parent) = parent.filter(|&parent| self.tree.is_live(parent)) {
                    self.tree.file_exposed(parent, EvictSet::Host);
                }
                self.tree.first_host_candidate()?
            }
        };
        Some(self.evict_host(victim, Some(exposed)))
    }

    /// Evicts host candidate `victim` for its host block (module documentation); `exposed`:
    /// where to leave the parent a removal makes a host candidate (unfiled), if the caller goes
    /// on evicting.
    #[inline]
    fn evict_host(
        &mut self,
        victim: NodeId,
        exposed: Option<&mut Option<NodeId>>,
    ) -> (u32, Option<TransferId>) {
        let node = self.tree.node(victim);
        let block = node.host().expect("a host candidate has a host block");
        // The block changes owner without passing through the pool.
        if node.device().is_some() {
            self.tree.update(victim, |node| node.set_host(None));
        } else if self.storage_enabled() {
            return self.evict_host_only_above_storage(victim, block, exposed);
        } else {
            // Without a storage tier no node is storage-only: a host candidate is a leaf.
            match exposed {
                Some(exposed) => *exposed = self.tree.remove_exposing_host(victim),
                None => self.tree.remove(victim),
            }
        }
        self.stats.evictions.host_dropped += 1;
        (block, None)
    }

    /// Evicts host-only candidate `victim` (its host block `block`) with a storage tier below
    /// (module documentation): to storage-only when the tier holds it, else written back when the
    /// tier is up and has room, else dropped with its storage-only children (while the tier is
    /// down those it holds are kept as orphans: `tier_health`). Returns the block
    /// and the STORE still reading it. `exposed`: as for [`CacheManager::evict_host`], for the
    /// first two.
    #[inline(never)]
    fn evict_host_only_above_storage(
        &mut self,
        victim: NodeId,
        block: u32,
        exposed: Option<&mut Option<NodeId>>,
    ) -> (u32, Option<TransferId>) {
        if self.tree.node(victim).stored() {
            let to_storage = |node: &mut NodeMut<'_>| {
                node.set_host(None);
                node.set_state(NodeState::Storage);
            };
            match exposed {
                Some(exposed) => *exposed = self.tree.update_exposing_host(victim, to_storage),
                None => self.tree.update(victim, to_storage),
            }
            self.stats.evictions.host_to_storage_metadata += 1;
            return (block, None);
        }
        if self.tier.is_down() {
            // No write-back to a tier that is down: the block is dropped (`tier_health`).
            self.stats.storage_down_dropped_blocks += 1;
        } else if self.reserve_storage_block() {
            let store = match exposed {
                Some(exposed) => {
                    let (store, parent) = self.start_write_back_exposing(victim, block);
                    *exposed = parent;
                    store
                }
                None => self.start_store(victim, block, StoreOut::Evict),
            };
            self.stats.evictions.host_written_back += 1;
            return (block, Some(store));
        }
        if self.tier.is_down() {
            // The tier holds its storage-only children intact: kept as orphans, not forgotten.
            self.orphan_stored_children(victim);
        } else {
            // Storage-only children of a full tier go with it, freeing its room.
            while let Some(child) = self.tree.first_child(victim) {
                self.drop_subtree(child);
            }
        }
        // The tier may hold the block all the same (a block loaded back keeps its slab copy).
        self.forget_dropped(self.tree.node(victim).hash(), NodeState::Host);
        self.tree.remove(victim);
        self.stats.evictions.host_dropped += 1;
        (block, None)
    }
}

/// Counts, up to `limit`, the host blocks that evictions of host candidates could give: every
/// candidate, and every node that becomes one once its children counted before it have left the
/// host tier (a host-only candidate leaves it; one with a device copy stays above storage).
/// `gone` and `exposed` are scratch space, as for [`count_reclaimable`].
pub(super) fn count_host_obtainable(
    tree: &Tree,
    gone: &mut IdMap<NodeId, u32>,
    exposed: &mut Vec<NodeId>,
    limit: usize,
) -> usize {
    let direct = tree.host_candidate_count();
    if direct >= limit {
        return limit;
    }
    gone.clear();
    exposed.clear();
    let mut count = direct;
    let mut expose = |id: NodeId, exposed: &mut Vec<NodeId>| {
        let node = tree.node(id);
        let parent = node.parent().expect("a counted node is not the root");
        if node.device().is_some() || parent == NodeId::ROOT {
            return;
        }
        let children = tree.upper_child_count(parent);
        let node = tree.node(parent);
        if counted_gone(gone, parent, children) == children
            && node.has_valid_host()
            && node.ref_count() == 0
        {
            exposed.push(parent);
        }
    };
    tree.visit(EvictSet::Host, |id| {
        expose(id, exposed);
        ControlFlow::Continue(())
    });
    while let Some(id) = exposed.pop() {
        count += 1;
        if count >= limit {
            return limit;
        }
        expose(id, exposed);
    }
    count
}

/// Counts, up to `limit`, the device blocks that claims and cascading evictions could free:
/// every claimable node, every device candidate, and every node that becomes a candidate once
/// the device children counted before it are gone. `gone` (device children counted, per
/// parent) and `exposed` (parents whose last device child was counted) are scratch space.
fn count_reclaimable(
    tree: &Tree,
    gone: &mut IdMap<NodeId, u32>,
    exposed: &mut Vec<NodeId>,
    limit: usize,
) -> usize {
    let direct = tree.claimable_count() + tree.device_candidate_count();
    if direct >= limit {
        return limit;
    }
    gone.clear();
    exposed.clear();
    let mut count = direct;
    let mut expose = |id: NodeId, exposed: &mut Vec<NodeId>| {
        let parent = tree.node(id).parent().expect("a counted node is not the root");
        if parent == NodeId::ROOT {
            return;
        }
        let children = tree.device_child_count(parent);
        let node = tree.node(parent);
        if counted_gone(gone, parent, children) == children
            && node.state() == NodeState::Device
            && node.device().is_some()
            && node.ref_count() == 0
        {
            exposed.push(parent);
        }
    };
    // The count does not depend on the order in which nodes are counted: each candidate's cascade
    // is followed as soon as it is found, so that a shortfall that a few chains cover stops
    // before visiting every candidate.
    let mut reached = false;
    for set in [EvictSet::Claimable, EvictSet::Device] {
        tree.visit(set, |id| {
            expose(id, exposed);
            while let Some(parent) = exposed.pop() {
                count += 1;
                if count >= limit {
                    reached = true;
                    return ControlFlow::Break(());
                }
                expose(parent, exposed);
            }
            ControlFlow::Continue(())
        });
        if reached {
            return limit;
        }
    }
    count
}

/// Counts one more child of `parent` (which has `children` of the kind counted) as gone, and
/// returns how many are gone. The only child of its kind is gone at once: a chain, the usual
/// shape, counts without touching the map (each child is counted once).
#[inline]
fn counted_gone(gone: &mut IdMap<NodeId, u32>, parent: NodeId, children: u32) -> u32 {
    if children == 1 {
        return 1;
    }
    let removed = gone.entry(parent).or_insert(0);
    *removed += 1;
    *removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::BlockHash;
    use crate::tree::{EvictionPolicy, SwapOut};

    /// What a node of a test tree is: its state and blocks (and whether something holds it).
    #[derive(Clone, Copy)]
    enum Kind {
        /// Idle on device, without a host copy.
        Device,
        /// Idle on device with a valid host copy (a backup).
        Backup,
        /// Host only.
        Host,
        /// On the storage tier only.
        Storage,
        /// Being copied to host as an eviction (claimable), its device block still there.
        Evicting,
        /// Being copied to host, its device block claimed by an allocation.
        Claimed,
        /// Being copied to host as a backup (stays on device).
        BackingUp,
        /// Host only, its host copy being written to storage as a backup.
        StoringBackup,
        /// Any of the above, held by a request.
        Held(&'static Kind),
    }

    /// A tree's nodes, each `(parent index or None for the root, kind)`, parents first.
    type Shape = &'static [(Option<usize>, Kind)];

    /// What a case is called, its tree, and the blocks its dry run must count.
    type Case = (&'static str, Shape, usize);

    /// A tree of `nodes` (each `(parent index or None for the root, kind)`, parents first).
    fn tree_of(policy: EvictionPolicy, nodes: Shape) -> Tree {
        let mut tree = Tree::new(policy);
        let mut ids: Vec<NodeId> = Vec::new();
        for (index, &(parent, kind)) in nodes.iter().enumerate() {
            let parent = parent.map_or(NodeId::ROOT, |parent| ids[parent]);
            let block = index as u32;
            let id = tree.insert(parent, BlockHash(index as u128 + 1), |node| {
                let mut kind = kind;
                if let Kind::Held(inner) = kind {
                    node.hold();
                    kind = *inner;
                }
                let (device, host, state) = match kind {
                    Kind::Device => (true, false, NodeState::Device),
                    Kind::Backup => (true, true, NodeState::Device),
                    Kind::Host => (false, true, NodeState::Host),
                    Kind::Storage => (false, false, NodeState::Storage),
                    Kind::Evicting => (true, true, NodeState::SwapToHost(SwapOut::Evict)),
                    Kind::Claimed => (false, true, NodeState::SwapToHost(SwapOut::Claimed)),
                    Kind::BackingUp => (true, true, NodeState::SwapToHost(SwapOut::Backup)),
                    Kind::StoringBackup => {
                        (false, true, NodeState::HostToStorage(crate::tree::StoreOut::Backup))
                    }
                    Kind::Held(_) => unreachable!("one level of holding"),
                };
                node.set_device(device.then_some(block));
                node.set_host(host.then_some(block));
                node.set_state(state);
                if matches!(kind, Kind::Storage) {
                    node.set_stored(true);
                }
                if matches!(
                    kind,
                    Kind::Evicting | Kind::Claimed | Kind::BackingUp | Kind::StoringBackup
                ) {
                    node.set_transfer(Some(1));
                }
            });
            ids.push(id);
        }
        tree.check().unwrap();
        tree
    }

    /// The dry runs count what evictions would give, hand-counted per shape of parent: chains
    /// (counted without the map), parents of several children of the kind counted, cascades,
    /// and children that keep their parent (held, a device or host copy that stays, a copy in
    /// flight) or do not count (storage-only, claimed, host-only below a device node).
    #[test]
    fn the_dry_runs_count_each_parent_once_its_every_child_of_the_kind_counted_is_gone() {
        use Kind::*;
        const HELD_DEVICE: Kind = Held(&Device);
        const HELD_HOST: Kind = Held(&Host);
        let device_shapes: &[Case] = &[
            ("a chain", &[(None, Device), (Some(0), Device), (Some(1), Device)], 3),
            ("two leaves", &[(None, Device), (Some(0), Device), (Some(0), Device)], 3),
            ("a held leaf", &[(None, Device), (Some(0), Device), (Some(0), HELD_DEVICE)], 1),
            ("a held parent", &[(None, HELD_DEVICE), (Some(0), Device)], 1),
            ("a leaf backing up", &[(None, Device), (Some(0), Device), (Some(0), BackingUp)], 1),
            ("a claimable leaf", &[(None, Device), (Some(0), Device), (Some(0), Evicting)], 3),
            ("a claimed leaf", &[(None, Device), (Some(0), Device), (Some(0), Claimed)], 2),
            ("a host-only leaf", &[(None, Device), (Some(0), Device), (Some(0), Host)], 2),
            (
                "a cascade over two levels",
                &[
                    (None, Device),
                    (Some(0), Device),
                    (Some(0), Device),
                    (Some(2), Device),
                    (Some(2), Backup),
                ],
                5,
            ),
        ];
        let host_shapes: &[Case] = &[
            ("a chain", &[(None, Host), (Some(0), Host), (Some(1), Host)], 3),
            ("two leaves", &[(None, Host), (Some(0), Host), (Some(0), Host)], 3),
            ("a held leaf", &[(None, Host), (Some(0), Host), (Some(0), HELD_HOST)], 1),
            ("a held parent", &[(None, HELD_HOST), (Some(0), Host)], 1),
            ("a backup leaf", &[(None, Backup), (Some(0), Host), (Some(0), Backup)], 2),
            ("a storage-only leaf", &[(None, Host), (Some(0), Host), (Some(0), Storage)], 2),
            ("a parent storing", &[(None, StoringBackup), (Some(0), Host)], 1),
            ("a device parent", &[(None, Device), (Some(0), Host), (Some(0), Host)], 2),
            (
                "a cascade over two levels",
                &[
                    (None, Host),
                    (Some(0), Host),
                    (Some(0), Host),
                    (Some(1), Host),
                    (Some(2), Host),
                    (Some(2), Host),
                ],
                6,
            ),
        ];
        let (mut gone, mut exposed) = (IdMap::default(), Vec::new());
        for policy in EvictionPolicy::ALL.iter().copied() {
            for &(what, nodes, expected) in device_shapes {
                let tree = tree_of(policy, nodes);
                let counted = count_reclaimable(&tree, &mut gone, &mut exposed, 100);
                assert_eq!(counted, expected, "device blocks, {what}, {policy:?}");
                assert_eq!(count_reclaimable(&tree, &mut gone, &mut exposed, 2), expected.min(2));
            }
            for &(what, nodes, expected) in host_shapes {
                let tree = tree_of(policy, nodes);
                let counted = count_host_obtainable(&tree, &mut gone, &mut exposed, 100);
                assert_eq!(counted, expected, "host blocks, {what}, {policy:?}");
            }
        }
    }
}
