//! Recency lists: the stamp-ordered intrusive lists that the `lru` and `conv` policies order
//! their sets with, and the one mapping from a node's evictable sets to the kind of list it
//! belongs in, which every policy shares.
//!
//! Core types: [`RecencyLists`] (`N` lists threaded through one per-node [`Link`] of 12 bytes:
//! stamp, previous, next), the list-kind constants ([`DEVICE_ONLY`] and the others) and
//! [`kind_of`].
//!
//! A stamp comes from a counter bumped at every release ([`RecencyLists::stamp_now`]); each list
//! is sorted by stamp, oldest first. One insertion ([`RecencyLists::insert`]):
//! 1. a node whose stamp is not older than the tail's (just released: the usual case) is
//!    appended, O(1); one older than the head is prepended, O(1);
//! 2. otherwise (it joins late: a parent whose last device child was evicted, a copy that
//!    landed) it is placed by a walk from the end nearer by stamp, which for a parent exposed by
//!    the eviction of a child it was released with is the head.
//!
//! Stamps are `u32`: when the counter runs out (every 4 billion releases) every stamp is
//! renumbered in order, once, in O(n log n), and `stamp_now` says so.

use super::Membership;

/// "No node": the end of a list.
pub(super) const NONE: u32 = u32::MAX;

/// The kinds of list a filed node belongs in, by its sets: a node is in at most one.
pub(super) const DEVICE_ONLY: usize = 0;
pub(super) const DEVICE_AND_HOST: usize = 1;
pub(super) const HOST_ONLY: usize = 2;
pub(super) const CLAIMABLE: usize = 3;
pub(super) const STORAGE_ONLY: usize = 4;
pub(super) const KINDS: usize = 5;

/// The kind of list of a node in `sets`, or `None` when it is in no set.
///
/// # Panics
/// On a claimable or storage node in another set too: the tree's predicates exclude it.
#[inline]
pub(super) fn kind_of(sets: Membership) -> Option<usize> {
    const NOT_FILED: usize = KINDS;
    const NO_LIST: usize = KINDS + 1;
    /// By membership bits (device 1, host 2, claimable 4, storage 8); `NO_LIST` where no node
    /// can be.
    const KIND: [usize; 16] = {
        let mut kind = [NO_LIST; 16];
        kind[0] = NOT_FILED;
        kind[1] = DEVICE_ONLY;
        kind[2] = HOST_ONLY;
        kind[3] = DEVICE_AND_HOST;
        kind[4] = CLAIMABLE;
        kind[8] = STORAGE_ONLY;
        kind
    };
    match KIND[usize::from(sets.bits())] {
        NOT_FILED => None,
        NO_LIST => {
            unreachable!("a claimable or storage node in another set is a programming error")
        }
        kind => Some(kind),
    }
}

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

/// `N` lists of nodes sorted by release stamp (module documentation).
#[derive(Debug)]
pub(super) struct RecencyLists<const N: usize> {
    links: Vec<Link>,
    lists: [List; N],
    /// The next stamp.
    clock: u32,
}

impl<const N: usize> Default for RecencyLists<N> {
    fn default() -> Self {
        RecencyLists { links: Vec::new(), lists: [EMPTY; N], clock: 0 }
    }
}

impl<const N: usize> RecencyLists<N> {
    #[inline]
    fn link(&self, node: u32) -> &Link {
        &self.links[node as usize]
    }

    #[inline]
    fn link_mut(&mut self, node: u32) -> &mut Link {
        &mut self.links[node as usize]
    }

    /// Makes room for nodes of ids below `nodes`.
    pub fn reserve_nodes(&mut self, nodes: usize) {
        if nodes > self.links.len() {
            self.links.resize(nodes, UNLINKED);
        }
    }

    /// The next stamp to be given.
    pub fn clock(&self) -> u32 {
        self.clock
    }

    /// The stamp of `node`'s last release (0 if never released).
    #[inline]
    pub fn stamp(&self, node: u32) -> u32 {
        self.link(node).stamp
    }

    /// Stamps `node` (in no list) as released now. Returns whether the stamps ran out and were
    /// renumbered first (every stamp then means something else).
    #[inline]
    pub fn stamp_now(&mut self, node: u32) -> bool {
        let renumbered = self.clock == u32::MAX;
        if renumbered {
            self.renumber();
        }
        let stamp = self.clock;
        self.clock += 1;
        self.link_mut(node).stamp = stamp;
        renumbered
    }

    #[inline]
    pub fn head(&self, list: usize) -> u32 {
        self.lists[list].head
    }

    #[inline]
    pub fn len(&self, list: usize) -> u32 {
        self.lists[list].len
    }

    /// The member after `node` in its list.
    #[inline]
    pub fn next(&self, node: u32) -> u32 {
        self.link(node).next
    }

    /// Of the heads of two lists, the one to give up first (the older; `a` on a tie); `NONE`
    /// when both are empty.
    #[inline]
    pub fn older_head(&self, a: usize, b: usize) -> u32 {
        match (self.lists[a].head, self.lists[b].head) {
            (NONE, other) | (other, NONE) => other,
            (a, b) if self.link(b).stamp < self.link(a).stamp => b,
            (a, _) => a,
        }
    }

