//! Every change to the tree, each keeping its invariants at its return: a node joins
//! ([`Tree::insert`]), changes ([`Tree::update`], and its named case, the release at the end
//! of a request) or leaves ([`Tree::remove`]), and the tree files it, and its parent when the
//! change reaches the parent's child counts, in the sets their fields admit (the flow in the
//! [module documentation](super)). No method leaves a node unfiled for its caller to file.
//!
//! Each operation dispatches on the eviction policy once ([`with_policy`]) and does its work in
//! the functions below, generic over the policy, so that their calls on it are direct.

use super::index::ChildIndex;
use super::node::{Node, NodeId, NodeMut, COUNT_SATURATED};
use super::policy::{with_policy, Access, Policy};
use super::policy::{EvictSet, Membership};
use super::{count_children, sets_of, Front, Tree};
use crate::hash::BlockHash;

impl Tree {
    /// Inserts a new node under `parent` and lets `init` set its fields; it starts as `Device`
    /// with no blocks, unheld, with one hit. Callers hold it (a commit does): the policy orders
    /// a node from the release that ends its first holder.
    ///
    /// # Panics
    /// In debug builds, if `parent` already has a child with `hash`: callers look up first.
    pub fn insert(
        &mut self,
        parent: NodeId,
        hash: BlockHash,
        init: impl FnOnce(&mut NodeMut<'_>),
    ) -> NodeId {
        let (id, access) = self.link_new(parent, hash, init);
        let Tree { nodes, policy, front, .. } = self;
        with_policy!(policy, policy => {
            refile(nodes, policy, front, parent, None);
            refile(nodes, policy, front, id, access);
        });
        id
    }

    /// Inserts a chain of new nodes: the first, keyed by `hashes[0]`, under `parent`, each next
    /// one under the one before, `init(i, node)` setting the fields of the `i`-th as
    /// [`Tree::insert`]'s `init` does. Their ids are appended to `path`, the first first. Each
    /// node is filed once, when its child has joined (the last at the end), in the order
    /// [`Tree::insert`] one by one would file them last.
    pub fn insert_chain(
        &mut self,
        parent: NodeId,
        hashes: &[BlockHash],
        mut init: impl FnMut(usize, &mut NodeMut<'_>),
        path: &mut Vec<NodeId>,
    ) {
        debug_assert!(
            hashes.first().is_none_or(|&hash| self.child(parent, hash).is_none()),
            "inserting a duplicate child is a programming error"
        );
        path.reserve(hashes.len());
        // One dispatch on the policy for the whole chain.
        let Tree { nodes, free_slots, index, policy, front } = self;
        with_policy!(policy, policy => {
            // The node inserted last and its access, filed once its child joined.
            let (mut last, mut access) = (parent, None);
            for (at, &hash) in hashes.iter().enumerate() {
                let slot = take_slot(nodes, free_slots, policy);
                let joined = link(nodes, index, slot, last, hash, |node| init(at, node));
                refile(nodes, policy, front, last, access);
                path.push(slot);
                (last, access) = (slot, joined);
            }
            refile(nodes, policy, front, last, access);
        });
    }

    /// [`Tree::insert`] but the filing: the new node is in the arena, the index and its
    /// parent's child list and counts, and neither it nor its parent is filed yet. Returns the
    /// node and the access its `init` recorded.
    fn link_new(
        &mut self,
        parent: NodeId,
        hash: BlockHash,
        init: impl FnOnce(&mut NodeMut<'_>),
    ) -> (NodeId, Option<Access>) {
        debug_assert!(
            self.child(parent, hash).is_none(),
            "inserting a duplicate child is a programming error"
        );
        let Tree { nodes, free_slots, index, policy, .. } = self;
        let slot = with_policy!(policy, policy => take_slot(nodes, free_slots, policy));
        (slot, link(nodes, index, slot, parent, hash, init))
    }

    /// Doubles the arena, which is full (or holds the root only), and makes the policy room for
    /// the new ids ([`grow_arena`]).
    pub(super) fn grow_arena(&mut self) {
        grow_arena(&mut self.nodes);
        self.policy.reserve_nodes(self.nodes.capacity());
    }

    /// Changes a node's own fields and keeps the derived state in step (module flow).
    pub fn update<R>(&mut self, id: NodeId, change: impl FnOnce(&mut NodeMut<'_>) -> R) -> R {
        let node = &mut self.nodes[id.index()];
        let had_device = node.device().is_some();
        let mut view = NodeMut { node, access: None, upper_changed: false };
        let result = change(&mut view);
        let change = Change { had_device, upper_changed: view.upper_changed, access: view.access };
        self.changed(id, change);
        result
    }

    /// [`Tree::update`] once its closure changed node `id`.
    fn changed(&mut self, id: NodeId, change: Change) {
        let Tree { nodes, policy, front, .. } = self;
        let nodes = nodes.as_mut_slice();
        with_policy!(policy, policy => changed(nodes, policy, front, id, change));
    }

    /// Releases one hold of `id` at the end of a request ([`Access::Release`]).
    ///
    /// # Panics
    /// If the node is not held: releasing more than was held is a programming error.
    pub fn release(&mut self, id: NodeId) {
        self.release_path(&[id]);
    }

    /// Releases every node of `path` once, the last first: the end of a request, its tail
    /// released first (so that for equal recency the deeper block goes first). A release
    /// changes neither blocks nor tiers, so parents stay as they are.
    ///
    /// # Panics
    /// If a node is not held.
    pub fn release_path(&mut self, path: &[NodeId]) {
        let Tree { nodes, policy, front, .. } = self;
        let nodes = nodes.as_mut_slice();
        with_policy!(policy, policy => {
            for &id in path.iter().rev() {
                nodes[id.index()].release_one();
                refile(nodes, policy, front, id, Some(Access::Release));
            }
        });
    }

    /// Removes a node with no children, and files its parent in the sets it belongs in now.
    /// Its blocks must already be accounted for by the caller.
    ///
    /// # Panics
    /// If the node has children or is the root.
    #[inline(always)] // into the eviction engine's loop (see `manager/evict.rs`)
    pub fn remove(&mut self, id: NodeId) {
        let Tree { nodes, free_slots, index, policy, front } = self;
        let nodes = nodes.as_mut_slice();
        with_policy!(policy, policy => remove(nodes, free_slots, index, policy, front, id));
    }

    /// Drops every node.
    pub fn clear(&mut self) {
        self.nodes.truncate(1);
        self.nodes[0] = Node::new(BlockHash(0), NodeId::NONE);
        self.free_slots = NodeId::NONE;
        self.index.clear();
        self.policy.clear();
        self.front = Front::NONE;
        self.policy.reserve_nodes(self.nodes.capacity());
    }
}

/// A free slot of arena `nodes` for a new node (a removed node's, else a fresh one at the end),
/// taken off the list of free slots; a full arena doubles ([`Tree::grow_arena`]) and makes the
/// policy room for the new ids.
#[inline]
fn take_slot<P: Policy>(nodes: &mut Vec<Node>, free_slots: &mut NodeId, policy: &mut P) -> NodeId {
    match free_slots.some() {
        Some(id) => {
            *free_slots = nodes[id.index()].next_sibling;
            id
        }
        None => {
            let id = NodeId(u32::try_from(nodes.len()).expect("fewer than 2^32 nodes"));
            nodes.push(Node::new(BlockHash(0), NodeId::NONE));
            if nodes.len() == nodes.capacity() {
                grow_arena(nodes);
                policy.reserve_nodes(nodes.capacity());
            }
            id
        }
    }
}

/// Doubles arena `nodes`, which is full (or holds the root only), and touches the new half now:
/// writing the spare slots (they stay outside the vector) makes the kernel map their pages in
/// this one call rather than in the first insertion into each page, one request after another.
/// The caller makes the policy room for the new ids.
#[cold]
fn grow_arena(nodes: &mut Vec<Node>) {
    nodes.reserve(nodes.len());
    for slot in nodes.spare_capacity_mut() {
        slot.write(Node::new(BlockHash(0), NodeId::NONE));
    }
}

/// Writes a new node keyed by `hash` under `parent` into free slot `id` and lets `init` set its
/// fields: the node is in the index and its parent's child list and counts, and neither it nor
/// its parent is filed yet. Returns the access `init` recorded.
#[inline]
fn link(
    nodes: &mut [Node],
    index: &mut ChildIndex,
    id: NodeId,
    parent: NodeId,
    hash: BlockHash,
    init: impl FnOnce(&mut NodeMut<'_>),
) -> Option<Access> {
    debug_assert!(
        parent == NodeId::ROOT || nodes[parent.index()].parent != NodeId::NONE,
        "inserting under a node that is not live is a programming error"
    );
    let first = nodes[parent.index()].first_child;
    let mut node = Node::new(hash, parent);
    node.next_sibling = first;
    let mut view = NodeMut { node: &mut node, access: None, upper_changed: false };
    init(&mut view);
    let access = view.access;
    let (has_device, is_upper, words) =
        (node.device().is_some(), node.is_upper(), *node.hash_words());
    nodes[id.index()] = node;
    index.insert(id, &words, nodes);
    if first != NodeId::NONE {
        nodes[first.index()].prev_sibling = id;
    }
    let parent_node = &mut nodes[parent.index()];
    parent_node.first_child = id;
    // Saturating: a saturated count means "at least that many".
    parent_node.device_children = parent_node.device_children.saturating_add(u16::from(has_device));
    parent_node.upper_children = parent_node.upper_children.saturating_add(u16::from(is_upper));
    access
}

/// What an update's closure changed of a node beyond its own fields ([`changed`]).
#[derive(Clone, Copy)]
struct Change {
    /// Whether the node had its device block before.
    had_device: bool,
    /// Whether it went from above storage to storage-only or back.
    upper_changed: bool,
    /// The access it recorded.
    access: Option<Access>,
}

/// [`Tree::update`] once its closure changed node `id`: the parent's child counts and sets if
/// the node gained or lost its device block or went to or from storage-only, then the node's
/// own sets, telling the policy of the access.
#[inline]
fn changed<P: Policy>(
    nodes: &mut [Node],
    policy: &mut P,
    front: &mut Front,
    id: NodeId,
    change: Change,
) {
    let node = &nodes[id.index()];
    let (parent, has_device, is_upper) = (node.parent, node.device().is_some(), node.is_upper());
    let device_changed = change.had_device != has_device;
    let parent_counts = (device_changed || change.upper_changed) && parent != NodeId::NONE;
    if parent_counts {
        let parent_node = &mut nodes[parent.index()];
        let mut recount = false;
        if device_changed {
            recount |= !count_child(&mut parent_node.device_children, has_device);
        }
        if change.upper_changed {
            recount |= !count_child(&mut parent_node.upper_children, is_upper);
        }
        if recount {
            recount_children(nodes, parent);
        }
    }
    // The node first: when it leaves the front of a set, its parent may take its place.
    refile(nodes, policy, front, id, change.access);
    if parent_counts {
        refile(nodes, policy, front, parent, None);
    }
}

/// [`Tree::remove`] on the tree's fields borrowed apart.
#[inline(always)] // as `Tree::remove`
fn remove<P: Policy>(
    nodes: &mut [Node],
    free_slots: &mut NodeId,
    index: &mut ChildIndex,
    policy: &mut P,
    front: &mut Front,
    id: NodeId,
) {
    assert!(id != NodeId::ROOT, "removing the root is a programming error");
    let node = &mut nodes[id.index()];
    assert!(!node.has_children(), "removing a node with children is a programming error");
    let (parent, prev, next, sets) =
        (node.parent, node.prev_sibling, node.next_sibling, node.membership());
    let (had_device, was_upper) = (node.device().is_some(), node.is_upper());
    if !sets.is_empty() {
        leave(policy, front, id, sets);
    }
    if P::HEARS_REMOVALS {
        let sole_child = parent != NodeId::ROOT && prev == NodeId::NONE && next == NodeId::NONE;
        policy.removing(id, node.hash(), sole_child.then_some(parent));
    }
    index.remove(id, node.hash_words());
    node.mark_removed(*free_slots);
    *free_slots = id;
    if next != NodeId::NONE {
        nodes[next.index()].prev_sibling = prev;
    }
    if prev != NodeId::NONE {
        nodes[prev.index()].next_sibling = next;
    }
    let parent_node = &mut nodes[parent.index()];
    if prev == NodeId::NONE {
        parent_node.first_child = next;
    }
    let mut recount = false;
    if had_device {
        recount |= !count_child(&mut parent_node.device_children, false);
    }
    if was_upper {
        recount |= !count_child(&mut parent_node.upper_children, false);
    }
    if recount {
        recount_children(nodes, parent);
    }
    refile(nodes, policy, front, parent, None);
}

/// Counts one child more (`joined`) or fewer in a child count. A saturated count stays
/// saturated on the way up ("at least that many"); on the way down it is left for the caller
/// to recount from the child list ([`recount_children`]): `false` then.
#[inline]
fn count_child(count: &mut u16, joined: bool) -> bool {
    if joined {
        *count = count.saturating_add(1);
    } else if *count != COUNT_SATURATED {
        *count -= 1;
    } else {
        return false;
    }
    true
}

/// Sets the child counts of `parent` to the exact counts of its child list (saturating), when
/// a saturated one would fall ([`count_child`]).
#[cold]
fn recount_children(nodes: &mut [Node], parent: NodeId) {
    let (device, upper) =
        (count_children(nodes, parent, false), count_children(nodes, parent, true));
    let node = &mut nodes[parent.index()];
    node.device_children = u16::try_from(device).unwrap_or(COUNT_SATURATED);
    node.upper_children = u16::try_from(upper).unwrap_or(COUNT_SATURATED);
}

/// Re-files `id` in the sets it belongs in now, telling the policy about `access` (the flow of
/// [`super::policy`]: it leaves its old sets, is touched in none, and enters its new ones).
// Inline, with `enter` and `leave`, into every change: each caller keeps only its own case (a
// removal's parent, a release's access). Out of line it costs 16% more instructions per request
// (callgrind, `kvshm replay` of the Mooncake trace at 5,859 device blocks: 208M against 179M).
#[inline(always)]
fn refile<P: Policy>(
    nodes: &mut [Node],
    policy: &mut P,
    front: &mut Front,
    id: NodeId,
    access: Option<Access>,
) {
    let node = &mut nodes[id.index()];
    let old = node.membership();
    // The root's fields admit no set: it has no block and is `Device`.
    let new = sets_of(node, node.device_children, node.upper_children);
    debug_assert!(id != NodeId::ROOT || new.is_empty(), "the root is in no set");
    let access = access.filter(|&access| policy.wants(access));
    if old == new && access.is_none() {
        return;
    }
    if !old.is_empty() {
        leave(policy, front, id, old);
    }
    if let Some(access) = access {
        policy.touch(id, node.hash(), access);
    }
    if !new.is_empty() {
        enter(policy, front, id, new);
    }
    node.set_membership(new);
}

/// `id`, in no set, joins `sets` (not empty): as the front of the one set it joins, if it
/// would be that set's first member and the set has no front, else with the policy, after the
/// fronts of its sets (which it may go before).
#[inline(always)] // as `refile`
fn enter<P: Policy>(policy: &mut P, front: &mut Front, id: NodeId, sets: Membership) {
    if let Some((set, slot)) = Front::alone(sets) {
        if front.0[slot] == NodeId::NONE && policy.would_come_first(id, set) {
            front.0[slot] = id;
            return;
        }
    }
    for set in [EvictSet::Device, EvictSet::Host] {
        if let Some(slot) = Front::slot(set).filter(|_| sets.contains(set)) {
            if let Some(first) = front.0[slot].some() {
                front.0[slot] = NodeId::NONE;
                policy.enter(first, Membership::NONE.with(set));
            }
        }
    }
    policy.enter(id, sets);
}

/// `id` leaves `sets`, the sets it is in: the front of its one set, or the policy's.
#[inline(always)] // as `refile`
fn leave<P: Policy>(policy: &mut P, front: &mut Front, id: NodeId, sets: Membership) {
    if let Some((_, slot)) = Front::alone(sets) {
        if front.0[slot] == id {
            front.0[slot] = NodeId::NONE;
            return;
        }
    }
    policy.leave(id, sets);
}
