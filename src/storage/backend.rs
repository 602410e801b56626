//! The interface of a storage back-end: one shard (one rank) of the tier below host.
//!
//! Core types: [`StorageBackend`] (batched put, get, contains, remove and forget with one outcome per
//! block), [`BlockKey`], [`BlockLayout`], the outcomes [`PutOutcome`] and [`GetOutcome`] with
//! their reasons [`Failure`] and [`GetMiss`], and [`BackendStats`].
//!
//! A back-end instance serves one rank of one namespace and one block layout; a block is named by
//! its 128-bit chained hash, which already carries the model, adapter, salt and multimodal keys,
//! so no tenant can name another's block. Every call takes a batch and fills one outcome per
//! block, in order:
//!
//! 1. the caller hands in the blocks (keys and byte slices of exactly `block_bytes`);
//! 2. the back-end does the I/O, batched and pipelined as it can, each block checksummed;
//! 3. each block gets its own outcome: a missing, corrupt or unreadable block is a miss for that
//!    block, a failed write a failure for that block. Nothing fails the batch as a whole, and no
//!    call returns an error: the tier is a cache, and a request never fails because of it.

use std::fmt;

use super::block_bytes::{BlockBytes, BlockBytesMut};
use crate::hash::BlockHash;

/// What names one stored block (the rank is the back-end instance's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockKey {
    /// The block's chained hash.
    pub hash: BlockHash,
    /// The hash of the block before it in its prefix (for the first block: what block 0 chains
    /// to, the namespace hash).
    pub parent: BlockHash,
    /// The block's position in its prefix (0: the first block).
    pub depth: u32,
}

impl BlockKey {
    pub fn new(hash: BlockHash, parent: BlockHash, depth: u32) -> BlockKey {
        BlockKey { hash, parent, depth }
    }
}

/// The shape of the bytes one rank stores per block: stored with every record, so that a record
/// written by a service with another shape is never read as this one's (dtype-independent: bytes
/// are bytes, and a different dtype changes `region_bytes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct BlockLayout {
    /// Bytes of one block on one rank (`regions * region_bytes`).
    pub block_bytes: u64,
    /// Regions per block per rank.
    pub regions: u32,
    /// Tensor-parallel size of the service (ranks shard the heads, so each rank's bytes differ).
    pub tp_size: u32,
}

impl BlockLayout {
    /// A layout; `None` when `block_bytes` is zero or not a multiple of `regions`.
    pub fn new(block_bytes: u64, regions: u32, tp_size: u32) -> Option<BlockLayout> {
        (block_bytes > 0 && regions > 0 && tp_size > 0 && block_bytes % u64::from(regions) == 0)
            .then_some(BlockLayout { block_bytes, regions, tp_size })
    }

    pub fn region_bytes(&self) -> u64 {
        self.block_bytes / u64::from(self.regions)
    }

    /// `block_bytes` as usize.
    ///
    /// # Panics
    ///
    /// If a block does not fit in memory: the host tier that holds such blocks could not exist.
    pub fn block_len(&self) -> usize {
        usize::try_from(self.block_bytes)
            .expect("a block larger than memory is a programming error")
    }

    /// The short form used in Redis keys: `tp2-r64x16384` (TP size, regions x region bytes).
    pub fn key_tag(&self) -> String {
        format!("tp{}-r{}x{}", self.tp_size, self.regions, self.region_bytes())
    }
}

impl fmt::Display for BlockLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} bytes per block ({} regions of {} bytes), TP {}",
            self.block_bytes,
            self.regions,
            self.region_bytes(),
            self.tp_size
        )
    }
}

/// Why the back-end could not do its part for a block: the tier failed, as opposed to the block
/// being absent. Counted per block; never an error for the request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The file system or server is full (ENOSPC, EDQUOT, EFBIG; Redis OOM).
    NoSpace,
    /// The back-end did not answer in time.
    Timeout,
    /// The back-end cannot be reached (Redis down or reconnecting).
    Unavailable,
    /// Any other I/O or protocol error, with what the system said.
    Io(String),
}

impl Failure {
    /// Whether it says the tier could not be reached (no answer in time, a connection refused or
    /// dropped): the tier is failing, not this block, and the block may still be there.
    pub fn is_unreachable(&self) -> bool {
        matches!(self, Failure::Timeout | Failure::Unavailable)
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::NoSpace => f.write_str("no space left"),
            Failure::Timeout => f.write_str("timed out"),
            Failure::Unavailable => f.write_str("unavailable"),
            Failure::Io(what) => write!(f, "i/o error: {what}"),
        }
    }
}

