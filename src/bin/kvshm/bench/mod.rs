//! `kvshm bench`: benchmarks that print one JSON object (or a table) with a baseline measured in
//! the same run, one module each. The scheduler's (`kvshm bench sched`) is library code,
//! [`kvshm::cli::bench_sched`], because `cargo bench` runs it too.

pub mod copy;
#[cfg(feature = "cuda")]
pub mod copy_cuda;
pub mod hash;
pub mod ring;
pub mod shared_tier;
pub mod storage;
pub mod tier;
