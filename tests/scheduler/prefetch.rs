//! Prefetch, storage queries and FORGET, on the scheduler alone: storage-only blocks brought up to
//! host before their request, a LOAD shared by an allocation that arrives meanwhile, a failed
//! prefetch that fails nothing else, the prefetch ticket's life, blocks found by a QUERY, and
//! the blocks the tree drops handed out for FORGET commands.

use kvshm::hash::BlockHash;
use kvshm::manager::{
    CacheConfig, CacheManager, PrefetchError, QueryError, RequestId, TicketError, TicketId,
    TicketStatus, TransferKind, MAX_PREFETCH_TICKETS,
};
use kvshm::tree::{NodeId, NodeState};

use crate::support::scheduler::{
    check, complete_all, complete_all_but, failure, hashes, manager, prompt_hitting,
    push_first_prompt_to_storage, serve, serve_prompt, settle_copies, three_tiny_tiers,
    BLOCK_TOKENS,
};

/// Completes every copy as it is handed out, the LOADs with `load_ok`; returns them all.
fn complete_loads(cache: &mut CacheManager, load_ok: bool) -> Vec<kvshm::manager::Transfer> {
    let fails = |transfer: &kvshm::manager::Transfer| {
        transfer.kind == TransferKind::StorageToHost && !load_ok
    };
    settle_copies(cache, |transfer| Some(if fails(transfer) { Err(failure()) } else { Ok(()) })).0
}

/// Prefetches `prompt`, answers its one QUERY with the first `found` blocks past the tree on the
/// tier, and completes every copy; returns the prefetch's ticket, ready.
fn prefetch_finding(cache: &mut CacheManager, prompt: &[BlockHash], found: usize) -> TicketId {
    let ticket = cache.prefetch(prompt).unwrap().expect("a query past the tree");
    let mut queries = Vec::new();
    cache.take_storage_queries(&mut queries);
    cache.complete_storage_query(queries[0].id, Ok(found)).unwrap();
    complete_loads(cache, true);
    assert_eq!(cache.prefetch_status(ticket), Ok(TicketStatus::Ready));
    ticket
}

/// Completes every copy handed out but the one LOAD, which it returns, unfinished.
fn hold_the_load(cache: &mut CacheManager) -> kvshm::manager::Transfer {
    let mut held = complete_all_but(cache, |copy| copy.kind == TransferKind::StorageToHost);
    assert_eq!(held.len(), 1, "one LOAD: {held:?}");
    held.pop().expect("one LOAD")
}

#[test]
fn a_prefetch_brings_storage_blocks_to_host_and_a_later_match_hits_them_there() {
    let mut cache = three_tiny_tiers();
    let first = push_first_prompt_to_storage(&mut cache);
    let ticket = cache.prefetch(&first).unwrap().expect("two blocks to load");
    check(&cache);
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Pending));
    let transfers = complete_loads(&mut cache, true);
    let loads: Vec<_> =
        transfers.iter().filter(|transfer| transfer.kind == TransferKind::StorageToHost).collect();
    assert_eq!(loads.len(), 1, "one LOAD: {transfers:?}");
    assert_eq!(loads[0].pairs.len(), 2);
    assert!(
        transfers.iter().all(|transfer| transfer.kind != TransferKind::HostToDevice),
        "no swap-in behind a prefetch"
    );
    assert_eq!(cache.prefetch_status(ticket), Ok(TicketStatus::Ready));
    assert_eq!(
        cache.prefetch_status(ticket),
        Err(TicketError::UnknownTicket(ticket)),
        "a prefetch ticket read as done is forgotten"
    );
    let found = cache.cached_prefix(&first);
    assert_eq!((found.host_blocks, found.storage_blocks), (2, 0), "{found:?}");
    // The blocks keep their storage copy: leaving host again writes nothing.
    let id = cache.tree().child(NodeId::ROOT, first[0]).unwrap();
    assert!(cache.tree().node(id).stored());
    let request = RequestId(50);
    let matched = cache.match_prefix(request, &first, prompt_hitting(2)).unwrap();
    assert_eq!((matched.host_blocks, matched.storage_blocks), (2, 0));
    cache.allocate(request, 1, 0).unwrap();
    let transfers = complete_loads(&mut cache, true);
    assert!(transfers.iter().all(|transfer| transfer.kind != TransferKind::StorageToHost));
    cache.finish(request).unwrap();
    check(&cache);
    let counters = cache.stats().counters;
    assert_eq!((counters.prefetches, counters.prefetch_load_blocks), (1, 2));
}

