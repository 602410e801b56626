//! The copy-engine interface the worker loop drives, and how a copy fails.
//!
//! Core types: [`CopyEngine`] (execute one validated [`CopyPlan`] layer by layer) and
//! [`CopyFailure`]. Implementations: [`super::host_engine::HostCopyEngine`] (memcpy between two
//! shared-memory mappings) and, with the `cuda` feature, `super::cuda::CudaCopyEngine`.
//!
//! 1. The worker validates a command into a plan ([`super::validate::validate`]).
//! 2. It calls [`CopyEngine::execute`] with a progress callback.
//! 3. The engine copies layer 0's pieces, reporting [`CopyProgress::Bytes`] at least every
//!    [`COPY_CHUNK_BYTES`] it moves (the host engine cuts pieces into chunks of that size; the CUDA
//!    engine reports each layer as it lands, the scheduler keeping a command's layers small), then
//!    [`CopyProgress::Layers`]`(1)`; layer 1's, `Layers(2)`, and so on. The worker heartbeats on
//!    every report, so a worker busy on a copy of any size stays alive in the scheduler's eyes
//!    while one that stops (or is stuck inside a copy) does not.
//! 4. When `execute` returns, every byte of the plan has landed (or the engine stopped touching the
//!    blocks: a failed copy leaves nothing in flight, so the scheduler may reuse them at once). A
//!    report answered with [`ControlFlow::Break`] stops the copy with [`CopyFailure::Stopped`].

use std::ops::ControlFlow;

use super::geometry::Geometry;
use super::plan::{CopyPlan, OutOfLayout};

/// The most bytes an engine copies between two progress reports (host engine), so that a worker
/// heartbeats often whatever the size of a copy: 256 KiB take 26 µs at 10 GB/s and 26 ms even at
/// 10 MB/s, far inside the heartbeat timeout, for one heartbeat's cost (a clock read and a store).
pub const COPY_CHUNK_BYTES: u64 = 256 * 1024;

/// What an engine reports while it executes a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyProgress {
    /// `bytes` more bytes (at most [`COPY_CHUNK_BYTES`] for the host engine) have been copied.
    Bytes(u64),
    /// Layers `0..layers` of every block of the plan have landed (`1..=layers` in turn).
    Layers(u32),
}

/// Why an engine could not complete a plan. The worker answers with `CommandError::CopyFailed`
/// and [`CopyFailure::detail`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CopyFailure {
    /// The plan does not fit the engine's layout (a plan made for another geometry).
    #[error(transparent)]
    OutOfLayout(#[from] OutOfLayout),
    /// A piece would leave the mapped area of a tier (a layout larger than its mapping).
    #[error("a copy piece ending at byte {end} overruns the {len}-byte {tier} area")]
    OutOfArea { tier: &'static str, end: u64, len: u64 },
    /// The CUDA driver refused a call.
    #[error("{call} failed with CUDA error {code}")]
    Driver { call: &'static str, code: u32 },
    /// The progress callback asked the engine to stop (the worker is leaving: its scheduler is
    /// gone). Nothing of the plan is still being copied; the command is not answered.
    #[error("the copy was stopped before it ended")]
    Stopped,
}

impl CopyFailure {
    /// The completion's detail value: the CUDA error code, the block outside the layout, or the
    /// end offset beyond the area.
    pub fn detail(&self) -> u64 {
        match *self {
            CopyFailure::OutOfLayout(out) => out.block.into(),
            CopyFailure::OutOfArea { end, .. } => end,
            CopyFailure::Driver { code, .. } => code.into(),
            CopyFailure::Stopped => 0,
        }
    }
}

/// Fails unless a piece ending at `end` (`None`: the end overflowed) lies within the first `len`
/// bytes of a tier's memory.
pub(crate) fn check_extent(
    end: Option<u64>,
    len: u64,
    tier: &'static str,
) -> Result<(), CopyFailure> {
    match end {
        Some(end) if end <= len => Ok(()),
        end => Err(CopyFailure::OutOfArea { tier, end: end.unwrap_or(u64::MAX), len }),
    }
}

/// Executes validated copy plans between a rank's device tier and host tier.
pub trait CopyEngine {
    /// The geometry the engine's memory was laid out with; plans are validated against it.
    fn geometry(&self) -> &Geometry;

    /// Copies every block of `plan`, layer by layer, reporting to `progress` as the module
    /// documentation says; stops with [`CopyFailure::Stopped`] once `progress` breaks. On error
    /// nothing of the plan is still being copied.
    fn execute(
        &mut self,
        plan: &CopyPlan,
        progress: &mut dyn FnMut(CopyProgress) -> ControlFlow<()>,
    ) -> Result<(), CopyFailure>;
}

/// Calls `progress` with `report` and turns a break into [`CopyFailure::Stopped`].
pub(crate) fn report(
    progress: &mut dyn FnMut(CopyProgress) -> ControlFlow<()>,
    report: CopyProgress,
) -> Result<(), CopyFailure> {
    match progress(report) {
        ControlFlow::Continue(()) => Ok(()),
        ControlFlow::Break(()) => Err(CopyFailure::Stopped),
    }
}
