//! The storage tier below the host tier: block bytes kept on local disk or in Redis, one shard
//! per tensor-parallel rank, read and written by the worker processes.
//!
//! - [`backend`]: the [`StorageBackend`] trait (batched put, get, contains, remove with one
//!   outcome per block), keys, layouts, outcomes.
//! - [`block_bytes`]: views of a block's bytes reached through raw pointers (host blocks).
//! - [`format`](mod@format): the frozen formats shared by the back-ends (payload checksum, Redis values).
//! - [`disk`]: the local-disk back-end (slab file + persisted index per rank), the default.
//! - [`disk_index`]: the disk index's format, and reading it back for a restarted scheduler.
//! - [`direct_io`]: O_DIRECT probing, aligned buffers, vectored positional I/O.
//! - [`drop`](mod@drop): dropping a whole namespace (`kvctl reset-storage`).
//! - `slab_io`: one disk batch's I/O calls, spread over threads.
//! - [`redis`]: the Redis back-end (shared across machines).
//! - [`redis_listing`]: what a Redis tier holds for a namespace, for a starting scheduler.
//! - [`spec`]: `disk:DIR` / `redis://...` specifications and opening a back-end from one.
//! - [`tally`]: counting per-block outcomes.
//!
//! One block through the tier (the design is in `docs/STORAGE.md`):
//!
//! 1. the scheduler decides a host block should be kept on storage and issues a STORE command to
//!    every rank (`kvshm_ipc::storage_record`);
//! 2. each rank's worker hands the command to its storage thread, which calls
//!    [`StorageBackend::put`] with the host block's bytes: the back-end writes them with a
//!    checksum and a layout tag under the block's hash and the rank;
//! 3. later a LOAD brings the bytes back into a host block: [`StorageBackend::get`] verifies
//!    them, and a missing or damaged block is a miss for that block only;
//! 4. each completion carries one result bit per block back to the scheduler.
pub mod backend;
pub mod block_bytes;
pub mod direct_io;
pub mod disk;
pub mod disk_index;
pub mod drop;
pub mod format;
pub mod redis;
pub mod redis_listing;
mod slab_io;
pub mod spec;
pub mod tally;

pub use backend::{
    BackendStats, BlockKey, BlockLayout, ContainsOutcome, Failure, GetBlock, GetMiss, GetOutcome,
    PutBlock, PutOutcome, StorageBackend,
};
pub use block_bytes::{BlockBytes, BlockBytesMut};
pub use disk::{DiskBackend, DiskError, DiskOptions};
