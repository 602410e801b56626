//! Chunks a client holds ahead of its stores (DESIGN §12.3), so that it answers its engine's
//! store at once and tells the owner later, with no wait, which keys it wrote where.
//!
//! 1. [`SharedTierIndex::lease`] tops `client`'s lease up to a target: free chunks (the owner
//!    keeps some free ahead of demand, `ahead.rs`), charged to it within its quota, their
//!    key-table slots cleared; each gets the next number of the client's lease sequence, and the
//!    client keeps the same list. The unnamed leased chunks of all clients stay within an
//!    eighth of the tier ([`LEASED_SHARE`]), and a client's lease within its equal share of that
//!    eighth among the clients attached when it is topped up ([`SharedTierIndex::max_lease`]),
//!    so that a client that stopped naming its chunks (fenced, or refused) holds no more than
//!    its share while the others keep theirs;
//! 2. [`SharedTierIndex::store_leased`]: the client wrote (or is writing) `keys` into its next
//!    `keys.len()` leased chunks, numbered from `first`: the keys the tier lacks become its
//!    pending stores there, as [`SharedTierIndex::prepare_store`] would have stored them; the
//!    chunk of a key the tier had (another engine stored it meanwhile) is a spare, held for the
//!    client until its store of that key ends;
//! 3. [`SharedTierIndex::complete_store`] frees a spare; [`SharedTierIndex::abandon_stores`]
//!    holds it (and the chunks of the stores abandoned) until the client leaves;
//!    [`SharedTierIndex::release_client`] frees the lease, the spares and what it holds with the
//!    client (after a grace when it died: `release.rs`). Until then the key is not stored again
//!    for the client ([`SharedTierIndex::prepare_store_for`] skips it), even if the tier lost it
//!    meanwhile: the spare's end would be taken for the second store's.
//!
//! A call that does not follow the sequence (numbered other than the lease's first chunk, or
//! more keys than chunks leased) is refused and changes nothing: the chunks stay leased to the
//! client, never another's while its process may still write them, and its later calls are
//! refused too (the client then stores through `prepare_store` only). A key the client stores
//! already (its copies of it could end in either order) has its new chunk held until the client
//! leaves.

use std::collections::{HashMap, VecDeque};

use super::{ClientId, SharedTierError, SharedTierIndex, NO_OWNER};
use crate::offload::key::{BuildPassThrough, OffloadKey};
use crate::offload::manager::{EvictionScope, PreparedStore};

/// The most chunks a client's lease holds: a tier of `chunks` chunks leases at most a 64th of
/// them to each client, and never more than this.
pub const MAX_LEASE: usize = 64;

/// The share of a tier's chunks that all clients' leases hold unnamed together, at most: one
/// chunk in this many. A leased chunk holds no block until its client names it, so that with
/// many clients (up to `MAX_CLIENTS`, each leasing a 64th) the leases could otherwise take the
/// tier's room for cached blocks.
pub const LEASED_SHARE: usize = 8;

/// One client's lease (module flow).
#[derive(Debug, Default)]
pub(super) struct Lease {
    /// Chunks leased and not yet named by a store, in sequence.
    chunks: VecDeque<u32>,
    /// The sequence number of `chunks[0]`.
    front: u64,
    /// Chunks written for keys the tier had, held until the client's store of the key ends.
    spares: HashMap<OffloadKey, u32, BuildPassThrough>,
    /// Chunks written for keys the client was storing already: held until it leaves.
    held: Vec<u32>,
}

impl Lease {
    /// Chunks leased, spare or held.
    pub(super) fn len(&self) -> u32 {
        (self.chunks.len() + self.spares.len() + self.held.len()) as u32
    }

    /// Holds `chunks` (taken, charged to the client) until the client leaves.
    pub(super) fn hold(&mut self, chunks: &[u32]) {
        self.held.extend_from_slice(chunks);
    }

