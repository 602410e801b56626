//! The CUDA backend (Cargo feature `cuda`): copies between the engine's KV buffers, opened from
//! CUDA IPC handles, and the pinned host tier, through the CUDA driver API (cudarc `sys`).
//!
//! - [`driver`]: loading libcuda without panicking when it is absent, typed driver errors.
//! - [`engine`]: [`CudaCopyEngine`], its configuration and set-up errors.
//! - [`calls`]: the per-piece DMA method.
//! - [`kernel`]: kvshm's copy kernel: a plan's pieces as rows, staged and launched in groups of
//!   layers.
//! - [`kv_buffers`]: a rank's KV cache on a GPU for programs that play the engine (the demo, the
//!   copy bench, the GPU tests).
//!
//! The crate builds with this feature on machines without CUDA: cudarc loads the driver at run
//! time, and a missing driver is [`DriverLoadError::DriverMissing`] from [`CudaCopyEngine::new`].
pub mod calls;
pub mod driver;
pub mod engine;
pub mod kernel;
pub mod kv_buffers;

pub use driver::{DriverCallError, DriverLoadError};
pub use engine::{
    CopyMethod, CudaCopyEngine, CudaEngineConfig, CudaInitError, IpcRegion, IPC_HANDLE_BYTES,
};
pub use kv_buffers::{device_count, DeviceKvBuffers, KvBufferError};
