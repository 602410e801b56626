//! LRU: the least recently released node goes first; on equal recency the deeper one.
//!
//! Recency is a stamp from a counter bumped at every release. The end of a request releases its
//! path tail first, so the deeper of two blocks released together gets the smaller stamp: ties
//! by depth are handled by that order, with no depth stored. Hits and commits need no stamp: the
//! nodes they touch are held, so in no set, until the end of their request releases (and stamps)
//! them. A node that joins a set for another reason (its last device child went, a copy landed)
//! keeps the stamp of its last release.
//!
//! Each node is in at most one of five lists, by its sets: device only, device and host, host
//! only, claimable, storage. Each list is sorted by stamp, oldest first, and threaded through a per-node
//! record of 12 bytes (stamp, previous, next). The first device candidate is the older of the
//! heads of "device only" and "device and host", the first host candidate the older of "host
//! only" and "device and host". A node joins with the newest stamp in the usual case (just
//! released) and is appended in O(1); one that joins with an older stamp is inserted at its place
//! by a walk from the nearer end by stamp, which for a parent exposed by the eviction of the
//! child it was released with is the head.
//!
//! Stamps are `u32`: when the counter runs out (every 4 billion releases) every stamp is
//! renumbered in order, once, in O(n log n).

use std::ops::ControlFlow;

use super::{Access, EvictSet, Membership, Policy};
use crate::hash::BlockHash;
use crate::tree::NodeId;

const NONE: u32 = u32::MAX;

/// The lists, by the sets of their members.
const DEVICE_ONLY: usize = 0;
const DEVICE_AND_HOST: usize = 1;
const HOST_ONLY: usize = 2;
const CLAIMABLE: usize = 3;
const STORAGE_ONLY: usize = 4;
const LISTS: usize = 5;

/// A node's place in the recency order.
#[derive(Clone, Copy, Debug)]
struct Link {
    stamp: u32,
    prev: u32,
    next: u32,
}

const UNLINKED: Link = Link { stamp: 0, prev: NONE, next: NONE };

#[derive(Clone, Copy, Debug)]
struct List {
    head: u32,
    tail: u32,
    len: u32,
}

const EMPTY: List = List { head: NONE, tail: NONE, len: 0 };

/// The LRU policy.
#[derive(Debug)]
pub struct Lru {
    links: Vec<Link>,
    lists: [List; LISTS],
    /// The next stamp.
    clock: u32,
}

impl Default for Lru {
    fn default() -> Lru {
        Lru { links: Vec::new(), lists: [EMPTY; LISTS], clock: 0 }
    }
}

/// The list of a node in `sets`, if any.
///
/// # Panics
/// On a claimable or storage node in another set too: the tree's predicates exclude it.
#[inline]
fn list_of(sets: Membership) -> Option<usize> {
    /// By membership bits (device 1, host 2, claimable 4, storage 8); `NO_LIST` where no node
    /// can be.
    const LIST: [usize; 16] = [
        NOT_FILED,
        DEVICE_ONLY,
        HOST_ONLY,
        DEVICE_AND_HOST,
        CLAIMABLE,
        NO_LIST,
        NO_LIST,
        NO_LIST,
        STORAGE_ONLY,
        NO_LIST,
        NO_LIST,
        NO_LIST,
        NO_LIST,
        NO_LIST,
        NO_LIST,
        NO_LIST,
    ];
    match LIST[usize::from(sets.bits())] {
        NOT_FILED => None,
        NO_LIST => {
            unreachable!("a claimable or storage node in another set is a programming error")
        }
        list => Some(list),
    }
}

const NOT_FILED: usize = LISTS;
const NO_LIST: usize = LISTS + 1;

impl Lru {
    fn link(&self, node: u32) -> &Link {
        &self.links[node as usize]
    }

    fn link_mut(&mut self, node: u32) -> &mut Link {
        &mut self.links[node as usize]
    }

    /// Of two list heads, the one to give up first.
    fn older(&self, a: u32, b: u32) -> u32 {
        match (a, b) {
            (NONE, other) | (other, NONE) => other,
            _ if self.link(b).stamp < self.link(a).stamp => b,
            _ => a,
        }
    }

