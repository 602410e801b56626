//! kvshm: a KV-cache manager for LLM serving engines.
//!
//! The scheduler side (this library, inside the engine's scheduler process) keeps a radix tree over
//! chained block hashes and the device and host block pools, and decides hits, evictions,
//! write-backs and swap-ins. Worker processes (`kvshm worker`), one per tensor-parallel rank,
//! execute the copies it issues through shared-memory rings ([`kvshm_ipc`]).
//!
//! Two prefix caches, for two kinds of engine. An engine that lets kvshm keep its prefix cache
//! uses [`service::Service`]: its [`manager::CacheManager`] holds the radix tree over kvshm's
//! chained block hashes, the device and host pools and the copies between them, and the engine
//! asks it to match, allocate, commit and finish each request. An engine that keeps its own device
//! prefix cache and hashes its own blocks (vLLM with its offloading connector) uses
//! [`offload::OffloadManager`] for the host tier alone, over the engine's opaque keys, with one
//! [`offload::HostTier`] per rank moving the bytes. Both evict leaf-first and least recently used
//! first; the tree keeps recency in intrusive lists (`tree::policy::recency`), the offload manager
//! in a heap of recency ranks ([`offload::candidates`]), as vLLM's rule of reranking a touched key
//! asks.
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
