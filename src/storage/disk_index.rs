//! The disk back-end's persisted index: one file per rank next to its slab, naming the block each
//! slab slot holds, so that a restarted worker (and a restarted scheduler) finds its records.
//!
//! Core types: [`IndexHeader`], [`SlotRecord`], [`IndexFile`] (the locked, open index of one
//! rank), [`IndexedBlock`] and the read-only entry points for the scheduler, [`read_index`] and
//! [`blocks_on_every_rank`].
//!
//! File layout (`DIR/NAMESPACE/rank-R.index`, all integers little-endian):
//!
//! ```text
//! 0      IndexHeader (128 bytes; the rest of the first 4096 is zero)
//! 4096   SlotRecord x capacity (64 bytes each): record i describes slab slot i
//! ```
//!
//! A [`SlotRecord`] is all zero when its slot is empty. A valid one holds the block's hash, its
//! parent's hash and its depth (what a tree needs to put the block back under its parent), the
//! write's sequence number (the slab's recency order after a restart), the checksum of the
//! slot's bytes, and a check word over the record seeded with the slot number, so that a torn or
//! misplaced record never reads as valid.
//!
//! Crash rules (the writer is [`super::disk`]): a slot's record is zeroed before its bytes are
//! overwritten and written only after they are complete, and every read verifies the bytes
//! against the record's checksum, which is seeded with the hash, rank and sequence. A process
//! killed at any point therefore leaves each slot empty, holding its old block, or holding its
//! new block; a record whose bytes did not all land fails its checksum and reads as a miss. No
//! fsync orders these writes: a killed process's completed writes are all in the page cache or
//! on the device. After a power loss a record may land without its bytes or the reverse; the
//! checksum catches both (see `docs/STORAGE.md`).
//!
//! Opening ([`IndexFile::open`]): 1. open or create the file and take its lock; 2. a file whose
//! header is zero or torn (a creation that did not finish) is (re)initialised by the caller;
//! a header with another magic is refused (not our file), one with another layout or rank too;
//! 3. read every record, keeping the valid ones and reporting the torn ones.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use bytemuck::{Pod, Zeroable};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::backend::BlockLayout;
use super::direct_io::{lock_exclusive, preallocate};
use super::format::{join_hash, split_hash, LayoutTag};
use crate::hash::BlockHash;

/// "KVSHMIDX", little-endian.
pub const INDEX_MAGIC: u64 = u64::from_le_bytes(*b"KVSHMIDX");
pub const INDEX_VERSION: u32 = 1;
/// Where the first slot record starts.
pub const RECORDS_OFFSET: u64 = 4096;

/// Whether `path` names `file` now (the same inode on the same device).
pub(crate) fn names_file(path: &Path, file: &File) -> std::io::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let open = file.metadata()?;
    match std::fs::metadata(path) {
        Ok(named) => Ok(named.dev() == open.dev() && named.ino() == open.ino()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(error) => Err(error),
    }
}

/// The length of an index of `capacity` records.
pub fn index_bytes(capacity: u64) -> u64 {
    RECORDS_OFFSET + capacity * size_of::<SlotRecord>() as u64
}
/// The `state` of a valid record ("REC1").
const VALID: u32 = u32::from_le_bytes(*b"REC1");

/// The first bytes of an index file.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct IndexHeader {
    pub magic: u64,
    pub version: u32,
    pub rank: u32,
    pub layout: LayoutTag,
    /// Bytes between the starts of two slab slots (`block_bytes` rounded up to the I/O alignment).
    pub slot_bytes: u64,
    /// Slots of the slab (and records of this file).
    pub capacity: u64,
    pub reserved: [u64; 9],
    /// XXH3-64 of the bytes before it.
    pub check: u64,
}

const _: () = assert!(size_of::<IndexHeader>() == 128);

impl IndexHeader {
    pub fn new(rank: u32, layout: &BlockLayout, slot_bytes: u64, capacity: u64) -> IndexHeader {
        let mut header = IndexHeader {
            magic: INDEX_MAGIC,
            version: INDEX_VERSION,
            rank,
            layout: LayoutTag::of(layout),
            slot_bytes,
            capacity,
            reserved: [0; 9],
            check: 0,
        };
        header.check = header.compute_check();
        header
    }

