//! The worker side: validating copy commands and executing them between a rank's device tier and
//! its host tier.
//!
//! - [`geometry`]: the shape of a rank's blocks (regions, layers, tier sizes).
//! - [`layout`]: where region `r` of block `b` lives in each tier (device region-major, host
//!   block-major).
//! - [`mod@validate`]: decoded command + geometry + generation -> [`ValidCommand`] or
//!   [`InvalidCommand`].
//! - [`storage_command`]: the storage part of validation (STORE, LOAD, QUERY, FORGET entries).
//! - [`plan`]: coalescing pairs into runs and runs into strided pieces, layer by layer.
//! - [`engine`]: the [`CopyEngine`] trait and [`CopyFailure`].
//! - [`host_engine`]: memcpy between two shared-memory mappings (the host backend).
//! - [`prefault`]: mapping the host backend's tiers in before the first copy.
//! - [`stream_copy`]: row copies with non-temporal stores, and the fence that publishes them.
//! - `cuda` (feature `cuda`): the CUDA driver engine over IPC-opened device regions, and the
//!   engine-side KV buffers of programs that play the engine on a GPU.
//! - [`copy_method`]: how the CUDA engine moves a layer (a worker option in every build).
//! - [`command_reader`]: whole commands out of the command ring, across batch boundaries.
//! - [`run`]: the serving loop of one claimed rank.
//! - [`storage_open`]: opening the rank's storage back-end before serving.
//! - [`storage_lane`]: the storage thread that runs STORE, LOAD, QUERY and FORGET beside the copy loop.
//! - [`completion_sink`]: the completion producer both threads push through.
//! - [`process`]: the `kvshm worker` process: attach, claim, build the engine, serve.
//!
//! One command through the worker:
//!
//! 1. the worker pops the command's slots from the ring and decodes them
//!    (`kvshm_ipc::record::decode_command`);
//! 2. [`validate`](validate::validate) checks it and coalesces its pairs into a [`CopyPlan`];
//! 3. the rank's [`CopyEngine`] executes the plan layer by layer, reporting progress;
//! 4. the worker answers with one completion: OK, the refusal, or the copy failure.
pub mod command_reader;
pub mod completion_sink;
pub mod copy_method;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod engine;
pub mod geometry;
pub mod host_engine;
pub mod layout;
pub mod plan;
pub mod prefault;
pub mod process;
pub mod run;
pub mod storage_command;
pub mod storage_lane;
pub mod storage_open;
pub mod stream_copy;
mod tiers;
pub mod validate;

pub use copy_method::CopyMethod;
pub use engine::{CopyEngine, CopyFailure};
pub use geometry::{Geometry, GeometryError, GeometryParams};
pub use host_engine::{HostCopyEngine, HostEngineError, MappedArea};
pub use layout::{DeviceLayout, DeviceLayoutError, DeviceRegion, HostLayout};
pub use plan::{BlockRun, CopyPlan, Direction, StridedCopy};
pub use validate::{validate, InvalidCommand, ValidCommand};
