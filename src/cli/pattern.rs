//! The demo's block contents: a pure function of (block hash, region, rank).
//!
//! The demo engine writes every new block with [`fill`] and checks every block it hits or swaps
//! in with [`verify`]. Because the bytes depend only on the block's identity, a block that lands
//! in the wrong place, a copy that moved the wrong region or rank, or a copy that was cut short
//! shows up as a mismatch, wherever the block has travelled in between.

/// What a region's bytes are derived from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegionIdentity {
    pub block_hash: u128,
    pub region: u32,
    pub rank: u32,
}

impl RegionIdentity {
    fn seed(&self) -> u64 {
        let folded = (self.block_hash as u64) ^ ((self.block_hash >> 64) as u64).rotate_left(17);
        mix(folded ^ (u64::from(self.region) << 32) ^ u64::from(self.rank).rotate_left(7))
    }
}

/// The splitmix64 finaliser: a bijection that scatters every input bit over the output.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn word(seed: u64, index: usize) -> [u8; 8] {
    mix(seed.wrapping_add((index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))).to_le_bytes()
}

/// Writes the region's expected bytes into `out`.
pub fn fill(identity: RegionIdentity, out: &mut [u8]) {
    let seed = identity.seed();
    let mut chunks = out.chunks_exact_mut(8);
    for (index, chunk) in chunks.by_ref().enumerate() {
        chunk.copy_from_slice(&word(seed, index));
    }
    let tail_index = out.len() / 8;
    let tail = out.len() % 8;
    let last = word(seed, tail_index);
    let start = out.len() - tail;
    out[start..].copy_from_slice(&last[..tail]);
}

/// Where a region's bytes first differ from what [`fill`] wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mismatch {
    pub offset: usize,
    pub expected: u8,
    pub found: u8,
}

/// Checks that `bytes` are what [`fill`] writes for `identity`.
pub fn verify(identity: RegionIdentity, bytes: &[u8]) -> Result<(), Mismatch> {
    let seed = identity.seed();
    for (index, chunk) in bytes.chunks(8).enumerate() {
        let expected = word(seed, index);
        if chunk != &expected[..chunk.len()] {
            let within = chunk.iter().zip(expected).position(|(a, b)| *a != b).unwrap_or(0);
            return Err(Mismatch {
                offset: index * 8 + within,
                expected: expected[within],
                found: chunk[within],
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(block_hash: u128, region: u32, rank: u32) -> RegionIdentity {
        RegionIdentity { block_hash, region, rank }
    }

    #[test]
    fn filled_bytes_verify() {
        let mut bytes = vec![0u8; 1003];
        fill(identity(7, 1, 0), &mut bytes);
        assert_eq!(verify(identity(7, 1, 0), &bytes), Ok(()));
    }

    #[test]
    fn bytes_of_another_block_region_or_rank_do_not_verify() {
        let mut bytes = vec![0u8; 256];
        fill(identity(7, 1, 0), &mut bytes);
        assert!(verify(identity(8, 1, 0), &bytes).is_err());
        assert!(verify(identity(7, 2, 0), &bytes).is_err());
        assert!(verify(identity(7, 1, 1), &bytes).is_err());
        assert!(verify(identity(7 | (1 << 100), 1, 0), &bytes).is_err());
    }

    #[test]
    fn a_single_flipped_byte_is_located() {
        let mut bytes = vec![0u8; 64];
        fill(identity(1, 0, 0), &mut bytes);
        bytes[37] ^= 0x10;
        let mismatch = verify(identity(1, 0, 0), &bytes).unwrap_err();
        assert_eq!(mismatch.offset, 37);
        assert_eq!(mismatch.found ^ mismatch.expected, 0x10);
    }
}
