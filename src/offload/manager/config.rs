//! What an [`OffloadManager`](super::OffloadManager) is built from ([`OffloadConfig`], its
//! [`EvictionOrder`]) and why it refuses a build or an operation ([`OffloadError`]).

use serde::Serialize;

use crate::offload::key::{KeyLayout, KeyTooLong, OffloadKey};
use crate::pool::TooManyBlocks;

/// How evictions choose among loadable, unpinned keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictionOrder {
    /// Least recently used among keys without cached children: a prefix loses its tail first and
    /// never keeps a tail it can no longer reach.
    #[default]
    LeafFirst,
    /// Least recently used among all keys, as vLLM's own LRU policy.
    Flat,
}

/// The sizes and rules of one manager.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OffloadConfig {
    /// Chunks of the host tier.
    pub chunks: u32,
    pub layout: KeyLayout,
    pub order: EvictionOrder,
    /// Keep stored and removed keys for `take_events`.
    pub events: bool,
}

impl OffloadConfig {
    pub fn new(chunks: u32) -> OffloadConfig {
        OffloadConfig {
            chunks,
            layout: KeyLayout::default(),
            order: EvictionOrder::LeafFirst,
            events: false,
        }
    }
}

/// Longest chain tag a layout may name.
pub const MAX_TAG_BYTES: usize = 8;

/// Why a manager cannot be built, or an operation was refused. Nothing changed in either case.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OffloadError {
    #[error(transparent)]
    KeyTooLong(#[from] KeyTooLong),
    #[error(transparent)]
    TooManyChunks(#[from] TooManyBlocks),
    #[error("a chain tag of {tag_bytes} bytes is longer than the {MAX_TAG_BYTES} allowed")]
    TagTooLong { tag_bytes: usize },
    #[error("{key:?} is not in the host tier")]
    UnknownKey { key: OffloadKey },
    #[error("{key:?} is still being stored and cannot be loaded yet")]
    NotReady { key: OffloadKey },
    #[error("{key:?} has no load in progress to complete")]
    NotPinned { key: OffloadKey },
    #[error("{key:?} is in the host tier already")]
    AlreadyCached { key: OffloadKey },
    #[error("chunk {chunk} is outside the tier or holds a key already")]
    ChunkTaken { chunk: u32 },
    #[error("{given} positions given for the {keys} keys request {request:?} presented")]
    PositionCount { request: String, given: usize, keys: usize },
}
