//! The storage tier's circuit breaker in the cache manager: a STORE or LOAD the tier failed for
//! marks it down; while it is down no match counts a storage-only block, no allocation loads
//! one, host evictions drop instead of writing back, write-throughs and prefetches are skipped,
//! and nothing is dropped from the cache; its owner brings it back up (after a probe).

use kvshm::hash::BlockHash;
use kvshm::manager::BlockOutcome::{self, Landed, Missing, Unavailable, Unreachable};
use kvshm::manager::{
    CacheConfig, CacheManager, RequestId, StorageWritePolicy, TicketStatus, Transfer,
    TransferFailure, TransferKind,
};
use kvshm_ipc::record::CommandError;

use crate::support::scheduler::{
    check, complete_all, complete_all_but, four_blocks_on_storage, hashes, manager, prompt_hitting,
    push_to_storage, serve, three_small_tiers, BLOCK_TOKENS,
};

/// Matches `blocks` as request `id` and allocates; returns how many storage hits it matched.
fn match_and_allocate(cache: &mut CacheManager, id: u64, blocks: &[BlockHash]) -> usize {
    let request = RequestId(id);
    let found = cache.match_prefix(request, blocks, prompt_hitting(blocks.len())).unwrap();
    cache.allocate(request, prompt_hitting(blocks.len()) - found.cached_tokens, 0).unwrap();
    check(cache);
    found.storage_blocks
}

/// Hands out every copy; completes all but the LOADs (STOREs land), and returns the storage
/// copies.
fn storage_copies(cache: &mut CacheManager) -> Vec<Transfer> {
    let mut storage = Vec::new();
    loop {
        let transfers = cache.take_transfers();
        if transfers.is_empty() {
            return storage;
        }
        for transfer in transfers {
            match transfer.kind {
                TransferKind::StorageToHost => {}
                TransferKind::HostToStorage => {
                    cache.complete_storage_transfer(transfer.id, Ok(None)).unwrap();
                }
                _ => cache.complete_transfer(transfer.id, Ok(())).unwrap(),
            }
            check(cache);
            if transfer.kind.is_storage() {
                storage.push(transfer);
            }
        }
    }
}

/// The LOADs among [`storage_copies`].
fn loads(cache: &mut CacheManager) -> Vec<Transfer> {
    let mut loads = storage_copies(cache);
    loads.retain(|copy| copy.kind == TransferKind::StorageToHost);
    loads
}

/// Marks the tier down the way a real outage does: a LOAD of the four stored blocks of `first`
/// comes back with every block unavailable. Request 90 made the LOAD; it is shortened to
/// nothing, computes the blocks, commits them and finishes.
fn tier_goes_down_under_a_load(cache: &mut CacheManager, first: &[BlockHash]) {
    assert_eq!(match_and_allocate(cache, 90, first), 4);
    let loads = loads(cache);
    assert_eq!(loads.len(), 1, "one LOAD: {loads:?}");
    cache.complete_storage_transfer(loads[0].id, Ok(Some(&[Unavailable; 4]))).unwrap();
    check(cache);
    assert!(cache.storage_tier_down(), "an unavailable block marks the tier down");
    complete_all(cache);
    cache.commit(RequestId(90), prompt_hitting(4), first).unwrap();
    cache.finish(RequestId(90)).unwrap();
    check(cache);
}

