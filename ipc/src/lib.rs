//! kvshm-ipc: the shared-memory protocol between the kvshm scheduler and its workers.
//!
//! - [`name`]: segment names and the shared-memory object names derived from them.
//! - [`shm`]: creating, opening and unlinking named shared-memory objects safely.
//! - [`layout`]: the segment header, configuration, worker slots and live counters.
//! - [`segment`]: a mapped control segment: create, attach, list, reclaim.
//! - [`ring`]: single-producer single-consumer rings that live in shared memory.
//! - [`doorbell`]: spin-then-futex waiting across processes.
//! - [`liveness`]: telling whether the process on the other side is still the one we knew.
//! - [`record`]: the fixed-layout command and completion records.
//! - [`sync`]: std or loom atomics, so that the ring protocol can be model-checked.
pub mod doorbell;
pub mod layout;
pub mod liveness;
pub mod name;
pub mod record;
pub mod ring;
pub mod segment;
pub mod shm;
pub mod sync;
