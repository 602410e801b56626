//! An allocation's device evictions with a host tier and no storage tier, run in one loop in the
//! tree ([`Tree::write_back_run`]): what the cache manager's per-victim path (`evict_device`
//! with `obtain_host_block_exposing` and `evict_host`) does for the victims it meets most, with
//! the node work in one place and the pools and copies behind [`WriteBackSink`].
//!
//! One victim of a run, the device candidate the policy gives up next (or the parent the last
//! one left unfiled as the next victim):
//! 1. with a valid host copy (a backup), its device copy is dropped: the node becomes `Host`
//!    ([`Tree::drop_device_copy_exposing`]);
//! 2. else, if the write policy wants a copy (`min_hits`), a host block is found: a free one from
//!    the sink, or the host candidate the policy gives up next, which must be a host-only leaf
//!    and leaves the tree ([`Tree::remove_exposing_host`]; its parent may be handed back
//!    unfiled as the next host victim, as in the manager's path);
//! 3. the victim's swap-out starts, its device block claimed at once by the allocation: the
//!    node becomes `SwapToHost(Claimed)` ([`Tree::start_claimed_swap_out`]), and the sink gets
//!    the (device, host) pair.
//!
//! Anything else (a victim the policy wants no copy of, no host block to be had, a host victim
//! with a device copy) ends the run with [`RunEnd::General`] before changing anything for that
//! victim: the manager evicts it by its general path and runs on. The write-backs join the copy
//! the caller opened for them (it takes the copy back if the run wrote nothing back). The
//! parents left unfiled stay in [`WriteBackRun`] across the ends.

use super::index::ChildIndex;
use super::node::Tier;
use super::policy::{EvictSet, Membership, Policies};
use super::set_order::SetOrder;
use super::{
    device_child_gone, is_next_device_victim, membership_in, recount_children, unlink, Node,
    NodeId, NodeMut, NodeState, SwapOut, Tree,
};

/// What a write-back run takes from and gives to its caller, who owns the pools and the copies.
pub trait WriteBackSink {
    /// How many free host blocks there are.
    fn free_host_blocks(&self) -> usize;
    /// A free host block, taken (there is one).
    fn take_free_host_block(&mut self) -> u32;
    /// Device candidate `id` is being written back: its device block `device`, taken by the
    /// allocation, is copied to host block `host` by the run's copy.
    fn written_back(&mut self, id: NodeId, device: u32, host: u32);
    /// A device candidate's device copy was dropped (it has a valid host copy): its device block
    /// `device` is taken by the allocation.
    fn device_copy_dropped(&mut self, device: u32);
}

/// The state a write-back run keeps across its ends, and what it counted.
#[derive(Debug, Default)]
pub struct WriteBackRun {
    /// The parent the last device eviction left unfiled as the next victim (see
    /// [`Tree::remove_exposing`]).
    pub exposed: Option<NodeId>,
    /// The host-only parent the last host eviction left unfiled (see
    /// [`Tree::remove_exposing_host`]): the next host victim if it comes first.
    pub exposed_host: Option<NodeId>,
    /// Device candidates written back.
    pub written_back: u64,
    /// Device copies dropped for a valid host copy.
    pub device_copies_dropped: u64,
    /// Host candidates that left the tree for their host block.
    pub host_dropped: u64,
}

/// Why a write-back run returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunEnd {
    /// It took the blocks asked for.
    Done,
    /// The next victim is not one the run evicts (module documentation): nothing was changed
    /// for it; evict it by the general path, then run again.
    General,
}