#[test]
fn an_allocation_arriving_while_a_prefetch_loads_shares_its_load_and_swaps_in_after_it() {
    let mut cache = three_tiny_tiers();
    let first = push_first_prompt_to_storage(&mut cache);
    let ticket = cache.prefetch(&first).unwrap().unwrap();
    // The host blocks were claimed from write-backs: their STOREs come first.
    let prefetch_load = hold_the_load(&mut cache);
    let request = RequestId(60);
    let matched = cache.match_prefix(request, &first, prompt_hitting(2)).unwrap();
    assert_eq!(matched.storage_blocks, 2, "a block being loaded is a storage hit");
    let allocation = cache.allocate(request, 1, 0).unwrap().ticket;
    check(&cache);
    let held = cache.take_transfers();
    assert!(
        held.iter().all(|transfer| transfer.kind != TransferKind::StorageToHost
            && transfer.kind != TransferKind::HostToDevice),
        "no second LOAD, and the swap-in waits for the prefetch's: {held:?}"
    );
    for transfer in held {
        cache.complete_transfer(transfer.id, Ok(())).unwrap();
    }
    cache.complete_transfer(prefetch_load.id, Ok(())).unwrap();
    check(&cache);
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Ready));
    assert_eq!(cache.ticket_status(allocation), Ok(TicketStatus::Pending));
    let swap_ins = complete_loads(&mut cache, true);
    assert_eq!(
        swap_ins.iter().filter(|transfer| transfer.kind == TransferKind::HostToDevice).count(),
        1
    );
    assert_eq!(cache.ticket_status(allocation), Ok(TicketStatus::Ready));
    assert_eq!(cache.cached_prefix(&first).device_blocks, 2);
    cache.finish(request).unwrap();
    check(&cache);
}

#[test]
fn a_failed_prefetch_load_ends_its_ticket_ready_and_fails_nothing_else() {
    let mut cache = three_tiny_tiers();
    let first = push_first_prompt_to_storage(&mut cache);
    let ticket = cache.prefetch(&first).unwrap().unwrap();
    let other = RequestId(70);
    let unrelated = hashes(&[80, 81]);
    cache.match_prefix(other, &unrelated, 8).unwrap();
    let allocation = cache.allocate(other, 8, 0).unwrap().ticket;
    complete_loads(&mut cache, false);
    // A prefetch is advisory: its misses are counted, never a failure.
    assert_eq!(cache.prefetch_status(ticket), Ok(TicketStatus::Ready));
    assert_eq!(cache.ticket_status(allocation), Ok(TicketStatus::Ready));
    cache.commit(other, 8, &unrelated).unwrap();
    cache.finish(other).unwrap();
    cache.poll();
    check(&cache);
    // The tier failed as a whole (a miss, not a lost block): the blocks are storage-only again
    // and stay cached for the next match.
    assert_eq!(cache.cached_prefix(&first).storage_blocks, first.len());
    let counters = cache.stats().counters;
    assert_eq!(counters.prefetch_failed_blocks, 2);
    assert_eq!(counters.failed_allocations, 0);
}

#[test]
fn prefetch_needs_a_storage_tier_and_a_path_with_nothing_to_load_gives_no_ticket() {
    let mut cache = manager(CacheConfig::new(BLOCK_TOKENS, 4));
    assert_eq!(cache.prefetch(&hashes(&[1])), Err(PrefetchError::NoStorageTier));
    let mut cache = three_tiny_tiers();
    let blocks = hashes(&[1, 2]);
    serve(&mut cache, 0, &blocks);
    // Cached on device, and the tier is asked nothing (the hashes end inside the tree).
    assert_eq!(cache.prefetch(&blocks), Ok(None));
    assert_eq!(
        cache.prefetch_status(TicketId(12345)),
        Err(TicketError::UnknownTicket(TicketId(12345)))
    );
}

#[test]
fn prefetch_tickets_never_read_are_forgotten_past_the_bound() {
    let mut cache = three_tiny_tiers();
    let first = push_first_prompt_to_storage(&mut cache);
    let mut tickets = Vec::new();
    // Each prefetch of blocks past the tree asks the tier (a QUERY), and gets a ticket.
    for round in 0..MAX_PREFETCH_TICKETS as u128 + 2 {
        let ticket = cache.prefetch(&hashes(&[1000 + round])).unwrap().unwrap();
        let mut queries = Vec::new();
        cache.take_storage_queries(&mut queries);
        cache.complete_storage_query(queries[0].id, Ok(0)).unwrap();
        tickets.push(ticket);
    }
    assert_eq!(
        cache.ticket_status(tickets[0]),
        Err(TicketError::UnknownTicket(tickets[0])),
        "the oldest went"
    );
    assert_eq!(cache.ticket_status(*tickets.last().unwrap()), Ok(TicketStatus::Ready));
    check(&cache);
    drop(first);
}

#[test]
fn blocks_a_query_finds_past_the_tree_are_adopted_and_loaded_in_the_same_ticket() {
    let mut cache = three_tiny_tiers();
    let prompt = hashes(&[1, 2, 3, 4]);
    serve(&mut cache, 0, &prompt[..1]);
    let ticket = cache.prefetch(&prompt).unwrap().expect("a query past the tree");
    let mut queries = Vec::new();
    cache.take_storage_queries(&mut queries);
    assert_eq!(queries.len(), 1);
    assert_eq!(queries[0].hashes, prompt[1..].to_vec());
    check(&cache);
    // Blocks 2 and 3 are on every rank; block 4 is not.
    cache.complete_storage_query(queries[0].id, Ok(2)).unwrap();
    check(&cache);
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Pending), "loading");
    let transfers = complete_loads(&mut cache, true);
    assert_eq!(
        transfers
            .iter()
            .filter(|transfer| transfer.kind == TransferKind::StorageToHost)
            .map(|transfer| transfer.pairs.len())
            .sum::<usize>(),
        2
    );
    assert_eq!(cache.prefetch_status(ticket), Ok(TicketStatus::Ready));
    let found = cache.cached_prefix(&prompt);
    assert_eq!((found.device_blocks, found.host_blocks, found.blocks()), (1, 2, 3), "{found:?}");
    let counters = cache.stats().counters;
    assert_eq!((counters.prefetch_query_blocks, counters.prefetch_found_blocks), (3, 2));
    assert!(cache.complete_storage_query(queries[0].id, Ok(0)).is_err(), "answered once");
}

