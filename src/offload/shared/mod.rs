//! [`SharedTierIndex`]: one host tier's keys, shared by several engine instances (its clients)
//! on one node, with pins per client, one eviction order over the whole tier and optional quotas
//! per client.
//!
//! The index decides; the clients move the bytes (each copies between its own KV tensors and the
//! tier's shared arena, at the chunks the index names). It is [`OffloadManager`] with a client
//! layer on top: the manager keeps the keys, their chunks, the loads in progress and the
//! leaf-first LRU order over every key of the tier, whoever stored it; this module keeps who
//! pinned what, which client each chunk is charged to, and the clients' requests. The same type
//! serves in process (`kvshm replay --instances`) and in the tier's owner process for clients in
//! other processes (DESIGN §12.3: [`TierServer`], `serve.rs`, answers the [`TierClient`]s of
//! `client.rs` over the rings of the tier's control object).
//!
//! One request of client `C`, batched as an engine asks, in prefix order:
//! 1. [`SharedTierIndex::acquire_prefix`]: the leading keys that are loadable, pinned for `C`,
//!    and their chunks; `C` copies them into its device blocks;
//! 2. [`SharedTierIndex::release_loads`] once those copies are done;
//! 3. [`SharedTierIndex::prepare_store`] for the blocks `C` computed: chunks for the keys the
//!    tier lacks, evicting the least recently used keys of the whole tier, or only `C`'s own
//!    when `C` is at its quota; the new keys are pending, and charged to `C`;
//! 4. [`SharedTierIndex::complete_store`] once `C` has written them (or failed to);
//! 5. [`SharedTierIndex::finish_request`]: the keys the request used become the most recent.
//!
//! [`SharedTierIndex::release_client`] ends a client (it detached, or died): its pins go, its
//! pending stores are dropped (their bytes may be partial), its requests end, and its stored keys
//! stay in the tier, charged to no one; a dead client's chunks that its copy side may still write
//! go to no store for a grace (`release.rs`). [`TierOwner`] (`owner.rs`) is the owner process's
//! side: the index and a handle on each client's process, releasing the clients that died.

mod ahead;
mod arenas;
mod batch;
mod client;
mod client_lease;
mod connection;
mod identity;
mod invariants;
mod keys;
mod lease;
mod listing;
mod owner;
mod pins;
mod release;
mod serve;
mod storage;

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use serde::Serialize;

pub use ahead::{DEFAULT_FREE_CHUNKS, EVICT_AHEAD_SLICE};
pub use arenas::{open_rank_arena, TierArenaError, TierArenas};
pub use batch::StoreEnd;
pub use client::{CallAnswer, ClientOptions, TierCall, TierClient};
pub use client_lease::DEFAULT_LEASE_CHUNKS;
pub use identity::TierIdentity;
pub use keys::TierKeys;
pub use lease::{LEASED_SHARE, MAX_LEASE};
pub use listing::{inspect_tier, ClientRow, TierReport};
pub use owner::{AttachError, ClientProcess, Reaped, TierOwner, SWEEP_INTERVAL};
pub use pins::MAX_PINS;
pub use release::DEAD_CLIENT_GRACE;
pub use serve::{ClientGone, ServeError, ServeStats, TierServer, OWNER_SPIN};
pub use storage::{TierStorage, TierStorageError, TierStorageStats};

use super::key::{BuildPassThrough, OffloadKey};
use super::key_table::TableEntry;
use super::manager::{
    EvictionScope, LookupResult, OffloadConfig, OffloadError, OffloadManager, OffloadStats,
    PreparedStore,
};

/// The most clients one tier serves at once: one per client slot its control object can have,
/// and the owner's storage tier, which attaches as a client of its own (`storage/`). An owner
/// never finds the index full for a client that claimed a slot, so it never has to take a slot
/// back from a live client.
pub const MAX_CLIENTS: usize = kvshm_ipc::tier_control::MAX_TIER_CLIENTS as usize + 1;

/// The most requests one client has live in the tier at once (named by its calls, not yet
/// finished): far above what an engine runs or queues, a bound on what the owner keeps for a
/// client that never finishes its requests.
pub const MAX_REQUESTS: usize = 1 << 16;

/// `owners` of a chunk charged to no client.
const NO_OWNER: u32 = u32::MAX;

/// One attached client: its slot, and which attach of that slot (a slot reused after a client
/// left gets a new generation, so the old id is refused).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct ClientId {
    pub slot: u32,
    pub generation: u32,
}