impl Tree {
    /// Evicts device candidates for an allocation of a cache with a host tier and no storage
    /// tier until `count` device blocks are taken or the run meets a victim it leaves to the
    /// caller (module flow). `min_hits`: the hits below which the write policy wants no copy of
    /// a victim; `copy`: the device-to-host copy the write-backs join. The parents left unfiled
    /// are in `run` when it returns: the caller files them once it is done evicting
    /// ([`Tree::file_exposed`]; the host one if it is still live).
    ///
    /// The loop holds the tree's fields borrowed apart, the arena as a slice (see `unlink`), and
    /// each step is the slice form of the fast form named in the module flow, which the `Tree`
    /// method calls too.
    ///
    /// # Panics
    /// If no device candidate is left (callers count them first).
    pub fn write_back_run(
        &mut self,
        run: &mut WriteBackRun,
        count: usize,
        min_hits: u32,
        copy: u64,
        sink: &mut impl WriteBackSink,
    ) -> RunEnd {
        let Tree { nodes, free_slots, index, policy } = self;
        let (nodes, args) = (nodes.as_mut_slice(), (count, min_hits, copy));
        // One dispatch on the policy for the whole run (see `SetOrder`).
        match policy {
            Policies::Lru(policy) => {
                write_back_loop(nodes, free_slots, index, policy, run, args, sink)
            }
            Policies::Conv(policy) => {
                write_back_loop(nodes, free_slots, index, policy, run, args, sink)
            }
            Policies::Optimal(policy) => {
                write_back_loop(nodes, free_slots, index, policy, run, args, sink)
            }
        }
    }
}

/// The loop of [`Tree::write_back_run`] with the tree's fields borrowed apart and the policy
/// itself; `(count, min_hits, copy)` as there.
// Out of line, one function per policy: the loop of the policy in use is compact code of its
// own, apart from the others'.
#[inline(never)]
fn write_back_loop(
    nodes: &mut [Node],
    free_slots: &mut NodeId,
    index: &mut ChildIndex,
    policy: &mut impl SetOrder,
    run: &mut WriteBackRun,
    (count, min_hits, copy): (usize, u32, u64),
    sink: &mut impl WriteBackSink,
) -> RunEnd {
    for _ in 0..count {
        let victim = match run.exposed {
            Some(parent) => parent,
            None => policy
                .first(EvictSet::Device)
                .expect("evicting past what the dry run counted is a programming error"),
        };
        let node = &nodes[victim.index()];
        debug_assert!(node.is(NodeState::Device), "{victim:?} is not a device candidate");
        let device = node.block(Tier::Device).expect("a device candidate has a device block");
        if node.block(Tier::Host).is_some() {
            // A device candidate is `Device`: its host block is a valid copy (a backup).
            run.exposed = drop_device_copy(nodes, policy, victim);
            run.device_copies_dropped += 1;
            sink.device_copy_dropped(device);
            continue;
        }
        if node.hit_count() < min_hits {
            return RunEnd::General;
        }
        let host = if sink.free_host_blocks() > 0 {
            sink.take_free_host_block()
        } else {
            let leaf = drop_host_leaf(nodes, free_slots, index, policy, &mut run.exposed_host);
            let Some(block) = leaf else { return RunEnd::General };
            run.host_dropped += 1;
            block
        };
        run.exposed = start_claimed_swap_out(nodes, policy, victim, host, copy);
        run.written_back += 1;
        sink.written_back(victim, device, host);
    }
    RunEnd::Done
}

/// The host block of the host candidate the policy gives up next, which must be a host-only
/// leaf and leaves the tree ([`Tree::remove_exposing_host`] on the arena as a slice), for a
/// run's next copy when the pool has no free block. `exposed_host`: the parent the previous
/// host eviction handed back unfiled, taken first if it still comes first (as
/// `is_next_host_victim`), filed otherwise; on return, the parent this one hands back, if any.
/// `None`, with nothing changed but that parent filed, when the general path must take over:
/// no host candidate, or the next one still has a device copy.
#[inline(always)]
pub(super) fn drop_host_leaf(
    nodes: &mut [Node],
    free_slots: &mut NodeId,
    index: &mut ChildIndex,
    policy: &mut impl SetOrder,
    exposed_host: &mut Option<NodeId>,
) -> Option<u32> {
    // A parent handed back unfiled is still a host candidate alone while it is live.
    let host_victim = match exposed_host.take() {
        Some(parent)
            if is_live(nodes, parent) && policy.would_come_first(parent, EvictSet::Host) =>
        {
            parent
        }
        parent => {
            if let Some(parent) = parent.filter(|&parent| is_live(nodes, parent)) {
                file_exposed(nodes, policy, parent, EvictSet::Host);
            }
            policy.first(EvictSet::Host)?
        }
    };
    let node = &nodes[host_victim.index()];
    if node.block(Tier::Device).is_some() {
        // A filed candidate (a parent handed back is host-only): the general path takes it
        // first again.
        return None;
    }
    let block = node.block(Tier::Host).expect("a host candidate has a host block");
    // Without a storage tier a host-only candidate is a leaf.
    let parent = unlink(nodes, free_slots, index, policy, host_victim, None);
    *exposed_host = host_child_gone_exposes(nodes, policy, parent);
    Some(block)
}

