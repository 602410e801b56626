//! A storage miss is a miss for that block, never a failure of the request: a LOAD whose blocks
//! miss shortens the hits of the requests waiting on it, which compute the rest and commit it.

use kvshm::hash::BlockHash;
use kvshm::manager::BlockOutcome::{self, Landed, Missing, Unavailable};
use kvshm::manager::{
    CacheConfig, CacheManager, CompleteError, RequestId, TicketId, TicketStatus, Transfer,
    TransferId, TransferKind, TransferStage,
};

use crate::support::scheduler::{
    check, complete_all, four_blocks_on_storage, hashes, manager, prompt_hitting, serve,
    three_small_tiers, tier_failure, BLOCK_TOKENS,
};

/// Hands out and completes every copy but the LOADs, which it returns (once there are some).
fn run_until_loads(cache: &mut CacheManager) -> Vec<Transfer> {
    loop {
        let transfers = cache.take_transfers();
        assert!(!transfers.is_empty(), "the loads are handed out");
        let mut loads = Vec::new();
        for transfer in transfers {
            if transfer.kind == TransferKind::StorageToHost {
                loads.push(transfer);
            } else {
                cache.complete_transfer(transfer.id, Ok(())).unwrap();
                check(cache);
            }
        }
        if !loads.is_empty() {
            return loads;
        }
    }
}

fn allocate_hitting_all(cache: &mut CacheManager, id: u64, blocks: &[BlockHash]) -> TicketId {
    let request = RequestId(id);
    let found = cache.match_prefix(request, blocks, prompt_hitting(blocks.len())).unwrap();
    assert_eq!(found.storage_blocks, blocks.len(), "{found:?}");
    let ticket = cache.allocate(request, 1, 0).unwrap().ticket;
    check(cache);
    ticket
}

/// Request 50 matches the four blocks of [`four_blocks_on_storage`] (on [`three_small_tiers`])
/// and allocates; every copy but its LOAD completes. Returns the cache, the four blocks, the
/// ticket and the LOAD, handed out, unfinished.
fn request_50_waiting_on_a_load() -> (CacheManager, Vec<BlockHash>, TicketId, Transfer) {
    let mut cache = three_small_tiers();
    let first = four_blocks_on_storage(&mut cache);
    let ticket = allocate_hitting_all(&mut cache, 50, &first);
    let mut loads = run_until_loads(&mut cache);
    assert_eq!(loads.len(), 1, "one LOAD: {loads:?}");
    (cache, first, ticket, loads.remove(0))
}

/// Request `id`, its ticket done, commits the four blocks of `first` it holds or computed, and
/// finishes.
fn commit_and_finish(cache: &mut CacheManager, id: u64, first: &[BlockHash]) {
    cache.commit(RequestId(id), 4 * BLOCK_TOKENS as usize, first).unwrap();
    check(cache);
    cache.finish(RequestId(id)).unwrap();
    check(cache);
}

/// Request `holder` matches the four blocks of `first` and waits; request 50 allocates them, and
/// its LOAD ends with `outcomes`; every other copy completes. Returns request 50's ticket.
fn load_while_another_holds(
    cache: &mut CacheManager,
    first: &[BlockHash],
    holder: u64,
    outcomes: &[BlockOutcome],
) -> TicketId {
    let found = cache.match_prefix(RequestId(holder), first, prompt_hitting(4)).unwrap();
    assert_eq!(found.storage_blocks, 4, "{found:?}");
    let ticket = allocate_hitting_all(cache, 50, first);
    let loads = run_until_loads(cache);
    cache.complete_storage_transfer(loads[0].id, Ok(Some(outcomes))).unwrap();
    check(cache);
    complete_all(cache);
    ticket
}

