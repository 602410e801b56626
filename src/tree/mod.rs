//! The radix tree of cached blocks: one node per cached full block, in an arena.
//!
//! The tree owns the nodes (an arena of packed [`Node`] records addressed by [`NodeId`], parents
//! and siblings by id), the index from (parent, block hash) to child ([`index`]), and the
//! evictable sets of each kind of victim, ordered by a pluggable eviction policy ([`policy`]). It
//! knows nothing of pools, requests or copies: the cache manager decides, the tree records and
//! keeps its derived state (device child counts, set membership) in step.
//!
//! A node joins through [`Tree::insert`], or [`Tree::insert_chain`] for a run of new blocks each
//! under the one before (a commit's usual case). Every change to a node goes through
//! [`Tree::update`], or through one of its fast forms for the hot steps (`hold_hit`,
//! `release_path`, the exposing removals, `drop_device_leaves`, `start_claimed_swap_out`,
//! `land_attached_claimed_swap_out`, `drop_device_copy_exposing`, `start_swap_in_of_held`,
//! `land_swap_in`, and an allocation's `write_back_run` of them, [`write_back`]; write-through's
//! `backup_run` and `land_backup_swap_outs`, [`backup_run`]), which do the same three steps
//! for the one change they make (checked against `update` by differential tests):
//! 1. apply the change (a closure on [`NodeMut`]), which may record an access;
//! 2. if the node gained or lost its device copy, adjust the parent's count of device children
//!    and re-file the parent (it may have become, or stopped being, a device candidate);
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

mod backup_run;
mod check;
mod index;
mod node;
pub mod policy;
mod set_order;
mod snapshot;
mod write_back;

use std::ops::ControlFlow;

use crate::hash::BlockHash;
pub use backup_run::{BackupEnd, BackupRun, BackupSink};
use index::{ChildIndex, Probe};
pub use node::{Node, NodeId, NodeMut, NodeState, StoreOut, SwapOut};
use node::{Tier, COUNT_SATURATED};
use policy::{Access, EvictSet, MatchEnd, Membership, Policies, TierShape};
pub use policy::{EvictionPolicy, FutureUses, ParseEvictionPolicyError};
use set_order::SetOrder;
pub use snapshot::{SnapshotNode, TreeSnapshot};
pub use write_back::{RunEnd, WriteBackRun, WriteBackSink};

/// The radix tree: arena, child index and evictable sets.
#[derive(Debug)]
pub struct Tree {
    nodes: Vec<Node>,
    /// The first removed slot, free for reuse; the free slots are linked by `next_sibling`.
    free_slots: NodeId,
    index: ChildIndex,
    policy: Policies,
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

/// How many blocks ahead of the one it works on a walk down a prompt asks for index groups
/// ([`Tree::prefetch_child`]).
pub const PREFETCH_AHEAD: usize = 4;

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

impl Tree {
    pub fn new(policy: EvictionPolicy) -> Tree {
        Tree::with_capacity(policy, 0)
    }

