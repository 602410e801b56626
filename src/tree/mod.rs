//! The radix tree of cached blocks: one node per cached full block, in an arena.
//!
//! The tree owns the nodes (an arena of packed [`Node`] records addressed by [`NodeId`], parents
//! and siblings by id), the index from (parent, block hash) to child ([`index`]), and the
//! evictable sets of each kind of victim, ordered by a pluggable eviction policy ([`policy`]). It
//! knows nothing of pools, requests, copies or write policies: the cache manager decides (its
//! eviction engine, `manager/evict.rs`, picks victims with [`Tree::first`]), the tree records and
//! keeps its derived state (child counts, set membership) in step.
//!
//! Every change goes through one of the methods of [`change`], and each one keeps the tree's
//! invariants at its return: a node is filed in exactly the sets its fields admit (DESIGN §4.4),
//! and its parent's child counts and sets agree with it. A change to one node flows so:
//! 1. apply the change (a closure on [`NodeMut`]), which may record an access;
//! 2. if the node gained or lost its device copy, or went to or from storage-only, adjust the
//!    parent's child counts and re-file the parent (it may have become, or stopped being, a
//!    candidate);
//! 3. re-file the node under the predicates of DESIGN §4 ([`policy::EvictSet`]), telling
//!    the policy what left, what was accessed and what joined (the flow of [`policy`]).
//!
//! Every operation is O(1) but for the policy's placement of a node that joins a set late (see
//! [`policy`]); nothing allocates once the arena and the index have grown to the tree's size.
//!
//! Node states ([`NodeState`], DESIGN §4.2), with which copies are valid:
//! - `Device`: device valid, host maybe (a backup);
//! - `Host`: host valid, no device block;
//! - `SwapToHost(_)`: a device-to-host copy is in flight; see [`SwapOut`] for what happens when
//!   it lands;
//! - `SwapToDevice`: a host-to-device copy is in flight into `device`; host valid;
//! - `Storage`: on the storage tier only (no block);
//! - `HostToStorage(_)`: a STORE is in flight; see [`StoreOut`] for the host block meanwhile;
//! - `StorageToHost`: a LOAD is in flight into `host`, a swap-in into `device` behind it (a
//!   prefetch's LOAD has none until an allocation meets it: no device block, it lands on host).
//!
//! Any node may also have a storage copy (its `stored` flag). Below a storage-only node every
//! node is storage-only: a node leaves the host tier only when none of its children is above
//! storage ([`Node`]'s `upper_children`), and new blocks are inserted under device copies (a
//! commit) or, storage-only, under any node but one being written back (an adoption).
//!
//! Child counts are 16 bits, saturating: a count at its maximum means "at least that many", and
//! the tree walks the child list to recount it when it would fall (only a node with 65,535
//! children on a tier ever pays that).

mod change;
mod check;
mod index;
mod node;
pub mod policy;
mod snapshot;

use std::ops::ControlFlow;

use crate::hash::BlockHash;
use index::ChildIndex;
pub use node::{Node, NodeId, NodeMut, NodeState, StoreOut, SwapOut};
use node::{Tier, COUNT_SATURATED};
use policy::{EvictSet, MatchEnd, Membership, Policies, TierShape};
pub use policy::{EvictionPolicy, FutureUses, ParseEvictionPolicyError};
pub use snapshot::{SnapshotNode, TreeSnapshot};

/// The radix tree: arena, child index and evictable sets.
#[derive(Debug)]
pub struct Tree {
    nodes: Vec<Node>,
    /// The first removed slot, free for reuse; the free slots are linked by `next_sibling`.
    free_slots: NodeId,
    index: ChildIndex,
    policy: Policies,
    front: Front,
}

/// The first member of the device set and of the host set, when the tree holds it rather than
/// the policy: a node that joins its one set as the member the policy would give up first (a
/// parent exposed by the eviction of its last child on the set's tier: the usual step of
/// evicting a chain tail first) is most likely the next victim, and would leave the policy's
/// lists again at once. Any other node joining the set first hands the front to the policy, so
/// the front always goes before every member the policy holds; a member all the same. Only a
/// policy that can tell ([`policy::Policy::would_come_first`]: LRU) ever has one. Measured with
/// `kvshm replay` on the Mooncake trace, seven runs each way interleaved: without fronts a
/// request takes 10% longer at p50 and 12% at p99 with 1,953 + 7,812 host blocks (5% and 2% at
/// 5,859 device blocks).
#[derive(Clone, Copy, Debug)]
struct Front([NodeId; 2]);