/// Why the index refused a call. Nothing changed in either case.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SharedTierError {
    #[error("the tier holds blocks of {field} {tier:?} and the client's have {client:?}: they would not be interchangeable")]
    Mismatch { field: &'static str, tier: String, client: String },
    #[error("the tier serves at most {MAX_CLIENTS} clients, all attached")]
    NoFreeSlot,
    #[error("client {client:?} is not attached")]
    UnknownClient { client: ClientId },
    #[error("client {client:?} has no load of {key:?} to release")]
    NotPinnedByClient { client: ClientId, key: OffloadKey },
    #[error("client {client:?} holds {pins} pins: {more} more would pass the {MAX_PINS} a client may hold")]
    TooManyPins { client: ClientId, pins: u32, more: usize },
    #[error("client {client:?} has {MAX_REQUESTS} requests live: a new one is refused")]
    TooManyRequests { client: ClientId },
    #[error("client {client:?} stored outside its lease: {why}")]
    LeaseMismatch { client: ClientId, why: String },
    #[error(transparent)]
    Offload(#[from] OffloadError),
}

/// What the index remembers of a client.
#[derive(Debug)]
struct Client {
    id: ClientId,
    name: String,
    quota: Option<u32>,
    /// Chunks charged to it: the keys it stored that are still in the tier, and its lease.
    charged: u32,
    /// Loads in progress (`pins.rs`).
    loads: pins::Pins,
    /// Keys it is storing (prepared, not completed), each with the client its chunk was charged
    /// to: itself, or the client the storage tier brings the key back for.
    stores: HashMap<OffloadKey, ClientId, BuildPassThrough>,
    /// Its requests the manager is tracking, by the manager's name for them, each with the
    /// number of its first call (a release ends them oldest first).
    requests: HashMap<String, u64>,
    /// The number the next new request gets.
    next_request: u64,
    /// Chunks it holds ahead of its stores (`lease.rs`).
    lease: lease::Lease,
}

impl Client {
    fn summary(&self) -> ClientSummary {
        ClientSummary {
            id: self.id,
            name: self.name.clone(),
            quota: self.quota,
            chunks: self.charged - self.lease.len(),
            pins: self.loads.total(),
            storing: self.stores.len() as u32,
            leased: self.lease.len(),
        }
    }
}

/// A client as `kvctl` lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ClientSummary {
    pub id: ClientId,
    pub name: String,
    pub quota: Option<u32>,
    /// Chunks of the keys it stored that are still in the tier (charged to it, as its lease).
    pub chunks: u32,
    /// Loads in progress.
    pub pins: u32,
    /// Keys being stored.
    pub storing: u32,
    /// Chunks leased ahead of its stores, or written but not stored (`lease.rs`).
    pub leased: u32,
}

/// What [`SharedTierIndex::release_client`] gave back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Released {
    /// Loads in progress released.
    pub pins: u32,
    /// Pending stores dropped.
    pub stores: u32,
    /// Chunks that stay in the tier, charged to no one now.
    pub chunks: u32,
    /// Chunks it held ahead of its stores (`lease.rs`), free again (or, with `held_back`, once
    /// the grace of a dead client is over).
    pub leased: u32,
    /// Chunks its copy side may still be writing (its lease, its pending stores'), kept out of
    /// every store for [`DEAD_CLIENT_GRACE`] after it died (`release.rs`).
    pub held_back: u32,
}

/// One host tier shared by several clients (module flow).
#[derive(Debug)]
pub struct SharedTierIndex {
    identity: TierIdentity,
    manager: OffloadManager,
    clients: Vec<Option<Client>>,
    /// Per slot, the generation its next client gets.
    generations: Vec<u32>,
    /// Per chunk, the slot it is charged to, or `NO_OWNER`.
    owners: Vec<u32>,
    /// The key table the owner keeps for the tier's next owner (`keys.rs`), if any.
    keys: Option<TierKeys>,
    /// Chunks kept free ahead of demand (`ahead.rs`), and what the last eviction ahead took.
    free_target: usize,
    evicted_ahead: PreparedStore,
    /// Scratch: the manager's name of the request of the call in progress, and keys counted.
    request_name: String,
    distinct: HashSet<OffloadKey, BuildPassThrough>,
    keys_scratch: Vec<OffloadKey>,
    /// Chunks dead clients' copy sides may still be writing, each batch with the end of its
    /// grace (`release.rs`): taken from the manager, charged to no one, holding no key.
    held_back: Vec<(Instant, Vec<u32>)>,
}