#[test]
fn a_load_the_tier_failed_for_marks_it_down_and_matches_then_end_before_storage_only_blocks() {
    let mut cache = three_small_tiers();
    let first = four_blocks_on_storage(&mut cache);
    let second = hashes(&[500, 501, 502, 503]);
    push_to_storage(&mut cache, 2, &second);
    assert!(!cache.storage_tier_down());
    tier_goes_down_under_a_load(&mut cache, &first);
    assert_eq!(cache.stats().counters.storage_outages, 1);

    // The other prompt's blocks are still cached on storage, but no match counts them.
    assert_eq!(cache.cached_prefix(&second).storage_blocks, 4, "nothing dropped");
    assert_eq!(cache.lookup(&second, prompt_hitting(4)).unwrap().blocks(), 0);
    let hits_before = cache.stats().counters.hits.storage_blocks;
    let found = cache.match_prefix(RequestId(5), &second, prompt_hitting(4)).unwrap();
    assert_eq!(found.blocks(), 0, "{found:?}");
    assert_eq!(cache.stats().counters.hits.storage_blocks, hits_before);
    // Its allocation loads nothing: the request computes every block.
    cache.allocate(RequestId(5), prompt_hitting(4), 0).unwrap();
    assert!(storage_copies(&mut cache).is_empty(), "no storage copy while the tier is down");
    cache.abort(RequestId(5)).unwrap();
    check(&cache);
    assert_eq!(cache.cached_prefix(&second).storage_blocks, 4, "still cached on storage");

    // Back up: the same prompt hits storage again and loads.
    assert!(cache.storage_tier_recovered());
    assert!(!cache.storage_tier_down());
    assert_eq!(match_and_allocate(&mut cache, 6, &second), 4);
    assert_eq!(loads(&mut cache).len(), 1);
    check(&cache);
}

#[test]
fn a_missing_block_is_an_ordinary_miss_that_leaves_the_tier_up() {
    let mut cache = three_small_tiers();
    let first = four_blocks_on_storage(&mut cache);
    assert_eq!(match_and_allocate(&mut cache, 2, &first), 4);
    let loads = loads(&mut cache);
    cache
        .complete_storage_transfer(loads[0].id, Ok(Some(&[Landed, Landed, Missing, Landed])))
        .unwrap();
    check(&cache);
    assert!(!cache.storage_tier_down());
    assert_eq!(cache.stats().counters.storage_outages, 0);
}

#[test]
fn a_whole_command_failure_marks_the_tier_down_only_when_the_tier_failed() {
    let failure = |error| TransferFailure { rank: 0, error, detail: 0 };
    for (error, down) in [
        (CommandError::WorkerDied, false),
        (CommandError::StaleGeneration, false),
        (CommandError::NoStorage, false),
        (CommandError::Malformed, false),
        // A worker never sends it for a storage command: only a code this build does not know.
        (CommandError::CopyFailed, false),
        (CommandError::StorageMiss, true),
    ] {
        let mut cache = three_small_tiers();
        let first = four_blocks_on_storage(&mut cache);
        assert_eq!(match_and_allocate(&mut cache, 2, &first), 4);
        let loads = loads(&mut cache);
        cache.complete_storage_transfer(loads[0].id, Err(failure(error))).unwrap();
        check(&cache);
        assert_eq!(cache.storage_tier_down(), down, "{error:?}");
        assert_eq!(cache.cached_prefix(&first).storage_blocks, 4, "{error:?}: nothing dropped");
    }
}

#[test]
fn a_request_that_matched_storage_blocks_before_the_tier_went_down_allocates_without_a_load() {
    let mut cache = three_small_tiers();
    let first = four_blocks_on_storage(&mut cache);
    let second = hashes(&[500, 501, 502, 503]);
    push_to_storage(&mut cache, 2, &second);
    // Request 7 matches four storage hits while the tier is up, then it goes down.
    let prompt = prompt_hitting(4);
    let found = cache.match_prefix(RequestId(7), &second, prompt).unwrap();
    assert_eq!(found.storage_blocks, 4);
    tier_goes_down_under_a_load(&mut cache, &first);

    let allocation = cache.allocate(RequestId(7), prompt - found.cached_tokens, 0).unwrap();
    let ticket = allocation.ticket;
    check(&cache);
    assert!(storage_copies(&mut cache).is_empty(), "no LOAD for a tier that is down");
    assert_eq!(cache.ticket_status(ticket).unwrap(), TicketStatus::Shortened { cached_blocks: 0 });
    // It computes the four blocks into its own table and commits them.
    cache.commit(RequestId(7), prompt, &second).unwrap();
    cache.finish(RequestId(7)).unwrap();
    check(&cache);
    assert_eq!(cache.cached_prefix(&second).device_blocks, 4);
}

