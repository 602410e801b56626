//! A storage tier that goes away under a running service, with real processes: a `kvshm worker`
//! over a private Redis that is killed (refusing) or paused (hung) mid-run. The LOAD that finds
//! it gone misses, its request is shortened and served (never failed), and the tier is marked
//! down: later requests neither hit nor wait on it, and nothing is dropped from the cache. Once
//! Redis is back a probe finds it, and the tier serves hits again, byte for byte.

use std::time::{Duration, Instant};

use kvshm::hash::BlockHash;
use kvshm::manager::{CacheConfig, RequestId};
use kvshm::service::{Counter, Service, ServiceConfig, TicketReady, TierBackoff};

use crate::support::{
    device_block_holds, hashes, poll_until, unique_name, unique_namespace, write_block,
    RedisServer, WorkerProcess,
};

const BLOCK_TOKENS: usize = 4;
const WAIT: Duration = Duration::from_secs(60);

/// A service of 4 device, 2 host and 64 storage blocks (its configuration `adjust`ed) and its
/// one worker, whose storage tier is `redis` with I/O timeout `io_timeout`, both up.
fn service_over(
    redis: &RedisServer,
    test: &str,
    io_timeout: Duration,
    adjust: impl FnOnce(&mut ServiceConfig),
) -> (Service, WorkerProcess) {
    let name = unique_name(test);
    let cache =
        CacheConfig::new(BLOCK_TOKENS as u32, 4).with_host_blocks(2).with_storage_blocks(64);
    let mut config = ServiceConfig::new(cache, 1, 1, 2, 1024);
    adjust(&mut config);
    let mut service = Service::create(&name, config).unwrap();
    let (url, namespace) = (redis.url(), unique_namespace(test));
    let timeout = io_timeout.as_secs().to_string();
    let args = ["--storage", &url, "--storage-namespace", &namespace];
    let args = [&args[..], &["--storage-timeout", &timeout]].concat();
    let worker = WorkerProcess::spawn_with(&name, 0, &args, &[]);
    service.wait_for_workers(Duration::from_secs(60)).unwrap();
    (service, worker)
}

/// Serves `blocks` as a prompt that may hit all of them; returns how the ticket became ready
/// and the hit blocks. Verifies every hit the ticket reports cached, computes the rest, and
/// commits them, unless `abort_if_shortened` (then the request is aborted when shortened).
fn serve(
    service: &mut Service,
    id: u64,
    blocks: &[BlockHash],
    abort_if_shortened: bool,
) -> (TicketReady, usize) {
    let request = RequestId(id);
    let prompt = blocks.len() * BLOCK_TOKENS + 1;
    let found = service.match_prefix(request, blocks, prompt).unwrap();
    let allocation = service.allocate(request, prompt - found.cached_tokens, 0).unwrap();
    let (mut table, ticket) = (allocation.block_table.to_vec(), allocation.ticket);
    let ready = service.wait(ticket, WAIT).expect("a storage miss never fails a request");
    let cached = match &ready {
        TicketReady::AllHits => found.blocks(),
        TicketReady::Shortened { cached_blocks, block_table } => {
            table.clone_from(block_table);
            *cached_blocks as usize
        }
    };
    if abort_if_shortened && cached < found.blocks() {
        service.abort(request).unwrap();
        return (ready, found.storage_blocks);
    }
    for (position, &block) in table.iter().enumerate().take(blocks.len()) {
        if position < cached {
            assert!(device_block_holds(service, blocks[position], block), "hit {position}");
        } else {
            write_block(service, blocks[position], block);
        }
    }
    service.commit(request, prompt, blocks).unwrap();
    service.finish(request).unwrap();
    service.cache().check_invariants().unwrap();
    (ready, found.storage_blocks)
}

/// Serves other prompts until `blocks` are on storage only (written back through the worker);
/// false if they left the cache instead (a write-back the tier refused leaves no copy).
fn push_to_storage(service: &mut Service, next_id: &mut u64, blocks: &[BlockHash]) -> bool {
    let deadline = Instant::now() + WAIT;
    loop {
        let found = service.cache().cached_prefix(blocks);
        if found.storage_blocks == blocks.len() {
            return true;
        }
        if found.blocks() < blocks.len() {
            return false;
        }
        assert!(Instant::now() < deadline, "the blocks never went down to storage: {found:?}");
        *next_id += 1;
        let filler = hashes(1_000_000 + 10 * u128::from(*next_id), 2);
        serve(service, *next_id, &filler, false);
        assert!(service.wait_for_copies(WAIT), "the write-backs land");
    }
}