impl SharedTierIndex {
    /// An empty tier of `config.chunks` chunks for blocks of `identity`, keeping
    /// [`DEFAULT_FREE_CHUNKS`] free ahead of demand (`ahead.rs`).
    pub fn new(identity: TierIdentity, config: OffloadConfig) -> Result<Self, SharedTierError> {
        let manager = OffloadManager::new(config)?;
        let mut index = SharedTierIndex {
            identity,
            owners: vec![NO_OWNER; config.chunks as usize],
            keys: None,
            free_target: 0,
            evicted_ahead: PreparedStore::default(),
            manager,
            clients: Vec::new(),
            generations: Vec::new(),
            request_name: String::new(),
            distinct: HashSet::default(),
            keys_scratch: Vec::new(),
            held_back: Vec::new(),
        };
        index.keep_free(DEFAULT_FREE_CHUNKS);
        Ok(index)
    }

    pub fn identity(&self) -> &TierIdentity {
        &self.identity
    }

    /// Attaches a client whose blocks are `identity`'s, holding at most `quota` chunks if given.
    ///
    /// # Errors
    /// [`SharedTierError::Mismatch`] when `identity` differs from the tier's in any field,
    /// [`SharedTierError::NoFreeSlot`] when [`MAX_CLIENTS`] are attached.
    pub fn attach(
        &mut self,
        identity: &TierIdentity,
        name: &str,
        quota: Option<u32>,
    ) -> Result<ClientId, SharedTierError> {
        self.identity.check_attach(identity)?;
        let slot = match self.clients.iter().position(Option::is_none) {
            Some(slot) => slot,
            None if self.clients.len() < MAX_CLIENTS => {
                self.clients.push(None);
                self.generations.push(0);
                self.clients.len() - 1
            }
            None => return Err(SharedTierError::NoFreeSlot),
        };
        let id = ClientId { slot: slot as u32, generation: self.generations[slot] };
        self.generations[slot] = self.generations[slot].wrapping_add(1);
        self.clients[slot] = Some(Client {
            id,
            name: name.to_owned(),
            quota,
            charged: 0,
            loads: pins::Pins::default(),
            stores: HashMap::default(),
            requests: HashMap::new(),
            next_request: 0,
            lease: lease::Lease::default(),
        });
        Ok(id)
    }

    fn client(&self, id: ClientId) -> Result<&Client, SharedTierError> {
        match self.clients.get(id.slot as usize) {
            Some(Some(client)) if client.id == id => Ok(client),
            _ => Err(SharedTierError::UnknownClient { client: id }),
        }
    }

    fn client_mut(&mut self, id: ClientId) -> Result<&mut Client, SharedTierError> {
        match self.clients.get_mut(id.slot as usize) {
            Some(Some(client)) if client.id == id => Ok(client),
            _ => Err(SharedTierError::UnknownClient { client: id }),
        }
    }

    /// Sets `request_name` to the manager's name of `client`'s `request`.
    fn spell_request(&mut self, client: ClientId, request: &str) -> Result<(), SharedTierError> {
        use std::fmt::Write;
        self.request_name.clear();
        write!(self.request_name, "{}/{}/{request}", client.slot, client.generation)
            .expect("writing to a String cannot fail");
        self.client(client).map(|_| ())
    }

    /// Sets `request_name` to the manager's name of `client`'s `request` and records it as live
    /// (at most [`MAX_REQUESTS`]).
    fn name_request(&mut self, client: ClientId, request: &str) -> Result<(), SharedTierError> {
        self.spell_request(client, request)?;
        let state = self.clients[client.slot as usize].as_mut().expect("checked above");
        if !state.requests.contains_key(&self.request_name) {
            if state.requests.len() >= MAX_REQUESTS {
                return Err(SharedTierError::TooManyRequests { client });
            }
            state.requests.insert(self.request_name.clone(), state.next_request);
            state.next_request += 1;
        }
        Ok(())
    }

    /// Module flow, step 1: pins for `client` the leading keys of `keys` that are loadable
    /// (up to the first that is missing or still being stored), writes their chunks to
    /// `chunks`, and returns how many.
    ///
    /// # Errors
    /// [`SharedTierError::TooManyPins`] when they would take `client` past [`MAX_PINS`]
    /// (`pins.rs`): nothing is pinned.
    pub fn acquire_prefix(
        &mut self,
        client: ClientId,
        request: &str,
        keys: &[OffloadKey],
        chunks: &mut Vec<u32>,
    ) -> Result<usize, SharedTierError> {
        self.client(client)?;
        self.name_request(client, request)?;
        let name = self.request_name.as_str();
        let hits = keys
            .iter()
            .take_while(|key| self.manager.lookup(name, key) == LookupResult::Hit)
            .count();
        chunks.clear();
        if hits == 0 {
            return Ok(0);
        }
        self.check_room_for_pins(client, hits)?;
        self.manager.prepare_load(name, &keys[..hits], chunks)?;
        self.count_loads(client, &keys[..hits])?;
        Ok(hits)
    }