#[test]
fn host_evictions_drop_blocks_instead_of_writing_them_back_while_the_tier_is_down() {
    let mut cache = three_small_tiers();
    let first = four_blocks_on_storage(&mut cache);
    tier_goes_down_under_a_load(&mut cache, &first);
    let written_back = cache.stats().counters.evictions.host_written_back;
    let used = cache.storage_used_blocks();
    for round in 0..6u128 {
        let base = 1_000 + 10 * round;
        let blocks = hashes(&[base, base + 1, base + 2, base + 3]);
        let request = RequestId(100 + round as u64);
        let prompt = 4 * BLOCK_TOKENS as usize;
        let found = cache.match_prefix(request, &blocks, prompt).unwrap();
        cache.allocate(request, prompt - found.cached_tokens, 0).unwrap();
        assert!(storage_copies(&mut cache).is_empty(), "no STORE while the tier is down");
        cache.commit(request, prompt, &blocks).unwrap();
        cache.finish(request).unwrap();
        check(&cache);
    }
    let counters = cache.stats().counters;
    assert_eq!(counters.evictions.host_written_back, written_back);
    assert!(counters.storage_down_dropped_blocks > 0, "{counters:?}");
    assert!(cache.storage_used_blocks() <= used, "nothing new counted on the tier");

    // Back up: host evictions write back again.
    cache.storage_tier_recovered();
    let mut stores = 0;
    for round in 0..6u128 {
        let base = 2_000 + 10 * round;
        let blocks = hashes(&[base, base + 1, base + 2, base + 3]);
        let request = RequestId(200 + round as u64);
        let prompt = 4 * BLOCK_TOKENS as usize;
        cache.match_prefix(request, &blocks, prompt).unwrap();
        cache.allocate(request, prompt, 0).unwrap();
        for copy in storage_copies(&mut cache) {
            assert_eq!(copy.kind, TransferKind::HostToStorage);
            stores += 1;
        }
        cache.commit(request, prompt, &blocks).unwrap();
        cache.finish(request).unwrap();
        check(&cache);
    }
    assert!(stores > 0, "write-backs resume once the tier is up");
}

#[test]
fn a_store_the_tier_failed_for_marks_it_down_and_one_not_written_for_room_does_not() {
    for (outcome, down) in [(Missing, false), (Unavailable, true)] {
        let mut cache = three_small_tiers();
        let mut stores = Vec::new();
        let mut round = 0u128;
        while stores.is_empty() {
            round += 1;
            assert!(round < 20, "set-up: no write-back");
            let base = 100 * round;
            let blocks = hashes(&[base, base + 1, base + 2, base + 3]);
            let request = RequestId(round as u64);
            let prompt = 4 * BLOCK_TOKENS as usize;
            cache.match_prefix(request, &blocks, prompt).unwrap();
            cache.allocate(request, prompt, 0).unwrap();
            for transfer in cache.take_transfers() {
                if transfer.kind == TransferKind::HostToStorage {
                    stores.push(transfer);
                } else {
                    cache.complete_transfer(transfer.id, Ok(())).unwrap();
                }
            }
            if stores.is_empty() {
                complete_all(&mut cache);
                cache.commit(request, prompt, &blocks).unwrap();
                cache.finish(request).unwrap();
            } else {
                cache.abort(request).unwrap();
            }
            check(&cache);
        }
        let results = vec![outcome; stores[0].pairs.len()];
        cache.complete_storage_transfer(stores[0].id, Ok(Some(&results))).unwrap();
        check(&cache);
        assert_eq!(cache.storage_tier_down(), down, "{outcome:?}");
    }
}

