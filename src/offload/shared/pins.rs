//! A client's loads in progress, its pins: counted per key and in all ([`Pins`]), and bounded
//! ([`MAX_PINS`]), so that no sequence of calls a client sends can carry the manager's count of
//! a key's pins past `u32` (a count that wrapped would let a release unpin another client's
//! load, or panic the owner when a client leaves).
//!
//! 1. [`SharedTierIndex::acquire_prefix`] (and `pin_to_read`) asks [`Pins::room_for`] before it
//!    pins anything in the manager: a call that would take the client past [`MAX_PINS`] is
//!    refused with [`SharedTierError::TooManyPins`], nothing pinned (its lookups are counted in
//!    the tier's statistics, and its request named; the owner answers it `Failed`, as any
//!    refused call, which the client's engine sees as a miss);
//! 2. the keys pinned are counted ([`SharedTierIndex::count_loads`]);
//! 3. [`SharedTierIndex::release_loads`] unpins keys the client holds, all or none;
//! 4. `release_client` unpins whatever is left when the client goes.

use std::collections::HashMap;

use super::{ClientId, SharedTierError, SharedTierIndex, MAX_CLIENTS};
use crate::offload::key::{BuildPassThrough, OffloadKey};

/// The most loads one client holds pinned at once (a key pinned twice counts two): with at most
/// [`MAX_CLIENTS`] clients, no key is pinned `u32::MAX` times.
pub const MAX_PINS: u32 = 1 << 20;

const _: () = assert!((MAX_PINS as u64) * (MAX_CLIENTS as u64) < u32::MAX as u64);

/// One client's pins (module documentation).
#[derive(Debug, Default)]
pub(super) struct Pins {
    per_key: HashMap<OffloadKey, u32, BuildPassThrough>,
    total: u32,
}

impl Pins {
    /// Loads in progress, a key pinned twice counting two.
    pub(super) fn total(&self) -> u32 {
        self.total
    }

    /// Each key pinned and how many times.
    pub(super) fn iter(&self) -> impl Iterator<Item = (&OffloadKey, u32)> {
        self.per_key.iter().map(|(key, &count)| (key, count))
    }

    /// Whether `more` pins keep the client within [`MAX_PINS`].
    pub(super) fn room_for(&self, more: usize) -> bool {
        (self.total as usize).saturating_add(more) <= MAX_PINS as usize
    }

    fn of(&self, key: &OffloadKey) -> u32 {
        self.per_key.get(key).copied().unwrap_or(0)
    }
}

impl SharedTierIndex {
    /// Module flow, step 1: refuses `more` pins for `client` past [`MAX_PINS`].
    pub(super) fn check_room_for_pins(
        &self,
        client: ClientId,
        more: usize,
    ) -> Result<(), SharedTierError> {
        let pins = &self.client(client)?.loads;
        if pins.room_for(more) {
            return Ok(());
        }
        Err(SharedTierError::TooManyPins { client, pins: pins.total(), more })
    }

    /// Module flow, step 2: counts one load more of each of `keys` for `client` (pinned for it
    /// just now, within the room [`SharedTierIndex::check_room_for_pins`] found).
    pub(super) fn count_loads(
        &mut self,
        client: ClientId,
        keys: &[OffloadKey],
    ) -> Result<(), SharedTierError> {
        let pins = &mut self.client_mut(client)?.loads;
        debug_assert!(pins.room_for(keys.len()), "pins counted past the room checked");
        for key in keys {
            *pins.per_key.entry(*key).or_insert(0) += 1;
        }
        pins.total += keys.len() as u32;
        Ok(())
    }

    /// Module flow, step 3: ends `client`'s loads of `keys` (one pin each; all or none).
    ///
    /// # Errors
    /// [`SharedTierError::NotPinnedByClient`] when `client` holds fewer loads of a key than
    /// `keys` names it (another client's pins are not its to release).
    pub fn release_loads(
        &mut self,
        client: ClientId,
        keys: &[OffloadKey],
    ) -> Result<(), SharedTierError> {
        let pins = &self.client(client)?.loads;
        let mut wanted: HashMap<OffloadKey, u32, BuildPassThrough> = HashMap::default();
        for key in keys {
            let count = wanted.entry(*key).or_insert(0);
            *count += 1;
            if pins.of(key) < *count {
                return Err(SharedTierError::NotPinnedByClient { client, key: *key });
            }
        }
        self.manager.complete_load(keys)?;
        let pins = &mut self.client_mut(client)?.loads;
        for (key, count) in wanted {
            let held = pins.per_key.get_mut(&key).expect("checked above");
            *held -= count;
            if *held == 0 {
                pins.per_key.remove(&key);
            }
        }
        pins.total -= keys.len() as u32;
        Ok(())
    }
}
