//! The copy-engine interface the worker loop drives, and how a copy fails.
//!
//! Core types: [`CopyEngine`] (execute one validated [`CopyPlan`] layer by layer) and
//! [`CopyFailure`]. Implementations: [`super::host_engine::HostCopyEngine`] (memcpy between two
//! shared-memory mappings) and, with the `cuda` feature, `super::cuda::CudaCopyEngine`.
//!
//! 1. The worker validates a command into a plan ([`super::validate::validate`]).
//! 2. It calls [`CopyEngine::execute`] with a progress callback.
//! 3. The engine copies layer 0's pieces, calls `progress(1)`, layer 1's, `progress(2)`, and so on.
//!    When `execute` returns, every byte of the plan has landed (or the engine stopped touching the
//!    blocks: a failed copy leaves nothing in flight, so the scheduler may reuse them at once).

use super::geometry::Geometry;
use super::plan::{CopyPlan, OutOfLayout};

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
}

impl CopyFailure {
    /// The completion's detail value: the CUDA error code, the block outside the layout, or the
    /// end offset beyond the area.
    pub fn detail(&self) -> u64 {
        match *self {
            CopyFailure::OutOfLayout(out) => out.block.into(),
            CopyFailure::OutOfArea { end, .. } => end,
            CopyFailure::Driver { code, .. } => code.into(),
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

    /// Copies every block of `plan`, layer by layer, calling `progress(layers_done)` after each
    /// layer has landed (`1..=layers`). On error nothing of the plan is still being copied.
    fn execute(
        &mut self,
        plan: &CopyPlan,
        progress: &mut dyn FnMut(u32),
    ) -> Result<(), CopyFailure>;
}
