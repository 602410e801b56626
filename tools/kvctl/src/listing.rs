//! `kvctl ls`: every kvshm segment under `/dev/shm`, judged, with what `cleanup` would do to it.
//!
//! The segment crate's [`kvshm_ipc::listing::list`] finds the objects and judges each control
//! object; this module turns that into rows a person can act on, and decides which objects
//! `kvctl cleanup` may remove (the same decision is used by both commands, so `ls` never promises
//! a removal that `cleanup` would refuse). The rule, per segment:
//!
//! 1. live (valid header, creator alive): never removed;
//! 2. stale (valid header, creator dead): removed with its data objects;
//! 3. garbage under our prefix (owned by us, header incomplete or not a kvshm header, of no other
//!    layout version, and either naming a creator that is dead or naming none and unchanged for
//!    [`CREATION_GRACE`]): shown as unreadable with the problem, and removed;
//! 4. any other unreadable object (another user's, another layout version, a live creator, being
//!    created): shown with the reason, never removed;
//! 5. data objects without a control object (orphaned): removed when the creator recorded in the
//!    arena header is dead, or when the header is unreadable and unchanged for [`CREATION_GRACE`];
//!    one whose creator is alive belongs to a segment being created and is kept;
//! 6. whatever the rules above say, an object that another user owns is never removed, whoever
//!    runs kvctl (root included), and nothing is opened in a way that could block (a FIFO) or
//!    follow a link: every read goes through [`CheckedObject`]. A FIFO, link or other non-file of
//!    our own under the prefix is garbage, removed once unchanged for [`CREATION_GRACE`];
//! 7. nor is a data object another running process maps ([`Mappers`]: an engine still copying
//!    into the arena of a shared tier whose owner died, a worker into its segment's): removing
//!    its name would let the next owner make new memory under it that the process never sees.
//!
//! Flow of `ls`: 1. list and judge (segment crate); 2. refine garbage and orphans ([`list`]);
//! 3. print a table or one JSON document.

use std::io::{self, Write};

use kvshm_ipc::arena::{ArenaHeader, ARENA_MAGIC};
use kvshm_ipc::inspect::{self, CheckedObject};
use kvshm_ipc::listing::CREATION_GRACE;
use kvshm_ipc::listing::{
    self as ipc_listing, DataObject, ListingState, SegmentKind, SegmentListing,
};
use kvshm_ipc::liveness::ProcessIdentity;
use kvshm_ipc::mappers::Mappers;
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::shm::ShmError;
use serde::Serialize;

use crate::probe;
use crate::text::{self, Table};

/// What a segment is, as `ls` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SegmentState {
    Live,
    Stale,
    Unreadable,
    Orphaned,
}

impl SegmentState {
    pub fn name(self) -> &'static str {
        match self {
            SegmentState::Live => "live",
            SegmentState::Stale => "stale",
            SegmentState::Unreadable => "unreadable",
            SegmentState::Orphaned => "orphaned",
        }
    }
}

