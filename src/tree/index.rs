//! The child index: (parent, block hash) to node, one open-addressed table for the whole tree.
//!
//! Slots come in groups of twelve, one cache line each: twelve one-byte tags (0 marks a free
//! slot), a count of displaced entries, and twelve node ids. The node holds the key. A key's
//! home group and tag come from its block hash alone (its words folded and multiplied once, the
//! high bits scaled to the number of groups): block hashes are uniform already, so no hash
//! function runs. The parent is compared with the hash when a tag matches. Core type: [`ChildIndex`].
//!
//! An entry takes the first free slot from its home group on, and every full group it passes
//! counts it as displaced. So:
//! - a lookup (1) scans its home group for its tag, comparing the key of each node that has it,
//!   and (2) stops at the first group that counts no displaced entry, or goes on to the next;
//! - a removal empties its slot and uncounts the groups the entry had passed: no tombstones, no
//!   shifting, nothing to rebuild;
//! - past 7/8 full, the table doubles and every entry is placed again. A tree sized for its
//!   tiers ([`ChildIndex::with_capacity`]: 9/16 full with all their blocks cached) never gets
//!   there unless the storage tier holds more.

use super::node::{split, Node};
use super::NodeId;
use crate::hash::BlockHash;

const SLOTS: usize = 12;

/// Twelve slots in one cache line.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
struct Group {
    /// The tags of the twelve slots (0: free), then the displaced count (little-endian u32).
    meta: [u8; 16],
    ids: [u32; SLOTS],
}

const _: () = assert!(size_of::<Group>() == 64);

const EMPTY_GROUP: Group = Group { meta: [0; 16], ids: [u32::MAX; SLOTS] };

/// The bits of the twelve slots in a [`Group::slots_tagged`] mask.
const ALL_SLOTS: u32 = (1 << SLOTS) - 1;

impl Group {
    /// A mask with bit `i` set for each slot `i` whose tag is `tag` (so `tag` 0 finds the free
    /// slots): one compare of the sixteen meta bytes, the displaced count masked off.
    #[inline]
    fn slots_tagged(&self, tag: u8) -> u32 {
        crate::simd::equal_bytes(&self.meta, tag) & ALL_SLOTS
    }

    fn displaced(&self) -> u32 {
        u32::from_le_bytes([self.meta[12], self.meta[13], self.meta[14], self.meta[15]])
    }

    fn set_displaced(&mut self, count: u32) {
        self.meta[12..16].copy_from_slice(&count.to_le_bytes());
    }
}

/// How full a table sized for its entries is once it holds them all, in sixteenths
/// ([`presized_groups`]).
pub(super) const PRESIZED_SIXTEENTHS_FULL: usize = 9;

/// The groups of a table sized for `entries` ([`ChildIndex::with_capacity`]): 9/16 full with
/// them all. Any number of groups will do (a key's home is its hash scaled to the table, not
/// masked), so a presized table is that full whatever its size, where rounding up to a power of
/// two left it anywhere between 7/16 and 7/8 full. Fuller, groups overflow into the next ones,
/// and the lookups that miss, the insertions and the removals that pass them read one more cache
/// line each: at 19,531 blocks the power of two was 80% full, and 9/16 cut the replay's p50 there
/// by a fifth. Emptier costs memory for little: 7/16 was 1-3% faster again at 19,531 blocks
/// but 3 bytes per block more (above the 96-byte budget); 10/16 was 5% slower.
fn presized_groups(entries: usize) -> usize {
    (entries * 16).div_ceil(SLOTS * PRESIZED_SIXTEENTHS_FULL)
}

/// The entries a table of `groups` groups holds before it doubles: 7/8 of its slots.
fn grow_at(groups: usize) -> usize {
    groups * SLOTS * 7 / 8
}

/// The slot of the lowest set bit of a [`Group::slots_tagged`] mask.
fn first_slot(mask: u32) -> usize {
    mask.trailing_zeros() as usize
}

