//! Why creating, attaching to or using a segment failed: one enum per operation.

use thiserror::Error;

use crate::arena::ArenaError;
use crate::config::ConfigError;
use crate::layout::Header;
use crate::ring::RingError;
use crate::shm::ShmError;

/// Why a segment could not be created.
#[derive(Debug, Error)]
pub enum CreateError {
    #[error("invalid segment configuration: {0}")]
    InvalidConfig(#[from] ConfigError),
    #[error("segment is in use: its creator pid {pid} is alive")]
    InUse { pid: u32 },
    #[error("segment object {object} is being created by another process right now")]
    BeingCreated { object: String },
    #[error("not enough space in /dev/shm for {requested} bytes of {object}")]
    NoSpace { object: String, requested: u64 },
    #[error(transparent)]
    Shm(ShmError),
    #[error(transparent)]
    Arena(ArenaError),
}

impl From<ShmError> for CreateError {
    fn from(error: ShmError) -> Self {
        match error {
            ShmError::NoSpace { object, requested } => CreateError::NoSpace { object, requested },
            error => CreateError::Shm(error),
        }
    }
}

impl From<ArenaError> for CreateError {
    fn from(error: ArenaError) -> Self {
        match error {
            ArenaError::Shm(error) => error.into(),
            error => CreateError::Arena(error),
        }
    }
}

/// What is wrong with the contents of a segment whose header otherwise matches.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CorruptReason {
    #[error("the stored configuration is invalid: {0}")]
    Config(ConfigError),
    #[error("area offset {area} is {found}, the configuration puts it at {expected}")]
    Offset { area: &'static str, found: u64, expected: u64 },
    #[error("total size is {found}, the configuration needs {expected}")]
    TotalSize { found: u64, expected: u64 },
}

/// Why a segment could not be attached. Each names one problem of what was found.
#[derive(Debug, Error)]
pub enum AttachError {
    #[error("segment object {object} does not exist")]
    NotFound { object: String },
    #[error("segment is owned by uid {owner}, we run as uid {expected}")]
    ForeignOwner { owner: u32, expected: u32 },
    #[error("segment is {len} bytes, expected at least {expected}")]
    Truncated { len: u64, expected: u64 },
    #[error("segment does not start with the kvshm magic")]
    BadMagic,
    #[error("segment has layout version {found}, this build reads version {expected}")]
    VersionMismatch { found: u32, expected: u32 },
    #[error("segment stores {record} as {found} bytes, this build uses {expected}")]
    RecordSizeMismatch { record: &'static str, found: u32, expected: u32 },
    #[error(
        "segment is not ready: its creator pid {pid} is still initialising it, or has closed it"
    )]
    NotReady { pid: u32 },
    #[error("segment is stale: its creator pid {pid} is dead")]
    CreatorDead { pid: u32 },
    #[error("segment is corrupt: {0}")]
    Corrupt(CorruptReason),
    #[error(transparent)]
    Shm(ShmError),
}

impl From<ShmError> for AttachError {
    fn from(error: ShmError) -> Self {
        match error {
            ShmError::NotFound { object } => AttachError::NotFound { object },
            ShmError::ForeignOwner { owner, expected, .. } => {
                AttachError::ForeignOwner { owner, expected }
            }
            ShmError::Empty { .. } => {
                AttachError::Truncated { len: 0, expected: size_of::<Header>() as u64 }
            }
            error => AttachError::Shm(error),
        }
    }
}

/// Why a per-rank area cannot be reached.
#[derive(Debug, Error)]
pub enum SegmentError {
    #[error("rank {rank} is outside 0..{tp_size}")]
    RankOutOfRange { rank: u32, tp_size: u32 },
    #[error("{ring} ring of rank {rank}: {source}")]
    Ring {
        ring: &'static str,
        rank: u32,
        #[source]
        source: RingError,
    },
    #[error(transparent)]
    Shm(ShmError),
}
