//! [`SharedTierIndex::check_invariants`]: the client layer agrees with the manager under it,
//! checked from scratch (tests call it after every operation).

use std::collections::HashMap;

use super::{SharedTierIndex, NO_OWNER};
use crate::offload::key::OffloadKey;
use crate::offload::manager::LookupResult;

impl SharedTierIndex {
    /// Checks the manager's invariants and the clients' agreement with it; a violation is a bug
    /// in this module.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.manager.check_invariants()?;
        let mut chunk_keys: HashMap<u32, (OffloadKey, bool)> = HashMap::new();
        for (key, ready) in self.manager.keys() {
            let chunk = self.manager.chunk_of(&key).ok_or("a listed key has no chunk")?;
            chunk_keys.insert(chunk, (key, ready));
        }
        // A leased chunk holds no key and is charged to its client (`lease.rs`).
        let mut leased: HashMap<u32, usize> = HashMap::new();
        for (slot, client) in self.clients.iter().enumerate() {
            for chunk in client.iter().flat_map(|client| client.lease.chunks()) {
                if chunk_keys.contains_key(&chunk) || leased.insert(chunk, slot).is_some() {
                    return Err(format!("leased chunk {chunk} holds a key or is leased twice"));
                }
                if self.owners.get(chunk as usize) != Some(&(slot as u32)) {
                    return Err(format!(
                        "chunk {chunk} leased to slot {slot} is not charged to it"
                    ));
                }
            }
        }
        if self.leased_unnamed() > self.max_leased() {
            let most = self.max_leased();
            return Err(format!("{} chunks leased unnamed, at most {most}", self.leased_unnamed()));
        }
        // A chunk held back for a dead client holds no key, is leased to no one and charged to
        // no one (`release.rs`).
        let mut held_back = 0;
        for chunk in self.held_back_chunks() {
            if chunk_keys.contains_key(&chunk)
                || leased.insert(chunk, usize::MAX).is_some()
                || self.owners.get(chunk as usize) != Some(&NO_OWNER)
            {
                return Err(format!("held-back chunk {chunk} holds a key, is leased or charged"));
            }
            held_back += 1;
        }
        if leased.len() != self.manager.taken_chunks() {
            let taken = self.manager.taken_chunks();
            return Err(format!(
                "{} chunks leased and {held_back} held back, the manager took {taken}",
                leased.len() - held_back
            ));
        }
        let mut charged = vec![0u32; self.clients.len()];
        for (chunk, &owner) in (0u32..).zip(&self.owners) {
            if owner == NO_OWNER {
                continue;
            }
            if !chunk_keys.contains_key(&chunk) && !leased.contains_key(&chunk) {
                return Err(format!("free chunk {chunk} is charged to slot {owner}"));
            }
            match self.clients.get(owner as usize) {
                Some(Some(_)) => charged[owner as usize] += 1,
                _ => return Err(format!("chunk {chunk} is charged to empty slot {owner}")),
            }
        }
        let mut pins: HashMap<OffloadKey, u32> = HashMap::new();
        let mut storing = 0;
        for (slot, client) in self.clients.iter().enumerate() {
            let Some(client) = client else { continue };
            if client.id.slot as usize != slot {
                return Err(format!("client {:?} sits in slot {slot}", client.id));
            }
            if client.charged != charged[slot] {
                return Err(format!(
                    "client {:?} counts {} chunks, {} are charged to it",
                    client.id, client.charged, charged[slot]
                ));
            }
            if client.quota.is_some_and(|quota| client.charged > quota) {
                return Err(format!(
                    "client {:?} holds {} chunks over its quota",
                    client.id, client.charged
                ));
            }
            let mut total = 0u64;
            for (key, count) in client.loads.iter() {
                if count == 0 {
                    return Err(format!("client {:?} keeps a load count of 0", client.id));
                }
                *pins.entry(*key).or_insert(0) += count;
                total += u64::from(count);
            }
            if total != u64::from(client.loads.total()) || total > u64::from(super::MAX_PINS) {
                return Err(format!(
                    "client {:?} counts {} pins in all, {total} by key (at most {})",
                    client.id,
                    client.loads.total(),
                    super::MAX_PINS
                ));
            }
            // A key stored is pending; its chunk is charged to the client it was charged to at
            // its `prepare_store_for` (the one that stored it, or the one the storage tier
            // brings it back for) while that one is attached, and to no one once it left.
            for (key, charged) in &client.stores {
                if self.manager.peek(key) != LookupResult::HitPending {
                    return Err(format!("{key:?} stored by {:?} is not pending", client.id));
                }
                let chunk = self.manager.chunk_of(key).ok_or("a pending key has no chunk")?;
                let attached = self
                    .clients
                    .get(charged.slot as usize)
                    .and_then(Option::as_ref)
                    .is_some_and(|state| state.id == *charged);
                let expected = if attached { charged.slot } else { NO_OWNER };
                let owner = self.owners[chunk as usize];
                if owner != expected {
                    let owner = match owner {
                        NO_OWNER => "no one".to_owned(),
                        slot => format!("slot {slot}"),
                    };
                    return Err(format!(
                        "{key:?} stored by {:?} for {charged:?} has its chunk charged to {owner}",
                        client.id
                    ));
                }
                storing += 1;
            }
        }
        for (key, _) in chunk_keys.values() {
            if self.manager.pins_of(key) != pins.get(key).copied().unwrap_or(0) {
                return Err(format!(
                    "{key:?} has {} pins, its clients hold {:?}",
                    self.manager.pins_of(key),
                    pins.get(key)
                ));
            }
        }
        if pins
            .keys()
            .any(|key| !chunk_keys.contains_key(&self.manager.chunk_of(key).unwrap_or(u32::MAX)))
        {
            return Err("a client holds a load of a key not in the tier".into());
        }
        // Every pending key is one client's store: each store is pending (above), and a key
        // the tier lacks is stored by one client at a time.
        let pending = chunk_keys.values().filter(|(_, ready)| !ready).count();
        if pending != storing {
            return Err(format!("{pending} keys pending, clients are storing {storing}"));
        }
        Ok(())
    }
}
