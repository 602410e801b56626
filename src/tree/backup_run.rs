//! Write-through's backups with a host tier and no storage tier, started in one loop in the tree
//! ([`Tree::backup_run`]), and their landing in one pass ([`Tree::land_backup_swap_outs`]):
//! what the cache manager's per-node path (`poll`'s `issue_backup` with `obtain_host_block`
//! and `start_swap_out`, and `swap_out_landed`) does for the nodes it meets most, with the node
//! work in one place and the pool and the copy behind [`BackupSink`].
//!
//! One node of the queue of a run, in the queue's order:
//! 1. a node no longer live or no longer queued is skipped; a queued one is queued no more;
//! 2. one that is not `Device` without a host copy any more needs no backup: skipped;
//! 3. else a host block is found: a free one from the sink, or the host candidate the policy
//!    gives up next, which must be a host-only leaf and leaves the tree (its parent may be
//!    handed back unfiled as the next host victim, as in an allocation's write-back run:
//!    [`write_back::host_child_gone_exposes`]);
//! 4. the node's backup starts: it becomes `SwapToHost(Backup)`, keeping its device block (so
//!    its parent's counts and sets stay), and leaves the sets it was in; the sink gets the
//!    (device, host) pair.
//!
//! Anything else (no host candidate left, a host victim with a device copy) ends the run with
//! [`BackupEnd::General`] before changing anything for that node: the manager handles it by
//! its general path and runs on. A first backup with no copy open ends it with
//! [`BackupEnd::NeedsCopy`], so that a run that starts no backup opens no copy (nor one that
//! finds no host block: the caller opens it only if one can be had). The host parent
//! left unfiled stays in [`BackupRun`] across those ends.
//!
//! A backup lands (the copy completed) as `Device` again, with its host copy as a backup and
//! no copy in flight, filed in the sets it belongs in.

use super::index::ChildIndex;
use super::node::Tier;
use super::policy::{EvictSet, Membership, Policies};
use super::set_order::SetOrder;
use super::write_back::{drop_host_leaf, is_live};
use super::{membership_in, Node, NodeId, NodeMut, NodeState, SwapOut, Tree};

/// What a backup run takes from and gives to its caller, who owns the host pool and the copy.
pub trait BackupSink {
    /// How many free host blocks there are.
    fn free_host_blocks(&self) -> usize;
    /// A free host block, taken (there is one).
    fn take_free_host_block(&mut self) -> u32;
    /// The backup of node `id` started: its device block `device` is copied to host block
    /// `host` by the run's copy.
    fn backed_up(&mut self, id: NodeId, device: u32, host: u32);
}

/// Where a backup run is in its queue, the state it keeps across its ends, and what it counted.
#[derive(Debug, Default)]
pub struct BackupRun {
    /// The position in the queue of the next node to look at.
    pub next: usize,
    /// The host-only parent the last host eviction left unfiled (see
    /// [`Tree::remove_exposing_host`]): the next host victim if it comes first.
    pub exposed_host: Option<NodeId>,
    /// Backups started.
    pub started: u64,
    /// Host candidates that left the tree for their host block.
    pub host_dropped: u64,
}

/// Why a backup run returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackupEnd {
    /// It went through the whole queue.
    Done,
    /// The next node (at [`BackupRun::next`]) is to be backed up and no copy is open: open
    /// one and run again if a host block can be had (a free one or a host candidate), else
    /// handle it by the general path (which finds none), as for [`BackupEnd::General`].
    NeedsCopy,
    /// The next node (at [`BackupRun::next`]) is not one the run backs up (module flow):
    /// nothing was changed for it; handle it by the general path, then run again.
    General,
}

impl Tree {
    /// Goes through the backups queued in `queue` from `run.next` on, for a cache with a host
    /// tier and no storage tier (module flow); `copy`: the device-to-host copy the backups join,
    /// if one is open. The host parent left unfiled is in `run` when it returns: the caller
    /// files it, if it is still live, once it is done ([`Tree::file_exposed`]).
    pub fn backup_run(
        &mut self,
        run: &mut BackupRun,
        queue: &[NodeId],
        copy: Option<u64>,
        sink: &mut impl BackupSink,
    ) -> BackupEnd {
        let Tree { nodes, free_slots, index, policy } = self;
        let nodes = nodes.as_mut_slice();
        // One dispatch on the policy for the whole run (see `SetOrder`).
        match policy {
            Policies::Lru(policy) => {
                backup_loop(nodes, free_slots, index, policy, run, (queue, copy), sink)
            }
            Policies::Conv(policy) => {
                backup_loop(nodes, free_slots, index, policy, run, (queue, copy), sink)
            }
            Policies::Optimal(policy) => {
                backup_loop(nodes, free_slots, index, policy, run, (queue, copy), sink)
            }
        }
    }

