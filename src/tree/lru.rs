//! The ordered sets of eviction candidates, and the hasher of the child index.
//!
//! A candidate is ordered by [`EvictKey`]: least recently used first, and on equal access times
//! the deeper node first (so that the tail of a prefix goes before its head when a whole request
//! was touched at once). The tree keeps one set per kind of candidate and moves a node in or out
//! whenever one of the fields its predicate reads changes, so that finding a victim is a
//! `first()` and never a scan.

use std::collections::BTreeSet;
use std::hash::{BuildHasherDefault, Hasher};

use super::NodeId;

/// The position of a candidate in an eviction order: smaller goes first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EvictKey {
    pub last_access: u64,
    /// `u32::MAX - depth`: deeper nodes sort first among equal access times.
    pub inverse_depth: u32,
    pub node: NodeId,
}

impl EvictKey {
    pub fn new(last_access: u64, depth: u32, node: NodeId) -> EvictKey {
        EvictKey { last_access, inverse_depth: u32::MAX - depth, node }
    }
}

/// The candidates of one kind, in eviction order.
pub type EvictionSet = BTreeSet<EvictKey>;

/// A fast hasher for the child index, whose keys are a parent id and a 128-bit block hash.
///
/// Block hashes are usually uniform already, but precomputed ones (trace ids) can be small
/// integers, so every word is mixed and the result goes through a full avalanche.
#[derive(Default, Clone, Copy)]
pub struct ChildHasher {
    state: u64,
}

impl ChildHasher {
    fn mix(&mut self, word: u64) {
        self.state = (self.state ^ word).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(29);
    }
}

impl Hasher for ChildHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.mix(u64::from_le_bytes(word));
        }
    }

    fn write_u32(&mut self, value: u32) {
        self.mix(u64::from(value));
    }

    fn write_u64(&mut self, value: u64) {
        self.mix(value);
    }

    fn write_u128(&mut self, value: u128) {
        self.mix(value as u64);
        self.mix((value >> 64) as u64);
    }

    fn finish(&self) -> u64 {
        // The splitmix64 finalizer.
        let mut x = self.state;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^ (x >> 31)
    }
}

/// Builds [`ChildHasher`]s for hash maps.
pub type BuildChildHasher = BuildHasherDefault<ChildHasher>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn older_nodes_come_first_and_deeper_ones_on_ties() {
        let mut set = EvictionSet::new();
        set.insert(EvictKey::new(5, 1, NodeId(1)));
        set.insert(EvictKey::new(3, 1, NodeId(2)));
        set.insert(EvictKey::new(5, 4, NodeId(3)));
        let order: Vec<NodeId> = set.iter().map(|key| key.node).collect();
        assert_eq!(order, vec![NodeId(2), NodeId(3), NodeId(1)]);
    }

    #[test]
    fn small_integer_keys_spread_over_the_hash_space() {
        let hash = |value: u64| {
            let mut hasher = ChildHasher::default();
            hasher.write_u64(value);
            hasher.finish()
        };
        let top_bits: std::collections::HashSet<u64> = (0..64).map(|v| hash(v) >> 58).collect();
        assert!(top_bits.len() > 32, "only {} of 64 top-bit patterns", top_bits.len());
    }
}
