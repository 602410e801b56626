//! Helpers shared by the scheduler test suites: a tiny engine that drives a `CacheManager`.
#![allow(dead_code)]

use std::path::PathBuf;

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

/// Eight device blocks, four host blocks, thirty-two storage blocks.
pub fn three_small_tiers() -> CacheManager {
    manager(CacheConfig::new(BLOCK_TOKENS, 8).with_host_blocks(4).with_storage_blocks(32))
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

/// The length of a prompt of `blocks` full blocks and one token more: the shortest prompt whose
/// `blocks` blocks may all hit under the last-token rule.
pub fn prompt_hitting(blocks: usize) -> usize {
    blocks * BLOCK_TOKENS as usize + 1
}

/// Runs one block-aligned prompt through match, allocate, copies, commit and finish; returns its
/// match. Under the last-token rule its last block never hits (it is recomputed).
pub fn serve(cache: &mut CacheManager, id: u64, blocks: &[BlockHash]) -> PrefixMatch {
    serve_prompt(cache, id, blocks, blocks.len() * BLOCK_TOKENS as usize)
}

/// Like [`serve`] for a prompt of `prompt` tokens whose full blocks are `blocks`.
pub fn serve_prompt(
    cache: &mut CacheManager,
    id: u64,
    blocks: &[BlockHash],
    prompt: usize,
) -> PrefixMatch {
    let request = RequestId(id);
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

/// The Mooncake conversation trace the repository carries in `traces/`.
///
/// # Panics
/// When it is missing: the tests that need it must not pass without it.
pub fn mooncake_trace() -> PathBuf {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("traces/mooncake_conversation_trace.jsonl");
    assert!(path.is_file(), "the Mooncake trace is missing at {}", path.display());
    path
}