/// Whether `id` names a live node of arena `nodes` ([`Tree::is_live`]).
#[inline(always)]
pub(super) fn is_live(nodes: &[Node], id: NodeId) -> bool {
    nodes.get(id.index()).is_some_and(|node| id == NodeId::ROOT || node.parent != NodeId::NONE)
}

/// [`Tree::file_exposed`] on the arena as a slice.
#[inline(always)]
pub(super) fn file_exposed(
    nodes: &mut [Node],
    policy: &mut impl SetOrder,
    id: NodeId,
    set: EvictSet,
) {
    let sets = Membership::NONE.with(set);
    debug_assert!(nodes[id.index()].membership().is_empty(), "{id:?} is filed");
    debug_assert_eq!(membership_in(nodes, id), sets, "{id:?} changed since it was handed back");
    policy.enter(id, sets);
    nodes[id.index()].set_membership(sets);
}

/// Re-files `id` in the sets it belongs in now, with no access to tell ([`Tree::refile`] of no
/// access on the arena as a slice).
#[inline(always)]
fn refile(nodes: &mut [Node], policy: &mut impl SetOrder, id: NodeId) {
    let old = nodes[id.index()].membership();
    let new = membership_in(nodes, id);
    if old != new {
        if !old.is_empty() {
            policy.leave(id, old);
        }
        if !new.is_empty() {
            policy.enter(id, new);
        }
        nodes[id.index()].set_membership(new);
    }
}

/// Whether the host set is the one set live node `id` belongs in ([`Tree::is_host_candidate_only`]
/// on the arena as a slice).
#[inline(always)]
pub(super) fn is_host_candidate_only(nodes: &[Node], id: NodeId) -> bool {
    let node = &nodes[id.index()];
    let only = id != NodeId::ROOT
        && (node.is(NodeState::Host) || node.is(NodeState::Device))
        && node.upper_children == 0
        && node.ref_count() == 0
        && node.block(Tier::Host).is_some()
        && node.block(Tier::Device).is_none();
    debug_assert_eq!(only, membership_in(nodes, id) == Membership::NONE.with(EvictSet::Host));
    only
}

/// The part of [`Tree::remove_exposing_host`] after the unlink of a host-only child of `parent`:
/// returns `parent`, unfiled, when it is now a host candidate alone, and re-files it otherwise.
/// A parent still counting a child above storage is left as it is: the child that went had no
/// device block, so only the host set (no child above storage) could change, and it cannot.
/// Such a parent may be unfiled: the allocation's current victim, handed back as the next
/// device victim, whose host-only child gave its host block to the victim's own write-back;
/// left out of the sets, it is not filed only to leave them again at once.
#[inline(always)]
pub(super) fn host_child_gone_exposes(
    nodes: &mut [Node],
    policy: &mut impl SetOrder,
    parent: NodeId,
) -> Option<NodeId> {
    let node = &nodes[parent.index()];
    if node.upper_children != 0 {
        debug_assert!(
            node.membership().is_empty() || node.membership() == membership_in(nodes, parent),
            "{parent:?} is filed in the wrong sets"
        );
        return None;
    }
    if node.membership().is_empty() && is_host_candidate_only(nodes, parent) {
        return Some(parent);
    }
    refile(nodes, policy, parent);
    None
}

