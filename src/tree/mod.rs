//! The radix tree of cached blocks: one node per cached full block, in an arena.
//!
//! The tree owns the nodes (an arena of [`Node`]s addressed by [`NodeId`], parents and siblings by
//! id), the index from (parent, block hash) to child, and the ordered sets of eviction candidates
//! of each tier ([`lru`]). It knows nothing of pools, requests or copies: the cache manager
//! decides, the tree records and keeps its derived state (child counts, candidate sets) in step.
//!
//! Every change to a node goes through [`Tree::update`]:
//! 1. take the node out of the candidate sets it is in (their keys read its fields);
//! 2. apply the change;
//! 3. if the node gained or lost its device copy, adjust the parent's count of device children
//!    and re-file the parent (it may have become, or stopped being, a device candidate);
//! 4. file the node again under the predicates of SPEC section 4.
//!
//! Node states ([`NodeState`], SPEC section 4), with which copies are valid:
//! - `Device`: device valid, host maybe (a backup);
//! - `Host`: host valid, no device block;
//! - `SwapToHost(_)`: a device-to-host copy is in flight; see [`SwapOut`] for what happens when
//!   it lands;
//! - `SwapToDevice`: a host-to-device copy is in flight into `device`; host valid.
//!
//! The loading state of the storage tier arrives with that tier.

mod check;
pub mod lru;
mod snapshot;

use std::collections::HashMap;

use crate::hash::BlockHash;
use lru::{BuildChildHasher, EvictKey, EvictionSet};
pub use snapshot::{SnapshotNode, TreeSnapshot};

/// An index into the node arena. Ids of removed nodes are reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub struct NodeId(pub u32);

impl NodeId {
    /// The root: the empty prefix. It holds no block and is never evicted.
    pub const ROOT: NodeId = NodeId(0);
    const NONE: NodeId = NodeId(u32::MAX);

    fn index(self) -> usize {
        self.0 as usize
    }

    fn some(self) -> Option<NodeId> {
        (self != NodeId::NONE).then_some(self)
    }
}

/// Marker of "no block" in a node's block fields.
const NO_BLOCK: u32 = u32::MAX;

/// What becomes of a node when its device-to-host copy lands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SwapOut {
    /// The host copy becomes a backup and the node stays on device: a write-through backup, or an
    /// eviction cancelled because the node was hit meanwhile.
    Backup,
    /// An eviction: the device block returns to the pool and the node becomes `Host`. Until then
    /// an allocation short of blocks may claim the device block early.
    Evict,
    /// An eviction whose device block an allocation has already claimed: the node has no device
    /// block and becomes `Host` when the copy lands.
    Claimed,
}

/// The state of a node (SPEC section 4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    Device,
    Host,
    SwapToHost(SwapOut),
    SwapToDevice,
}

impl NodeState {
    /// Whether a copy for this node is in flight.
    pub fn in_flight(self) -> bool {
        matches!(self, NodeState::SwapToHost(_) | NodeState::SwapToDevice)
    }

    pub fn name(self) -> &'static str {
        match self {
            NodeState::Device => "device",
            NodeState::Host => "host",
            NodeState::SwapToHost(SwapOut::Backup) => "swap_to_host(backup)",
            NodeState::SwapToHost(SwapOut::Evict) => "swap_to_host(evict)",
            NodeState::SwapToHost(SwapOut::Claimed) => "swap_to_host(claimed)",
            NodeState::SwapToDevice => "swap_to_device",
        }
    }
}

/// One cached full block.
#[derive(Clone, Debug)]
pub struct Node {
    hash: BlockHash,
    parent: NodeId,
    first_child: NodeId,
    next_sibling: NodeId,
    prev_sibling: NodeId,
    depth: u32,
    device: u32,
    host: u32,
    state: NodeState,
    ref_count: u32,
    hit_count: u32,
    child_count: u32,
    device_child_count: u32,
    last_access: u64,
    /// The id of the one copy in flight for this node, 0 when none.
    transfer: u64,
    /// Queued for a write-through backup on the next poll.
    backup_queued: bool,
    /// Which candidate sets hold this node (`IN_*` bits), so removal never guesses.
    filed: u8,
}

const IN_DEVICE_SET: u8 = 1;
const IN_HOST_SET: u8 = 2;
const IN_CLAIMABLE_SET: u8 = 4;

