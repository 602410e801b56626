//! LRU: the least recently released node goes first; on equal recency the deeper one.
//!
//! Recency is a stamp from a counter bumped at every release. The end of a request releases its
//! path tail first, so the deeper of two blocks released together gets the smaller stamp: ties
//! by depth are handled by that order, with no depth stored. Hits and commits need no stamp: the
//! nodes they touch are held, so in no set, until the end of their request releases (and stamps)
//! them. A node that joins a set for another reason (its last device child went, a copy landed)
//! keeps the stamp of its last release.
//!
//! Each node is in at most one of five recency lists ([`super::recency`]), by its sets: device
//! only, device and host, host only, claimable, storage. The first device candidate is the older
//! of the heads of "device only" and "device and host", the first host candidate the older of
//! "host only" and "device and host". A node joins with the newest stamp in the usual case (just
//! released) and is appended in O(1); one that joins with an older stamp is placed by a walk
//! from the nearer end, which for a parent exposed by the eviction of the child it was released
//! with is the head.

use std::ops::ControlFlow;

use super::recency::{
    kind_of, RecencyLists, CLAIMABLE, DEVICE_AND_HOST, DEVICE_ONLY, HOST_ONLY, KINDS, NONE,
    STORAGE_ONLY,
};
use super::{Access, EvictSet, Membership, Policy};
use crate::hash::BlockHash;
use crate::tree::NodeId;

/// The LRU policy: one recency list per kind of list ([`kind_of`]).
#[derive(Debug, Default)]
pub struct Lru {
    lists: RecencyLists<KINDS>,
}

impl Lru {
    /// The two lists whose members make up `set` (the second `None` for a set of one list).
    #[inline]
    fn lists_of(set: EvictSet) -> (usize, Option<usize>) {
        match set {
            EvictSet::Device => (DEVICE_ONLY, Some(DEVICE_AND_HOST)),
            EvictSet::Host => (HOST_ONLY, Some(DEVICE_AND_HOST)),
            EvictSet::Claimable => (CLAIMABLE, None),
            EvictSet::Storage => (STORAGE_ONLY, None),
        }
    }

    #[cfg(test)]
    fn with_clock(clock: u32) -> Lru {
        Lru { lists: RecencyLists::with_clock(clock) }
    }
}

impl Policy for Lru {
    fn reserve_nodes(&mut self, nodes: usize) {
        self.lists.reserve_nodes(nodes);
    }

    #[inline]
    fn wants(&self, access: Access) -> bool {
        access == Access::Release
    }

    #[inline]
    fn touch(&mut self, node: NodeId, _key: BlockHash, access: Access) {
        if access == Access::Release {
            self.lists.stamp_now(node.0);
        }
    }

    #[inline]
    fn enter(&mut self, node: NodeId, sets: Membership) {
        if let Some(list) = kind_of(sets) {
            self.lists.insert(list, node.0);
        }
    }

    #[inline]
    fn leave(&mut self, node: NodeId, sets: Membership) {
        if let Some(list) = kind_of(sets) {
            self.lists.unlink(list, node.0);
        }
    }

    #[inline]
    fn first(&self, set: EvictSet) -> Option<NodeId> {
        let head = match set {
            EvictSet::Device => self.lists.older_head(DEVICE_ONLY, DEVICE_AND_HOST),
            EvictSet::Host => self.lists.older_head(HOST_ONLY, DEVICE_AND_HOST),
            EvictSet::Claimable => self.lists.head(CLAIMABLE),
            EvictSet::Storage => self.lists.head(STORAGE_ONLY),
        };
        Some(head).filter(|&node| node != NONE).map(NodeId)
    }

    #[inline]
    fn would_come_first(&self, node: NodeId, set: EvictSet) -> bool {
        // Older than the first member (the older of the two heads), it would go in front of its
        // list's head and before the other list's: older than both heads.
        let (a, b) = Lru::lists_of(set);
        let stamp = self.lists.stamp(node.0);
        self.lists.older_than_head(stamp, a)
            && b.is_none_or(|b| self.lists.older_than_head(stamp, b))
    }

