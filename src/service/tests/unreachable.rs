//! LOADs whose answers say a rank could not reach the storage tier (`TIER_UNREACHABLE`: a Redis
//! part that timed out or lost its connection), on one rank and on two.

use kvshm_ipc::storage_record::{storage_answer, StorageResults};

use super::*;

/// A service of `tp_size` ranks (all claimed) whose blocks 11 and 12 are on storage only, a
/// request matching both, and its LOAD answered on each rank by `load_answer(rank, command id,
/// generation)`; every other command succeeds. Returns the service and how the ticket ended.
fn load_answered(
    test: &str,
    tp_size: u32,
    load_answer: impl Fn(u32, u64, u64) -> Completion,
) -> (Service, TicketReady) {
    let mut service = service_with(test, |config| {
        config.tp_size = tp_size;
        config.cache = config
            .cache
            .clone()
            .with_storage_blocks(32)
            .with_storage_write_policy(crate::manager::StorageWritePolicy::WriteThrough);
    });
    let (segment, _claims) = claim_every_rank(&mut service);
    let all_done = StorageResults { done: u32::MAX, failed: 0 };
    let succeed = |_, id, generation| storage_answer(id, generation, all_done, false);
    // Answers every command on every rank (LOADs as `load_answer` says); how many LOADs.
    let answer = |load_answer: &dyn Fn(u32, u64, u64) -> Completion| {
        let mut loads = 0;
        for rank in 0..tp_size {
            let mut completions = segment.completion_producer(rank).unwrap();
            for header in pop_commands(&segment, rank) {
                let (id, generation) = (header.command_id, header.generation);
                let completion = if header.op == Op::StorageLoad as u32 {
                    loads += 1;
                    load_answer(rank, id, generation)
                } else {
                    succeed(rank, id, generation)
                };
                completions.push(completion).unwrap();
            }
        }
        loads
    };
    let settle = |service: &mut Service| {
        for _ in 0..6 {
            answer(&succeed);
            service.poll();
        }
    };
    let stored = [BlockHash(11), BlockHash(12)];
    cache_blocks(&mut service, 1, &stored);
    settle(&mut service);
    // Sixteen newer one-block prompts take the device and the host: 11 and 12 are on storage
    // only, and every host copy is a leaf a LOAD can take the block of.
    for request in 2..18 {
        cache_blocks(&mut service, request, &[BlockHash(u128::from(request) << 8)]);
        settle(&mut service);
    }
    assert_eq!(service.cache().cached_prefix(&stored).storage_blocks, 2);

    let tokens = 2 * BLOCK_TOKENS as usize + 1;
    let found = service.match_prefix(RequestId(20), &stored, tokens).unwrap();
    assert_eq!(found.storage_blocks, 2);
    let ticket = service.allocate(RequestId(20), 1, 0).unwrap().ticket;
    service.poll();
    assert_eq!(answer(&load_answer), tp_size as usize, "one LOAD per rank");
    // The landed block's swap-in, and anything else, succeeds.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let ready = loop {
        if let Some(ready) = service.poll_ticket(ticket).unwrap() {
            break ready;
        }
        assert!(std::time::Instant::now() < deadline, "the ticket never became ready");
        answer(&succeed);
    };
    service.cache().check_invariants().unwrap();
    (service, ready)
}

/// A flagged LOAD takes the tier down and drops none of its blocks: without the flag, its
/// results (one block landed, one failed) would say one bad block, which the cache drops while
/// the tier stays up. The block that landed is a hit.
#[test]
fn a_load_the_tier_could_not_be_reached_for_takes_it_down_and_drops_nothing() {
    let landed_then_failed = StorageResults { done: 0b01, failed: 0b10 };
    let (service, ready) = load_answered("load-unreachable", 1, |_, id, generation| {
        storage_answer(id, generation, landed_then_failed, true)
    });
    assert!(matches!(ready, TicketReady::Shortened { cached_blocks: 1, .. }), "{ready:?}");
    assert!(service.cache().storage_tier_down());
    let cached = service.cache().cached_prefix(&[BlockHash(11), BlockHash(12)]);
    assert_eq!((cached.device_blocks, cached.storage_blocks), (1, 1), "nothing dropped");
    let stats = service.stats();
    assert_eq!((stats.copy_failures, stats.storage_misses), (0, 1), "{stats:?}");
}

/// One rank could not reach the tier for block 12 while the other found it absent: the tier
/// goes down (the breaker must hear of a rank that could not reach it, whatever another found),
/// and block 12 is kept for now; a later LOAD that finds it missing drops it.
#[test]
fn a_rank_that_could_not_reach_the_tier_outweighs_another_rank_s_miss() {
    let (service, ready) = load_answered("load-unreachable-tp2", 2, |rank, id, generation| {
        let (results, unreachable) = match rank {
            0 => (StorageResults { done: 0b01, failed: 0 }, false),
            _ => (StorageResults { done: 0b01, failed: 0b10 }, true),
        };
        storage_answer(id, generation, results, unreachable)
    });
    assert!(matches!(ready, TicketReady::Shortened { cached_blocks: 1, .. }), "{ready:?}");
    assert!(service.cache().storage_tier_down(), "the breaker heard of rank 1");
    let cached = service.cache().cached_prefix(&[BlockHash(11), BlockHash(12)]);
    assert_eq!((cached.device_blocks, cached.storage_blocks), (1, 1), "block 12 kept");
    assert_eq!(service.stats().storage_misses, 2, "one per rank");
}

/// One rank could not reach the tier while the other rank's LOAD failed whole (here an error
/// code this build does not know): the copy fails, but the breaker still hears of the first rank,
/// and nothing is dropped.
#[test]
fn a_rank_that_could_not_reach_the_tier_is_heard_when_another_rank_s_command_fails() {
    let (service, ready) = load_answered("load-unreachable-failed", 2, |rank, id, generation| {
        // The copy ends once both ranks answered: rank 1's flag is recorded by then.
        match rank {
            1 => storage_answer(id, generation, StorageResults { done: 0, failed: 0b11 }, true),
            _ => Completion {
                status: kvshm_ipc::record::STATUS_FAILED,
                error: 99,
                ..Completion::ok(id, generation)
            },
        }
    });
    assert!(matches!(ready, TicketReady::Shortened { cached_blocks: 0, .. }), "{ready:?}");
    assert!(service.cache().storage_tier_down(), "the breaker heard of rank 1");
    assert_eq!(service.cache().stats().counters.storage_outages, 1);
    let cached = service.cache().cached_prefix(&[BlockHash(11), BlockHash(12)]);
    assert_eq!(cached.storage_blocks, 2, "nothing dropped");
}
