//! Offloading for engines that keep their own device prefix cache and hash their own blocks
//! (vLLM's `OffloadingConnector`): kvshm manages only the host tier, over the engine's keys.
//!
//! - [`key`]: engine keys (opaque bytes, up to 64) and their chain tags.
//! - [`manager`]: [`OffloadManager`], vLLM's `OffloadingManager` contract: lookups, loads and
//!   stores of keys, chunks of the host tier, leaf-first LRU evictions, events.
//! - [`candidates`]: the eviction order (a heap of recency ranks with lazy invalidation).
//! - [`transfer`]: the worker side: transfer specs turned into block pairs.
//! - [`tensor_memory`]: in-process copies of those pairs between the engine's tensors and the
//!   shared-memory host tier.
//! - [`host_tier`]: [`HostTier`], one rank's host tier segment and its jobs (in process, or by
//!   a `kvshm worker` process over CUDA IPC handles, surviving its crashes).
//! - [`shared`]: [`SharedTierIndex`], one host tier's keys shared by the engine instances of a
//!   node: pins per instance, one eviction order over the tier, quotas.
//! - [`key_table`]: which key each chunk of a persistent host tier holds, for warm restarts.
//! - [`torch_ipc`]: reading the CUDA IPC handle bytes PyTorch exports for a tensor.
//!
//! One key's path: the engine's scheduler asks [`OffloadManager::lookup`]; a miss is computed on
//! the device and offered to [`OffloadManager::prepare_store`], which names its chunk; the
//! engine's workers copy the block into that chunk of the shared-memory host tier and the
//! scheduler calls [`OffloadManager::complete_store`]; a later request finds it, pins it with
//! [`OffloadManager::prepare_load`], the workers copy it back, and
//! [`OffloadManager::complete_load`] unpins it.
pub mod candidates;
pub mod host_tier;
pub mod key;
pub mod key_table;
pub mod manager;
pub mod shared;
pub mod tensor_memory;
pub mod torch_ipc;
pub mod transfer;

pub use host_tier::{
    CopyTotals, HostTier, HostTierError, JobResult, StoredKey, TierEngine, TierOptions,
};
pub use key::{KeyLayout, KeyTooLong, OffloadKey, MAX_KEY_BYTES};
pub use key_table::{read_tier_keys, KeyTable, TableEntry, TableEpoch};
pub use manager::{
    EvictionOrder, EvictionScope, LookupResult, OffloadConfig, OffloadError, OffloadEvent,
    OffloadManager, OffloadStats, PreparedStore,
};
pub use shared::{
    inspect_tier, AttachError, CallAnswer, ClientId, ClientOptions, ClientProcess, ClientRow,
    ClientSummary, Reaped, Released, ServeError, ServeStats, SharedTierError, SharedTierIndex,
    StoreEnd, TierCall, TierClient, TierIdentity, TierOwner, TierReport, TierServer,
    DEAD_CLIENT_GRACE, DEFAULT_LEASE_CHUNKS, SWEEP_INTERVAL,
};
