//! The CUDA backend (Cargo feature `cuda`): copies between the engine's KV buffers, opened from
//! CUDA IPC handles, and the pinned host tier, through the CUDA driver API (cudarc `sys`).
//!
//! - [`driver`]: loading libcuda without panicking when it is absent, typed driver errors.
//! - [`engine`]: [`CudaCopyEngine`], its configuration and set-up errors.
//!
//! The crate builds with this feature on machines without CUDA: cudarc loads the driver at run
//! time, and a missing driver is [`DriverLoadError::DriverMissing`] from [`CudaCopyEngine::new`].
pub mod driver;
pub mod engine;

pub use driver::{DriverCallError, DriverLoadError};
pub use engine::{CudaCopyEngine, CudaEngineConfig, CudaInitError, IpcRegion, IPC_HANDLE_BYTES};
