//! Data segments: the per-rank block arenas of the host backend's device tier and of the host tier.
//!
//! Each arena is its own shared-memory object (`/kvshm.NAME.dev.RANK`, `/kvshm.NAME.host.RANK`),
//! created by the segment's creator so that the host tier outlives any worker. It starts with a
//! small [`ArenaHeader`] (magic, version, kind, rank, block count, bytes per block, data offset) and
//! the blocks follow at a page-aligned offset, so that the CUDA worker can register the data with
//! `cuMemHostRegister`. Blocks are block-major: block `b` is `block_bytes` at `b * block_bytes`.
//!
//! Flow: 1. [`Arena::create`] sizes and backs the object (a full `/dev/shm` fails here), writes the
//! header; 2. a worker calls [`Arena::open`], which validates the header against the name it opened
//! and the file size before handing out [`Arena::data_ptr`].

use bytemuck::{Pod, Zeroable};
use thiserror::Error;

use crate::inspect::ObjectIdentity;
use crate::liveness::ProcessIdentity;
use crate::name::SegmentName;
use crate::shm::{self, SharedMemory, ShmError};

/// "KVSHMARN", little-endian.
pub const ARENA_MAGIC: u64 = u64::from_le_bytes(*b"KVSHMARN");
pub const ARENA_VERSION: u32 = 1;
/// Offset of the first block: one page, so the data is page-aligned.
pub const ARENA_DATA_OFFSET: u64 = 4096;

/// Which tier an arena holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ArenaKind {
    /// The device tier of the host backend.
    Device,
    /// The host tier.
    Host,
    /// The key table of a shared host tier (what each chunk holds, for the tier's next owner).
    Keys,
}

impl ArenaKind {
    fn to_wire(self) -> u32 {
        match self {
            ArenaKind::Device => 1,
            ArenaKind::Host => 2,
            ArenaKind::Keys => 3,
        }
    }

    /// The object name of this arena of `name` for `rank`.
    pub fn object(self, name: &SegmentName, rank: u32) -> String {
        match self {
            ArenaKind::Device => name.device_arena_object(rank),
            ArenaKind::Host => name.host_tier_object(rank),
            ArenaKind::Keys => name.tier_keys_object(rank),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ArenaKind::Device => "device",
            ArenaKind::Host => "host",
            ArenaKind::Keys => "keys",
        }
    }
}

/// The header at offset 0 of an arena.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct ArenaHeader {
    pub magic: u64,
    pub version: u32,
    pub kind: u32,
    pub rank: u32,
    pub reserved0: u32,
    pub blocks: u64,
    pub block_bytes: u64,
    pub data_offset: u64,
    pub data_len: u64,
    pub creator: ProcessIdentity,
    pub reserved: [u64; 2],
}

const _: () = assert!(size_of::<ArenaHeader>() == 88);

