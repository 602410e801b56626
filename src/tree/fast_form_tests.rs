//! Differential tests of the tree's fast forms (a match's `hold_hit`, a commit's `insert_chain`
//! and the end of a request's `release_path`; an allocation's `drop_device_leaves` without a host
//! tier; the write-back path's `start_claimed_swap_out`, `land_attached_claimed_swap_out`,
//! `drop_device_copy_exposing`, `remove_exposing_host` and `update_exposing_host`; the swap-in's
//! `start_swap_in_of_held` and `land_swap_in`): each, applied to one of two trees built alike,
//! must leave what the general [`Tree::insert`], [`Tree::update`] or [`Tree::remove`] leaves in
//! the other.

use super::tests::{hash, served};
use super::twin_tests::{device_without_host, serving_parents};
use super::*;
use crate::test_rng::picker;

/// Asserts that two trees hold the same node records (free slots included), stamps and sets,
/// in child indexes of the same size.
pub(crate) fn same(a: &Tree, b: &Tree, what: &str) {
    assert_eq!(a.nodes.len(), b.nodes.len(), "{what}");
    assert_eq!(
        (a.index.len(), a.index.heap_bytes()),
        (b.index.len(), b.index.heap_bytes()),
        "{what}: the child indexes' entries and sizes"
    );
    for (slot, (x, y)) in a.nodes.iter().zip(&b.nodes).enumerate() {
        assert_eq!(format!("{x:?}"), format!("{y:?}"), "{what}: slot {slot}");
        let id = NodeId(slot as u32);
        if a.is_live(id) {
            assert_eq!(a.last_access(id), b.last_access(id), "{what}: stamp of {id:?}");
        }
    }
    for set in EvictSet::ALL {
        assert_eq!(a.candidates(set), b.candidates(set), "{what}: {set:?}");
    }
    a.check().unwrap();
    b.check().unwrap();
}