    fn len(&self, set: EvictSet) -> usize {
        let (a, b) = Lru::lists_of(set);
        (self.lists.len(a) + b.map_or(0, |b| self.lists.len(b))) as usize
    }

    fn visit(&self, set: EvictSet, visit: &mut dyn FnMut(NodeId) -> ControlFlow<()>) {
        let (a, b) = Lru::lists_of(set);
        let (mut a, mut b) = (self.lists.head(a), b.map_or(NONE, |b| self.lists.head(b)));
        while a != NONE || b != NONE {
            // The older of the two cursors, `a` on a tie (as `first`).
            let take_a = b == NONE || (a != NONE && self.lists.stamp(a) <= self.lists.stamp(b));
            let node = if take_a { a } else { b };
            if take_a {
                a = self.lists.next(a);
            } else {
                b = self.lists.next(b);
            }
            if visit(NodeId(node)).is_break() {
                return;
            }
        }
    }

    fn stamp(&self, node: NodeId) -> u64 {
        u64::from(self.lists.stamp(node.0))
    }

    fn clear(&mut self) {
        *self = Lru::default();
    }

    fn check(&self, membership: &dyn Fn(NodeId) -> Option<Membership>) -> Result<(), String> {
        self.lists.check("LRU", &|node| match membership(NodeId(node)) {
            Some(sets) => Ok(kind_of(sets)),
            None => Err(format!("{node} is not a live node")),
        })
    }