    fn heads(&self, set: EvictSet) -> (u32, u32) {
        match set {
            EvictSet::Device => (self.lists[DEVICE_ONLY].head, self.lists[DEVICE_AND_HOST].head),
            EvictSet::Host => (self.lists[HOST_ONLY].head, self.lists[DEVICE_AND_HOST].head),
            EvictSet::Claimable => (self.lists[CLAIMABLE].head, NONE),
            EvictSet::Storage => (self.lists[STORAGE_ONLY].head, NONE),
        }
    }

    /// Links `node` into `list` at the place of its stamp (module documentation).
    #[inline]
    fn insert(&mut self, list: usize, node: u32) {
        let stamp = self.link(node).stamp;
        let List { head, tail, .. } = self.lists[list];
        let (prev, next) = if tail == NONE {
            (NONE, NONE)
        } else if self.link(tail).stamp <= stamp {
            (tail, NONE)
        } else if stamp < self.link(head).stamp {
            (NONE, head)
        } else {
            self.place_inside(head, tail, stamp)
        };
        let link = self.link_mut(node);
        link.prev = prev;
        link.next = next;
        match prev {
            NONE => self.lists[list].head = node,
            prev => self.link_mut(prev).next = node,
        }
        match next {
            NONE => self.lists[list].tail = node,
            next => self.link_mut(next).prev = node,
        }
        self.lists[list].len += 1;
    }

    /// The neighbours of a node stamped `stamp`, to go strictly inside the list from `head` to
    /// `tail`: a walk from the end nearer by stamp.
    #[inline(never)]
    fn place_inside(&self, head: u32, tail: u32, stamp: u32) -> (u32, u32) {
        if stamp - self.link(head).stamp <= self.link(tail).stamp - stamp {
            // Walk from the head to the first member younger than `node`.
            let mut next = head;
            while self.link(next).stamp <= stamp {
                next = self.link(next).next;
            }
            (self.link(next).prev, next)
        } else {
            // Walk from the tail to the last member not younger than `node`.
            let mut prev = tail;
            while self.link(prev).stamp > stamp {
                prev = self.link(prev).prev;
            }
            (prev, self.link(prev).next)
        }
    }

    #[inline]
    fn unlink(&mut self, list: usize, node: u32) {
        let Link { prev, next, .. } = *self.link(node);
        match prev {
            NONE => self.lists[list].head = next,
            prev => self.link_mut(prev).next = next,
        }
        match next {
            NONE => self.lists[list].tail = prev,
            next => self.link_mut(next).prev = prev,
        }
        let link = self.link_mut(node);
        link.prev = NONE;
        link.next = NONE;
        self.lists[list].len -= 1;
    }

    /// Renumbers every stamp from 0, keeping the order (list order among equal stamps).
    #[cold]
    #[inline(never)]
    fn renumber(&mut self) {
        let mut rank = vec![0u32; self.links.len()];
        for list in &self.lists {
            let (mut node, mut position) = (list.head, 0);
            while node != NONE {
                rank[node as usize] = position;
                position += 1;
                node = self.link(node).next;
            }
        }
        let mut order: Vec<u32> = (0..self.links.len() as u32).collect();
        order.sort_unstable_by_key(|&node| (self.link(node).stamp, rank[node as usize]));
        for (stamp, &node) in order.iter().enumerate() {
            self.link_mut(node).stamp = stamp as u32;
        }
        self.clock = order.len() as u32;
    }

    /// The next stamp, renumbering first if the counter ran out.
    #[inline]
    fn next_stamp(&mut self) -> u32 {
        if self.clock == u32::MAX {
            self.renumber();
        }
        let stamp = self.clock;
        self.clock += 1;
        stamp
    }

    #[cfg(test)]
    fn with_clock(clock: u32) -> Lru {
        Lru { clock, ..Lru::default() }
    }
}

impl Policy for Lru {
    fn reserve_nodes(&mut self, nodes: usize) {
        if nodes > self.links.len() {
            self.links.resize(nodes, UNLINKED);
        }
    }

    #[inline]
    fn wants(&self, access: Access) -> bool {
        access == Access::Release
    }