impl Front {
    const NONE: Front = Front([NodeId::NONE; 2]);

    /// The front's slot of `set`, if the set has one.
    fn slot(set: EvictSet) -> Option<usize> {
        match set {
            EvictSet::Device => Some(0),
            EvictSet::Host => Some(1),
            EvictSet::Claimable | EvictSet::Storage => None,
        }
    }

    /// The front of `set`, if it has one.
    #[inline]
    fn of(&self, set: EvictSet) -> Option<NodeId> {
        Front::slot(set).and_then(|slot| self.0[slot].some())
    }

    /// The set and front slot of a node in exactly `sets`, when that is one set with a front
    /// slot (the device set alone, or the host set alone).
    #[inline]
    fn alone(sets: Membership) -> Option<(EvictSet, usize)> {
        const DEVICE: u8 = Membership::NONE.with(EvictSet::Device).bits();
        const HOST: u8 = Membership::NONE.with(EvictSet::Host).bits();
        match sets.bits() {
            DEVICE => Some((EvictSet::Device, 0)),
            HOST => Some((EvictSet::Host, 1)),
            _ => None,
        }
    }
}

impl Default for Tree {
    fn default() -> Self {
        Tree::new(EvictionPolicy::default())
    }
}

/// Heap bytes per block that [`Tree::with_capacity`] sets aside: the child index (64-byte
/// groups of twelve slots, [`index::PRESIZED_SIXTEENTHS_FULL`] sixteenths full).
pub const PRESIZED_BYTES_PER_BLOCK: usize =
    (64 * 16usize).div_ceil(12 * index::PRESIZED_SIXTEENTHS_FULL);

impl Tree {
    pub fn new(policy: EvictionPolicy) -> Tree {
        Tree::with_capacity(policy, 0)
    }

    /// A tree whose child index holds `blocks` cached blocks without growing, 9/16 full when
    /// they are all cached ([`PRESIZED_BYTES_PER_BLOCK`] each), so that no request pays for a
    /// rehash of the whole index. The arena grows by doubling, touching the new half at once
    /// (see [`Tree::insert`]).
    pub fn with_capacity(policy: EvictionPolicy, blocks: usize) -> Tree {
        let mut tree = Tree {
            nodes: vec![Node::new(BlockHash(0), NodeId::NONE)],
            free_slots: NodeId::NONE,
            index: ChildIndex::with_capacity(blocks),
            policy: Policies::new(policy),
            front: Front::NONE,
        };
        // The arena always has a spare slot, so that `insert`'s push never reallocates.
        tree.grow_arena();
        tree
    }

    /// The eviction policy ordering the evictable sets.
    pub fn eviction_policy(&self) -> EvictionPolicy {
        self.policy.kind()
    }

    /// Number of cached blocks (nodes other than the root).
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// # Panics
    /// On an id that is not a live node: ids come from this tree, so that is a programming error.
    pub fn node(&self, id: NodeId) -> &Node {
        let node = &self.nodes[id.index()];
        debug_assert!(id == NodeId::ROOT || node.parent != NodeId::NONE, "{id:?} is not live");
        node
    }

    /// Whether `id` names a live node.
    pub fn is_live(&self, id: NodeId) -> bool {
        self.nodes
            .get(id.index())
            .is_some_and(|node| id == NodeId::ROOT || node.parent != NodeId::NONE)
    }

    /// The node `id` names if it is live and names `transfer` as its copy in flight: a pair
    /// of that copy still attached to it.
    pub fn attached_to(&self, id: NodeId, transfer: u64) -> Option<&Node> {
        self.nodes
            .get(id.index())
            .filter(|node| node.parent != NodeId::NONE && node.transfer() == Some(transfer))
    }

    /// The child of `parent` keyed by `hash`.
    #[inline]
    pub fn child(&self, parent: NodeId, hash: BlockHash) -> Option<NodeId> {
        // A node without children (a block just committed, say) needs no probe.
        if !self.nodes[parent.index()].has_children() {
            return None;
        }
        self.index.find(parent, hash, &self.nodes)
    }

