//! One test per rule of the scheduler (DESIGN §3, §4, §6), plus the scenarios engines check
//! in their own suites. Every test checks the invariants after each step.

use kvshm::hash::{BlockHasher, MultimodalItem, Namespace};
use kvshm::manager::{
    AllocateError, CacheConfig, CommitError, CompleteError, EvictionPolicy, FinishError, Lookup,
    MatchError, PromptError, RequestId, ResetError, TicketStatus, TransferId, TransferKind,
    WritePolicy,
};
use kvshm::tree::{NodeState, SwapOut};
use kvshm_ipc::record::BlockPair;

use crate::support::scheduler::*;

fn with_host(
    device_blocks: u32,
    host_blocks: u32,
    policy: WritePolicy,
) -> kvshm::manager::CacheManager {
    manager(
        CacheConfig::new(BLOCK_TOKENS, device_blocks)
            .with_host_blocks(host_blocks)
            .with_write_policy(policy),
    )
}

#[test]
fn a_prefill_hits_on_a_common_prefix() {
    let mut cache = device_only(16);
    serve(&mut cache, 1, &hashes(&[1, 2, 3]));
    let second = serve(&mut cache, 2, &hashes(&[1, 2, 9, 10]));
    assert_eq!((second.device_blocks, second.host_blocks, second.cached_tokens), (2, 0, 8));
    let stats = cache.stats();
    assert_eq!((stats.counters.hits.device_blocks, stats.counters.hits.device_tokens), (2, 8));
    assert_eq!(stats.cached_blocks, 5);
}

#[test]
fn lookup_has_no_side_effects() {
    let mut cache = device_only(8);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    let before = cache.tree_snapshot(8);
    assert_eq!(cache.cached_prefix(&hashes(&[1, 2, 3])).device_blocks, 2);
    let after = cache.tree_snapshot(8);
    assert_eq!(format!("{before:?}"), format!("{after:?}"));
    assert_eq!(cache.stats().counters.matches, 1);
}

#[test]
fn a_fully_cached_block_aligned_prompt_leaves_its_last_block_to_compute() {
    let mut cache = device_only(8);
    serve(&mut cache, 1, &hashes(&[1, 2, 3]));
    let request = RequestId(2);
    let found = cache.match_prefix(request, &hashes(&[1, 2, 3]), 12).unwrap();
    assert_eq!((found.device_blocks, found.cached_tokens), (2, 8), "block 3 is recomputed");
    let allocation = cache.allocate(request, 12 - found.cached_tokens, 0).unwrap();
    assert_eq!(allocation.new_blocks, 1);
    // The block the last token is written into is the request's own, not a cached one.
    let last = *allocation.block_table.last().unwrap();
    let snapshot = cache.tree_snapshot(u32::MAX);
    assert!(snapshot.nodes.iter().all(|node| node.device != Some(last)), "{snapshot:?}");
    let committed = cache.commit(request, 12, &hashes(&[1, 2, 3])).unwrap();
    assert_eq!((committed.inserted, committed.duplicates), (0, 1), "one cached copy of 3");
    cache.finish(request).unwrap();
    check(&cache);
    assert_eq!(cache.free_device_blocks(), 5, "the recomputed copy went back to the pool");
}

#[test]
fn a_prompt_with_a_partial_last_block_hits_every_full_block() {
    let mut cache = device_only(8);
    serve(&mut cache, 1, &hashes(&[1, 2, 3]));
    for (id, prompt) in [(2, 13), (3, 15)] {
        let found = cache.match_prefix(RequestId(id), &hashes(&[1, 2, 3]), prompt).unwrap();
        assert_eq!((found.device_blocks, found.cached_tokens), (3, 12), "{prompt} tokens");
    }
    // A hash given for the trailing partial block (as traces do) never hits.
    let found = cache.match_prefix(RequestId(4), &hashes(&[1, 2, 3]), 10).unwrap();
    assert_eq!(found.device_blocks, 2);
    check(&cache);
}

#[test]
fn prompts_of_one_token_or_none_hit_nothing() {
    let mut cache = device_only(8);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    assert_eq!(cache.match_prefix(RequestId(2), &[], 0).unwrap().blocks(), 0);
    let one_token = cache.match_prefix(RequestId(3), &hashes(&[1]), 1).unwrap();
    assert_eq!((one_token.blocks(), one_token.cached_tokens), (0, 0));
    check(&cache);
}

#[test]
fn more_hashes_than_the_prompt_has_blocks_are_refused_and_change_nothing() {
    let mut cache = device_only(8);
    serve(&mut cache, 1, &hashes(&[1, 2, 3]));
    let before = format!("{:?}", cache.tree_snapshot(8));
    let wrong = PromptError { hashes: 3, prompt_tokens: 8, block_tokens: BLOCK_TOKENS, blocks: 2 };
    let request = RequestId(2);
    assert_eq!(
        cache.match_prefix(request, &hashes(&[1, 2, 3]), 8),
        Err(MatchError::Prompt(wrong.clone()))
    );
    assert_eq!(cache.lookup(&hashes(&[1, 2, 3]), 8), Err(wrong));
    assert_eq!(
        cache.match_prefix(request, &hashes(&[1]), 0).unwrap_err(),
        MatchError::Prompt(PromptError {
            hashes: 1,
            prompt_tokens: 0,
            block_tokens: BLOCK_TOKENS,
            blocks: 0
        })
    );
    assert_eq!(format!("{:?}", cache.tree_snapshot(8)), before);
    assert_eq!(cache.request_count(), 0, "the request is not live");
    assert_eq!(cache.match_prefix(request, &hashes(&[1, 2, 3]), 9).unwrap().blocks(), 2);
    check(&cache);
}