impl Node {
    fn new(hash: BlockHash, parent: NodeId, depth: u32) -> Node {
        Node {
            hash,
            parent,
            first_child: NodeId::NONE,
            next_sibling: NodeId::NONE,
            prev_sibling: NodeId::NONE,
            depth,
            device: NO_BLOCK,
            host: NO_BLOCK,
            state: NodeState::Device,
            ref_count: 0,
            hit_count: 1,
            child_count: 0,
            device_child_count: 0,
            last_access: 0,
            transfer: 0,
            backup_queued: false,
            filed: 0,
        }
    }

    pub fn hash(&self) -> BlockHash {
        self.hash
    }
    /// The parent, `None` for the root.
    pub fn parent(&self) -> Option<NodeId> {
        self.parent.some()
    }
    /// Blocks from the root: 1 for the first block of a prompt.
    pub fn depth(&self) -> u32 {
        self.depth
    }
    /// The device block: the valid copy, the source of a swap-out, or the destination of a
    /// swap-in (by state).
    pub fn device(&self) -> Option<u32> {
        (self.device != NO_BLOCK).then_some(self.device)
    }
    /// The host block: the valid copy or backup, or the destination of a swap-out (by state).
    pub fn host(&self) -> Option<u32> {
        (self.host != NO_BLOCK).then_some(self.host)
    }
    pub fn state(&self) -> NodeState {
        self.state
    }
    pub fn ref_count(&self) -> u32 {
        self.ref_count
    }
    pub fn hit_count(&self) -> u32 {
        self.hit_count
    }
    pub fn last_access(&self) -> u64 {
        self.last_access
    }
    pub fn child_count(&self) -> u32 {
        self.child_count
    }
    /// The raw id of the copy in flight for this node, if any.
    pub fn transfer(&self) -> Option<u64> {
        (self.transfer != 0).then_some(self.transfer)
    }
    pub fn backup_queued(&self) -> bool {
        self.backup_queued
    }
    /// Whether the node has a valid host copy that no copy in flight is writing.
    pub fn has_valid_host(&self) -> bool {
        self.host != NO_BLOCK && matches!(self.state, NodeState::Device | NodeState::Host)
    }

    fn key(&self, id: NodeId) -> EvictKey {
        EvictKey::new(self.last_access, self.depth, id)
    }
}

/// A mutable view of a node's own fields, handed to [`Tree::update`] closures. The structural
/// fields (parent, children, counts) stay with the tree.
pub struct NodeMut<'a>(&'a mut Node);

impl NodeMut<'_> {
    pub fn set_device(&mut self, block: Option<u32>) {
        self.0.device = block.unwrap_or(NO_BLOCK);
    }
    pub fn set_host(&mut self, block: Option<u32>) {
        self.0.host = block.unwrap_or(NO_BLOCK);
    }
    pub fn set_state(&mut self, state: NodeState) {
        self.0.state = state;
    }
    pub fn set_transfer(&mut self, transfer: Option<u64>) {
        self.0.transfer = transfer.unwrap_or(0);
    }
    pub fn set_backup_queued(&mut self, queued: bool) {
        self.0.backup_queued = queued;
    }
    pub fn hold(&mut self) {
        self.0.ref_count += 1;
    }
    /// # Panics
    /// If the node is not held: releasing more than was held is a programming error.
    pub fn release(&mut self) {
        self.0.ref_count = self
            .0
            .ref_count
            .checked_sub(1)
            .expect("releasing an unheld node is a programming error");
    }
    pub fn count_hit(&mut self) {
        self.0.hit_count = self.0.hit_count.saturating_add(1);
    }
    pub fn touch(&mut self, clock: u64) {
        self.0.last_access = clock;
    }
    pub fn node(&self) -> &Node {
        self.0
    }
}

/// Key of the child index. The hash is kept as two words so that the key aligns to 8 bytes, not
/// 16: an index entry takes 32 bytes instead of 48.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct ChildKey {
    parent: u32,
    hash: [u64; 2],
}

impl ChildKey {
    fn new(parent: NodeId, hash: BlockHash) -> ChildKey {
        ChildKey { parent: parent.0, hash: [hash.0 as u64, (hash.0 >> 64) as u64] }
    }
}

const _: () = assert!(size_of::<(ChildKey, NodeId)>() == 32);

/// The radix tree: arena, child index and candidate sets.
#[derive(Debug)]
pub struct Tree {
    nodes: Vec<Node>,
    free_slots: Vec<NodeId>,
    children: HashMap<ChildKey, NodeId, BuildChildHasher>,
    device_candidates: EvictionSet,
    host_candidates: EvictionSet,
    claimable: EvictionSet,
}

impl std::fmt::Debug for ChildKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "({}, {:016x}{:016x})", self.parent, self.hash[1], self.hash[0])
    }
}