    /// A tree whose child index holds `blocks` cached blocks without growing, 9/16 full when
    /// they are all cached ([`PRESIZED_BYTES_PER_BLOCK`] each), so that no request pays for a
    /// rehash of the whole index. The arena grows by doubling, touching the
    /// new half at once (see [`Tree::insert`]).
    pub fn with_capacity(policy: EvictionPolicy, blocks: usize) -> Tree {
        let mut tree = Tree {
            nodes: vec![Node::new(BlockHash(0), NodeId::NONE)],
            free_slots: NodeId::NONE,
            index: ChildIndex::with_capacity(blocks),
            policy: Policies::new(policy),
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

    // Always inline: a walk down a prompt probes in a loop, and a call per probe costs a fifth
    // of the probe (saving and restoring the registers the walk keeps).
    #[inline(always)]
    pub fn child(&self, parent: NodeId, hash: BlockHash) -> Option<NodeId> {
        // A node without children (a block just committed, say) needs no probe.
        if !self.nodes[parent.index()].has_children() {
            return None;
        }
        self.index.find(parent, hash, &self.nodes)
    }

    /// A hint that [`Tree::child`] will look `hash` up soon (see [`index::ChildIndex::prefetch`]).
    #[inline]
    pub fn prefetch_child(&self, hash: BlockHash) {
        self.index.prefetch(hash);
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

    /// The node's recency according to the eviction policy (for snapshots).
    pub fn last_access(&self, id: NodeId) -> u64 {
        self.policy.stamp(id)
    }

    /// The device candidate to evict next: a device copy, no child with one, not held, nothing
    /// in flight.
    pub fn first_device_candidate(&self) -> Option<NodeId> {
        self.policy.first(EvictSet::Device)
    }

    pub fn device_candidate_count(&self) -> usize {
        self.policy.len(EvictSet::Device)
    }

    /// The host candidate to evict next: a valid host copy, no children, not held, nothing in
    /// flight.
    pub fn first_host_candidate(&self) -> Option<NodeId> {
        self.policy.first(EvictSet::Host)
    }

    pub fn host_candidate_count(&self) -> usize {
        self.policy.len(EvictSet::Host)
    }

    /// The node being evicted to host whose device block an allocation claims next.
    pub fn first_claimable(&self) -> Option<NodeId> {
        self.policy.first(EvictSet::Claimable)
    }

    pub fn claimable_count(&self) -> usize {
        self.policy.len(EvictSet::Claimable)
    }

    /// Visits the members of `set` in the order they would go, until `visit` breaks.
    pub fn visit(&self, set: EvictSet, mut visit: impl FnMut(NodeId) -> ControlFlow<()>) {
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

    /// Whether a node with these fields would be a device candidate.
    pub fn is_device_candidate(&self, id: NodeId) -> bool {
        let node = self.node(id);
        id != NodeId::ROOT
            && node.state() == NodeState::Device
            && node.device().is_some()
            && node.device_children == 0
            && node.ref_count() == 0
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

    /// The storage candidate to evict next: storage-only, no children, not held, nothing in
    /// flight.
    pub fn first_storage_candidate(&self) -> Option<NodeId> {
        self.policy.first(EvictSet::Storage)
    }

    pub fn storage_candidate_count(&self) -> usize {
        self.policy.len(EvictSet::Storage)
    }

    /// Counts one more child of `parent` with a device block (`upper` false) or above storage
    /// (`upper` true). A saturated count stays saturated: it means "at least that many".
    #[inline]
    fn count_child_in(&mut self, parent: NodeId, upper: bool) {
        let node = &mut self.nodes[parent.index()];
        let count = if upper { &mut node.upper_children } else { &mut node.device_children };
        *count = count.saturating_add(1);
    }

    /// Counts one child fewer, after the child's change; a saturated count is recounted.
    #[inline]
    fn count_child_out(&mut self, parent: NodeId, upper: bool) {
        count_child_out(&mut self.nodes, parent, upper);
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

    /// Inserts a new node under `parent` and lets `init` set its fields; it starts as `Device`
    /// with no blocks, unheld, with one hit. Callers hold it (a commit does): the policy orders
    /// a node from the release that ends its first holder.
    ///
    /// # Panics
    /// In debug builds, if `parent` already has a child with `hash`: callers look up first.
    #[inline(always)]
    pub fn insert(
        &mut self,
        parent: NodeId,
        hash: BlockHash,
        init: impl FnOnce(&mut NodeMut<'_>),
    ) -> NodeId {
        debug_assert!(
            self.child(parent, hash).is_none(),
            "inserting a duplicate child is a programming error"
        );
        let mut node = Node::new(hash, parent);
        let mut view = NodeMut { node: &mut node, access: None, upper_changed: false };
        init(&mut view);
        let access = view.access;
        let held = node.ref_count() > 0;
        let has_device = node.device().is_some();
        let is_upper = node.is_upper();
        let words = *node.hash_words();
        let first = self.nodes[parent.index()].first_child;
        node.next_sibling = first;
        let id = self.take_slot(node);
        if first != NodeId::NONE {
            self.nodes[first.index()].prev_sibling = id;
        }
        let parent_node = &mut self.nodes[parent.index()];
        parent_node.first_child = id;
        // Saturating: a saturated count means "at least that many".
        parent_node.device_children =
            parent_node.device_children.saturating_add(u16::from(has_device));
        parent_node.upper_children = parent_node.upper_children.saturating_add(u16::from(is_upper));
        self.index.insert(id, &words, &self.nodes);
        // A held node is in no set before or after (see `membership`): a commit's parent, on the
        // request's path, and the new node its commit holds need no refile, only the access.
        if self.nodes[parent.index()].ref_count() == 0 {
            self.refile(parent, None);
        }
        if held {
            if let Some(access) = access.filter(|&access| self.policy.wants(access)) {
                let nodes = &self.nodes;
                self.policy.touch(id, || nodes[id.index()].hash(), access);
            }
        } else {
            self.refile(id, access);
        }
        id
    }

    /// Inserts a chain of new nodes: the first, keyed by `hashes[0]`, under `parent`, each next
    /// one under the one before, `init(i, node)` setting the fields of the `i`-th as
    /// [`Tree::insert`]'s `init` does; it must hold each of them. Their ids are appended to
    /// `path`, the first first. The same as that many [`Tree::insert`]s, for a commit whose
    /// blocks past its first new one are all new (a node just inserted has no child to find).
    ///
    /// Past the first, a node's parent is a node just inserted, held (so in no set), with no
    /// child: linking the node under it sets the parent's child list and counts, and nothing
    /// is re-filed. Asks for the index groups [`PREFETCH_AHEAD`] nodes ahead (the caller asks
    /// for the first ones).
    ///
    /// # Panics
    /// In debug builds, if `init` leaves a node unheld, or `parent` already has a child keyed
    /// by `hashes[0]`.
    pub fn insert_chain(
        &mut self,
        parent: NodeId,
        hashes: &[BlockHash],
        mut init: impl FnMut(usize, &mut NodeMut<'_>),
        path: &mut Vec<NodeId>,
    ) {
        let Some((&first_hash, rest)) = hashes.split_first() else { return };
        // Room for the whole chain in the index at once: no test for growth per node.
        self.index.reserve(hashes.len(), &self.nodes);
        let mut parent = self.insert(parent, first_hash, |node| init(0, node));
        debug_assert!(self.nodes[parent.index()].ref_count() > 0, "a chain's node is unheld");
        path.reserve(hashes.len());
        path.push(parent);
        for (index, &hash) in rest.iter().enumerate() {
            if let Some(&ahead) = rest.get(index + PREFETCH_AHEAD) {
                self.index.prefetch(ahead);
            }
            let mut node = Node::new(hash, parent);
            let mut view = NodeMut { node: &mut node, access: None, upper_changed: false };
            init(index + 1, &mut view);
            let access = view.access;
            debug_assert!(node.ref_count() > 0, "a chain's node is unheld");
            let (has_device, is_upper, words) =
                (node.device().is_some(), node.is_upper(), *node.hash_words());
            let id = self.take_slot(node);
            let parent_node = &mut self.nodes[parent.index()];
            debug_assert!(!parent_node.has_children() && parent_node.ref_count() > 0);
            parent_node.first_child = id;
            parent_node.device_children = u16::from(has_device);
            parent_node.upper_children = u16::from(is_upper);
            self.index.insert_reserved(id, &words);
            if let Some(access) = access.filter(|&access| self.policy.wants(access)) {
                let nodes = &self.nodes;
                self.policy.touch(id, || nodes[id.index()].hash(), access);
            }
            path.push(id);
            parent = id;
        }
    }

    /// Puts a new node into a free slot of the arena (a removed node's, else a fresh one at the
    /// end) and returns its id.
    #[inline(always)]
    fn take_slot(&mut self, node: Node) -> NodeId {
        match self.free_slots.some() {
            Some(id) => {
                self.free_slots = self.nodes[id.index()].next_sibling;
                self.nodes[id.index()] = node;
                id
            }
            None => {
                let id = NodeId(u32::try_from(self.nodes.len()).expect("fewer than 2^32 nodes"));
                self.nodes.push(node);
                if self.nodes.len() == self.nodes.capacity() {
                    self.grow_arena();
                }
                id
            }
        }
    }

    /// Doubles the arena, which is full (or holds the root only), and touches the new half now
    /// (the policy's per-node state too): writing the spare slots
    /// (they stay outside the vector) makes the kernel map their pages in this one call rather
    /// than in the first insertion into each page, one request after another.
    #[cold]
    #[inline(never)]
    fn grow_arena(&mut self) {
        self.nodes.reserve(self.nodes.len());
        for slot in self.nodes.spare_capacity_mut() {
            slot.write(Node::new(BlockHash(0), NodeId::NONE));
        }
        self.policy.reserve_nodes(self.nodes.capacity());
    }

    /// Changes a node's own fields and keeps the derived state in step (module flow).
    pub fn update<R>(&mut self, id: NodeId, change: impl FnOnce(&mut NodeMut<'_>) -> R) -> R {
        let node = &mut self.nodes[id.index()];
        let had_device = node.device().is_some();
        let mut view = NodeMut { node, access: None, upper_changed: false };
        let result = change(&mut view);
        let (access, upper_changed) = (view.access, view.upper_changed);
        let node = &self.nodes[id.index()];
        if (had_device != node.device().is_some() || upper_changed) && node.parent != NodeId::NONE {
            self.recount_parent(id, had_device, upper_changed);
        }
        self.refile(id, access);
        result
    }

    /// Applies a change of node `id` to its parent's child counts (a device block gained or lost
    /// beside `had_device`; `upper_changed`: above storage now, or no longer) and sets.
    #[inline(never)]
    fn recount_parent(&mut self, id: NodeId, had_device: bool, upper_changed: bool) {
        let node = &self.nodes[id.index()];
        let (parent, has_device, is_upper) =
            (node.parent, node.device().is_some(), node.is_upper());
        if had_device != has_device {
            if has_device {
                self.count_child_in(parent, false);
            } else {
                self.count_child_out(parent, false);
            }
        }
        if upper_changed {
            if is_upper {
                self.count_child_in(parent, true);
            } else {
                self.count_child_out(parent, true);
            }
        }
        self.refile(parent, None);
    }

    /// Holds `id` for a match that hit it: one more holder, one more hit, the access recorded
    /// (the fast form of an [`Tree::update`] doing that).
    #[inline]
    pub fn hold_hit(&mut self, id: NodeId) {
        let node = &mut self.nodes[id.index()];
        node.hold_one();
        node.count_hit();
        // Held, it belongs in no set (see `membership`): it leaves the ones it was in, if any
        // (an inner node of a path was in none), and the policy hears the hit if it wants to.
        let old = node.membership();
        let access = Some(Access::Hit).filter(|&access| self.policy.wants(access));
        if !old.is_empty() || access.is_some() {
            self.refile_with_policy(id, old, Membership::NONE, access);
        }
    }

    /// Releases one hold of `id` at the end of a request ([`Access::Release`]): the fast form of
    /// an [`Tree::update`] that releases and records the access.
    ///
    /// # Panics
    /// If the node is not held: releasing more than was held is a programming error.
    pub fn release(&mut self, id: NodeId) {
        let wants_release = self.policy.wants(Access::Release);
        self.release_inline(id, wants_release);
    }

    /// Releases every node of `path` once, the last first ([`Tree::release`] of each, in one
    /// call): the end of a request, its tail released first.
    ///
    /// # Panics
    /// If a node is not held.
    pub fn release_path(&mut self, path: &[NodeId]) {
        // The usual case (LRU): one pass, in which the policy stamps each node and files it once
        // the tree has released it (`release_held`). With `false` a constant, the general loop
        // below loses its policy test (one loop over a `wants_release` bool costs 1.6% more
        // instructions in the replay).
        let Tree { nodes, policy, .. } = self;
        let nodes: &mut [Node] = nodes;
        if policy.release_path(path, |id| release_held(nodes, id)) {
            return;
        }
        // The policy's wish does not change between the releases.
        let wants_release = self.policy.wants(Access::Release);
        for &id in path.iter().rev() {
            self.release_inline(id, wants_release);
        }
    }

    /// [`Tree::release`], inline in loops; `wants_release` is the policy's
    /// [`Policies::wants`] of [`Access::Release`].
    #[inline(always)]
    fn release_inline(&mut self, id: NodeId, wants_release: bool) {
        let Tree { nodes, policy, .. } = self;
        // A held node is in no set (see `membership`): only the access, then the sets it joins
        // now (if it is unheld now), are left to tell, in `refile_with_policy`'s order.
        if wants_release {
            let node = &nodes[id.index()];
            policy.touch(id, || node.hash(), Access::Release);
        }
        let sets = release_held(nodes, id);
        if !sets.is_empty() {
            policy.enter(id, sets);
        }
    }

    /// Removes a node with no children. Its blocks must already be accounted for by the caller.
    ///
    /// # Panics
    /// If the node has children or is the root.
    pub fn remove(&mut self, id: NodeId) {
        let parent = self.unlink(id);
        self.refile(parent, None);
    }

    /// Removes a node with no children, as [`Tree::remove`] does, for an eviction that goes on
    /// evicting: when the removal makes the parent a device candidate (and nothing else) that
    /// the policy would give up next, the parent is left out of the sets and returned. The
    /// caller then evicts it at once, or files it with [`Tree::file`] before any other change:
    /// this saves filing a node only to take it out again, the usual step of evicting a chain
    /// tail first.
    ///
    /// # Panics
    /// If the node has children or is the root.
    #[inline(always)]
    pub fn remove_exposing(&mut self, id: NodeId) -> Option<NodeId> {
        let parent = self.unlink(id);
        if self.is_next_device_victim(parent) {
            // Its removal may come next: start loading its index group now.
            self.index.prefetch_words(self.nodes[parent.index()].hash_words());
            return Some(parent);
        }
        self.refile(parent, None);
        None
    }

    /// Evicts `count` device candidates in the policy's order, each a leaf with a device block
    /// alone, appending their device blocks to `blocks`: an allocation of a cache without a
    /// host tier (so without a storage tier), where every node is on device alone and nothing
    /// but the block is to give up. Each is a [`Tree::remove_exposing`]: a parent it exposes is
    /// the next victim, taken without being filed (a chain goes tail first,
    /// [`Tree::drop_device_chain`]), and the one the last removal exposes is filed at the end.
    ///
    /// # Panics
    /// If fewer than `count` device candidates can be had (callers count them first), or one
    /// has children.
    pub fn drop_device_leaves(&mut self, count: usize, blocks: &mut Vec<u32>) {
        // The blocks are written into slots taken at once: a push per block would reload the
        // vector's header after each write to the tree.
        let start = blocks.len();
        blocks.resize(start + count, u32::MAX);
        let mut slots = blocks[start..].iter_mut();
        // The parent the last removal exposed when the slots ran out.
        let mut exposed = None;
        while slots.len() > 0 {
            exposed = self.drop_device_chain(&mut slots);
        }
        if let Some(parent) = exposed {
            self.file_exposed(parent, EvictSet::Device);
        }
    }

    /// [`Tree::drop_device_leaves`] of one chain: drops the first device candidate, then, while
    /// a removal exposes the parent as the next victim, that parent, writing their blocks into
    /// `slots` until they run out (there is at least one). Returns the parent exposed when they
    /// ran out, unfiled; files the one a removal does not expose.
    #[inline(always)]
    fn drop_device_chain(&mut self, slots: &mut std::slice::IterMut<'_, u32>) -> Option<NodeId> {
        let first = self.first_device_candidate();
        let mut victim =
            first.expect("evicting past what the dry run counted is a programming error");
        // The exposed parent's index probe: taken for the prefetch of its group, it saves its
        // removal hashing the key again.
        let mut probe = None;
        // The fields borrowed apart for the whole chain, the arena as a slice (see `unlink`).
        let Tree { nodes, free_slots, index, policy } = self;
        let nodes = nodes.as_mut_slice();
        for slot in slots {
            let node = &nodes[victim.index()];
            debug_assert!(
                node.is(NodeState::Device) && node.host().is_none() && !node.stored(),
                "{victim:?} is not on device alone"
            );
            *slot = node.device().expect("a device candidate has a device block");
            let parent = unlink(nodes, free_slots, index, policy, victim, probe);
            if !is_next_device_victim_without_host(nodes, policy, parent) {
                self.refile(parent, None);
                return None;
            }
            // Its removal comes next: start loading its index group now.
            let next = index.probe(nodes[parent.index()].hash_words());
            index.prefetch_probe(next);
            (victim, probe) = (parent, Some(next));
        }
        Some(victim)
    }

    /// Removes a host candidate, as [`Tree::remove`] does, for an allocation that goes on
    /// evicting host blocks: when the removal makes the parent a host candidate (and nothing
    /// else), the parent is left out of the sets and returned, as with [`Tree::remove_exposing`]
    /// but without asking the policy yet whether it comes first: other nodes may join the host
    /// candidates before the next host eviction, which must ask anyway. The caller evicts it
    /// next if [`Tree::is_next_host_victim`] says so, and files it with [`Tree::file`] otherwise
    /// (if it is still live) before its operation ends. A parent still counting a child above
    /// storage keeps its sets, filed or not (the allocation's victim, left unfiled as the next
    /// device victim, stays so: [`write_back::host_child_gone_exposes`]).
    ///
    /// # Panics
    /// If the node has children or is the root.
    #[inline(always)] // one caller, the write-back path of an allocation's eviction
    pub fn remove_exposing_host(&mut self, id: NodeId) -> Option<NodeId> {
        let parent = self.unlink(id);
        write_back::host_child_gone_exposes(&mut self.nodes, &mut self.policy, parent)
    }

    /// [`Tree::update`] for a change that takes node `id` off the host tier to storage (written
    /// back, or held there already), for an allocation that goes on evicting host blocks: when
    /// the change makes the parent a host candidate (and nothing else), the parent is left out
    /// of the sets and returned, as with [`Tree::remove_exposing_host`].
    pub fn update_exposing_host(
        &mut self,
        id: NodeId,
        change: impl FnOnce(&mut NodeMut<'_>),
    ) -> Option<NodeId> {
        let node = &mut self.nodes[id.index()];
        let had_device = node.device().is_some();
        let mut view = NodeMut { node, access: None, upper_changed: false };
        change(&mut view);
        let (access, upper_changed) = (view.access, view.upper_changed);
        let node = &self.nodes[id.index()];
        let parent = node.parent;
        let left_the_upper_tiers = upper_changed && !node.is_upper();
        if had_device != node.device().is_some() || !left_the_upper_tiers || parent == NodeId::NONE
        {
            // Not the change this is for: as `update`.
            if (had_device != node.device().is_some() || upper_changed) && parent != NodeId::NONE {
                self.recount_parent(id, had_device, upper_changed);
            }
            self.refile(id, access);
            return None;
        }
        self.count_child_out(parent, true);
        self.refile(id, access);
        if self.nodes[parent.index()].membership().is_empty() && self.is_host_candidate_only(parent)
        {
            return Some(parent);
        }
        self.refile(parent, None);
        None
    }

    /// Whether `id`, a parent that [`Tree::remove_exposing_host`] or
    /// [`Tree::update_exposing_host`] handed back unfiled, is still live and the host candidate
    /// the policy would give up before every filed one. Its sets are not decided again: no change
    /// an allocation makes in between reaches it (its evictions change device candidates, their
    /// parents, which have a child above storage, and other host candidates), but a dropped
    /// subtree may have taken it out of the tree.
    #[inline]
    pub fn is_next_host_victim(&self, id: NodeId) -> bool {
        if !self.is_live(id) {
            return false;
        }
        debug_assert!(
            self.nodes[id.index()].membership().is_empty() && self.is_host_candidate_only(id),
            "{id:?} changed since it was handed back unfiled"
        );
        self.policy.would_come_first(id, EvictSet::Host)
    }

    /// Starts the swap-out of device candidate `id` to `host_block` by copy `transfer`, its
    /// device block claimed at once by an allocation that goes on evicting (the node becomes
    /// `SwapToHost(Claimed)`, in no set): the fast form of an [`Tree::update`] doing that. As
    /// with [`Tree::remove_exposing`], when the parent becomes the device candidate the policy
    /// would give up next (and nothing else), it is left out of the sets and returned, for the
    /// caller to evict at once or file with [`Tree::file`].
    ///
    /// # Panics
    /// In debug builds, if `id` is not a device candidate (filed or left unfiled as exposed).
    #[inline(always)] // one caller, the write-back path of an allocation's eviction
    pub fn start_claimed_swap_out(
        &mut self,
        id: NodeId,
        host_block: u32,
        transfer: u64,
    ) -> Option<NodeId> {
        // The arena as a slice: its address and length stay in registers across the writes
        // (see `unlink`).
        let Tree { nodes, policy, .. } = self;
        write_back::start_claimed_swap_out(nodes, policy, id, host_block, transfer)
    }

    /// Starts the swap-in of host node `id` into device `block` by copy `transfer` (the node
    /// becomes `SwapToDevice`), for an allocation whose request holds it: the fast form of an
    /// [`Tree::update`] doing that. Held, the node is in no set before or after; its parent
    /// gains a device child, and is filed again only when it is neither the root nor held (a
    /// hit's parent is the hit before it on the request's path, held too).
    ///
    /// # Panics
    /// In debug builds, if `id` is not a held `Host` node.
    #[inline]
    pub fn start_swap_in_of_held(&mut self, id: NodeId, block: u32, transfer: u64) {
        // The arena as a slice (see `unlink`).
        let nodes = self.nodes.as_mut_slice();
        let node = &mut nodes[id.index()];
        debug_assert!(
            id != NodeId::ROOT && node.ref_count() > 0 && node.is(NodeState::Host),
            "a swap-in of {id:?}, which is not a held host node"
        );
        let parent = node.parent;
        {
            // Both states are above storage: the parent's count of upper children stays.
            let mut view = NodeMut { node, access: None, upper_changed: false };
            view.set_device(Some(block));
            view.set_state(NodeState::SwapToDevice);
            view.set_transfer(Some(transfer));
        }
        let parent_node = &mut nodes[parent.index()];
        parent_node.device_children = parent_node.device_children.saturating_add(1);
        if parent != NodeId::ROOT && parent_node.ref_count() == 0 {
            self.refile(parent, None);
        }
        debug_assert!(self.membership(id).is_empty(), "a held node belongs in no set");
    }

    /// Swap-in `id`'s copy landed: the node is `Device`, with no copy in flight, and, if its
    /// host copy only passed through (`passing_through_host`), without it; the fast form of an
    /// [`Tree::update`] doing that. Its device block and tier stay, so the parent's counts and
    /// sets do; the node itself is filed again only if no request holds it (a held node is in
    /// no set before or after).
    #[inline]
    pub fn land_swap_in(&mut self, id: NodeId, passing_through_host: bool) {
        let node = &mut self.nodes[id.index()];
        let held = node.ref_count() > 0;
        let mut view = NodeMut { node, access: None, upper_changed: false };
        view.set_state(NodeState::Device);
        view.set_transfer(None);
        if passing_through_host {
            view.set_host(None);
            view.set_passing_through_host(false);
        }
        if held {
            debug_assert!(self.membership(id).is_empty(), "a held node belongs in no set");
        } else {
            self.refile(id, None);
        }
    }

    /// Drops the device copy of device candidate `id`, whose host copy is valid (its backup):
    /// the node becomes `Host`, and joins the host candidates if nothing below it is above
    /// storage. The fast form of an [`Tree::update`] doing that, for an allocation that goes on
    /// evicting: as with [`Tree::remove_exposing`], when the parent becomes the device candidate
    /// the policy would give up next (and nothing else), it is left out of the sets and
    /// returned, for the caller to evict at once or file with [`Tree::file`].
    ///
    /// # Panics
    /// In debug builds, if `id` is not a device candidate with a valid host copy.
    pub fn drop_device_copy_exposing(&mut self, id: NodeId) -> Option<NodeId> {
        // The arena as a slice (see `unlink`).
        let Tree { nodes, policy, .. } = self;
        write_back::drop_device_copy(nodes, policy, id)
    }

    /// Swap-out `transfer` landed for node `id`: if the node is still attached to it (see
    /// [`Tree::attached_to`]) and its device block was claimed (`SwapToHost(Claimed)`, the usual
    /// completion of an allocation's eviction), it is `Host` now, with no copy in flight, and
    /// joins the host candidates if nothing below it is above storage, all in one visit to its
    /// record. The fast form of an [`Tree::update`] doing that: neither block nor tier changes,
    /// so the parent's counts and sets stay. Changes nothing otherwise, and says why.
    #[inline]
    pub fn land_attached_claimed_swap_out(&mut self, id: NodeId, transfer: u64) -> Landing {
        let Some(node) = self.nodes.get_mut(id.index()) else { return Landing::Detached };
        if node.parent == NodeId::NONE || node.transfer() != Some(transfer) {
            return Landing::Detached;
        }
        if !node.is(NodeState::SwapToHost(SwapOut::Claimed)) {
            return Landing::Attached(node.state());
        }
        land_claimed(node, id, &mut self.policy);
        debug_assert_eq!(self.nodes[id.index()].membership(), self.membership(id));
        Landing::Landed
    }

    /// [`Tree::land_attached_claimed_swap_out`] for the nodes of swap-out `transfer` (one per
    /// pair) in one pass, the arena and the policy borrowed once: lands each claimed one still
    /// attached, skips each detached one, and stops at the first attached in another state (a
    /// backup or an unclaimed eviction, which the manager lands), so that the nodes still change
    /// in the copy's order. Returns how many nodes it went through (all of them unless it
    /// stopped) and how many it landed.
    #[inline]
    pub fn land_claimed_swap_outs(&mut self, nodes: &[NodeId], transfer: u64) -> (usize, u64) {
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
            if !node.is(NodeState::SwapToHost(SwapOut::Claimed)) {
                return (index, landed);
            }
            land_claimed(node, id, policy);
            landed += 1;
        }
        (nodes.len(), landed)
    }

    /// The node `id` names if it is live and names `transfer` as its copy in flight: a pair
    /// of that copy still attached to it.
    #[inline]
    pub fn attached_to(&self, id: NodeId, transfer: u64) -> Option<&Node> {
        self.nodes
            .get(id.index())
            .filter(|node| node.parent != NodeId::NONE && node.transfer() == Some(transfer))
    }

    /// Whether unfiled `parent` has just become a device candidate (and nothing else) that the
    /// policy would give up next: what the exposing changes leave out of the sets.
    #[inline(always)]
    fn is_next_device_victim(&self, parent: NodeId) -> bool {
        let next = is_next_device_victim(&self.nodes, &self.policy, parent);
        debug_assert!(!next || self.is_device_candidate_only(parent));
        next
    }

    /// Whether the device set is the one set live node `id` belongs in: [`Tree::membership`]
    /// is exactly that, decided from the fields ([`Node::is_device_candidate_alone`]).
    #[inline(always)]
    fn is_device_candidate_only(&self, id: NodeId) -> bool {
        let only = id != NodeId::ROOT && self.nodes[id.index()].is_device_candidate_alone();
        debug_assert_eq!(only, self.membership(id) == Membership::NONE.with(EvictSet::Device));
        only
    }

    /// Whether the host set is the one set live node `id` belongs in: [`Tree::membership`] is
    /// exactly that, decided for the states that admit it (DESIGN §4: a host block, no device
    /// block, no child above storage, not held, in state `Host`, or `Device` without its
    /// device block; a `Device` node with one is a device candidate too, or has a device
    /// child, which is above storage).
    #[inline(always)]
    fn is_host_candidate_only(&self, id: NodeId) -> bool {
        write_back::is_host_candidate_only(&self.nodes, id)
    }

    /// Files `id` in the sets it belongs in: a parent that [`Tree::remove_exposing`] returned
    /// and that is not evicted after all.
    pub fn file(&mut self, id: NodeId) {
        self.refile(id, None);
    }

    /// [`Tree::file`] of a parent that an exposing change handed back unfiled as a member of
    /// `set` alone (the device set for [`Tree::remove_exposing`], [`Tree::drop_device_leaves`]
    /// and the other device fast forms, the host set for [`Tree::remove_exposing_host`] and
    /// [`Tree::update_exposing_host`]), unchanged since: its sets are not decided again.
    ///
    /// # Panics
    /// In debug builds, if `id` is filed or does not belong in `set` alone.
    #[inline]
    pub fn file_exposed(&mut self, id: NodeId, set: EvictSet) {
        let Tree { nodes, policy, .. } = self;
        write_back::file_exposed(nodes, policy, id, set);
    }

    /// Takes a node with no children out of the tree (its sets, the index, its parent's child
    /// list and counts), all but re-filing the parent, which it returns.
    #[inline(always)]
    fn unlink(&mut self, id: NodeId) -> NodeId {
        let Tree { nodes, free_slots, index, policy } = self;
        unlink(nodes.as_mut_slice(), free_slots, index, policy, id, None)
    }

    /// Drops every node.
    pub fn clear(&mut self) {
        self.nodes.truncate(1);
        self.nodes[0] = Node::new(BlockHash(0), NodeId::NONE);
        self.free_slots = NodeId::NONE;
        self.index.clear();
        self.policy.clear();
        self.policy.reserve_nodes(self.nodes.capacity());
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

    /// Re-files `id` in the sets it belongs in now, telling the policy about `access`. The
    /// usual case, nothing to tell, is decided inline.
    #[inline]
    fn refile(&mut self, id: NodeId, access: Option<Access>) {
        let old = self.nodes[id.index()].membership();
        let new = self.membership(id);
        let access = access.filter(|&access| self.policy.wants(access));
        if old != new || (access.is_some() && !old.is_empty()) {
            self.refile_with_policy(id, old, new, access);
        } else if let Some(access) = access {
            // In no set before or after (an inner node of a path, say): only the access.
            let nodes = &self.nodes;
            self.policy.touch(id, || nodes[id.index()].hash(), access);
        }
    }

    #[inline(never)]
    fn refile_with_policy(
        &mut self,
        id: NodeId,
        old: Membership,
        new: Membership,
        access: Option<Access>,
    ) {
        if !old.is_empty() {
            self.policy.leave(id, old);
        }
        if let Some(access) = access {
            let nodes = &self.nodes;
            self.policy.touch(id, || nodes[id.index()].hash(), access);
        }
        if !new.is_empty() {
            self.policy.enter(id, new);
        }
        self.nodes[id.index()].set_membership(new);
    }

    /// The evictable sets a live node belongs in (DESIGN §4): [`membership_in`] of the arena.
    #[inline]
    fn membership(&self, id: NodeId) -> Membership {
        membership_in(&self.nodes, id)
    }
}

/// The evictable sets live node `id` of arena `nodes` belongs in (DESIGN §4), computed without
/// branches: the sets its state allows ([`SETS_OF_STATE`]) that its blocks and children admit.
#[inline]
fn membership_in(nodes: &[Node], id: NodeId) -> Membership {
    let node = &nodes[id.index()];
    if id == NodeId::ROOT || node.ref_count() > 0 {
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
    let admitted = bit(device & (node.device_children == 0), EvictSet::Device)
        | bit(host & (node.upper_children == 0), EvictSet::Host)
        | bit(device, EvictSet::Claimable)
        | bit(!node.has_children(), EvictSet::Storage);
    Membership::from_bits(admitted & SETS_OF_STATE[usize::from(node.state_code())])
}

/// The tree's part of the release of held node `id` of arena `nodes` ([`Tree::release_path`]):
/// one hold fewer, and the sets it belongs in now recorded and returned (none while it is
/// still held or has a device child), for the policy to file it in.
///
/// # Panics
/// If the node is not held.
#[inline(always)]
fn release_held(nodes: &mut [Node], id: NodeId) -> Membership {
    let node = &mut nodes[id.index()];
    node.release_one();
    // A held node is in no set (see `membership`).
    debug_assert!(node.membership().is_empty(), "a held node is filed");
    // The usual release, of a path's inner node: with a device child it is no device
    // candidate, and that child, above storage, keeps it from being a host candidate.
    if node.device_children != 0 && node.is(NodeState::Device) {
        debug_assert!(membership_in(nodes, id).is_empty(), "{id:?} belongs in a set");
        return Membership::NONE;
    }
    let sets = membership_in(nodes, id);
    nodes[id.index()].set_membership(sets);
    sets
}

/// [`Tree::unlink`] on the tree's fields borrowed apart, the arena as a slice: its address and
/// length stay in registers across the writes below, which the optimizer cannot otherwise tell
/// from writes to the vector's own header (a reload and a bounds check after each). `probe`:
/// where the node's index entry is looked for, when the caller has it already.
#[inline(always)]
fn unlink(
    nodes: &mut [Node],
    free_slots: &mut NodeId,
    index: &mut ChildIndex,
    policy: &mut impl SetOrder,
    id: NodeId,
    probe: Option<Probe>,
) -> NodeId {
    assert!(id != NodeId::ROOT, "removing the root is a programming error");
    let node = &nodes[id.index()];
    assert!(!node.has_children(), "removing a node with children is a programming error");
    let (parent, prev, next, sets) =
        (node.parent, node.prev_sibling, node.next_sibling, node.membership());
    let (had_device, was_upper) = (node.device().is_some(), node.is_upper());
    let probe = probe.unwrap_or_else(|| index.probe(node.hash_words()));
    if !sets.is_empty() {
        policy.leave(id, sets);
    }
    let sole_child = parent != NodeId::ROOT && prev == NodeId::NONE && next == NodeId::NONE;
    policy.removing(id, || nodes[id.index()].hash(), sole_child.then_some(parent));
    index.remove(id, probe);
    if next != NodeId::NONE {
        nodes[next.index()].prev_sibling = prev;
    }
    if prev != NodeId::NONE {
        nodes[prev.index()].next_sibling = next;
    }
    nodes[id.index()].mark_removed(*free_slots);
    *free_slots = id;
    // The parent's list head and counts, in one visit to its record.
    let parent_node = &mut nodes[parent.index()];
    if prev == NodeId::NONE {
        parent_node.first_child = next;
    }
    if parent_node.device_children == COUNT_SATURATED
        || parent_node.upper_children == COUNT_SATURATED
    {
        uncount_child_of_saturated(nodes, parent, had_device, was_upper);
    } else {
        parent_node.device_children -= u16::from(had_device);
        parent_node.upper_children -= u16::from(was_upper);
    }
    parent
}

/// [`unlink`]'s update of the child counts of a parent with a saturated count: the removed
/// child had a device block (`had_device`), was above storage (`was_upper`). A saturated count
/// is recounted by walking the child list.
#[cold]
#[inline(never)]
fn uncount_child_of_saturated(
    nodes: &mut [Node],
    parent: NodeId,
    had_device: bool,
    was_upper: bool,
) {
    if had_device {
        count_child_out(nodes, parent, false);
    }
    if was_upper {
        count_child_out(nodes, parent, true);
    }
}

/// [`Tree::count_child_out`] on the arena as a slice: one child of `parent` fewer with a device
/// block (`upper` false) or above storage (`upper` true); a saturated count is recounted.
#[inline]
fn count_child_out(nodes: &mut [Node], parent: NodeId, upper: bool) {
    let node = &mut nodes[parent.index()];
    let count = if upper { &mut node.upper_children } else { &mut node.device_children };
    if *count == COUNT_SATURATED {
        recount_children(nodes, parent, upper);
    } else {
        *count -= 1;
    }
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

/// Recounts the child count of `parent` of children with a device block (`upper` false) or
/// above storage (`upper` true) by walking its child list.
#[cold]
#[inline(never)]
fn recount_children(nodes: &mut [Node], parent: NodeId, upper: bool) {
    let exact = u16::try_from(count_children(nodes, parent, upper)).unwrap_or(COUNT_SATURATED);
    let node = &mut nodes[parent.index()];
    if upper {
        node.upper_children = exact;
    } else {
        node.device_children = exact;
    }
}

/// Whether unfiled `parent` has just become a device candidate (and nothing else) that the
/// policy would give up next: [`Tree::is_next_device_victim`] for the fast forms that hold the
/// arena as a slice.
#[inline(always)]
fn is_next_device_victim(nodes: &[Node], policy: &impl SetOrder, parent: NodeId) -> bool {
    let node = &nodes[parent.index()];
    node.membership().is_empty()
        && parent != NodeId::ROOT
        && node.is_device_candidate_alone()
        && policy.would_come_first(parent, EvictSet::Device)
}

/// [`is_next_device_victim`] of the parent of a node just unlinked, in a tree without a host
/// tier: every node is `Device` with its device block alone, and the parent, which had a device
/// child, is in no set. So the children, the holders and the policy decide.
#[inline(always)]
fn is_next_device_victim_without_host(nodes: &[Node], policy: &Policies, parent: NodeId) -> bool {
    let node = &nodes[parent.index()];
    let next = parent != NodeId::ROOT
        && node.device_children == 0
        && node.ref_count() == 0
        && policy.would_come_first(parent, EvictSet::Device);
    debug_assert_eq!(next, is_next_device_victim(nodes, policy, parent));
    next
}

/// One device child of `parent` fewer (a child lost its device block), and whether `parent` is
/// now the device candidate the policy would give up next (and nothing else; unfiled), in one
/// visit to its record: [`Tree::is_next_device_victim`] for the fast forms that hold the arena as
/// a slice (see [`Tree::start_claimed_swap_out`]). `None` when the count is saturated: the
/// caller recounts and asks the tree.
#[inline(always)]
fn device_child_gone(nodes: &mut [Node], policy: &impl SetOrder, parent: NodeId) -> Option<bool> {
    let node = &mut nodes[parent.index()];
    if node.device_children == COUNT_SATURATED {
        return None;
    }
    node.device_children -= 1;
    Some(is_next_device_victim(nodes, policy, parent))
}

/// Lands node `id` (its record `node`: live, attached to its swap-out, `SwapToHost(Claimed)`,
/// so in no set): it is `Host` now, with no copy in flight, and joins the host candidates unless
/// held or kept by a child above storage (decided from those two fields rather than the whole
/// of `membership`: with its host block and no device block it can be in no other set). Neither
/// block nor tier changes, so the parent's counts and sets stay. Shared by
/// [`Tree::land_attached_claimed_swap_out`] and [`Tree::land_claimed_swap_outs`].
#[inline(always)]
fn land_claimed(node: &mut Node, id: NodeId, policy: &mut Policies) {
    debug_assert!(node.membership().is_empty(), "a claimed swap-out is filed");
    let mut view = NodeMut { node, access: None, upper_changed: false };
    view.set_state(NodeState::Host);
    view.set_transfer(None);
    view.set_passing_through_host(false);
    if node.upper_children == 0 && node.ref_count() == 0 {
        let host = Membership::NONE.with(EvictSet::Host);
        policy.enter(id, host);
        node.set_membership(host);
    }
}

/// What [`Tree::land_attached_claimed_swap_out`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Landing {
    /// The node was a claimed swap-out of the copy: it is `Host` now.
    Landed,
    /// The node is attached to the copy in this other state: unchanged.
    Attached(NodeState),
    /// The node left the tree, or names another copy: the pair is detached.
    Detached,
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
mod backup_run_tests;
#[cfg(test)]
pub(crate) mod fast_form_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod twin_tests;
#[cfg(test)]
mod write_back_tests;
