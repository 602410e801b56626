//! Rule tests of the radix tree: eviction candidates per tier (leaf-first LRU, holds, claims), slot
//! reuse, removal order and snapshots.

use super::*;

fn hash(value: u128) -> BlockHash {
    BlockHash(value)
}

/// Inserts a chain of device nodes with blocks `first..` under `parent`, touched at `clock`.
fn chain(
    tree: &mut Tree,
    parent: NodeId,
    hashes: &[u128],
    first_block: u32,
    clock: u64,
) -> Vec<NodeId> {
    let mut ids = Vec::new();
    let mut parent = parent;
    for (offset, &value) in hashes.iter().enumerate() {
        parent = tree.insert(parent, hash(value), |node| {
            node.set_device(Some(first_block + offset as u32));
            node.touch(clock);
        });
        ids.push(parent);
    }
    ids
}

#[test]
fn only_the_tail_of_a_chain_is_a_device_candidate() {
    let mut tree = Tree::new();
    let ids = chain(&mut tree, NodeId::ROOT, &[1, 2, 3], 0, 1);
    assert_eq!(tree.first_device_candidate(), Some(ids[2]));
    assert_eq!(tree.device_candidate_count(), 1);
    tree.check().unwrap();
}

#[test]
fn the_least_recently_used_leaf_goes_first_and_the_deeper_on_ties() {
    let mut tree = Tree::new();
    let a = chain(&mut tree, NodeId::ROOT, &[1, 2], 0, 5);
    let b = chain(&mut tree, NodeId::ROOT, &[3], 2, 5);
    let c = chain(&mut tree, NodeId::ROOT, &[4], 3, 2);
    let order: Vec<NodeId> = tree.device_candidates().map(|key| key.node).collect();
    assert_eq!(order, vec![c[0], a[1], b[0]]);
}

#[test]
fn a_held_node_is_not_a_candidate_until_released() {
    let mut tree = Tree::new();
    let ids = chain(&mut tree, NodeId::ROOT, &[1], 0, 1);
    tree.update(ids[0], |node| node.hold());
    assert_eq!(tree.first_device_candidate(), None);
    tree.update(ids[0], |node| node.release());
    assert_eq!(tree.first_device_candidate(), Some(ids[0]));
    tree.check().unwrap();
}

#[test]
fn losing_the_last_device_child_makes_the_parent_a_candidate() {
    let mut tree = Tree::new();
    let ids = chain(&mut tree, NodeId::ROOT, &[1, 2], 0, 1);
    tree.update(ids[1], |node| {
        node.set_device(None);
        node.set_host(Some(7));
        node.set_state(NodeState::Host);
    });
    assert_eq!(tree.first_device_candidate(), Some(ids[0]));
    assert_eq!(tree.first_host_candidate(), Some(ids[1]), "a host-only leaf");
    tree.check().unwrap();
}

#[test]
fn a_host_candidate_has_no_children_at_all() {
    let mut tree = Tree::new();
    let ids = chain(&mut tree, NodeId::ROOT, &[1, 2], 0, 1);
    tree.update(ids[0], |node| node.set_host(Some(3)));
    assert_eq!(tree.first_host_candidate(), None);
    tree.remove(ids[1]);
    assert_eq!(tree.first_host_candidate(), Some(ids[0]));
    tree.check().unwrap();
}

#[test]
fn an_evicting_node_is_claimable_and_not_a_candidate() {
    let mut tree = Tree::new();
    let ids = chain(&mut tree, NodeId::ROOT, &[1], 0, 1);
    tree.update(ids[0], |node| {
        node.set_host(Some(0));
        node.set_state(NodeState::SwapToHost(SwapOut::Evict));
        node.set_transfer(Some(9));
    });
    assert_eq!(tree.first_claimable(), Some(ids[0]));
    assert_eq!((tree.first_device_candidate(), tree.first_host_candidate()), (None, None));
    tree.check().unwrap();
}

#[test]
fn removed_slots_are_reused_and_the_index_forgets_them() {
    let mut tree = Tree::new();
    let ids = chain(&mut tree, NodeId::ROOT, &[1], 0, 1);
    tree.remove(ids[0]);
    assert_eq!(tree.child(NodeId::ROOT, hash(1)), None);
    let again = chain(&mut tree, NodeId::ROOT, &[2], 0, 1);
    assert_eq!(again[0], ids[0]);
    assert_eq!(tree.len(), 1);
    tree.check().unwrap();
}

#[test]
fn the_same_hash_under_two_parents_is_two_nodes() {
    let mut tree = Tree::new();
    let a = chain(&mut tree, NodeId::ROOT, &[1, 9], 0, 1);
    let b = chain(&mut tree, NodeId::ROOT, &[2, 9], 2, 1);
    assert_ne!(a[1], b[1]);
    assert_eq!(tree.child(a[0], hash(9)), Some(a[1]));
    tree.check().unwrap();
}

#[test]
fn a_subtree_comes_out_children_first() {
    let mut tree = Tree::new();
    let a = chain(&mut tree, NodeId::ROOT, &[1, 2, 3], 0, 1);
    let b = chain(&mut tree, a[0], &[4], 3, 1);
    let order = tree.subtree_post_order(a[0]);
    assert_eq!(order.len(), 4);
    assert_eq!(*order.last().unwrap(), a[0]);
    let position = |id| order.iter().position(|&x| x == id).unwrap();
    assert!(position(a[2]) < position(a[1]) && position(b[0]) < position(a[0]));
    for id in order {
        tree.remove(id);
    }
    assert!(tree.is_empty());
    tree.check().unwrap();
}

#[test]
fn a_snapshot_stops_at_the_requested_depth() {
    let mut tree = Tree::new();
    chain(&mut tree, NodeId::ROOT, &[1, 2, 3], 0, 1);
    chain(&mut tree, NodeId::ROOT, &[4], 3, 1);
    let snapshot = tree.snapshot(2);
    assert_eq!((snapshot.total_nodes, snapshot.nodes.len()), (4, 3));
    assert!(snapshot.nodes.iter().all(|node| node.depth <= 2));
    assert!(serde_json::to_string(&snapshot).unwrap().contains("\"state\":\"device\""));
}