#[test]
fn write_through_stores_are_skipped_while_the_tier_is_down_and_resume_once_it_is_up() {
    let mut cache = manager(
        CacheConfig::new(BLOCK_TOKENS, 8)
            .with_host_blocks(8)
            .with_storage_blocks(32)
            .with_storage_write_policy(StorageWritePolicy::WriteThrough),
    );
    assert!(cache.storage_tier_failed(), "an owner may mark the tier down");
    assert!(!cache.storage_tier_failed(), "once per outage");
    for round in 0..4u128 {
        let base = 100 * (round + 1);
        let blocks = hashes(&[base, base + 1, base + 2, base + 3]);
        let request = RequestId(round as u64 + 1);
        let prompt = 4 * BLOCK_TOKENS as usize;
        cache.match_prefix(request, &blocks, prompt).unwrap();
        cache.allocate(request, prompt, 0).unwrap();
        assert!(storage_copies(&mut cache).is_empty(), "no write-through while down");
        cache.commit(request, prompt, &blocks).unwrap();
        cache.finish(request).unwrap();
        cache.poll();
        assert!(storage_copies(&mut cache).is_empty(), "no write-through while down");
        check(&cache);
    }
    assert!(cache.stats().counters.storage_down_skipped_stores > 0);
    assert_eq!(cache.storage_used_blocks(), 0);
}

#[test]
fn a_prefetch_does_nothing_while_the_tier_is_down() {
    let mut cache = three_small_tiers();
    let first = four_blocks_on_storage(&mut cache);
    cache.set_storage_shared(true);
    cache.storage_tier_failed();
    let mut past = first.clone();
    past.extend(hashes(&[9_001, 9_002]));
    assert_eq!(cache.prefetch(&past).unwrap(), None);
    assert!(cache.take_transfers().is_empty());
    let mut queries = Vec::new();
    cache.take_storage_queries(&mut queries);
    assert!(queries.is_empty(), "no QUERY either");
    assert_eq!(cache.stats().counters.storage_down_skipped_prefetches, 1);
    check(&cache);
    cache.storage_tier_recovered();
    assert!(cache.prefetch(&first).unwrap().is_some(), "prefetches load again once it is up");
}

#[test]
fn rematch_stops_before_storage_only_blocks_while_the_tier_is_down() {
    let mut cache = three_small_tiers();
    let first = four_blocks_on_storage(&mut cache);
    let prompt = prompt_hitting(4);
    // A prompt whose first block is not cached yet matches nothing, then its blocks come back.
    cache.storage_tier_failed();
    let found = cache.match_prefix(RequestId(50), &first, prompt).unwrap();
    assert_eq!(found.blocks(), 0);
    let found = cache.rematch(RequestId(50), &first, prompt).unwrap();
    assert_eq!(found.blocks(), 0, "{found:?}");
    cache.storage_tier_recovered();
    let found = cache.rematch(RequestId(50), &first, prompt).unwrap();
    assert_eq!(found.storage_blocks, 4, "{found:?}");
    cache.release_match(RequestId(50)).unwrap();
    check(&cache);
}

#[test]
fn a_cache_without_a_storage_tier_is_never_marked_down() {
    let mut cache = manager(CacheConfig::new(BLOCK_TOKENS, 8).with_host_blocks(4));
    assert!(!cache.storage_tier_failed());
    assert!(!cache.storage_tier_down());
}

#[test]
fn a_query_answered_after_the_tier_went_down_adopts_and_loads_nothing() {
    let mut cache = three_small_tiers();
    let first = four_blocks_on_storage(&mut cache);
    cache.set_storage_shared(true);
    let mut past = first.clone();
    past.extend(hashes(&[9_001, 9_002]));
    let ticket = cache.prefetch(&past).unwrap().expect("loads and asks");
    let mut queries = Vec::new();
    cache.take_storage_queries(&mut queries);
    assert_eq!(queries.len(), 1);
    for load in loads(&mut cache) {
        cache.complete_storage_transfer(load.id, Ok(None)).unwrap();
    }
    assert!(cache.take_transfers().is_empty());
    cache.storage_tier_failed();
    cache.complete_storage_query(queries[0].id, Ok(2)).unwrap();
    check(&cache);
    let transfers = cache.take_transfers();
    assert!(transfers.is_empty(), "no LOAD of what the QUERY found: {transfers:?}");
    assert_eq!(cache.cached_prefix(&past).blocks(), 4, "nothing adopted");
    assert_eq!(cache.prefetch_status(ticket).unwrap(), TicketStatus::Ready);
}