/// A copy still in the outbox (here the swap-ins held back behind a LOAD) cannot have completed:
/// completing it is refused and changes nothing, and the LOAD ahead of it then lands as usual.
/// Accepted, it would leave the LOAD's nodes waiting on a swap-in that no longer exists.
#[test]
fn a_completion_of_a_copy_not_handed_out_is_refused_and_changes_nothing() {
    let (mut cache, first, ticket, load) = request_50_waiting_on_a_load();
    let queued: Vec<TransferId> = cache
        .ticket_transfers(ticket)
        .filter(|&id| cache.transfer_stage(id) == TransferStage::Queued)
        .collect();
    assert!(!queued.is_empty(), "swap-ins wait behind the LOAD");
    for &id in &queued {
        assert_eq!(cache.complete_transfer(id, Ok(())), Err(CompleteError::NotIssued(id)));
        assert_eq!(
            cache.complete_transfer(id, Err(tier_failure())),
            Err(CompleteError::NotIssued(id))
        );
        assert_eq!(
            cache.complete_storage_transfer(id, Ok(None)),
            Err(CompleteError::NotIssued(id))
        );
        assert_eq!(cache.transfer_stage(id), TransferStage::Queued);
        check(&cache);
    }
    cache.complete_transfer(load.id, Ok(())).unwrap();
    check(&cache);
    complete_all(&mut cache);
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Ready));
    commit_and_finish(&mut cache, 50, &first);
}

#[test]
fn a_load_missing_its_third_block_shortens_the_hit_to_two_and_the_request_caches_what_it_computes()
{
    let mut cache = three_small_tiers();
    let first = four_blocks_on_storage(&mut cache);
    let ticket = allocate_hitting_all(&mut cache, 50, &first);
    let table = cache.block_table(RequestId(50)).unwrap().to_vec();
    let loads = run_until_loads(&mut cache);
    assert_eq!(loads.len(), 1);
    let load = &loads[0];
    let counters = cache.stats().counters;
    let order: Vec<BlockHash> = load.blocks.iter().map(|block| block.hash).collect();
    assert_eq!(order, first, "a LOAD carries its chain block 0 first");
    cache.complete_storage_transfer(load.id, Ok(Some(&[Landed, Landed, Missing, Landed]))).unwrap();
    check(&cache);
    assert_eq!(cache.ticket_cached_blocks(ticket), Ok(Some(2)), "known before the swap-in runs");
    // The swap-in behind it carries the two blocks that landed.
    let swap_ins: Vec<Transfer> = cache.take_transfers();
    let pairs: usize = swap_ins
        .iter()
        .filter(|transfer| transfer.kind == TransferKind::HostToDevice)
        .map(|transfer| transfer.pairs.len())
        .sum();
    assert_eq!(pairs, 2);
    for transfer in swap_ins {
        cache.complete_transfer(transfer.id, Ok(())).unwrap();
        check(&cache);
    }
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Shortened { cached_blocks: 2 }));
    assert_eq!(cache.block_table(RequestId(50)).unwrap(), table, "the table keeps its blocks");
    // The missed block left at once, with the block below it: no match sees them any more.
    let found = cache.cached_prefix(&first);
    assert_eq!((found.device_blocks, found.storage_blocks), (2, 0), "{found:?}");
    let after = cache.stats().counters;
    assert_eq!(after.load_missing_blocks, 1);
    assert_eq!(after.lost_blocks_dropped, 2, "the missing block and the one below it");
    assert_eq!(after.evictions.storage_dropped, counters.evictions.storage_dropped, "no eviction");
    assert_eq!(after.failed_transfers, counters.failed_transfers, "a miss is no failed copy");
    // The request computes blocks 3 and 4 into its table and commits them.
    commit_and_finish(&mut cache, 50, &first);
    let found = cache.cached_prefix(&first);
    assert_eq!(found.device_blocks, 4, "blocks 1-2 kept, 3-4 cached from the request: {found:?}");
    assert_eq!(cache.stats().storage_used, cache.storage_used_blocks());
}