    /// Pins for `client` the leading keys of `keys` that are loadable, as
    /// [`SharedTierIndex::acquire_prefix`] does, for a reader that is no request: the storage
    /// tier's writes. No lookup or load is counted, and no key moves in the eviction order (a
    /// write of a block to storage is no use of it). Released by
    /// [`SharedTierIndex::release_loads`].
    pub fn pin_to_read(
        &mut self,
        client: ClientId,
        keys: &[OffloadKey],
        chunks: &mut Vec<u32>,
    ) -> Result<usize, SharedTierError> {
        self.check_room_for_pins(client, keys.len())?;
        let pinned = self.manager.pin_loadable(keys, chunks);
        self.count_loads(client, &keys[..pinned])?;
        Ok(pinned)
    }

    /// Module flow, step 3: chunks for the keys of `keys` the tier lacks, stored on behalf of
    /// `client`'s `request` (see [`OffloadManager::prepare_store`]). A client at its quota
    /// evicts its own least recently used keys to make room; any other evicts the least
    /// recently used keys of the whole tier. Returns `false`, storing nothing, when not enough
    /// can be evicted.
    pub fn prepare_store(
        &mut self,
        client: ClientId,
        request: &str,
        keys: &[OffloadKey],
        out: &mut PreparedStore,
    ) -> Result<bool, SharedTierError> {
        self.prepare_store_for(client, client, request, keys, out)
    }

    /// [`SharedTierIndex::prepare_store`] by `storer` (whose stores the new keys are: only it
    /// completes them) of chunks charged to `charged` and within its quota: the tier's storage
    /// tier bringing blocks back for the client that asked for them (`storage/`). A key the
    /// storer writes into a spare chunk already (`lease.rs`) is not stored twice.
    pub fn prepare_store_for(
        &mut self,
        storer: ClientId,
        charged: ClientId,
        request: &str,
        keys: &[OffloadKey],
        out: &mut PreparedStore,
    ) -> Result<bool, SharedTierError> {
        if let Some(kept) = self.keys_without_spares(storer, keys)? {
            let offered: Vec<OffloadKey> = kept.iter().map(|&at| keys[at as usize]).collect();
            let stored = self.prepare_store_for(storer, charged, request, &offered, out)?;
            out.to_store.iter_mut().for_each(|at| *at = kept[*at as usize]);
            return Ok(stored);
        }
        let (quota, held) = {
            let state = self.client(charged)?;
            (state.quota, state.charged as usize)
        };
        self.distinct.clear();
        for key in keys {
            if self.manager.peek(key) == LookupResult::Miss {
                self.distinct.insert(*key);
            }
        }
        let new_keys = self.distinct.len();
        let over_quota = quota.map_or(0, |quota| (held + new_keys).saturating_sub(quota as usize));
        self.name_request(storer, request)?;
        let owners = &self.owners;
        let own_chunk = |chunk: u32| owners[chunk as usize] == charged.slot;
        let scope = if over_quota > 0 {
            EvictionScope { at_least: over_quota, only: Some(&own_chunk), partial: false }
        } else {
            EvictionScope::default()
        };
        let stored = self.manager.prepare_store_within(&self.request_name, keys, scope, out);
        if !stored {
            return Ok(false);
        }
        for &chunk in &out.evicted_chunks {
            self.discharge(chunk);
        }
        if let Some(table) = &self.keys {
            for &chunk in &out.chunks {
                table.cleared(chunk);
            }
        }
        for &chunk in &out.chunks {
            self.owners[chunk as usize] = charged.slot;
        }
        self.clients[charged.slot as usize].as_mut().expect("checked above").charged +=
            out.chunks.len() as u32;
        let state = self.clients[storer.slot as usize].as_mut().expect("checked above");
        state.stores.extend(out.to_store.iter().map(|&index| (keys[index as usize], charged)));
        Ok(true)
    }

    /// Charges `chunk` to no one any more.
    fn discharge(&mut self, chunk: u32) {
        let owner = std::mem::replace(&mut self.owners[chunk as usize], NO_OWNER);
        if owner != NO_OWNER {
            let state = self.clients[owner as usize]
                .as_mut()
                .expect("a chunk is charged to an attached client: a programming error otherwise");
            state.charged -= 1;
        }
    }