#[test]
fn redis_stopped_mid_run_shortens_hits_without_failing_a_request_and_hits_return_once_it_is_back() {
    let mut redis = RedisServer::start();
    let (mut service, _worker) = service_over(&redis, "redis-away", Duration::from_secs(2), |_| {});

    let mut next_id = 0;
    let (first, second) = (hashes(100, 2), hashes(200, 2));
    for prompt in [&first, &second] {
        next_id += 1;
        serve(&mut service, next_id, prompt, false);
    }
    assert!(push_to_storage(&mut service, &mut next_id, &first));
    assert!(push_to_storage(&mut service, &mut next_id, &second));
    assert_eq!(service.cache().cached_prefix(&first).storage_blocks, 2);

    redis.kill();
    // The tier goes away: the hit is shortened to nothing, the request computes both blocks,
    // and the tier is marked down.
    next_id += 1;
    let (ready, storage_hits) = serve(&mut service, next_id, &first, false);
    assert!(matches!(ready, TicketReady::Shortened { cached_blocks: 0, .. }), "{ready:?}");
    assert_eq!(storage_hits, 2);
    assert!(service.stats().storage_misses > 0, "{:?}", service.stats());
    assert!(service.cache().storage_tier_down(), "a refused LOAD marks the tier down");
    // An unavailable tier drops nothing: the other prompt's blocks are still on storage, but
    // no request is routed to them while it is down. A probe cannot bring it up meanwhile:
    // every connection to a dead server is refused, which is a failed bit, whatever the timing.
    assert_eq!(service.cache().cached_prefix(&second).storage_blocks, 2);
    next_id += 1;
    let (ready, storage_hits) = serve(&mut service, next_id, &second, true);
    assert_eq!((ready, storage_hits), (TicketReady::AllHits, 0), "no hit on a tier down");
    assert!(service.cache().storage_tier_down(), "no probe reaches a dead server");
    assert_eq!(service.cache().stats().counters.storage_outages, 1, "one outage");
    // Still cached (recomputed onto the device if the request computed them, else on storage).
    assert_eq!(service.cache().cached_prefix(&second).blocks(), 2, "still there");

    // Back (empty: it keeps nothing on disk). Blocks written from now on hit again.
    redis.restart();
    let deadline = Instant::now() + WAIT;
    let mut round = 0u128;
    loop {
        assert!(Instant::now() < deadline, "the storage tier never served a hit again");
        round += 1;
        let prompt = hashes(300 + 10 * round, 2);
        next_id += 1;
        serve(&mut service, next_id, &prompt, false);
        if !push_to_storage(&mut service, &mut next_id, &prompt) {
            // Its write-back failed while the worker reconnects: try a new prompt.
            std::thread::sleep(Duration::from_millis(200));
            continue;
        }
        next_id += 1;
        let (ready, storage_hits) = serve(&mut service, next_id, &prompt, false);
        if (ready, storage_hits) == (TicketReady::AllHits, 2) {
            break; // loaded from Redis and verified byte for byte in `serve`
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let counters = service.cache().stats().counters;
    assert!(counters.loaded_blocks >= 2 && counters.shortened_tickets >= 1, "{counters:?}");
    assert!(counters.storage_outages >= 1, "{counters:?}");
    assert!(service.stats().storage_tier_probes >= 1, "a probe brought the tier back");
    assert_eq!(counters.shortening_failed, 0);
    let published = service.segment().counters();
    assert_eq!(
        published.get(kvshm::service::Counter::ShortenedTickets),
        counters.shortened_tickets,
        "kvctl sees the shortened hits"
    );
}

#[test]
fn a_hung_redis_is_marked_down_so_requests_stop_waiting_on_it_and_a_probe_brings_it_back() {
    // A LOAD to a hung server waits out the worker's I/O timeout (8 s here); the requests after
    // the first must not.
    const IO_TIMEOUT: Duration = Duration::from_secs(8);
    let mut redis = RedisServer::start();
    let (mut service, _worker) = service_over(&redis, "redis-hung", IO_TIMEOUT, |config| {
        // The rank owes answers while Redis hangs: not a silent worker.
        config.command_deadline = Duration::from_secs(120);
        config.storage_backoff =
            TierBackoff { first: Duration::from_millis(200), max: Duration::from_secs(2) };
    });

    let mut next_id = 0;
    let prompts: Vec<Vec<BlockHash>> = (1..=3).map(|base| hashes(100 * base, 2)).collect();
    for prompt in &prompts {
        next_id += 1;
        serve(&mut service, next_id, prompt, false);
    }
    for prompt in &prompts {
        assert!(push_to_storage(&mut service, &mut next_id, prompt));
    }

    redis.pause();
    // The first request finds out: its LOAD times out, it is shortened, the tier goes down.
    next_id += 1;
    let (ready, storage_hits) = serve(&mut service, next_id, &prompts[0], false);
    assert_eq!(storage_hits, 2);
    assert!(matches!(ready, TicketReady::Shortened { cached_blocks: 0, .. }), "{ready:?}");
    assert!(service.cache().storage_tier_down());
    let published = |service: &Service, counter| service.segment().counters().get(counter);
    assert_eq!(published(&service, Counter::StorageTierDown), 1, "kvctl sees the tier down");
    assert_eq!(published(&service, Counter::StorageTierOutages), 1);
    assert!(published(&service, Counter::StorageTierDownSinceNs) > 0);

    // While it is down: no storage hit, and no wait on the tier. The second prompt's blocks stay
    // cached on storage. (Past the worker's own connect back-off, at most 1 s, during which its
    // connections fail at once: after it, a LOAD would connect to the hung server and wait.)
    std::thread::sleep(Duration::from_secs(2));
    let before = service.cache().stats().counters;
    let started = Instant::now();
    next_id += 1;
    let (ready, storage_hits) = serve(&mut service, next_id, &prompts[1], false);
    let took = started.elapsed();
    println!("a request while the tier is down took {took:?}");
    assert_eq!((ready, storage_hits), (TicketReady::AllHits, 0));
    let after = service.cache().stats().counters;
    assert_eq!(after.hits.storage_blocks, before.hits.storage_blocks);
    assert_eq!(after.load_blocks_issued, before.load_blocks_issued, "no LOAD to wait on");
    // Evictions meanwhile drop instead of writing back: no STORE joins the queue of the hung
    // server. (Probes fail meanwhile: Redis answers nothing.)
    for round in 0..3 {
        next_id += 1;
        let filler = hashes(5_000 + 10 * round, 2);
        serve(&mut service, next_id, &filler, false);
    }
    assert!(service.wait_for_copies(WAIT), "no copy waits on the tier");
    assert!(service.cache().storage_tier_down(), "still down: the probe cannot reach it");
    assert!(service.cache().stats().counters.storage_down_dropped_blocks > 0);
    assert_eq!(service.cache().cached_prefix(&prompts[2]).storage_blocks, 2, "nothing dropped");

    // Redis goes on, its data intact: a probe finds it and the tier comes back up.
    redis.resume();
    poll_until(&mut service, WAIT, "no probe brought the tier back up", |service| {
        !service.cache().storage_tier_down()
    });
    let stats = service.stats();
    assert!(stats.storage_tier_probes >= 1, "{stats:?}");
    service.poll();
    assert_eq!(published(&service, Counter::StorageTierDown), 0);
    assert_eq!(published(&service, Counter::StorageTierDownSinceNs), 0);
    assert_eq!(published(&service, Counter::StorageTierProbes), stats.storage_tier_probes);

    // Storage hits resume: the third prompt loads from Redis, checked byte for byte.
    next_id += 1;
    let (ready, storage_hits) = serve(&mut service, next_id, &prompts[2], false);
    assert_eq!((ready, storage_hits), (TicketReady::AllHits, 2));
    assert_eq!(service.cache().stats().counters.storage_outages, 1);
}
