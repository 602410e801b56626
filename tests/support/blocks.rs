//! The bytes and storage entries of the storage tests' blocks.

use kvshm_ipc::storage_record::StorageEntry;

/// `len` pseudo-random bytes from `seed` (xorshift): blocks of different seeds differ everywhere.
pub fn pattern_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// The bytes of block `tag` on `rank` (every rank's part differs, as on a real TP engine).
pub fn block_content(tag: u64, rank: u32, len: usize) -> Vec<u8> {
    pattern_bytes(tag ^ (u64::from(rank) << 40), len)
}

/// The storage entry of block `tag` (hash derived from the tag, parent the previous tag, depth
/// the tag) read from or written to `host_block`.
pub fn entry(tag: u64, host_block: u32) -> StorageEntry {
    StorageEntry::new(block_hash(tag), block_hash(tag.wrapping_sub(1)), tag as u32, host_block)
}

pub fn block_hash(tag: u64) -> u128 {
    (u128::from(tag) << 64) | 0x0570_7a6e
}
