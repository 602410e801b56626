//! Finding, judging and removing the kvshm objects under `/dev/shm` (for `kvctl ls` and `cleanup`,
//! and for `Segment::create` taking over a stale segment).
//!
//! [`list`] scans `/dev/shm` for names that parse as kvshm objects, groups them by segment, and
//! judges each control object: [`ListingState::Live`] (valid, creator alive),
//! [`ListingState::Stale`] (creator dead; or unreadable, creatorless and older than
//! [`CREATION_GRACE`]), [`ListingState::Unreadable`] (with the reason), and data objects without a
//! control object as [`ListingState::Orphaned`]. [`unlink`] removes every object of a name.
//!
//! A segment whose creator identity was not written yet (the first microseconds of creation)
//! cannot be judged by its creator; within [`CREATION_GRACE`] of its last modification it counts
//! as being created, after that as stale.
//!
//! Limitation: taking over a stale segment is check-then-unlink; two processes creating the same
//! stale name at the same moment can race (one may remove the other's fresh object). Creating one
//! name from several processes at once is not a supported use.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::arena::{self, ArenaKind};
use crate::config::SegmentConfig;
use crate::liveness::ProcessIdentity;
use crate::name::{ObjectKind, ObjectName, SegmentName};
use crate::segment::{read_creator, validate_header, AttachError, CreateError};
use crate::shm::{self, SharedMemory, ShmError};

/// Where POSIX shared-memory objects appear on Linux.
pub const SHM_DIR: &str = "/dev/shm";
/// How long a control object without a readable creator is presumed to be in creation.
pub const CREATION_GRACE: Duration = Duration::from_secs(2);

/// What became of a segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListingState {
    /// Valid and its creator runs.
    Live,
    /// Its creator is dead (or it is old creatorless garbage): `kvctl cleanup` removes it.
    Stale,
    /// It cannot be judged (another user's, another layout version, being created, corrupt with a
    /// live creator); the reason says which.
    Unreadable(String),
    /// Data objects whose control object is gone.
    Orphaned,
}

impl ListingState {
    pub fn name(&self) -> &'static str {
        match self {
            ListingState::Live => "live",
            ListingState::Stale => "stale",
            ListingState::Unreadable(_) => "unreadable",
            ListingState::Orphaned => "orphaned",
        }
    }
}

/// A data object (arena) of a segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataObject {
    pub kind: ArenaKind,
    pub rank: u32,
    /// Object name, with the leading slash.
    pub object: String,
    pub size: u64,
}

/// One segment found under `/dev/shm`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentListing {
    pub name: SegmentName,
    pub state: ListingState,
    pub creator: Option<ProcessIdentity>,
    /// Bytes of the control object (0 when orphaned).
    pub size: u64,
    /// The configuration, when the header validated.
    pub config: Option<SegmentConfig>,
    pub data_objects: Vec<DataObject>,
}

/// Every kvshm segment under `/dev/shm`, sorted by name. Entries that vanish during the scan are
/// skipped; a missing `/dev/shm` gives an empty list.
pub fn list() -> Vec<SegmentListing> {
    let mut by_name: BTreeMap<SegmentName, (Option<u64>, Vec<DataObject>)> = BTreeMap::new();
    for (parsed, size) in scan() {
        let entry = by_name.entry(parsed.segment.clone()).or_default();
        match parsed.kind {
            ObjectKind::Control => entry.0 = Some(size),
            ObjectKind::DeviceArena { rank } => entry.1.push(DataObject {
                kind: ArenaKind::Device,
                rank,
                object: parsed.object(),
                size,
            }),
            ObjectKind::HostTier { rank } => entry.1.push(DataObject {
                kind: ArenaKind::Host,
                rank,
                object: parsed.object(),
                size,
            }),
        }
    }
    by_name
        .into_iter()
        .map(|(name, (control_size, mut data_objects))| {
            data_objects.sort_by_key(|object| (object.rank, object.kind.name()));
            let (state, creator, config) = match control_size {
                Some(_) => judge_for_listing(&name.control_object()),
                None => (ListingState::Orphaned, None, None),
            };
            SegmentListing {
                name,
                state,
                creator,
                size: control_size.unwrap_or(0),
                config,
                data_objects,
            }
        })
        .collect()
}

/// Removes every data object and then the control object of `name`; returns how many were
/// removed. The control object goes last: while it exists nobody else can create the name, so a
/// concurrent creator's fresh data objects are never caught by this removal.
pub fn unlink(name: &SegmentName) -> Result<usize, ShmError> {
    let removed = unlink_data_objects(name)?;
    Ok(removed + usize::from(unlink_if_present(&name.control_object())?))
}