    fn compute_check(&self) -> u64 {
        xxh3_64(&bytemuck::bytes_of(self)[..size_of::<IndexHeader>() - 8])
    }

    /// The layout recorded, if it describes one.
    pub fn layout(&self) -> Option<BlockLayout> {
        self.layout.layout()
    }

    fn with_capacity(mut self, capacity: u64) -> IndexHeader {
        self.capacity = capacity;
        self.check = self.compute_check();
        self
    }
}

/// What the first bytes of an index file turned out to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeaderState {
    /// Empty or all zero: a new file, or a creation that did not get to its header.
    Uninitialised,
    /// Our magic, but cut short or with a check word that does not match (a torn header
    /// write at creation).
    Torn,
    /// Someone else's file.
    Foreign,
    /// A complete header of this version.
    Valid(IndexHeader),
    /// A complete header of another version.
    OtherVersion(u32),
}

/// Judges the first bytes of an index file.
pub fn judge_header(bytes: &[u8]) -> HeaderState {
    if bytes.iter().all(|&b| b == 0) {
        return HeaderState::Uninitialised;
    }
    if bytes.len() < size_of::<IndexHeader>() {
        // A header cut short is ours only if it starts like one.
        let magic = INDEX_MAGIC.to_le_bytes();
        let common = bytes.len().min(magic.len());
        return if bytes[..common] == magic[..common] {
            HeaderState::Torn
        } else {
            HeaderState::Foreign
        };
    }
    let header: IndexHeader = bytemuck::pod_read_unaligned(&bytes[..size_of::<IndexHeader>()]);
    if header.magic != INDEX_MAGIC {
        return HeaderState::Foreign;
    }
    if header.check != header.compute_check() {
        return HeaderState::Torn;
    }
    if header.version != INDEX_VERSION {
        return HeaderState::OtherVersion(header.version);
    }
    HeaderState::Valid(header)
}

/// One slot's record (module documentation). All zero: the slot is empty.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct SlotRecord {
    pub state: u32,
    pub depth: u32,
    pub hash: [u64; 2],
    pub parent: [u64; 2],
    pub sequence: u64,
    /// [`super::format::payload_checksum`] of the slot's `block_bytes`.
    pub checksum: u64,
    /// XXH3-64 of the 56 bytes before it, seeded with the slot number.
    pub check: u64,
}

const _: () = assert!(size_of::<SlotRecord>() == 64);

/// What a slot record says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordState {
    Empty,
    Valid,
    /// Neither empty nor valid: torn, misplaced or scribbled; the slot is treated as empty.
    Damaged,
}

impl SlotRecord {
    pub const EMPTY: SlotRecord = SlotRecord {
        state: 0,
        depth: 0,
        hash: [0; 2],
        parent: [0; 2],
        sequence: 0,
        checksum: 0,
        check: 0,
    };

    pub fn valid(
        slot: u32,
        hash: BlockHash,
        parent: BlockHash,
        depth: u32,
        sequence: u64,
        checksum: u64,
    ) -> SlotRecord {
        let mut record = SlotRecord {
            state: VALID,
            depth,
            hash: split_hash(hash),
            parent: split_hash(parent),
            sequence,
            checksum,
            check: 0,
        };
        record.check = record.compute_check(slot);
        record
    }

    fn compute_check(&self, slot: u32) -> u64 {
        xxh3_64_with_seed(&bytemuck::bytes_of(self)[..56], u64::from(slot))
    }

    /// Judges the record read for `slot`.
    pub fn state(&self, slot: u32) -> RecordState {
        if *self == SlotRecord::EMPTY {
            RecordState::Empty
        } else if self.state == VALID && self.check == self.compute_check(slot) {
            RecordState::Valid
        } else {
            RecordState::Damaged
        }
    }

    pub fn hash(&self) -> BlockHash {
        join_hash(self.hash)
    }

    pub fn parent(&self) -> BlockHash {
        join_hash(self.parent)
    }
}