#[test]
fn lookup_reports_what_a_match_would_hold() {
    let mut cache = with_host(2, 4, WritePolicy::WriteBack);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    serve(&mut cache, 2, &hashes(&[3, 4])); // 1 and 2 go to host
    complete_all(&mut cache);
    let prompt = hashes(&[1, 2]);
    for (id, tokens) in [(3, 5), (4, 8), (5, 9), (6, 12)] {
        let looked_up = cache.lookup(&prompt, tokens).unwrap();
        let found = cache.match_prefix(RequestId(id), &prompt, tokens).unwrap();
        let expected = if tokens > 8 { 2 } else { 1 };
        assert_eq!(
            looked_up,
            Lookup {
                device_blocks: found.device_blocks,
                host_blocks: found.host_blocks,
                storage_blocks: 0
            }
        );
        assert_eq!(found.host_blocks, expected, "{tokens} tokens");
        check(&cache);
    }
    assert_eq!(
        cache.cached_prefix(&prompt),
        Lookup { device_blocks: 0, host_blocks: 2, storage_blocks: 0 }
    );
}

#[test]
fn matching_holds_the_prefix_until_the_request_ends() {
    let mut cache = device_only(8);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    cache.match_prefix(RequestId(2), &hashes(&[1, 2]), prompt_hitting(2)).unwrap();
    cache.match_prefix(RequestId(3), &hashes(&[1]), 8).unwrap();
    check(&cache);
    let snapshot = cache.tree_snapshot(2);
    let refs: Vec<u32> = snapshot.nodes.iter().map(|node| node.ref_count).collect();
    assert_eq!(refs, vec![2, 1]);
    assert_eq!(snapshot.nodes[0].hit_count, 3, "1 + two matches");
    cache.abort(RequestId(2)).unwrap();
    cache.finish(RequestId(3)).unwrap();
    check(&cache);
    assert!(cache.tree_snapshot(2).nodes.iter().all(|node| node.ref_count == 0));
}

#[test]
fn unknown_and_duplicate_requests_are_typed_errors() {
    let mut cache = device_only(4);
    let ghost = RequestId(7);
    assert_eq!(cache.allocate(ghost, 4, 0).unwrap_err(), AllocateError::UnknownRequest(ghost));
    assert_eq!(cache.commit(ghost, 4, &[]).unwrap_err(), CommitError::UnknownRequest(ghost));
    assert_eq!(cache.finish(ghost).unwrap_err(), FinishError::UnknownRequest(ghost));
    cache.match_prefix(ghost, &[], 0).unwrap();
    assert_eq!(cache.match_prefix(ghost, &[], 0).unwrap_err(), MatchError::DuplicateRequest(ghost));
    check(&cache);
}

#[test]
fn allocation_covers_new_and_lookahead_tokens_after_the_hits() {
    let mut cache = device_only(16);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    let request = RequestId(2);
    cache.match_prefix(request, &hashes(&[1, 2, 3]), 10).unwrap();
    let allocation = cache.allocate(request, 2, 5).unwrap();
    // 8 cached + 2 new + 5 lookahead = 15 tokens = 4 blocks, 2 of them hits.
    assert_eq!((allocation.block_table.len(), allocation.new_blocks), (4, 2));
    let allocation = cache.allocate(request, 1, 0).unwrap();
    assert_eq!(allocation.new_blocks, 0, "11 tokens fit in the 4 blocks already there");
    let ticket = allocation.ticket;
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Ready));
    check(&cache);
}

#[test]
fn eviction_follows_lru_order() {
    let mut cache = device_only(3);
    serve(&mut cache, 1, &hashes(&[1]));
    serve(&mut cache, 2, &hashes(&[2]));
    serve(&mut cache, 3, &hashes(&[3]));
    // Hits 1 (one token past it) and needs a block for that token: 2, the oldest, goes.
    serve_prompt(&mut cache, 4, &hashes(&[1]), prompt_hitting(1));
    serve(&mut cache, 5, &hashes(&[4])); // takes the block of that token, freed at finish
    assert_eq!(cache.cached_prefix(&hashes(&[2])).blocks(), 0);
    for kept in [1, 3, 4] {
        assert_eq!(cache.cached_prefix(&hashes(&[kept])).blocks(), 1, "block {kept}");
    }
    assert_eq!(cache.stats().counters.evictions.device_dropped, 1);
}

#[test]
fn eviction_is_leaf_first_and_deeper_first_on_ties() {
    let mut cache = device_only(3);
    serve(&mut cache, 1, &hashes(&[1, 2, 3]));
    serve(&mut cache, 2, &hashes(&[7]));
    // All of 1, 2, 3 were released at once: the tail goes first, then its parent.
    assert_eq!(cache.cached_prefix(&hashes(&[1, 2, 3])).blocks(), 2);
    serve(&mut cache, 3, &hashes(&[8]));
    assert_eq!(cache.cached_prefix(&hashes(&[1, 2, 3])).blocks(), 1);
}