    /// Module flow, step 4: makes `client`'s stores of `keys` loadable (`success`) or drops
    /// them, and frees its spares of them (`lease.rs`). Keys `client` is not storing are skipped
    /// (a duplicate completion changes nothing, and one client cannot complete another's store).
    pub fn complete_store(
        &mut self,
        client: ClientId,
        keys: &[OffloadKey],
        success: bool,
    ) -> Result<(), SharedTierError> {
        for key in keys {
            self.free_spare(client, key);
        }
        let mut mine = std::mem::take(&mut self.keys_scratch);
        mine.clear();
        match self.client_mut(client) {
            Ok(state) => mine.extend(keys.iter().filter(|key| state.stores.remove(*key).is_some())),
            Err(error) => {
                self.keys_scratch = mine;
                return Err(error);
            }
        }
        if !success {
            for key in &mine {
                let chunk = self.manager.chunk_of(key).expect("a pending store is cached");
                self.discharge(chunk);
            }
        }
        self.manager.complete_store(&mine, success);
        if let (Some(table), true) = (&mut self.keys, success) {
            for key in &mine {
                let chunk = self.manager.chunk_of(key).expect("a completed store is cached");
                let parent = self.manager.parent_of(key);
                let parent_chunk = parent.and_then(|parent| self.manager.chunk_of(&parent));
                table.stored(chunk, key, parent_chunk);
            }
        }
        self.keys_scratch = mine;
        Ok(())
    }

    /// Keeps `table` up to date from now on (`keys.rs`), after taking back the keys of
    /// `entries` (what the table held when this owner took the tier over) into their chunks,
    /// oldest first, each under its parent where that came back; returns how many came back.
    /// An entry whose key or chunk the index holds already is skipped.
    pub fn keep_key_table(&mut self, table: TierKeys, mut entries: Vec<TableEntry>) -> usize {
        entries.sort_unstable_by_key(|entry| entry.seq);
        let mut by_chunk: HashMap<u32, (u64, OffloadKey)> = HashMap::new();
        for entry in entries {
            let parent = entry.parent.and_then(|(chunk, seq)| {
                by_chunk.get(&chunk).filter(|(held, _)| *held == seq).map(|&(_, key)| key)
            });
            if self.manager.restore(entry.key, entry.chunk, parent.as_ref()).is_ok() {
                by_chunk.insert(entry.chunk, (entry.seq, entry.key));
            }
        }
        self.keys = Some(table);
        by_chunk.len()
    }

    /// Module flow, step 5: ends `client`'s `request`; the keys it loaded and stored become the
    /// most recently used, its head most of all.
    pub fn finish_request(
        &mut self,
        client: ClientId,
        request: &str,
    ) -> Result<(), SharedTierError> {
        self.spell_request(client, request)?;
        let name = std::mem::take(&mut self.request_name);
        self.client_mut(client)?.requests.remove(&name);
        let finished = self.manager.on_request_finished(&name, None);
        self.request_name = name;
        finished?;
        Ok(())
    }

    /// Records that the next key `client`'s `request` stores follows `parent` (a block stored
    /// after its parent left the engine by another way, such as an eviction from the device).
    pub fn link_parent(
        &mut self,
        client: ClientId,
        request: &str,
        parent: &OffloadKey,
    ) -> Result<(), SharedTierError> {
        self.name_request(client, request)?;
        self.manager.present(&self.request_name, std::slice::from_ref(parent));
        Ok(())
    }

    /// The attached clients, for `kvctl`.
    pub fn clients(&self) -> Vec<ClientSummary> {
        self.clients.iter().flatten().map(Client::summary).collect()
    }

    /// One attached client, for `kvctl`.
    pub fn client_summary(&self, client: ClientId) -> Option<ClientSummary> {
        self.client(client).ok().map(Client::summary)
    }

    /// Whether `key` is loadable, without counting a lookup.
    pub fn peek(&self, key: &OffloadKey) -> LookupResult {
        self.manager.peek(key)
    }

    /// The client `key`'s chunk is charged to, if any.
    pub fn owner_of(&self, key: &OffloadKey) -> Option<ClientId> {
        let chunk = self.manager.chunk_of(key)?;
        let owner = self.owners[chunk as usize];
        (owner != NO_OWNER).then(|| self.clients[owner as usize].as_ref().expect("attached").id)
    }

    /// Keys in the tier (stored or being stored).
    pub fn len(&self) -> usize {
        self.manager.len()
    }

    pub fn is_empty(&self) -> bool {
        self.manager.is_empty()
    }

    /// The tier's counters (the manager's: lookups, stores, evictions over every client; the
    /// storage tier's promotions count as its client's stores, its writes as nothing).
    pub fn stats(&self) -> OffloadStats {
        self.manager.stats()
    }
}
