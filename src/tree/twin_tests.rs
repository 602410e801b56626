//! Two trees driven alike, for the differential tests of the write-back and backup runs: one
//! tree (`a`) takes the fast form under test, the other (`b`) the general form, and [`Twins`]
//! does the steps both take the same way (a request's chain served, a path held or released,
//! host blocks coming free into both pools) and compares them after each step. The node
//! lists a step picks from ([`serving_parents`], [`device_without_host`]) serve the fast-form
//! test too.

use super::fast_form_tests::same;
use super::tests::served;
use super::*;

/// The nodes of `tree` under which a request's new blocks may be served: the root and each
/// `Device` node with a device copy.
pub(super) fn serving_parents(tree: &Tree, ids: &[NodeId]) -> Vec<NodeId> {
    std::iter::once(NodeId::ROOT)
        .chain(ids.iter().copied().filter(|&id| {
            tree.node(id).state() == NodeState::Device && tree.node(id).device().is_some()
        }))
        .collect()
}

/// The `Device` nodes among `ids` without a host copy (those a backup may land on).
pub(super) fn device_without_host(tree: &Tree, ids: &[NodeId]) -> Vec<NodeId> {
    ids.iter()
        .copied()
        .filter(|&id| tree.node(id).state() == NodeState::Device && tree.node(id).host().is_none())
        .collect()
}

/// Two trees built alike with their host pools, and the numbers the next step hands out.
pub(super) struct Twins {
    /// The tree the fast form under test changes.
    pub a: Tree,
    /// The tree the general form changes.
    pub b: Tree,
    /// The host pools of `a` and `b`: stacks, as [`crate::pool::BlockPool`]'s free list.
    pub pool_a: Vec<u32>,
    pub pool_b: Vec<u32>,
    next_hash: u128,
    next_block: u32,
    next_copy: u64,
    /// The paths requests hold (their hits), until they end.
    held: Vec<Vec<NodeId>>,
}

impl Twins {
    /// Two empty trees under `policy`, with empty host pools.
    pub fn new(policy: EvictionPolicy) -> Self {
        Self {
            a: Tree::new(policy),
            b: Tree::new(policy),
            pool_a: Vec::new(),
            pool_b: Vec::new(),
            next_hash: 1,
            next_block: 1,
            next_copy: 1,
            held: Vec::new(),
        }
    }

    /// The live nodes (the same in both trees).
    pub fn ids(&self) -> Vec<NodeId> {
        self.a.ids().collect()
    }

    /// A block number not handed out before (device or host).
    pub fn new_block(&mut self) -> u32 {
        self.next_block += 1;
        self.next_block - 1
    }

    /// A copy number not handed out before.
    pub fn new_copy(&mut self) -> u64 {
        self.next_copy += 1;
        self.next_copy - 1
    }

    /// A request's new blocks (one to four) under the root or a device copy, served in both
    /// trees; the path of new nodes.
    pub fn serve_chain(&mut self, rnd: &mut impl FnMut(usize) -> usize, what: &str) -> Vec<NodeId> {
        let parents = serving_parents(&self.a, &self.ids());
        let parent = parents[rnd(parents.len())];
        let hashes: Vec<u128> = (0..1 + rnd(4) as u128).map(|i| self.next_hash + i).collect();
        self.next_hash += hashes.len() as u128;
        let path_a = served(&mut self.a, parent, &hashes, self.next_block);
        let path_b = served(&mut self.b, parent, &hashes, self.next_block);
        assert_eq!(path_a, path_b, "{what}");
        self.next_block += hashes.len() as u32;
        path_a
    }

    /// A random `Device` node without a host copy gets a new one in both trees, if there is
    /// such a node.
    pub fn land_host_copy(&mut self, rnd: &mut impl FnMut(usize) -> usize) {
        let list = device_without_host(&self.a, &self.ids());
        if !list.is_empty() {
            let id = list[rnd(list.len())];
            let block = self.new_block();
            for tree in [&mut self.a, &mut self.b] {
                tree.update(id, |node| node.set_host(Some(block)));
            }
        }
    }

    /// Host blocks come free into both pools, now and then (none or one).
    pub fn free_host_blocks(&mut self, rnd: &mut impl FnMut(usize) -> usize) {
        for _ in 0..rnd(2) {
            let block = self.new_block();
            self.pool_a.push(block);
            self.pool_b.push(block);
        }
    }

    /// A request holds a random node's path from the root (its hits), or one that held ends.
    pub fn hold_or_release(&mut self, rnd: &mut impl FnMut(usize) -> usize) {
        let ids = self.ids();
        if rnd(2) == 0 && !self.held.is_empty() {
            let path = self.held.swap_remove(rnd(self.held.len()));
            for tree in [&mut self.a, &mut self.b] {
                tree.release_path(&path);
            }
        } else if !ids.is_empty() {
            let mut path = vec![ids[rnd(ids.len())]];
            while let Some(parent) = self.a.node(path[0]).parent() {
                if parent == NodeId::ROOT {
                    break;
                }
                path.insert(0, parent);
            }
            for &id in &path {
                self.a.hold_hit(id);
                self.b.hold_hit(id);
            }
            self.held.push(path);
        }
    }

    /// Asserts that the two trees and their pools are the same, and that both trees keep their
    /// invariants.
    pub fn assert_same(&self, what: &str) {
        assert_eq!(self.pool_a, self.pool_b, "{what}: the host pool");
        same(&self.a, &self.b, what);
    }
}