    fn heap_bytes(&self) -> usize {
        self.lists.heap_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEVICE: Membership = Membership::from_bits(1);

    fn released(lru: &mut Lru, nodes: &[u32]) {
        for &node in nodes {
            lru.touch(NodeId(node), BlockHash(0), Access::Release);
            lru.enter(NodeId(node), DEVICE);
        }
    }

    fn order(lru: &Lru, set: EvictSet) -> Vec<u32> {
        let mut order = Vec::new();
        lru.visit(set, &mut |node| {
            order.push(node.0);
            ControlFlow::Continue(())
        });
        order
    }

    #[test]
    fn members_leave_in_release_order_and_late_joiners_find_their_place() {
        let mut lru = Lru::default();
        lru.reserve_nodes(8);
        released(&mut lru, &[3, 1, 2]);
        // 5 and 6 are released between 1 and 2 in time, but join later (exposed parents).
        lru.leave(NodeId(2), DEVICE);
        for node in [4, 5, 6, 7] {
            lru.touch(NodeId(node), BlockHash(0), Access::Release);
        }
        lru.enter(NodeId(2), DEVICE);
        lru.enter(NodeId(7), DEVICE);
        lru.enter(NodeId(5), DEVICE);
        lru.enter(NodeId(4), DEVICE);
        assert_eq!(order(&lru, EvictSet::Device), vec![3, 1, 2, 4, 5, 7]);
        assert_eq!(lru.first(EvictSet::Device), Some(NodeId(3)));
        let membership = |node: NodeId| {
            Some(if [3, 1, 2, 4, 5, 7].contains(&node.0) { DEVICE } else { Membership::NONE })
        };
        lru.check(&membership).unwrap();
    }

    #[test]
    fn hits_and_commits_leave_the_order_alone() {
        let mut lru = Lru::default();
        lru.reserve_nodes(4);
        released(&mut lru, &[0, 1]);
        lru.leave(NodeId(0), DEVICE);
        lru.touch(NodeId(0), BlockHash(0), Access::Hit);
        lru.touch(NodeId(0), BlockHash(0), Access::Commit);
        lru.enter(NodeId(0), DEVICE);
        assert_eq!(order(&lru, EvictSet::Device), vec![0, 1]);
    }

    #[test]
    fn the_device_and_host_sets_share_their_common_members_in_order() {
        let mut lru = Lru::default();
        lru.reserve_nodes(4);
        let both = DEVICE.with(EvictSet::Host);
        let host = Membership::NONE.with(EvictSet::Host);
        for (node, sets) in [(0, DEVICE), (1, both), (2, host), (3, both)] {
            lru.touch(NodeId(node), BlockHash(0), Access::Release);
            lru.enter(NodeId(node), sets);
        }
        assert_eq!(order(&lru, EvictSet::Device), vec![0, 1, 3]);
        assert_eq!(order(&lru, EvictSet::Host), vec![1, 2, 3]);
        assert_eq!((lru.len(EvictSet::Device), lru.len(EvictSet::Host)), (3, 3));
        assert_eq!(lru.first(EvictSet::Host), Some(NodeId(1)));
        assert_eq!(lru.first(EvictSet::Claimable), None);
    }

    /// `would_come_first` is exact for LRU (stamps are unique): a node in no set would come first
    /// in a set exactly when, joining that set alone, it becomes the set's first member, whichever
    /// of the set's two lists (for the device and host sets) holds the older head, and when either
    /// or both are empty.
    #[test]
    fn an_unfiled_node_would_come_first_exactly_when_it_would_be_first_once_filed() {
        let kinds = [
            DEVICE,
            DEVICE.with(EvictSet::Host),
            Membership::NONE.with(EvictSet::Host),
            Membership::NONE.with(EvictSet::Claimable),
            Membership::NONE.with(EvictSet::Storage),
            Membership::NONE,
        ];
        let mut rnd = crate::test_rng::picker(1);
        let mut cases = [0usize; 2];
        for _ in 0..400 {
            let nodes = 1 + rnd(8) as u32;
            let mut lru = Lru::default();
            lru.reserve_nodes(nodes as usize);
            // Released in a random order, each filed by random sets (or none: unfiled).
            let mut order: Vec<u32> = (0..nodes).collect();
            for index in (1..order.len()).rev() {
                order.swap(index, rnd(index + 1));
            }
            let mut sets = vec![Membership::NONE; nodes as usize];
            for &node in &order {
                lru.touch(NodeId(node), BlockHash(0), Access::Release);
                sets[node as usize] = kinds[rnd(kinds.len())];
            }
            // Filed in another order: a late joiner finds its place by its stamp.
            for index in (1..order.len()).rev() {
                order.swap(index, rnd(index + 1));
            }
            for &node in &order {
                if !sets[node as usize].is_empty() {
                    lru.enter(NodeId(node), sets[node as usize]);
                }
            }
            for node in (0..nodes).filter(|&node| sets[node as usize].is_empty()) {
                for set in EvictSet::ALL {
                    let predicted = lru.would_come_first(NodeId(node), set);
                    let alone = Membership::NONE.with(set);
                    lru.enter(NodeId(node), alone);
                    let first = lru.first(set) == Some(NodeId(node));
                    lru.leave(NodeId(node), alone);
                    assert_eq!(predicted, first, "node {node}, {set:?}, sets {sets:?}");
                    cases[usize::from(first)] += 1;
                }
            }
        }
        assert!(cases.iter().all(|&count| count > 100), "cases (not first, first): {cases:?}");
    }

    #[test]
    fn running_out_of_stamps_renumbers_them_in_order() {
        let mut lru = Lru::with_clock(u32::MAX - 2);
        lru.reserve_nodes(6);
        released(&mut lru, &[4, 2]);
        lru.touch(NodeId(5), BlockHash(0), Access::Release); // not filed: keeps its place too
        released(&mut lru, &[0, 3]);
        assert!(lru.lists.clock() < 10, "renumbered: clock {}", lru.lists.clock());
        lru.enter(NodeId(5), DEVICE);
        assert_eq!(order(&lru, EvictSet::Device), vec![4, 2, 5, 0, 3]);
    }
}
