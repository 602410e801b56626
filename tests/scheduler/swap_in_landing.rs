//! A swap-in's life on the host tier's fast path: `complete_transfer` applies a landed swap-in in
//! one pass and the tree starts and lands it through fast forms that skip the refiling of held
//! nodes. These tests end the requests that share a swap-in before or after it lands, fail it,
//! make it stale by a reset, and fail one of the two copies a ticket waits on, checking the
//! invariants after every step and what the engine sees (ticket states, refusals, what an
//! allocation can still evict).

use kvshm::manager::{
    AllocateError, CacheConfig, CacheManager, CommitError, EvictionPolicy, RequestId, TicketId,
    TicketStatus, Transfer, TransferId, TransferKind, WritePolicy,
};

use crate::support::scheduler::*;
use crate::support::Rng;

/// A request whose ticket waits on two copies handed out together: the swap-in of its host hit
/// (into a free block) and the claimed swap-out its fresh block was taken from.
struct TwoCopies {
    cache: CacheManager,
    request: RequestId,
    ticket: TicketId,
    swap_in: TransferId,
    swap_out: TransferId,
}

fn ticket_on_a_swap_in_and_a_swap_out() -> TwoCopies {
    let mut cache = manager(
        CacheConfig::new(BLOCK_TOKENS, 3)
            .with_host_blocks(8)
            .with_write_policy(WritePolicy::WriteBack),
    );
    serve(&mut cache, 1, &hashes(&[1]));
    // 1 goes to host.
    serve(&mut cache, 2, &hashes(&[2, 3, 4]));
    // A request that takes a block (4 goes to host) and gives it back: one free device block.
    let scratch = RequestId(9);
    cache.match_prefix(scratch, &[], 0).unwrap();
    cache.allocate(scratch, BLOCK_TOKENS as usize, 0).unwrap();
    complete_all(&mut cache);
    cache.abort(scratch).unwrap();
    check(&cache);
    assert_eq!(cache.free_device_blocks(), 1);
    assert_eq!(cache.cached_prefix(&hashes(&[1])).host_blocks, 1);

    let request = RequestId(3);
    let found = cache.match_prefix(request, &hashes(&[1]), prompt_hitting(1)).unwrap();
    assert_eq!(found.host_blocks, 1);
    // The hit takes the free block; the new token's block is claimed from 3's swap-out.
    let ticket = cache.allocate(request, 1, 0).unwrap().ticket;
    check(&cache);
    let copies = cache.take_transfers();
    let id_of = |kind: TransferKind| {
        let found: Vec<&Transfer> = copies.iter().filter(|copy| copy.kind == kind).collect();
        assert_eq!(found.len(), 1, "one {kind:?} handed out: {copies:?}");
        found[0].id
    };
    let (swap_in, swap_out) =
        (id_of(TransferKind::HostToDevice), id_of(TransferKind::DeviceToHost));
    assert_eq!(copies.len(), 2, "{copies:?}");
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Pending));
    TwoCopies { cache, request, ticket, swap_in, swap_out }
}

#[test]
fn a_failed_swap_in_fails_its_request_at_once_while_the_ticket_still_waits_on_a_swap_out() {
    let TwoCopies { mut cache, request, ticket, swap_in, swap_out } =
        ticket_on_a_swap_in_and_a_swap_out();
    cache.complete_transfer(swap_in, Err(failure())).unwrap();
    check(&cache);
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Failed(failure())));
    assert_eq!(cache.ticket_request(ticket), Some(request));
    // The request is failed now, not once the swap-out lands too.
    assert_eq!(cache.commit(request, 5, &hashes(&[1])), Err(CommitError::RequestFailed(request)));
    assert_eq!(cache.allocate(request, 4, 0).unwrap_err(), AllocateError::RequestFailed(request));
    cache.complete_transfer(swap_out, Ok(())).unwrap();
    check(&cache);
    assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Failed(failure())));
    assert_eq!(cache.commit(request, 5, &hashes(&[1])), Err(CommitError::RequestFailed(request)));
    cache.abort(request).unwrap();
    check(&cache);
    assert_eq!(cache.cached_prefix(&hashes(&[1])).host_blocks, 1, "1 is back on host");
}

