//! The frozen byte formats the storage tier shares between back-ends: the payload checksum and
//! the self-describing value a Redis key holds. (The disk's index records live in
//! [`super::disk_index`].)
//!
//! Core items: [`payload_checksum`], [`ValueHeader`], [`encode_value`], [`check_value`].
//!
//! Records outlive the process and are shared between services, so these formats are versioned
//! and pinned by tests; a change is a new magic. All integers are little-endian.
//!
//! The checksum is XXH3-64 of the block's bytes, seeded with XXH3-64 of (hash, rank, sequence):
//! bytes stored for another block, another rank or another write of the same slot never verify,
//! and a record torn by a crash (new header, old or partial bytes) fails with probability
//! 1 - 2^-64.
//!
//! A Redis value is an 80-byte [`ValueHeader`] followed by the block's bytes:
//!
//! ```text
//! 0   magic "KVSHMRV1"      8   version u32      12  rank u32
//! 16  block_bytes u64       24  regions u32      28  tp_size u32
//! 32  hash (16 bytes)       48  parent (16 bytes)
//! 64  depth u32             68  reserved u32 (0) 72  payload checksum u64 (sequence 0)
//! 80  the block's bytes
//! ```
//!
//! Reading one value ([`check_value`]): 1. the length is header + `block_bytes`; 2. magic and
//! version; 3. hash, rank and layout are the ones asked for; 4. the checksum of the bytes. Any
//! failure is [`Corrupt`] with the reason: a miss, never an error.

use bytemuck::{Pod, Zeroable};
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

use super::backend::{BlockKey, BlockLayout};
use super::block_bytes::BlockBytes;
use crate::hash::BlockHash;

/// "KVSHMRV1", little-endian.
pub const VALUE_MAGIC: u64 = u64::from_le_bytes(*b"KVSHMRV1");
pub const VALUE_VERSION: u32 = 1;
/// Bytes of the header in front of a Redis value's block bytes.
pub const VALUE_HEADER_BYTES: usize = size_of::<ValueHeader>();

/// The checksum of one record's bytes (module documentation), read a chunk at a time.
pub fn payload_checksum(hash: BlockHash, rank: u32, sequence: u64, bytes: BlockBytes<'_>) -> u64 {
    let mut hasher = Xxh3::with_seed(checksum_seed(hash, rank, sequence));
    bytes.chunks(|chunk| hasher.update(chunk));
    hasher.digest()
}

fn checksum_seed(hash: BlockHash, rank: u32, sequence: u64) -> u64 {
    let mut seed_input = [0u8; 28];
    seed_input[..16].copy_from_slice(&hash.0.to_le_bytes());
    seed_input[16..20].copy_from_slice(&rank.to_le_bytes());
    seed_input[20..].copy_from_slice(&sequence.to_le_bytes());
    xxh3_64(&seed_input)
}

pub(crate) fn split_hash(hash: BlockHash) -> [u64; 2] {
    [hash.0 as u64, (hash.0 >> 64) as u64]
}

pub(crate) fn join_hash(words: [u64; 2]) -> BlockHash {
    BlockHash(u128::from(words[0]) | (u128::from(words[1]) << 64))
}

/// A block layout as the record formats store it: block bytes, regions, TP size (16 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct LayoutTag {
    pub block_bytes: u64,
    pub regions: u32,
    pub tp_size: u32,
}

const _: () = assert!(size_of::<LayoutTag>() == 16);

impl LayoutTag {
    pub fn of(layout: &BlockLayout) -> LayoutTag {
        LayoutTag {
            block_bytes: layout.block_bytes,
            regions: layout.regions,
            tp_size: layout.tp_size,
        }
    }

    /// The layout recorded, if it describes one.
    pub fn layout(&self) -> Option<BlockLayout> {
        BlockLayout::new(self.block_bytes, self.regions, self.tp_size)
    }
}

impl std::fmt::Display for LayoutTag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.layout() {
            Some(layout) => layout.fmt(f),
            None => write!(
                f,
                "{} bytes, {} regions, TP {}",
                self.block_bytes, self.regions, self.tp_size
            ),
        }
    }
}

/// The header of a Redis value (module documentation).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct ValueHeader {
    pub magic: u64,
    pub version: u32,
    pub rank: u32,
    pub layout: LayoutTag,
    pub hash: [u64; 2],
    pub parent: [u64; 2],
    pub depth: u32,
    pub reserved: u32,
    pub checksum: u64,
}

const _: () = assert!(size_of::<ValueHeader>() == 80);

/// Writes into `value` (replacing what it held) the Redis value that stores `bytes` as block
/// `key` of `rank`: the header, then the bytes. The block is read once: its checksum is taken
/// from the very chunks copied into the value, and the header written last.
pub fn encode_value(
    key: &BlockKey,
    rank: u32,
    layout: &BlockLayout,
    bytes: BlockBytes<'_>,
    value: &mut Vec<u8>,
) {
    value.clear();
    value.resize(VALUE_HEADER_BYTES, 0);
    value.reserve(bytes.len());
    let mut hasher = Xxh3::with_seed(checksum_seed(key.hash, rank, 0));
    bytes.chunks(|chunk| {
        hasher.update(chunk);
        value.extend_from_slice(chunk);
    });
    let header = ValueHeader {
        magic: VALUE_MAGIC,
        version: VALUE_VERSION,
        rank,
        layout: LayoutTag::of(layout),
        hash: split_hash(key.hash),
        parent: split_hash(key.parent),
        depth: key.depth,
        reserved: 0,
        checksum: hasher.digest(),
    };
    value[..VALUE_HEADER_BYTES].copy_from_slice(bytemuck::bytes_of(&header));
}