// A LOAD the manager made before the tier went down, but had not handed out yet, would queue
// behind a hung server and wait out the worker's I/O timeout (a rank runs its storage commands
// in ring order): it is settled at once, and its request is shortened.
#[test]
fn a_load_made_before_the_tier_went_down_but_not_yet_handed_out_is_not_sent_to_it() {
    let mut cache = three_small_tiers();
    let first = hashes(&[1, 2]);
    push_to_storage(&mut cache, 1, &first);
    let second = hashes(&[500, 501]);
    push_to_storage(&mut cache, 2, &second);
    // Request 90's LOAD goes out; request 7 allocates before its outcome is known (between two
    // polls of a service), so its LOAD waits in the manager's outbox.
    assert_eq!(match_and_allocate(&mut cache, 90, &first), 2);
    let handed_out = loads(&mut cache);
    assert_eq!(handed_out.len(), 1);
    let prompt = prompt_hitting(second.len());
    let found = cache.match_prefix(RequestId(7), &second, prompt).unwrap();
    assert_eq!(found.storage_blocks, 2);
    let ticket = cache.allocate(RequestId(7), prompt - found.cached_tokens, 0).unwrap().ticket;
    check(&cache);
    cache.complete_storage_transfer(handed_out[0].id, Ok(Some(&[Unavailable; 2]))).unwrap();
    check(&cache);
    assert!(cache.storage_tier_down());
    let late = loads(&mut cache);
    assert!(late.is_empty(), "a LOAD handed out to a tier already marked down: {late:?}");
    assert_eq!(cache.stats().counters.storage_down_settled_copies, 1);
    complete_all(&mut cache);
    assert_eq!(cache.ticket_status(ticket).unwrap(), TicketStatus::Shortened { cached_blocks: 0 });
    // It computes both blocks into its own table; the tier still holds them.
    cache.commit(RequestId(7), prompt, &second).unwrap();
    cache.finish(RequestId(7)).unwrap();
    check(&cache);
    assert_eq!(cache.cached_prefix(&second).device_blocks, 2);
}

// A write-back STORE made before the tier went down and not handed out yet is settled as a
// failed STORE (its reservation given back), not sent to the tier.
#[test]
fn a_store_made_before_the_tier_went_down_but_not_yet_handed_out_gives_its_blocks_back() {
    let mut cache = three_small_tiers();
    let first = hashes(&[1, 2]);
    push_to_storage(&mut cache, 1, &first);
    assert_eq!(match_and_allocate(&mut cache, 90, &first), 2);
    let handed_out = loads(&mut cache);
    assert_eq!(handed_out.len(), 1);
    // Other prompts fill the host tier meanwhile; request 70's allocation then pushes cached
    // blocks down to host, and host blocks down to the tier: write-backs, not handed out yet
    // when the LOAD's outcome comes.
    for id in 60..62u64 {
        let base = u128::from(id) * 100;
        serve(&mut cache, id, &hashes(&[base, base + 1]));
    }
    let used = cache.storage_used_blocks();
    let blocks = hashes(&[7_000, 7_001, 7_002, 7_003]);
    let prompt = blocks.len() * BLOCK_TOKENS as usize;
    cache.match_prefix(RequestId(70), &blocks, prompt).unwrap();
    cache.allocate(RequestId(70), prompt, 0).unwrap();
    check(&cache);
    assert!(cache.storage_used_blocks() > used, "set-up: the allocation wrote nothing back");
    cache.complete_storage_transfer(handed_out[0].id, Ok(Some(&[Unavailable; 2]))).unwrap();
    check(&cache);
    assert!(cache.storage_tier_down());
    assert_eq!(cache.stats().counters.storage_down_settled_copies, 1);
    let late: Vec<Transfer> = complete_all(&mut cache);
    assert!(
        late.iter().all(|copy| !copy.kind.is_storage()),
        "a STORE handed out to a tier already marked down: {late:?}"
    );
    assert!(cache.storage_used_blocks() <= used, "the write-backs' blocks are given back");
    assert!(cache.stats().counters.store_failed_blocks > 0);
    cache.commit(RequestId(70), prompt, &blocks).unwrap();
    cache.finish(RequestId(70)).unwrap();
    cache.abort(RequestId(90)).unwrap();
    check(&cache);
}

