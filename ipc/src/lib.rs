//! kvshm-ipc: the shared-memory protocol between the kvshm scheduler and its workers.
//!
//! - [`name`]: segment names and the shared-memory object names derived from them.
//! - [`shm`]: creating, opening and unlinking named shared-memory objects safely.
//! - [`huge_pages`]: backing objects with huge pages where the kernel gives them, and mapping
//!   them so that they stay huge.
//! - [`inspect`]: looking at objects under `/dev/shm` without trusting them (no blocking on a
//!   FIFO, no following a link, another user's objects never read or removed).
//! - [`config`]: the configuration a segment is created with, validated on every attach.
//! - [`layout`]: the segment header and where every area lies.
//! - [`segment`]: a mapped control segment: create, attach, accessors, rank claims.
//! - [`listing`]: finding, judging and removing segments under `/dev/shm`.
//! - [`arena`]: the per-rank data segments (host-backend device tier, host tier).
//! - [`tier_control`]: a shared host tier's control object: its identity, owner and client
//!   slots (claimed as worker slots are).
//! - [`worker_slot`], [`counters`], [`control`], [`progress`], [`device_handles`]: the areas of a
//!   segment (worker liveness, kvctl counters, kvctl requests, layer progress, CUDA handles).
//! - [`seqlock`]: consistent reads of byte blobs that another process rewrites.
//! - [`shared_bytes`]: race-free byte copies in and out of memory other processes write.
//! - [`ring`]: single-producer single-consumer rings that live in shared memory.
//! - [`doorbell`]: spin-then-futex waiting across processes.
//! - [`liveness`]: telling whether the process on the other side is still the one we knew.
//! - [`process_handle`]: a pidfd on a process seen attaching, and whether a process maps a file.
//! - [`worker_watch`]: the scheduler's record of each rank's worker, and its fencing decisions.
//! - [`record`]: the fixed-layout command and completion records.
//! - [`storage_record`]: the entries of storage commands and their per-block results.
//! - [`sync`]: std or loom atomics, so that the ring protocol can be model-checked.
pub mod config;
pub mod doorbell;
pub mod liveness;
pub mod name;
pub mod process_handle;
pub mod record;
pub mod ring;
pub mod storage_record;
pub mod sync;
pub mod worker_slot;
pub mod worker_watch;

// Shared-memory areas hold std atomics in place; loom's are not layout-compatible, so under loom
// only the ring protocol, the worker slot, the watch and their primitives are built.
#[cfg(not(loom))]
pub mod arena;
#[cfg(not(loom))]
pub mod control;
#[cfg(not(loom))]
pub mod counters;
#[cfg(not(loom))]
pub mod device_handles;
#[cfg(not(loom))]
pub mod huge_pages;
#[cfg(not(loom))]
pub mod inspect;
#[cfg(not(loom))]
pub mod layout;
#[cfg(not(loom))]
pub mod listing;
#[cfg(not(loom))]
pub mod mappers;
#[cfg(not(loom))]
pub mod progress;
#[cfg(not(loom))]
pub mod segment;
#[cfg(not(loom))]
pub mod seqlock;
#[cfg(not(loom))]
pub mod shared_bytes;
#[cfg(not(loom))]
pub mod shm;
#[cfg(not(loom))]
pub mod tier_control;