    /// Swap-out `transfer`, serving `nodes` (one per pair), landed: lands, in one pass, each
    /// node still attached that is a backup (`SwapToHost(Backup)`): it is `Device` again with
    /// its host copy as a backup and no copy in flight, filed in its sets unless held (the fast
    /// form of an [`Tree::update`] doing that: neither block nor tier changes, so the parent's
    /// counts and sets stay). Skips each detached node, and stops at the first attached in
    /// another state, which the manager lands, so that the nodes still change in the copy's
    /// order. Returns how many nodes it went through (all of them unless it stopped) and how
    /// many it landed.
    pub fn land_backup_swap_outs(&mut self, nodes: &[NodeId], transfer: u64) -> (usize, u64) {
        let Tree { nodes: arena, policy, .. } = self;
        let arena = arena.as_mut_slice();
        let mut landed = 0;
        for (index, &id) in nodes.iter().enumerate() {
            // Slots are never given back, so an id of the copy indexes the arena even when its
            // node left the tree.
            let node = &mut arena[id.index()];
            if node.parent == NodeId::NONE || !node.names_transfer(transfer) {
                continue;
            }
            if !node.is(NodeState::SwapToHost(SwapOut::Backup)) {
                return (index, landed);
            }
            debug_assert!(node.membership().is_empty(), "a backup in flight is filed");
            {
                let mut view = NodeMut { node, access: None, upper_changed: false };
                view.set_state(NodeState::Device);
                view.set_transfer(None);
            }
            // `Device` with both blocks, not the root (a copy's node): decided from the three
            // fields that can keep it out of the device and host sets.
            let sets = if node.ref_count() > 0 {
                Membership::NONE
            } else {
                let device = Membership::NONE.with(EvictSet::Device);
                let host = Membership::NONE.with(EvictSet::Host);
                // A child with a device block is above storage: a node with a device child
                // has a child above storage too, and is in neither set.
                match (node.device_children == 0, node.upper_children == 0) {
                    (true, true) => Membership::from_bits(device.bits() | host.bits()),
                    (true, false) => device,
                    (false, _) => Membership::NONE,
                }
            };
            debug_assert_eq!(sets, membership_in(arena, id));
            if !sets.is_empty() {
                policy.enter(id, sets);
                arena[id.index()].set_membership(sets);
            }
            landed += 1;
        }
        (nodes.len(), landed)
    }
}

/// The loop of [`Tree::backup_run`] with the tree's fields borrowed apart and the policy
/// itself; `(queue, copy)` as there.
// Out of line, one function per policy, as `write_back_loop`.
#[inline(never)]
fn backup_loop(
    nodes: &mut [Node],
    free_slots: &mut NodeId,
    index: &mut ChildIndex,
    policy: &mut impl SetOrder,
    run: &mut BackupRun,
    (queue, copy): (&[NodeId], Option<u64>),
    sink: &mut impl BackupSink,
) -> BackupEnd {
    while let Some(&id) = queue.get(run.next) {
        if !is_live(nodes, id) || !nodes[id.index()].backup_queued() {
            run.next += 1;
            continue;
        }
        let node = &nodes[id.index()];
        let device = node.block(Tier::Device);
        let wants_backup = node.is(NodeState::Device) && node.block(Tier::Host).is_none();
        let Some(device) = device.filter(|_| wants_backup) else {
            // Step 2: no longer wanting a backup.
            unqueue(&mut nodes[id.index()]);
            run.next += 1;
            continue;
        };
        let Some(copy) = copy else {
            // No host block was taken yet (each is taken for a backup, in the copy).
            debug_assert!(run.exposed_host.is_none(), "a host block taken with no copy open");
            return BackupEnd::NeedsCopy;
        };
        let host = if sink.free_host_blocks() > 0 {
            sink.take_free_host_block()
        } else {
            let leaf = drop_host_leaf(nodes, free_slots, index, policy, &mut run.exposed_host);
            let Some(block) = leaf else { return BackupEnd::General };
            run.host_dropped += 1;
            block
        };
        unqueue(&mut nodes[id.index()]);
        start_backup(nodes, policy, id, host, copy);
        run.started += 1;
        run.next += 1;
        sink.backed_up(id, device, host);
    }
    BackupEnd::Done
}

/// Takes `node` off the backup queue (the flag alone: its sets do not depend on it).
#[inline(always)]
fn unqueue(node: &mut Node) {
    NodeMut { node, access: None, upper_changed: false }.set_backup_queued(false);
}

/// Starts the backup of `id`, a `Device` node without a host copy, to `host_block` by copy
/// `transfer` (module flow, step 4): the fast form of an [`Tree::update`] doing that.
#[inline(always)]
fn start_backup(
    nodes: &mut [Node],
    policy: &mut impl SetOrder,
    id: NodeId,
    host_block: u32,
    transfer: u64,
) {
    let node = &mut nodes[id.index()];
    let sets = node.membership();
    {
        // Both states are above storage and the device block stays: the parent's counts stay.
        let mut view = NodeMut { node, access: None, upper_changed: false };
        view.set_host(Some(host_block));
        view.set_state(NodeState::SwapToHost(SwapOut::Backup));
        view.set_transfer(Some(transfer));
    }
    // Its new state admits no set: it leaves the ones it was in (the device set, or none when
    // it has a device child or is held).
    if !sets.is_empty() {
        policy.leave(id, sets);
        node.set_membership(Membership::NONE);
    }
    debug_assert_eq!(membership_in(nodes, id), Membership::NONE);
}
