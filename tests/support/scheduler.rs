//! The scheduler tests' engine: a tiny one that drives a `CacheManager` alone (no workers)
//! through match, allocate, copies, commit and finish, with the invariants checked after each
//! step, and the set-ups several of those tests share.

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

/// Hands out copies until none is left, settling each as `outcome` says: `Some(result)`
/// completes it with that result, `None` holds it, unfinished. Returns the copies completed and
/// those held, each in the order handed out; checks the invariants after each copy.
pub fn settle_copies(
    cache: &mut CacheManager,
    outcome: impl Fn(&Transfer) -> Option<Result<(), TransferFailure>>,
) -> (Vec<Transfer>, Vec<Transfer>) {
    let (mut completed, mut held) = (Vec::new(), Vec::new());
    loop {
        let transfers = cache.take_transfers();
        if transfers.is_empty() {
            return (completed, held);
        }
        for transfer in transfers {
            match outcome(&transfer) {
                Some(result) => {
                    cache.complete_transfer(transfer.id, result).unwrap();
                    completed.push(transfer);
                }
                None => held.push(transfer),
            }
            check(cache);
        }
    }
}

/// Completes every copy handed out, successfully, until none is left; returns them.
pub fn complete_all(cache: &mut CacheManager) -> Vec<Transfer> {
    settle_copies(cache, |_| Some(Ok(()))).0
}

/// Completes every copy handed out, successfully, but those `hold` picks, which it returns,
/// unfinished; until no copy is left to hand out.
pub fn complete_all_but(
    cache: &mut CacheManager,
    hold: impl Fn(&Transfer) -> bool,
) -> Vec<Transfer> {
    settle_copies(cache, |transfer| (!hold(transfer)).then_some(Ok(()))).1
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

/// A whole storage command the tier failed (unreachable, timed out), as its owner reports it.
pub fn tier_failure() -> TransferFailure {
    TransferFailure { error: CommandError::StorageMiss, ..failure() }
}

/// Four device blocks, two host blocks, eight storage blocks.
pub fn three_tiny_tiers() -> CacheManager {
    manager(CacheConfig::new(BLOCK_TOKENS, 4).with_host_blocks(2).with_storage_blocks(8))
}

/// Serves prompts of two blocks until the first one's blocks are on storage only: the third
/// prompt pushes it to host, the fourth on to storage (on [`three_tiny_tiers`]).
pub fn push_first_prompt_to_storage(cache: &mut CacheManager) -> Vec<BlockHash> {
    let first = hashes(&[1, 2]);
    serve(cache, 0, &first);
    for (index, base) in [10u128, 20, 30].into_iter().enumerate() {
        serve(cache, 1 + index as u64, &hashes(&[base, base + 1]));
    }
    let found = cache.cached_prefix(&first);
    assert_eq!((found.device_blocks, found.host_blocks, found.storage_blocks), (0, 0, 2));
    first
}

/// Serves a four-block prompt (blocks 1 to 4), then others until all four of its blocks are on
/// storage only.
pub fn four_blocks_on_storage(cache: &mut CacheManager) -> Vec<BlockHash> {
    let first = hashes(&[1, 2, 3, 4]);
    push_to_storage(cache, 1, &first);
    first
}

/// Serves `blocks` as request `id`, then other four-block prompts (ids and hashes from
/// `id * 1000` on) until all of them are on storage only.
pub fn push_to_storage(cache: &mut CacheManager, id: u64, blocks: &[BlockHash]) {
    serve(cache, id, blocks);
    let mut round = 0u128;
    while cache.cached_prefix(blocks).storage_blocks < blocks.len() {
        round += 1;
        assert!(round < 20, "set-up: the prompt never reached storage");
        let base = u128::from(id) * 1000 + 10 * round;
        serve(cache, id * 1000 + round as u64, &hashes(&[base, base + 1, base + 2, base + 3]));
    }
}