/// Every fast form of a request's match, commit and end and of the write-back path, applied to
/// one of two trees built alike, leaves that tree as [`Tree::insert`], [`Tree::update`] (or
/// [`Tree::remove`]) leave the other once the parent it hands back is filed (by
/// [`Tree::file_exposed`], in the one set it was handed back for): node fields, sets,
/// counts, the policy's order and stamps. A parent handed back as the next device victim is the
/// policy's first device candidate once filed.
#[test]
fn every_fast_form_leaves_what_the_general_insert_update_and_remove_leave() {
    for policy in EvictionPolicy::ALL.iter().copied() {
        for seed in 1..=40u64 {
            let mut rnd = picker(seed);
            let (mut a, mut b) = (Tree::new(policy), Tree::new(policy));
            let (mut next_hash, mut next_block, mut next_transfer) = (1u128, 1u32, 1u64);
            let mut held: Vec<NodeId> = Vec::new();
            for step in 0..300 {
                let ids: Vec<NodeId> = a.ids().collect();
                let pick = |rnd: &mut dyn FnMut(usize) -> usize, list: &[NodeId]| {
                    (!list.is_empty()).then(|| list[rnd(list.len())])
                };
                let what = format!("{policy:?} seed {seed} step {step}");
                match rnd(12) {
                    0 | 1 => {
                        // A new chain under the root or a device node, served (held, released).
                        let parents = serving_parents(&a, &ids);
                        let parent = pick(&mut rnd, &parents).unwrap();
                        let len = 1 + rnd(3);
                        let hashes: Vec<u128> = (0..len as u128).map(|i| next_hash + i).collect();
                        next_hash += len as u128;
                        // `a` commits it in one chain and releases it in one path.
                        let mut path = Vec::new();
                        let first_block = next_block;
                        let init = |at: usize, node: &mut NodeMut<'_>| {
                            node.set_device(Some(first_block + at as u32));
                            node.hold();
                            node.access(Access::Commit);
                        };
                        let chain: Vec<BlockHash> =
                            hashes.iter().map(|&value| hash(value)).collect();
                        a.insert_chain(parent, &chain, init, &mut path);
                        a.release_path(&path);
                        let path_b = served(&mut b, parent, &hashes, next_block);
                        assert_eq!(path, path_b, "{what}");
                        next_block += len as u32;
                    }
                    2 => {
                        // A backup lands on a device node without one.
                        let list = device_without_host(&a, &ids);
                        if let Some(id) = pick(&mut rnd, &list) {
                            let block = next_block;
                            next_block += 1;
                            a.update(id, |node| node.set_host(Some(block)));
                            b.update(id, |node| node.set_host(Some(block)));
                        }
                    }
                    3 => {
                        let list: Vec<NodeId> = a
                            .candidates(EvictSet::Device)
                            .into_iter()
                            .filter(|&id| a.node(id).has_valid_host())
                            .collect();
                        if let Some(id) = pick(&mut rnd, &list) {
                            let exposed = a.drop_device_copy_exposing(id);
                            b.update(id, |node| {
                                node.set_device(None);
                                node.set_state(NodeState::Host);
                            });
                            if let Some(parent) = exposed {
                                assert!(a.nodes[parent.index()].membership().is_empty());
                                a.file_exposed(parent, EvictSet::Device);
                                assert_eq!(b.first_device_candidate(), Some(parent), "{what}");
                            }
                        }
                    }
                    4 => {
                        let list: Vec<NodeId> = a
                            .candidates(EvictSet::Device)
                            .into_iter()
                            .filter(|&id| a.node(id).host().is_none())
                            .collect();
                        if let Some(id) = pick(&mut rnd, &list) {
                            let (block, transfer) = (next_block, next_transfer);
                            next_block += 1;
                            next_transfer += 1;
                            let exposed = a.start_claimed_swap_out(id, block, transfer);
                            b.update(id, |node| {
                                node.set_device(None);
                                node.set_host(Some(block));
                                node.set_state(NodeState::SwapToHost(SwapOut::Claimed));
                                node.set_transfer(Some(transfer));
                            });
                            if let Some(parent) = exposed {
                                assert!(a.nodes[parent.index()].membership().is_empty());
                                a.file_exposed(parent, EvictSet::Device);
                                assert_eq!(b.first_device_candidate(), Some(parent), "{what}");
                            }
                        }
                    }
                    5 => {
                        let list: Vec<NodeId> = ids
                            .iter()
                            .copied()
                            .filter(|&id| {
                                a.node(id).state() == NodeState::SwapToHost(SwapOut::Claimed)
                            })
                            .collect();
                        if let Some(id) = pick(&mut rnd, &list) {
                            // The completion's form: attached to its copy, claimed, landed.
                            let transfer =
                                a.node(id).transfer().expect("a swap-out names its copy");
                            assert_eq!(
                                a.land_attached_claimed_swap_out(id, transfer + 1),
                                Landing::Detached,
                                "another copy's completion leaves it"
                            );
                            assert_eq!(
                                a.land_attached_claimed_swap_out(id, transfer),
                                Landing::Landed
                            );
                            b.update(id, |node| {
                                node.set_device(None);
                                node.set_state(NodeState::Host);
                                node.set_transfer(None);
                                node.set_passing_through_host(false);
                            });
                        }
                    }
                    6 => {
                        // A host-only leaf leaves the tree.
                        let list: Vec<NodeId> = a
                            .candidates(EvictSet::Host)
                            .into_iter()
                            .filter(|&id| {
                                a.node(id).device().is_none() && !a.node(id).has_children()
                            })
                            .collect();
                        if let Some(id) = pick(&mut rnd, &list) {
                            let exposed = a.remove_exposing_host(id);
                            b.remove(id);
                            if let Some(parent) = exposed {
                                let next = a.is_next_host_victim(parent);
                                a.file_exposed(parent, EvictSet::Host);
                                if next {
                                    assert_eq!(b.first_host_candidate(), Some(parent), "{what}");
                                }
                            }
                        }
                    }
                    7 => {
                        // A host-only candidate goes to storage: held there, or written back.
                        let list: Vec<NodeId> = a
                            .candidates(EvictSet::Host)
                            .into_iter()
                            .filter(|&id| a.node(id).device().is_none())
                            .collect();
                        if let Some(id) = pick(&mut rnd, &list) {
                            let (stored, transfer) = (rnd(2) == 0, next_transfer);
                            next_transfer += 1;
                            let change = |node: &mut NodeMut<'_>| {
                                node.set_host(None);
                                if stored {
                                    node.set_stored(true);
                                    node.set_state(NodeState::Storage);
                                } else {
                                    node.set_state(NodeState::HostToStorage(StoreOut::Evict));
                                    node.set_transfer(Some(transfer));
                                }
                            };
                            let exposed = a.update_exposing_host(id, change);
                            b.update(id, change);
                            if let Some(parent) = exposed {
                                let next = a.is_next_host_victim(parent);
                                a.file_exposed(parent, EvictSet::Host);
                                if next {
                                    assert_eq!(b.first_host_candidate(), Some(parent), "{what}");
                                }
                            }
                        }
                    }
                    8 => {
                        // A STORE lands; or a storage-only leaf leaves.
                        let list: Vec<NodeId> = ids
                            .iter()
                            .copied()
                            .filter(|&id| a.node(id).state().storage_only())
                            .collect();
                        if let Some(id) = pick(&mut rnd, &list) {
                            if a.node(id).state() == NodeState::Storage {
                                if !a.node(id).has_children() && a.node(id).ref_count() == 0 {
                                    a.remove(id);
                                    b.remove(id);
                                }
                            } else {
                                let change = |node: &mut NodeMut<'_>| {
                                    node.set_state(NodeState::Storage);
                                    node.set_transfer(None);
                                    node.set_stored(true);
                                };
                                a.update(id, change);
                                b.update(id, change);
                            }
                        }
                    }
                    9 => {
                        // An allocation starts the swap-in of a held host hit below the root
                        // or a device copy.
                        let list: Vec<NodeId> = ids
                            .iter()
                            .copied()
                            .filter(|&id| {
                                let node = a.node(id);
                                let parent = node.parent().expect("a live node has a parent");
                                node.state() == NodeState::Host
                                    && node.ref_count() > 0
                                    && (parent == NodeId::ROOT || a.node(parent).device().is_some())
                            })
                            .collect();
                        if let Some(id) = pick(&mut rnd, &list) {
                            let (block, transfer) = (next_block, next_transfer);
                            next_block += 1;
                            next_transfer += 1;
                            a.start_swap_in_of_held(id, block, transfer);
                            b.update(id, |node| {
                                node.set_device(Some(block));
                                node.set_state(NodeState::SwapToDevice);
                                node.set_transfer(Some(transfer));
                            });
                        }
                    }
                    10 => {
                        // A swap-in lands, held or not, its host copy kept or only passing.
                        let list: Vec<NodeId> = ids
                            .iter()
                            .copied()
                            .filter(|&id| a.node(id).state() == NodeState::SwapToDevice)
                            .collect();
                        if let Some(id) = pick(&mut rnd, &list) {
                            let passing = rnd(2) == 0;
                            a.land_swap_in(id, passing);
                            b.update(id, |node| {
                                node.set_state(NodeState::Device);
                                node.set_transfer(None);
                                if passing {
                                    node.set_host(None);
                                    node.set_passing_through_host(false);
                                }
                            });
                        }
                    }
                    _ => {
                        // Hold a random node (a request's parent), or release one: `a` as the
                        // end of a request of that one node releases it (in any state, with
                        // any copies), `b` by the general update.
                        if rnd(2) == 0 && !held.is_empty() {
                            let id = held.swap_remove(rnd(held.len()));
                            if a.is_live(id) {
                                a.release_path(&[id]);
                                b.update(id, |node| {
                                    node.release();
                                    node.access(Access::Release);
                                });
                            }
                        } else if let Some(id) = pick(&mut rnd, &ids) {
                            if rnd(2) == 0 {
                                a.update(id, |node| node.hold());
                                b.update(id, |node| node.hold());
                            } else {
                                // A match's hit.
                                a.hold_hit(id);
                                b.update(id, |node| {
                                    node.hold();
                                    node.count_hit();
                                    node.access(Access::Hit);
                                });
                            }
                            held.push(id);
                        }
                    }
                }
                same(&a, &b, &what);
            }
        }
    }
}

