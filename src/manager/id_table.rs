//! A small open-addressed map keyed by an integer id, for the maps a request touches every time:
//! the live requests' slots, the tickets, and the copies in flight.
//!
//! Core type: [`IdTable`]. The keys are integers the engine picks (requests) or the manager
//! counts (tickets, copies), so their bits are spread by one multiply (Fibonacci hashing: the high bits
//! of the product pick the home slot) and no hash function runs. Entries sit inline in a
//! power-of-two array, at most half full, probed linearly:
//! 1. a lookup scans from the key's home slot to the key, or to the first empty slot (absent);
//! 2. an insertion takes the first empty slot from home on (the table doubles first when it
//!    would pass half full);
//! 3. a removal empties the key's slot and shifts back the entries after it that may move
//!    closer to their home (backward-shift deletion): no tombstones, so a probe never runs
//!    longer than the entries that collide with it.
//!
//! A request's `match_prefix` and `finish` each do one operation here (its `allocate` and
//! `commit` too, unless the request is the latest started: see `Requests`); a general hash
//! map's generic probing cost several times the work of these few instructions.

/// An integer id used as an [`IdTable`] key.
pub(crate) trait IdKey: Copy + Eq {
    fn bits(self) -> u64;
}

impl IdKey for super::RequestId {
    fn bits(self) -> u64 {
        self.0
    }
}

impl IdKey for super::TicketId {
    fn bits(self) -> u64 {
        self.0
    }
}

impl IdKey for super::TransferId {
    fn bits(self) -> u64 {
        self.0
    }
}

const MULTIPLIER: u64 = 0x9E37_79B9_7F4A_7C15;

/// Slots of a table's first allocation.
const MIN_SLOTS: usize = 16;

/// A map from ids to values (module flow).
#[derive(Clone, Debug)]
pub(crate) struct IdTable<K, V> {
    slots: Vec<Option<(K, V)>>,
    len: usize,
    /// `64 - log2(slots.len())`: the product's shift that leaves the home slot.
    shift: u32,
}

impl<K, V> Default for IdTable<K, V> {
    fn default() -> Self {
        IdTable { slots: Vec::new(), len: 0, shift: 64 }
    }
}

impl<K: IdKey, V> IdTable<K, V> {
    pub fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn home(&self, key: K) -> usize {
        // `shift` is 64 only while the table is empty, and no lookup probes then.
        (key.bits().wrapping_mul(MULTIPLIER) >> self.shift) as usize
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// The slot holding `key`, if any (module flow, step 1).
    #[inline]
    fn find(&self, key: K) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mask = self.mask();
        let mut index = self.home(key);
        // At most half full: an empty slot ends every probe.
        loop {
            match &self.slots[index] {
                Some((found, _)) if *found == key => return Some(index),
                Some(_) => index = (index + 1) & mask,
                None => return None,
            }
        }
    }

    #[inline]
    pub fn get(&self, key: &K) -> Option<&V> {
        let index = self.find(*key)?;
        self.slots[index].as_ref().map(|(_, value)| value)
    }

    #[inline]
    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        let index = self.find(*key)?;
        self.slots[index].as_mut().map(|(_, value)| value)
    }

    pub fn contains_key(&self, key: &K) -> bool {
        self.find(*key).is_some()
    }

    /// Inserts `value` under `key` unless the key is present: `false` then, and nothing changes.
    #[inline]
    pub fn insert_new(&mut self, key: K, value: V) -> bool {
        if (self.len + 1) * 2 > self.slots.len() {
            self.grow();
        }
        let mask = self.mask();
        let mut index = self.home(key);
        loop {
            match &self.slots[index] {
                Some((found, _)) if *found == key => return false,
                Some(_) => index = (index + 1) & mask,
                None => break,
            }
        }
        self.slots[index] = Some((key, value));
        self.len += 1;
        true
    }

    /// Inserts `value` under `key`, returning the value it replaces.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        if let Some(slot) = self.get_mut(&key) {
            return Some(std::mem::replace(slot, value));
        }
        self.insert_new(key, value);
        None
    }

    /// Removes `key` (module flow, step 3), returning its value.
    #[inline]
    pub fn remove(&mut self, key: &K) -> Option<V> {
        let mut hole = self.find(*key)?;
        let (_, value) = self.slots[hole].take().expect("found above");
        self.len -= 1;
        let mask = self.mask();
        let mut next = (hole + 1) & mask;
        while let Some((moved, _)) = &self.slots[next] {
            // An entry may move back to the hole if the hole lies between its home and its slot.
            let home = self.home(*moved);
            if (next.wrapping_sub(home) & mask) >= (next.wrapping_sub(hole) & mask) {
                self.slots[hole] = self.slots[next].take();
                hole = next;
            }
            next = (next + 1) & mask;
        }
        Some(value)
    }

    /// Doubles the table (or makes its first one) and places every entry again.
    #[cold]
    fn grow(&mut self) {
        let slots = (self.slots.len() * 2).max(MIN_SLOTS);
        let old = std::mem::replace(&mut self.slots, (0..slots).map(|_| None).collect());
        self.shift = 64 - slots.trailing_zeros();
        self.len = 0;
        for (key, value) in old.into_iter().flatten() {
            self.insert_new(key, value);
        }
    }

    /// Every entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> + '_ {
        self.slots.iter().flatten().map(|(key, value)| (key, value))
    }

    /// Every value, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = &V> + '_ {
        self.slots.iter().flatten().map(|(_, value)| value)
    }

    /// Every value, mutable, in no particular order.
    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut V> + '_ {
        self.slots.iter_mut().flatten().map(|(_, value)| value)
    }

    /// Keeps the entries for which `keep` is true.
    pub fn retain(&mut self, mut keep: impl FnMut(&K, &mut V) -> bool) {
        let gone: Vec<K> = self
            .slots
            .iter_mut()
            .flatten()
            .filter_map(|(key, value)| (!keep(key, value)).then_some(*key))
            .collect();
        for key in gone {
            self.remove(&key);
        }
    }
}