#[test]
fn a_query_that_fails_adopts_nothing_and_its_ticket_ends_ready() {
    let mut cache = three_tiny_tiers();
    let prompt = hashes(&[1, 2]);
    let ticket = cache.prefetch(&prompt).unwrap().unwrap();
    let mut queries = Vec::new();
    cache.take_storage_queries(&mut queries);
    cache.complete_storage_query(queries[0].id, Err(failure())).unwrap();
    // A prefetch is advisory: its ticket never fails (DESIGN §9), it found nothing.
    assert_eq!(cache.prefetch_status(ticket), Ok(TicketStatus::Ready));
    assert_eq!(cache.cached_prefix(&prompt).blocks(), 0);
    check(&cache);
}

#[test]
fn blocks_the_tree_drops_from_storage_are_handed_out_to_be_forgotten() {
    // Two storage blocks: the third prompt's write-back drops the oldest storage block.
    let mut cache =
        manager(CacheConfig::new(BLOCK_TOKENS, 1).with_host_blocks(1).with_storage_blocks(2));
    let mut forgotten = Vec::new();
    for value in 1..=5u128 {
        serve(&mut cache, value as u64, &hashes(&[value]));
        complete_all(&mut cache);
        cache.take_forgotten_blocks(&mut forgotten);
        check(&cache);
    }
    assert!(cache.stats().counters.evictions.storage_dropped >= 1);
    assert!(forgotten.contains(&BlockHash(1)), "{forgotten:?}");
    assert!(!forgotten.contains(&BlockHash(5)), "{forgotten:?}");
    // Whatever is forgotten is not counted on the tier any more.
    for hash in &forgotten {
        let node = cache.tree().child(NodeId::ROOT, *hash);
        assert!(node.is_none_or(|id| !cache.tree().node(id).stored()), "{hash:?}");
    }
    // A reset forgets everything the tree had.
    cache.reset(true).unwrap();
    forgotten.clear();
    cache.take_forgotten_blocks(&mut forgotten);
    assert!(forgotten.contains(&BlockHash(5)), "{forgotten:?}");
}

#[test]
fn stored_blocks_whose_parent_never_comes_back_expire_and_are_forgotten() {
    let mut cache = three_tiny_tiers();
    // Eight orphans (parent 99 is never cached), then the tier's capacity worth of commits.
    let orphans: Vec<_> =
        (0..8u128).map(|i| (BlockHash(200 + i), BlockHash(99), 1 + i as u32)).collect();
    assert_eq!(cache.adopt_stored_blocks(orphans), 0);
    assert_eq!(cache.storage_blocks_waiting_for_parent(), 8);
    // Orphans do not eat the budget: a block under the root is still adopted.
    assert_eq!(cache.adopt_stored_blocks([(BlockHash(7), BlockHash(0), 0)]), 1);
    for value in 0..8u128 {
        serve(&mut cache, 300 + value as u64, &hashes(&[400 + value]));
        cache.poll();
    }
    assert_eq!(cache.storage_blocks_waiting_for_parent(), 0);
    let mut forgotten = Vec::new();
    cache.take_forgotten_blocks(&mut forgotten);
    assert!(forgotten.contains(&BlockHash(200)), "{forgotten:?}");
    assert_eq!(cache.stats().counters.expired_orphans, 8);
    check(&cache);
}

#[test]
fn a_waiting_stored_block_a_query_adopts_waits_no_more_and_never_expires() {
    let mut cache = three_tiny_tiers();
    let prompt = hashes(&[1, 2]);
    // Block 2 is on the tier and waits for block 1, which is not cached.
    assert_eq!(cache.adopt_stored_blocks([(prompt[1], prompt[0], 1)]), 0);
    assert_eq!(cache.storage_blocks_waiting_for_parent(), 1);
    // A QUERY finds both on the tier: they join the tree, and block 2 waits no more.
    prefetch_finding(&mut cache, &prompt, 2);
    assert_eq!(cache.storage_blocks_waiting_for_parent(), 0);
    check(&cache);
    // The tier's capacity worth of commits: nothing waits, so nothing expires (an expiry would
    // tell the tier to forget block 2, which the tree counts on it).
    for value in 0..8u128 {
        serve(&mut cache, 10 + value as u64, &hashes(&[400 + value]));
        complete_all(&mut cache);
        cache.poll();
        check(&cache);
    }
    assert_eq!(cache.stats().counters.expired_orphans, 0);
}

