//! The engine-facing cache manager API that porting vLLM's, SGLang's and FastDeploy's prefix-cache
//! tests asked for: checked token counts, capacity queries, releasing and re-matching requests,
//! forced resets that name what they dropped, and cascade-attention prefixes.

use kvshm::manager::{
    AllocateError, AllocationCheck, CacheConfig, MatchError, RequestId, UnknownRequest, WritePolicy,
};
use kvshm::tree::NodeState;

use crate::support::scheduler::*;

#[test]
fn an_absurd_token_count_is_a_typed_error_that_changes_nothing() {
    let mut cache = device_only(8);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    let request = RequestId(2);
    cache.match_prefix(request, &hashes(&[1, 2]), 9).unwrap();
    let free = cache.free_device_blocks();
    for (new_tokens, lookahead) in [(usize::MAX, 0), (usize::MAX - 4, 8), (1, usize::MAX)] {
        assert_eq!(
            cache.allocate(request, new_tokens, lookahead).unwrap_err(),
            AllocateError::TooManyTokens { request, new_tokens, lookahead }
        );
        assert_eq!(cache.free_device_blocks(), free);
        check(&cache);
    }
    assert_eq!(cache.allocate(request, 4, 0).unwrap().new_blocks, 1);
    check(&cache);
}

#[test]
fn can_allocate_says_what_allocate_would_do_and_changes_nothing() {
    let mut cache = manager(
        CacheConfig::new(BLOCK_TOKENS, 6)
            .with_host_blocks(8)
            .with_write_policy(WritePolicy::WriteBack),
    );
    serve(&mut cache, 1, &hashes(&[1, 2, 3]));
    let request = RequestId(2);
    cache.match_prefix(request, &hashes(&[1, 2]), prompt_hitting(2)).unwrap();
    let before = format!("{:?} {:?}", cache.tree_snapshot(9), cache.stats());
    // Held: 1 and 2. Free: 3 blocks; block 3 is evictable: 4 could be had.
    for (tokens, needed, fits) in [(12, 3, true), (16, 4, true), (20, 5, false)] {
        let check = cache.can_allocate(request, tokens, 0).unwrap();
        assert_eq!(check.needed, needed);
        assert_eq!(check.fits(), fits, "{tokens} tokens: {check:?}");
        assert_eq!(format!("{:?} {:?}", cache.tree_snapshot(9), cache.stats()), before);
    }
    assert_eq!(
        cache.can_allocate(request, 20, 0).unwrap(),
        AllocationCheck { needed: 5, available: 4 }
    );
    assert!(cache.take_transfers().is_empty(), "counting issued no copy");
    assert_eq!(cache.obtainable_device_blocks(100), 4);
    assert_eq!(cache.obtainable_device_blocks(2), 2, "counted up to the limit");
    assert!(cache.allocate(request, 20, 0).is_err());
    assert_eq!(cache.allocate(request, 16, 0).unwrap().new_blocks, 4);
    check(&cache);
    assert_eq!(
        cache.can_allocate(RequestId(9), 1, 0),
        Err(AllocateError::UnknownRequest(RequestId(9)))
    );
}

#[test]
fn a_request_whose_allocation_failed_can_give_its_holds_back_and_match_again() {
    let mut cache = device_only(4);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    let waiting = RequestId(2);
    cache.match_prefix(waiting, &hashes(&[1, 2]), prompt_hitting(2)).unwrap();
    assert!(cache.allocate(waiting, 16, 0).is_err(), "3 free blocks, 4 needed");
    cache.release_match(waiting).unwrap();
    check(&cache);
    assert_eq!(cache.request_count(), 0);
    assert_eq!(cache.stats().counters.aborted_requests, 0, "released, not aborted");
    // Its prefix is evictable again: another request can take the whole tier.
    let other = RequestId(3);
    cache.match_prefix(other, &hashes(&[7]), 16).unwrap();
    assert_eq!(cache.allocate(other, 16, 0).unwrap().new_blocks, 4);
    cache.abort(other).unwrap();
    check(&cache);
    cache.match_prefix(waiting, &hashes(&[1, 2]), prompt_hitting(2)).unwrap();

    // Once it has allocated, it ends with finish or abort.
    cache.allocate(waiting, 4, 0).unwrap();
    assert_eq!(cache.release_match(waiting), Err(MatchError::AlreadyAllocated(waiting)));
    assert_eq!(cache.release_match(RequestId(9)), Err(MatchError::UnknownRequest(RequestId(9))));
    cache.finish(waiting).unwrap();
    check(&cache);
}