/// One device child of `parent` fewer (a child lost its device block), and whether `parent` is
/// now the device candidate the policy would give up next (and nothing else; left unfiled),
/// the count recounted when it is saturated; re-filed otherwise. A parent still counting a
/// device child keeps its sets (only the device set, no device child, could change).
#[inline(always)]
fn device_child_gone_exposes(
    nodes: &mut [Node],
    policy: &mut impl SetOrder,
    parent: NodeId,
) -> Option<NodeId> {
    let exposed = match device_child_gone(nodes, policy, parent) {
        Some(next) => next,
        None => {
            recount_children(nodes, parent, false);
            is_next_device_victim(nodes, policy, parent)
        }
    };
    if exposed {
        return Some(parent);
    }
    if nodes[parent.index()].device_children != 0 {
        debug_assert_eq!(nodes[parent.index()].membership(), membership_in(nodes, parent));
        return None;
    }
    refile(nodes, policy, parent);
    None
}

/// [`Tree::start_claimed_swap_out`] on the arena as a slice.
#[inline(always)]
pub(super) fn start_claimed_swap_out(
    nodes: &mut [Node],
    policy: &mut impl SetOrder,
    id: NodeId,
    host_block: u32,
    transfer: u64,
) -> Option<NodeId> {
    debug_assert!(
        id != NodeId::ROOT && membership_in(nodes, id) == Membership::NONE.with(EvictSet::Device),
        "a claimed swap-out starts from a device candidate without a host copy"
    );
    let node = &mut nodes[id.index()];
    let (parent, sets) = (node.parent, node.membership());
    {
        // Both states are above storage: the parent's count of upper children stays.
        let mut view = NodeMut { node, access: None, upper_changed: false };
        view.set_device(None);
        view.set_host(Some(host_block));
        view.set_state(NodeState::SwapToHost(SwapOut::Claimed));
        view.set_transfer(Some(transfer));
    }
    // Its new state admits no set without a device block: it leaves the one it was in (none
    // when it is a parent left unfiled by the previous eviction), the device set alone (no host
    // copy), named as a constant so that the policy's list is too.
    if !sets.is_empty() {
        debug_assert_eq!(sets, Membership::NONE.with(EvictSet::Device));
        policy.leave(id, Membership::NONE.with(EvictSet::Device));
        nodes[id.index()].set_membership(Membership::NONE);
    }
    device_child_gone_exposes(nodes, policy, parent)
}

/// [`Tree::drop_device_copy_exposing`] on the arena as a slice.
#[inline(always)]
pub(super) fn drop_device_copy(
    nodes: &mut [Node],
    policy: &mut impl SetOrder,
    id: NodeId,
) -> Option<NodeId> {
    debug_assert!(
        id != NodeId::ROOT
            && nodes[id.index()].has_valid_host()
            && membership_in(nodes, id).contains(EvictSet::Device),
        "dropping the device copy of a node that is not a device candidate with a backup"
    );
    let node = &mut nodes[id.index()];
    let (parent, sets) = (node.parent, node.membership());
    // The node leaves its sets first, so that the parent is compared with the others.
    if !sets.is_empty() {
        policy.leave(id, sets);
    }
    let node = &mut nodes[id.index()];
    node.set_membership(Membership::NONE);
    {
        // Both states are above storage: the parent's count of upper children stays.
        let mut view = NodeMut { node, access: None, upper_changed: false };
        view.set_device(None);
        view.set_state(NodeState::Host);
    }
    // `Host` with its host block, unheld (it was a candidate): a host candidate, and nothing
    // else, unless a child above storage keeps it.
    let joins = if node.upper_children == 0 {
        Membership::NONE.with(EvictSet::Host)
    } else {
        Membership::NONE
    };
    let exposed = device_child_gone_exposes(nodes, policy, parent);
    debug_assert_eq!(joins, membership_in(nodes, id));
    if !joins.is_empty() {
        policy.enter(id, joins);
        nodes[id.index()].set_membership(joins);
    }
    exposed
}
