//! The scheduler's use of the storage tier, step by step: write-back of blocks leaving the host
//! tier, storage hits, a storage -> host -> device load as one ticket, and failed loads.

use kvshm::hash::BlockHash;
use kvshm::manager::{
    BlockOutcome, CacheConfig, CacheManager, RequestId, StorageWritePolicy, TicketStatus,
    TransferKind,
};

use crate::support::scheduler::{
    check, complete_all, complete_all_but, failure, hashes, manager, prompt_hitting,
    push_first_prompt_to_storage, serve, three_tiny_tiers, BLOCK_TOKENS,
};

#[test]
fn blocks_leaving_the_host_tier_are_written_back_and_then_hit_on_storage() {
    let mut cache = three_tiny_tiers();
    let first = push_first_prompt_to_storage(&mut cache);
    let found = cache.cached_prefix(&first);
    assert_eq!((found.device_blocks, found.host_blocks), (0, 0), "{found:?}");
    assert!(found.storage_blocks >= 2, "{found:?}");
    let counters = cache.stats().counters;
    assert!(counters.evictions.host_written_back >= 2, "{counters:?}");
    assert_eq!(counters.stored_blocks, counters.store_blocks_issued);
    assert_eq!(cache.stats().storage_used, cache.storage_used_blocks());
    check(&cache);
}

#[test]
fn stores_name_each_block_by_hash_parent_and_depth() {
    let mut cache = three_tiny_tiers();
    let first = hashes(&[1, 2]);
    serve(&mut cache, 0, &first);
    let mut stored = Vec::new();
    for (index, base) in [10u128, 20, 30].into_iter().enumerate() {
        let request = RequestId(1 + index as u64);
        let blocks = hashes(&[base, base + 1]);
        let found = cache.match_prefix(request, &blocks, 8).unwrap();
        cache.allocate(request, 8 - found.cached_tokens, 0).unwrap();
        for transfer in complete_all(&mut cache) {
            if transfer.kind == TransferKind::HostToStorage {
                assert_eq!(transfer.blocks.len(), transfer.pairs.len());
                stored.extend(transfer.blocks);
            }
        }
        cache.commit(request, 8, &blocks).unwrap();
        cache.finish(request).unwrap();
    }
    let block = |value: u128| stored.iter().find(|block| block.hash == BlockHash(value));
    let one = block(1).expect("block 1 was stored");
    assert_eq!((one.parent, one.depth), (BlockHash(0), 0));
    let two = block(2).expect("block 2 was stored");
    assert_eq!((two.parent, two.depth), (BlockHash(1), 1));
}

#[test]
fn a_storage_hit_loads_into_host_then_device_under_one_ticket() {
    let mut cache = three_tiny_tiers();
    let first = push_first_prompt_to_storage(&mut cache);
    let request = RequestId(9);
    let found = cache.match_prefix(request, &first, prompt_hitting(2)).unwrap();
    assert_eq!((found.device_blocks, found.host_blocks, found.storage_blocks), (0, 0, 2));
    let ticket = cache.allocate(request, 1, 0).unwrap().ticket;
    check(&cache);
    let mut loads = 0;
    let mut swap_ins_after_load = 0;
    loop {
        let transfers = cache.take_transfers();
        if transfers.is_empty() {
            break;
        }
        for transfer in transfers {
            match transfer.kind {
                TransferKind::StorageToHost => {
                    loads += transfer.pairs.len();
                    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Pending));
                    // The swap-in behind it is not handed out before it lands.
                    assert!(cache
                        .take_transfers()
                        .iter()
                        .all(|t| t.kind != TransferKind::HostToDevice));
                }
                TransferKind::HostToDevice => {
                    assert_eq!(loads, 2, "the swap-in comes after the load");
                    swap_ins_after_load += transfer.pairs.len();
                }
                _ => {}
            }
            cache.complete_transfer(transfer.id, Ok(())).unwrap();
            check(&cache);
        }
    }
    assert_eq!((loads, swap_ins_after_load), (2, 2));
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Ready));
    let now = cache.cached_prefix(&first);
    assert_eq!(now.device_blocks, 2, "{now:?}");
    let counters = cache.stats().counters;
    assert_eq!((counters.hits.storage_blocks, counters.loaded_blocks), (2, 2));
    cache.finish(request).unwrap();
    check(&cache);
}

