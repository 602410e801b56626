//! Rule tests of the radix tree: evictable sets per tier (leaf-first LRU, holds, claims), the
//! child index, slot reuse, removal order and snapshots. Every test runs with every registered
//! eviction policy where the rule is the tree's, not the policy's.

use super::policy::Access;
use super::*;

pub(super) fn hash(value: u128) -> BlockHash {
    BlockHash(value)
}

/// Inserts a chain of device nodes with blocks `first_block..` under `parent`, held as a commit
/// holds them; [`release`] ends the "request".
pub(super) fn chain(
    tree: &mut Tree,
    parent: NodeId,
    hashes: &[u128],
    first_block: u32,
) -> Vec<NodeId> {
    let mut ids = Vec::new();
    let mut parent = parent;
    for (offset, &value) in hashes.iter().enumerate() {
        parent = tree.insert(parent, hash(value), |node| {
            node.set_device(Some(first_block + offset as u32));
            node.hold();
            node.access(Access::Commit);
        });
        ids.push(parent);
    }
    ids
}

/// Releases a held path as the end of a request does: tail first.
pub(super) fn release(tree: &mut Tree, path: &[NodeId]) {
    for &id in path.iter().rev() {
        tree.update(id, |node| {
            node.release();
            node.access(Access::Release);
        });
    }
}

pub(super) fn served(
    tree: &mut Tree,
    parent: NodeId,
    hashes: &[u128],
    first_block: u32,
) -> Vec<NodeId> {
    let ids = chain(tree, parent, hashes, first_block);
    release(tree, &ids);
    ids
}

fn trees() -> impl Iterator<Item = Tree> {
    EvictionPolicy::ALL.iter().map(|&policy| Tree::new(policy))
}

#[test]
fn only_the_tail_of_a_chain_is_a_device_candidate() {
    for mut tree in trees() {
        let ids = served(&mut tree, NodeId::ROOT, &[1, 2, 3], 0);
        assert_eq!(tree.first(EvictSet::Device), Some(ids[2]));
        assert_eq!(tree.count(EvictSet::Device), 1);
        tree.check().unwrap();
    }
}

#[test]
fn the_least_recently_used_leaf_goes_first_and_the_deeper_on_ties() {
    let mut tree = Tree::new(EvictionPolicy::Lru);
    let c = served(&mut tree, NodeId::ROOT, &[4], 3);
    let a = chain(&mut tree, NodeId::ROOT, &[1, 2], 0);
    let b = chain(&mut tree, NodeId::ROOT, &[3], 2);
    // One release of a and b together: a's tail, then b, then a's head.
    release(&mut tree, &[a[0], b[0], a[1]]);
    assert_eq!(tree.candidates(EvictSet::Device), vec![c[0], a[1], b[0]]);
    // Evicting a's tail exposes its head, released after b: it goes after b.
    tree.update(a[1], |node| {
        node.set_device(None);
        node.set_host(Some(0));
        node.set_state(NodeState::Host);
    });
    assert_eq!(tree.candidates(EvictSet::Device), vec![c[0], b[0], a[0]]);
    tree.check().unwrap();
}

#[test]
fn a_parent_exposed_by_its_released_childs_eviction_goes_first() {
    let mut tree = Tree::new(EvictionPolicy::Lru);
    let old = served(&mut tree, NodeId::ROOT, &[1, 2], 0);
    let newer = served(&mut tree, NodeId::ROOT, &[3], 2);
    tree.remove(old[1]);
    assert_eq!(tree.candidates(EvictSet::Device), vec![old[0], newer[0]]);
    tree.check().unwrap();
}

/// The members of `set`, in no particular order.
fn members(tree: &Tree, set: EvictSet) -> Vec<NodeId> {
    sorted(&tree.candidates(set))
}

fn sorted(ids: &[NodeId]) -> Vec<NodeId> {
    let mut ids = ids.to_vec();
    ids.sort();
    ids
}

