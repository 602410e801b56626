//! The `kvshm` subcommands, one module each; `main.rs` only parses and dispatches.
pub mod bench_copy;
#[cfg(feature = "cuda")]
pub mod bench_copy_cuda;
pub mod bench_hash;
pub mod bench_ring;
pub mod bench_sched;
pub mod bench_storage;
pub mod bench_tier;
pub mod checks;
pub mod demo;
pub mod replay;
pub mod worker;