/// A stored block waits for its parent, and the parent comes back from the tier rather than from
/// a commit (a QUERY finds another service's copy; a listing names it later): the block joins
/// the tree under it then, as it does under a committed parent. Before, it kept waiting while
/// its parent was cached, and a commit of the prompt past the parent (a hit on it) inserted it
/// again as new: the tier then counted it twice, and its expiry forgot a block the tree counts.
#[test]
fn a_stored_block_waiting_for_its_parent_joins_when_a_query_or_a_listing_brings_the_parent() {
    let prompt = hashes(&[1, 2, 3]);
    // A QUERY of the parent alone (block 3 waits below block 2, not queried).
    let mut cache = three_tiny_tiers();
    assert_eq!(cache.adopt_stored_blocks([(prompt[2], prompt[1], 2)]), 0);
    prefetch_finding(&mut cache, &prompt[..2], 2);
    assert_eq!(cache.storage_blocks_waiting_for_parent(), 0);
    assert_eq!(cache.cached_prefix(&prompt).blocks(), 3, "{:?}", cache.cached_prefix(&prompt));
    check(&cache);
    // A listing that names the child before its parent.
    let mut cache = three_tiny_tiers();
    let listing = [(prompt[1], prompt[0], 1), (prompt[0], BlockHash(0), 0)];
    assert_eq!(cache.adopt_stored_blocks(listing), 2, "both joined");
    assert_eq!(cache.storage_blocks_waiting_for_parent(), 0);
    assert_eq!(cache.cached_prefix(&prompt).storage_blocks, 2);
    check(&cache);
}

/// The node of `blocks` (a chain from block 0).
fn node_of(cache: &CacheManager, blocks: &[BlockHash]) -> NodeId {
    blocks.iter().fold(NodeId::ROOT, |parent, &hash| {
        cache.tree().child(parent, hash).expect("the chain is cached")
    })
}

#[test]
fn a_swap_in_failing_above_a_node_a_prefetch_loads_keeps_the_blocks_below_it_storage_only() {
    let mut cache =
        manager(CacheConfig::new(BLOCK_TOKENS, 4).with_host_blocks(4).with_storage_blocks(16));
    let first = hashes(&[1, 2, 3]);
    serve(&mut cache, 0, &first);
    for round in 0..20u128 {
        if cache.cached_prefix(&first).storage_blocks == 3 {
            break;
        }
        serve(&mut cache, 1 + round as u64, &hashes(&[100 + 2 * round, 101 + 2 * round]));
    }
    assert_eq!(cache.cached_prefix(&first).storage_blocks, 3);
    // P (block 1) back on host; S0 and S1 (blocks 2 and 3) on storage below it.
    cache.prefetch(&first[..1]).unwrap().expect("P to load");
    complete_loads(&mut cache, true);
    let found = cache.cached_prefix(&first);
    assert_eq!((found.host_blocks, found.storage_blocks), (1, 2), "{found:?}");
    // R0 swaps P in (F0), held.
    let first_request = RequestId(90);
    cache.match_prefix(first_request, &first[..1], prompt_hitting(1)).unwrap();
    cache.allocate(first_request, 1, 0).unwrap();
    let swap_in =
        complete_all_but(&mut cache, |transfer| transfer.kind == TransferKind::HostToDevice);
    assert_eq!(swap_in.len(), 1, "{swap_in:?}");
    // A prefetch loads S0 and S1 (L), held.
    cache.prefetch(&first).unwrap().expect("S0 and S1 to load");
    let load =
        complete_all_but(&mut cache, |transfer| transfer.kind == TransferKind::StorageToHost);
    assert_eq!(load.len(), 1, "{load:?}");
    assert_eq!(load[0].pairs.len(), 2);
    // R meets S0 loading: it follows the LOAD with a swap-in after F0 and L.
    let second_request = RequestId(91);
    let matched = cache.match_prefix(second_request, &first[..2], prompt_hitting(2)).unwrap();
    assert_eq!(matched.storage_blocks, 1, "{matched:?}");
    cache.allocate(second_request, 1, 0).unwrap();
    let held = complete_all_but(&mut cache, |transfer| {
        matches!(transfer.kind, TransferKind::HostToDevice | TransferKind::StorageToHost)
    });
    assert!(held.is_empty(), "no second LOAD, and the follow waits for F0 and L: {held:?}");
    // F0 fails: P is host-only again, S0 storage-only, and so must S1 be (it was only loading
    // for the prefetch).
    cache.complete_transfer(swap_in[0].id, Err(failure())).unwrap();
    check(&cache);
    cache.complete_transfer(load[0].id, Ok(())).unwrap();
    check(&cache);
    let s0 = node_of(&cache, &first[..2]);
    let s1 = node_of(&cache, &first);
    assert_eq!(cache.tree().node(s0).state(), NodeState::Storage);
    assert_eq!(cache.tree().node(s1).state(), NodeState::Storage);
    assert!(cache.tree().node(s1).stored(), "S1 keeps its storage copy");
    for request in [first_request, second_request] {
        cache.finish(request).unwrap();
    }
    complete_all(&mut cache);
    cache.poll();
    check(&cache);
}

/// Three tiers whose storage tier is full, of two-block prompts `[100 + 2r, 101 + 2r]`.
fn full_tier() -> CacheManager {
    let mut cache = three_tiny_tiers();
    for round in 0..40u128 {
        if cache.storage_used_blocks() == 8 {
            break;
        }
        serve(&mut cache, round as u64, &hashes(&[100 + 2 * round, 101 + 2 * round]));
        complete_all(&mut cache);
    }
    assert_eq!(cache.storage_used_blocks(), 8, "the tier is full");
    cache
}