#[test]
fn two_requests_sharing_one_load_are_both_shortened_each_with_blocks_of_its_own() {
    // Room on device for the second request's own copies of the blocks it shared.
    let mut cache =
        manager(CacheConfig::new(BLOCK_TOKENS, 12).with_host_blocks(4).with_storage_blocks(32));
    let first = four_blocks_on_storage(&mut cache);
    // Both match before either allocates: the second one's allocation shares the first one's
    // LOAD (a match stops at a block being loaded).
    for id in [50, 51] {
        let found = cache.match_prefix(RequestId(id), &first, prompt_hitting(4)).unwrap();
        assert_eq!(found.storage_blocks, 4, "{found:?}");
    }
    let one = cache.allocate(RequestId(50), 1, 0).unwrap().ticket;
    let two = cache.allocate(RequestId(51), 1, 0).unwrap().ticket;
    check(&cache);
    let loads = run_until_loads(&mut cache);
    assert_eq!(loads.len(), 1, "the second request shares the first one's LOAD");
    cache
        .complete_storage_transfer(loads[0].id, Ok(Some(&[Landed, Missing, Landed, Landed])))
        .unwrap();
    check(&cache);
    complete_all(&mut cache);
    for ticket in [one, two] {
        assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Shortened { cached_blocks: 1 }));
    }
    let tables = [RequestId(50), RequestId(51)].map(|id| cache.block_table(id).unwrap().to_vec());
    assert_eq!(tables[0][0], tables[1][0], "the block that landed is shared");
    for (one, two) in tables[0][1..4].iter().zip(&tables[1][1..4]) {
        assert_ne!(one, two, "each computes into its own block");
    }
    for id in [50, 51] {
        commit_and_finish(&mut cache, id, &first);
    }
    assert_eq!(cache.cached_prefix(&first).device_blocks, 4);
    assert_eq!(cache.stats().counters.shortened_tickets, 2);
}

#[test]
fn a_whole_load_failing_is_a_miss_for_every_block_and_drops_none_of_them() {
    let (mut cache, first, ticket, load) = request_50_waiting_on_a_load();
    let free_host = cache.free_host_blocks();
    let free_device = cache.free_device_blocks();
    cache.complete_transfer(load.id, Err(tier_failure())).unwrap();
    check(&cache);
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Shortened { cached_blocks: 0 }));
    assert!(cache.take_transfers().iter().all(|t| t.kind != TransferKind::HostToDevice));
    assert_eq!(cache.free_host_blocks(), free_host + 4, "the load's host blocks are free again");
    assert_eq!(cache.free_device_blocks(), free_device, "the request owns its device blocks");
    cache.abort(RequestId(50)).unwrap();
    check(&cache);
    cache.poll();
    check(&cache);
    // The tier may have been down for a moment: the blocks are still there, for the first match
    // once it is back up (while it is down no match counts them: `scheduler_storage_tier_down`).
    let found = cache.cached_prefix(&first);
    assert_eq!(found.storage_blocks, 4, "{found:?}");
    assert!(cache.storage_tier_down());
    assert_eq!(cache.lookup(&first, prompt_hitting(4)).unwrap().blocks(), 0);
    assert!(cache.storage_tier_recovered());
    let again = allocate_hitting_all(&mut cache, 51, &first);
    complete_all(&mut cache);
    assert_eq!(cache.ticket_status(again), Ok(TicketStatus::Ready));
    cache.finish(RequestId(51)).unwrap();
    check(&cache);
}

#[test]
fn a_missing_first_block_shortens_to_nothing_and_forgets_the_chain_once_unheld() {
    let (mut cache, first, ticket, load) = request_50_waiting_on_a_load();
    cache.complete_storage_transfer(load.id, Ok(Some(&[Missing, Landed, Landed, Landed]))).unwrap();
    check(&cache);
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Shortened { cached_blocks: 0 }));
    assert_eq!(cache.cached_prefix(&first).blocks(), 0, "no longer matchable, before any poll");
    cache.abort(RequestId(50)).unwrap();
    check(&cache);
}