#[test]
fn a_ticket_whose_swap_out_lands_first_waits_for_its_swap_in_and_then_fails_or_is_ready() {
    for swap_in_fails in [false, true] {
        let TwoCopies { mut cache, request, ticket, swap_in, swap_out } =
            ticket_on_a_swap_in_and_a_swap_out();
        cache.complete_transfer(swap_out, Ok(())).unwrap();
        check(&cache);
        assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Pending));
        assert_eq!(cache.ticket_request(ticket), Some(request));
        assert_eq!(
            cache.commit(request, 5, &hashes(&[1])),
            Err(CommitError::TicketPending(request))
        );
        let outcome = if swap_in_fails { Err(failure()) } else { Ok(()) };
        cache.complete_transfer(swap_in, outcome).unwrap();
        check(&cache);
        if swap_in_fails {
            assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Failed(failure())));
            assert_eq!(
                cache.commit(request, 5, &hashes(&[1])),
                Err(CommitError::RequestFailed(request))
            );
            cache.abort(request).unwrap();
        } else {
            assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Ready));
            cache.commit(request, 5, &hashes(&[1])).unwrap();
            cache.finish(request).unwrap();
        }
        check(&cache);
    }
}

const DEVICE_BLOCKS: u32 = 6;

/// Blocks 1 and 2 on host (written back), the device full of 3 to 8.
fn chain_on_host(policy: EvictionPolicy) -> CacheManager {
    let mut cache = manager(
        CacheConfig::new(BLOCK_TOKENS, DEVICE_BLOCKS)
            .with_host_blocks(8)
            .with_write_policy(WritePolicy::WriteBack)
            .with_eviction(policy),
    );
    serve(&mut cache, 1, &hashes(&[1, 2]));
    serve(&mut cache, 2, &hashes(&[3, 4, 5, 6, 7, 8]));
    assert_eq!(cache.cached_prefix(&hashes(&[1, 2])).host_blocks, 2);
    check(&cache);
    cache
}

/// Up to three requests share the swap-in of the chain 1, 2 (the first starts it, the others
/// hit it in flight); in a random order they end (finished or aborted), the copies complete
/// (the swap-in landing or failing), and a forced reset may come. Whatever the order, the
/// invariants hold after every step, each ticket ends as its copies did, a landed swap-in is
/// counted once per block, and once every request has ended every device block can be had
/// again: a node that landed unheld is a device candidate like any other.
#[test]
fn a_shared_swap_in_lands_or_fails_whenever_its_requests_end_and_its_nodes_stay_evictable() {
    for policy in EvictionPolicy::online() {
        let mut seen = Seen::default();
        for seed in 0..300 {
            shared_swap_in_scenario(policy, seed, &mut seen);
        }
        // Every case the scenario is for came up.
        assert!(
            seen.landed_unheld > 10
                && seen.landed_held_after_an_end > 10
                && seen.failed > 10
                && seen.reset_in_flight > 10,
            "{policy:?}: {seen:?}"
        );
    }
}

/// How often each case of [`shared_swap_in_scenario`] came up.
#[derive(Debug, Default)]
struct Seen {
    /// The swap-in landed after every request sharing it had ended.
    landed_unheld: usize,
    /// It landed held, after one of the requests sharing it had ended.
    landed_held_after_an_end: usize,
    failed: usize,
    /// A reset came while it was in flight: its completion was stale.
    reset_in_flight: usize,
}

