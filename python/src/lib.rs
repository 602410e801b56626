//! `kvshm._kvshm`: the Python binding of kvshm. A thin layer: every class forwards to the Rust
//! crates (`kvshm`, `kvctl`), which stay usable without Python.
//!
//! - [`service`]: `Service`, the scheduler API over both tiers; [`results`] what its calls
//!   return; [`hasher`]: `BlockHasher`.
//! - [`offload`]: `OffloadManager`, the scheduler side of the vLLM offloading backend.
//! - [`host_tier`]: `HostTier`, one worker rank's host tier and copies (the worker side).
//! - [`vllm`]: `VllmManagerCore`, vLLM's manager methods straight over the Rust manager.
//! - [`shared_tier`]: `VllmSharedTierCore`, the same methods over a host tier several engines
//!   share; [`tier_info`]: a shared tier's name, its owner and its clients.
//! - [`buffers`]: block tables and hashes as buffer objects; reading numpy arrays and buffers.
//! - [`errors`]: the exception hierarchy under `KvshmError`.
//! - [`cli`]: `python -m kvshm worker`, `tier-owner` and `kvctl`.
//! - [`waiting`]: one Rust object shared by Python threads: locking without the GIL, waiting
//!   without the lock.
mod buffers;
mod cli;
mod errors;
mod hasher;
mod host_tier;
mod offload;
mod results;
mod service;
mod shared_tier;
mod tier_info;
mod vllm;
mod waiting;

use pyo3::prelude::*;

#[pymodule]
fn _kvshm(module: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(module)?;
    module.add_class::<service::Service>()?;
    module.add_class::<hasher::BlockHasher>()?;
    module.add_class::<results::PrefixMatch>()?;
    module.add_class::<results::Allocation>()?;
    module.add_class::<results::AllocationCheck>()?;
    module.add_class::<results::ShortenedHit>()?;
    module.add_class::<offload::OffloadManager>()?;
    module.add_class::<host_tier::HostTier>()?;
    module.add_class::<vllm::VllmManagerCore>()?;
    module.add_class::<shared_tier::VllmSharedTierCore>()?;
    module.add_function(wrap_pyfunction!(tier_info::shared_tier_name, module)?)?;
    module.add_function(wrap_pyfunction!(tier_info::shared_tier_owner, module)?)?;
    module.add_function(wrap_pyfunction!(tier_info::shared_tier_clients, module)?)?;
    module.add_function(wrap_pyfunction!(host_tier::parse_cuda_handle, module)?)?;
    module.add_function(wrap_pyfunction!(host_tier::read_tier_keys, module)?)?;
    module.add_class::<buffers::U32Array>()?;
    module.add_class::<buffers::BlockHashes>()?;
    module.add_function(wrap_pyfunction!(cli::run_worker, module)?)?;
    module.add_function(wrap_pyfunction!(cli::run_kvctl, module)?)?;
    module.add_function(wrap_pyfunction!(cli::run_tier_owner, module)?)?;
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