/// The folded and multiplied block hash: its high bits pick the home group, a middle byte is
/// the tag.
fn mix(hash: &[u32; 4]) -> u64 {
    let low = u64::from(hash[0]) | u64::from(hash[1]) << 32;
    let high = u64::from(hash[2]) | u64::from(hash[3]) << 32;
    // Uniform hashes need no mixing; the multiply spreads small precomputed ones (tests, trace
    // ids) over the table as well.
    (low ^ high.rotate_left(32)).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

fn tag(mixed: u64) -> u8 {
    let tag = (mixed >> 24) as u8;
    tag | u8::from(tag == 0)
}

/// (parent, block hash) to child, for every node but the root.
#[derive(Debug, Default)]
pub struct ChildIndex {
    groups: Vec<Group>,
    len: usize,
    /// The entries past which the table doubles (7/8 of its slots).
    grow_at: usize,
}

impl ChildIndex {
    /// An index that holds `entries` without growing, 9/16 full when it holds them all
    /// ([`presized_groups`]), allocated (and written) now.
    pub fn with_capacity(entries: usize) -> ChildIndex {
        let groups = presized_groups(entries);
        ChildIndex { groups: vec![EMPTY_GROUP; groups], len: 0, grow_at: grow_at(groups) }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    fn home(&self, mixed: u64) -> usize {
        ((u128::from(mixed) * self.groups.len() as u128) >> 64) as usize
    }

    fn next(&self, group: usize) -> usize {
        if group + 1 == self.groups.len() {
            0
        } else {
            group + 1
        }
    }

    /// The child of `parent` keyed by `hash`.
    #[inline]
    pub fn find(&self, parent: NodeId, hash: BlockHash, nodes: &[Node]) -> Option<NodeId> {
        if self.groups.is_empty() {
            return None;
        }
        let words = split(hash);
        let mixed = mix(&words);
        let tag = tag(mixed);
        let mut index = self.home(mixed);
        // Every group at most once: displaced entries may wrap around the end of the table.
        for _ in 0..self.groups.len() {
            let group = &self.groups[index];
            let mut candidates = group.slots_tagged(tag);
            while candidates != 0 {
                let id = group.ids[first_slot(candidates)];
                let node = &nodes[id as usize];
                if node.parent == parent && node.has_hash(&words) {
                    return Some(NodeId(id));
                }
                candidates &= candidates - 1;
            }
            if group.displaced() == 0 {
                return None;
            }
            index = self.next(index);
        }
        None
    }

    /// Adds node `id`, keyed by `words` (its hash words, as `nodes[id]` holds them) and absent
    /// from the index, growing the table first when it is 7/8 full.
    #[inline]
    pub fn insert(&mut self, id: NodeId, words: &[u32; 4], nodes: &[Node]) {
        if self.len >= self.grow_at {
            self.grow(nodes);
        }
        self.place(id, words);
        self.len += 1;
    }

    fn place(&mut self, id: NodeId, words: &[u32; 4]) {
        let mixed = mix(words);
        let mut index = self.home(mixed);
        loop {
            let group = &mut self.groups[index];
            let free = group.slots_tagged(0);
            if free != 0 {
                let slot = first_slot(free);
                group.meta[slot] = tag(mixed);
                group.ids[slot] = id.0;
                return;
            }
            group.set_displaced(group.displaced() + 1);
            index = self.next(index);
        }
    }

    /// Removes node `id`, keyed by `words`.
    ///
    /// # Panics
    /// If the index does not hold it: the tree removes only nodes it inserted.
    #[inline]
    pub fn remove(&mut self, id: NodeId, words: &[u32; 4]) {
        let mixed = mix(words);
        let tag = tag(mixed);
        let mut index = self.home(mixed);
        for _ in 0..self.groups.len() {
            let group = &mut self.groups[index];
            let mut candidates = group.slots_tagged(tag);
            while candidates != 0 {
                let slot = first_slot(candidates);
                if group.ids[slot] == id.0 {
                    group.meta[slot] = 0;
                    self.len -= 1;
                    return;
                }
                candidates &= candidates - 1;
            }
            // The entry went past this group when it was placed.
            group.set_displaced(group.displaced() - 1);
            index = self.next(index);
        }
        unreachable!("removing {id:?}, which the child index does not hold, is a programming error")
    }

    #[cold]
    fn grow(&mut self, nodes: &[Node]) {
        let groups = (self.groups.len() * 2).max(1);
        let old = std::mem::replace(&mut self.groups, vec![EMPTY_GROUP; groups]);
        self.grow_at = grow_at(groups);
        for group in &old {
            let mut occupied = !group.slots_tagged(0) & ALL_SLOTS;
            while occupied != 0 {
                let id = group.ids[first_slot(occupied)];
                self.place(NodeId(id), nodes[id as usize].hash_words());
                occupied &= occupied - 1;
            }
        }
    }

    /// Every indexed node id, in no particular order.
    pub fn ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.groups.iter().flat_map(|group| {
            (0..SLOTS).filter(|&slot| group.meta[slot] != 0).map(|slot| NodeId(group.ids[slot]))
        })
    }

    /// Checks the load factor (the growth threshold is 7/8 of the slots, and no more entries
    /// than that are held: [`ChildIndex::insert`] grows first) and
    /// the displaced counts: each group counts exactly the entries placed past it.
    pub fn check(&self, nodes: &[Node]) -> Result<(), String> {
        if self.grow_at != grow_at(self.groups.len()) {
            return Err(format!(
                "the child index grows at {} entries, not 7/8 of its {} groups' slots",
                self.grow_at,
                self.groups.len()
            ));
        }
        if self.len > self.grow_at {
            return Err(format!(
                "the child index holds {} entries, past the {} it grows at",
                self.len, self.grow_at
            ));
        }
        let mut displaced = vec![0u32; self.groups.len()];
        let mut count = 0;
        for (index, group) in self.groups.iter().enumerate() {
            for slot in (0..SLOTS).filter(|&slot| group.meta[slot] != 0) {
                count += 1;
                let id = group.ids[slot] as usize;
                let mixed = mix(nodes[id].hash_words());
                if group.meta[slot] != tag(mixed) {
                    return Err(format!("node {id} is indexed under a wrong tag"));
                }
                let mut passed = self.home(mixed);
                while passed != index {
                    displaced[passed] += 1;
                    passed = self.next(passed);
                }
            }
        }
        if count != self.len {
            return Err(format!("the child index counts {} entries but holds {count}", self.len));
        }
        for (index, group) in self.groups.iter().enumerate() {
            if group.displaced() != displaced[index] {
                return Err(format!(
                    "group {index} of the child index counts {} displaced entries, not {}",
                    group.displaced(),
                    displaced[index]
                ));
            }
        }
        Ok(())
    }

    /// Removes every entry, keeping the table's size.
    pub fn clear(&mut self) {
        self.groups.fill(EMPTY_GROUP);
        self.len = 0;
    }

    pub fn heap_bytes(&self) -> usize {
        self.groups.capacity() * size_of::<Group>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tag_is_found_exactly_and_free_slots_too() {
        let mut group = EMPTY_GROUP;
        for (slot, tag) in [(0, 7u8), (3, 7), (5, 0x80), (8, 0xff), (9, 0x7f), (11, 1)] {
            group.meta[slot] = tag;
        }
        group.set_displaced(0x0707_0707);
        let slots = |mask: u32| {
            let mut mask = mask;
            let mut slots = Vec::new();
            while mask != 0 {
                slots.push(first_slot(mask));
                mask &= mask - 1;
            }
            slots
        };
        assert_eq!(slots(group.slots_tagged(7)), vec![0, 3], "the displaced count is no tag");
        assert_eq!(slots(group.slots_tagged(0x80)), vec![5]);
        assert_eq!(slots(group.slots_tagged(0xff)), vec![8]);
        assert_eq!(slots(group.slots_tagged(0x7f)), vec![9]);
        assert_eq!(slots(group.slots_tagged(0)), vec![1, 2, 4, 6, 7, 10]);
        assert_eq!(group.displaced(), 0x0707_0707);
    }

    #[test]
    fn a_missing_key_is_missing_when_every_group_counts_displaced_entries() {
        let mut index = ChildIndex { groups: vec![EMPTY_GROUP; 2], len: 0, grow_at: grow_at(2) };
        let mut nodes = vec![Node::new(BlockHash(0), NodeId::NONE)];
        let mut values = 1u128..;
        let mut add = |index: &mut ChildIndex, nodes: &mut Vec<Node>, home: usize| {
            let value = values.find(|&value| index.home(mix(&split(BlockHash(value)))) == home);
            let hash = BlockHash(value.unwrap());
            nodes.push(Node::new(hash, NodeId::ROOT));
            let id = NodeId(nodes.len() as u32 - 1);
            index.place(id, &split(hash));
            index.len += 1;
            id
        };
        // Group 0 fills, an entry of group 0 spills into group 1, group 1 fills; a slot of group
        // 0 frees and an entry of group 1 spills into it: both groups count a displaced entry.
        // (Past the load factor on the way: `place` does not grow the table.)
        let first = add(&mut index, &mut nodes, 0);
        let at_home_0: Vec<NodeId> = (0..11).map(|_| add(&mut index, &mut nodes, 0)).collect();
        let at_home = (0..11).map(|_| add(&mut index, &mut nodes, 1)).last().unwrap();
        add(&mut index, &mut nodes, 0);
        index.remove(first, &split(nodes[first.index()].hash()));
        add(&mut index, &mut nodes, 1);
        // Entries at home leave until the table is back within its load factor: the displaced
        // counts stay.
        for &id in [at_home].iter().chain(&at_home_0[..2]) {
            index.remove(id, &split(nodes[id.index()].hash()));
        }
        assert_eq!(index.len(), grow_at(2));
        assert!(index.groups.iter().all(|group| group.displaced() == 1));
        index.check(&nodes).unwrap();
        assert_eq!(index.find(NodeId::ROOT, BlockHash(u128::MAX), &nodes), None);
        let last = NodeId(nodes.len() as u32 - 1);
        assert_eq!(index.find(NodeId::ROOT, nodes[last.index()].hash(), &nodes), Some(last));
    }

    /// Removals move no entry (they only uncount displaced ones): in a table whose groups count
    /// displaced entries, every entry is removed, in a scrambled order, the counts checked after
    /// each.
    #[test]
    fn removals_in_any_order_keep_every_displaced_count() {
        let mut index = ChildIndex::with_capacity(40);
        let mut nodes = vec![Node::new(BlockHash(0), NodeId::NONE)];
        // Keys whose homes crowd the first groups: most of them are displaced.
        let homes = index.groups.len();
        let mut values = 1u128..;
        while index.len() < index.grow_at {
            let value = values.find(|&value| index.home(mix(&split(BlockHash(value)))) < 2);
            let hash = BlockHash(value.unwrap());
            nodes.push(Node::new(hash, NodeId::ROOT));
            let id = NodeId(nodes.len() as u32 - 1);
            index.insert(id, &split(hash), &nodes);
        }
        assert_eq!(index.groups.len(), homes, "the table kept its size");
        assert!(index.groups.iter().filter(|group| group.displaced() > 0).count() > 1);
        let mut ids: Vec<NodeId> = (1..nodes.len()).map(|id| NodeId(id as u32)).collect();
        // Scrambled, deterministically: displaced entries go before and after their blockers.
        ids.sort_by_key(|&id| id.0.wrapping_mul(0x9E37_79B9) >> 7);
        for (removed, &id) in ids.iter().enumerate() {
            index.remove(id, nodes[id.index()].hash_words());
            index.check(&nodes).unwrap_or_else(|error| panic!("after {removed} removals: {error}"));
            assert_eq!(index.find(NodeId::ROOT, nodes[id.index()].hash(), &nodes), None);
        }
        assert_eq!(index.len(), 0);
    }

    #[test]
    fn small_hashes_spread_over_the_groups() {
        let index = ChildIndex { groups: vec![EMPTY_GROUP; 64], len: 0, grow_at: grow_at(64) };
        let homes: std::collections::HashSet<usize> =
            (0..256u128).map(|value| index.home(mix(&split(BlockHash(value))))).collect();
        assert!(homes.len() > 48, "only {} of 64 groups used", homes.len());
    }
}