/// `drop_device_leaves` (an allocation without a host tier), applied to one of two device-only
/// trees built alike, evicts the device candidates that [`Tree::first_device_candidate`] and
/// [`Tree::remove`] evict one by one in the other, in that order, handing out their blocks in
/// that order, and leaves the same tree: chains go tail first, the parent the last removal
/// exposes is filed, held nodes and their ancestors stay.
#[test]
fn dropping_device_leaves_evicts_what_first_and_remove_evict_one_by_one() {
    for policy in EvictionPolicy::ALL.iter().copied() {
        for seed in 1..=30u64 {
            let mut rnd = picker(seed);
            let (mut a, mut b) = (Tree::new(policy), Tree::new(policy));
            let (mut next_hash, mut next_block) = (1u128, 0u32);
            let mut held: Vec<NodeId> = Vec::new();
            let (mut dropped, mut exposed) = (0, 0);
            for step in 0..200 {
                let what = format!("{policy:?} seed {seed} step {step}");
                let ids: Vec<NodeId> = a.ids().collect();
                match rnd(5) {
                    0 | 1 => {
                        // A request's new blocks under the root or a cached node, served.
                        let parent = match rnd(3) {
                            0 => NodeId::ROOT,
                            _ if ids.is_empty() => NodeId::ROOT,
                            _ => ids[rnd(ids.len())],
                        };
                        let hashes: Vec<u128> =
                            (0..1 + rnd(4) as u128).map(|i| next_hash + i).collect();
                        next_hash += hashes.len() as u128;
                        let path_a = served(&mut a, parent, &hashes, next_block);
                        let path_b = served(&mut b, parent, &hashes, next_block);
                        assert_eq!(path_a, path_b, "{what}");
                        next_block += hashes.len() as u32;
                    }
                    2 => {
                        // A request holds a node (its path's end), or one that held ends.
                        if rnd(2) == 0 && !held.is_empty() {
                            let id = held.swap_remove(rnd(held.len()));
                            for tree in [&mut a, &mut b] {
                                tree.update(id, |node| {
                                    node.release();
                                    node.access(Access::Release);
                                });
                            }
                        } else if !ids.is_empty() {
                            let id = ids[rnd(ids.len())];
                            a.update(id, |node| node.hold());
                            b.update(id, |node| node.hold());
                            held.push(id);
                        }
                    }
                    _ => {
                        // An allocation short of blocks: `b` evicts one candidate at a time.
                        let mut blocks_b = Vec::new();
                        for _ in 0..1 + rnd(8) {
                            let Some(id) = b.first_device_candidate() else { break };
                            let parent = b.node(id).parent().unwrap();
                            blocks_b.push(b.node(id).device().unwrap());
                            b.remove(id);
                            exposed += usize::from(b.first_device_candidate() == Some(parent));
                        }
                        let mut blocks_a = vec![u32::MAX];
                        a.drop_device_leaves(blocks_b.len(), &mut blocks_a);
                        assert_eq!(blocks_a[1..], blocks_b, "{what}");
                        dropped += blocks_b.len();
                    }
                }
                same(&a, &b, &what);
            }
            assert!(dropped > 100 && exposed > 20, "{policy:?} seed {seed}: {dropped} {exposed}");
        }
    }
}

