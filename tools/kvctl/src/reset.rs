//! `kvctl reset`: asking the scheduler to drop every cached block and start a new generation.
//!
//! kvctl never empties the cache itself: it leaves a reset request in the control area
//! ([`Control::reset`]) and the scheduler carries it out in its `poll()`, on its own thread. Without
//! `--force` the scheduler refuses while any request holds blocks; kvctl reports the outcome and
//! exits non-zero unless the reset was done.
//!
//! Flow: 1. attach; 2. read the generation; 3. request and wait up to the timeout; 4. read the
//! generation again (the scheduler bumps it before answering) and report.
//!
//! [`Control::reset`]: kvshm_ipc::control::Control::reset

use std::io::{self, Write};
use std::time::Duration;

use kvshm_ipc::control::ResetStatus;
use kvshm_ipc::segment::Segment;
use serde::Serialize;

use crate::error::KvctlError;

/// How the scheduler answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ResetOutcome {
    Done,
    RefusedBusy,
    Failed,
}

impl From<ResetStatus> for ResetOutcome {
    fn from(status: ResetStatus) -> Self {
        match status {
            ResetStatus::Done => ResetOutcome::Done,
            ResetStatus::RefusedBusy => ResetOutcome::RefusedBusy,
            ResetStatus::Failed => ResetOutcome::Failed,
        }
    }
}

/// The result of `kvctl reset`.
#[derive(Debug, Clone, Serialize)]
pub struct ResetReport {
    pub segment: String,
    pub force: bool,
    pub outcome: ResetOutcome,
    pub generation_before: u64,
    pub generation_after: u64,
}

/// Asks the scheduler of `segment` to reset, waiting up to `timeout` for its answer.
pub fn reset(segment: &Segment, force: bool, timeout: Duration) -> Result<ResetReport, KvctlError> {
    let generation_before = segment.generation();
    let status = segment
        .control()
        .reset(force, timeout)
        .map_err(|error| KvctlError::from_control(segment, error))?;
    Ok(ResetReport {
        segment: segment.name().to_string(),
        force,
        outcome: status.into(),
        generation_before,
        generation_after: segment.generation(),
    })
}

impl ResetReport {
    /// `Err` unless the reset was carried out, naming why.
    pub fn ensure_done(&self) -> Result<(), KvctlError> {
        let segment = self.segment.clone();
        match self.outcome {
            ResetOutcome::Done => Ok(()),
            ResetOutcome::RefusedBusy => Err(KvctlError::ResetRefused { segment }),
            ResetOutcome::Failed => Err(KvctlError::ResetFailed { segment }),
        }
    }

    pub fn write_text(&self, out: &mut dyn Write) -> io::Result<()> {
        match self.outcome {
            ResetOutcome::Done => writeln!(
                out,
                "segment {}: cache reset, generation {} -> {}",
                self.segment, self.generation_before, self.generation_after
            ),
            ResetOutcome::RefusedBusy => writeln!(
                out,
                "segment {}: reset refused, requests hold blocks (generation stays {})",
                self.segment, self.generation_after
            ),
            ResetOutcome::Failed => writeln!(
                out,
                "segment {}: the scheduler failed to reset (generation {})",
                self.segment, self.generation_after
            ),
        }
    }
}
