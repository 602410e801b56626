//! The end of a client ([`SharedTierIndex::release_client`]: it detached, or it died):
//!
//! 1. its loads are released (a dead engine reads nothing any more);
//! 2. its pending stores are dropped (their bytes may be partial), and its requests end, oldest
//!    first;
//! 3. the keys it stored stay in the tier, charged to no one;
//! 4. the chunks it may still be writing, its lease (leased, spare and held chunks) and its
//!    pending stores' chunks, go back to the free pool: at once when it detached; when it died
//!    ([`SharedTierIndex::release_dead_client`]) only once [`DEAD_CLIENT_GRACE`] has passed
//!    ([`SharedTierIndex::return_held_back`]). The processes that copy for an engine (vLLM's
//!    workers, a `kvshm worker` started by one) are not the one the owner watches, and they
//!    notice its death later, finishing the copies they started first: a chunk handed to another
//!    store meanwhile could take their late bytes under the other store's key.
//!
//! A client may also end some of its stores without ending itself
//! ([`SharedTierIndex::abandon_stores`]: its engine reset its cache): their keys go at once, their
//! chunks stay held by the client until it leaves.

use std::time::{Duration, Instant};

use super::{ClientId, Released, SharedTierError, SharedTierIndex, NO_OWNER};
use crate::offload::key::OffloadKey;

/// How long the chunks a dead client may still be writing go to no store (module flow, step 4):
/// its copy processes check on their engine every 10 ms or so, and a copy they started runs for
/// milliseconds.
pub const DEAD_CLIENT_GRACE: Duration = Duration::from_secs(2);

impl SharedTierIndex {
    /// Ends `client`, which detached: what it held is free again at once (module flow).
    pub fn release_client(&mut self, client: ClientId) -> Result<Released, SharedTierError> {
        self.release(client, None)
    }

    /// Ends `client`, whose process died (module flow): the chunks it may still be writing go
    /// to no store until `hold_until` ([`SharedTierIndex::return_held_back`]).
    pub fn release_dead_client(
        &mut self,
        client: ClientId,
        hold_until: Instant,
    ) -> Result<Released, SharedTierError> {
        self.release(client, Some(hold_until))
    }

    /// Ends `client`'s stores of `keys` with no word of their copies (its engine reset its cache
    /// with them in flight, and will report none): each pending key is dropped, and may be stored
    /// again at once, by any engine. Its chunk, and a spare of the key, stay the client's, held
    /// until it leaves the tier (`lease.rs`): a live engine runs the copies it was given whenever
    /// it steps next, which may be long after, so no grace would do. Keys `client` is not storing
    /// are skipped. Returns how many chunks it holds so.
    pub fn abandon_stores(
        &mut self,
        client: ClientId,
        keys: &[OffloadKey],
    ) -> Result<u32, SharedTierError> {
        let state = self.client_mut(client)?;
        let mut held = Vec::new();
        let mut dropped = Vec::new();
        for key in keys {
            // A spare is a taken chunk charged to the client already: it only becomes held.
            held.extend(state.lease.take_spare(key));
            if state.stores.remove(key).is_some() {
                dropped.push(*key);
            }
        }
        let mut store_chunks = Vec::with_capacity(dropped.len());
        for key in &dropped {
            let chunk = self.manager.chunk_of(key).expect("a pending store is cached");
            self.discharge(chunk);
            store_chunks.push(chunk);
        }
        self.manager.complete_store(&dropped, false);
        // Freed with their keys just above: taken back before any store can have them, and
        // charged to the client, as its lease's held chunks are.
        self.manager.take_free(&store_chunks);
        for &chunk in &store_chunks {
            self.owners[chunk as usize] = client.slot;
        }
        held.extend(store_chunks);
        let state = self.client_mut(client)?;
        state.charged += dropped.len() as u32;
        state.lease.hold(&held);
        Ok(held.len() as u32)
    }

    /// Returns to the free pool the chunks held back for dead clients whose grace ended by
    /// `now`; how many.
    pub fn return_held_back(&mut self, now: Instant) -> u32 {
        let (held_back, manager) = (&mut self.held_back, &mut self.manager);
        let mut returned = 0;
        held_back.retain(|(until, chunks)| {
            if *until > now {
                return true;
            }
            manager.return_chunks(chunks);
            returned += chunks.len() as u32;
            false
        });
        returned
    }

    /// Chunks held back for dead clients now.
    pub fn held_back_chunks(&self) -> impl Iterator<Item = u32> + '_ {
        self.held_back.iter().flat_map(|(_, chunks)| chunks.iter().copied())
    }

    /// Module flow; `hold_until` for a client that died.
    fn release(
        &mut self,
        client: ClientId,
        hold_until: Option<Instant>,
    ) -> Result<Released, SharedTierError> {
        self.client(client)?;
        let state = self.clients[client.slot as usize].take().expect("checked above");
        let mut held = Vec::new();
        let leased = match hold_until {
            None => self.free_lease(&state.lease),
            Some(_) => {
                held.extend(state.lease.chunks());
                for &chunk in &held {
                    self.owners[chunk as usize] = NO_OWNER;
                }
                held.len() as u32
            }
        };
        let mut loads = Vec::new();
        for (key, count) in state.loads.iter() {
            loads.extend(std::iter::repeat_n(*key, count as usize));
        }
        self.manager
            .complete_load(&loads)
            .expect("a client's loads are pinned in the manager: a programming error otherwise");
        let stores: Vec<OffloadKey> = state.stores.keys().copied().collect();
        let mut store_chunks = Vec::with_capacity(stores.len());
        for key in &stores {
            let chunk = self.manager.chunk_of(key).expect("a pending store is cached");
            // Charged to another client when the storage tier brought it back for that one.
            if self.owners[chunk as usize] == client.slot {
                self.owners[chunk as usize] = NO_OWNER;
            } else {
                self.discharge(chunk);
            }
            store_chunks.push(chunk);
        }
        self.manager.complete_store(&stores, false);
        let mut requests: Vec<(&String, &u64)> = state.requests.iter().collect();
        requests.sort_unstable_by_key(|&(_, &first_call)| first_call);
        for (name, _) in requests {
            self.manager.on_request_finished(name, None)?;
        }
        let mut chunks = 0;
        for owner in &mut self.owners {
            if *owner == client.slot {
                *owner = NO_OWNER;
                chunks += 1;
            }
        }
        if let Some(until) = hold_until {
            // Freed with their keys just above: taken back before any store can have them.
            self.manager.take_free(&store_chunks);
            held.extend(store_chunks);
            if !held.is_empty() {
                self.held_back.push((until, held.clone()));
            }
        }
        Ok(Released {
            pins: loads.len() as u32,
            stores: stores.len() as u32,
            chunks,
            leased,
            held_back: held.len() as u32,
        })
    }
}
