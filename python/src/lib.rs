//! `kvshm._kvshm`: the Python binding of kvshm. A thin layer: every class forwards to the Rust
//! crates (`kvshm`, `kvctl`), which stay usable without Python.
//!
//! - [`service`]: `Service` (the scheduler API over both tiers) and `BlockHasher`.
//! - [`offload`]: `OffloadManager` and `HostTier`, the pieces of the vLLM offloading backend.
//! - [`vllm`]: `VllmManagerCore`, vLLM's manager methods straight over the Rust manager.
//! - [`buffers`]: block tables and hashes as buffer objects; reading numpy arrays and buffers.
//! - [`errors`]: the exception hierarchy under `KvshmError`.
//! - [`cli`]: `python -m kvshm worker` and `python -m kvshm kvctl`.
mod buffers;
mod cli;
mod errors;
mod offload;
mod service;
mod vllm;

use pyo3::prelude::*;

#[pymodule]
fn _kvshm(module: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(module)?;
    module.add_class::<service::Service>()?;
    module.add_class::<service::BlockHasher>()?;
    module.add_class::<service::PrefixMatch>()?;
    module.add_class::<service::Allocation>()?;
    module.add_class::<service::AllocationCheck>()?;
    module.add_class::<offload::OffloadManager>()?;
    module.add_class::<offload::HostTier>()?;
    module.add_class::<vllm::VllmManagerCore>()?;
    module.add_function(wrap_pyfunction!(offload::parse_cuda_handle, module)?)?;
    module.add_class::<buffers::U32Array>()?;
    module.add_class::<buffers::BlockHashes>()?;
    module.add_function(wrap_pyfunction!(cli::run_worker, module)?)?;
    module.add_function(wrap_pyfunction!(cli::run_kvctl, module)?)?;
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