/// A removal, or a change that takes a node off a tier, files the parent it exposes at once,
/// in the one set or the two sets the parent joins, at its place in the policy's order: no
/// change leaves a node in no set for its caller to file.
#[test]
fn a_parent_exposed_by_a_removal_or_a_change_below_it_is_filed_at_once() {
    for mut tree in trees() {
        let older = served(&mut tree, NodeId::ROOT, &[9], 5);
        let chain = served(&mut tree, NodeId::ROOT, &[1, 2, 3], 0);
        // The tail leaves the tree: its parent is a device candidate, after `older`.
        tree.remove(chain[2]);
        assert_eq!(members(&tree, EvictSet::Device), sorted(&[older[0], chain[1]]));
        tree.check().unwrap();
        // The next one's device copy is dropped over a backup: a host candidate, and its parent
        // a device candidate.
        tree.update(chain[1], |node| node.set_host(Some(4)));
        tree.update(chain[1], |node| {
            node.set_device(None);
            node.set_state(NodeState::Host);
        });
        assert_eq!(tree.candidates(EvictSet::Host), vec![chain[1]]);
        assert_eq!(members(&tree, EvictSet::Device), sorted(&[older[0], chain[0]]));
        if tree.eviction_policy() == EvictionPolicy::Lru {
            assert_eq!(tree.candidates(EvictSet::Device), vec![older[0], chain[0]]);
        }
        tree.check().unwrap();
        // The host-only leaf goes to storage: its host-only parent (once off the device) is a
        // host candidate.
        tree.update(chain[0], |node| {
            node.set_host(Some(5));
            node.set_device(None);
            node.set_state(NodeState::Host);
        });
        tree.update(chain[1], |node| {
            node.set_host(None);
            node.set_state(NodeState::HostToStorage(StoreOut::Evict));
            node.set_transfer(Some(3));
        });
        assert_eq!(tree.candidates(EvictSet::Host), vec![chain[0]]);
        tree.check().unwrap();
    }
}

/// An allocation's count of what evictions could free asks whether a parent joins a set once
/// its children on that set's tiers are gone: held, in flight or without the set's block it
/// does not; the count of its children does not matter.
#[test]
fn a_parent_joins_a_set_once_its_children_go_unless_held_in_flight_or_without_the_block() {
    for mut tree in trees() {
        let chain = served(&mut tree, NodeId::ROOT, &[1, 2], 0);
        assert!(tree.joins_once_children_go(chain[0], EvictSet::Device));
        assert!(!tree.joins_once_children_go(chain[0], EvictSet::Host), "no host copy");
        tree.update(chain[0], |node| node.set_host(Some(4)));
        assert!(tree.joins_once_children_go(chain[0], EvictSet::Host));
        tree.update(chain[0], |node| node.hold());
        assert!(!tree.joins_once_children_go(chain[0], EvictSet::Device), "held");
        tree.update(chain[0], |node| {
            node.release();
            node.set_state(NodeState::SwapToHost(SwapOut::Backup));
            node.set_transfer(Some(2));
        });
        assert!(!tree.joins_once_children_go(chain[0], EvictSet::Device), "in flight");
        assert!(!tree.joins_once_children_go(NodeId::ROOT, EvictSet::Device), "the root");
        tree.check().unwrap();
    }
}

#[test]
fn a_held_node_is_not_a_candidate_until_released() {
    for mut tree in trees() {
        let ids = served(&mut tree, NodeId::ROOT, &[1], 0);
        tree.update(ids[0], |node| node.hold());
        assert_eq!(tree.first(EvictSet::Device), None);
        tree.check().unwrap();
        release(&mut tree, &ids);
        assert_eq!(tree.first(EvictSet::Device), Some(ids[0]));
        tree.check().unwrap();
    }
}

#[test]
fn losing_the_last_device_child_makes_the_parent_a_candidate() {
    for mut tree in trees() {
        let ids = served(&mut tree, NodeId::ROOT, &[1, 2], 0);
        tree.update(ids[1], |node| {
            node.set_device(None);
            node.set_host(Some(7));
            node.set_state(NodeState::Host);
        });
        assert_eq!(tree.first(EvictSet::Device), Some(ids[0]));
        assert_eq!(tree.first(EvictSet::Host), Some(ids[1]), "a host-only leaf");
        tree.check().unwrap();
    }
}