#[test]
fn a_load_whose_first_block_is_missing_shortens_the_hit_and_forgets_the_chain_at_once() {
    let mut cache = three_tiny_tiers();
    let first = push_first_prompt_to_storage(&mut cache);
    let request = RequestId(9);
    cache.match_prefix(request, &first, prompt_hitting(2)).unwrap();
    let ticket = cache.allocate(request, 1, 0).unwrap().ticket;
    // The stores writing back the host blocks the load takes go first.
    let load = loop {
        let transfers = cache.take_transfers();
        assert!(!transfers.is_empty(), "the load is handed out");
        let mut load = None;
        for transfer in transfers {
            match transfer.kind {
                TransferKind::StorageToHost => load = Some(transfer),
                _ => cache.complete_transfer(transfer.id, Ok(())).unwrap(),
            }
        }
        if let Some(load) = load {
            break load;
        }
    };
    let free_host = cache.free_host_blocks();
    cache
        .complete_storage_transfer(
            load.id,
            Ok(Some(&[BlockOutcome::Missing, BlockOutcome::Landed])),
        )
        .unwrap();
    check(&cache);
    // Not a failure: the request computes both blocks into the blocks it was given.
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Shortened { cached_blocks: 0 }));
    assert_eq!(cache.free_host_blocks(), free_host + 2, "the load's host blocks are free again");
    assert!(cache.take_transfers().iter().all(|t| t.kind != TransferKind::HostToDevice));
    // The missing block and the one below it are gone before any poll: a retry computes them.
    assert_eq!(cache.cached_prefix(&first).blocks(), 0);
    assert_eq!(cache.storage_used_blocks(), cache.stats().storage_used);
    let prompt = first.len() * BLOCK_TOKENS as usize;
    cache.commit(request, prompt, &first).unwrap();
    check(&cache);
    cache.finish(request).unwrap();
    check(&cache);
    assert_eq!(cache.cached_prefix(&first).device_blocks, 2, "computed and cached again");
}

#[test]
fn a_full_storage_tier_drops_its_least_recently_used_leaves() {
    let mut cache =
        manager(CacheConfig::new(BLOCK_TOKENS, 4).with_host_blocks(2).with_storage_blocks(2));
    for base in 0..8u128 {
        serve(&mut cache, base as u64, &hashes(&[100 * base + 1, 100 * base + 2]));
    }
    let stats = cache.stats();
    assert!(stats.storage_used <= 2);
    assert!(stats.counters.evictions.storage_dropped > 0, "{stats:?}");
    check(&cache);
}

#[test]
fn write_through_stores_blocks_as_they_settle_on_host_so_their_eviction_writes_nothing() {
    let config = CacheConfig::new(BLOCK_TOKENS, 4)
        .with_host_blocks(2)
        .with_storage_blocks(8)
        .with_storage_write_policy(StorageWritePolicy::WriteThrough);
    let mut cache = manager(config);
    let first = push_first_prompt_to_storage(&mut cache);
    for index in 0..3 {
        cache.poll();
        complete_all(&mut cache);
        serve(&mut cache, 20 + index, &hashes(&[500 + u128::from(index as u8), 600]));
    }
    let counters = cache.stats().counters;
    assert!(counters.evictions.host_to_storage_metadata > 0, "{counters:?}");
    assert!(cache.cached_prefix(&first).storage_blocks >= 1);
    check(&cache);
}

#[test]
fn a_storage_tier_without_a_host_tier_is_refused() {
    let config = CacheConfig::new(BLOCK_TOKENS, 3).with_storage_blocks(2);
    assert!(CacheManager::new(config).is_err());
}

#[test]
fn stored_blocks_found_at_start_join_the_tree_at_once_or_when_their_parent_is_committed() {
    let mut cache = three_tiny_tiers();
    let adopted = cache.adopt_stored_blocks([
        (BlockHash(1), BlockHash(0), 0),
        (BlockHash(2), BlockHash(1), 1),
        (BlockHash(12), BlockHash(11), 1), // its parent is not cached
        (BlockHash(99), BlockHash(98), 0), // a first block chains to 0: not a first block
    ]);
    assert_eq!(adopted, 2);
    assert_eq!(cache.storage_blocks_waiting_for_parent(), 2);
    check(&cache);
    let found = cache.cached_prefix(&hashes(&[1, 2]));
    assert_eq!(found.storage_blocks, 2, "{found:?}");
    serve(&mut cache, 0, &hashes(&[11, 40]));
    assert_eq!(cache.storage_blocks_waiting_for_parent(), 1);
    let found = cache.cached_prefix(&hashes(&[11, 12]));
    assert_eq!((found.device_blocks, found.storage_blocks), (1, 1), "{found:?}");
    assert_eq!(cache.storage_used_blocks(), 3);
    check(&cache);
}

