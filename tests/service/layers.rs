//! Layer-wise swap-ins: a ticket reports how many leading layers have landed on every rank, so an
//! engine can start on the first layers before the whole copy is done.

use std::time::Duration;

use kvshm::manager::{CacheConfig, RequestId, WritePolicy};
use kvshm::service::{Service, ServiceConfig};

use crate::support::*;

const BLOCK_TOKENS: u32 = 16;
const LAYERS: u32 = 4;

#[test]
fn a_slow_swap_in_reports_its_layers_one_by_one_until_the_ticket_is_ready() {
    let name = unique_name("layers");
    let cache = CacheConfig::new(BLOCK_TOKENS, 8)
        .with_host_blocks(32)
        .with_write_policy(WritePolicy::WriteThrough);
    let mut service =
        Service::create(&name, ServiceConfig::new(cache, 1, LAYERS, 2 * LAYERS, 4096)).unwrap();
    // 60 ms after every layer of every copy: each layer's landing is visible from here.
    let _worker = WorkerProcess::spawn(&name, 0, Some(60_000));
    service.wait_for_workers(Duration::from_secs(10)).unwrap();

    // Cache a prefix; write-through backs it up to host.
    let prefix = hashes(7_000, 4);
    let tokens = prefix.len() * BLOCK_TOKENS as usize;
    let request = RequestId(1);
    service.match_prefix(request, &prefix, tokens).unwrap();
    let allocation = service.allocate(request, tokens, 0).unwrap();
    let (table, ticket) = (allocation.block_table.to_vec(), allocation.ticket);
    service.wait(ticket, Duration::from_secs(10)).unwrap();
    for (hash, &block) in prefix.iter().zip(&table) {
        write_block(&service, *hash, block);
    }
    service.commit(request, tokens, &prefix).unwrap();
    service.finish(request).unwrap();
    assert!(service.wait_for_copies(Duration::from_secs(20)), "the backups land");

    // Push it off the device, then ask for it again: a swap-in from host.
    let other = hashes(8_000, 8);
    let request = RequestId(2);
    service.match_prefix(request, &other, 8 * BLOCK_TOKENS as usize).unwrap();
    let ticket = service.allocate(request, 8 * BLOCK_TOKENS as usize, 0).unwrap().ticket;
    service.wait(ticket, Duration::from_secs(20)).unwrap();
    service.abort(request).unwrap();

    let request = RequestId(3);
    // A prompt one token past the prefix, so that all of it may hit (the last-token rule).
    let matched = service.match_prefix(request, &prefix, tokens + 1).unwrap();
    assert_eq!(matched.host_blocks, prefix.len());
    let allocation = service.allocate(request, tokens - matched.cached_tokens, 0).unwrap();
    let (table, ticket) = (allocation.block_table.to_vec(), allocation.ticket);
    let mut seen = Vec::new();
    loop {
        service.poll();
        let layers = service.ticket_layers_ready(ticket).unwrap();
        if seen.last() != Some(&layers) {
            seen.push(layers);
        }
        if layers == LAYERS {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(seen.windows(2).all(|pair| pair[0] < pair[1]), "layers only grow: {seen:?}");
    assert!(
        seen.iter().any(|&layers| 0 < layers && layers < LAYERS),
        "some layers were reported before the whole copy landed: {seen:?}"
    );
    service.wait(ticket, Duration::from_secs(10)).unwrap();
    for (hash, &block) in prefix.iter().zip(&table) {
        assert!(device_block_holds(&service, *hash, block));
    }
    service.cache().check_invariants().unwrap();
}