#[test]
fn a_prefetch_on_a_full_tier_still_asks_it_and_makes_room_for_the_blocks_found() {
    let mut cache = full_tier();
    let prompt = hashes(&[900, 901]);
    let ticket = cache.prefetch(&prompt).unwrap().expect("the tier is asked");
    let mut queries = Vec::new();
    cache.take_storage_queries(&mut queries);
    assert_eq!(queries.len(), 1);
    assert_eq!(queries[0].hashes, prompt);
    cache.complete_storage_query(queries[0].id, Ok(2)).unwrap();
    check(&cache);
    complete_loads(&mut cache, true);
    assert_eq!(cache.prefetch_status(ticket), Ok(TicketStatus::Ready));
    let found = cache.cached_prefix(&prompt);
    assert_eq!(found.blocks(), 2, "both adopted and loaded: {found:?}");
    assert_eq!(cache.stats().counters.prefetch_found_blocks, 2);
    assert!(cache.storage_used_blocks() <= 8);
    let mut forgotten = Vec::new();
    cache.take_forgotten_blocks(&mut forgotten);
    assert!(forgotten.len() >= 2, "the blocks dropped to make room are forgotten: {forgotten:?}");
    check(&cache);
}

#[test]
fn blocks_a_query_finds_never_push_out_blocks_a_request_holds() {
    let mut cache = full_tier();
    // A request holds every storage-only block (matched, not allocated yet).
    let mut holders = Vec::new();
    for round in 0..40u128 {
        let blocks = hashes(&[100 + 2 * round, 101 + 2 * round]);
        if cache.cached_prefix(&blocks).storage_blocks > 0 {
            let request = RequestId(500 + round as u64);
            cache.match_prefix(request, &blocks, prompt_hitting(2)).unwrap();
            holders.push(request);
        }
    }
    assert_eq!(
        cache.tree().count(kvshm::tree::policy::EvictSet::Storage),
        0,
        "every storage block is held"
    );
    let prompt = hashes(&[900, 901]);
    cache.prefetch(&prompt).unwrap().expect("the tier is asked");
    let mut queries = Vec::new();
    cache.take_storage_queries(&mut queries);
    cache.complete_storage_query(queries[0].id, Ok(2)).unwrap();
    check(&cache);
    assert_eq!(cache.cached_prefix(&prompt).blocks(), 0, "no room without dropping held blocks");
    assert_eq!(cache.storage_used_blocks(), 8);
    for request in holders {
        cache.finish(request).unwrap();
    }
    check(&cache);
}

#[test]
fn a_host_block_dropped_because_the_tier_below_has_no_room_is_forgotten() {
    // Device 2, host 1, storage 2: blocks 1 and 2 end on storage, 3 on host, 4 and 5 on device.
    let mut cache =
        manager(CacheConfig::new(BLOCK_TOKENS, 2).with_host_blocks(1).with_storage_blocks(2));
    for value in 1..=5u128 {
        serve(&mut cache, value as u64, &hashes(&[value]));
        complete_all(&mut cache);
    }
    let on_host = hashes(&[3]);
    assert_eq!(cache.cached_prefix(&on_host).host_blocks, 1);
    // Requests hold both storage blocks: the tier can make no room.
    for value in 1..=2u128 {
        let matched = cache.match_prefix(RequestId(10 + value as u64), &hashes(&[value]), 5);
        assert_eq!(matched.unwrap().storage_blocks, 1);
    }
    let mut forgotten = Vec::new();
    cache.take_forgotten_blocks(&mut forgotten);
    // A new prompt evicts a device block to host, which drops block 3 (the slab may hold it:
    // it may have been loaded back from storage).
    serve(&mut cache, 6, &hashes(&[6]));
    complete_all(&mut cache);
    assert_eq!(cache.cached_prefix(&on_host).blocks(), 0, "block 3 was dropped");
    forgotten.clear();
    cache.take_forgotten_blocks(&mut forgotten);
    assert!(forgotten.contains(&BlockHash(3)), "{forgotten:?}");
    check(&cache);
}

#[test]
fn an_orphan_that_finds_no_room_when_its_parent_arrives_is_forgotten() {
    let mut cache = three_tiny_tiers();
    assert_eq!(cache.adopt_stored_blocks([(BlockHash(201), BlockHash(99), 1)]), 0);
    let full: Vec<_> = (0..8u128).map(|i| (BlockHash(300 + i), BlockHash(0), 0)).collect();
    assert_eq!(cache.adopt_stored_blocks(full), 8);
    let mut forgotten = Vec::new();
    cache.take_forgotten_blocks(&mut forgotten);
    assert!(forgotten.is_empty(), "{forgotten:?}");
    serve(&mut cache, 1, &hashes(&[99]));
    assert_eq!(cache.storage_blocks_waiting_for_parent(), 0);
    assert_eq!(cache.cached_prefix(&hashes(&[99, 201])).blocks(), 1, "not adopted");
    cache.take_forgotten_blocks(&mut forgotten);
    assert_eq!(forgotten, [BlockHash(201)], "the tier must not keep what the tree does not count");
    check(&cache);
}