/// Why a get found no usable block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GetMiss {
    /// Not stored (never written, evicted, expired, removed).
    Absent,
    /// Stored, but its checksum, length, key or layout tag is wrong (a torn or damaged record);
    /// the back-end dropped it.
    Corrupt,
    /// The tier failed; the block may still be stored.
    Failed(Failure),
}

/// The outcome of putting one block: `Ok` once its record is complete and indexed.
pub type PutOutcome = Result<(), Failure>;
/// The outcome of getting one block: `Ok` once its bytes are in the destination and verified.
/// On a miss the destination's contents are unspecified.
pub type GetOutcome = Result<(), GetMiss>;
/// Whether a block is stored (its bytes are not checked: a later get may still find it corrupt).
pub type ContainsOutcome = Result<bool, Failure>;

/// One block to put: its key and its bytes (exactly `block_bytes`).
#[derive(Clone, Copy, Debug)]
pub struct PutBlock<'a> {
    pub key: BlockKey,
    pub bytes: BlockBytes<'a>,
}

/// One block to get: its hash and where its bytes go (exactly `block_bytes`).
#[derive(Debug)]
pub struct GetBlock<'a> {
    pub hash: BlockHash,
    pub dest: BlockBytesMut<'a>,
}

/// Figures a back-end keeps that per-block outcomes do not show.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct BackendStats {
    /// Records dropped to make room (the back-end's own LRU).
    pub evictions: u64,
    /// Records held now, where the back-end knows (disk); `None` for a shared server.
    pub used_blocks: Option<u64>,
    /// Records it can hold, where it has its own capacity (disk).
    pub capacity_blocks: Option<u64>,
    /// Connections (re)established (Redis).
    pub connects: u64,
}

/// One rank's shard of the storage tier (module documentation).
///
/// Every method fills `outcomes` with exactly one entry per input block, in input order (it clears
/// the vector first). A block whose slice is not `block_bytes` long is a caller bug; back-ends
/// answer it with `Failure::Io` rather than touching it.
pub trait StorageBackend: Send {
    /// `"disk"` or `"redis"`.
    fn kind(&self) -> &'static str;

    /// Whether other services may write to this back-end's blocks (Redis), so that asking it
    /// which blocks it holds (QUERY) can find blocks the scheduler does not know; a back-end
    /// only this rank writes (the disk slab) answers only what the scheduler adopted at start.
    fn is_shared(&self) -> bool;

    /// The layout every record of this back-end has.
    fn layout(&self) -> BlockLayout;

    /// Stores each block (a block already stored under its hash counts as stored: the hash names
    /// the content).
    fn put(&mut self, blocks: &[PutBlock<'_>], outcomes: &mut Vec<PutOutcome>);

    /// Reads each block into its destination and verifies it.
    fn get(&mut self, blocks: &mut [GetBlock<'_>], outcomes: &mut Vec<GetOutcome>);

    /// Whether each block is stored (metadata only).
    fn contains(&mut self, hashes: &[BlockHash], outcomes: &mut Vec<ContainsOutcome>);

    /// Forgets each block (absent ones too); `Ok` once it can no longer be read.
    fn remove(&mut self, hashes: &[BlockHash], outcomes: &mut Vec<PutOutcome>);

    /// The scheduler that counts this shard dropped these blocks (a FORGET command): a back-end
    /// that owns its room frees them ([`StorageBackend::remove`]: the disk slab, so that its own
    /// LRU never has to drop a block the scheduler still counts); a back-end shared by several
    /// services keeps them, since another service may count them (Redis: its TTL and its
    /// `maxmemory` policy govern what leaves). `Ok` per block once done (or deliberately kept).
    fn forget(&mut self, hashes: &[BlockHash], outcomes: &mut Vec<PutOutcome>);

    /// Makes every record written so far durable across a power loss where the medium allows
    /// (a disk's fdatasync); a no-op for a server that owns its own persistence.
    fn sync(&mut self) -> Result<(), Failure>;

    fn stats(&self) -> BackendStats;
}

/// Checks a slice against the layout's block length.
pub(crate) fn check_len(len: usize, layout: &BlockLayout) -> Result<(), Failure> {
    if len as u64 == layout.block_bytes {
        Ok(())
    } else {
        Err(Failure::Io(format!(
            "a block of {len} bytes where the layout has {}",
            layout.block_bytes
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layout_needs_whole_regions_and_tags_its_keys() {
        assert_eq!(BlockLayout::new(0, 1, 1), None);
        assert_eq!(BlockLayout::new(100, 3, 1), None);
        assert_eq!(BlockLayout::new(4096, 2, 0), None);
        let layout = BlockLayout::new(64 * 16384, 64, 2).unwrap();
        assert_eq!(layout.region_bytes(), 16384);
        assert_eq!(layout.key_tag(), "tp2-r64x16384");
    }
}