    /// Takes the spare written for `key`, if it holds one.
    pub(super) fn take_spare(&mut self, key: &OffloadKey) -> Option<u32> {
        self.spares.remove(key)
    }

    pub(super) fn chunks(&self) -> impl Iterator<Item = u32> + '_ {
        let spares = self.spares.values().copied();
        self.chunks.iter().copied().chain(spares).chain(self.held.iter().copied())
    }
}

impl SharedTierIndex {
    /// The most chunks one client's lease holds in this tier now: a 64th of the tier, at most
    /// [`MAX_LEASE`], and at most an equal share of [`SharedTierIndex::max_leased`] among the
    /// clients attached (module flow, step 1), the owner's storage tier among them when it has
    /// one (it leases nothing).
    pub fn max_lease(&self) -> usize {
        let attached = self.clients.iter().flatten().count().max(1);
        (self.owners.len() / 64).min(MAX_LEASE).min(self.max_leased() / attached)
    }

    /// The most unnamed chunks all clients' leases hold together in this tier
    /// ([`LEASED_SHARE`]).
    pub fn max_leased(&self) -> usize {
        self.owners.len() / LEASED_SHARE
    }

    /// Chunks leased to all clients and not yet named by a store.
    pub(super) fn leased_unnamed(&self) -> usize {
        self.clients.iter().flatten().map(|state| state.lease.chunks.len()).sum()
    }

    /// Module flow, step 1: tops `client`'s lease up to `target` chunks (at most
    /// [`SharedTierIndex::max_lease`], within its quota, the chunks free now and what the
    /// unnamed leases of all clients leave of [`SharedTierIndex::max_leased`]), writing the
    /// chunks added to `granted`, in sequence.
    pub fn lease(
        &mut self,
        client: ClientId,
        target: usize,
        granted: &mut Vec<u32>,
    ) -> Result<(), SharedTierError> {
        granted.clear();
        let state = self.client(client)?;
        let room =
            state.quota.map_or(usize::MAX, |quota| quota.saturating_sub(state.charged) as usize);
        let count = target
            .min(self.max_lease())
            .saturating_sub(state.lease.chunks.len())
            .min(room)
            .min(self.manager.free_chunks())
            .min(self.max_leased().saturating_sub(self.leased_unnamed()));
        if count == 0 {
            return Ok(());
        }
        let mut taken = PreparedStore::default();
        if !self.manager.take_chunks(count, EvictionScope::default(), &mut taken) {
            return Ok(());
        }
        debug_assert!(taken.evicted.is_empty(), "free chunks need no eviction");
        for &chunk in &taken.chunks {
            if let Some(table) = &self.keys {
                table.cleared(chunk);
            }
            self.owners[chunk as usize] = client.slot;
        }
        let state = self.client_mut(client)?;
        state.charged += count as u32;
        state.lease.chunks.extend(&taken.chunks);
        granted.extend(&taken.chunks);
        Ok(())
    }

