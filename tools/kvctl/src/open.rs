//! Attaching to a segment by name, with errors that say what is wrong and what to do about it.
//!
//! [`open_segment`] is `Segment::attach` plus a diagnosis: every [`AttachError`] becomes an
//! [`OpenError`] that names the segment, and a segment refused because its recorded creator is
//! dead is probed ([`crate::probe`]) to tell a stale segment (a complete header) from garbage under
//! our prefix (no magic, never initialised), since both are for `kvctl cleanup` but mean different
//! things to the person reading the message.
//!
//! Flow: 1. validate the name; 2. attach; 3. on failure, map the error (probing the header bytes
//! when the creator is dead).

use kvshm_ipc::name::{NameError, SegmentName};
use kvshm_ipc::segment::{AttachError, Segment};
use thiserror::Error;

use crate::probe::{self, HeaderProblem};

/// Why kvctl cannot read segment `name`.
#[derive(Debug, Error)]
pub enum OpenError {
    #[error("{text:?} is not a segment name: {source}")]
    BadName {
        text: String,
        #[source]
        source: NameError,
    },
    #[error("no segment named {name} (no {object} under /dev/shm); `kvctl ls` lists the segments")]
    Missing { name: SegmentName, object: String },
    #[error("segment {name} belongs to uid {owner}, kvctl runs as uid {expected}; run kvctl as the segment's owner")]
    ForeignOwner { name: SegmentName, owner: u32, expected: u32 },
    #[error("segment {name} is truncated: it is {len} bytes long, but needs {expected}")]
    Truncated { name: SegmentName, len: u64, expected: u64 },
    #[error(
        "segment {name} is stale: its creator pid {pid} is dead; `kvctl cleanup {name}` removes it"
    )]
    Stale { name: SegmentName, pid: u32 },
    #[error("segment {name} is not a usable kvshm segment: {problem}; the process its creator word names ({pid}) is dead, so `kvctl cleanup {name}` removes it")]
    Garbage { name: SegmentName, problem: HeaderProblem, pid: u32 },
    #[error("segment {name} does not start with the kvshm magic: it is not a kvshm segment")]
    NotKvshm { name: SegmentName },
    #[error("segment {name} has layout version {found}, this kvctl reads version {expected}; use the kvctl of the same kvshm release")]
    VersionMismatch { name: SegmentName, found: u32, expected: u32 },
    #[error("segment {name} is still being created by pid {pid}; retry in a moment")]
    BeingCreated { name: SegmentName, pid: u32 },
    #[error("{name} is a shared tier, not an engine's segment: `kvctl tier {name}` shows it")]
    SharedTier { name: SegmentName },
    #[error("segment {name} is unreadable: {source}")]
    Unreadable {
        name: SegmentName,
        #[source]
        source: AttachError,
    },
}

/// Validates `text` as a segment name.
pub fn parse_name(text: &str) -> Result<SegmentName, OpenError> {
    SegmentName::new(text).map_err(|source| OpenError::BadName { text: text.to_owned(), source })
}

/// Attaches to segment `name` for reading and for leaving control requests.
pub fn open_segment(name: &SegmentName) -> Result<Segment, OpenError> {
    Segment::attach(name).map_err(|error| diagnose(name, error))
}

/// Turns an attach failure into an [`OpenError`] that names the segment.
pub fn diagnose(name: &SegmentName, error: AttachError) -> OpenError {
    let name = name.clone();
    // A shared tier's control object is laid out otherwise: an engine segment's attach reads
    // its words as a header being written (by a creator alive or dead), or without the magic.
    let misread = matches!(
        error,
        AttachError::NotReady { .. } | AttachError::BadMagic | AttachError::CreatorDead { .. }
    );
    if misread && is_shared_tier(&name) {
        return OpenError::SharedTier { name };
    }
    match error {
        AttachError::NotFound { object } => OpenError::Missing { name, object },
        AttachError::ForeignOwner { owner, expected } => {
            OpenError::ForeignOwner { name, owner, expected }
        }
        AttachError::Truncated { len, expected } => OpenError::Truncated { name, len, expected },
        AttachError::BadMagic => OpenError::NotKvshm { name },
        AttachError::VersionMismatch { found, expected } => {
            OpenError::VersionMismatch { name, found, expected }
        }
        AttachError::NotReady { pid } => OpenError::BeingCreated { name, pid },
        AttachError::CreatorDead { pid } => {
            // A dead creator makes attach give up before it looks at the rest of the header;
            // probe it to tell a stale segment from garbage. If the object vanished meanwhile,
            // "stale" is still the truth of what was there.
            match probe::probe(&name.control_object()).ok().and_then(|probe| probe.problem) {
                Some(problem) => OpenError::Garbage { name, problem, pid },
                None => OpenError::Stale { name, pid },
            }
        }
        error => OpenError::Unreadable { name, source: error },
    }
}

/// Whether the control object of `name` is a shared tier's (`kvctl ls` tells them apart).
fn is_shared_tier(name: &SegmentName) -> bool {
    kvshm_ipc::listing::list().iter().any(|listing| {
        listing.name == *name && listing.kind == kvshm_ipc::listing::SegmentKind::SharedTier
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name() -> SegmentName {
        SegmentName::new("llama").unwrap()
    }

    #[test]
    fn messages_name_the_segment_and_the_way_out() {
        let missing =
            diagnose(&name(), AttachError::NotFound { object: "/kvshm.llama".into() }).to_string();
        assert!(missing.contains("no segment named llama") && missing.contains("kvctl ls"));
        let foreign =
            diagnose(&name(), AttachError::ForeignOwner { owner: 0, expected: 1000 }).to_string();
        assert!(foreign.contains("uid 0") && foreign.contains("uid 1000"), "{foreign}");
        let truncated =
            diagnose(&name(), AttachError::Truncated { len: 4096, expected: 1 << 21 }).to_string();
        assert!(truncated.contains("truncated") && truncated.contains("4096"), "{truncated}");
    }

    #[test]
    fn a_dead_creator_of_a_missing_object_reads_as_stale() {
        let name = SegmentName::new(&format!("kvctl-unit-{}", std::process::id())).unwrap();
        let message = diagnose(&name, AttachError::CreatorDead { pid: 12 }).to_string();
        assert!(message.contains("stale") && message.contains("kvctl cleanup"), "{message}");
    }

    #[test]
    fn bad_names_are_refused_before_any_lookup() {
        assert!(matches!(parse_name("a/b"), Err(OpenError::BadName { .. })));
        assert!(parse_name("ok_name-1").is_ok());
    }
}