impl<'a, K: IdKey, V> IntoIterator for &'a IdTable<K, V> {
    type Item = (&'a K, &'a V);
    type IntoIter = Box<dyn Iterator<Item = (&'a K, &'a V)> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::super::RequestId;
    use super::*;
    use crate::test_rng::xorshift;
    use std::collections::HashMap;

    #[test]
    fn random_inserts_and_removals_agree_with_a_hash_map() {
        for keys in [8u64, 100, 5_000] {
            let mut table = IdTable::<RequestId, u64>::default();
            let mut model = HashMap::new();
            let mut state = 0x1234_5678_9abc_def1 ^ keys;
            for step in 0..50_000u64 {
                let key = RequestId(xorshift(&mut state) % keys);
                match xorshift(&mut state) % 4 {
                    0 | 1 => assert_eq!(table.insert(key, step), model.insert(key, step)),
                    2 => assert_eq!(table.remove(&key), model.remove(&key)),
                    _ => assert_eq!(table.get(&key), model.get(&key)),
                }
                assert_eq!(table.len(), model.len());
            }
            let mut entries: Vec<_> = table.iter().map(|(&key, &value)| (key, value)).collect();
            let mut expected: Vec<_> = model.iter().map(|(&key, &value)| (key, value)).collect();
            entries.sort_unstable();
            expected.sort_unstable();
            assert_eq!(entries, expected);
        }
    }

    #[test]
    fn colliding_keys_stay_findable_after_removals_around_the_wrap() {
        let mut table = IdTable::<RequestId, u32>::default();
        // Keys whose home is the last slot of the first table: their probes wrap to slot 0.
        let last = MIN_SLOTS - 1;
        let keys: Vec<RequestId> =
            (0u64..).map(RequestId).filter(|&key| table_home(key) == last).take(5).collect();
        for (value, &key) in keys.iter().enumerate() {
            assert!(table.insert_new(key, value as u32));
        }
        assert!(!table.insert_new(keys[0], 99), "a present key is not inserted again");
        table.remove(&keys[1]);
        table.remove(&keys[3]);
        for (value, key) in keys.iter().enumerate() {
            let expected = (value != 1 && value != 3).then_some(value as u32);
            assert_eq!(table.get(key).copied(), expected);
        }
    }

    fn table_home(key: RequestId) -> usize {
        (key.0.wrapping_mul(MULTIPLIER) >> (64 - MIN_SLOTS.trailing_zeros())) as usize
    }

    /// The copies in flight: ids counted from 1, each removed once, in any order, while later
    /// ones are inserted. Every lookup, `iter`, `values` and `values_mut` (which a reset uses
    /// to reserve every copy's blocks) agree with a hash map after every step.
    #[test]
    fn counted_ids_completed_out_of_order_agree_with_a_hash_map_in_every_view() {
        use super::super::TransferId;
        for window in [1u64, 7, 300] {
            let mut table = IdTable::<TransferId, u64>::default();
            let mut model: HashMap<TransferId, u64> = HashMap::new();
            let mut state = 0x0dd_ba11_5eed_u64 ^ window;
            let mut next_id = 1;
            for step in 0..20_000u64 {
                if model.len() < window as usize && xorshift(&mut state) % 3 != 0 {
                    let id = TransferId(next_id);
                    next_id += 1;
                    assert!(table.insert_new(id, step), "a fresh id is new");
                    model.insert(id, step);
                } else if !model.is_empty() {
                    // Oldest, newest or any: completions come in no order.
                    let mut ids: Vec<TransferId> = model.keys().copied().collect();
                    ids.sort_unstable_by_key(|id| id.0);
                    let id = ids[(xorshift(&mut state) % ids.len() as u64) as usize];
                    assert_eq!(table.remove(&id), model.remove(&id));
                    assert_eq!(table.get(&id), None, "a completed id is gone");
                }
                if step % 7 == 0 {
                    for value in table.values_mut() {
                        *value += 1;
                    }
                    for value in model.values_mut() {
                        *value += 1;
                    }
                }
                assert_eq!(table.len(), model.len());
                let mut values: Vec<u64> = table.values().copied().collect();
                let mut expected: Vec<u64> = model.values().copied().collect();
                values.sort_unstable();
                expected.sort_unstable();
                assert_eq!(values, expected, "window {window} step {step}");
                let mut entries: Vec<_> = table.iter().map(|(&id, &value)| (id.0, value)).collect();
                let mut expected: Vec<_> =
                    model.iter().map(|(&id, &value)| (id.0, value)).collect();
                entries.sort_unstable();
                expected.sort_unstable();
                assert_eq!(entries, expected, "window {window} step {step}");
            }
        }
    }

    #[test]
    fn retain_keeps_only_what_it_is_told() {
        let mut table = IdTable::<RequestId, u64>::default();
        for key in 0..100 {
            table.insert(RequestId(key), key);
        }
        table.retain(|_, value| *value % 3 == 0);
        assert_eq!(table.len(), 34);
        assert!(table.iter().all(|(key, &value)| value % 3 == 0 && key.0 == value));
        assert!(table.get(&RequestId(1)).is_none());
    }
}