impl Default for Tree {
    fn default() -> Self {
        Tree::new()
    }
}

impl Tree {
    pub fn new() -> Tree {
        Tree {
            nodes: vec![Node::new(BlockHash(0), NodeId::NONE, 0)],
            free_slots: Vec::new(),
            children: HashMap::default(),
            device_candidates: EvictionSet::new(),
            host_candidates: EvictionSet::new(),
            claimable: EvictionSet::new(),
        }
    }

    /// Number of cached blocks (nodes other than the root).
    pub fn len(&self) -> usize {
        self.children.len()
    }

    pub fn is_empty(&self) -> bool {
        self.children.is_empty()
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

    pub fn child(&self, parent: NodeId, hash: BlockHash) -> Option<NodeId> {
        self.children.get(&ChildKey::new(parent, hash)).copied()
    }

    /// The children of `id`, most recently inserted first.
    pub fn children(&self, id: NodeId) -> Children<'_> {
        Children { tree: self, next: self.node(id).first_child }
    }

    /// The least recently used device candidate: a device copy, no child with one, not held,
    /// nothing in flight.
    pub fn first_device_candidate(&self) -> Option<NodeId> {
        self.device_candidates.first().map(|key| key.node)
    }

    /// The device candidates in eviction order.
    pub fn device_candidates(&self) -> impl Iterator<Item = EvictKey> + '_ {
        self.device_candidates.iter().copied()
    }

    pub fn device_candidate_count(&self) -> usize {
        self.device_candidates.len()
    }

    /// The least recently used host candidate: a valid host copy, no children, not held, nothing
    /// in flight.
    pub fn first_host_candidate(&self) -> Option<NodeId> {
        self.host_candidates.first().map(|key| key.node)
    }

    pub fn host_candidate_count(&self) -> usize {
        self.host_candidates.len()
    }

    /// The oldest node being evicted to host whose device block no allocation has claimed yet.
    pub fn first_claimable(&self) -> Option<NodeId> {
        self.claimable.first().map(|key| key.node)
    }

    /// The claimable nodes in eviction order.
    pub fn claimable(&self) -> impl Iterator<Item = EvictKey> + '_ {
        self.claimable.iter().copied()
    }

    pub fn claimable_count(&self) -> usize {
        self.claimable.len()
    }

    /// Whether a node with these fields would be a device candidate.
    pub fn is_device_candidate(&self, id: NodeId) -> bool {
        let node = self.node(id);
        id != NodeId::ROOT
            && node.state == NodeState::Device
            && node.device != NO_BLOCK
            && node.device_child_count == 0
            && node.ref_count == 0
    }

    /// How many children of `id` have a device block.
    pub fn device_child_count(&self, id: NodeId) -> u32 {
        self.node(id).device_child_count
    }

    /// Inserts a new node under `parent` and lets `init` set its fields; it starts as `Device`
    /// with no blocks, unheld, with one hit.
    ///
    /// # Panics
    /// If `parent` already has a child with `hash`: callers look up first.
    pub fn insert(
        &mut self,
        parent: NodeId,
        hash: BlockHash,
        init: impl FnOnce(&mut NodeMut<'_>),
    ) -> NodeId {
        let depth = self.node(parent).depth + 1;
        let node = Node::new(hash, parent, depth);
        let id = match self.free_slots.pop() {
            Some(id) => {
                self.nodes[id.index()] = node;
                id
            }
            None => {
                self.nodes.push(node);
                NodeId(self.nodes.len() as u32 - 1)
            }
        };
        let previous = self.children.insert(ChildKey::new(parent, hash), id);
        assert!(previous.is_none(), "inserting a duplicate child is a programming error");
        let first = self.nodes[parent.index()].first_child;
        self.nodes[id.index()].next_sibling = first;
        if first != NodeId::NONE {
            self.nodes[first.index()].prev_sibling = id;
        }
        self.nodes[parent.index()].first_child = id;
        self.update_counts(parent, |parent| parent.child_count += 1);
        self.update(id, init);
        id
    }

    /// Changes a node's own fields and keeps the derived state in step (module flow).
    pub fn update<R>(&mut self, id: NodeId, change: impl FnOnce(&mut NodeMut<'_>) -> R) -> R {
        self.unfile(id);
        let had_device = self.nodes[id.index()].device != NO_BLOCK;
        let result = change(&mut NodeMut(&mut self.nodes[id.index()]));
        let has_device = self.nodes[id.index()].device != NO_BLOCK;
        if had_device != has_device {
            let parent = self.nodes[id.index()].parent;
            if parent != NodeId::NONE {
                self.update_counts(parent, |parent| {
                    if has_device {
                        parent.device_child_count += 1;
                    } else {
                        parent.device_child_count -= 1;
                    }
                });
            }
        }
        self.file(id);
        result
    }

    /// Removes a node with no children. Its blocks must already be accounted for by the caller.
    ///
    /// # Panics
    /// If the node has children or is the root.
    pub fn remove(&mut self, id: NodeId) {
        assert!(id != NodeId::ROOT, "removing the root is a programming error");
        let node = &self.nodes[id.index()];
        assert!(node.child_count == 0, "removing a node with children is a programming error");
        let (parent, hash, prev, next) =
            (node.parent, node.hash, node.prev_sibling, node.next_sibling);
        self.update(id, |node| node.set_device(None));
        self.unfile(id);
        self.children.remove(&ChildKey::new(parent, hash));
        if prev == NodeId::NONE {
            self.nodes[parent.index()].first_child = next;
        } else {
            self.nodes[prev.index()].next_sibling = next;
        }
        if next != NodeId::NONE {
            self.nodes[next.index()].prev_sibling = prev;
        }
        self.update_counts(parent, |parent| parent.child_count -= 1);
        self.nodes[id.index()] = Node::new(BlockHash(0), NodeId::NONE, 0);
        self.free_slots.push(id);
    }

    /// The subtree under and including `id`, every node after all of its descendants (the order in
    /// which they can be removed).
    pub fn subtree_post_order(&self, id: NodeId) -> Vec<NodeId> {
        let mut order = Vec::new();
        let mut stack = vec![id];
        while let Some(next) = stack.pop() {
            order.push(next);
            stack.extend(self.children(next));
        }
        order.reverse();
        order
    }

    /// Drops every node.
    pub fn clear(&mut self) {
        *self = Tree::new();
    }

    /// Live node ids, root excluded.
    pub fn ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.children.values().copied()
    }

    /// Bytes of heap memory held by the arena, the index and the candidate sets (the sets
    /// estimated from their entry count: a B-tree leaf holds up to 11 keys).
    pub fn heap_bytes(&self) -> usize {
        let arena = self.nodes.capacity() * size_of::<Node>() + self.free_slots.capacity() * 4;
        let index = self.children.capacity() * (size_of::<(ChildKey, NodeId)>() + 1);
        let set_entries =
            self.device_candidates.len() + self.host_candidates.len() + self.claimable.len();
        // A B-tree node of 11 keys, about two thirds full on average.
        let sets = set_entries * size_of::<EvictKey>() * 3 / 2;
        arena + index + sets
    }

    fn update_counts(&mut self, id: NodeId, change: impl FnOnce(&mut Node)) {
        self.unfile(id);
        change(&mut self.nodes[id.index()]);
        self.file(id);
    }

    fn unfile(&mut self, id: NodeId) {
        let node = &mut self.nodes[id.index()];
        if node.filed == 0 {
            return;
        }
        let key = node.key(id);
        if node.filed & IN_DEVICE_SET != 0 {
            self.device_candidates.remove(&key);
        }
        if node.filed & IN_HOST_SET != 0 {
            self.host_candidates.remove(&key);
        }
        if node.filed & IN_CLAIMABLE_SET != 0 {
            self.claimable.remove(&key);
        }
        node.filed = 0;
    }

    fn file(&mut self, id: NodeId) {
        if id == NodeId::ROOT {
            return;
        }
        let filed = self.predicates(id);
        let node = &mut self.nodes[id.index()];
        node.filed = filed;
        let key = node.key(id);
        if filed & IN_DEVICE_SET != 0 {
            self.device_candidates.insert(key);
        }
        if filed & IN_HOST_SET != 0 {
            self.host_candidates.insert(key);
        }
        if filed & IN_CLAIMABLE_SET != 0 {
            self.claimable.insert(key);
        }
    }

    /// The candidate sets a live non-root node belongs in (SPEC section 4).
    fn predicates(&self, id: NodeId) -> u8 {
        let node = &self.nodes[id.index()];
        let mut filed = 0;
        if node.ref_count > 0 {
            return 0;
        }
        if self.is_device_candidate(id) {
            filed |= IN_DEVICE_SET;
        }
        if node.has_valid_host() && node.child_count == 0 {
            filed |= IN_HOST_SET;
        }
        if node.state == NodeState::SwapToHost(SwapOut::Evict) && node.device != NO_BLOCK {
            filed |= IN_CLAIMABLE_SET;
        }
        filed
    }
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