#[test]
fn rematching_a_waiting_request_picks_up_blocks_cached_meanwhile() {
    let mut cache = device_only(16);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    let waiting = RequestId(2);
    let prompt = hashes(&[1, 2, 3, 4]);
    let first = cache.match_prefix(waiting, &prompt, prompt_hitting(4)).unwrap();
    assert_eq!(first.blocks(), 2);
    // Another request computes blocks 3 and 4 while the first one waits.
    serve(&mut cache, 3, &prompt);
    let hits_before = cache.stats().counters.hits.device_blocks;
    let again = cache.rematch(waiting, &prompt, prompt_hitting(4)).unwrap();
    assert_eq!((again.device_blocks, again.host_blocks), (4, 0));
    assert_eq!(again.cached_tokens, 4 * BLOCK_TOKENS as usize);
    check(&cache);
    let new_hits = cache.stats().counters.hits.device_blocks - hits_before;
    assert_eq!(new_hits, 2, "the two new hits counted, the two held ones not again");
    // The last-token rule holds on a rematch too: a block-aligned prompt keeps its last block.
    let aligned = RequestId(4);
    cache.match_prefix(aligned, &hashes(&[1]), 4).unwrap();
    let again = cache.rematch(aligned, &prompt, 4 * BLOCK_TOKENS as usize).unwrap();
    assert_eq!(again.blocks(), 3);
    check(&cache);
    assert_eq!(
        cache.rematch(waiting, &hashes(&[1, 9]), prompt_hitting(2)),
        Err(MatchError::PrefixMismatch { request: waiting, block: 1 })
    );
    cache.allocate(waiting, 1, 0).unwrap();
    assert_eq!(
        cache.rematch(waiting, &prompt, prompt_hitting(4)),
        Err(MatchError::AlreadyAllocated(waiting))
    );
    for request in [waiting, aligned] {
        cache.finish(request).unwrap();
    }
    check(&cache);
    assert!(cache.tree_snapshot(9).nodes.iter().all(|node| node.ref_count == 0));
}

#[test]
fn a_forced_reset_returns_the_requests_it_ended() {
    let mut cache = device_only(8);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    for id in [7, 3] {
        cache.match_prefix(RequestId(id), &hashes(&[1]), prompt_hitting(1)).unwrap();
    }
    cache.match_prefix(RequestId(5), &hashes(&[9]), 4).unwrap();
    cache.allocate(RequestId(5), 4, 0).unwrap();
    cache.match_prefix(RequestId(6), &[], 0).unwrap();
    assert_eq!(cache.reset(true).unwrap(), vec![RequestId(3), RequestId(5), RequestId(7)]);
    check(&cache);
    assert_eq!(cache.reset(false).unwrap(), vec![], "request 6 holds nothing and lives on");
    assert_eq!(cache.request_count(), 1);
}

#[test]
fn the_common_prefix_counts_the_leading_device_blocks_every_live_request_holds() {
    let mut cache = device_only(32);
    serve(&mut cache, 1, &hashes(&[1, 2, 3]));
    let (a, b) = (RequestId(2), RequestId(3));
    cache.match_prefix(a, &hashes(&[1, 2, 3]), prompt_hitting(3)).unwrap();
    cache.allocate(a, 1, 0).unwrap();
    assert_eq!(cache.common_prefix_blocks(a), Ok(3), "alone, its whole cached prefix");
    cache.match_prefix(b, &hashes(&[1, 2, 9]), prompt_hitting(3)).unwrap();
    assert_eq!(cache.common_prefix_blocks(a), Ok(2));
    assert_eq!(cache.common_prefix_blocks(b), Ok(0), "b has no device blocks yet");
    cache.allocate(b, 5, 0).unwrap();
    assert_eq!(cache.common_prefix_blocks(b), Ok(2));
    cache.match_prefix(RequestId(4), &hashes(&[5]), 4).unwrap();
    assert_eq!(cache.common_prefix_blocks(a), Ok(0), "a request sharing nothing");
    assert_eq!(cache.common_prefix_blocks(RequestId(8)), Err(UnknownRequest(RequestId(8))));
}

#[test]
fn snapshots_carry_node_states_as_a_typed_enum_and_serialise_them_by_name() {
    let mut cache = device_only(8);
    serve(&mut cache, 1, &hashes(&[1]));
    let snapshot = cache.tree_snapshot(1);
    assert_eq!(snapshot.nodes[0].state, NodeState::Device);
    let json = serde_json::to_value(&snapshot).unwrap();
    assert_eq!(json["nodes"][0]["state"], "device", "kvctl reads the same text as before");
}