#[test]
fn a_store_keeps_the_blocks_that_landed_and_gives_back_only_those_that_missed() {
    let mut cache = three_small_tiers();
    let first = hashes(&[1, 2, 3, 4]);
    serve(&mut cache, 1, &first);
    let mut stores = Vec::new();
    for round in 0..6u128 {
        let request = RequestId(10 + round as u64);
        let base = 100 * (round + 1);
        let blocks = hashes(&[base, base + 1, base + 2, base + 3]);
        let prompt = 4 * BLOCK_TOKENS as usize;
        let found = cache.match_prefix(request, &blocks, prompt).unwrap();
        cache.allocate(request, prompt - found.cached_tokens, 0).unwrap();
        loop {
            let transfers = cache.take_transfers();
            if transfers.is_empty() {
                break;
            }
            for transfer in transfers {
                if transfer.kind == TransferKind::HostToStorage && transfer.pairs.len() >= 2 {
                    // Every other block is not written.
                    let written: Vec<BlockOutcome> = (0..transfer.pairs.len())
                        .map(|i| if i % 2 == 0 { Landed } else { Missing })
                        .collect();
                    cache.complete_storage_transfer(transfer.id, Ok(Some(&written))).unwrap();
                    stores.push(written);
                } else {
                    cache.complete_transfer(transfer.id, Ok(())).unwrap();
                }
                check(&cache);
            }
        }
        cache.commit(request, prompt, &blocks).unwrap();
        cache.finish(request).unwrap();
        check(&cache);
    }
    assert!(!stores.is_empty(), "some STORE carried several blocks");
    let counters = cache.stats().counters;
    let missed: usize =
        stores.iter().map(|written| written.iter().filter(|&&b| b != Landed).count()).sum();
    assert_eq!(counters.store_failed_blocks as usize, missed, "{counters:?}");
    assert_eq!(counters.stored_blocks + counters.store_failed_blocks, counters.store_blocks_issued);
    assert_eq!(cache.stats().storage_used, cache.storage_used_blocks());
}

#[test]
fn per_block_results_of_a_copy_that_is_not_a_storage_copy_or_of_the_wrong_length_are_refused() {
    let (mut cache, _, _, load) = request_50_waiting_on_a_load();
    let wrong = cache.complete_storage_transfer(load.id, Ok(Some(&[Landed])));
    assert!(wrong.is_err(), "{wrong:?}");
    check(&cache);
    cache.complete_storage_transfer(load.id, Ok(None)).unwrap();
    let swap_in = cache.take_transfers().into_iter().find(|t| t.kind == TransferKind::HostToDevice);
    let swap_in = swap_in.expect("the swap-in follows the load");
    let refused = cache.complete_storage_transfer(swap_in.id, Ok(Some(&[Landed; 4])));
    assert!(refused.is_err(), "{refused:?}");
    cache.complete_transfer(swap_in.id, Ok(())).unwrap();
    check(&cache);
}

// The tier answered for the other blocks: the unreadable one is a fault of that block (one bad
// slot), not of the tier, so it is dropped as a missing one is instead of being loaded again
// (`tier_health`); a whole command that failed drops nothing (above).
#[test]
fn a_block_the_tier_could_not_read_among_answered_ones_shortens_the_hit_and_is_dropped() {
    let (mut cache, first, ticket, load) = request_50_waiting_on_a_load();
    let blocks = [Landed, Unavailable, Landed, Landed];
    cache.complete_storage_transfer(load.id, Ok(Some(&blocks))).unwrap();
    check(&cache);
    complete_all(&mut cache);
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Shortened { cached_blocks: 1 }));
    cache.abort(RequestId(50)).unwrap();
    cache.poll();
    check(&cache);
    let found = cache.cached_prefix(&first);
    assert_eq!((found.device_blocks, found.storage_blocks), (1, 0), "{found:?}");
    assert_eq!(cache.stats().counters.load_missing_blocks, 1);
    assert!(!cache.storage_tier_down());
}

#[test]
fn a_request_shortened_by_a_tier_that_was_down_caches_what_it_computes_over_the_stored_blocks() {
    let (mut cache, first, ticket, load) = request_50_waiting_on_a_load();
    cache.complete_transfer(load.id, Err(tier_failure())).unwrap();
    complete_all(&mut cache);
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Shortened { cached_blocks: 0 }));
    // The nodes are still there, storage-only: the commit takes the request's copies for them.
    commit_and_finish(&mut cache, 50, &first);
    let found = cache.cached_prefix(&first);
    assert_eq!(found.device_blocks, 4, "{found:?}");
    assert_eq!(cache.stats().storage_used, cache.storage_used_blocks());
}

#[test]
fn a_missing_block_below_one_the_tier_could_not_read_is_dropped_with_it() {
    let (mut cache, first, ticket, load) = request_50_waiting_on_a_load();
    let blocks = [Landed, Unavailable, Missing, Landed];
    cache.complete_storage_transfer(load.id, Ok(Some(&blocks))).unwrap();
    check(&cache);
    complete_all(&mut cache);
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Shortened { cached_blocks: 1 }));
    let found = cache.cached_prefix(&first);
    assert_eq!((found.device_blocks, found.storage_blocks), (1, 0), "{found:?}");
    cache.abort(RequestId(50)).unwrap();
    check(&cache);
}