#[test]
fn blocks_a_request_just_matched_are_not_evicted_before_others() {
    let mut cache = device_only(4);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    serve(&mut cache, 2, &hashes(&[3, 4]));
    // Request 3 matches the older prefix 1, 2 and needs two more blocks: 3, 4 must go instead.
    let request = RequestId(3);
    let found = cache.match_prefix(request, &hashes(&[1, 2, 5, 6]), 16).unwrap();
    assert_eq!(found.device_blocks, 2);
    let allocation = cache.allocate(request, 8, 0).unwrap();
    assert_eq!(allocation.new_blocks, 2);
    check(&cache);
    assert_eq!(cache.cached_prefix(&hashes(&[1, 2])).blocks(), 2);
    assert_eq!(cache.cached_prefix(&hashes(&[3])).blocks(), 0);
}

#[test]
fn a_failed_allocation_changes_nothing() {
    let mut cache = with_host(4, 2, WritePolicy::WriteBack);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    serve(&mut cache, 2, &hashes(&[3]));
    let request = RequestId(3);
    cache.match_prefix(request, &hashes(&[1]), prompt_hitting(1)).unwrap();
    let before = (
        format!("{:?}", cache.tree_snapshot(9)),
        cache.free_device_blocks(),
        cache.free_host_blocks(),
    );
    // Held: 1. Reclaimable: 2, 3 and the free block: 3 blocks, not 4.
    let error = cache.allocate(request, 16, 0).unwrap_err();
    assert_eq!(error, AllocateError::OutOfBlocks { needed: 4, available: 3 });
    let after = (
        format!("{:?}", cache.tree_snapshot(9)),
        cache.free_device_blocks(),
        cache.free_host_blocks(),
    );
    assert_eq!(before, after);
    assert!(cache.take_transfers().is_empty());
    check(&cache);
    assert_eq!(cache.allocate(request, 12, 0).unwrap().new_blocks, 3);
    check(&cache);
}

#[test]
fn reset_refuses_while_blocks_are_held() {
    let mut cache = device_only(4);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    cache.match_prefix(RequestId(2), &hashes(&[1]), prompt_hitting(1)).unwrap();
    assert_eq!(cache.reset(false), Err(ResetError::RequestsHoldBlocks { requests: 1 }));
    assert_eq!(cache.cached_prefix(&hashes(&[1, 2])).blocks(), 2);
    cache.finish(RequestId(2)).unwrap();
    cache.reset(false).unwrap();
    check(&cache);
    assert_eq!((cache.generation(), cache.cached_prefix(&hashes(&[1])).blocks()), (1, 0));
    assert_eq!(cache.free_device_blocks(), 4);
}

#[test]
fn a_forced_reset_ends_every_request_and_bumps_the_generation() {
    let mut cache = device_only(4);
    cache.match_prefix(RequestId(1), &hashes(&[1]), 4).unwrap();
    cache.allocate(RequestId(1), 8, 0).unwrap();
    cache.reset(true).unwrap();
    check(&cache);
    assert_eq!(cache.generation(), 1);
    assert_eq!(cache.finish(RequestId(1)), Err(FinishError::UnknownRequest(RequestId(1))));
    assert_eq!(cache.free_device_blocks(), 4);
}

#[test]
fn salt_and_multimodal_keys_isolate() {
    let tokens: Vec<u32> = (0..8).collect();
    let tenant = |salt: &[u8]| {
        BlockHasher::new(Namespace::new("m", None, Some(salt)), BLOCK_TOKENS as usize).unwrap()
    };
    let image = |hash| [MultimodalItem { start: 5, len: 2, content_hash: hash }];
    let mut cache = device_only(16);
    serve(&mut cache, 1, &tenant(b"a").hash_prompt(&tokens, &image(1)));
    assert_eq!(cache.cached_prefix(&tenant(b"a").hash_prompt(&tokens, &image(1))).blocks(), 2);
    assert_eq!(cache.cached_prefix(&tenant(b"b").hash_prompt(&tokens, &image(1))).blocks(), 0);
    assert_eq!(
        cache.cached_prefix(&tenant(b"a").hash_prompt(&tokens, &image(2))).blocks(),
        1,
        "block 0 has no image"
    );
    assert_eq!(cache.cached_prefix(&tenant(b"a").hash_prompt(&tokens, &[])).blocks(), 1);
}

#[test]
fn a_duplicate_commit_keeps_one_cached_copy() {
    let mut cache = device_only(8);
    let blocks = hashes(&[1, 2]);
    for id in [1, 2] {
        cache.match_prefix(RequestId(id), &blocks, 8).unwrap();
        cache.allocate(RequestId(id), 8, 0).unwrap();
    }
    assert_eq!(cache.commit(RequestId(1), 8, &blocks).unwrap().inserted, 2);
    let second = cache.commit(RequestId(2), 8, &blocks).unwrap();
    assert_eq!((second.inserted, second.duplicates), (0, 2));
    check(&cache);
    assert_eq!(cache.stats().cached_blocks, 2);
    assert_eq!(cache.free_device_blocks(), 4, "request 2 still holds its private copies");
    cache.finish(RequestId(2)).unwrap();
    cache.finish(RequestId(1)).unwrap();
    check(&cache);
    assert_eq!(cache.free_device_blocks(), 6);
}

