//! The engine-facing service API as engine authors met it: layer readiness of copies not yet
//! issued, failure counts, resizing, and what `allocate` returns.

use std::time::Duration;

use kvshm::hash::BlockHash;
use kvshm::manager::{
    BlockPair, CacheConfig, CommandError, RequestId, ResizeError, TicketStatus, TransferFailure,
    WritePolicy,
};
use kvshm::service::{
    Backend, Counter, DeviceRegionHandle, DeviceResizeError, SegmentName, Service, ServiceConfig,
    CUDA_IPC_HANDLE_BYTES,
};

use crate::support::*;

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
    let ticket = service.allocate(request, tokens - matched.cached_tokens, 0).unwrap().ticket;
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
    let ticket = service.allocate(request, 0, 0).unwrap().ticket;
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
    let published = service.segment().counters().get(Counter::CopyFailures);
    assert_eq!(published, 1, "kvctl and Prometheus read the same figure");
}

#[test]
fn allocate_returns_the_table_and_how_many_blocks_it_added() {
    let mut service = service("allocation", CacheConfig::new(BLOCK_TOKENS, 8), 1);
    let request = RequestId(1);
    let prefix = hashes(400, 2);
    service.match_prefix(request, &prefix, 40).unwrap();
    let allocation = service.allocate(request, 40, 0).unwrap();
    assert_eq!((allocation.new_blocks, allocation.block_table.len()), (3, 3));
    let first = allocation.block_table.to_vec();
    let allocation = service.allocate(request, 16, 0).unwrap();
    assert_eq!(allocation.new_blocks, 1);
    assert_eq!(&allocation.block_table[..3], &first[..]);
    assert_eq!(service.cache().block_table(request).unwrap().len(), 4);
}

#[test]
fn the_device_tier_resizes_within_the_segment_it_was_created_with() {
    let mut service = service("resize", CacheConfig::new(BLOCK_TOKENS, 8), 1);
    let request = RequestId(1);
    service.match_prefix(request, &hashes(500, 1), 32).unwrap();
    service.allocate(request, 32, 0).unwrap();
    assert_eq!(
        service.resize_device(9),
        Err(DeviceResizeError::BeyondSegment { blocks: 9, capacity: 8 })
    );
    assert_eq!(
        service.resize_device(1),
        Err(DeviceResizeError::Cache(ResizeError::BlocksInUse { blocks: 1, first_in_use: 1 }))
    );
    service.resize_device(4).unwrap();
    assert_eq!(service.cache().stats().device_blocks, 4);
    let published = service.segment().counters().get(Counter::DeviceBlocksTotal);
    assert_eq!(published, 4, "kvctl sees the new size");
    service.resize_device(8).unwrap();
    service.cache().check_invariants().unwrap();
}

#[test]
fn the_shared_memory_types_of_the_api_come_from_kvshm_itself() {
    // An engine depends on kvshm alone: what its API names is re-exported.
    let failure = TransferFailure { rank: 0, error: CommandError::WorkerDied, detail: 0 };
    let pair = BlockPair::new(1, 2);
    assert_eq!((failure.error, pair.src, pair.dst), (CommandError::WorkerDied, 1, 2));
    let name: SegmentName = SegmentName::new("kvshm-api-check").unwrap();
    let handle = DeviceRegionHandle::new([0; CUDA_IPC_HANDLE_BYTES], 0, 64, 64);
    assert_eq!((name.as_str(), handle.len), ("kvshm-api-check", 64));
    assert_eq!(Backend::HostArena, ServiceConfig::new(CacheConfig::new(1, 1), 1, 1, 1, 1).backend);
}