    #[inline]
    fn touch(&mut self, node: NodeId, _key: BlockHash, access: Access) {
        if access == Access::Release {
            let stamp = self.next_stamp();
            self.link_mut(node.0).stamp = stamp;
        }
    }

    #[inline]
    fn enter(&mut self, node: NodeId, sets: Membership) {
        if let Some(list) = list_of(sets) {
            self.insert(list, node.0);
        }
    }

    #[inline]
    fn leave(&mut self, node: NodeId, sets: Membership) {
        if let Some(list) = list_of(sets) {
            self.unlink(list, node.0);
        }
    }

    #[inline]
    fn first(&self, set: EvictSet) -> Option<NodeId> {
        let (a, b) = self.heads(set);
        Some(self.older(a, b)).filter(|&node| node != NONE).map(NodeId)
    }

    fn len(&self, set: EvictSet) -> usize {
        let len = |list: usize| self.lists[list].len as usize;
        match set {
            EvictSet::Device => len(DEVICE_ONLY) + len(DEVICE_AND_HOST),
            EvictSet::Host => len(HOST_ONLY) + len(DEVICE_AND_HOST),
            EvictSet::Claimable => len(CLAIMABLE),
            EvictSet::Storage => len(STORAGE_ONLY),
        }
    }

    fn visit(&self, set: EvictSet, visit: &mut dyn FnMut(NodeId) -> ControlFlow<()>) {
        let (mut a, mut b) = self.heads(set);
        while a != NONE || b != NONE {
            let node = self.older(a, b);
            if node == a {
                a = self.link(a).next;
            } else {
                b = self.link(b).next;
            }
            if visit(NodeId(node)).is_break() {
                return;
            }
        }
    }

    fn stamp(&self, node: NodeId) -> u64 {
        u64::from(self.link(node.0).stamp)
    }

    fn clear(&mut self) {
        *self = Lru::default();
    }

    fn check(&self, membership: &dyn Fn(NodeId) -> Option<Membership>) -> Result<(), String> {
        for (list, state) in self.lists.iter().enumerate() {
            let (mut node, mut prev, mut count) = (state.head, NONE, 0u32);
            while node != NONE {
                let link =
                    self.links.get(node as usize).ok_or(format!("list {list} names {node}"))?;
                let sets = membership(NodeId(node))
                    .ok_or_else(|| format!("list {list} holds {node}, not a live node"))?;
                if list_of(sets) != Some(list) {
                    return Err(format!("node {node} is in LRU list {list} but filed as {sets:?}"));
                }
                if link.prev != prev {
                    return Err(format!("node {node} of LRU list {list} has a wrong back link"));
                }
                if prev != NONE && self.link(prev).stamp > link.stamp {
                    return Err(format!("LRU list {list} is out of order at node {node}"));
                }
                count += 1;
                if count > state.len {
                    return Err(format!("LRU list {list} is longer than its length {}", state.len));
                }
                prev = node;
                node = link.next;
            }
            if prev != state.tail || count != state.len {
                return Err(format!("LRU list {list} has a wrong tail or length"));
            }
        }
        let mut filed = [0u32; LISTS];
        for node in 0..self.links.len() as u32 {
            if let Some(list) = membership(NodeId(node)).and_then(list_of) {
                filed[list] += 1;
            }
        }
        if filed != self.lists.map(|list| list.len) {
            return Err(format!("LRU lists hold {:?} nodes but {filed:?} are filed", self.lists));
        }
        Ok(())
    }

    fn heap_bytes(&self) -> usize {
        self.links.capacity() * size_of::<Link>()
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

    #[test]
    fn running_out_of_stamps_renumbers_them_in_order() {
        let mut lru = Lru::with_clock(u32::MAX - 2);
        lru.reserve_nodes(6);
        released(&mut lru, &[4, 2]);
        lru.touch(NodeId(5), BlockHash(0), Access::Release); // not filed: keeps its place too
        released(&mut lru, &[0, 3]);
        assert!(lru.clock < 10, "renumbered: clock {}", lru.clock);
        lru.enter(NodeId(5), DEVICE);
        assert_eq!(order(&lru, EvictSet::Device), vec![4, 2, 5, 0, 3]);
    }
}
