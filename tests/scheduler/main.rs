//! The scheduler: the cache manager alone, driven by a tiny engine in the test (no workers, no
//! shared memory), rule by rule and against reference models; its storage tier (prefetch,
//! misses, the tier going down); the `kvshm replay` and `kvshm bench` commands over it; and the
//! replay's hot path, which must allocate nothing.

#[path = "../support/mod.rs"]
mod support;

mod bench_cli;
mod engine_api;
mod model;
mod prefetch;
mod random;
mod replay;
mod replay_allocations;
mod rules;
mod storage;
mod storage_misses;
mod storage_tier_down;
mod swap_in_landing;