#[test]
fn a_host_candidate_has_no_children_at_all() {
    for mut tree in trees() {
        let ids = served(&mut tree, NodeId::ROOT, &[1, 2], 0);
        tree.update(ids[0], |node| node.set_host(Some(3)));
        assert_eq!(tree.first(EvictSet::Host), None);
        tree.remove(ids[1]);
        assert_eq!(tree.first(EvictSet::Host), Some(ids[0]));
        assert_eq!(tree.first(EvictSet::Device), Some(ids[0]), "in both sets at once");
        tree.check().unwrap();
    }
}

#[test]
fn an_evicting_node_is_claimable_and_not_a_candidate() {
    for mut tree in trees() {
        let ids = served(&mut tree, NodeId::ROOT, &[1], 0);
        tree.update(ids[0], |node| {
            node.set_host(Some(0));
            node.set_state(NodeState::SwapToHost(SwapOut::Evict));
            node.set_transfer(Some(9));
        });
        assert_eq!(tree.first(EvictSet::Claimable), Some(ids[0]));
        assert_eq!((tree.first(EvictSet::Device), tree.first(EvictSet::Host)), (None, None));
        assert_eq!(tree.node(ids[0]).transfer(), Some(9));
        tree.check().unwrap();
    }
}

#[test]
fn removed_slots_are_reused_and_the_index_forgets_them() {
    for mut tree in trees() {
        let ids = served(&mut tree, NodeId::ROOT, &[1], 0);
        tree.remove(ids[0]);
        assert_eq!(tree.child(NodeId::ROOT, hash(1)), None);
        tree.check().unwrap();
        let again = served(&mut tree, NodeId::ROOT, &[2], 0);
        assert_eq!(again[0], ids[0]);
        assert_eq!(tree.len(), 1);
        tree.check().unwrap();
    }
}

#[test]
fn the_same_hash_under_two_parents_is_two_nodes() {
    for mut tree in trees() {
        let a = served(&mut tree, NodeId::ROOT, &[1, 9], 0);
        let b = served(&mut tree, NodeId::ROOT, &[2, 9], 2);
        assert_ne!(a[1], b[1]);
        assert_eq!(tree.child(a[0], hash(9)), Some(a[1]));
        assert_eq!(tree.child(b[0], hash(9)), Some(b[1]));
        tree.check().unwrap();
    }
}

#[test]
fn the_index_finds_every_node_through_growth_and_removals() {
    let mut tree = Tree::default();
    // Many children of one parent with clustered hashes, so that groups fill and overflow.
    let ids: Vec<NodeId> =
        (0..2_000u128).map(|value| served(&mut tree, NodeId::ROOT, &[value << 64], 0)[0]).collect();
    tree.check().unwrap();
    for (value, &id) in ids.iter().enumerate().filter(|(value, _)| value % 3 == 0) {
        assert_eq!(tree.child(NodeId::ROOT, hash((value as u128) << 64)), Some(id));
        tree.remove(id);
    }
    tree.check().unwrap();
    for (value, &id) in ids.iter().enumerate() {
        let found = tree.child(NodeId::ROOT, hash((value as u128) << 64));
        assert_eq!(found, (value % 3 != 0).then_some(id), "{value}");
    }
    assert_eq!(tree.len(), 2_000 - 667);
}

#[test]
fn a_subtree_is_removable_children_first() {
    for mut tree in trees() {
        let a = served(&mut tree, NodeId::ROOT, &[1, 2, 3], 0);
        let b = served(&mut tree, a[0], &[4], 3);
        assert_eq!(tree.child_count(a[0]), 2);
        assert_eq!((tree.depth(a[2]), tree.depth(b[0])), (3, 2));
        // Leaves first, as the manager drops a subtree.
        for id in [a[2], a[1], b[0], a[0]] {
            tree.remove(id);
            tree.check().unwrap();
        }
        assert!(tree.is_empty());
    }
}