/// Removes every data object of `name`; returns how many were removed.
pub(crate) fn unlink_data_objects(name: &SegmentName) -> Result<usize, ShmError> {
    let mut removed = 0;
    for (parsed, _) in scan() {
        if &parsed.segment == name && parsed.kind != ObjectKind::Control {
            removed += usize::from(unlink_if_present(&parsed.object())?);
        }
    }
    Ok(removed)
}

fn unlink_if_present(object: &str) -> Result<bool, ShmError> {
    match shm::unlink(object) {
        Ok(()) => Ok(true),
        Err(ShmError::NotFound { .. }) => Ok(false),
        Err(error) => Err(error),
    }
}

/// What `Segment::create` found under its name.
pub(crate) enum ExistingSegment {
    Live {
        pid: u32,
    },
    BeingCreated,
    Stale,
    /// It disappeared meanwhile.
    Gone,
}

/// Judges an existing control object for `Segment::create`.
pub(crate) fn judge_existing(object: &str) -> Result<ExistingSegment, CreateError> {
    let memory = match SharedMemory::open(object) {
        Ok(memory) => memory,
        Err(ShmError::NotFound { .. }) => return Ok(ExistingSegment::Gone),
        Err(ShmError::Empty { .. }) => return Ok(judge_creatorless(object)),
        Err(error) => return Err(CreateError::Shm(error)),
    };
    Ok(match read_creator(&memory) {
        Some(creator) if creator.is_alive() => ExistingSegment::Live { pid: creator.pid },
        Some(_) => ExistingSegment::Stale,
        None => judge_creatorless(object),
    })
}

fn judge_creatorless(object: &str) -> ExistingSegment {
    if recently_modified(object) {
        ExistingSegment::BeingCreated
    } else {
        ExistingSegment::Stale
    }
}

/// The creator recorded in a control object or an arena, if readable (for Drop's ownership check).
pub(crate) fn object_creator(object: &str) -> Option<ProcessIdentity> {
    let memory = SharedMemory::open(object).ok()?;
    match ObjectName::parse(object)?.kind {
        ObjectKind::Control => read_creator(&memory),
        ObjectKind::DeviceArena { .. } | ObjectKind::HostTier { .. } => {
            arena::read_header(&memory).ok().map(|header| header.creator)
        }
    }
}

fn judge_for_listing(
    object: &str,
) -> (ListingState, Option<ProcessIdentity>, Option<SegmentConfig>) {
    let unreadable = |reason: String| (ListingState::Unreadable(reason), None, None);
    let memory = match SharedMemory::open(object) {
        Ok(memory) => memory,
        Err(ShmError::Empty { .. }) => return creatorless(object, "empty object".to_owned()),
        Err(error) => return unreadable(error.to_string()),
    };
    let creator = read_creator(&memory);
    let creator_alive = creator.map(|creator| creator.is_alive());
    match validate_header(&memory) {
        Ok((fields, _)) => {
            let state =
                if fields.creator.is_alive() { ListingState::Live } else { ListingState::Stale };
            (state, Some(fields.creator), Some(fields.config))
        }
        // Another layout version may keep its creator elsewhere: never call it stale.
        Err(error @ AttachError::VersionMismatch { .. }) => unreadable(error.to_string()),
        Err(error) => match creator_alive {
            Some(false) => (ListingState::Stale, creator, None),
            Some(true) => (ListingState::Unreadable(error.to_string()), creator, None),
            None => creatorless(object, error.to_string()),
        },
    }
}

fn creatorless(
    object: &str,
    reason: String,
) -> (ListingState, Option<ProcessIdentity>, Option<SegmentConfig>) {
    if recently_modified(object) {
        (ListingState::Unreadable(format!("being created ({reason})")), None, None)
    } else {
        (ListingState::Stale, None, None)
    }
}

fn recently_modified(object: &str) -> bool {
    std::fs::metadata(format!("{SHM_DIR}{object}"))
        .and_then(|metadata| metadata.modified())
        .ok()
        .and_then(|modified| modified.elapsed().ok())
        .map_or(true, |age| age < CREATION_GRACE)
}

/// Every kvshm object under `/dev/shm` with its size.
fn scan() -> Vec<(ObjectName, u64)> {
    let Ok(entries) = std::fs::read_dir(SHM_DIR) else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let parsed = ObjectName::parse(entry.file_name().to_str()?)?;
            let size = entry.metadata().ok()?.len();
            Some((parsed, size))
        })
        .collect()
}