/// Serves `blocks` (a chain of four) and fillers until its first blocks are on host only and
/// the rest on storage only, as write-back leaves a prompt (leaf first); returns the two parts.
fn half_on_host_half_on_storage(
    cache: &mut CacheManager,
    blocks: &[BlockHash],
) -> (Vec<BlockHash>, Vec<BlockHash>) {
    serve(cache, 1, blocks);
    let mut round = 0u128;
    loop {
        let found = cache.cached_prefix(blocks);
        if found.storage_blocks > 0 && found.host_blocks > 0 && found.device_blocks == 0 {
            let host_part = blocks[..found.host_blocks].to_vec();
            return (host_part, blocks[found.host_blocks..].to_vec());
        }
        round += 1;
        assert!(round < 40, "set-up: never half on host, half on storage: {found:?}");
        // Two-block fillers: the host tier gives up two blocks at a time, leaves first.
        let base = 1000 + 10 * round;
        serve(cache, 1000 + round as u64, &hashes(&[base, base + 1]));
    }
}

// Under write-back a prompt leaves host leaf first, so its last blocks are storage-only while
// its first are still host-only. Host pressure during an outage drops the host-only parent
// (no write-back to a tier that is down); the storage-only children the tier holds intact
// must not be forgotten with it: they wait for the parent and are storage hits again once it
// is cached again.
#[test]
fn an_outage_does_not_make_the_tier_forget_blocks_it_holds_below_a_host_only_parent() {
    let (mut cache, first) = (three_small_tiers(), hashes(&[1, 2, 3, 4]));
    let (host_part, on_storage) = half_on_host_half_on_storage(&mut cache, &first);
    let mut forgotten = Vec::new();
    cache.take_forgotten_blocks(&mut forgotten);
    assert!(cache.storage_tier_failed());
    // Host pressure during the outage.
    for round in 0..6u128 {
        let base = 5000 + 10 * round;
        serve(&mut cache, 5000 + round as u64, &hashes(&[base, base + 1, base + 2, base + 3]));
    }
    assert_eq!(cache.cached_prefix(&first).blocks(), 0, "set-up: the host-only parent stayed");
    forgotten.clear();
    cache.take_forgotten_blocks(&mut forgotten);
    let lost: Vec<&BlockHash> = on_storage.iter().filter(|hash| forgotten.contains(hash)).collect();
    assert!(lost.is_empty(), "blocks the tier holds intact are forgotten: {lost:?}");
    assert_eq!(cache.stats().counters.storage_down_orphaned_blocks, on_storage.len() as u64);
    assert_eq!(cache.storage_blocks_waiting_for_parent(), on_storage.len());

    // Back up: the parent computed and cached again, its stored children are storage hits.
    cache.storage_tier_recovered();
    serve(&mut cache, 77, &host_part);
    assert_eq!(cache.cached_prefix(&first).storage_blocks, on_storage.len());
    assert_eq!(cache.storage_blocks_waiting_for_parent(), 0);
    assert_eq!(match_and_allocate(&mut cache, 78, &first), on_storage.len());
    assert_eq!(loads(&mut cache).len(), 1);
    check(&cache);
}

