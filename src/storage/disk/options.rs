//! What a disk back-end is opened with ([`DiskOptions`]), the crash hook tests use to kill the
//! process in the middle of a write ([`CrashHook`], [`CrashPoint`]), and why opening fails
//! ([`DiskError`]).

use std::path::PathBuf;

use crate::storage::backend::BlockLayout;
use crate::storage::disk_index::IndexError;

/// What a disk back-end is opened with.
#[derive(Clone, Debug)]
pub struct DiskOptions {
    /// The directory the user named; the namespace is a directory inside it.
    pub dir: PathBuf,
    /// A validated storage namespace ([`crate::storage::spec::StorageNamespace`]).
    pub namespace: String,
    pub rank: u32,
    pub layout: BlockLayout,
    /// Slots of the slab (blocks this rank can hold).
    pub capacity_blocks: u64,
    /// Try O_DIRECT (the default); `false` forces buffered I/O.
    pub prefer_direct: bool,
    /// Test hook: kill the process at a point of a write (see [`CrashHook`]).
    pub crash: Option<CrashHook>,
}

/// Test hook: raise SIGKILL in the middle of the `write`-th block written since the back-end
/// was opened (counting from 1), at `point` (or panic the thread writing it, at
/// [`CrashPoint::Panic`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CrashHook {
    pub write: u64,
    pub point: CrashPoint,
}

/// Where [`CrashHook`] kills the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashPoint {
    /// After the old record of the block's slot was zeroed (step 2).
    AfterInvalidate,
    /// After half of the block's bytes were written (step 3).
    MidPayload,
    /// After the block's bytes were written, before its record (between steps 3 and 4).
    BeforeRecord,
    /// Where `AfterInvalidate` is, a panic of the thread writing instead of SIGKILL: the worker
    /// then answers the storage commands given to its storage thread no more.
    Panic,
}

impl std::str::FromStr for CrashHook {
    type Err = String;

    /// `POINT@N`, POINT one of `after-invalidate`, `mid-payload`, `before-record`, `panic`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let error = || {
            format!(
                "crash hook {text:?} is not POINT@N (after-invalidate, mid-payload, before-record, panic)"
            )
        };
        let (point, write) = text.split_once('@').ok_or_else(error)?;
        let point = match point {
            "after-invalidate" => CrashPoint::AfterInvalidate,
            "mid-payload" => CrashPoint::MidPayload,
            "before-record" => CrashPoint::BeforeRecord,
            "panic" => CrashPoint::Panic,
            _ => return Err(error()),
        };
        let write = write.parse().map_err(|_| error())?;
        Ok(CrashHook { write, point })
    }
}

/// Why a disk back-end cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error(transparent)]
    Index(#[from] IndexError),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error(
        "no room for {path} ({bytes} bytes for a storage tier of {blocks} blocks): {source}; \
         free space or ask for fewer storage blocks"
    )]
    NoSpace { path: PathBuf, bytes: u64, blocks: u64, source: std::io::Error },
    #[error("a storage tier of {blocks} blocks needs at least one block")]
    ZeroCapacity { blocks: u64 },
    #[error("a slab of {blocks} blocks of {slot_bytes} bytes is too large")]
    TooLarge { blocks: u64, slot_bytes: u64 },
}
