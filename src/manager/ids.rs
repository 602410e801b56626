//! Hash maps keyed by the manager's own ids: the allocation dry run's scratch, prefetch queries
//! (and the scheduler benchmark's fast baseline, a map of block hashes). The maps every request
//! touches (its slot, its tickets, the copies in flight) are [`super::id_table::IdTable`]s
//! instead.
//!
//! The keys are integers the engine picks (requests) or the manager counts (tickets, copies),
//! not input that an attacker shapes to flood a table, so a multiply replaces SipHash, which
//! cost more than the rest of a request's bookkeeping.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Hashes integer ids with one multiply, folded so that both the low bits (the bucket) and the
/// high bits (the tag) of the result depend on every bit of the id.
#[derive(Clone, Copy, Debug, Default)]
pub struct IdHasher(u64);

const MULTIPLIER: u64 = 0x9E37_79B9_7F4A_7C15;

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(u64::from(byte));
        }
    }

    fn write_u32(&mut self, value: u32) {
        self.write_u64(u64::from(value));
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = (self.0.rotate_left(5) ^ value).wrapping_mul(MULTIPLIER);
    }

    fn write_u128(&mut self, value: u128) {
        self.write_u64(value as u64 ^ (value >> 64) as u64);
    }

    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 32)
    }
}

/// A hash map keyed by ids, hashed by [`IdHasher`].
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn consecutive_ids_differ_in_low_and_high_bits() {
        let build = BuildHasherDefault::<IdHasher>::default();
        let hashes: Vec<u64> = (0..256u64).map(|id| build.hash_one(id)).collect();
        let low: std::collections::HashSet<u64> = hashes.iter().map(|hash| hash & 0xff).collect();
        let high: std::collections::HashSet<u64> = hashes.iter().map(|hash| hash >> 57).collect();
        assert!(low.len() > 150 && high.len() > 100, "{} low, {} high", low.len(), high.len());
    }
}
