//! Finding, judging and removing the kvshm objects under `/dev/shm` (for `kvctl ls` and `cleanup`,
//! and for `Segment::create` taking over a stale segment).
//!
//! [`list`] scans `/dev/shm` for names that parse as kvshm objects, groups them by segment, and
//! judges each control object: [`ListingState::Live`] (valid, creator alive),
//! [`ListingState::Stale`] (creator dead; or unreadable, creatorless and older than
//! [`CREATION_GRACE`]), [`ListingState::Unreadable`] (with the reason), and data objects without a
//! control object as [`ListingState::Orphaned`]. A shared tier's control object
//! ([`crate::tier_control`], [`SegmentKind::SharedTier`]) is judged by its owner the same way,
//! and its host arenas are its data objects. [`unlink`] removes every object of a name.
//!
//! Every object is opened through [`crate::inspect`] (no blocking on a FIFO, no following a link,
//! a regular file of our effective uid or nothing), and nothing here removes an object that
//! another user owns: [`unlink`] refuses the whole name, naming the foreign object and its owner.
//! A control object larger than any segment can be (a sparse file of terabytes) is never mapped;
//! its creator word is read with `pread` and judges it.
//!
//! A segment whose creator identity was not written yet (the first microseconds of creation)
//! cannot be judged by its creator; within [`CREATION_GRACE`] of its last modification it counts
//! as being created, after that as stale. So does a FIFO, link or other non-file of ours under the
//! prefix: it names no creator, and once it is old it is garbage.
//!
//! Limitation: taking over a stale segment is check-then-unlink; two processes creating the same
//! stale name at the same moment can race (one may remove the other's fresh object). Creating one
//! name from several processes at once is not a supported use.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::arena::ArenaKind;
use crate::config::MAX_REGIONS;
use crate::config::{SegmentConfig, MAX_COMMAND_RING_SLOTS, MAX_COMPLETION_RING_SLOTS, MAX_RANKS};
use crate::inspect::{self, Access, CheckedObject, ObjectIdentity, ObjectStatus};
use crate::layout::{HeaderFields, SegmentLayout};
use crate::liveness::ProcessIdentity;
use crate::name::{ObjectKind, ObjectName, SegmentName};
use crate::segment::{validate_header, AttachError, CreateError};
use crate::shm::{SharedMemory, ShmError};
use crate::tier_control::{self, TierAttachError};

pub use crate::inspect::SHM_DIR;
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
    /// The uid that owns it (another user's is never read or removed).
    pub owner: u32,
}

/// What a control object serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentKind {
    /// An engine's segment (its creator is the scheduler), or an object that is no kvshm
    /// control object of any kind.
    Engine,
    /// A host tier shared by several engines ([`crate::tier_control`]; its creator is the
    /// tier's owner).
    SharedTier,
}

/// One segment found under `/dev/shm`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentListing {
    pub name: SegmentName,
    pub kind: SegmentKind,
    pub state: ListingState,
    pub creator: Option<ProcessIdentity>,
    /// Bytes of the control object (0 when orphaned).
    pub size: u64,
    /// The uid that owns the control object (`None` when orphaned).
    pub owner: Option<u32>,
    /// The configuration, when the header validated.
    pub config: Option<SegmentConfig>,
    pub data_objects: Vec<DataObject>,
}

/// Every kvshm segment under `/dev/shm`, sorted by name. Entries that vanish during the scan are
/// skipped; a missing `/dev/shm` gives an empty list.
pub fn list() -> Vec<SegmentListing> {
    let mut by_name: BTreeMap<SegmentName, (Option<ObjectStatus>, Vec<DataObject>)> =
        BTreeMap::new();
    for (parsed, status) in scan() {
        let entry = by_name.entry(parsed.segment.clone()).or_default();
        let data = |kind: ArenaKind, rank: u32| DataObject {
            kind,
            rank,
            object: parsed.object(),
            size: status.len,
            owner: status.owner,
        };
        match parsed.kind {
            ObjectKind::Control => entry.0 = Some(status),
            ObjectKind::DeviceArena { rank } => entry.1.push(data(ArenaKind::Device, rank)),
            ObjectKind::HostTier { rank } => entry.1.push(data(ArenaKind::Host, rank)),
            ObjectKind::TierKeys { rank } => entry.1.push(data(ArenaKind::Keys, rank)),
        }
    }
    by_name
        .into_iter()
        .map(|(name, (control, mut data_objects))| {
            data_objects.sort_by_key(|object| (object.rank, object.kind.name()));
            let (state, creator, config, kind) = match &control {
                Some(_) => judge_for_listing(&name.control_object()),
                None => (ListingState::Orphaned, None, None, SegmentKind::Engine),
            };
            SegmentListing {
                name,
                kind,
                state,
                creator,
                size: control.as_ref().map_or(0, |status| status.len),
                owner: control.as_ref().map(|status| status.owner),
                config,
                data_objects,
            }
        })
        .collect()
}