#[test]
fn generated_tokens_are_committed_too() {
    let mut cache = device_only(8);
    let request = RequestId(1);
    let hasher = BlockHasher::new(Namespace::new("m", None, None), BLOCK_TOKENS as usize).unwrap();
    let mut tokens: Vec<u32> = vec![1, 2, 3, 4, 5, 6];
    let mut blocks = hasher.hash_prompt(&tokens, &[]);
    cache.match_prefix(request, &blocks, tokens.len()).unwrap();
    cache.allocate(request, 6, 0).unwrap();
    cache.commit(request, 6, &blocks).unwrap();
    for generated in [7, 8, 9] {
        tokens.push(generated);
        cache.allocate(request, 1, 0).unwrap();
        hasher.extend(&mut blocks, &tokens, &[]);
        cache.commit(request, tokens.len(), &blocks).unwrap();
        check(&cache);
    }
    cache.finish(request).unwrap();
    assert_eq!(cache.cached_prefix(&hasher.hash_prompt(&tokens, &[])).blocks(), 2);
}

#[test]
fn a_commit_needs_allocated_blocks_and_enough_hashes() {
    let mut cache = device_only(8);
    let request = RequestId(1);
    cache.match_prefix(request, &hashes(&[1, 2]), 8).unwrap();
    assert_eq!(
        cache.commit(request, 8, &hashes(&[1, 2])),
        Err(CommitError::NotAllocated { blocks: 2, allocated: 0 })
    );
    cache.allocate(request, 8, 0).unwrap();
    assert_eq!(
        cache.commit(request, 8, &hashes(&[1])),
        Err(CommitError::MissingHashes { blocks: 2, given: 1 })
    );
    cache.commit(request, 4, &hashes(&[1])).unwrap();
    assert_eq!(
        cache.commit(request, 8, &hashes(&[9, 2])),
        Err(CommitError::PrefixMismatch { block: 0 })
    );
    check(&cache);
}

#[test]
fn finishing_gives_blocks_back_tail_first() {
    let mut cache = device_only(4);
    let request = RequestId(1);
    cache.match_prefix(request, &[], 0).unwrap();
    let table = cache.allocate(request, 12, 0).unwrap().block_table.to_vec();
    cache.abort(request).unwrap();
    check(&cache);
    // The head was given back last, so it is handed out first.
    cache.match_prefix(RequestId(2), &[], 0).unwrap();
    assert_eq!(cache.allocate(RequestId(2), 4, 0).unwrap().block_table, &table[..1]);
}

#[test]
fn without_a_host_tier_evicted_blocks_are_dropped() {
    let mut cache = device_only(2);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    serve(&mut cache, 2, &hashes(&[3, 4]));
    assert_eq!(cache.cached_prefix(&hashes(&[1])).blocks(), 0);
    assert!(cache.take_transfers().is_empty());
    assert_eq!(cache.stats().counters.evictions.device_dropped, 2);
}

#[test]
fn write_back_moves_evicted_blocks_to_host_and_a_hit_swaps_them_in() {
    let mut cache = with_host(2, 4, WritePolicy::WriteBack);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    serve(&mut cache, 2, &hashes(&[3, 4]));
    let found = cache.cached_prefix(&hashes(&[1, 2]));
    assert_eq!((found.device_blocks, found.host_blocks), (0, 2));
    let stats = cache.stats();
    assert_eq!(
        (stats.counters.evictions.device_written_back, stats.counters.swap_out_blocks),
        (2, 2)
    );

    let request = RequestId(3);
    let found = cache.match_prefix(request, &hashes(&[1, 2]), prompt_hitting(2)).unwrap();
    assert_eq!(found.host_blocks, 2);
    let allocation = cache.allocate(request, 0, 0).unwrap();
    let (ticket, table) = (allocation.ticket, allocation.block_table.to_vec());
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Pending));
    check(&cache);
    let transfers = cache.take_transfers();
    // The swap-outs of 3 and 4 that made room, then the swap-in into their claimed blocks.
    assert_eq!(transfers.len(), 1, "the swap-in waits for the swap-out reading its blocks");
    assert_eq!(transfers[0].kind, TransferKind::DeviceToHost);
    cache.complete_transfer(transfers[0].id, Ok(())).unwrap();
    check(&cache);
    let swap_in = complete_all(&mut cache);
    assert_eq!(swap_in[0].kind, TransferKind::HostToDevice);
    assert_eq!(swap_in[0].pairs.iter().map(|pair| pair.dst).collect::<Vec<_>>(), table);
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Ready));
    assert_eq!(cache.cached_prefix(&hashes(&[1, 2])).device_blocks, 2);
    assert_eq!(cache.block_table(request).unwrap(), table);
    assert_eq!(cache.stats().counters.swap_in_blocks, 2);
    check(&cache);
}

