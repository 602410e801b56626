//! The engine-facing service API as engine authors met it: layer readiness of copies not yet
//! issued, failure counts, resizing, and what `allocate` returns.

mod service_support;

use std::time::Duration;

use kvshm::hash::BlockHash;
use kvshm::manager::{CacheConfig, RequestId, TicketStatus, WritePolicy};
use kvshm::service::{Service, ServiceConfig};
use service_support::*;

const BLOCK_TOKENS: u32 = 16;
const LAYERS: u32 = 2;

fn service(test: &str, cache: CacheConfig, tp_size: u32) -> Service {
    let name = unique_name(test);
    Service::create(&name, ServiceConfig::new(cache, tp_size, LAYERS, 2 * LAYERS, 256)).unwrap()
}

/// Runs one request over `prefix` to the end: match, allocate, wait, commit, finish.
fn cache_prefix(service: &mut Service, request: u64, prefix: &[BlockHash]) {
    let request = RequestId(request);
    let tokens = prefix.len() * BLOCK_TOKENS as usize;
    let matched = service.match_prefix(request, prefix, tokens).unwrap();
    let (_, ticket) = service.allocate(request, tokens - matched.cached_tokens, 0).unwrap();
    service.wait(ticket, Duration::from_secs(20)).unwrap();
    service.commit(request, tokens, prefix).unwrap();
    service.finish(request).unwrap();
}

#[test]
fn a_swap_in_held_back_behind_swap_outs_reports_no_layer_ready() {
    let cache = CacheConfig::new(BLOCK_TOKENS, 4).with_host_blocks(16);
    let mut service = service("held-back", cache.with_write_policy(WritePolicy::WriteBack), 2);
    let _workers = [WorkerProcess::spawn(service.segment().name(), 0, None), {
        WorkerProcess::spawn(service.segment().name(), 1, None)
    }];
    service.wait_for_workers(Duration::from_secs(10)).unwrap();
    let a = hashes(100, 4);
    let b = hashes(200, 4);
    cache_prefix(&mut service, 1, &a);
    cache_prefix(&mut service, 2, &b);
    assert!(service.wait_for_copies(Duration::from_secs(20)));

    let request = RequestId(3);
    // One prompt token past A's blocks, so that all of them can hit (the last-token rule).
    let matched = service.match_prefix(request, &a, a.len() * BLOCK_TOKENS as usize + 1).unwrap();
    assert_eq!(matched.host_blocks, 4, "A went to host when B took the device");
    // The swap-in needs B's blocks, whose swap-outs must read them first: it is held back.
    let (_, ticket) = service.allocate(request, 0, 0).unwrap();
    assert_eq!(service.ticket_status(ticket).unwrap(), TicketStatus::Pending);
    assert_eq!(
        service.ticket_layers_ready(ticket).unwrap(),
        0,
        "no block holds A yet: an engine reading layer 0 now would read B's bytes"
    );
    service.wait(ticket, Duration::from_secs(20)).unwrap();
    assert_eq!(service.ticket_layers_ready(ticket).unwrap(), LAYERS);
    service.cache().check_invariants().unwrap();
}

#[test]
fn a_copy_failing_for_want_of_a_worker_is_counted_once() {
    let cache = CacheConfig::new(BLOCK_TOKENS, 8).with_host_blocks(8);
    let mut service = service("no-worker", cache.with_write_policy(WritePolicy::WriteThrough), 1);
    // No worker attached: the write-through backup of the committed blocks fails at issue.
    let request = RequestId(1);
    let prefix = hashes(300, 2);
    let tokens = prefix.len() * BLOCK_TOKENS as usize;
    service.match_prefix(request, &prefix, tokens).unwrap();
    service.allocate(request, tokens, 0).unwrap();
    service.commit(request, tokens, &prefix).unwrap();
    service.finish(request).unwrap();
    service.poll();
    assert_eq!(service.cache().stats().counters.failed_transfers, 1, "one backup copy failed");
    assert_eq!(service.stats().copy_failures, 1);
    let published = service.segment().counters().get(kvshm_ipc::counters::Counter::CopyFailures);
    assert_eq!(published, 1, "kvctl and Prometheus read the same figure");
}