#[test]
fn a_missing_block_recomputed_while_another_request_holds_it_is_no_longer_counted_on_storage() {
    let mut cache = three_small_tiers();
    let first = four_blocks_on_storage(&mut cache);
    let ticket =
        load_while_another_holds(&mut cache, &first, 60, &[Landed, Landed, Missing, Landed]);
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Shortened { cached_blocks: 2 }));
    let mut forgotten = Vec::new();
    cache.take_forgotten_blocks(&mut forgotten);
    // Block 3 is still held by request 60, so it stays until the next poll; request 50 computes
    // it and commits it, and the node becomes the device copy of a block the tier lost.
    cache.commit(RequestId(50), 4 * BLOCK_TOKENS as usize, &first).unwrap();
    check(&cache);
    let tree = cache.tree();
    let mut node = tree.child(kvshm::tree::NodeId::ROOT, first[0]).unwrap();
    for &hash in &first[1..3] {
        node = tree.child(node, hash).unwrap();
    }
    assert!(!tree.node(node).stored(), "the tier's copy of block 3 is gone: not counted as stored");
    assert_eq!(cache.stats().storage_used, cache.storage_used_blocks());
    cache.take_forgotten_blocks(&mut forgotten);
    assert!(forgotten.contains(&first[2]), "the tier is told to forget its damaged copy");
    for id in [50, 60] {
        cache.abort(RequestId(id)).unwrap();
        check(&cache);
    }
    cache.poll();
    check(&cache);
    assert_eq!(cache.cached_prefix(&first).device_blocks, 4, "the recomputed blocks stay cached");
}

#[test]
fn a_missing_block_still_held_is_no_hit_for_new_matches_and_its_holder_allocates_without_a_load() {
    let mut cache =
        manager(CacheConfig::new(BLOCK_TOKENS, 12).with_host_blocks(4).with_storage_blocks(32));
    let first = four_blocks_on_storage(&mut cache);
    let ticket =
        load_while_another_holds(&mut cache, &first, 51, &[Landed, Missing, Landed, Landed]);
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Shortened { cached_blocks: 1 }));
    // Block 2 is still held by request 51, but no match counts it (or anything below it).
    let found = cache.match_prefix(RequestId(52), &first, prompt_hitting(4)).unwrap();
    assert_eq!((found.blocks(), found.storage_blocks), (1, 0), "{found:?}");
    assert_eq!(cache.lookup(&first, prompt_hitting(4)).unwrap().blocks(), 1);
    assert_eq!(cache.cached_prefix(&first).blocks(), 1);
    check(&cache);
    // Request 51 allocates: no LOAD of a block the tier does not have; its hit ends at block 2
    // at once, and the positions from there on get blocks of their own.
    let allocation = cache.allocate(RequestId(51), 1, 0).unwrap();
    let (two, table) = (allocation.ticket, allocation.block_table.to_vec());
    assert_eq!(table.len(), 5, "four prompt positions and the new token");
    check(&cache);
    let transfers = cache.take_transfers();
    assert!(
        transfers.iter().all(|transfer| transfer.kind != TransferKind::StorageToHost),
        "{transfers:?}"
    );
    for transfer in transfers {
        cache.complete_transfer(transfer.id, Ok(())).unwrap();
        check(&cache);
    }
    assert_eq!(cache.ticket_status(two), Ok(TicketStatus::Shortened { cached_blocks: 1 }));
    assert_eq!(cache.stats().counters.load_missing_blocks, 1, "no second LOAD missed it");
    for id in [50, 51] {
        commit_and_finish(&mut cache, id, &first);
    }
    cache.abort(RequestId(52)).unwrap();
    check(&cache);
    assert_eq!(cache.cached_prefix(&first).device_blocks, 4);
    assert_eq!(cache.stats().storage_used, cache.storage_used_blocks());
}