/// Removes every data object and then the control object of `name`; returns how many were
/// removed. The control object goes last: while it exists nobody else can create the name, so a
/// concurrent creator's fresh data objects are never caught by this removal.
///
/// If another user owns any object of the name, nothing is removed and the error names it.
pub fn unlink(name: &SegmentName) -> Result<usize, ShmError> {
    check_all_ours(name, true)?;
    let removed = unlink_data_objects(name)?;
    Ok(removed + usize::from(inspect::unlink_owned(&name.control_object())?))
}

/// Removes every data object of `name`; returns how many were removed. If another user owns any
/// of them, nothing is removed and the error names it.
pub(crate) fn unlink_data_objects(name: &SegmentName) -> Result<usize, ShmError> {
    unlink_data_objects_but(name, false)
}

/// [`unlink_data_objects`], sparing the host tier arenas when `keep_host`.
pub(crate) fn unlink_data_objects_but(
    name: &SegmentName,
    keep_host: bool,
) -> Result<usize, ShmError> {
    check_all_ours(name, false)?;
    let mut removed = 0;
    for (parsed, _) in scan() {
        let spared = keep_host
            && matches!(parsed.kind, ObjectKind::HostTier { .. } | ObjectKind::TierKeys { .. });
        if &parsed.segment == name && parsed.kind != ObjectKind::Control && !spared {
            removed += usize::from(inspect::unlink_owned(&parsed.object())?);
        }
    }
    Ok(removed)
}

/// Fails with [`ShmError::ForeignOwner`] naming the first object of `name` (data objects, and the
/// control object if `with_control`) that another user owns.
fn check_all_ours(name: &SegmentName, with_control: bool) -> Result<(), ShmError> {
    let ours = inspect::our_uid();
    for (parsed, status) in scan() {
        let included = with_control || parsed.kind != ObjectKind::Control;
        if &parsed.segment == name && included && status.owner != ours {
            return Err(ShmError::ForeignOwner {
                object: parsed.object(),
                owner: status.owner,
                expected: ours,
            });
        }
    }
    Ok(())
}

/// What `Segment::create` found under its name.
pub(crate) enum ExistingSegment {
    Live {
        pid: u32,
    },
    BeingCreated,
    /// Its creator is dead; the file judged (a racing creator may replace it meanwhile).
    Stale {
        identity: ObjectIdentity,
    },
    /// It disappeared meanwhile.
    Gone,
}

/// Judges an existing control object for `Segment::create`. Another user's object, or anything
/// that is not a regular file of ours, is an error that names it; nothing is mapped.
pub(crate) fn judge_existing(object: &str) -> Result<ExistingSegment, CreateError> {
    let checked = match CheckedObject::open(object) {
        Ok(checked) => checked,
        Err(ShmError::NotFound { .. }) => return Ok(ExistingSegment::Gone),
        Err(ShmError::NotRegularFile { owner, .. }) if owner == inspect::our_uid() => {
            return Ok(judge_creatorless(inspect::status(object).ok().as_ref()))
        }
        Err(error) => return Err(CreateError::Shm(error)),
    };
    Ok(match read_creator_word(&checked) {
        Some(creator) if creator.is_alive() => ExistingSegment::Live { pid: creator.pid },
        Some(_) => ExistingSegment::Stale { identity: checked.identity() },
        None => judge_creatorless(inspect::status(object).ok().as_ref()),
    })
}

fn judge_creatorless(status: Option<&ObjectStatus>) -> ExistingSegment {
    match status {
        Some(status) if status.unchanged_for(CREATION_GRACE) => {
            ExistingSegment::Stale { identity: status.identity }
        }
        _ => ExistingSegment::BeingCreated,
    }
}

/// The creator identity at its fixed header offset, read without mapping (`None` if the object
/// is too short or the word is zero).
fn read_creator_word(checked: &CheckedObject) -> Option<ProcessIdentity> {
    let at = std::mem::offset_of!(HeaderFields, creator);
    let bytes = checked.read_at(at as u64, size_of::<ProcessIdentity>()).ok()?;
    if bytes.len() < size_of::<ProcessIdentity>() {
        return None;
    }
    let creator: ProcessIdentity = bytemuck::pod_read_unaligned(&bytes);
    (!creator.is_none()).then_some(creator)
}

/// The largest control object any valid configuration makes (of a segment or a shared tier). A
/// larger object is neither (whatever its header says), and is judged without mapping it.
pub fn largest_control_object() -> u64 {
    let largest = SegmentConfig {
        tp_size: MAX_RANKS,
        regions: MAX_REGIONS,
        layers: 1,
        command_ring_slots: MAX_COMMAND_RING_SLOTS,
        completion_ring_slots: MAX_COMPLETION_RING_SLOTS,
        device_blocks: 1,
        host_blocks: 0,
        region_bytes: 1,
        ..SegmentConfig::default()
    };
    let segment = SegmentLayout::compute(&largest)
        .map(|layout| layout.total_size as u64)
        .expect("the largest configuration validates; anything else is a programming error");
    segment.max(tier_control::TierLayout::largest() as u64)
}