#[test]
fn a_swap_in_carries_host_to_device_pairs_of_the_hits() {
    let mut cache = with_host(4, 4, WritePolicy::WriteBack);
    serve(&mut cache, 1, &hashes(&[1]));
    serve(&mut cache, 2, &hashes(&[2, 3, 4, 5])); // 1 goes to host
    let host_block =
        cache.tree_snapshot(1).nodes.iter().find(|node| node.hash.0 == 1).unwrap().host.unwrap();
    let request = RequestId(3);
    cache.match_prefix(request, &hashes(&[1]), prompt_hitting(1)).unwrap();
    let table = cache.allocate(request, 0, 0).unwrap().block_table.to_vec();
    let swap_in = complete_all_but(&mut cache, |copy| copy.kind != TransferKind::DeviceToHost);
    assert_eq!(swap_in.len(), 1);
    assert_eq!(swap_in[0].pairs, vec![BlockPair::new(host_block, table[0])]);
    assert_eq!(swap_in[0].generation, cache.generation());
    cache.complete_transfer(swap_in[0].id, Ok(())).unwrap();
    check(&cache);
    let snapshot = cache.tree_snapshot(1);
    let node = snapshot.nodes.iter().find(|node| node.hash.0 == 1).unwrap();
    assert_eq!(
        (node.device, node.host),
        (Some(table[0]), Some(host_block)),
        "the host copy stays as a backup"
    );
}

#[test]
fn a_node_hit_while_swapping_to_host_stays_on_device() {
    let mut cache = with_host(2, 4, WritePolicy::WriteBack).tap_watermark(2);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    cache.poll(); // evicts the leaf 2 ahead of demand; 1 keeps a device child until that lands
    check(&cache);
    let out = cache.take_transfers();
    assert_eq!((out.len(), out[0].pairs.len()), (1, 1));
    let request = RequestId(2);
    let found = cache.match_prefix(request, &hashes(&[1, 2]), prompt_hitting(2)).unwrap();
    assert_eq!(found.device_blocks, 2, "a node being swapped out is still a device hit");
    let table = cache.allocate(request, 0, 0).unwrap().block_table.to_vec();
    assert!(cache.take_transfers().is_empty(), "no swap-in needed");
    cache.complete_transfer(out[0].id, Ok(())).unwrap();
    check(&cache);
    let snapshot = cache.tree_snapshot(2);
    assert!(
        snapshot.nodes.iter().all(|node| node.state == NodeState::Device),
        "eviction cancelled"
    );
    assert!(snapshot.nodes[1].host.is_some(), "the host copy became a backup");
    assert_eq!(cache.block_table(request).unwrap(), table);
    assert_eq!(cache.stats().counters.backup_blocks, 1);
}

#[test]
fn a_node_hit_while_swapping_to_device_shares_the_copy_in_flight() {
    let mut cache = with_host(4, 4, WritePolicy::WriteBack);
    serve(&mut cache, 1, &hashes(&[1]));
    serve(&mut cache, 2, &hashes(&[2, 3, 4, 5]));
    complete_all(&mut cache);
    assert_eq!(cache.cached_prefix(&hashes(&[1])).host_blocks, 1);
    cache.match_prefix(RequestId(3), &hashes(&[1]), prompt_hitting(1)).unwrap();
    let first = cache.allocate(RequestId(3), 0, 0).unwrap();
    let (first_ticket, first_table) = (first.ticket, first.block_table.to_vec());
    let copies: Vec<_> =
        complete_all_but(&mut cache, |copy| copy.kind != TransferKind::DeviceToHost);
    assert_eq!(copies.len(), 1);
    let swap_in = copies[0].clone();
    assert_eq!(swap_in.kind, TransferKind::HostToDevice);
    let found = cache.match_prefix(RequestId(4), &hashes(&[1]), prompt_hitting(1)).unwrap();
    assert_eq!(found.device_blocks, 1);
    let second = cache.allocate(RequestId(4), 0, 0).unwrap();
    assert_eq!(second.block_table, first_table, "the same destination block");
    let second_ticket = second.ticket;
    assert!(cache.take_transfers().is_empty(), "never a second copy");
    assert_eq!(cache.ticket_status(second_ticket), Ok(TicketStatus::Pending));
    cache.complete_transfer(swap_in.id, Ok(())).unwrap();
    check(&cache);
    assert_eq!(cache.ticket_status(first_ticket), Ok(TicketStatus::Ready));
    assert_eq!(cache.ticket_status(second_ticket), Ok(TicketStatus::Ready));
}

#[test]
fn an_allocation_short_of_free_blocks_claims_a_block_being_swapped_out() {
    let mut cache = with_host(2, 4, WritePolicy::WriteBack);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    let request = RequestId(2);
    cache.match_prefix(request, &hashes(&[7]), 4).unwrap();
    let allocation = cache.allocate(request, 4, 0).unwrap();
    let (ticket, block) = (allocation.ticket, allocation.block_table[0]);
    assert_eq!(
        cache.ticket_status(ticket),
        Ok(TicketStatus::Pending),
        "the swap-out still reads it"
    );
    check(&cache);
    let snapshot = cache.tree_snapshot(2);
    assert!(snapshot
        .nodes
        .iter()
        .any(|node| node.state == NodeState::SwapToHost(SwapOut::Claimed)));
    assert_eq!(
        cache.cached_prefix(&hashes(&[1, 2])).blocks(),
        1,
        "a match stops at a claimed node"
    );
    let out = cache.take_transfers();
    assert!(out[0].pairs.iter().any(|pair| pair.src == block));
    assert_eq!(cache.commit(request, 4, &hashes(&[7])), Err(CommitError::TicketPending(request)));
    cache.complete_transfer(out[0].id, Ok(())).unwrap();
    check(&cache);
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Ready));
    assert_eq!(cache.cached_prefix(&hashes(&[1, 2])).host_blocks, 1);
    cache.commit(request, 4, &hashes(&[7])).unwrap();
    check(&cache);
}

