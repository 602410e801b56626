//! The library side of the `kvshm` command: the parts that other programs run or check against.
//! The demo and the other benchmarks live in the binary (`src/bin/kvshm/`), not here.
//!
//! - [`worker`]: the worker process's entry (`kvshm worker`, and `python -m kvshm worker`).
//! - [`replay`]: trace replay through the scheduler (`kvshm replay`, and the hit-rate tests that
//!   check its figures).
//! - [`bench_sched`]: the scheduler benchmark (`kvshm bench sched`, and `cargo bench`, which
//!   measures it under a counting allocator).
//! - [`pattern`]: the bytes the demo writes into each block, which the tests check copies against.
//! - [`checks`]: the argument checks the commands share.
//! - [`tier_owner`]: the owner process of a host tier several engines share (`kvshm tier-owner`).
pub mod bench_sched;
pub mod checks;
pub mod pattern;
pub mod replay;
pub mod tier_owner;
pub mod worker;
