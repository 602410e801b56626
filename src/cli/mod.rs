//! The `kvshm` subcommands, one module each; `main.rs` only parses and dispatches.
pub mod bench_copy;
pub mod bench_ring;
pub mod bench_sched;
pub mod checks;
pub mod demo;
pub mod replay;
pub mod worker;