    /// Whether a node stamped `stamp` would go before the head of `list` (an empty list has
    /// none).
    #[inline]
    pub fn older_than_head(&self, stamp: u32, list: usize) -> bool {
        match self.lists[list].head {
            NONE => true,
            head => stamp < self.link(head).stamp,
        }
    }

    /// Links `node` into `list` at the place of its stamp (module flow).
    #[inline]
    pub fn insert(&mut self, list: usize, node: u32) {
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

    /// Unlinks `node` from `list`, which holds it.
    #[inline]
    pub fn unlink(&mut self, list: usize, node: u32) {
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

    /// Checks every list against `expected`: for each id there is room for, the
    /// list the node belongs in (`Ok(None)`: none), or `Err` with what is wrong with it (not a
    /// live node, say). `name` names the policy in the messages. Scans everything.
    pub fn check(
        &self,
        name: &str,
        expected: &dyn Fn(u32) -> Result<Option<usize>, String>,
    ) -> Result<(), String> {
        for (list, state) in self.lists.iter().enumerate() {
            let (mut node, mut prev, mut count) = (state.head, NONE, 0u32);
            while node != NONE {
                let link = self
                    .links
                    .get(node as usize)
                    .ok_or(format!("{name} list {list} names {node}"))?;
                let belongs =
                    expected(node).map_err(|error| format!("{name} list {list}: {error}"))?;
                if belongs != Some(list) {
                    return Err(format!(
                        "node {node} is in {name} list {list} but belongs in {belongs:?}"
                    ));
                }
                if link.prev != prev {
                    return Err(format!("node {node} of {name} list {list} has a wrong back link"));
                }
                if prev != NONE && self.link(prev).stamp > link.stamp {
                    return Err(format!("{name} list {list} is out of order at node {node}"));
                }
                count += 1;
                if count > state.len {
                    return Err(format!(
                        "{name} list {list} is longer than its length {}",
                        state.len
                    ));
                }
                prev = node;
                node = link.next;
            }
            if prev != state.tail || count != state.len {
                return Err(format!("{name} list {list} has a wrong tail or length"));
            }
        }
        let mut filed = [0u32; N];
        for node in 0..self.links.len() as u32 {
            if let Ok(Some(list)) = expected(node) {
                filed[list] += 1;
            }
        }
        let held = self.lists.map(|list| list.len);
        if filed != held {
            return Err(format!("{name} lists hold {held:?} nodes but {filed:?} are filed"));
        }
        Ok(())
    }

    /// Bytes of heap memory held.
    pub fn heap_bytes(&self) -> usize {
        self.links.capacity() * size_of::<Link>()
    }

    /// Lists whose clock starts at `clock` (to test running out of stamps).
    #[cfg(test)]
    pub fn with_clock(clock: u32) -> Self {
        RecencyLists { clock, ..RecencyLists::default() }
    }

    /// Moves the clock `by` stamps on, as that many releases of other nodes would.
    #[cfg(test)]
    pub fn advance_clock(&mut self, by: u32) {
        self.clock += by;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order<const N: usize>(lists: &RecencyLists<N>, list: usize) -> Vec<u32> {
        let mut order = Vec::new();
        let mut node = lists.head(list);
        while node != NONE {
            order.push(node);
            node = lists.next(node);
        }
        order
    }

    #[test]
    fn late_joiners_are_placed_by_stamp_and_the_older_head_goes_first() {
        let mut lists = RecencyLists::<2>::default();
        lists.reserve_nodes(8);
        for node in [3, 1, 2, 4, 5, 6, 7] {
            lists.stamp_now(node);
        }
        for node in [3, 1, 7] {
            lists.insert(0, node);
        }
        lists.insert(0, 5); // inside, near the tail
        lists.insert(0, 2); // inside, near the head
        assert_eq!(order(&lists, 0), vec![3, 1, 2, 5, 7]);
        lists.unlink(0, 3);
        assert_eq!(lists.head(0), 1);
        lists.insert(1, 4);
        assert_eq!(lists.older_head(0, 1), 1);
        lists.unlink(0, 1);
        assert_eq!(lists.older_head(0, 1), 2);
        let expected =
            |node: u32| Ok([2, 5, 7].contains(&node).then_some(0).or((node == 4).then_some(1)));
        lists.check("test", &expected).unwrap();
        assert!(lists.check("test", &|_| Ok(None)).is_err(), "a stray member is found");
    }

    #[test]
    fn running_out_of_stamps_renumbers_them_in_order() {
        let mut lists = RecencyLists::<1>::with_clock(u32::MAX - 2);
        lists.reserve_nodes(6);
        for node in [4, 2] {
            assert!(!lists.stamp_now(node));
            lists.insert(0, node);
        }
        assert!(lists.stamp_now(5), "the counter ran out"); // not filed: keeps its place too
        for node in [0, 3] {
            lists.stamp_now(node);
            lists.insert(0, node);
        }
        assert!(lists.clock() < 10, "renumbered: clock {}", lists.clock());
        lists.insert(0, 5);
        assert_eq!(order(&lists, 0), vec![4, 2, 5, 0, 3]);
    }
}