/// Why a stored value is not the block asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Corrupt {
    #[error("value of {found} bytes where {expected} were expected")]
    Length { found: usize, expected: usize },
    #[error("bad magic or version")]
    Magic,
    #[error("the value names another block, rank or layout")]
    Identity,
    #[error("checksum mismatch")]
    Checksum,
}

/// Checks a value read for block `hash` of `rank` (module documentation) and returns its bytes.
pub fn check_value<'v>(
    value: &'v [u8],
    hash: BlockHash,
    rank: u32,
    layout: &BlockLayout,
) -> Result<&'v [u8], Corrupt> {
    let expected = VALUE_HEADER_BYTES + layout.block_len();
    if value.len() != expected {
        return Err(Corrupt::Length { found: value.len(), expected });
    }
    let (head, bytes) = value.split_at(VALUE_HEADER_BYTES);
    let header: ValueHeader = bytemuck::pod_read_unaligned(head);
    if header.magic != VALUE_MAGIC || header.version != VALUE_VERSION || header.reserved != 0 {
        return Err(Corrupt::Magic);
    }
    let same_block = header.hash == split_hash(hash) && header.rank == rank;
    let same_layout = header.layout == LayoutTag::of(layout);
    if !(same_block && same_layout) {
        return Err(Corrupt::Identity);
    }
    if payload_checksum(hash, rank, 0, BlockBytes::new(bytes)) != header.checksum {
        return Err(Corrupt::Checksum);
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> BlockLayout {
        BlockLayout::new(256, 4, 2).unwrap()
    }

    fn key() -> BlockKey {
        BlockKey::new(BlockHash(0x0123_4567_89ab_cdef_0011_2233_4455_6677), BlockHash(5), 3)
    }

    fn value(bytes: &[u8]) -> Vec<u8> {
        let mut value = vec![0xAA; 7];
        encode_value(&key(), 1, &layout(), BlockBytes::new(bytes), &mut value);
        value
    }

    #[test]
    fn an_encoded_value_is_its_header_then_the_bytes_and_checks_out_whole() {
        // Longer than one chunk of BlockBytes::chunks, not a multiple of it.
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let mut value = Vec::new();
        encode_value(&key(), 1, &layout(), BlockBytes::new(&bytes), &mut value);
        assert_eq!(value.len(), VALUE_HEADER_BYTES + bytes.len());
        let header: ValueHeader = bytemuck::pod_read_unaligned(&value[..VALUE_HEADER_BYTES]);
        assert_eq!(header.checksum, payload_checksum(key().hash, 1, 0, BlockBytes::new(&bytes)));
        assert_eq!(&value[VALUE_HEADER_BYTES..], bytes.as_slice());
    }

    #[test]
    fn the_checksum_is_pinned() {
        // A change of this value is a change of the on-disk and in-Redis format.
        let bytes: Vec<u8> = (0..=255u8).collect();
        assert_eq!(
            payload_checksum(BlockHash(1), 0, 0, BlockBytes::new(&bytes)),
            0xa770_e86d_67a7_2e23
        );
        // Read in chunks, a long block sums as XXH3-64 of all its bytes at once would.
        let long: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let seed = checksum_seed(BlockHash(9), 3, 4);
        assert_eq!(
            payload_checksum(BlockHash(9), 3, 4, BlockBytes::new(&long)),
            xxhash_rust::xxh3::xxh3_64_with_seed(&long, seed)
        );
    }

    #[test]
    fn the_checksum_depends_on_block_rank_and_sequence() {
        let bytes = BlockBytes::new(&[7u8; 64]);
        let base = payload_checksum(BlockHash(1), 0, 0, bytes);
        assert_ne!(base, payload_checksum(BlockHash(2), 0, 0, bytes));
        assert_ne!(base, payload_checksum(BlockHash(1), 1, 0, bytes));
        assert_ne!(base, payload_checksum(BlockHash(1), 0, 1, bytes));
    }

    #[test]
    fn a_value_reads_back_as_its_bytes() {
        let bytes: Vec<u8> = (0..256).map(|i| i as u8).collect();
        let value = value(&bytes);
        assert_eq!(value.len(), VALUE_HEADER_BYTES + 256);
        assert_eq!(&value[..8], b"KVSHMRV1");
        assert_eq!(check_value(&value, key().hash, 1, &layout()), Ok(&bytes[..]));
    }

    #[test]
    fn every_kind_of_damage_is_corrupt() {
        let bytes = vec![9u8; 256];
        let good = value(&bytes);
        let l = layout();
        let h = key().hash;
        assert_eq!(
            check_value(&good[..100], h, 1, &l),
            Err(Corrupt::Length { found: 100, expected: 336 })
        );
        let mut flipped = good.clone();
        flipped[200] ^= 1;
        assert_eq!(check_value(&flipped, h, 1, &l), Err(Corrupt::Checksum));
        let mut magic = good.clone();
        magic[0] = b'X';
        assert_eq!(check_value(&magic, h, 1, &l), Err(Corrupt::Magic));
        assert_eq!(check_value(&good, BlockHash(1), 1, &l), Err(Corrupt::Identity));
        assert_eq!(check_value(&good, h, 0, &l), Err(Corrupt::Identity));
        let other_tp = BlockLayout::new(256, 4, 4).unwrap();
        assert_eq!(check_value(&good, h, 1, &other_tp), Err(Corrupt::Identity));
    }
}