/// Adopting blocks that are cached already (a second listing of the tier, overlapping the tree)
/// leaves them as they are: none is forgotten (the tier would drop a block the tree counts), none
/// counted twice, and their children in the listing are found under them. A full tier made no
/// difference to that: its capacity was checked before whether the block was cached.
#[test]
fn adopting_blocks_cached_already_leaves_them_alone_even_with_the_tier_full() {
    let mut cache =
        manager(CacheConfig::new(BLOCK_TOKENS, 4).with_host_blocks(2).with_storage_blocks(3));
    let listing = [
        (BlockHash(1), BlockHash(0), 0),
        (BlockHash(2), BlockHash(1), 1),
        (BlockHash(3), BlockHash(2), 2),
    ];
    assert_eq!(cache.adopt_stored_blocks(listing), 3);
    let mut forgotten = Vec::new();
    cache.take_forgotten_blocks(&mut forgotten);
    assert!(forgotten.is_empty(), "{forgotten:?}");
    check(&cache);

    // The tier is full now; the same listing again, and again with a block past the capacity.
    assert_eq!(cache.adopt_stored_blocks(listing), 0);
    let beyond = [(BlockHash(1), BlockHash(0), 0), (BlockHash(4), BlockHash(1), 1)];
    assert_eq!(cache.adopt_stored_blocks(beyond), 0);
    cache.take_forgotten_blocks(&mut forgotten);
    assert_eq!(forgotten, vec![BlockHash(4)], "only the block past the capacity is forgotten");
    assert_eq!(cache.storage_used_blocks(), 3);
    assert_eq!(cache.storage_blocks_waiting_for_parent(), 0);
    let found = cache.cached_prefix(&hashes(&[1, 2, 3]));
    assert_eq!(found.storage_blocks, 3, "{found:?}");
    check(&cache);

    // A block cached on device alone, listed while the tier is full: the tree does not count the
    // tier's copy, so the tier forgets it.
    serve(&mut cache, 1, &hashes(&[50, 51]));
    assert_eq!(cache.cached_prefix(&hashes(&[50])).device_blocks, 1);
    assert_eq!(cache.adopt_stored_blocks([(BlockHash(50), BlockHash(0), 0)]), 0);
    cache.take_forgotten_blocks(&mut forgotten);
    assert_eq!(forgotten, vec![BlockHash(4), BlockHash(50)]);
    check(&cache);
}

/// A listing that names a block and not its parent (a hot parent that never reached storage,
/// or a second listing of part of the tier) finds the parent in the tree: the block joins under
/// it at once, or, cached already, is left alone; none waits as an orphan, which would have the
/// tier forget a block the tree counts once it expired.
#[test]
fn a_listed_block_whose_parent_is_cached_joins_under_it_unlisted_parent_or_not() {
    let mut cache = three_tiny_tiers();
    serve(&mut cache, 0, &hashes(&[1, 2]));
    let listed = [(BlockHash(3), BlockHash(2), 2)];
    assert_eq!(cache.adopt_stored_blocks(listed), 1);
    assert_eq!(cache.storage_blocks_waiting_for_parent(), 0);
    check(&cache);
    assert_eq!(cache.adopt_stored_blocks(listed), 0);
    assert_eq!(cache.storage_blocks_waiting_for_parent(), 0);
    let mut forgotten = Vec::new();
    cache.take_forgotten_blocks(&mut forgotten);
    assert!(forgotten.is_empty(), "{forgotten:?}");
    let found = cache.cached_prefix(&hashes(&[1, 2, 3]));
    assert_eq!((found.device_blocks, found.storage_blocks), (2, 1), "{found:?}");
    assert_eq!(cache.storage_used_blocks(), 1);
    check(&cache);
}