#[test]
fn a_block_forgotten_after_its_query_was_made_is_not_adopted_from_the_answer() {
    let mut cache = three_tiny_tiers();
    let prompt = hashes(&[1, 2]);
    let ticket = cache.prefetch(&prompt).unwrap().expect("a query");
    let mut queries = Vec::new();
    cache.take_storage_queries(&mut queries);
    // Meanwhile a request computes the blocks, and other traffic pushes them off every tier.
    serve(&mut cache, 0, &prompt);
    for round in 0..12u128 {
        serve(&mut cache, 1 + round as u64, &hashes(&[100 + 2 * round, 101 + 2 * round]));
        complete_all(&mut cache);
    }
    let mut forgotten = Vec::new();
    cache.take_forgotten_blocks(&mut forgotten);
    assert!(forgotten.contains(&BlockHash(1)), "{forgotten:?}");
    assert_eq!(cache.cached_prefix(&prompt).blocks(), 0);
    // The answer says both are on the tier, but the FORGET of block 1 may reach it later.
    cache.complete_storage_query(queries[0].id, Ok(2)).unwrap();
    assert_eq!(cache.cached_prefix(&prompt).blocks(), 0, "nothing adopted");
    assert_eq!(cache.prefetch_status(ticket), Ok(TicketStatus::Ready));
    assert_eq!(cache.stats().counters.prefetch_found_blocks, 0);
    check(&cache);
}

#[test]
fn a_prefetch_load_landing_after_a_reset_changes_nothing_and_gives_its_host_block_back() {
    let mut cache = three_tiny_tiers();
    let first = push_first_prompt_to_storage(&mut cache);
    cache.prefetch(&first).unwrap().expect("two blocks to load");
    let load = hold_the_load(&mut cache);
    cache.reset(true).unwrap();
    check(&cache);
    assert_eq!(cache.stats().host_free, 0, "the LOAD still writes its host blocks");
    cache.complete_transfer(load.id, Ok(())).unwrap();
    check(&cache);
    assert_eq!(cache.stats().host_free, 2, "given back once it landed");
    assert_eq!(cache.cached_prefix(&first).blocks(), 0);
    assert_eq!(cache.stats().counters.stale_completions, 1);
}

#[test]
fn a_query_answered_after_a_reset_is_unknown_and_adopts_nothing() {
    let mut cache = three_tiny_tiers();
    let prompt = hashes(&[1, 2]);
    cache.prefetch(&prompt).unwrap().expect("a query");
    let mut queries = Vec::new();
    cache.take_storage_queries(&mut queries);
    cache.reset(true).unwrap();
    let id = queries[0].id;
    assert_eq!(cache.complete_storage_query(id, Ok(2)), Err(QueryError::UnknownQuery(id)));
    assert_eq!(cache.cached_prefix(&prompt).blocks(), 0);
    check(&cache);
}

#[test]
fn the_query_of_a_ticket_pushed_out_by_newer_ones_still_adopts_and_loads_its_blocks() {
    let mut cache = three_tiny_tiers();
    let prompt = hashes(&[1, 2]);
    let first = cache.prefetch(&prompt).unwrap().expect("a query");
    let mut queries = Vec::new();
    cache.take_storage_queries(&mut queries);
    let asked = queries.remove(0);
    for round in 0..MAX_PREFETCH_TICKETS as u128 {
        cache.prefetch(&hashes(&[1000 + round])).unwrap().expect("a query");
        cache.take_storage_queries(&mut queries);
        cache.complete_storage_query(queries.remove(0).id, Ok(0)).unwrap();
    }
    assert_eq!(cache.ticket_status(first), Err(TicketError::UnknownTicket(first)), "pushed out");
    check(&cache);
    cache.complete_storage_query(asked.id, Ok(2)).unwrap();
    check(&cache);
    complete_loads(&mut cache, true);
    let found = cache.cached_prefix(&prompt);
    assert_eq!((found.host_blocks, found.blocks()), (2, 2), "{found:?}");
    check(&cache);
}

#[test]
fn a_node_dropped_while_its_store_is_in_flight_is_forgotten_once_the_store_completes() {
    // Device 2, host 1, write-through to storage: block 2 settles on host and its STORE is held.
    let mut cache = manager(
        CacheConfig::new(BLOCK_TOKENS, 2)
            .with_host_blocks(1)
            .with_storage_blocks(8)
            .with_storage_write_policy(kvshm::manager::StorageWritePolicy::WriteThrough),
    );
    let chain = hashes(&[1, 2]);
    serve(&mut cache, 0, &chain);
    serve(&mut cache, 1, &hashes(&[10]));
    cache.poll();
    let store =
        complete_all_but(&mut cache, |transfer| transfer.kind == TransferKind::HostToStorage);
    assert_eq!(store.len(), 1, "{store:?}");
    assert_eq!(store[0].blocks[0].hash, BlockHash(2));
    // Block 1 is evicted from the device with no host block to be had: it leaves with block 2.
    let request = RequestId(2);
    cache.match_prefix(request, &hashes(&[20]), 4).unwrap();
    cache.allocate(request, 4, 0).unwrap();
    check(&cache);
    assert_eq!(cache.cached_prefix(&chain).blocks(), 0, "dropped");
    let mut forgotten = Vec::new();
    cache.take_forgotten_blocks(&mut forgotten);
    assert!(!forgotten.contains(&BlockHash(2)), "not before its STORE is done: {forgotten:?}");
    cache.complete_transfer(store[0].id, Ok(())).unwrap();
    check(&cache);
    cache.take_forgotten_blocks(&mut forgotten);
    assert!(forgotten.contains(&BlockHash(2)), "once it is: {forgotten:?}");
    complete_all(&mut cache);
    cache.finish(request).unwrap();
    check(&cache);
}

