//! The offline optimum ("optimal"): Belady's farthest-next-use rule under the prefix
//! constraint, an upper bound for the online policies. It needs the future, so only a replay of
//! a known trace runs it (`kvshm replay --eviction optimal`).
//!
//! Core types: [`FutureUses`] (for each block key, the requests in which it may hit, in order),
//! [`Optimal`] (the policy).
//!
//! A block's next use is the first later request in which it may hit (its position is below the
//! request's last-token bound). The member of a set whose next use is farthest goes first (never
//! used again first of all); ties by recency, as LRU (older release first, deeper first on equal
//! recency). Only leaves are candidates, which costs nothing: a parent is used whenever a child
//! is, so its next use is never later than any descendant's, and the farthest next use over all
//! cached blocks is always reached at a leaf.
//!
//! It is a strong feasible schedule, not a proven optimum: an allocation must hold a request's
//! new and output blocks together, hits count only as a prefix, and every computed block is
//! cached; none of which classic paging has.
//!
//! One request, as the replay drives it:
//! 1. [`Policy::request_started`] (its match) advances the request number;
//! 2. every access to a node (hit, commit, release) sets its next use from its key's uses after
//!    the current request (a binary search), and a release its recency;
//! 3. a node joins its set keyed by (farthest next use first, older first), in a B-tree:
//!    O(log n) per change; keys change only at accesses, when the node is in no set.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use std::ops::ControlFlow;

use super::recency::{
    kind_of, CLAIMABLE, DEVICE_AND_HOST, DEVICE_ONLY, HOST_ONLY, KINDS, STORAGE_ONLY,
};
use super::{Access, EvictSet, MatchEnd, Membership, Policy};
use crate::hash::BlockHash;
use crate::tree::NodeId;

/// "Never used again".
const NEVER: u32 = u32::MAX;

/// For each block key, the requests (numbered from 0 in the order they are matched) in which
/// it may hit.
#[derive(Debug, Default, Clone)]
pub struct FutureUses {
    uses: HashMap<BlockHash, Vec<u32>>,
    requests: u32,
}

impl FutureUses {
    /// Records the next request: `hit_eligible` are the keys of its blocks that may hit (those
    /// below its last-token bound).
    pub fn push_request(&mut self, hit_eligible: impl IntoIterator<Item = BlockHash>) {
        let request = self.requests;
        for key in hit_eligible {
            let uses = self.uses.entry(key).or_default();
            if uses.last() != Some(&request) {
                uses.push(request);
            }
        }
        self.requests += 1;
    }

    /// Requests recorded.
    pub fn requests(&self) -> u32 {
        self.requests
    }

    /// The first request after `request` in which `key` may hit, or [`NEVER`].
    fn next_use(&self, key: BlockHash, request: u32) -> u32 {
        let Some(uses) = self.uses.get(&key) else { return NEVER };
        let later = uses.partition_point(|&used| used <= request);
        uses.get(later).copied().unwrap_or(NEVER)
    }

    fn heap_bytes(&self) -> usize {
        self.uses.capacity() * (size_of::<BlockHash>() + size_of::<Vec<u32>>())
            + self.uses.values().map(|uses| uses.capacity() * size_of::<u32>()).sum::<usize>()
    }
}

/// The order of a set: farthest next use first, then the older release.
type Key = (Reverse<u32>, u64, u32);

/// What the policy knows of one node.
#[derive(Clone, Copy, Debug)]
struct NodeState {
    next_use: u32,
    /// Release order (larger: more recent).
    stamp: u64,
}

const UNSEEN: NodeState = NodeState { next_use: NEVER, stamp: 0 };

/// The offline optimum.
#[derive(Debug, Default)]
pub struct Optimal {
    future: FutureUses,
    nodes: Vec<NodeState>,
    lists: [BTreeSet<Key>; KINDS],
    /// The request being served: the number of matches so far, minus one.
    request: u32,
    started: u32,
    clock: u64,
}

impl Optimal {
    /// Orders by `future` from now on.
    pub fn foresee(&mut self, future: FutureUses) {
        self.future = future;
    }

    fn key(&self, node: NodeId) -> Key {
        let state = self.nodes[node.index()];
        (Reverse(state.next_use), state.stamp, node.0)
    }

    fn lists_of(set: EvictSet) -> &'static [usize] {
        match set {
            EvictSet::Device => &[DEVICE_ONLY, DEVICE_AND_HOST],
            EvictSet::Host => &[HOST_ONLY, DEVICE_AND_HOST],
            EvictSet::Claimable => &[CLAIMABLE],
            EvictSet::Storage => &[STORAGE_ONLY],
        }
    }
}

impl Policy for Optimal {
    fn reserve_nodes(&mut self, nodes: usize) {
        if nodes > self.nodes.len() {
            self.nodes.resize(nodes, UNSEEN);
        }
    }