    /// The children of `id`, most recently inserted first.
    pub fn children(&self, id: NodeId) -> Children<'_> {
        Children { tree: self, next: self.node(id).first_child }
    }

    /// The most recently inserted child of `id`.
    pub fn first_child(&self, id: NodeId) -> Option<NodeId> {
        self.node(id).first_child.some()
    }

    /// How many children `id` has (a walk of its child list).
    pub fn child_count(&self, id: NodeId) -> usize {
        self.children(id).count()
    }

    /// Blocks from the root to `id`: 1 for the first block of a prompt (a walk up the tree).
    pub fn depth(&self, id: NodeId) -> u32 {
        let mut depth = 0;
        let mut node = id;
        while let Some(parent) = self.node(node).parent() {
            depth += 1;
            node = parent;
        }
        depth
    }

    /// How many children of `id` have a device block.
    pub fn device_child_count(&self, id: NodeId) -> u32 {
        match self.node(id).device_children {
            COUNT_SATURATED => count_children(&self.nodes, id, false),
            count => u32::from(count),
        }
    }

    /// How many children of `id` are not storage-only.
    pub fn upper_child_count(&self, id: NodeId) -> u32 {
        match self.node(id).upper_children {
            COUNT_SATURATED => count_children(&self.nodes, id, true),
            count => u32::from(count),
        }
    }

    /// The node's recency according to the eviction policy (for snapshots).
    pub fn last_access(&self, id: NodeId) -> u64 {
        self.policy.stamp(id)
    }

    /// The member of `set` the eviction policy gives up next: the next victim of its tier.
    #[inline]
    pub fn first(&self, set: EvictSet) -> Option<NodeId> {
        self.front.of(set).or_else(|| self.policy.first(set))
    }

    /// How many members `set` has.
    pub fn count(&self, set: EvictSet) -> usize {
        self.policy.len(set) + usize::from(self.front.of(set).is_some())
    }

    /// Visits the members of `set` in the order they would go, until `visit` breaks.
    pub fn visit(&self, set: EvictSet, mut visit: impl FnMut(NodeId) -> ControlFlow<()>) {
        if let Some(front) = self.front.of(set) {
            if visit(front).is_break() {
                return;
            }
        }
        self.policy.visit(set, &mut visit);
    }

    /// The members of `set` in the order they would go (allocates: for tests and inspection).
    pub fn candidates(&self, set: EvictSet) -> Vec<NodeId> {
        let mut members = Vec::new();
        self.visit(set, |id| {
            members.push(id);
            ControlFlow::Continue(())
        });
        members
    }

    /// Whether `id` would be a member of `set` once its children went from the tiers `set`
    /// looks at (no child with a device copy for the device set, none above storage for the
    /// host set), its own fields unchanged: the question an allocation's count of what
    /// evictions could free asks of a parent whose children it counted as evicted.
    pub fn joins_once_children_go(&self, id: NodeId, set: EvictSet) -> bool {
        id != NodeId::ROOT && sets_of(self.node(id), 0, 0).contains(set)
    }

    /// Tells the eviction policy that a request started: its match ended at `deepest` (none: no
    /// block hit), and `next_key` is the prompt's first block past the match. Returns the
    /// policy's tag for the request, to hand to [`Tree::request_ending`].
    pub fn request_started(&mut self, deepest: Option<NodeId>, next_key: Option<BlockHash>) -> u8 {
        let nodes = &self.nodes;
        self.policy.request_started(|| MatchEnd {
            deepest: deepest.map(|id| (id, !nodes[id.index()].has_children())),
            next_key,
        })
    }

    /// Whether the eviction policy hears [`Tree::request_started`] (else the call does nothing
    /// and may come after the request's hits are held).
    pub fn hears_request_starts(&self) -> bool {
        self.policy.hears_request_starts()
    }

    /// Tells the eviction policy that the releases that follow end the request tagged `tag`.
    pub fn request_ending(&mut self, tag: u8) {
        self.policy.request_ending(tag);
    }

    /// Tells the eviction policy that a request finished with `last` the end of its path.
    pub fn turn_ended(&mut self, last: NodeId) {
        self.policy.turn_ended(last);
    }

    /// Tells the eviction policy the tiers' sizes: before the first node, and again when a tier
    /// is resized.
    pub fn configure_policy(&mut self, device_blocks: u32, host_blocks: u32) {
        self.policy.configure(TierShape { device_blocks, host_blocks });
    }

    /// Hands an offline eviction policy the future it orders by; `false` for an online one.
    pub fn foresee(&mut self, future: FutureUses) -> bool {
        self.policy.foresee(future)
    }

    /// Live node ids, root excluded.
    pub fn ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.index.ids()
    }

    /// Bytes of heap memory held by the arena, the index and the policy.
    pub fn heap_bytes(&self) -> usize {
        self.nodes.capacity() * size_of::<Node>()
            + self.index.heap_bytes()
            + self.policy.heap_bytes()
    }

    /// The evictable sets live node `id` belongs in (DESIGN §4).
    #[inline]
    fn membership(&self, id: NodeId) -> Membership {
        membership_in(&self.nodes, id)
    }
}