#[test]
fn a_snapshot_stops_at_the_requested_depth() {
    let mut tree = Tree::default();
    served(&mut tree, NodeId::ROOT, &[1, 2, 3], 0);
    served(&mut tree, NodeId::ROOT, &[4], 3);
    let snapshot = tree.snapshot(2);
    assert_eq!((snapshot.total_nodes, snapshot.nodes.len()), (4, 3));
    assert!(snapshot.nodes.iter().all(|node| node.depth <= 2));
    assert_eq!(snapshot.nodes.iter().map(|node| node.depth).collect::<Vec<_>>(), vec![1, 2, 1]);
    assert!(serde_json::to_string(&snapshot).unwrap().contains("\"state\":\"device\""));
}

#[test]
fn clearing_leaves_an_empty_consistent_tree() {
    for mut tree in trees() {
        served(&mut tree, NodeId::ROOT, &[1, 2], 0);
        tree.clear();
        assert!(tree.is_empty() && tree.first(EvictSet::Device).is_none());
        tree.check().unwrap();
        served(&mut tree, NodeId::ROOT, &[1], 0);
        tree.check().unwrap();
    }
}

#[test]
fn under_conv_a_trimmed_chain_moves_its_turn_end_up_and_a_removed_branch_leaves_a_ghost() {
    let mut tree = Tree::new(EvictionPolicy::Conv);
    tree.configure_policy(64, 0);
    // Turn 1: [1, 2], finished.
    let first = chain(&mut tree, NodeId::ROOT, &[1, 2], 0);
    tree.request_ending(1);
    release(&mut tree, &first);
    tree.turn_ended(first[1]);
    // Its tail is evicted: the head, a sole child's parent, is now the end of the turn.
    tree.remove(first[1]);
    assert_eq!(tree.request_started(Some(first[0]), None), 2);
    tree.check().unwrap();
    // Turn 2 (generation 2) branches off the head with [3] and finishes; a sibling [4] is cached.
    let second = chain(&mut tree, first[0], &[3], 2);
    tree.update(first[0], |node| {
        node.hold();
        node.access(Access::Hit);
    });
    tree.request_ending(2);
    release(&mut tree, &[first[0], second[0]]);
    tree.turn_ended(second[0]);
    served(&mut tree, first[0], &[4], 3);
    // Removing [3], which has a sibling, leaves a ghost: the next turn is recognised by it.
    tree.remove(second[0]);
    assert_eq!(tree.request_started(Some(first[0]), Some(hash(3))), 3);
    assert_eq!(tree.request_started(Some(first[0]), Some(hash(3))), 1, "taken once");
    tree.check().unwrap();
}

#[test]
fn child_counts_saturate_past_65535_children_and_are_recounted_exactly_on_the_way_down() {
    let mut tree = Tree::new(EvictionPolicy::Lru);
    let parent = served(&mut tree, NodeId::ROOT, &[1], 0)[0];
    let children: Vec<NodeId> = (0..65_537u32)
        .map(|index| {
            tree.insert(parent, hash(1_000 + u128::from(index)), |node| {
                node.set_device(Some(1 + index));
                node.set_host(Some(index));
            })
        })
        .collect();
    assert_eq!(tree.node(parent).device_children, COUNT_SATURATED);
    assert_eq!(tree.device_child_count(parent), 65_537);
    assert_eq!(tree.upper_child_count(parent), 65_537);
    tree.check().unwrap();
    // All but two children leave the device, then all but one the host tier (storage-only):
    // each count falls through saturation to an exact count.
    for &child in &children[2..] {
        tree.update(child, |node| {
            node.set_device(None);
            node.set_state(NodeState::Host);
        });
    }
    assert_eq!(tree.node(parent).device_children, 2);
    for &child in &children[1..] {
        tree.update(child, |node| {
            node.set_device(None);
            node.set_host(None);
            node.set_state(NodeState::Storage);
            node.set_stored(true);
        });
    }
    assert_eq!(tree.node(parent).device_children, 1);
    assert_eq!(tree.node(parent).upper_children, 1);
    assert!(tree.first(EvictSet::Device) != Some(parent));
    tree.check().unwrap();
    tree.update(children[0], |node| {
        node.set_device(None);
        node.set_state(NodeState::Host);
    });
    assert_eq!(tree.node(parent).device_children, 0);
    assert_eq!(tree.first(EvictSet::Device), Some(parent), "its last device child left");
    tree.check().unwrap();
}
