//! Segment names and the shared-memory object names derived from them.
//!
//! A segment called `NAME` is a family of POSIX shared-memory objects under `/dev/shm`, all starting
//! with [`OBJECT_PREFIX`]:
//!
//! - `/kvshm.NAME`            the control segment (header, rings, counters), or a shared
//!   tier's control object (`tier_control`),
//! - `/kvshm.NAME.dev.RANK`   the device arena of a rank (host backend only),
//! - `/kvshm.NAME.host.RANK`  the host tier of a rank.
//!
//! Names are `[A-Za-z0-9_-]{1,64}`: no dot and no slash, so an object name parses back into exactly
//! one (segment, kind) pair ([`ObjectName::parse`]), which is how listing and cleanup find every
//! object of a segment.
//!
//! Flow of one name: 1. [`SegmentName::new`] validates user input; 2. the `*_object` methods build
//! the object names that `shm` opens; 3. `ObjectName::parse` maps a `/dev/shm` entry back.

use std::fmt;

use thiserror::Error;

/// Every object kvshm creates starts with this (after the leading slash).
pub const OBJECT_PREFIX: &str = "kvshm.";

/// The longest segment name accepted.
pub const MAX_NAME_LEN: usize = 64;

/// Why a string is not a segment name.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum NameError {
    #[error("segment name is empty")]
    Empty,
    #[error("segment name is {len} bytes long, the limit is {max}")]
    TooLong { len: usize, max: usize },
    #[error(
        "segment name has {ch:?} at byte {position}; only A-Z, a-z, 0-9, '_' and '-' are allowed"
    )]
    InvalidChar { ch: char, position: usize },
}

/// A validated segment name (`[A-Za-z0-9_-]{1,64}`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SegmentName(String);

impl SegmentName {
    /// Validates `name`.
    pub fn new(name: &str) -> Result<SegmentName, NameError> {
        if name.is_empty() {
            return Err(NameError::Empty);
        }
        if let Some((position, ch)) = name
            .char_indices()
            .find(|&(_, ch)| !(ch.is_ascii_alphanumeric() || ch == '_' || ch == '-'))
        {
            return Err(NameError::InvalidChar { ch, position });
        }
        if name.len() > MAX_NAME_LEN {
            return Err(NameError::TooLong { len: name.len(), max: MAX_NAME_LEN });
        }
        Ok(SegmentName(name.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `/kvshm.NAME`: the control segment.
    pub fn control_object(&self) -> String {
        format!("/{OBJECT_PREFIX}{}", self.0)
    }

    /// `/kvshm.NAME.dev.RANK`: the device arena of `rank` on the host backend.
    pub fn device_arena_object(&self, rank: u32) -> String {
        format!("/{OBJECT_PREFIX}{}.dev.{rank}", self.0)
    }

    /// `/kvshm.NAME.host.RANK`: the host tier of `rank`.
    pub fn host_tier_object(&self, rank: u32) -> String {
        format!("/{OBJECT_PREFIX}{}.host.{rank}", self.0)
    }

    /// `/kvshm.NAME.keys.RANK`: the key table of a shared host tier (rank 0: one for the tier).
    pub fn tier_keys_object(&self, rank: u32) -> String {
        format!("/{OBJECT_PREFIX}{}.keys.{rank}", self.0)
    }
}

impl fmt::Display for SegmentName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a kvshm object is, by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ObjectKind {
    Control,
    DeviceArena { rank: u32 },
    HostTier { rank: u32 },
    TierKeys { rank: u32 },
}

/// A `/dev/shm` entry that belongs to kvshm, parsed back into its segment and kind.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ObjectName {
    pub segment: SegmentName,
    pub kind: ObjectKind,
}

impl ObjectName {
    /// Parses a file name as listed in `/dev/shm` (no leading slash) or an object name (with one).
    /// Returns `None` for anything that is not exactly a name this module builds.
    pub fn parse(file_name: &str) -> Option<ObjectName> {
        let rest = file_name.strip_prefix('/').unwrap_or(file_name).strip_prefix(OBJECT_PREFIX)?;
        let mut parts = rest.split('.');
        let segment = SegmentName::new(parts.next()?).ok()?;
        let kind = match (parts.next(), parts.next(), parts.next()) {
            (None, _, _) => ObjectKind::Control,
            (Some(kind), Some(rank), None) => {
                // Only the canonical decimal spelling, so that parse(build(x)) is a bijection.
                let rank_value: u32 = rank.parse().ok()?;
                if rank_value.to_string() != rank {
                    return None;
                }
                match kind {
                    "dev" => ObjectKind::DeviceArena { rank: rank_value },
                    "host" => ObjectKind::HostTier { rank: rank_value },
                    "keys" => ObjectKind::TierKeys { rank: rank_value },
                    _ => return None,
                }
            }
            _ => return None,
        };
        Some(ObjectName { segment, kind })
    }

    /// The object name (with the leading slash) this parses from.
    pub fn object(&self) -> String {
        match self.kind {
            ObjectKind::Control => self.segment.control_object(),
            ObjectKind::DeviceArena { rank } => self.segment.device_arena_object(rank),
            ObjectKind::HostTier { rank } => self.segment.host_tier_object(rank),
            ObjectKind::TierKeys { rank } => self.segment.tier_keys_object(rank),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_letters_digits_underscore_and_dash() {
        let name = SegmentName::new("Llama-3_70b").unwrap();
        assert_eq!(name.control_object(), "/kvshm.Llama-3_70b");
        assert_eq!(name.device_arena_object(2), "/kvshm.Llama-3_70b.dev.2");
        assert_eq!(name.host_tier_object(7), "/kvshm.Llama-3_70b.host.7");
    }

    #[test]
    fn rejects_empty_names() {
        assert_eq!(SegmentName::new(""), Err(NameError::Empty));
    }

    #[test]
    fn rejects_names_with_a_slash_or_a_dot() {
        assert_eq!(SegmentName::new("a/b"), Err(NameError::InvalidChar { ch: '/', position: 1 }));
        assert_eq!(SegmentName::new("a.b"), Err(NameError::InvalidChar { ch: '.', position: 1 }));
        assert!(matches!(
            SegmentName::new("é"),
            Err(NameError::InvalidChar { ch: 'é', position: 0 })
        ));
    }

    #[test]
    fn rejects_names_longer_than_64_bytes() {
        assert!(SegmentName::new(&"x".repeat(64)).is_ok());
        assert_eq!(SegmentName::new(&"x".repeat(65)), Err(NameError::TooLong { len: 65, max: 64 }));
    }

    #[test]
    fn object_names_parse_back_to_their_segment_and_kind() {
        let name = SegmentName::new("seg-1").unwrap();
        for object in [
            name.control_object(),
            name.device_arena_object(3),
            name.host_tier_object(0),
            name.tier_keys_object(0),
        ] {
            let parsed = ObjectName::parse(&object).unwrap();
            assert_eq!(parsed.segment, name);
            assert_eq!(parsed.object(), object);
        }
        assert_eq!(
            ObjectName::parse("kvshm.seg-1.host.4").unwrap().kind,
            ObjectKind::HostTier { rank: 4 }
        );
    }

    #[test]
    fn foreign_and_malformed_object_names_do_not_parse() {
        for file in [
            "other",
            "kvshm.",
            "kvshm.a.dev",
            "kvshm.a.dev.x",
            "kvshm.a.dev.01",
            "kvshm.a.gpu.1",
            "kvshm.a.dev.1.2",
        ] {
            assert_eq!(ObjectName::parse(file), None, "{file}");
        }
    }
}
