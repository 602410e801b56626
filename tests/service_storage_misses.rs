//! A storage tier that goes away under a running service, with real processes: a `kvshm worker`
//! over a private Redis that is stopped mid-run. Its LOADs miss, and the requests that hit
//! storage are shortened and served (never failed) while nothing is dropped from the cache; once
//! Redis is back the tier serves hits again, byte for byte.

mod service_support;
mod storage_support;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvshm::hash::BlockHash;
use kvshm::manager::{CacheConfig, RequestId};
use kvshm::service::{Service, ServiceConfig, TicketReady};
use service_support::{device_block_holds, hashes, unique_name, write_block};
use storage_support::{unique_namespace, RedisServer};

const BLOCK_TOKENS: usize = 4;
const WAIT: Duration = Duration::from_secs(60);

struct KilledOnDrop(Child);

impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
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
    let name = unique_name("redis-away");
    let cache =
        CacheConfig::new(BLOCK_TOKENS as u32, 4).with_host_blocks(2).with_storage_blocks(64);
    let config = ServiceConfig::new(cache, 1, 1, 2, 1024);
    let mut service = Service::create(&name, config).unwrap();
    let worker = Command::new(env!("CARGO_BIN_EXE_kvshm"))
        .args(["worker", "--name", name.as_str(), "--rank", "0"])
        .args(["--storage", &redis.url(), "--storage-namespace", &unique_namespace("away")])
        .args(["--storage-timeout", "2"])
        .stdin(Stdio::null())
        .spawn()
        .expect("spawning kvshm worker");
    let _worker = KilledOnDrop(worker);
    service.wait_for_workers(Duration::from_secs(60)).unwrap();

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
    // The tier is down: the hit is shortened to nothing, the request computes both blocks.
    next_id += 1;
    let (ready, storage_hits) = serve(&mut service, next_id, &first, false);
    assert!(matches!(ready, TicketReady::Shortened { cached_blocks: 0, .. }), "{ready:?}");
    assert_eq!(storage_hits, 2);
    assert!(service.stats().storage_misses > 0, "{:?}", service.stats());
    // An unavailable tier drops nothing: the other prompt's blocks are still on storage.
    assert_eq!(service.cache().cached_prefix(&second).storage_blocks, 2);
    next_id += 1;
    let (ready, _) = serve(&mut service, next_id, &second, true);
    assert!(matches!(ready, TicketReady::Shortened { cached_blocks: 0, .. }), "{ready:?}");
    assert_eq!(service.cache().cached_prefix(&second).storage_blocks, 2, "still there");

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
    assert!(counters.loaded_blocks >= 2 && counters.shortened_tickets >= 2, "{counters:?}");
    assert_eq!(counters.shortening_failed, 0);
    let published = service.segment().counters();
    assert_eq!(
        published.get(kvshm::service::Counter::ShortenedTickets),
        counters.shortened_tickets,
        "kvctl sees the shortened hits"
    );
}
