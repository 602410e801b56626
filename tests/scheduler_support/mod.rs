//! Helpers shared by the scheduler test suites: a tiny engine that drives a `CacheManager`.
#![allow(dead_code)]

use kvshm::hash::BlockHash;
use kvshm::manager::{
    CacheConfig, CacheManager, PrefixMatch, RequestId, Transfer, TransferFailure,
};
use kvshm_ipc::record::CommandError;

pub const BLOCK_TOKENS: u32 = 4;

pub fn manager(config: CacheConfig) -> CacheManager {
    CacheManager::new(config).expect("a valid test configuration")
}

pub fn device_only(device_blocks: u32) -> CacheManager {
    manager(CacheConfig::new(BLOCK_TOKENS, device_blocks))
}

pub fn hashes(values: &[u128]) -> Vec<BlockHash> {
    values.iter().map(|&value| BlockHash(value)).collect()
}

pub fn failure() -> TransferFailure {
    TransferFailure { rank: 0, error: CommandError::CopyFailed, detail: 5 }
}

pub fn check(cache: &CacheManager) {
    if let Err(violation) = cache.check_invariants() {
        panic!("{violation}");
    }
}

/// Completes every copy handed out, successfully, until none is left.
pub fn complete_all(cache: &mut CacheManager) -> Vec<Transfer> {
    let mut done = Vec::new();
    loop {
        let transfers = cache.take_transfers();
        if transfers.is_empty() {
            return done;
        }
        for transfer in transfers {
            cache.complete_transfer(transfer.id, Ok(())).unwrap();
            check(cache);
            done.push(transfer);
        }
    }
}

/// Runs one request through match, allocate, copies, commit and finish; returns its match.
pub fn serve(cache: &mut CacheManager, id: u64, blocks: &[BlockHash]) -> PrefixMatch {
    let request = RequestId(id);
    let prompt = blocks.len() * BLOCK_TOKENS as usize;
    let found = cache.match_prefix(request, blocks, prompt).unwrap();
    check(cache);
    cache.allocate(request, prompt - found.cached_tokens, 0).unwrap();
    check(cache);
    complete_all(cache);
    cache.commit(request, prompt, blocks).unwrap();
    check(cache);
    cache.finish(request).unwrap();
    check(cache);
    found
}

/// A small seeded PRNG (xorshift64*), so that randomized tests replay exactly.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..bound` (bound > 0).
    pub fn below(&mut self, bound: usize) -> usize {
        (self.next_u64() % bound as u64) as usize
    }

    /// True with probability `percent`/100.
    pub fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}