/// One data object (per-rank arena) of a segment.
#[derive(Debug, Clone, Serialize)]
pub struct DataObjectRow {
    /// Object name with its leading slash (`/kvshm.NAME.host.0`).
    pub object: String,
    /// `device` or `host`.
    pub kind: &'static str,
    pub rank: u32,
    pub size_bytes: u64,
    /// Whether `kvctl cleanup` removes it.
    pub removable: bool,
    /// Why it is kept or removed, for orphans.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// One segment (or group of orphaned data objects) under `/dev/shm`.
#[derive(Debug, Clone, Serialize)]
pub struct SegmentRow {
    pub name: String,
    /// `engine`, or `shared_tier` for a host tier several engines share.
    pub kind: &'static str,
    pub state: SegmentState,
    /// Why it is stale, unreadable or orphaned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Whether `kvctl cleanup` removes its control object (and its data objects).
    pub removable: bool,
    pub creator_pid: Option<u32>,
    /// Bytes of the control object (0 for orphans).
    pub size_bytes: u64,
    pub tp_size: Option<u32>,
    pub block_tokens: Option<u32>,
    pub device_blocks: Option<u32>,
    pub host_blocks: Option<u32>,
    pub data_objects: Vec<DataObjectRow>,
    /// The creator identity as judged, so that cleanup can check nothing changed since.
    #[serde(skip)]
    pub creator: Option<ProcessIdentity>,
    /// The validated name.
    #[serde(skip)]
    pub segment: SegmentName,
}

/// The result of `kvctl ls`.
#[derive(Debug, Clone, Serialize)]
pub struct Listing {
    pub segments: Vec<SegmentRow>,
}

/// Lists the segments named in `only` (every segment when empty), judged.
pub fn list(only: &[SegmentName]) -> Listing {
    let mappers = Mappers::scan();
    let segments = ipc_listing::list()
        .into_iter()
        .filter(|listing| only.is_empty() || only.contains(&listing.name))
        .map(|listing| row(&listing, &mappers))
        .collect();
    Listing { segments }
}

fn row(listing: &SegmentListing, mappers: &Mappers) -> SegmentRow {
    let (state, reason, removable) = judge(listing);
    let data_objects = listing
        .data_objects
        .iter()
        .map(|data| {
            let (removable, reason) = if state == SegmentState::Orphaned {
                let (removable, reason) = judge_orphan(data);
                (removable, Some(reason))
            } else if data.owner != inspect::our_uid() {
                (false, Some(not_ours(&data.object, data.owner)))
            } else {
                (removable, None)
            };
            match mappers.of(&data.object) {
                [pid, ..] if removable => {
                    data_row(data, false, Some(format!("in use: process {pid} maps it")))
                }
                _ => data_row(data, removable, reason),
            }
        })
        .collect::<Vec<_>>();
    let removable = if state == SegmentState::Orphaned {
        data_objects.iter().any(|data| data.removable)
    } else {
        removable
    };
    let config = listing.config.as_ref();
    SegmentRow {
        name: listing.name.to_string(),
        kind: match listing.kind {
            SegmentKind::Engine => "engine",
            SegmentKind::SharedTier => "shared_tier",
        },
        state,
        reason,
        removable,
        creator_pid: listing.creator.map(|creator| creator.pid),
        size_bytes: listing.size,
        tp_size: config.map(|config| config.tp_size),
        block_tokens: config.map(|config| config.block_tokens),
        device_blocks: config.map(|config| config.device_blocks),
        host_blocks: config.map(|config| config.host_blocks),
        data_objects,
        creator: listing.creator,
        segment: listing.name.clone(),
    }
}

fn data_row(data: &DataObject, removable: bool, reason: Option<String>) -> DataObjectRow {
    DataObjectRow {
        object: data.object.clone(),
        kind: data.kind.name(),
        rank: data.rank,
        size_bytes: data.size,
        removable,
        reason,
    }
}

/// State, reason and removability of a segment's control object (rules 1 to 4).
fn judge(listing: &SegmentListing) -> (SegmentState, Option<String>, bool) {
    match &listing.state {
        ListingState::Live => (SegmentState::Live, None, false),
        ListingState::Stale if listing.kind == SegmentKind::SharedTier => {
            let pid = listing.creator.map_or(0, |creator| creator.pid);
            (SegmentState::Stale, Some(format!("the tier's owner pid {pid} is dead")), true)
        }
        ListingState::Stale if listing.config.is_some() => {
            let pid = listing.creator.map_or(0, |creator| creator.pid);
            (SegmentState::Stale, Some(format!("creator pid {pid} is dead")), true)
        }
        ListingState::Stale => {
            // The header did not validate and the segment crate judged it abandoned: garbage.
            let problem = match probe::probe(&listing.name.control_object()) {
                Ok(probe) => probe.problem.map(|problem| problem.to_string()),
                Err(error @ ShmError::NotRegularFile { .. }) => Some(error.to_string()),
                Err(_) => None,
            };
            let whose = match listing.creator {
                Some(creator) => format!("the creator it names (pid {}) is dead", creator.pid),
                None => format!("it names no creator and is older than {CREATION_GRACE:?}"),
            };
            match problem {
                Some(problem) => {
                    (SegmentState::Unreadable, Some(format!("{problem}; {whose}")), true)
                }
                None => (SegmentState::Stale, Some(whose), true),
            }
        }
        ListingState::Unreadable(reason) => (SegmentState::Unreadable, Some(reason.clone()), false),
        ListingState::Orphaned => (
            SegmentState::Orphaned,
            Some("data objects without a control object".to_owned()),
            false,
        ),
    }
}

/// Rules 5 and 6: whether an orphaned data object may be removed, and why.
pub fn judge_orphan(data: &DataObject) -> (bool, String) {
    if data.owner != inspect::our_uid() {
        return (false, not_ours(&data.object, data.owner));
    }
    let checked = match CheckedObject::open(&data.object) {
        Ok(checked) => checked,
        Err(_) if inspect::is_directory_with_entries(&data.object) => {
            let error = ShmError::DirectoryNotEmpty { object: data.object.clone() };
            return (false, error.to_string());
        }
        Err(error @ ShmError::NotRegularFile { .. }) => {
            let old = inspect::status(&data.object)
                .is_ok_and(|status| status.unchanged_for(CREATION_GRACE));
            return match old {
                true => (true, error.to_string()),
                false => (false, format!("{error}; changed within {CREATION_GRACE:?}")),
            };
        }
        Err(error) => return (false, format!("cannot be read: {error}")),
    };
    match read_arena_header(&checked) {
        Ok(Some(header)) if header.creator.is_alive() => (
            false,
            format!("its creator pid {} is alive (a segment being created?)", header.creator.pid),
        ),
        Ok(Some(header)) => (true, format!("its creator pid {} is dead", header.creator.pid)),
        Ok(None) if checked.unchanged_for(CREATION_GRACE) => {
            (true, "not a kvshm arena header, and not being written".to_owned())
        }
        Ok(None) => (false, "no arena header yet (being created?)".to_owned()),
        Err(error) => (false, format!("cannot be read: {error}")),
    }
}

/// Why `object`, which another user owns, stays (rule 6).
fn not_ours(object: &str, owner: u32) -> String {
    let what = match inspect::status(object) {
        Ok(status) if !status.is_regular_file() => {
            format!("it is a {} of uid {owner}", status.kind)
        }
        _ => format!("it belongs to uid {owner}"),
    };
    format!("{what}, and kvctl runs as uid {}: never removed", inspect::our_uid())
}

/// The arena header of an object, `None` if it is not one (short, no magic). Read-only.
fn read_arena_header(checked: &CheckedObject) -> Result<Option<ArenaHeader>, ShmError> {
    let bytes = checked.read_at(0, size_of::<ArenaHeader>())?;
    if bytes.len() < size_of::<ArenaHeader>() {
        return Ok(None);
    }
    let header: ArenaHeader = bytemuck::pod_read_unaligned(&bytes);
    Ok((header.magic == ARENA_MAGIC && !header.creator.is_none()).then_some(header))
}

impl Listing {
    /// A table, one line per segment, with a note saying why and whether cleanup removes it.
    pub fn write_text(&self, out: &mut dyn Write) -> io::Result<()> {
        if self.segments.is_empty() {
            return writeln!(out, "no kvshm segments under {}", ipc_listing::SHM_DIR);
        }
        let mut table = Table::new(&[
            "NAME",
            "STATE",
            "PID",
            "SIZE",
            "TP",
            "BLOCK_TOKENS",
            "DEVICE",
            "HOST",
            "DATA",
            "NOTE",
        ]);
        for row in &self.segments {
            let mut note = row.reason.clone().unwrap_or_default();
            if row.removable {
                note.push_str(if note.is_empty() { "" } else { "; " });
                note.push_str("`kvctl cleanup` removes it");
            }
            let data_bytes: u64 = row.data_objects.iter().map(|data| data.size_bytes).sum();
            let data = if row.data_objects.is_empty() {
                "-".to_owned()
            } else {
                format!("{} ({})", row.data_objects.len(), text::bytes(data_bytes))
            };
            let size = if row.state == SegmentState::Orphaned {
                "-".to_owned()
            } else {
                text::bytes(row.size_bytes)
            };
            table.push(vec![
                row.name.clone(),
                row.state.name().to_owned(),
                text::or_dash(row.creator_pid),
                size,
                text::or_dash(row.tp_size),
                text::or_dash(row.block_tokens),
                text::or_dash(row.device_blocks),
                text::or_dash(row.host_blocks),
                data,
                note,
            ]);
        }
        table.write(out)
    }
}
