//! The service over real workers with a storage tier: the blocks the scheduler drops are
//! forgotten by the disk slab (so that its own LRU never drops a block the scheduler still
//! counts), and a prefetch discovers, through QUERY, the blocks another service wrote to a
//! shared Redis after this one started; two requests that shared a LOAD which missed a block
//! compute into the tables `wait` returns, and the cache serves the right bytes after them.

use std::time::Duration;

use kvshm::hash::BlockHash;
use kvshm::manager::{CacheConfig, RequestId, StorageWritePolicy, TicketStatus};
use kvshm::service::{Service, ServiceConfig, TicketReady};
use kvshm_ipc::name::SegmentName;

use crate::support::{
    connect, device_block_holds, poll_until, redis_for_test, unique_name, unique_namespace,
    write_block, Scratch, Worker,
};

const TP: u32 = 2;
const LAYERS: u32 = 2;
const BLOCK_TOKENS: u32 = 4;
const WAIT: Duration = Duration::from_secs(30);

/// A service of `TP` ranks whose workers keep a storage tier `storage_args`.
fn service_with_workers(
    name: &SegmentName,
    cache: CacheConfig,
    storage_args: &[String],
) -> (Service, Vec<Worker>) {
    let mut service =
        Service::create(name, ServiceConfig::new(cache, TP, LAYERS, 2 * LAYERS, 4096)).unwrap();
    let workers: Vec<Worker> =
        (0..TP).map(|rank| Worker::spawn(name, rank, storage_args, &[], None)).collect();
    service.wait_for_workers(WAIT).unwrap();
    (service, workers)
}

/// Runs a request whose prompt is `hashes` and one token more (so every block may hit): match,
/// allocate, wait, check the hit bytes, write the others, commit, finish. Returns the match's
/// (device, host, storage) hits.
fn serve(service: &mut Service, id: u64, hashes: &[BlockHash]) -> (usize, usize, usize) {
    let request = RequestId(id);
    let tokens = hashes.len() * BLOCK_TOKENS as usize + 1;
    let matched = service.match_prefix(request, hashes, tokens).unwrap();
    let allocation = service.allocate(request, tokens - matched.cached_tokens, 0).unwrap();
    let (table, ticket) = (allocation.block_table.to_vec(), allocation.ticket);
    service.wait(ticket, WAIT).expect("the request's copies land");
    for (index, (&hash, &block)) in hashes.iter().zip(&table).enumerate() {
        if index < matched.blocks() {
            assert!(device_block_holds(service, hash, block), "hit block {index} holds its bytes");
        } else {
            write_block(service, hash, block);
        }
    }
    service.commit(request, tokens, hashes).unwrap();
    service.finish(request).unwrap();
    service.cache().check_invariants().unwrap();
    (matched.device_blocks, matched.host_blocks, matched.storage_blocks)
}

/// Matches `hashes` for a request that is aborted at once: the blocks are touched (newest for
/// the scheduler's LRU) without any copy.
fn touch(service: &mut Service, id: u64, hashes: &[BlockHash]) {
    let request = RequestId(id);
    let tokens = hashes.len() * BLOCK_TOKENS as usize + 1;
    service.match_prefix(request, hashes, tokens).unwrap();
    service.abort(request).unwrap();
}

#[test]
fn the_disk_slab_forgets_what_the_scheduler_drops_so_a_block_it_keeps_is_never_evicted_below_it() {
    // The sequence of the storage review: a tier of 2 blocks, host 1, device 2, and a slab sized
    // as the demo sizes it (storage + host + device). Block X is written back, then touched
    // after every write-back so that the scheduler always keeps it and drops the others; the
    // slab, which never sees those touches, must not drop X for them.
    let dir = Scratch::new("forget");
    let name = unique_name("forget");
    let cache = CacheConfig::new(BLOCK_TOKENS, 2).with_host_blocks(1).with_storage_blocks(2);
    let args: Vec<String> = [
        "--storage".to_owned(),
        format!("disk:{}", dir.0.display()),
        "--storage-blocks".to_owned(),
        "5".to_owned(),
        "--storage-namespace".to_owned(),
        "forget".to_owned(),
    ]
    .into();
    let (mut service, _workers) = service_with_workers(&name, cache, &args);
    let x = [BlockHash(0x1000)];
    serve(&mut service, 0, &x);
    for value in 0..12u64 {
        serve(&mut service, 1 + value, &[BlockHash(0x2000 + u128::from(value))]);
        assert!(service.wait_for_copies(WAIT));
        touch(&mut service, 1000 + value, &x);
    }
    assert!(service.wait_for_copies(WAIT));
    let found = service.cache().cached_prefix(&x);
    assert_eq!(found.storage_blocks, 1, "the scheduler kept X on storage: {found:?}");
    assert!(service.cache().stats().counters.evictions.storage_dropped >= 8);
    // X loads from the slab, with its bytes.
    let (_, _, storage_hits) = serve(&mut service, 999, &x);
    assert_eq!(storage_hits, 1);
    let stats = service.stats();
    assert_eq!(stats.storage_misses, 0, "{stats:?}");
    assert!(stats.storage_forgets_sent >= 8, "{stats:?}");
    let counters = service.segment().counters();
    assert_eq!(
        counters.get(kvshm::service::Counter::StorageEvictions),
        0,
        "the slab never evicted"
    );
    assert!(counters.get(kvshm::service::Counter::StorageForgottenBlocks) >= 16, "both ranks");
}