#[test]
fn every_missing_block_of_a_load_recomputed_while_held_stops_counting_on_storage_and_is_written_back(
) {
    let mut cache =
        manager(CacheConfig::new(BLOCK_TOKENS, 12).with_host_blocks(4).with_storage_blocks(32));
    let first = four_blocks_on_storage(&mut cache);
    let ticket =
        load_while_another_holds(&mut cache, &first, 51, &[Landed, Missing, Missing, Landed]);
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Shortened { cached_blocks: 1 }));
    assert_eq!(cache.stats().counters.load_missing_blocks, 2, "counted per block");
    // Request 50 computes blocks 2-4 and commits them: blocks 2 and 3 (missing) are no longer
    // counted on storage; block 4 (landed) keeps its copy there.
    let stored = cache.storage_used_blocks();
    cache.commit(RequestId(50), 4 * BLOCK_TOKENS as usize, &first).unwrap();
    check(&cache);
    assert_eq!(cache.storage_used_blocks(), stored - 2);
    assert_eq!(cache.stats().storage_used, cache.storage_used_blocks());
    let mut forgotten = Vec::new();
    cache.take_forgotten_blocks(&mut forgotten);
    assert!(forgotten.contains(&first[1]) && forgotten.contains(&first[2]), "{forgotten:?}");
    for id in [50, 51] {
        cache.finish(RequestId(id)).unwrap();
        check(&cache);
    }
    // Other prompts push the four blocks down again: block 3 is written back to storage.
    let mut written = Vec::new();
    for round in 0..20u128 {
        let base = 1000 + 100 * round;
        let blocks = hashes(&[base, base + 1, base + 2, base + 3]);
        let request = RequestId(200 + round as u64);
        let prompt = blocks.len() * BLOCK_TOKENS as usize;
        let found = cache.match_prefix(request, &blocks, prompt).unwrap();
        cache.allocate(request, prompt - found.cached_tokens, 0).unwrap();
        for transfer in cache.take_transfers() {
            if transfer.kind == TransferKind::HostToStorage {
                written.extend(transfer.blocks.iter().map(|block| block.hash));
            }
            cache.complete_transfer(transfer.id, Ok(())).unwrap();
            check(&cache);
        }
        complete_all(&mut cache);
        cache.commit(request, prompt, &blocks).unwrap();
        cache.finish(request).unwrap();
        check(&cache);
        if cache.cached_prefix(&first).storage_blocks == 4 {
            break;
        }
    }
    assert_eq!(cache.cached_prefix(&first).storage_blocks, 4, "back on storage only");
    assert!(written.contains(&first[2]), "block 3 was written back: {written:?}");
}

#[test]
fn a_second_request_sharing_a_lost_block_with_no_device_block_to_be_had_fails_and_frees_nothing_twice(
) {
    let mut cache = three_small_tiers();
    let first = four_blocks_on_storage(&mut cache);
    for id in [50, 51] {
        let found = cache.match_prefix(RequestId(id), &first, prompt_hitting(4)).unwrap();
        assert_eq!(found.storage_blocks, 4, "{found:?}");
    }
    let one = cache.allocate(RequestId(50), 1, 0).unwrap().ticket;
    let two = cache.allocate(RequestId(51), 1, 0).unwrap().ticket;
    check(&cache);
    // A third request takes every device block left: nothing free, nothing reclaimable.
    let rest = cache.obtainable_device_blocks(usize::MAX);
    cache.match_prefix(RequestId(52), &[], rest * BLOCK_TOKENS as usize).unwrap();
    cache.allocate(RequestId(52), rest * BLOCK_TOKENS as usize, 0).unwrap();
    check(&cache);
    assert_eq!(cache.obtainable_device_blocks(usize::MAX), 0);
    let loads = run_until_loads(&mut cache);
    assert_eq!(loads.len(), 1, "the second request shares the first one's LOAD");
    cache
        .complete_storage_transfer(loads[0].id, Ok(Some(&[Landed, Missing, Landed, Landed])))
        .unwrap();
    check(&cache);
    complete_all(&mut cache);
    check(&cache);
    assert_eq!(cache.ticket_status(one), Ok(TicketStatus::Shortened { cached_blocks: 1 }));
    match cache.ticket_status(two) {
        Ok(TicketStatus::Failed(failure)) => {
            assert_eq!(failure.error, kvshm::manager::CommandError::StorageMiss);
        }
        status => panic!("the second request has no device block of its own: {status:?}"),
    }
    assert_eq!(cache.stats().counters.shortening_failed, 1);
    let free = cache.free_device_blocks();
    cache.abort(RequestId(51)).unwrap();
    check(&cache);
    assert_eq!(cache.free_device_blocks(), free + 1, "only its own new block comes back");
    cache.poll();
    check(&cache);
    let found = cache.cached_prefix(&first);
    assert_eq!((found.device_blocks, found.storage_blocks), (1, 0), "{found:?}");
    cache.commit(RequestId(50), 4 * BLOCK_TOKENS as usize, &first).unwrap();
    check(&cache);
    for id in [50, 52] {
        cache.finish(RequestId(id)).unwrap();
        check(&cache);
    }
    assert_eq!(cache.cached_prefix(&first).device_blocks, 4);
}