/// Why an arena cannot be created or opened.
#[derive(Debug, Error)]
pub enum ArenaError {
    #[error(transparent)]
    Shm(#[from] ShmError),
    #[error("a {kind} arena of {blocks} blocks x {block_bytes} bytes does not fit in memory")]
    TooLarge { kind: &'static str, blocks: u64, block_bytes: u64 },
    #[error("arena object is {len} bytes, its header needs {expected}")]
    Truncated { len: u64, expected: u64 },
    #[error("arena object does not start with the kvshm arena magic")]
    BadMagic,
    #[error("arena layout version {found}, expected {expected}")]
    VersionMismatch { found: u32, expected: u32 },
    #[error("arena header says kind {found_kind} rank {found_rank}, expected kind {expected_kind} rank {expected_rank}")]
    WrongArena { found_kind: u32, found_rank: u32, expected_kind: u32, expected_rank: u32 },
    #[error("arena header is inconsistent: {0}")]
    Corrupt(&'static str),
    #[error("{len} bytes at offset {offset} lie beyond the arena's {data_len} data bytes")]
    OutOfBounds { offset: usize, len: usize, data_len: usize },
}

/// A mapped arena.
#[derive(Debug)]
pub struct Arena {
    memory: SharedMemory,
    header: ArenaHeader,
}

impl Arena {
    /// Creates the `kind` arena of `rank` for segment `name`: `blocks` blocks of `block_bytes`.
    pub fn create(
        name: &SegmentName,
        kind: ArenaKind,
        rank: u32,
        blocks: u64,
        block_bytes: u64,
    ) -> Result<Arena, ArenaError> {
        let too_large = || ArenaError::TooLarge { kind: kind.name(), blocks, block_bytes };
        let data_len = blocks.checked_mul(block_bytes).ok_or_else(too_large)?;
        let total = data_len
            .checked_add(ARENA_DATA_OFFSET)
            .filter(|&total| total <= i64::MAX as u64)
            .and_then(|total| usize::try_from(total).ok())
            .ok_or_else(too_large)?;
        let object = kind.object(name, rank);
        let (memory, huge) = SharedMemory::create_reporting_huge_pages(&object, total)?;
        tracing::info!(
            object,
            bytes = total,
            huge_page_bytes = huge.bytes,
            refused = ?huge.refused.map(|errno| errno.desc()),
            "arena created, in huge pages where the kernel gave them"
        );
        let header = ArenaHeader {
            magic: ARENA_MAGIC,
            version: ARENA_VERSION,
            kind: kind.to_wire(),
            rank,
            reserved0: 0,
            blocks,
            block_bytes,
            data_offset: ARENA_DATA_OFFSET,
            data_len,
            creator: ProcessIdentity::current(),
            reserved: [0; 2],
        };
        // SAFETY: 1. the mapping is at least ARENA_DATA_OFFSET (4096) bytes, more than the header;
        // 2. it is page-aligned, so aligned for ArenaHeader; 3. no race: the object was created
        // with O_EXCL just now, and any other process that opens it before this store copies the
        // header with a volatile read it then validates (a torn copy fails validation).
        unsafe { memory.as_ptr().cast::<ArenaHeader>().write_volatile(header) };
        Ok(Arena { memory, header })
    }

    /// Opens the `kind` arena of `rank` for segment `name` and validates its header.
    pub fn open(name: &SegmentName, kind: ArenaKind, rank: u32) -> Result<Arena, ArenaError> {
        let memory = SharedMemory::open(&kind.object(name, rank))?;
        let header = read_header(&memory)?;
        validate(&header, memory.len() as u64, Some((kind, rank)))?;
        Ok(Arena { memory, header })
    }

    /// Takes over the `kind` arena of `rank` for segment `name` left by a creator that is gone,
    /// bytes and all, if it holds exactly `blocks` blocks of `block_bytes` (its header then names
    /// this process as creator); `Ok(None)` if there is none, and if it is of another shape or
    /// cannot be read (it is removed then: the caller creates a new one).
    pub fn adopt(
        name: &SegmentName,
        kind: ArenaKind,
        rank: u32,
        blocks: u64,
        block_bytes: u64,
    ) -> Result<Option<Arena>, ArenaError> {
        let mut arena = match Arena::open(name, kind, rank) {
            Ok(arena) => arena,
            Err(ArenaError::Shm(ShmError::NotFound { .. })) => return Ok(None),
            Err(_) => {
                shm::unlink(&kind.object(name, rank))?;
                return Ok(None);
            }
        };
        if arena.header.blocks != blocks || arena.header.block_bytes != block_bytes {
            drop(arena);
            shm::unlink(&kind.object(name, rank))?;
            return Ok(None);
        }
        arena.header.creator = ProcessIdentity::current();
        // SAFETY: 1. the mapping holds a validated header at offset 0 (Arena::open), page-aligned;
        // 2. a volatile store of a Pod: the arena's creator is gone, so the only other accesses
        // are volatile copies by tools (kvctl), which validate what they read.
        unsafe { arena.memory.as_ptr().cast::<ArenaHeader>().write_volatile(arena.header) };
        Ok(Some(arena))
    }

    /// Removes the `kind` arena of `rank` for segment `name`.
    pub fn unlink(name: &SegmentName, kind: ArenaKind, rank: u32) -> Result<(), ShmError> {
        shm::unlink(&kind.object(name, rank))
    }

    /// Start of block 0. Valid for [`data_len`](Self::data_len) bytes while `self` lives; other
    /// processes write these bytes, so they are reached through raw pointers only (never a Rust
    /// reference), with copies whose premise is the block-ownership protocol.
    pub fn data_ptr(&self) -> *mut u8 {
        // SAFETY: validate() checked data_offset + data_len <= the mapping's length (or create()
        // made it so); forming the pointer accesses nothing.
        unsafe { self.memory.as_ptr().add(self.header.data_offset as usize) }
    }

    pub fn data_len(&self) -> usize {
        self.header.data_len as usize
    }

    /// Copies `out.len()` data bytes at `offset` into `out`. Every access to the arena is atomic
    /// ([`shared_bytes`](crate::shared_bytes)), so a worker copying the same bytes meanwhile
    /// makes them inconsistent, never this copy undefined.
    pub fn read_data(&self, offset: usize, out: &mut [u8]) -> Result<(), ArenaError> {
        self.check_data_range(offset, out.len())?;
        // SAFETY: offset + out.len() <= data_len (checked above), inside the mapping that `self`
        // keeps alive; `out` is this process's memory, not the arena.
        unsafe { crate::shared_bytes::copy_from_shared(self.data_ptr().add(offset), out) };
        Ok(())
    }

    /// Copies `bytes` into the data at `offset`, with atomic accesses as [`read_data`](Self::read_data).
    pub fn write_data(&self, offset: usize, bytes: &[u8]) -> Result<(), ArenaError> {
        self.check_data_range(offset, bytes.len())?;
        // SAFETY: offset + bytes.len() <= data_len (checked above), inside the mapping that
        // `self` keeps alive; `bytes` is a Rust slice, so it cannot lie in the mapping (no
        // reference into the mapping's bytes is ever handed out).
        unsafe { crate::shared_bytes::copy_to_shared(bytes, self.data_ptr().add(offset)) };
        Ok(())
    }

    fn check_data_range(&self, offset: usize, len: usize) -> Result<(), ArenaError> {
        let data_len = self.data_len();
        match offset.checked_add(len) {
            Some(end) if end <= data_len => Ok(()),
            _ => Err(ArenaError::OutOfBounds { offset, len, data_len }),
        }
    }

    pub fn blocks(&self) -> u64 {
        self.header.blocks
    }

    pub fn block_bytes(&self) -> u64 {
        self.header.block_bytes
    }

    pub fn header(&self) -> &ArenaHeader {
        &self.header
    }

    /// Which file this arena is (its creator removes exactly this file on drop).
    pub fn identity(&self) -> Result<ObjectIdentity, ShmError> {
        self.memory.identity()
    }
}

/// Copies the header out of a mapping (at least one page long or `Truncated`).
pub(crate) fn read_header(memory: &SharedMemory) -> Result<ArenaHeader, ArenaError> {
    if (memory.len() as u64) < ARENA_DATA_OFFSET {
        return Err(ArenaError::Truncated {
            len: memory.len() as u64,
            expected: ARENA_DATA_OFFSET,
        });
    }
    // SAFETY: 1. the mapping is at least 4096 bytes, more than the header; 2. it is page-aligned;
    // 3. a volatile copy of a Pod: any bytes are a value, read once, and validated before use.
    // The creator writes the header once, at creation (trusted peer: another process writing it
    // while it is copied races this read and gets a torn header that validation refuses).
    Ok(unsafe { memory.as_ptr().cast::<ArenaHeader>().read_volatile() })
}

/// Checks a header against the file length and, if given, the expected kind and rank.
pub(crate) fn validate(
    header: &ArenaHeader,
    file_len: u64,
    expected: Option<(ArenaKind, u32)>,
) -> Result<(), ArenaError> {
    if header.magic != ARENA_MAGIC {
        return Err(ArenaError::BadMagic);
    }
    if header.version != ARENA_VERSION {
        return Err(ArenaError::VersionMismatch { found: header.version, expected: ARENA_VERSION });
    }
    if let Some((kind, rank)) = expected {
        if header.kind != kind.to_wire() || header.rank != rank {
            return Err(ArenaError::WrongArena {
                found_kind: header.kind,
                found_rank: header.rank,
                expected_kind: kind.to_wire(),
                expected_rank: rank,
            });
        }
    }
    if header.data_offset < size_of::<ArenaHeader>() as u64
        || header.data_offset % ARENA_DATA_OFFSET != 0
    {
        return Err(ArenaError::Corrupt("data offset is not a page boundary after the header"));
    }
    if header.blocks.checked_mul(header.block_bytes) != Some(header.data_len) {
        return Err(ArenaError::Corrupt("data length is not blocks x block bytes"));
    }
    let end = header
        .data_offset
        .checked_add(header.data_len)
        .ok_or(ArenaError::Corrupt("data end overflows"))?;
    if end > file_len {
        return Err(ArenaError::Truncated { len: file_len, expected: end });
    }
    Ok(())
}
