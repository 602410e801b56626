//! The failures a kvctl command reports: each names the segment and, where there is one, the way
//! out (`kvctl cleanup`, `--force`, `--depth`, `--timeout`).

use std::io;
use std::time::Duration;

use kvshm_ipc::control::ControlError;
use kvshm_ipc::counters::Counter;
use kvshm_ipc::liveness::monotonic_ns;
use kvshm_ipc::segment::Segment;
use thiserror::Error;

use crate::open::OpenError;
use crate::stat::SchedulerReport;

/// Why a kvctl command failed.
#[derive(Debug, Error)]
pub enum KvctlError {
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error("the scheduler of segment {segment} did not answer within {timeout:?} (it is {scheduler}); the request stays pending and is carried out when the scheduler next polls; a longer --timeout waits more")]
    NoAnswer { segment: String, timeout: Duration, scheduler: String },
    #[error("segment {segment} is an engine's host tier (vLLM's offloading connector): the engine keeps its own cache and answers no `kvctl {command}`; `kvctl stat {segment}` shows what it holds, and the engine's own reset (vLLM's reset_prefix_cache) forgets it")]
    NoScheduler { segment: String, command: &'static str },
    #[error("the tree snapshot of segment {segment} is {len} bytes, more than the {max}-byte snapshot area; ask for fewer levels with --depth")]
    SnapshotTooLarge { segment: String, len: u64, max: usize },
    #[error("segment {segment}: {source}")]
    Control {
        segment: String,
        #[source]
        source: ControlError,
    },
    #[error("the scheduler of segment {segment} sent a tree snapshot kvctl cannot read: {source}")]
    BadSnapshot {
        segment: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("reset of segment {segment} refused: requests hold blocks; `kvctl reset {segment} --force` drops them anyway")]
    ResetRefused { segment: String },
    #[error("the scheduler of segment {segment} failed to reset its cache")]
    ResetFailed { segment: String },
    #[error("cleanup could not remove {count} object(s)")]
    CleanupIncomplete { count: usize },
    #[error("storage: {0}")]
    Storage(String),
    #[error("shared tier {tier}: {source} (an engine that finds no owner starts one; `kvctl cleanup {tier}` removes what a dead owner left)")]
    Tier {
        tier: String,
        #[source]
        source: kvshm_ipc::tier_control::TierAttachError,
    },
    #[error("writing the output failed: {0}")]
    Output(#[from] io::Error),
}

impl KvctlError {
    /// Names a failed control request of `segment`, with the scheduler's last poll on a timeout.
    pub fn from_control(segment: &Segment, error: ControlError) -> KvctlError {
        let name = segment.name().to_string();
        match error {
            ControlError::TimedOut(timeout) => {
                let last_poll = segment.counters().get(Counter::LastPollNs);
                let scheduler = SchedulerReport::judge(last_poll, monotonic_ns()).describe();
                KvctlError::NoAnswer { segment: name, timeout, scheduler }
            }
            ControlError::SnapshotTooLarge { len, max } => {
                KvctlError::SnapshotTooLarge { segment: name, len, max }
            }
            source => KvctlError::Control { segment: name, source },
        }
    }

    /// True for a closed standard output (`kvctl ls | head`), which is not worth a message.
    pub fn is_broken_pipe(&self) -> bool {
        matches!(self, KvctlError::Output(error) if error.kind() == io::ErrorKind::BrokenPipe)
    }
}
