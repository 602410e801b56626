//! [`Held`]: the names a storage tier holds, as its owner knows them: what the back-end listed
//! when the owner started and what it wrote or read since, at most the back-end's capacity, the
//! least recently used forgotten first, as a full disk slab makes room (a write or a read makes a
//! block its newest; the owner tells them in the order the slab does).
//!
//! It is a guide, not the truth: the back-end may drop a block on its own (a Redis expiry, or
//! its LRU over a different history), and then one promotion misses and the name is forgotten; a
//! block forgotten here while the back-end keeps it is written again when an engine stores it
//! again.

use std::collections::{HashMap, VecDeque};

use crate::hash::BlockHash;

/// The names held, each with the turn it was last used in (module documentation).
#[derive(Debug)]
pub(super) struct Held {
    names: HashMap<BlockHash, u64>,
    /// Names by the turn they were used in, oldest first; an entry whose turn is not its name's
    /// any more (used again, or forgotten) is skipped.
    order: VecDeque<(BlockHash, u64)>,
    turn: u64,
    capacity: usize,
}

impl Held {
    /// At most `capacity` names, starting with `listed` (kept in the order given).
    pub fn new(capacity: usize, listed: impl IntoIterator<Item = BlockHash>) -> Held {
        let mut held = Held {
            names: HashMap::new(),
            order: VecDeque::new(),
            turn: 0,
            capacity: capacity.max(1),
        };
        for name in listed {
            held.insert(name);
        }
        held
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn contains(&self, name: &BlockHash) -> bool {
        self.names.contains_key(name)
    }

    /// `name` was written or read: the newest, and the least recently used forgotten past the
    /// capacity.
    pub fn insert(&mut self, name: BlockHash) {
        self.turn += 1;
        self.names.insert(name, self.turn);
        self.order.push_back((name, self.turn));
        while self.names.len() > self.capacity {
            let Some((oldest, turn)) = self.order.pop_front() else { break };
            if self.names.get(&oldest) == Some(&turn) {
                self.names.remove(&oldest);
            }
        }
        // Entries left behind by names written again or forgotten: dropped before they
        // outnumber the names.
        if self.order.len() > 2 * self.capacity {
            let names = &self.names;
            self.order.retain(|(name, turn)| names.get(name) == Some(turn));
        }
    }

    /// The back-end does not hold `name` (a read found it absent or damaged).
    pub fn forget(&mut self, name: &BlockHash) {
        self.names.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Past its capacity it forgets the least recently used; a name used again is the newest.
    #[test]
    fn the_least_recently_used_go_first_past_the_capacity() {
        let name = |n: u128| BlockHash(n);
        let mut held = Held::new(3, [name(1), name(2)]);
        held.insert(name(3));
        held.insert(name(1)); // written again: now the newest
        held.insert(name(4)); // past 3: the oldest, 2, goes
        assert!(!held.contains(&name(2)));
        assert!([1, 3, 4].iter().all(|&n| held.contains(&name(n))));
        held.forget(&name(3));
        held.insert(name(5));
        assert_eq!(held.len(), 3, "room made by a forgotten name is used first");
        assert!([1, 4, 5].iter().all(|&n| held.contains(&name(n))));
        for n in 10..100 {
            held.insert(name(n));
            assert!(held.order.len() <= 2 * held.capacity + 1);
        }
        assert_eq!(held.len(), 3);
    }
}