#[test]
fn a_request_that_ends_before_the_swap_out_it_claimed_from_leaves_the_block_reserved() {
    let mut cache = with_host(1, 2, WritePolicy::WriteBack);
    serve(&mut cache, 1, &hashes(&[1]));
    cache.match_prefix(RequestId(2), &[], 0).unwrap();
    cache.allocate(RequestId(2), 4, 0).unwrap();
    let out = cache.take_transfers();
    cache.abort(RequestId(2)).unwrap();
    check(&cache);
    assert_eq!(cache.free_device_blocks(), 0, "the swap-out still reads the block");
    cache.complete_transfer(out[0].id, Ok(())).unwrap();
    check(&cache);
    assert_eq!(cache.free_device_blocks(), 1);
}

#[test]
fn a_failed_swap_out_leaves_the_node_on_device_and_frees_the_host_block() {
    let mut cache = with_host(2, 4, WritePolicy::WriteBack).tap_watermark(1);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    cache.poll();
    let out = cache.take_transfers();
    assert_eq!(cache.free_host_blocks(), 3);
    cache.complete_transfer(out[0].id, Err(failure())).unwrap();
    check(&cache);
    assert_eq!(cache.free_host_blocks(), 4);
    assert_eq!(cache.cached_prefix(&hashes(&[1, 2])).device_blocks, 2);
    assert_eq!(cache.stats().counters.failed_transfers, 1);
}

#[test]
fn a_failed_claimed_swap_out_drops_the_node() {
    let mut cache = with_host(1, 2, WritePolicy::WriteBack);
    serve(&mut cache, 1, &hashes(&[1]));
    cache.match_prefix(RequestId(2), &[], 0).unwrap();
    let ticket = cache.allocate(RequestId(2), 4, 0).unwrap().ticket;
    let out = cache.take_transfers();
    cache.complete_transfer(out[0].id, Err(failure())).unwrap();
    check(&cache);
    assert_eq!(cache.cached_prefix(&hashes(&[1])).blocks(), 0);
    assert_eq!(
        cache.ticket_status(ticket),
        Ok(TicketStatus::Ready),
        "the claimed block is free to write"
    );
    assert_eq!(cache.free_host_blocks(), 2);
}

#[test]
fn a_failed_swap_in_fails_the_ticket_and_leaves_the_node_on_host() {
    let mut cache = with_host(4, 4, WritePolicy::WriteBack);
    serve(&mut cache, 1, &hashes(&[1]));
    serve(&mut cache, 2, &hashes(&[2, 3, 4, 5]));
    let request = RequestId(3);
    cache.match_prefix(request, &hashes(&[1]), prompt_hitting(1)).unwrap();
    let ticket = cache.allocate(request, 0, 0).unwrap().ticket;
    let swap_in = complete_all_but(&mut cache, |copy| copy.kind != TransferKind::DeviceToHost);
    let free_before = cache.free_device_blocks();
    cache.complete_transfer(swap_in[0].id, Err(failure())).unwrap();
    check(&cache);
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Failed(failure())));
    assert_eq!(cache.free_device_blocks(), free_before + 1);
    assert_eq!(cache.cached_prefix(&hashes(&[1])).host_blocks, 1);
    assert_eq!(cache.commit(request, 4, &hashes(&[1])), Err(CommitError::RequestFailed(request)));
    assert_eq!(cache.allocate(request, 4, 0).unwrap_err(), AllocateError::RequestFailed(request));
    cache.abort(request).unwrap();
    check(&cache);
}

#[test]
fn completing_an_unknown_transfer_is_a_typed_error() {
    let mut cache = device_only(1);
    let ghost = TransferId(42);
    assert_eq!(cache.complete_transfer(ghost, Ok(())), Err(CompleteError::UnknownTransfer(ghost)));
}

#[test]
fn write_through_backs_up_every_committed_block_on_poll() {
    let mut cache = with_host(2, 4, WritePolicy::WriteThrough);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    assert_eq!(cache.pending_backups(), 2);
    cache.poll();
    let out = complete_all(&mut cache);
    assert_eq!((out.len(), out[0].pairs.len()), (1, 2), "one batched copy");
    assert_eq!(cache.stats().counters.backup_blocks, 2);
    // Evicting a backed-up node is metadata only: no copy.
    serve(&mut cache, 2, &hashes(&[3]));
    let stats = cache.stats();
    assert_eq!(
        (
            stats.counters.evictions.device_to_host_metadata,
            stats.counters.evictions.device_written_back
        ),
        (1, 0)
    );
    assert_eq!(cache.cached_prefix(&hashes(&[1, 2])).host_blocks, 1);
}

#[test]
fn write_through_selective_backs_up_hot_nodes_and_drops_cold_ones() {
    let mut cache = with_host(2, 4, WritePolicy::WriteThroughSelective { threshold: 2 });
    serve(&mut cache, 1, &hashes(&[1]));
    serve(&mut cache, 2, &hashes(&[2]));
    // Hits 1 (its hit count reaches 2); the block of its last token evicts 2 (cold: dropped).
    serve_prompt(&mut cache, 3, &hashes(&[1]), prompt_hitting(1));
    cache.poll();
    assert_eq!(complete_all(&mut cache).len(), 1);
    assert_eq!(cache.stats().counters.backup_blocks, 1);
    serve(&mut cache, 4, &hashes(&[3])); // takes the block freed by request 3
    serve(&mut cache, 5, &hashes(&[4])); // evicts 1 (backed up: metadata)
    assert_eq!(cache.cached_prefix(&hashes(&[2])).blocks(), 0);
    assert_eq!(cache.cached_prefix(&hashes(&[1])).host_blocks, 1);
    let stats = cache.stats();
    assert_eq!(
        (stats.counters.evictions.device_dropped, stats.counters.evictions.device_to_host_metadata),
        (1, 1)
    );
}