#[test]
fn a_prefetch_finds_blocks_another_service_wrote_to_the_shared_redis_after_it_started() {
    let redis = redis_for_test();
    let namespace = unique_namespace("discover");
    let args: Vec<String> =
        ["--storage".to_owned(), redis.url(), "--storage-namespace".to_owned(), namespace.clone()]
            .into();
    let cache = |device: u32, storage_blocks: u32, storage: StorageWritePolicy| {
        CacheConfig::new(BLOCK_TOKENS, device)
            .with_host_blocks(16)
            .with_storage_blocks(storage_blocks)
            .with_storage_write_policy(storage)
    };
    // B starts first: at its start the namespace holds nothing it could adopt.
    let name_b = unique_name("discover-b");
    let (mut b, _workers_b) =
        service_with_workers(&name_b, cache(16, 8, StorageWritePolicy::WriteBack), &args);
    // B's own traffic fills its tier (device 16 + host 16 + storage 8 blocks, then more):
    // discovery must go on once the tier is full, making room by its LRU.
    for round in 0..12u128 {
        let own: Vec<BlockHash> =
            (0..4u128).map(|i| BlockHash(0xb0b0_0000 + 16 * round + i)).collect();
        serve(&mut b, 100 + round as u64, &own);
        assert!(b.wait_for_copies(WAIT));
    }
    assert_eq!(b.cache().storage_used_blocks(), 8, "B's tier is full");
    let name_a = unique_name("discover-a");
    let (mut a, _workers_a) =
        service_with_workers(&name_a, cache(7, 64, StorageWritePolicy::WriteThrough), &args);
    let prompt: Vec<BlockHash> = (0..6u128).map(|i| BlockHash(0xd15c_0000 + i)).collect();
    serve(&mut a, 0, &prompt);
    // Another prompt pushes A's blocks to host, where write-through stores them in Redis.
    let filler: Vec<BlockHash> = (0..6u128).map(|i| BlockHash(0xf111_0000 + i)).collect();
    serve(&mut a, 1, &filler);
    let deadline = std::time::Instant::now() + WAIT;
    while a.cache().stats().counters.stored_blocks < prompt.len() as u64 {
        assert!(
            std::time::Instant::now() < deadline,
            "A stored its blocks: {:?} {:?}",
            a.cache().stats(),
            a.stats()
        );
        a.poll();
        a.wait_for_copies(Duration::from_millis(100));
    }
    assert_eq!(b.cache().cached_prefix(&prompt).blocks(), 0, "B knows nothing yet");
    let ticket = b.prefetch(&prompt).unwrap().expect("B asks the tier about the prompt");
    b.wait(ticket, WAIT).expect("the query and the loads land");
    assert_eq!(b.prefetch_status(ticket), Ok(TicketStatus::Ready));
    let found = b.cache().cached_prefix(&prompt);
    assert_eq!(found.host_blocks, prompt.len(), "B found every block and loaded it: {found:?}");
    let (device, host, storage) = serve(&mut b, 1, &prompt);
    assert_eq!((device, host, storage), (0, prompt.len(), 0));
    let counters = b.cache().stats().counters;
    assert_eq!(counters.prefetch_found_blocks, prompt.len() as u64, "{counters:?}");
    let published = b.segment().counters();
    assert_eq!(
        published.get(kvshm::service::Counter::PrefetchQueryBlocks),
        counters.prefetch_query_blocks,
        "kvctl sees the blocks asked about"
    );
    assert!(counters.prefetch_query_blocks >= prompt.len() as u64);
    assert_eq!(b.stats().storage_misses, 0);
}