/// Matches `blocks` for a request aborted at once: they become the most recently used.
fn touch(cache: &mut CacheManager, id: u64, blocks: &[BlockHash]) {
    cache.match_prefix(RequestId(id), blocks, prompt_hitting(blocks.len())).unwrap();
    cache.abort(RequestId(id)).unwrap();
}

#[test]
fn a_claimed_parent_whose_swap_out_fails_drops_the_prefetch_node_loading_below_it() {
    let mut cache =
        manager(CacheConfig::new(BLOCK_TOKENS, 2).with_host_blocks(2).with_storage_blocks(8));
    let chain = hashes(&[1, 2]);
    serve(&mut cache, 0, &chain);
    serve(&mut cache, 1, &hashes(&[10]));
    touch(&mut cache, 100, &chain[..1]);
    serve(&mut cache, 2, &hashes(&[20]));
    touch(&mut cache, 101, &chain[..1]);
    serve(&mut cache, 3, &hashes(&[30]));
    complete_all(&mut cache);
    let found = cache.cached_prefix(&chain);
    assert_eq!((found.device_blocks, found.storage_blocks), (1, 1), "{found:?}");
    // A prefetch loads block 2 below block 1 (on device), held.
    cache.prefetch(&chain).unwrap().expect("block 2 to load");
    let load =
        complete_all_but(&mut cache, |transfer| transfer.kind == TransferKind::StorageToHost);
    assert_eq!(load.len(), 1);
    // An allocation claims block 1's device block; its swap-out fails.
    touch(&mut cache, 102, &hashes(&[30]));
    let request = RequestId(4);
    cache.match_prefix(request, &hashes(&[40]), 4).unwrap();
    cache.allocate(request, 4, 0).unwrap();
    let swap_out = complete_all_but(&mut cache, |transfer| {
        matches!(transfer.kind, TransferKind::DeviceToHost | TransferKind::StorageToHost)
    });
    assert_eq!(swap_out.len(), 1, "{swap_out:?}");
    assert_eq!(swap_out[0].kind, TransferKind::DeviceToHost);
    let mut forgotten = Vec::new();
    cache.take_forgotten_blocks(&mut forgotten);
    cache.complete_transfer(swap_out[0].id, Err(failure())).unwrap();
    check(&cache);
    assert_eq!(cache.cached_prefix(&chain).blocks(), 0, "block 1 left with block 2");
    forgotten.clear();
    cache.take_forgotten_blocks(&mut forgotten);
    assert!(!forgotten.contains(&BlockHash(2)), "not while its LOAD runs: {forgotten:?}");
    cache.complete_transfer(load[0].id, Ok(())).unwrap();
    check(&cache);
    cache.take_forgotten_blocks(&mut forgotten);
    assert!(forgotten.contains(&BlockHash(2)), "{forgotten:?}");
    complete_all(&mut cache);
    cache.finish(request).unwrap();
    check(&cache);
}

#[test]
fn a_prefetch_load_missing_a_block_ends_its_ticket_ready_with_the_blocks_above_on_host() {
    let mut cache = three_tiny_tiers();
    let first = push_first_prompt_to_storage(&mut cache);
    let ticket = cache.prefetch(&first).unwrap().unwrap();
    let load = hold_the_load(&mut cache);
    assert_eq!(load.blocks.len(), 2);
    cache
        .complete_storage_transfer(
            load.id,
            Ok(Some(&[
                kvshm::manager::BlockOutcome::Landed,
                kvshm::manager::BlockOutcome::Missing,
            ])),
        )
        .unwrap();
    check(&cache);
    assert_eq!(cache.prefetch_status(ticket), Ok(TicketStatus::Ready), "a miss is no failure");
    let found = cache.cached_prefix(&first);
    assert_eq!((found.host_blocks, found.storage_blocks), (1, 0), "{found:?}");
    assert_eq!(cache.stats().counters.load_missing_blocks, 1);
}