// One bad block (an EIO on one slot of a disk, a key Redis refuses) while the rest of the
// command is answered is a fault of that block, not of the tier: the tier stays up, and the
// block is dropped (and forgotten) as a missing one is, so that it is not loaded again.
#[test]
fn a_load_with_one_unavailable_block_among_answered_ones_drops_that_block_and_leaves_the_tier_up() {
    let (cache, first, forgotten) = load_four_answered(&[Landed, Unavailable, Landed, Landed]);
    assert!(!cache.storage_tier_down(), "one bad block marks the tier down");
    assert_eq!(cache.stats().counters.storage_outages, 0);
    // Only the block that landed is cached: the bad one (and the blocks below it) left, and the
    // tier is told to forget it.
    assert_eq!(cache.cached_prefix(&first).blocks(), 1);
    assert!(forgotten.contains(&first[1]), "{forgotten:?}");
    assert_eq!(cache.lookup(&first, prompt_hitting(4)).unwrap().storage_blocks, 0);
}

/// Four blocks on storage, matched and loaded by request 2, the LOAD answered `outcomes`, then
/// the request aborted. Returns the cache, the blocks and those forgotten since the LOAD.
fn load_four_answered(
    outcomes: &[BlockOutcome; 4],
) -> (CacheManager, Vec<BlockHash>, Vec<BlockHash>) {
    let mut cache = three_small_tiers();
    let first = four_blocks_on_storage(&mut cache);
    let mut forgotten = Vec::new();
    cache.take_forgotten_blocks(&mut forgotten);
    assert_eq!(match_and_allocate(&mut cache, 2, &first), 4);
    let loads = loads(&mut cache);
    assert_eq!(loads.len(), 1);
    cache.complete_storage_transfer(loads[0].id, Ok(Some(outcomes))).unwrap();
    check(&cache);
    complete_all(&mut cache);
    cache.abort(RequestId(2)).unwrap();
    check(&cache);
    forgotten.clear();
    cache.take_forgotten_blocks(&mut forgotten);
    (cache, first, forgotten)
}

// A STORE where some blocks were written and one came back unavailable leaves the tier up: the
// unavailable block is not written (given back), the others are stored.
#[test]
fn a_store_with_one_unavailable_block_among_written_ones_leaves_the_tier_up() {
    let mut cache = three_small_tiers();
    let mut round = 0u128;
    let store = loop {
        round += 1;
        assert!(round < 20, "set-up: no write-back of two blocks or more");
        let base = 100 * round;
        let blocks = hashes(&[base, base + 1, base + 2, base + 3]);
        let request = RequestId(round as u64);
        let prompt = 4 * BLOCK_TOKENS as usize;
        cache.match_prefix(request, &blocks, prompt).unwrap();
        cache.allocate(request, prompt, 0).unwrap();
        let mut store = None;
        for transfer in cache.take_transfers() {
            if transfer.kind == TransferKind::HostToStorage && transfer.pairs.len() >= 2 {
                store = Some(transfer);
            } else if transfer.kind == TransferKind::HostToStorage {
                cache.complete_storage_transfer(transfer.id, Ok(None)).unwrap();
            } else {
                cache.complete_transfer(transfer.id, Ok(())).unwrap();
            }
        }
        if store.is_some() {
            cache.abort(request).unwrap();
        } else {
            complete_all(&mut cache);
            cache.commit(request, prompt, &blocks).unwrap();
            cache.finish(request).unwrap();
        }
        check(&cache);
        if let Some(store) = store {
            break store;
        }
    };
    let used = cache.storage_used_blocks();
    let mut results = vec![Landed; store.pairs.len()];
    results[0] = Unavailable;
    cache.complete_storage_transfer(store.id, Ok(Some(&results))).unwrap();
    check(&cache);
    assert!(!cache.storage_tier_down(), "one bad block marks the tier down");
    assert_eq!(cache.storage_used_blocks(), used - 1, "the unavailable block is given back");
    assert_eq!(cache.stats().counters.store_failed_blocks, 1);
}