    /// Module flow, step 2: `client`'s `request` stores `keys` in its leased chunks numbered
    /// `first` on.
    ///
    /// # Errors
    /// [`SharedTierError::LeaseMismatch`] when the call does not follow the lease (module
    /// documentation); nothing changed then.
    pub fn store_leased(
        &mut self,
        client: ClientId,
        request: &str,
        keys: &[OffloadKey],
        first: u64,
    ) -> Result<(), SharedTierError> {
        let state = self.client(client)?;
        let lease = &state.lease;
        let refused = if first != lease.front {
            Some(format!("chunk {first} named, {} leased next", lease.front))
        } else if keys.len() > lease.chunks.len() {
            Some(format!("{} keys for {} leased chunks", keys.len(), lease.chunks.len()))
        } else {
            None
        };
        if let Some(why) = refused {
            return Err(SharedTierError::LeaseMismatch { client, why });
        }
        // In sequence: the chunks leave the lease as they left the client's book, whatever
        // follows, so that the two lists stay the same.
        let state = self.clients[client.slot as usize].as_mut().expect("checked above");
        let chunks: Vec<u32> = state.lease.chunks.drain(..keys.len()).collect();
        state.lease.front += keys.len() as u64;
        if let Err(error) = self.name_request(client, request) {
            // A request refused (`MAX_REQUESTS`): its chunks are held, as the client wrote them.
            let state = self.clients[client.slot as usize].as_mut().expect("checked above");
            state.lease.held.extend(chunks);
            return Err(error);
        }
        let distinct = &mut self.distinct;
        let state = self.clients[client.slot as usize].as_mut().expect("checked above");
        // A key the client stores already: its new chunk is held, and the key not offered.
        let (mut offered, mut offered_chunks) = (Vec::new(), Vec::new());
        distinct.clear();
        for (key, &chunk) in keys.iter().zip(&chunks) {
            let twice = state.stores.contains_key(key) || state.lease.spares.contains_key(key);
            if twice || !distinct.insert(*key) {
                state.lease.held.push(chunk);
            } else {
                offered.push(*key);
                offered_chunks.push(chunk);
            }
        }
        let mut stored = PreparedStore::default();
        let mut spare = Vec::new();
        let name = &self.request_name;
        self.manager.store_into(name, &offered, &offered_chunks, &mut stored, &mut spare);
        let state = self.clients[client.slot as usize].as_mut().expect("checked above");
        for &index in &stored.to_store {
            state.stores.insert(offered[index as usize], client);
        }
        for &index in &spare {
            state.lease.spares.insert(offered[index as usize], offered_chunks[index as usize]);
        }
        Ok(())
    }

    /// Undoes the lease that just gave `client` `granted` (the last chunks of its lease): its
    /// answer could not be sent.
    pub(super) fn return_lease(&mut self, client: ClientId, granted: &[u32]) {
        let Ok(state) = self.client_mut(client) else { return };
        let kept = state.lease.chunks.len().saturating_sub(granted.len());
        if state.lease.chunks.range(kept..).ne(granted.iter()) {
            return;
        }
        state.lease.chunks.truncate(kept);
        self.manager.return_chunks(granted);
        for &chunk in granted {
            self.discharge(chunk);
        }
    }

    /// The indices of the keys of `keys` that `storer` is not writing into a spare, when it
    /// writes any of them into one (`None` otherwise): such a key is not stored again until that
    /// store ends. Stored twice, the first end would free the spare and make the second chunk
    /// loadable while the engine still writes it.
    pub(super) fn keys_without_spares(
        &self,
        storer: ClientId,
        keys: &[OffloadKey],
    ) -> Result<Option<Vec<u32>>, SharedTierError> {
        let spares = &self.client(storer)?.lease.spares;
        if spares.is_empty() || !keys.iter().any(|key| spares.contains_key(key)) {
            return Ok(None);
        }
        let kept = (0u32..).zip(keys).filter(|(_, key)| !spares.contains_key(*key));
        Ok(Some(kept.map(|(at, _)| at).collect()))
    }

    /// Step 3: frees `client`'s spare for `key`, if it holds one.
    pub(super) fn free_spare(&mut self, client: ClientId, key: &OffloadKey) {
        let Ok(state) = self.client_mut(client) else { return };
        let Some(chunk) = state.lease.spares.remove(key) else { return };
        self.manager.return_chunks(&[chunk]);
        self.discharge(chunk);
    }

    /// Step 3: frees what `lease` (of a client gone) held; returns how many chunks.
    pub(super) fn free_lease(&mut self, lease: &Lease) -> u32 {
        let chunks: Vec<u32> = lease.chunks().collect();
        self.manager.return_chunks(&chunks);
        for &chunk in &chunks {
            self.owners[chunk as usize] = NO_OWNER;
        }
        chunks.len() as u32
    }
}