#[test]
fn an_allocation_following_a_prefetch_load_that_misses_a_block_is_shortened_and_the_block_dropped()
{
    let mut cache = three_tiny_tiers();
    let first = push_first_prompt_to_storage(&mut cache);
    let prefetch = cache.prefetch(&first).unwrap().unwrap();
    let load = hold_the_load(&mut cache);
    check(&cache);
    // The request matches both blocks while the prefetch loads them, and follows its LOAD.
    let request = RequestId(60);
    let found = cache.match_prefix(request, &first, prompt_hitting(first.len())).unwrap();
    assert_eq!(found.storage_blocks, first.len(), "{found:?}");
    let ticket = cache.allocate(request, 1, 0).unwrap().ticket;
    check(&cache);
    let transfers = cache.take_transfers();
    assert!(
        transfers.iter().all(|transfer| transfer.kind != TransferKind::StorageToHost),
        "no LOAD of its own: {transfers:?}"
    );
    cache
        .complete_storage_transfer(
            load.id,
            Ok(Some(&[
                kvshm::manager::BlockOutcome::Landed,
                kvshm::manager::BlockOutcome::Missing,
            ])),
        )
        .unwrap();
    check(&cache);
    assert_eq!(cache.ticket_cached_blocks(ticket), Ok(Some(1)));
    for transfer in transfers {
        cache.complete_transfer(transfer.id, Ok(())).unwrap();
        check(&cache);
    }
    complete_all(&mut cache);
    check(&cache);
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Shortened { cached_blocks: 1 }));
    assert_eq!(cache.prefetch_status(prefetch), Ok(TicketStatus::Ready));
    let found = cache.cached_prefix(&first);
    assert_eq!((found.device_blocks, found.storage_blocks), (1, 0), "block 2 is gone: {found:?}");
    let blocks = first.len() * BLOCK_TOKENS as usize;
    cache.commit(request, blocks, &first).unwrap();
    check(&cache);
    cache.finish(request).unwrap();
    check(&cache);
    assert_eq!(cache.cached_prefix(&first).device_blocks, first.len());
}

/// Under selective write-through an allocation may drop a cold device node (one hit) with the
/// host-only nodes a prefetch brought up below it, after a host eviction in the same allocation
/// left one of those (the parent of a block sent back to storage) for the next host eviction:
/// that next eviction, or the allocation's end, must see it gone, neither taking nor filing it,
/// and the allocation goes on with the candidates left.
#[test]
fn an_allocation_that_drops_the_host_parent_its_host_eviction_left_next_evicts_around_it() {
    // Five blocks: the free one, then 1 (copied to host: 12 goes back to storage, leaving 11
    // for the next host eviction), 10 (cold: dropped with 11 and 12 below it), 3 (copied into
    // 11's block) and 4 (copied: no host block left, so dropped). Four: 4 stays, and the end of
    // the allocation finds 11 gone.
    for (blocks, dropped) in [(5, 2), (4, 1)] {
        let mut cache = selective_over_storage_with_a_prefetched_chain_under_a_cold_node();
        let request = RequestId(9);
        let fresh = &hashes(&[20, 21, 22, 23, 24])[..blocks];
        let tokens = blocks * BLOCK_TOKENS as usize;
        cache.match_prefix(request, fresh, tokens).unwrap();
        assert_eq!(cache.allocate(request, tokens, 0).unwrap().new_blocks, blocks);
        check(&cache);
        let counters = cache.stats().counters;
        let evictions = &counters.evictions;
        assert_eq!(
            (evictions.device_written_back, evictions.device_dropped),
            (2, dropped),
            "{blocks} blocks: {counters:?}"
        );
        assert_eq!(evictions.host_to_storage_metadata, 1, "{counters:?}");
        complete_all(&mut cache);
        check(&cache);
        assert_eq!(cache.cached_prefix(&hashes(&[10, 11, 12])).blocks(), 0, "10 with 11, 12");
        for block in [1, 3] {
            assert_eq!(cache.cached_prefix(&hashes(&[block])).host_blocks, 1, "{block} on host");
        }
        let four = cache.cached_prefix(&hashes(&[4])).device_blocks;
        assert_eq!(four, usize::from(blocks == 4), "{blocks} blocks: 4 on device");
        cache.finish(request).unwrap();
        check(&cache);
    }
}

/// Five device blocks, two host blocks (full), selective write-through (two hits) over a
/// storage tier: on device, in the order they go, 1 (hot), 10 (cold), 3 and 4 (hot); on host,
/// prefetched below 10, 11 and its child 12, the host tier's one candidate. One block free.
fn selective_over_storage_with_a_prefetched_chain_under_a_cold_node() -> CacheManager {
    let policy = kvshm::manager::WritePolicy::WriteThroughSelective { threshold: 2 };
    let mut cache = manager(
        CacheConfig::new(BLOCK_TOKENS, 5)
            .with_host_blocks(2)
            .with_storage_blocks(8)
            .with_write_policy(policy),
    );
    let hot = |cache: &mut CacheManager, id: u64, block: u128| {
        serve(cache, id, &hashes(&[block]));
        // A second request hits it: two hits, hot enough to be copied to host (no poll: the
        // backup it queued is never issued).
        serve_prompt(cache, id + 100, &hashes(&[block]), prompt_hitting(1));
    };
    hot(&mut cache, 1, 1);
    // The cold device node, released after the first hot one.
    serve(&mut cache, 2, &hashes(&[10]));
    // A prefetch finds 11 and 12 on the tier below 10 and brings them up to host.
    let prompt = hashes(&[10, 11, 12]);
    prefetch_finding(&mut cache, &prompt, 2);
    let found = cache.cached_prefix(&prompt);
    assert_eq!((found.device_blocks, found.host_blocks), (1, 2), "{found:?}");
    assert_eq!(cache.free_host_blocks(), 0);
    hot(&mut cache, 3, 3);
    hot(&mut cache, 4, 4);
    check(&cache);
    assert_eq!(cache.free_device_blocks(), 1);
    cache
}