fn shared_swap_in_scenario(policy: EvictionPolicy, seed: u64, seen: &mut Seen) {
    let mut rng = Rng::new(seed);
    let mut cache = chain_on_host(policy);
    let chain = hashes(&[1, 2]);
    let holders = 1 + rng.below(3);
    let mut live: Vec<(RequestId, TicketId)> = Vec::new();
    for index in 0..holders {
        let request = RequestId(10 + index as u64);
        let found = cache.match_prefix(request, &chain, prompt_hitting(2)).unwrap();
        if index == 0 {
            assert_eq!(found.host_blocks, 2, "seed {seed}");
        } else {
            assert_eq!(found.device_blocks, 2, "seed {seed}: a swap-in in flight is a device hit");
        }
        let ticket = cache.allocate(request, 1, 0).unwrap().ticket;
        check(&cache);
        live.push((request, ticket));
    }
    let swaps_in_before = cache.stats().counters.swap_in_blocks;
    let mut handed_out: Vec<Transfer> = Vec::new();
    // Whether the swap-in of 1 and 2 landed, failed, or was made stale by a reset.
    let (mut landed, mut failed, mut reset) = (false, false, false);
    let what = |step: &str| format!("{policy:?} seed {seed}: {step}");
    loop {
        handed_out.extend(cache.take_transfers());
        if live.is_empty() && handed_out.is_empty() {
            break;
        }
        match rng.below(10) {
            0..=2 if !live.is_empty() => {
                let (request, _) = live.swap_remove(rng.below(live.len()));
                if rng.below(2) == 0 {
                    cache.finish(request).unwrap();
                } else {
                    cache.abort(request).unwrap();
                }
                check(&cache);
            }
            3 if !reset && rng.below(4) == 0 => {
                if !landed && !failed {
                    seen.reset_in_flight += 1;
                }
                let ended = cache.reset(true).unwrap();
                assert_eq!(ended.len(), live.len(), "{}", what("a forced reset ends every holder"));
                live.clear();
                reset = true;
                check(&cache);
            }
            _ if !handed_out.is_empty() => {
                let copy = handed_out.swap_remove(rng.below(handed_out.len()));
                let is_swap_in = copy.kind == TransferKind::HostToDevice;
                let fails = is_swap_in && rng.below(3) == 0;
                let outcome = if fails { Err(failure()) } else { Ok(()) };
                cache.complete_transfer(copy.id, outcome).unwrap();
                check(&cache);
                if is_swap_in && !reset {
                    (landed, failed) = (!fails, fails);
                    if fails {
                        seen.failed += 1;
                    } else if live.is_empty() {
                        seen.landed_unheld += 1;
                    } else if live.len() < holders {
                        seen.landed_held_after_an_end += 1;
                    }
                }
            }
            _ => {}
        }
        // A ticket still live tells how its copies went.
        for &(request, ticket) in &live {
            let status = cache.ticket_status(ticket).unwrap();
            assert_eq!(cache.ticket_request(ticket), Some(request), "{}", what("its request"));
            if failed {
                assert_eq!(status, TicketStatus::Failed(failure()), "{}", what("failed ticket"));
                assert_eq!(
                    cache.commit(request, prompt_hitting(2), &chain),
                    Err(CommitError::RequestFailed(request)),
                    "{}",
                    what("a failed swap-in fails its requests")
                );
            } else if landed {
                // Ready, or still waiting on the swap-out its fresh block was claimed from.
                assert!(
                    matches!(status, TicketStatus::Ready | TicketStatus::Pending),
                    "{}: {status:?}",
                    what("a landed swap-in fails no ticket")
                );
            } else {
                assert_eq!(status, TicketStatus::Pending, "{}", what("waiting on the swap-in"));
            }
        }
    }
    check(&cache);
    let swapped_in = cache.stats().counters.swap_in_blocks - swaps_in_before;
    let found = cache.cached_prefix(&chain);
    if reset {
        assert_eq!(found.blocks(), 0, "{}", what("a reset drops the chain"));
    } else if landed {
        assert_eq!(swapped_in, 2, "{}", what("each landed block counted once"));
        assert_eq!(found.device_blocks, 2, "{}", what("the chain is on device"));
    } else {
        assert!(failed, "{}", what("the swap-in completed"));
        assert_eq!(swapped_in, 0, "{}", what("a failed swap-in lands nothing"));
        assert_eq!(found.host_blocks, 2, "{}", what("the chain is back on host"));
    }
    // Nothing is held: every device block can be had, the chain's included.
    let sweep = RequestId(99);
    cache.match_prefix(sweep, &[], 0).unwrap();
    let tokens = DEVICE_BLOCKS as usize * BLOCK_TOKENS as usize;
    let allocation = cache.allocate(sweep, tokens, 0);
    assert!(
        allocation.is_ok(),
        "{}: {:?}",
        what("every device block can be had"),
        allocation.err()
    );
    check(&cache);
    complete_all(&mut cache);
    cache.abort(sweep).unwrap();
    check(&cache);
}