type Judgement = (ListingState, Option<ProcessIdentity>, Option<SegmentConfig>, SegmentKind);

fn judge_for_listing(object: &str) -> Judgement {
    let unreadable =
        |reason: String| (ListingState::Unreadable(reason), None, None, SegmentKind::Engine);
    let checked = match CheckedObject::open_with(object, Access::ReadWrite) {
        Ok(checked) => checked,
        Err(error @ ShmError::NotRegularFile { owner, .. }) if owner == inspect::our_uid() => {
            if inspect::is_directory_with_entries(object) {
                // Cleanup removes only empty directories (`inspect::unlink_owned`): never call
                // this one removable.
                let reason = ShmError::DirectoryNotEmpty { object: object.to_owned() };
                return unreadable(reason.to_string());
            }
            return creatorless(inspect::status(object).ok().as_ref(), error.to_string());
        }
        Err(error) => return unreadable(error.to_string()),
    };
    if checked.is_empty() {
        return creatorless(inspect::status(object).ok().as_ref(), "empty object".to_owned());
    }
    let creator = read_creator_word(&checked);
    if checked.len() > largest_control_object() {
        let reason = format!("it is {} bytes, more than any kvshm segment can be", checked.len());
        return judge_by_creator(creator, &checked, reason);
    }
    let modified = inspect::status(object).ok();
    let memory = match SharedMemory::map(checked) {
        Ok(memory) => memory,
        Err(error) => return unreadable(error.to_string()),
    };
    if tier_control::has_tier_magic(&memory) {
        return judge_tier(&memory, creator, modified.as_ref());
    }
    match validate_header(&memory) {
        Ok((fields, _)) => {
            let state =
                if fields.creator.is_alive() { ListingState::Live } else { ListingState::Stale };
            (state, Some(fields.creator), Some(fields.config), SegmentKind::Engine)
        }
        // Another layout version may keep its creator elsewhere: never call it stale.
        Err(error @ AttachError::VersionMismatch { .. }) => unreadable(error.to_string()),
        Err(error) => match creator.map(|creator| creator.is_alive()) {
            Some(false) => (ListingState::Stale, creator, None, SegmentKind::Engine),
            Some(true) => {
                (ListingState::Unreadable(error.to_string()), creator, None, SegmentKind::Engine)
            }
            None => creatorless(modified.as_ref(), error.to_string()),
        },
    }
}

/// A shared tier's control object: live while its owner runs, stale once it is dead (another
/// layout version of it is never called stale).
fn judge_tier(
    memory: &SharedMemory,
    creator: Option<ProcessIdentity>,
    modified: Option<&ObjectStatus>,
) -> Judgement {
    let tier = SegmentKind::SharedTier;
    match tier_control::validate(memory) {
        Ok((fields, _)) => {
            let state =
                if fields.creator.is_alive() { ListingState::Live } else { ListingState::Stale };
            (state, Some(fields.creator), None, tier)
        }
        Err(error @ TierAttachError::VersionMismatch { .. }) => {
            (ListingState::Unreadable(error.to_string()), creator, None, tier)
        }
        Err(error) => match creator.map(|creator| creator.is_alive()) {
            Some(false) => (ListingState::Stale, creator, None, tier),
            Some(true) => (ListingState::Unreadable(error.to_string()), creator, None, tier),
            None => {
                let (state, creator, config, _) = creatorless(modified, error.to_string());
                (state, creator, config, tier)
            }
        },
    }
}

/// An object that cannot be a segment, judged by the creator it names (or its age if none).
fn judge_by_creator(
    creator: Option<ProcessIdentity>,
    checked: &CheckedObject,
    reason: String,
) -> Judgement {
    match creator {
        Some(creator) if creator.is_alive() => (
            ListingState::Unreadable(format!(
                "{reason}; the creator it names (pid {}) is alive",
                creator.pid
            )),
            Some(creator),
            None,
            SegmentKind::Engine,
        ),
        Some(creator) => (ListingState::Stale, Some(creator), None, SegmentKind::Engine),
        None => creatorless(inspect::status(checked.object()).ok().as_ref(), reason),
    }
}

fn creatorless(status: Option<&ObjectStatus>, reason: String) -> Judgement {
    match status {
        Some(status) if status.unchanged_for(CREATION_GRACE) => {
            (ListingState::Stale, None, None, SegmentKind::Engine)
        }
        _ => (
            ListingState::Unreadable(format!("being created ({reason})")),
            None,
            None,
            SegmentKind::Engine,
        ),
    }
}

/// Every kvshm object under `/dev/shm`, described without opening it.
fn scan() -> Vec<(ObjectName, ObjectStatus)> {
    let Ok(entries) = std::fs::read_dir(SHM_DIR) else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let parsed = ObjectName::parse(entry.file_name().to_str()?)?;
            let status = inspect::status(&parsed.object()).ok()?;
            Some((parsed, status))
        })
        .collect()
}