#[test]
fn write_back_with_a_full_host_tier_drops_host_leaves_first() {
    let mut cache = with_host(1, 1, WritePolicy::WriteBack);
    serve(&mut cache, 1, &hashes(&[1]));
    serve(&mut cache, 2, &hashes(&[2])); // 1 goes to host
    serve(&mut cache, 3, &hashes(&[3])); // host full: 1 is dropped, 2 goes to host
    assert_eq!(cache.cached_prefix(&hashes(&[1])).blocks(), 0);
    assert_eq!(cache.cached_prefix(&hashes(&[2])).host_blocks, 1);
    assert_eq!(cache.stats().counters.evictions.host_dropped, 1);
}

#[test]
fn write_back_drops_the_device_node_when_no_host_block_can_go() {
    let mut cache = with_host(2, 1, WritePolicy::WriteBack);
    serve(&mut cache, 1, &hashes(&[1]));
    serve(&mut cache, 2, &hashes(&[2]));
    serve(&mut cache, 3, &hashes(&[3])); // 1 to host
    cache.match_prefix(RequestId(4), &hashes(&[1]), prompt_hitting(1)).unwrap(); // holds the host copy
    serve(&mut cache, 5, &hashes(&[5])); // evicting 2: host full and held, so 2 is dropped
    assert_eq!(cache.cached_prefix(&hashes(&[2])).blocks(), 0);
    assert_eq!(cache.stats().counters.evictions.device_dropped, 1);
    cache.finish(RequestId(4)).unwrap();
    check(&cache);
}

#[test]
fn completions_from_an_older_generation_keep_their_blocks_until_they_arrive() {
    let mut cache = with_host(2, 2, WritePolicy::WriteBack).tap_watermark(2);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    cache.poll();
    let out = cache.take_transfers();
    cache.reset(false).unwrap();
    check(&cache);
    assert_eq!(
        (cache.free_device_blocks(), cache.free_host_blocks()),
        (1, 1),
        "one copy in flight"
    );
    cache.complete_transfer(out[0].id, Ok(())).unwrap();
    check(&cache);
    assert_eq!((cache.free_device_blocks(), cache.free_host_blocks()), (2, 2));
    assert_eq!(cache.cached_prefix(&hashes(&[1])).blocks(), 0);
    assert_eq!(cache.stats().counters.stale_completions, 1);
}

#[test]
fn the_watermark_evicts_ahead_of_demand_on_poll() {
    let mut cache = device_only(4).tap_watermark(2);
    serve(&mut cache, 1, &hashes(&[1, 2, 3, 4]));
    assert_eq!(cache.free_device_blocks(), 0);
    cache.poll();
    check(&cache);
    assert_eq!(cache.free_device_blocks(), 2);
    assert_eq!(cache.cached_prefix(&hashes(&[1, 2, 3, 4])).blocks(), 2);
}

#[test]
fn resize_grows_and_shrinks_only_over_free_blocks() {
    let mut cache = device_only(4);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    assert!(cache.resize_device(1).is_err());
    cache.resize_device(8).unwrap();
    assert_eq!(cache.free_device_blocks(), 6);
    cache.resize_device(2).unwrap();
    check(&cache);
    assert_eq!((cache.free_device_blocks(), cache.stats().device_blocks), (0, 2));
}

#[test]
fn stats_and_the_tree_snapshot_serialize() {
    let mut cache = device_only(4);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    let stats = serde_json::to_value(cache.stats()).unwrap();
    assert_eq!(stats["hits"]["device_blocks"], 0);
    assert_eq!(stats["cached_blocks"], 2);
    let tree = serde_json::to_value(cache.tree_snapshot(1)).unwrap();
    assert_eq!(tree["nodes"].as_array().unwrap().len(), 1);
    assert_eq!(tree["total_nodes"], 2);
}

trait Watermark {
    fn tap_watermark(self, blocks: u32) -> Self;
}

impl Watermark for kvshm::manager::CacheManager {
    /// Rebuilds the manager with a free watermark.
    fn tap_watermark(self, blocks: u32) -> Self {
        manager(self.config().clone().with_free_watermark(blocks))
    }
}

