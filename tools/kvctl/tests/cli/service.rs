//! Against a live `kvshm::service::Service` in the test process: host backend, TP 1, no host tier
//! (so nothing needs copying and no worker has to run), polled by the test thread while each kvctl
//! process runs.

use kvshm::hash::BlockHash;
use kvshm::manager::{CacheConfig, RequestId};
use kvshm::service::{Service, ServiceConfig};
use kvshm_ipc::counters::Counter;

use crate::support::*;

const BLOCK_TOKENS: usize = 16;

/// Runs one request through match, allocate, commit and finish; the blocks stay cached.
fn run_request(service: &mut Service, id: u64, hashes: &[BlockHash]) {
    let request = RequestId(id);
    let tokens = hashes.len() * BLOCK_TOKENS;
    service.match_prefix(request, hashes, tokens).unwrap();
    service.allocate(request, tokens, 0).unwrap();
    service.commit(request, tokens, hashes).unwrap();
    service.finish(request).unwrap();
}

#[test]
fn kvctl_reads_and_drives_a_live_service() {
    let name = unique_name("service");
    let _cleanup = Cleanup(name.clone());
    let cache = CacheConfig::new(BLOCK_TOKENS as u32, 64);
    let mut service = Service::create(&name, ServiceConfig::new(cache, 1, 2, 4, 1024)).unwrap();
    let chain = [BlockHash(0xa1), BlockHash(0xa2), BlockHash(0xa3)];
    let branch = [BlockHash(0xa1), BlockHash(0xb2)];
    run_request(&mut service, 1, &chain);
    run_request(&mut service, 2, &branch);
    service.poll();
    let name = name.as_str();

    // stat: the counters the service publishes, and a polling scheduler.
    let stat = kvctl_while(&["stat", name, "--json"], || service.poll()).assert_ok().json();
    assert_eq!(stat["counters"]["cached_nodes"], 4);
    assert_eq!(stat["counters"]["device_hit_blocks"], 1);
    assert_eq!(stat["counters"]["lookups"], 2);
    assert_eq!(stat["counters"]["device_blocks_total"], 64);
    assert_eq!(stat["config"]["block_tokens"], BLOCK_TOKENS);
    assert_eq!(stat["config"]["host_blocks"], 0);
    assert_eq!(stat["scheduler"]["polling"], true);
    let generation = stat["generation"].as_u64().unwrap();

    let text =
        kvctl_while(&["stat", name, "--prometheus"], || service.poll()).assert_ok().stdout.clone();
    let (samples, _) = parse_prometheus(&text).unwrap_or_else(|error| panic!("{error}\n{text}"));
    let cached = samples.iter().find(|sample| sample.name == "kvshm_cached_nodes").unwrap();
    assert_eq!((cached.value, cached.labels["segment"].as_str()), (4.0, name));

    let workers = kvctl_while(&["workers", name, "--json"], || service.poll()).assert_ok().json();
    assert_eq!(workers["ranks"][0]["verdict"], "empty");

    // tree: the cached nodes, depth-first by hash, each under its parent.
    let tree = kvctl_while(&["tree", name, "--json"], || service.poll()).assert_ok().json();
    assert_eq!(tree["total_nodes"], 4);
    let nodes = tree["nodes"].as_array().unwrap();
    let hashes: Vec<_> = nodes.iter().map(|node| node["hash"].as_str().unwrap()).collect();
    let expected = [chain[0], chain[1], chain[2], branch[1]].map(|hash| hash.to_string());
    assert_eq!(hashes, expected);
    assert_eq!(nodes[1]["parent"], nodes[0]["id"]);
    assert_eq!(nodes[3]["parent"], nodes[0]["id"]);
    assert!(nodes.iter().all(|node| node["state"] == "device" && node["ref_count"] == 0));

    let text =
        kvctl_while(&["tree", name, "--depth", "2"], || service.poll()).assert_ok().stdout.clone();
    assert!(text.contains("4 cached blocks; showing 3 (down to depth 2)"), "{text}");
    assert!(
        text.contains("\n  000000000000  2      device") && text.contains("(+1 below)"),
        "{text}"
    );

    // reset: refused while a request holds blocks, done with --force, and the generation moves.
    service.match_prefix(RequestId(3), &chain, chain.len() * BLOCK_TOKENS).unwrap();
    let refused = kvctl_while(&["reset", name, "--json"], || service.poll());
    refused.assert_fails_saying(&["refused", "--force"]);
    assert_eq!(refused.json()["outcome"], "refused_busy");
    assert_eq!(service.segment().generation(), generation);
    assert_eq!(service.cache().tree_snapshot(u32::MAX).total_nodes, 4);

    let done =
        kvctl_while(&["reset", name, "--force", "--json"], || service.poll()).assert_ok().json();
    assert_eq!(done["outcome"], "done");
    assert_eq!(done["generation_before"], generation);
    assert_eq!(done["generation_after"], generation + 1);
    assert_eq!(service.segment().generation(), generation + 1);
    let stat = kvctl_while(&["stat", name, "--json"], || service.poll()).assert_ok().json();
    assert_eq!(stat["counters"]["cached_nodes"], 0);
    assert_eq!(stat["counters"][Counter::Resets.name()], 1);
    assert_eq!(stat["generation"], generation + 1);
}