/// Why an index cannot be opened or read.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path} is locked by another process (another worker serves this rank and namespace)")]
    Busy { path: PathBuf },
    #[error("{path} is not a kvshm storage index (unknown magic); refusing to overwrite it")]
    Foreign { path: PathBuf },
    #[error("{path} has index format version {found}; this build reads version {INDEX_VERSION}")]
    OtherVersion { path: PathBuf, found: u32 },
    #[error("{path} holds records of rank {found}, not rank {expected}")]
    RankMismatch { path: PathBuf, found: u32, expected: u32 },
    #[error(
        "{path} holds blocks of another layout ({found}) than this service ({expected}); use \
         another storage namespace or remove the files"
    )]
    LayoutMismatch { path: PathBuf, found: String, expected: BlockLayout },
    #[error("{path} has no index yet (never written, or its creation did not finish)")]
    NotInitialised { path: PathBuf },
}

/// The index file of one rank, open and locked.
#[derive(Debug)]
pub struct IndexFile {
    file: File,
    path: PathBuf,
}

/// What [`IndexFile::open`] found.
#[derive(Debug)]
pub enum Opened {
    /// A complete header; the caller checks it against its layout.
    Existing(IndexHeader),
    /// Nothing usable: the caller initialises the slab and then the header.
    Fresh,
}

impl IndexFile {
    /// Opens or creates the index at `path` and takes its lock (module documentation, steps 1
    /// and 2).
    pub fn open(path: &Path) -> Result<(IndexFile, Opened), IndexError> {
        let io = |source| IndexError::Io { path: path.to_owned(), source };
        let file = loop {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(path)
                .map_err(io)?;
            if !lock_exclusive(&file).map_err(io)? {
                return Err(IndexError::Busy { path: path.to_owned() });
            }
            // The lock is of the file opened: one that `kvctl reset-storage` removed while this
            // waited for its lock is no index any more, and the path is opened again.
            if names_file(path, &file).map_err(io)? {
                break file;
            }
        };
        let mut head = [0u8; size_of::<IndexHeader>()];
        let read = read_up_to(&file, &mut head, 0).map_err(io)?;
        let opened = match judge_header(&head[..read]) {
            HeaderState::Uninitialised | HeaderState::Torn => Opened::Fresh,
            HeaderState::Foreign => return Err(IndexError::Foreign { path: path.to_owned() }),
            HeaderState::OtherVersion(found) => {
                return Err(IndexError::OtherVersion { path: path.to_owned(), found })
            }
            HeaderState::Valid(header) => Opened::Existing(header),
        };
        Ok((IndexFile { file, path: path.to_owned() }, opened))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sizes the file for `capacity` records (new records read as empty) and writes `header`.
    /// The records are preallocated, as the slab is: a full file system shows here, not in the
    /// first write of a record.
    pub fn initialise(&self, header: &IndexHeader) -> std::io::Result<()> {
        self.file.set_len(0)?;
        self.preallocate(header.capacity)?;
        self.file.write_all_at(bytemuck::bytes_of(header), 0)?;
        self.file.sync_all()
    }

    /// Changes the number of records to `capacity` (records beyond it are cut off, new ones are
    /// empty and preallocated) and rewrites the header.
    pub fn resize(&self, header: &IndexHeader, capacity: u64) -> std::io::Result<IndexHeader> {
        let header = header.with_capacity(capacity);
        self.file.set_len(index_bytes(capacity))?;
        self.preallocate(capacity)?;
        self.file.write_all_at(bytemuck::bytes_of(&header), 0)?;
        self.file.sync_all()?;
        Ok(header)
    }

    /// Takes the disk space of `capacity` records (an index made sparse, by a kvshm of before
    /// [`IndexFile::initialise`] preallocated, takes it at its next open).
    pub fn preallocate(&self, capacity: u64) -> std::io::Result<()> {
        preallocate(&self.file, index_bytes(capacity))
    }

    /// Reads the records of slots `0..capacity`.
    pub fn read_records(&self, capacity: u64) -> std::io::Result<Vec<SlotRecord>> {
        read_records(&self.file, capacity)
    }

    /// Writes `records` for the consecutive slots starting at `first`.
    pub fn write_records(&self, first: u32, records: &[SlotRecord]) -> std::io::Result<()> {
        self.file.write_all_at(bytemuck::cast_slice(records), record_offset(first))
    }

    /// fdatasync of the index.
    pub fn sync(&self) -> std::io::Result<()> {
        self.file.sync_data()
    }
}

fn record_offset(slot: u32) -> u64 {
    RECORDS_OFFSET + u64::from(slot) * size_of::<SlotRecord>() as u64
}

fn read_records(file: &File, capacity: u64) -> std::io::Result<Vec<SlotRecord>> {
    let count =
        usize::try_from(capacity).map_err(|_| std::io::Error::from_raw_os_error(libc::EFBIG))?;
    let mut records = vec![SlotRecord::EMPTY; count];
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut records);
    let read = read_up_to(file, bytes, RECORDS_OFFSET)?;
    // A file cut short (a resize that did not finish) reads as empty records beyond its end.
    bytes[read..].fill(0);
    Ok(records)
}