#[test]
fn a_failed_swap_in_cancels_the_swap_ins_held_back_below_it() {
    let mut cache = with_host(4, 8, WritePolicy::WriteBack);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    serve(&mut cache, 2, &hashes(&[3, 4, 5, 6])); // 1 and 2 go to host
    assert_eq!(cache.cached_prefix(&hashes(&[1, 2])).host_blocks, 2);
    cache.match_prefix(RequestId(3), &hashes(&[1]), prompt_hitting(1)).unwrap();
    let first = cache.allocate(RequestId(3), 0, 0).unwrap().ticket;
    let parent_swap_in =
        complete_all_but(&mut cache, |copy| copy.kind != TransferKind::DeviceToHost);
    assert_eq!(parent_swap_in.len(), 1);
    // Request 4 shares the swap-in of 1 and swaps 2 in behind it.
    cache.match_prefix(RequestId(4), &hashes(&[1, 2]), prompt_hitting(2)).unwrap();
    let second = cache.allocate(RequestId(4), 0, 0).unwrap().ticket;
    assert!(
        complete_all_but(&mut cache, |copy| copy.kind != TransferKind::DeviceToHost).is_empty(),
        "the swap-in of 2 waits for that of 1"
    );
    check(&cache);
    let free = cache.free_device_blocks();
    cache.complete_transfer(parent_swap_in[0].id, Err(failure())).unwrap();
    check(&cache);
    assert!(cache.take_transfers().is_empty(), "the swap-in of 2 was cancelled");
    assert_eq!(cache.transfers_in_flight(), 0);
    assert_eq!(cache.free_device_blocks(), free + 2);
    assert_eq!(cache.cached_prefix(&hashes(&[1, 2])).host_blocks, 2);
    for ticket in [first, second] {
        assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Failed(failure())));
    }
    cache.abort(RequestId(3)).unwrap();
    cache.abort(RequestId(4)).unwrap();
    check(&cache);
}

#[test]
fn a_shared_swap_in_that_lands_releases_the_one_behind_it() {
    let mut cache = with_host(4, 8, WritePolicy::WriteBack);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    serve(&mut cache, 2, &hashes(&[3, 4, 5, 6]));
    cache.match_prefix(RequestId(3), &hashes(&[1]), prompt_hitting(1)).unwrap();
    cache.allocate(RequestId(3), 0, 0).unwrap();
    let parent_swap_in =
        complete_all_but(&mut cache, |copy| copy.kind != TransferKind::DeviceToHost);
    cache.match_prefix(RequestId(4), &hashes(&[1, 2]), prompt_hitting(2)).unwrap();
    let ticket = cache.allocate(RequestId(4), 0, 0).unwrap().ticket;
    complete_all_but(&mut cache, |copy| copy.kind != TransferKind::DeviceToHost);
    cache.complete_transfer(parent_swap_in[0].id, Ok(())).unwrap();
    let behind = cache.take_transfers();
    assert_eq!((behind.len(), behind[0].kind), (1, TransferKind::HostToDevice));
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Pending));
    cache.complete_transfer(behind[0].id, Ok(())).unwrap();
    check(&cache);
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Ready));
    assert_eq!(cache.cached_prefix(&hashes(&[1, 2])).device_blocks, 2);
}

#[test]
fn selective_write_through_with_threshold_one_backs_up_on_commit() {
    let mut cache = with_host(2, 4, WritePolicy::WriteThroughSelective { threshold: 1 });
    serve(&mut cache, 1, &hashes(&[1, 2]));
    cache.poll();
    assert_eq!(complete_all(&mut cache).len(), 1);
    assert_eq!(cache.stats().counters.backup_blocks, 2);
}

/// Serves the same workload under `eviction`: 48 two-turn conversations whose second turn comes
/// 12 releases after the first (the think time `conv` learns), then a three-turn conversation X,
/// then `fresh` one-turn requests. Returns how many of X's blocks are still cached.
fn conversation_survival(eviction: EvictionPolicy, fresh: u128) -> usize {
    let mut cache = manager(CacheConfig::new(BLOCK_TOKENS, 64).with_eviction(eviction));
    let turn = |blocks: &[u128]| (hashes(blocks), prompt_hitting(blocks.len()));
    let mut id = 0;
    let mut serve_turn = |cache: &mut kvshm::manager::CacheManager, blocks: &[u128]| {
        id += 1;
        let (blocks, prompt) = turn(blocks);
        serve_prompt(cache, id, &blocks, prompt)
    };
    for conversation in 0..52u128 {
        if conversation < 48 {
            serve_turn(&mut cache, &[1_000 + conversation]);
        }
        if conversation >= 4 {
            let earlier = conversation - 4;
            let found = serve_turn(&mut cache, &[1_000 + earlier, 2_000 + earlier]);
            assert_eq!(found.device_blocks, 1, "the first turn is still cached");
        }
    }
    let x = [3_000, 3_001, 3_002];
    for turns in 1..=3 {
        serve_turn(&mut cache, &x[..turns]);
    }
    for request in 0..fresh {
        serve_turn(&mut cache, &[10_000 + request]);
    }
    let (blocks, prompt) = turn(&x);
    cache.lookup(&blocks, prompt).unwrap().blocks()
}

#[test]
fn under_conv_a_conversation_continued_twice_outlives_newer_first_turns() {
    // 68 fresh blocks after X overflow the 64-block tier: LRU has evicted X by then. conv keeps
    // X's third-generation blocks two think times (2 x ~13 releases) longer than first turns.
    assert_eq!(conversation_survival(EvictionPolicy::Lru, 68), 0);
    assert_eq!(conversation_survival(EvictionPolicy::Conv, 68), 3);
    // Both keep X without pressure, and conv too gives it up once its credit is spent.
    assert_eq!(conversation_survival(EvictionPolicy::Lru, 40), 3);
    assert_eq!(conversation_survival(EvictionPolicy::Conv, 40), 3);
    assert_eq!(conversation_survival(EvictionPolicy::Conv, 120), 0);
}
