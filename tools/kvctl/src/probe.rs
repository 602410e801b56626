//! Reading a control object's header bytes without attaching, to name what is wrong with it.
//!
//! `Segment::attach` answers "can this segment be used?"; when the answer is no because the
//! recorded creator is dead, it does not say whether the bytes ever were a kvshm segment. [`probe`]
//! reads the first bytes of `/dev/shm/OBJECT` read-only (no mapping, no write) and reports the
//! creator word and the first problem of the header ([`HeaderProblem`]).
//!
//! Flow of one probe: 1. open the object through [`CheckedObject`] (never blocking on a FIFO or
//! following a link; only a regular file of ours is read) and read at most one `Header`; 2. copy
//! the creator identity out if the file is long enough; 3. check, in order: length, magic, layout
//! version, ready flag, and the declared total size against the file's length.

use std::mem::offset_of;
use std::time::SystemTime;

use kvshm_ipc::inspect::CheckedObject;
use kvshm_ipc::layout::{Header, HeaderFields, LAYOUT_VERSION, MAGIC, READY};
use kvshm_ipc::liveness::ProcessIdentity;
use kvshm_ipc::shm::ShmError;
use thiserror::Error;

/// The first thing wrong with a control object's header.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HeaderProblem {
    #[error("it is {len} bytes long, but needs at least {expected}")]
    Truncated { len: u64, expected: u64 },
    #[error("it does not start with the kvshm magic")]
    NoMagic,
    #[error("it has layout version {found}, this kvctl reads version {expected}")]
    VersionMismatch { found: u32, expected: u32 },
    #[error("its creator never finished initialising it")]
    NeverReady,
}

/// What the header bytes of a control object say, read at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderProbe {
    /// Bytes of the object.
    pub len: u64,
    /// The creator identity, if the object is long enough and the word is not zero.
    pub creator: Option<ProcessIdentity>,
    /// `None` when the header looks like a complete kvshm header of this layout version.
    pub problem: Option<HeaderProblem>,
    /// Last modification time, if the file system reports one.
    pub modified: Option<SystemTime>,
}

/// Reads the header of `object` (a name with its leading slash, e.g. `/kvshm.NAME`) read-only.
pub fn probe(object: &str) -> Result<HeaderProbe, ShmError> {
    let checked = CheckedObject::open(object)?;
    let bytes = checked.read_at(0, size_of::<Header>())?;
    Ok(HeaderProbe {
        len: checked.len(),
        creator: read_creator(&bytes),
        problem: header_problem(&bytes, checked.len()),
        modified: checked.modified(),
    })
}

/// The creator identity stored at its fixed header offset, if present.
pub fn read_creator(bytes: &[u8]) -> Option<ProcessIdentity> {
    let at = offset_of!(HeaderFields, creator);
    let word = bytes.get(at..at + size_of::<ProcessIdentity>())?;
    let creator: ProcessIdentity = bytemuck::pod_read_unaligned(word);
    (!creator.is_none()).then_some(creator)
}

/// The first problem of the header `bytes` (at most one `Header`) of an object of `len` bytes.
pub fn header_problem(bytes: &[u8], len: u64) -> Option<HeaderProblem> {
    let header_len = size_of::<Header>() as u64;
    if len < header_len || (bytes.len() as u64) < header_len {
        return Some(HeaderProblem::Truncated { len, expected: header_len });
    }
    let fields: HeaderFields = bytemuck::pod_read_unaligned(&bytes[..size_of::<HeaderFields>()]);
    if fields.magic != MAGIC {
        return Some(HeaderProblem::NoMagic);
    }
    if fields.layout_version != LAYOUT_VERSION {
        return Some(HeaderProblem::VersionMismatch {
            found: fields.layout_version,
            expected: LAYOUT_VERSION,
        });
    }
    let at = offset_of!(Header, ready);
    let ready = u32::from_ne_bytes(bytes[at..at + 4].try_into().expect("a 4-byte slice"));
    if ready != READY {
        return Some(HeaderProblem::NeverReady);
    }
    if fields.total_size > len {
        return Some(HeaderProblem::Truncated { len, expected: fields.total_size });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid_header(total_size: u64) -> Vec<u8> {
        let mut bytes = vec![0u8; size_of::<Header>()];
        let fields = HeaderFields {
            magic: MAGIC,
            layout_version: LAYOUT_VERSION,
            total_size,
            creator: ProcessIdentity::new(42, 7),
            ..bytemuck::Zeroable::zeroed()
        };
        bytes[..size_of::<HeaderFields>()].copy_from_slice(bytemuck::bytes_of(&fields));
        let at = offset_of!(Header, ready);
        bytes[at..at + 4].copy_from_slice(&READY.to_ne_bytes());
        bytes
    }

    #[test]
    fn a_complete_header_has_no_problem_and_names_its_creator() {
        let bytes = valid_header(8192);
        assert_eq!(header_problem(&bytes, 8192), None);
        assert_eq!(read_creator(&bytes), Some(ProcessIdentity::new(42, 7)));
    }

    #[test]
    fn a_file_shorter_than_its_declared_size_is_truncated() {
        let bytes = valid_header(8192);
        assert_eq!(
            header_problem(&bytes, 4096),
            Some(HeaderProblem::Truncated { len: 4096, expected: 8192 })
        );
        assert_eq!(
            header_problem(&bytes[..100], 100),
            Some(HeaderProblem::Truncated { len: 100, expected: size_of::<Header>() as u64 })
        );
    }

    #[test]
    fn each_header_word_is_checked_in_order() {
        let mut bytes = valid_header(4096);
        let at = offset_of!(Header, ready);
        bytes[at] ^= 1;
        assert_eq!(header_problem(&bytes, 4096), Some(HeaderProblem::NeverReady));
        bytes[offset_of!(HeaderFields, layout_version)] = 99;
        assert_eq!(
            header_problem(&bytes, 4096),
            Some(HeaderProblem::VersionMismatch { found: 99, expected: LAYOUT_VERSION })
        );
        bytes[0] ^= 0xff;
        assert_eq!(header_problem(&bytes, 4096), Some(HeaderProblem::NoMagic));
    }

    #[test]
    fn a_zero_creator_word_names_no_creator() {
        let bytes = vec![0u8; size_of::<Header>()];
        assert_eq!(read_creator(&bytes), None);
        assert_eq!(read_creator(&bytes[..80]), None);
    }
}