/// `insert_chain` makes room in the child index for its whole chain at once
/// ([`ChildIndex::reserve`]): the index grows at the counts where one [`Tree::insert`] per node
/// grows it (several times over for a chain longer than the table), so it ends the size those
/// inserts leave, never holds more than 7/8 of its slots, and finds every node. Chains of every
/// length from 1 to 45 (each length a divisor of some of the counts where the table doubles, or
/// not), onto trees empty at first or presized.
#[test]
fn a_chain_grows_the_child_index_where_one_insert_per_node_grows_it() {
    for presized in [0, 100] {
        for len in 1..=45u128 {
            let policy = EvictionPolicy::Lru;
            let mut a = Tree::with_capacity(policy, presized);
            let mut b = Tree::with_capacity(policy, presized);
            let (mut next_hash, mut next_block) = (1u128, 0u32);
            let mut parent = NodeId::ROOT;
            while a.len() < 700 {
                let what = format!("presized for {presized}, chains of {len}, {} nodes", a.len());
                let hashes: Vec<u128> = (next_hash..next_hash + len).collect();
                next_hash += len;
                let first_block = next_block;
                let init = |at: usize, node: &mut NodeMut<'_>| {
                    node.set_device(Some(first_block + at as u32));
                    node.hold();
                    node.access(Access::Commit);
                };
                let chain: Vec<BlockHash> = hashes.iter().map(|&value| hash(value)).collect();
                let mut path = Vec::new();
                a.insert_chain(parent, &chain, init, &mut path);
                a.release_path(&path);
                assert_eq!(path, served(&mut b, parent, &hashes, next_block), "{what}");
                next_block += len as u32;
                same(&a, &b, &what);
                for (&id, &value) in path.iter().zip(&hashes) {
                    let parent = a.node(id).parent().unwrap();
                    assert_eq!(a.child(parent, hash(value)), Some(id), "{what}");
                }
                // The next chain hangs under the root or under this one's head, by turns.
                parent = if parent == NodeId::ROOT { path[0] } else { NodeId::ROOT };
            }
        }
    }
}