/// Reads as much of `buf` as the file holds from `offset`.
fn read_up_to(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(read) => done += read,
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(done)
}

/// The index file of `rank` under a namespace directory.
pub fn index_path(namespace_dir: &Path, rank: u32) -> PathBuf {
    namespace_dir.join(format!("rank-{rank}.index"))
}

/// The slab file of `rank` under a namespace directory.
pub fn slab_path(namespace_dir: &Path, rank: u32) -> PathBuf {
    namespace_dir.join(format!("rank-{rank}.slab"))
}

/// One block an index holds, as a scheduler rebuilding its tree needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct IndexedBlock {
    pub hash: BlockHash,
    pub parent: BlockHash,
    pub depth: u32,
    /// Larger is more recently written.
    pub sequence: u64,
}

/// Reads the valid records of `rank`'s index under `namespace_dir` without locking it (a worker
/// may be writing: a record caught mid-write reads as damaged and is skipped; a listed block
/// whose bytes are damaged is a miss when loaded). The layout must match.
pub fn read_index(
    namespace_dir: &Path,
    rank: u32,
    layout: &BlockLayout,
) -> Result<Vec<IndexedBlock>, IndexError> {
    let path = index_path(namespace_dir, rank);
    let io = |source| IndexError::Io { path: path.clone(), source };
    let file = File::open(&path).map_err(io)?;
    let mut head = [0u8; size_of::<IndexHeader>()];
    let read = read_up_to(&file, &mut head, 0).map_err(io)?;
    let header = match judge_header(&head[..read]) {
        HeaderState::Valid(header) => header,
        HeaderState::Foreign => return Err(IndexError::Foreign { path }),
        HeaderState::OtherVersion(found) => return Err(IndexError::OtherVersion { path, found }),
        HeaderState::Uninitialised | HeaderState::Torn => {
            return Err(IndexError::NotInitialised { path })
        }
    };
    check_header(&header, &path, rank, layout)?;
    // Only the records the file holds: slots past its end are empty (a resize cut short), and a
    // header naming more than that (written by no worker) allocates no more than the file.
    let in_file = file.metadata().map_err(io)?.len().saturating_sub(RECORDS_OFFSET)
        / size_of::<SlotRecord>() as u64;
    let records = read_records(&file, header.capacity.min(in_file)).map_err(io)?;
    Ok(records
        .iter()
        .enumerate()
        .filter(|(slot, record)| record.state(*slot as u32) == RecordState::Valid)
        .map(|(_, record)| IndexedBlock {
            hash: record.hash(),
            parent: record.parent(),
            depth: record.depth,
            sequence: record.sequence,
        })
        .collect())
}

/// Checks that a valid header belongs to `rank` and `layout`.
pub fn check_header(
    header: &IndexHeader,
    path: &Path,
    rank: u32,
    layout: &BlockLayout,
) -> Result<(), IndexError> {
    if header.rank != rank {
        return Err(IndexError::RankMismatch {
            path: path.to_owned(),
            found: header.rank,
            expected: rank,
        });
    }
    if header.layout() != Some(*layout) {
        let found = header.layout.to_string();
        return Err(IndexError::LayoutMismatch { path: path.to_owned(), found, expected: *layout });
    }
    Ok(())
}