/// Polls `service` until the segment's `StorageForgottenBlocks` reaches `at_least`, or panics.
fn wait_for_forgotten(service: &mut Service, at_least: u64) -> u64 {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let forgotten =
            service.segment().counters().get(kvshm::service::Counter::StorageForgottenBlocks);
        if forgotten >= at_least {
            return forgotten;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the tier forgot {forgotten} blocks, not {at_least}: {:?}",
            service.stats()
        );
        service.poll();
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_reset_while_a_worker_is_gone_forgets_on_the_live_rank_at_once_and_on_the_other_once_back() {
    let dir = Scratch::new("forget-down");
    let name = unique_name("forget-down");
    let cache = CacheConfig::new(BLOCK_TOKENS, 4).with_host_blocks(4).with_storage_blocks(8);
    let args: Vec<String> = [
        "--storage".to_owned(),
        format!("disk:{}", dir.0.display()),
        "--storage-namespace".to_owned(),
        "forget-down".to_owned(),
    ]
    .into();
    let (mut service, mut workers) = service_with_workers(&name, cache, &args);
    for round in 0..4u128 {
        let blocks: Vec<BlockHash> =
            (0..3u128).map(|i| BlockHash(0x3000 + 8 * round + i)).collect();
        serve(&mut service, round as u64, &blocks);
    }
    assert!(service.wait_for_copies(WAIT));
    // Rank 1's worker dies; the service notices.
    workers[1].kill_hard();
    poll_until(&mut service, WAIT, "the death is noticed", |service| {
        service.stats().worker_deaths > 0
    });
    let before = service.segment().counters().get(kvshm::service::Counter::StorageForgottenBlocks);
    // A reset forgets every block of the tree: rank 0 is told now.
    service.reset(true).unwrap();
    service.poll();
    let waiting = service.storage_forgets_waiting() as u64;
    assert!(waiting >= 12, "rank 1's share waits: {waiting}");
    let after_live = wait_for_forgotten(&mut service, before + waiting);
    // A new worker serves rank 1: it is told too.
    workers[1] = Worker::spawn(&name, 1, &args, &[], None);
    service.wait_for_workers(WAIT).unwrap();
    wait_for_forgotten(&mut service, after_live + waiting);
    assert_eq!(service.storage_forgets_waiting(), 0);
    assert_eq!(service.stats().storage_forgets_dropped, 0, "{:?}", service.stats());
}

#[test]
fn a_prefetch_past_the_cache_asks_a_shared_tier_but_not_a_disk_slab_only_this_service_writes() {
    let dir = Scratch::new("no-query");
    let name = unique_name("no-query");
    let cache = CacheConfig::new(BLOCK_TOKENS, 4).with_host_blocks(4).with_storage_blocks(8);
    let args: Vec<String> = [
        "--storage".to_owned(),
        format!("disk:{}", dir.0.display()),
        "--storage-namespace".to_owned(),
        "no-query".to_owned(),
    ]
    .into();
    let (mut service, _workers) = service_with_workers(&name, cache.clone(), &args);
    let prompt: Vec<BlockHash> = (0..3u128).map(|i| BlockHash(0x4000 + i)).collect();
    assert_eq!(service.prefetch(&prompt), Ok(None), "nothing to load, nothing to ask");
    assert!(service.wait_for_copies(WAIT));
    assert_eq!(service.cache().stats().counters.prefetch_query_blocks, 0);
    let counters = service.segment().counters();
    assert_eq!(counters.get(kvshm::service::Counter::StorageQueryBlocks), 0);
    assert_eq!(counters.get(kvshm::service::Counter::StorageSharedTier), 0);
    drop(service);

    let redis = redis_for_test();
    let args: Vec<String> = [
        "--storage".to_owned(),
        redis.url(),
        "--storage-namespace".to_owned(),
        unique_namespace("query"),
    ]
    .into();
    let name = unique_name("query");
    let (mut service, _workers) = service_with_workers(&name, cache, &args);
    assert_eq!(service.segment().counters().get(kvshm::service::Counter::StorageSharedTier), 1);
    let ticket = service.prefetch(&prompt).unwrap().expect("a shared tier is asked");
    service.wait(ticket, WAIT).expect("the query lands");
    assert_eq!(service.cache().stats().counters.prefetch_query_blocks, prompt.len() as u64);
}

#[test]
fn two_requests_sharing_a_load_that_misses_compute_into_the_tables_wait_returns_and_cache_right_bytes(
) {
    let redis = redis_for_test();
    let namespace = unique_namespace("shared-load");
    let args: Vec<String> =
        ["--storage".to_owned(), redis.url(), "--storage-namespace".to_owned(), namespace.clone()]
            .into();
    let cache = CacheConfig::new(BLOCK_TOKENS, 16).with_host_blocks(4).with_storage_blocks(64);
    let name = unique_name("shared-load");
    let (mut service, _workers) = service_with_workers(&name, cache, &args);
    let prompt: Vec<BlockHash> = (0..4u128).map(|i| BlockHash(0x5a4e_0000 + i)).collect();
    serve(&mut service, 0, &prompt);
    // Other prompts push it down to host, then (written back) to storage only.
    let mut next_id = 1;
    while service.cache().cached_prefix(&prompt).storage_blocks < prompt.len() {
        assert!(next_id < 40, "the prompt reached storage: {:?}", service.cache().stats());
        let base = 0xf111_0000 + 16 * u128::from(next_id);
        let filler: Vec<BlockHash> = (0..4u128).map(|i| BlockHash(base + i)).collect();
        serve(&mut service, next_id, &filler);
        service.wait_for_copies(WAIT);
        next_id += 1;
    }
    // Block 1 goes missing on the tier (every rank).
    let mut redis_connection = connect(&redis.url());
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("kvshm:{namespace}:*:{}:*", prompt[1]))
        .query(&mut redis_connection)
        .unwrap();
    assert_eq!(keys.len(), TP as usize, "{keys:?}");
    let _: () = redis::cmd("DEL").arg(&keys).query(&mut redis_connection).unwrap();

    // Two requests scheduled together: both match, both allocate, then both wait. The second
    // shares the first one's LOAD.
    let tokens = prompt.len() * BLOCK_TOKENS as usize + 1;
    let mut scheduled = Vec::new();
    for id in [50, 51] {
        let found = service.match_prefix(RequestId(id), &prompt, tokens).unwrap();
        assert_eq!(found.storage_blocks, prompt.len(), "{found:?}");
        let allocation = service.allocate(RequestId(id), tokens - found.cached_tokens, 0).unwrap();
        scheduled.push((id, allocation.ticket, allocation.block_table.to_vec()));
    }
    let mut tables = Vec::new();
    for (id, ticket, allocated) in scheduled {
        // Layer by layer: no layer reads as ready before the cut is known (a storage command
        // publishes no layer progress; the swap-ins behind the LOAD come after it).
        let deadline = std::time::Instant::now() + WAIT;
        let ready = loop {
            let layers = service.ticket_layers_ready(ticket).unwrap();
            if layers > 0 {
                let cached = service.ticket_cached_blocks(ticket).unwrap();
                assert!(cached.is_some(), "{layers} layers ready before the cut is known");
            }
            if let Some(ready) = service.poll_ticket(ticket).expect("a miss fails no request") {
                break ready;
            }
            assert!(std::time::Instant::now() < deadline, "ticket {ticket:?} never ready");
        };
        let TicketReady::Shortened { cached_blocks, block_table } = ready else {
            panic!("block 1 is missing: {ready:?}");
        };
        assert_eq!(cached_blocks, 1);
        assert_eq!(block_table[..1], allocated[..1], "the cached position keeps its block");
        assert_eq!(service.block_table(RequestId(id)), Some(&block_table[..]));
        tables.push((id, block_table));
    }
    assert_ne!(tables[0].1[1..4], tables[1].1[1..4], "each computes into blocks of its own");
    // The engine checks the cached block, computes the rest into the tables `wait` returned, and
    // the second request commits first (its blocks become the cached copies).
    for (id, table) in tables.iter().rev() {
        assert!(device_block_holds(&service, prompt[0], table[0]), "request {id}'s hit");
        for position in 1..prompt.len() {
            write_block(&service, prompt[position], table[position]);
        }
        service.commit(RequestId(*id), tokens, &prompt).unwrap();
        service.cache().check_invariants().unwrap();
    }
    for (id, _) in &tables {
        service.finish(RequestId(*id)).unwrap();
    }
    service.cache().check_invariants().unwrap();
    // A later request hits every block on device, byte for byte (checked in `serve`).
    let (device, _, _) = serve(&mut service, 60, &prompt);
    assert_eq!(device, prompt.len());
}
