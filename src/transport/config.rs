//! What a transport is made from ([`TransportConfig`]: the segment header and how commands are
//! cut and timed), why making one fails, and what it counts.

use std::time::Duration;

use kvshm_ipc::name::SegmentName;

use super::{
    ArenaError, BlockAccessError, CreateError, SegmentConfig, SegmentError,
    DEFAULT_COMMAND_DEADLINE, DEFAULT_MAX_COMMAND_BYTES,
};
#[cfg(doc)]
use super::{Segment, Transport};
use crate::worker::{Geometry, GeometryError, GeometryParams};

/// How the transport's segment is made and its commands cut.
#[derive(Clone, Debug)]
pub struct TransportConfig {
    /// The segment's header: ranks, block shape and tier sizes, rings, backend, who copies, and
    /// what kvctl shows of the cache above (block tokens, write policy).
    pub segment: SegmentConfig,
    /// Ask workers for per-layer progress of every copy.
    pub layerwise: bool,
    /// The most bytes one command asks one rank to copy (all its layers together): copies are
    /// split into commands of at most this many bytes (at least one block each), so that one
    /// command ends within a bounded time (the command deadline relies on it).
    pub max_command_bytes: u64,
    /// How long a rank that owes answers may give none before its worker is fenced and its
    /// commands fail, as if it had crashed (`deadline`).
    pub command_deadline: Duration,
    /// Take over the host tier arenas a gone creator of the name left, bytes and all
    /// ([`Segment::create_keeping_host_tier`]); [`Transport::host_tier_kept`] says if it did.
    pub keep_host_tier: bool,
    /// The shared tier whose arenas hold the host tier, for a segment whose `host_tier` says
    /// so ([`SegmentConfig::HOST_TIER_SHARED`]: a segment of one rank), and the tier's rank whose
    /// arena that is; `None` for a segment's own.
    pub shared_tier: Option<(SegmentName, u32)>,
}

impl TransportConfig {
    /// A transport over a segment of header `segment`, with layer-wise progress and the default
    /// command size and deadline.
    pub fn new(segment: SegmentConfig) -> TransportConfig {
        TransportConfig {
            segment,
            layerwise: true,
            max_command_bytes: DEFAULT_MAX_COMMAND_BYTES,
            command_deadline: DEFAULT_COMMAND_DEADLINE,
            keep_host_tier: false,
            shared_tier: None,
        }
    }

    pub(super) fn geometry(&self) -> Result<Geometry, GeometryError> {
        let segment = &self.segment;
        Geometry::new(GeometryParams {
            layers: segment.layers,
            regions: segment.regions,
            region_bytes: segment.region_bytes,
            device_blocks: segment.device_blocks,
            host_blocks: segment.host_blocks,
        })
    }
}

/// Why a transport could not start.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("block geometry: {0}")]
    Geometry(#[from] GeometryError),
    #[error("creating the segment: {0}")]
    Create(#[from] CreateError),
    #[error("segment: {0}")]
    Segment(#[from] SegmentError),
    #[error("opening an arena: {0}")]
    Arena(#[from] ArenaError),
    #[error("arena layout: {0}")]
    Memory(#[from] BlockAccessError),
    #[error(
        "a segment whose host tier is a shared tier's needs the tier's name, and only such a \
         segment takes one"
    )]
    SharedTierName,
}

/// A rank still had no live worker when a wait for the workers ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("rank {rank} has no worker after {waited:?}")]
pub struct WorkerMissing {
    pub rank: u32,
    pub waited: Duration,
}

/// What the transport counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TransportStats {
    pub commands_issued: u64,
    pub commands_completed: u64,
    /// Bytes copied by all ranks together for block copies (jobs and direct copies) that
    /// succeeded.
    pub bytes_copied: u64,
    /// Direct copies that live workers failed (the owner counts its own jobs' failures).
    pub copy_failures: u64,
    pub worker_deaths: u64,
    /// Completions that matched no command in the ring (a misbehaving worker, or one written
    /// over in its ring).
    pub stray_completions: u64,
    /// Commands whose answer never came while the worker answered a later command of their lane
    /// (a command or completion written over in its ring); each failed with `AnswerLost`.
    pub lost_answers: u64,
    /// Times a rank owed answers past the command deadline and its worker was fenced.
    pub command_deadlines_missed: u64,
    /// Times commands waited past the command deadline for a rank's worker to set up, and its
    /// backlog failed unsent (`WorkerNotServing`).
    pub setup_waits_failed: u64,
}