// A block some rank could not reach the tier for (a Redis part that timed out or lost its
// connection) says the tier is failing, whatever the rest of the command met: the tier goes
// down, the blocks that landed land, and the unreachable one is kept (it may still be there),
// not dropped as one bad block is.
#[test]
fn a_load_with_one_unreachable_block_takes_the_tier_down_and_drops_nothing() {
    let (cache, first, forgotten) = load_four_answered(&[Landed, Unreachable, Landed, Landed]);
    assert!(cache.storage_tier_down());
    assert_eq!(cache.stats().counters.storage_outages, 1);
    let cached = cache.cached_prefix(&first);
    assert_eq!((cached.blocks(), cached.storage_blocks), (4, 3), "the landed block and the rest");
    assert!(first.iter().all(|hash| !forgotten.contains(hash)), "{forgotten:?}");
}

// A write-back STORE of a host-only chain whose first block some rank could not reach the tier
// for takes the tier down; that block leaves (no copy is left of it), but the blocks below it
// the tier holds intact (those stored before, and those of the same STORE that landed) wait as
// orphans, as below a host victim dropped while the tier is down, instead of being forgotten
// with it.
#[test]
fn an_eviction_store_the_tier_could_not_be_reached_for_keeps_the_stored_blocks_below_it() {
    let (mut cache, first) = (three_small_tiers(), hashes(&[1, 2, 3, 4]));
    let (host_part, _) = half_on_host_half_on_storage(&mut cache, &first);
    assert!(host_part.len() >= 2, "set-up: a landed block of the STORE below the failed one");
    let mut forgotten = Vec::new();
    cache.take_forgotten_blocks(&mut forgotten);
    // Host pressure, the tier up: the host part is written back, and that STORE comes back
    // unreachable.
    let writes_host_part = |transfer: &Transfer| {
        transfer.kind == TransferKind::HostToStorage
            && transfer.blocks.iter().any(|block| host_part.contains(&block.hash))
    };
    let mut failed = 0;
    for round in 0..6u128 {
        let base = 5000 + 10 * round;
        let blocks = hashes(&[base, base + 1, base + 2, base + 3]);
        let (request, prompt) = (RequestId(5000 + round as u64), 4 * BLOCK_TOKENS as usize);
        cache.match_prefix(request, &blocks, prompt).unwrap();
        cache.allocate(request, prompt, 0).unwrap();
        for store in complete_all_but(&mut cache, writes_host_part) {
            // The chain's first block unreachable; the rest of the STORE (the host part's other
            // blocks, other prompts' blocks) lands.
            let outcomes: Vec<_> = store
                .blocks
                .iter()
                .map(|block| if block.hash == first[0] { Unreachable } else { Landed })
                .collect();
            assert!(outcomes.len() >= 2, "set-up: a STORE of one block: {store:?}");
            let written = store.blocks.iter().filter(|block| host_part.contains(&block.hash));
            failed += written.count();
            cache.complete_storage_transfer(store.id, Ok(Some(&outcomes))).unwrap();
        }
        complete_all(&mut cache);
        cache.commit(request, prompt, &blocks).unwrap();
        cache.finish(request).unwrap();
        check(&cache);
        if failed > 0 {
            break;
        }
    }
    assert_eq!(failed, host_part.len(), "set-up: the host part was not written back at once");
    assert!(cache.storage_tier_down());
    assert_eq!(cache.cached_prefix(&first).blocks(), 0, "the first block has no copy left");
    forgotten.clear();
    cache.take_forgotten_blocks(&mut forgotten);
    let lost: Vec<&BlockHash> = first[1..].iter().filter(|hash| forgotten.contains(hash)).collect();
    assert!(lost.is_empty(), "blocks the tier holds intact are forgotten: {lost:?}");
    assert_eq!(cache.storage_blocks_waiting_for_parent(), first.len() - 1);
    check(&cache);
}