/// A FORGET sent again leaves out the blocks the tree counts on storage or whose STORE is in
/// flight (a STORE of the block went out after the first FORGET), but not those of a STORE of an
/// older generation: the reset forgot its blocks, and nothing would forget them again.
#[test]
fn a_resent_forget_keeps_the_blocks_of_a_store_from_before_a_reset() {
    let mut cache = three_tiny_tiers();
    serve(&mut cache, 0, &hashes(&[1, 2]));
    serve(&mut cache, 1, &hashes(&[10, 11]));
    serve(&mut cache, 2, &hashes(&[20, 21]));
    // The fourth prompt writes the first one back to storage: its STOREs stay in flight.
    let (request, blocks) = (RequestId(3), hashes(&[30, 31]));
    let prompt = 2 * BLOCK_TOKENS as usize;
    cache.match_prefix(request, &blocks, prompt).unwrap();
    cache.allocate(request, prompt, 0).unwrap();
    let held =
        complete_all_but(&mut cache, |transfer| transfer.kind == TransferKind::HostToStorage);
    let stored: Vec<BlockHash> =
        held.iter().flat_map(|store| store.blocks.iter().map(|block| block.hash)).collect();
    assert!(!stored.is_empty(), "a STORE in flight");
    let mut resent = stored.clone();
    cache.keep_forgettable(&mut resent);
    assert!(resent.is_empty(), "being stored now: {resent:?}");

    cache.reset(true).unwrap();
    let mut resent = stored.clone();
    cache.keep_forgettable(&mut resent);
    assert_eq!(resent, stored, "a STORE of before the reset counts nothing");
    check(&cache);
}

/// Serves a workload whose prompts come back (so that blocks gather hits) through a small device
/// and host tier over storage, under `policy`; returns the manager after the last request.
fn serve_recurring_prompts(policy: StorageWritePolicy) -> CacheManager {
    let config = CacheConfig::new(BLOCK_TOKENS, 4)
        .with_host_blocks(2)
        .with_storage_blocks(16)
        .with_storage_write_policy(policy);
    let mut cache = manager(config);
    // Prompt k is blocks [k, k + 100, k + 200]; prompts 0 and 1 come back often, the others once.
    let order = [0u128, 1, 2, 0, 3, 1, 4, 0, 5, 1, 6, 0, 7, 1];
    for (id, &k) in order.iter().enumerate() {
        cache.poll();
        complete_all(&mut cache);
        serve(&mut cache, id as u64, &hashes(&[k, k + 100, k + 200]));
        check(&cache);
    }
    cache
}

#[test]
fn selective_write_through_stores_at_once_only_the_blocks_with_enough_hits() {
    let counters = |policy| serve_recurring_prompts(policy).stats().counters;
    let selective = |threshold| StorageWritePolicy::WriteThroughSelective { threshold };
    // The two ends: a threshold every block meets is write-through, one none meets write-back.
    assert_eq!(counters(selective(1)), counters(StorageWritePolicy::WriteThrough));
    assert_eq!(counters(selective(65_535)), counters(StorageWritePolicy::WriteBack));
    // In between, blocks of the recurring prompts are stored as they settle on host (their later
    // eviction from host costs no write), the others are written back when they leave.
    let through = counters(StorageWritePolicy::WriteThrough).evictions.host_to_storage_metadata;
    let back = counters(StorageWritePolicy::WriteBack).evictions.host_to_storage_metadata;
    let between = counters(selective(2)).evictions.host_to_storage_metadata;
    assert!(back < between && between < through, "{back} < {between} < {through}");
}

#[test]
fn a_recomputed_block_found_on_storage_takes_the_requests_copy_and_its_decode_blocks_follow() {
    let mut cache = three_tiny_tiers();
    let first = push_first_prompt_to_storage(&mut cache);
    assert_eq!(cache.cached_prefix(&first).storage_blocks, 2);
    // The same block-aligned prompt again, with two blocks of output: its first block hits on
    // storage, its last is recomputed (the last-token rule) though the tier holds it.
    let request = RequestId(40);
    let prompt = first.len() * BLOCK_TOKENS as usize;
    let found = cache.match_prefix(request, &first, prompt).unwrap();
    assert_eq!(found.storage_blocks, 1);
    let output = 2 * BLOCK_TOKENS as usize;
    cache.allocate(request, prompt - found.cached_tokens + output, 0).unwrap();
    complete_all(&mut cache);
    let mut all = first.clone();
    all.extend(hashes(&[3, 4]));
    cache.commit(request, prompt + output, &all).unwrap();
    check(&cache);
    cache.finish(request).unwrap();
    check(&cache);
    let now = cache.cached_prefix(&all);
    assert_eq!(now.blocks(), 4, "the decode blocks are cached under the prompt: {now:?}");
    assert_eq!(now.device_blocks, 4, "{now:?}");
}

/// The storage-only blocks the tree counts (the tier's only copies).
fn storage_only_blocks(cache: &CacheManager) -> usize {
    let tree = cache.tree();
    tree.ids().filter(|&id| tree.node(id).state() == kvshm::tree::NodeState::Storage).count()
}