/// By state code, the evictable sets a node in that state may be in (DESIGN §4): a device
/// candidate is `Device` (with a device block, no device child); a host candidate is `Device` or
/// `Host` (with a host block, no child above storage); a claimable node is `SwapToHost(evict)`
/// (with its device block); a storage candidate is `Storage` (no child).
const SETS_OF_STATE: [u8; node::STATE_CODES] = {
    let mut sets = [0; node::STATE_CODES];
    let device = Membership::NONE.with(EvictSet::Device).bits();
    let host = Membership::NONE.with(EvictSet::Host).bits();
    sets[NodeState::Device.code() as usize] = device | host;
    sets[NodeState::Host.code() as usize] = host;
    sets[NodeState::SwapToHost(SwapOut::Evict).code() as usize] =
        Membership::NONE.with(EvictSet::Claimable).bits();
    sets[NodeState::Storage.code() as usize] = Membership::NONE.with(EvictSet::Storage).bits();
    sets
};

/// The evictable sets live node `id` of arena `nodes` belongs in (DESIGN §4): none for the root,
/// else [`sets_of`] its fields.
#[inline]
fn membership_in(nodes: &[Node], id: NodeId) -> Membership {
    let node = &nodes[id.index()];
    if id == NodeId::ROOT {
        return Membership::NONE;
    }
    sets_of(node, node.device_children, node.upper_children)
}

/// The rule of the evictable sets (DESIGN §4), for a node other than the root with
/// `device_children` children with a device copy and `upper_children` children above storage:
/// none while it is held; else the sets its state allows ([`SETS_OF_STATE`]) that its blocks and
/// children admit.
#[inline]
fn sets_of(node: &Node, device_children: u16, upper_children: u16) -> Membership {
    if node.ref_count() > 0 {
        return Membership::NONE;
    }
    let device = node.block(Tier::Device).is_some();
    let host = node.block(Tier::Host).is_some();
    let bit = |member: bool, set: EvictSet| {
        if member {
            Membership::NONE.with(set).bits()
        } else {
            0
        }
    };
    let admitted = bit(device & (device_children == 0), EvictSet::Device)
        | bit(host & (upper_children == 0), EvictSet::Host)
        | bit(device, EvictSet::Claimable)
        | bit(!node.has_children(), EvictSet::Storage);
    Membership::from_bits(admitted & SETS_OF_STATE[usize::from(node.state_code())])
}

/// Walks the child list of `parent`, counting the children with a device block (`upper` false)
/// or above storage (`upper` true).
fn count_children(nodes: &[Node], parent: NodeId, upper: bool) -> u32 {
    let mut count = 0;
    let mut child = nodes[parent.index()].first_child;
    while child != NodeId::NONE {
        let node = &nodes[child.index()];
        count += u32::from(if upper { node.is_upper() } else { node.device().is_some() });
        child = node.next_sibling;
    }
    count
}

/// Iterator over the children of a node.
pub struct Children<'a> {
    tree: &'a Tree,
    next: NodeId,
}

impl Iterator for Children<'_> {
    type Item = NodeId;

    fn next(&mut self) -> Option<NodeId> {
        let id = self.next.some()?;
        self.next = self.tree.nodes[id.index()].next_sibling;
        Some(id)
    }
}

#[cfg(test)]
mod tests;