/// The blocks that every one of `tp_size` ranks holds under `namespace_dir` (a block is usable
/// only when all ranks have their part), ordered by depth, so that inserting them in order always
/// finds a block's parent already inserted when it is there at all. A block whose parent is not
/// in the list (and is not a first block) can only be reached once its parent is cached again.
pub fn blocks_on_every_rank(
    namespace_dir: &Path,
    layout: &BlockLayout,
) -> Result<Vec<IndexedBlock>, IndexError> {
    let mut common: Option<std::collections::HashMap<BlockHash, IndexedBlock>> = None;
    for rank in 0..layout.tp_size {
        let blocks = read_index(namespace_dir, rank, layout)?;
        common = Some(match common {
            None => blocks.into_iter().map(|block| (block.hash, block)).collect(),
            Some(mut kept) => {
                let here: std::collections::HashMap<BlockHash, IndexedBlock> =
                    blocks.into_iter().map(|block| (block.hash, block)).collect();
                kept.retain(|hash, block| match here.get(hash) {
                    Some(other) => {
                        // Recency of the whole block: its least recent part.
                        block.sequence = block.sequence.min(other.sequence);
                        true
                    }
                    None => false,
                });
                kept
            }
        });
    }
    let mut blocks: Vec<IndexedBlock> = common.unwrap_or_default().into_values().collect();
    blocks.sort_by_key(|block| (block.depth, block.hash));
    Ok(blocks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_valid_only_in_their_own_slot_and_whole() {
        let record = SlotRecord::valid(7, BlockHash(11), BlockHash(10), 3, 42, 0xfeed);
        assert_eq!(record.state(7), RecordState::Valid);
        assert_eq!(record.state(8), RecordState::Damaged);
        assert_eq!(SlotRecord::EMPTY.state(7), RecordState::Empty);
        let mut torn = record;
        torn.checksum ^= 1;
        assert_eq!(torn.state(7), RecordState::Damaged);
        assert_eq!(
            (record.hash(), record.parent(), record.depth),
            (BlockHash(11), BlockHash(10), 3)
        );
    }

    #[test]
    fn headers_are_told_apart_from_zeros_tears_and_strangers() {
        let layout = BlockLayout::new(8192, 2, 1).unwrap();
        let header = IndexHeader::new(0, &layout, 8192, 10);
        let bytes = bytemuck::bytes_of(&header).to_vec();
        assert_eq!(judge_header(&bytes), HeaderState::Valid(header));
        assert_eq!(judge_header(&[0; 128]), HeaderState::Uninitialised);
        assert_eq!(judge_header(&[]), HeaderState::Uninitialised);
        assert_eq!(judge_header(&bytes[..64]), HeaderState::Torn);
        assert_eq!(judge_header(b"somebody's short file"), HeaderState::Foreign);
        let mut torn = bytes.clone();
        torn[40] ^= 1;
        assert_eq!(judge_header(&torn), HeaderState::Torn);
        let mut foreign = bytes.clone();
        foreign[0] = b'#';
        assert_eq!(judge_header(&foreign), HeaderState::Foreign);
        assert_eq!(header.layout(), Some(layout));
    }

    /// A valid header whose capacity the file does not hold (no worker wrote it; a crafted or
    /// damaged index) costs no more memory than the file: the listing reads what is there.
    #[test]
    fn a_header_naming_more_slots_than_the_file_holds_reads_only_the_file() {
        let dir = std::env::temp_dir().join(format!("kvshm-index-cap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let layout = BlockLayout::new(8192, 1, 1).unwrap();
        let (index, _) = IndexFile::open(&index_path(&dir, 0)).unwrap();
        index.initialise(&IndexHeader::new(0, &layout, 8192, 4)).unwrap();
        let record = SlotRecord::valid(2, BlockHash(7), BlockHash(6), 1, 9, 0);
        index.write_records(2, &[record]).unwrap();
        let huge = IndexHeader::new(0, &layout, 8192, 4).with_capacity(u64::MAX / 64);
        index.file.write_all_at(bytemuck::bytes_of(&huge), 0).unwrap();
        let blocks = read_index(&dir, 0, &layout).unwrap();
        assert_eq!(blocks.iter().map(|block| block.hash).collect::<Vec<_>>(), [BlockHash(7)]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