#[test]
fn write_through_never_drops_a_storage_only_block_to_back_up_one_still_on_host() {
    let config = CacheConfig::new(BLOCK_TOKENS, 4)
        .with_host_blocks(4)
        .with_storage_blocks(6)
        .with_storage_write_policy(StorageWritePolicy::WriteThrough);
    let mut cache = manager(config);
    for base in 0..24u128 {
        serve(&mut cache, base as u64, &hashes(&[100 * base + 1, 100 * base + 2]));
        // The write-through STOREs are issued by poll: they may only take free room.
        let before = storage_only_blocks(&cache);
        cache.poll();
        check(&cache);
        assert!(
            storage_only_blocks(&cache) >= before,
            "a write-through dropped a storage-only block"
        );
        complete_all(&mut cache);
    }
    let counters = cache.stats().counters;
    assert!(counters.write_through_skipped > 0, "the tier was full: {counters:?}");
    assert!(storage_only_blocks(&cache) > 0, "{counters:?}");
}

/// Review finding 1: a LOAD (L2) ordered after a STORE (T) still reading the host block L2 was
/// given, and after another LOAD (L1); a swap-in above both fails (its nodes abandon their loads,
/// L2's host block becomes its reservation), then L1 fails: the host block T still reads must
/// not go back to the pool before T completes.
#[test]
fn a_load_behind_a_failed_one_keeps_the_host_block_a_store_still_reads_until_that_store_lands() {
    let mut cache =
        manager(CacheConfig::new(BLOCK_TOKENS, 6).with_host_blocks(9).with_storage_blocks(16));
    let chain = hashes(&[1, 2, 3]);
    serve(&mut cache, 1, &chain);
    for (index, base) in [10u128, 20, 30, 40, 50, 60, 70].into_iter().enumerate() {
        serve(&mut cache, 10 + index as u64, &hashes(&[base, base + 1]));
    }
    // A on host, B and C on storage only, the host tier full of blocks never stored.
    let found = cache.cached_prefix(&chain);
    assert_eq!((found.host_blocks, found.storage_blocks), (1, 2), "set-up: {found:?}");
    assert_eq!(cache.free_host_blocks(), 0);
    for (id, blocks) in [(20u64, 1usize), (21, 2), (22, 3)] {
        let found = cache.match_prefix(RequestId(id), &chain[..blocks], prompt_hitting(blocks));
        assert_eq!(found.unwrap().blocks(), blocks);
    }
    for id in [20, 21, 22] {
        cache.allocate(RequestId(id), 1, 0).unwrap();
        check(&cache);
    }
    // Everything runs but the last request's STORE (T, writing back the host block C's LOAD
    // L2 was given) until A's swap-in (S0) and B's LOAD (L1) are handed out; L2 waits for T.
    let (mut swap_in, mut load, mut last_store) = (None, None, None);
    let mut stores = Vec::new();
    for transfer in cache.take_transfers() {
        if transfer.kind == TransferKind::HostToStorage {
            stores.push(transfer.id);
            last_store = Some(transfer.id);
        } else {
            stores.push(transfer.id);
        }
        match transfer.kind {
            TransferKind::HostToDevice => swap_in = Some(transfer.id),
            TransferKind::StorageToHost => load = Some(transfer.id),
            _ => {}
        }
    }
    let last_store = last_store.expect("the claimed host blocks are written back");
    let mut pending: Vec<_> =
        stores.into_iter().filter(|&id| Some(id) != swap_in && Some(id) != load).collect();
    while swap_in.is_none() || load.is_none() {
        let next = pending.iter().position(|&id| id != last_store);
        let id = pending.remove(next.expect("something else to complete"));
        cache.complete_transfer(id, Ok(())).unwrap();
        check(&cache);
        for transfer in cache.take_transfers() {
            match transfer.kind {
                TransferKind::HostToDevice if swap_in.is_none() => swap_in = Some(transfer.id),
                TransferKind::StorageToHost if load.is_none() => load = Some(transfer.id),
                _ => pending.push(transfer.id),
            }
        }
    }
    let (swap_in, load) = (swap_in.unwrap(), load.unwrap());
    assert!(cache.transfer_stage(last_store) == kvshm::manager::TransferStage::Issued);
    cache.complete_transfer(swap_in, Err(failure())).unwrap();
    check(&cache);
    cache.complete_transfer(load, Err(failure())).unwrap();
    check(&cache);
    for id in [20, 21, 22] {
        cache.abort(RequestId(id)).unwrap();
        check(&cache);
    }
    complete_all(&mut cache);
    cache.poll();
    check(&cache);
}
