//! kvshm: a KV-cache manager for LLM serving engines.
//!
//! The scheduler side (this library, inside the engine's scheduler process) keeps a radix tree over
//! chained block hashes and the device and host block pools, and decides hits, evictions,
//! write-backs and swap-ins. Worker processes (`kvshm worker`), one per tensor-parallel rank,
//! execute the copies it issues through shared-memory rings ([`kvshm_ipc`]).
//!
//! - [`hash`]: chained 128-bit block hashes with a namespace.
//! - [`pool`]: device and host block pools.
//! - [`tree`]: the radix tree of cached blocks and its evictable sets.
//! - [`manager`]: the engine-facing cache manager and its write policies.
//! - [`offload`]: the host tier over engine-supplied keys, for engines that keep their own device
//!   cache (vLLM's offloading connector).
//! - [`percentiles`]: the p50/p99 summary of the benchmark and demo reports.
//! - [`transport`]: the segment, its rings and the worker processes behind them, with no cache:
//!   commands in flight, direct copies, worker liveness and deadlines.
//! - [`service`]: the cache manager on top of a transport.
//! - [`storage`]: the storage tier below host: local disk and Redis back-ends.
//! - [`worker`]: the worker side: validating and executing copy commands.
//! - [`trace`]: reading Mooncake-format request traces.
//! - [`cli`]: the library side of the `kvshm` command: the worker process's entry, trace replay
//!   and the scheduler benchmark, which the Python package, the tests and `cargo bench` run too.
pub mod cli;
pub mod hash;
pub mod manager;
pub mod offload;
pub mod percentiles;
pub mod pool;
pub mod service;
mod simd;
pub mod storage;
pub mod trace;
pub mod transport;
pub mod tree;
pub mod worker;

#[cfg(test)]
mod test_rng;

/// The README's Rust examples, compiled by `cargo test --doc` so that they stay true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExamples;