/// `drop_device_leaves` (through [`unlink`]) counts the children of a parent with saturated
/// child counts down as it drops them, recounting while saturated, and drops the parent once
/// its last child is gone: the counts agree with the children after every batch.
#[test]
fn dropping_device_leaves_of_a_saturated_parent_recounts_its_children() {
    let mut tree = Tree::new(EvictionPolicy::Lru);
    let parent = served(&mut tree, NodeId::ROOT, &[1], 0)[0];
    let children = 65_537u32;
    for index in 0..children {
        tree.insert(parent, hash(1_000 + u128::from(index)), |node| {
            node.set_device(Some(1 + index));
            node.access(Access::Release);
        });
    }
    let counts = |tree: &Tree| {
        let node = tree.node(parent);
        (node.device_children, node.upper_children)
    };
    assert_eq!(counts(&tree), (COUNT_SATURATED, COUNT_SATURATED));
    let mut blocks = Vec::new();
    let mut batches = 0;
    while !tree.is_empty() {
        let batch = 1_000.min(tree.len());
        tree.drop_device_leaves(batch, &mut blocks);
        tree.check().unwrap_or_else(|error| panic!("batch {batches}: {error:?}"));
        batches += 1;
        if tree.is_live(parent) {
            let left = u16::try_from(tree.child_count(parent)).unwrap();
            assert_eq!(counts(&tree), (left, left), "batch {batches}");
        }
    }
    blocks.sort_unstable();
    assert_eq!(blocks, (0..=children).collect::<Vec<u32>>());
}

/// The fast forms count a parent's saturated child counts down as `Tree::update` does.
#[test]
fn fast_forms_recount_a_saturated_parent_as_the_general_update_does() {
    let (mut a, mut b) = (Tree::new(EvictionPolicy::Lru), Tree::new(EvictionPolicy::Lru));
    let mut children = Vec::new();
    for tree in [&mut a, &mut b] {
        let parent = served(tree, NodeId::ROOT, &[1], 0)[0];
        children = (0..65_537u32)
            .map(|index| {
                tree.insert(parent, hash(1_000 + u128::from(index)), |node| {
                    node.set_device(Some(1 + index));
                    node.set_host(Some(index));
                })
            })
            .collect();
    }
    for &child in &children[2..] {
        if let Some(parent) = a.drop_device_copy_exposing(child) {
            a.file(parent);
        }
        b.update(child, |node| {
            node.set_device(None);
            node.set_state(NodeState::Host);
        });
    }
    assert_eq!(a.node(a.node(children[0]).parent().unwrap()).device_children, 2);
    for tree in [&mut a, &mut b] {
        tree.update(children[1], |node| node.set_host(None));
    }
    if let Some(parent) = a.start_claimed_swap_out(children[1], 7, 9) {
        a.file(parent);
    }
    b.update(children[1], |node| {
        node.set_device(None);
        node.set_host(Some(7));
        node.set_state(NodeState::SwapToHost(SwapOut::Claimed));
        node.set_transfer(Some(9));
    });
    assert_eq!(a.land_attached_claimed_swap_out(children[1], 9), Landing::Landed);
    b.update(children[1], |node| {
        node.set_state(NodeState::Host);
        node.set_transfer(None);
    });
    let to_storage = |node: &mut NodeMut<'_>| {
        node.set_host(None);
        node.set_stored(true);
        node.set_state(NodeState::Storage);
    };
    for &child in &children[1..] {
        if let Some(parent) = a.update_exposing_host(child, to_storage) {
            a.file(parent);
        }
        b.update(child, to_storage);
    }
    let parent = a.node(children[0]).parent().unwrap();
    assert_eq!((a.node(parent).device_children, a.node(parent).upper_children), (1, 1));
    for (x, y) in a.nodes.iter().zip(&b.nodes) {
        assert_eq!(format!("{x:?}"), format!("{y:?}"));
    }
    for set in EvictSet::ALL {
        assert_eq!(a.candidates(set), b.candidates(set));
    }
    a.check().unwrap();
}