    fn request_started(&mut self, _matched: MatchEnd) -> u8 {
        self.request = self.started;
        self.started = self.started.saturating_add(1);
        0
    }

    const HEARS_REQUEST_STARTS: bool = true;

    fn wants(&self, _access: Access) -> bool {
        true
    }

    fn touch(&mut self, node: NodeId, key: BlockHash, access: Access) {
        let next_use = self.future.next_use(key, self.request);
        let state = &mut self.nodes[node.index()];
        state.next_use = next_use;
        if access == Access::Release {
            self.clock += 1;
            state.stamp = self.clock;
        }
    }

    fn enter(&mut self, node: NodeId, sets: Membership) {
        if let Some(list) = kind_of(sets) {
            let key = self.key(node);
            self.lists[list].insert(key);
        }
    }

    fn leave(&mut self, node: NodeId, sets: Membership) {
        if let Some(list) = kind_of(sets) {
            let key = self.key(node);
            self.lists[list].remove(&key);
        }
    }

    fn first(&self, set: EvictSet) -> Option<NodeId> {
        Optimal::lists_of(set)
            .iter()
            .filter_map(|&list| self.lists[list].first())
            .min()
            .map(|&(_, _, node)| NodeId(node))
    }

    fn len(&self, set: EvictSet) -> usize {
        Optimal::lists_of(set).iter().map(|&list| self.lists[list].len()).sum()
    }

    fn visit(&self, set: EvictSet, visit: &mut dyn FnMut(NodeId) -> ControlFlow<()>) {
        let mut members: Vec<&Key> =
            Optimal::lists_of(set).iter().flat_map(|&list| self.lists[list].iter()).collect();
        members.sort_unstable();
        for &&(_, _, node) in &members {
            if visit(NodeId(node)).is_break() {
                return;
            }
        }
    }

    fn stamp(&self, node: NodeId) -> u64 {
        self.nodes[node.index()].stamp
    }

    fn clear(&mut self) {
        let future = std::mem::take(&mut self.future);
        *self = Optimal { future, ..Optimal::default() };
    }

    fn check(&self, membership: &dyn Fn(NodeId) -> Option<Membership>) -> Result<(), String> {
        let mut filed = [0usize; KINDS];
        for node in 0..self.nodes.len() as u32 {
            let Some(list) = membership(NodeId(node)).and_then(kind_of) else { continue };
            filed[list] += 1;
            if !self.lists[list].contains(&self.key(NodeId(node))) {
                return Err(format!("node {node} is filed but not in optimal list {list}"));
            }
        }
        let held = self.lists.each_ref().map(|list| list.len());
        if held != filed {
            return Err(format!("optimal lists hold {held:?} nodes but {filed:?} are filed"));
        }
        Ok(())
    }

    fn heap_bytes(&self) -> usize {
        self.nodes.capacity() * size_of::<NodeState>()
            + self.lists.iter().map(|list| list.len() * size_of::<Key>()).sum::<usize>()
            + self.future.heap_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEVICE: Membership = Membership::from_bits(1);

    fn key(value: u128) -> BlockHash {
        BlockHash(value)
    }

    #[test]
    fn the_member_used_farthest_ahead_goes_first_and_the_unused_before_all() {
        let mut future = FutureUses::default();
        future.push_request([key(1), key(2), key(3)]); // request 0
        future.push_request([key(1)]); // 1
        future.push_request([key(3)]); // 2
        let mut optimal = Optimal::default();
        optimal.foresee(future);
        optimal.reserve_nodes(4);
        optimal.request_started(MatchEnd::default());
        for (node, value) in [(1, 1), (2, 2), (3, 3)] {
            optimal.touch(NodeId(node), key(value), Access::Release);
            optimal.enter(NodeId(node), DEVICE);
        }
        let mut order = Vec::new();
        optimal.visit(EvictSet::Device, &mut |node| {
            order.push(node.0);
            ControlFlow::Continue(())
        });
        // 2 is never used again, 3 next in request 2, 1 in request 1.
        assert_eq!(order, vec![2, 3, 1]);
        assert_eq!(optimal.first(EvictSet::Device), Some(NodeId(2)));
        let membership = |node: NodeId| Some(if node.0 > 0 { DEVICE } else { Membership::NONE });
        optimal.check(&membership).unwrap();
    }

    #[test]
    fn a_use_in_the_current_request_is_not_a_next_use() {
        let mut future = FutureUses::default();
        future.push_request([key(7)]);
        future.push_request([key(7)]);
        assert_eq!(future.next_use(key(7), 0), 1);
        assert_eq!(future.next_use(key(7), 1), NEVER);
        assert_eq!(future.next_use(key(8), 0), NEVER);
        assert_eq!(future.requests(), 2);
    }
}