#[test]
fn a_load_ordered_after_one_that_misses_but_hanging_below_a_block_that_landed_is_kept_and_issued() {
    // Host room for both LOADs at once.
    let mut cache =
        manager(CacheConfig::new(BLOCK_TOKENS, 12).with_host_blocks(16).with_storage_blocks(64));
    // Two prompts sharing blocks 1-2, both on storage only.
    let one = hashes(&[1, 2, 3, 4]);
    let two = hashes(&[1, 2, 9, 10]);
    serve(&mut cache, 1, &one);
    serve(&mut cache, 2, &two);
    let mut round = 0u128;
    while cache.cached_prefix(&one).storage_blocks < 4
        || cache.cached_prefix(&two).storage_blocks < 4
    {
        round += 1;
        assert!(round < 20, "set-up: the prompts never reached storage");
        let base = 100 * round;
        serve(&mut cache, 10 + round as u64, &hashes(&[base, base + 1, base + 2, base + 3]));
    }
    complete_all(&mut cache); // the STOREs still reading host blocks
                              // Request 51 matches first; request 50 allocates (LOAD 1 of blocks 1-4), then request 51
                              // (sharing blocks 1-2 of LOAD 1, and LOAD 2 of blocks 9-10, ordered after LOAD 1).
    let found = cache.match_prefix(RequestId(51), &two, prompt_hitting(4)).unwrap();
    assert_eq!(found.storage_blocks, 4, "{found:?}");
    let first_ticket = allocate_hitting_all(&mut cache, 50, &one);
    let second_ticket = cache.allocate(RequestId(51), 1, 0).unwrap().ticket;
    check(&cache);
    let loads = run_until_loads(&mut cache);
    assert_eq!(loads.len(), 1, "the second LOAD waits for the first");
    let order: Vec<BlockHash> = loads[0].blocks.iter().map(|block| block.hash).collect();
    assert_eq!(order, one);
    // LOAD 1 misses block 3, below the blocks request 51 shares: its own LOAD is kept.
    cache
        .complete_storage_transfer(loads[0].id, Ok(Some(&[Landed, Landed, Missing, Landed])))
        .unwrap();
    check(&cache);
    let loads = run_until_loads(&mut cache);
    let order: Vec<BlockHash> =
        loads.iter().flat_map(|load| &load.blocks).map(|b| b.hash).collect();
    assert_eq!(order, two[2..], "the second LOAD is issued");
    for load in loads {
        cache.complete_storage_transfer(load.id, Ok(None)).unwrap();
        check(&cache);
    }
    complete_all(&mut cache);
    check(&cache);
    assert_eq!(cache.ticket_status(first_ticket), Ok(TicketStatus::Shortened { cached_blocks: 2 }));
    assert_eq!(cache.ticket_status(second_ticket), Ok(TicketStatus::Ready), "not shortened");
    for (id, blocks) in [(50, &one), (51, &two)] {
        cache.commit(RequestId(id), 4 * BLOCK_TOKENS as usize, blocks).unwrap();
        check(&cache);
        cache.finish(RequestId(id)).unwrap();
        check(&cache);
    }
    assert_eq!(cache.cached_prefix(&one).device_blocks, 4);
    assert_eq!(cache.cached_prefix(&two).device_blocks, 4);
}
