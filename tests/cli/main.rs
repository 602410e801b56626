//! The `kvshm` command as a user runs it: arguments refused before any work, the demo's segment
//! and its storage tier, the benchmarks' JSON, and the documents that describe them.

#[path = "../support/mod.rs"]
mod support;

mod arguments;
mod bench_ring;
mod bench_shared_tier;
mod bench_storage;
mod demo_segment;
mod demo_storage;
mod docs;
