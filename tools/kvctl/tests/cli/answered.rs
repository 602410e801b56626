//! Requests answered by a scheduler played by the test thread: a real `CacheManager` and the
//! scheduler side of the control area, so that `tree` reads the manager's own snapshot schema and
//! `reset` meets real refusals.

use kvshm::hash::BlockHash;
use kvshm::manager::{CacheConfig, CacheManager, RequestId};
use kvshm_ipc::config::SegmentConfig;
use kvshm_ipc::control::ResetStatus;
use kvshm_ipc::counters::Counter;
use kvshm_ipc::liveness::monotonic_ns;
use kvshm_ipc::segment::Segment;

use crate::support::*;

/// One poll of the played scheduler: answer pending requests, publish the poll time.
fn poll_once(segment: &Segment, manager: &mut CacheManager) {
    let control = segment.control();
    if let Some(request) = control.pending_reset() {
        let status = match manager.reset(request.force) {
            Ok(()) => {
                segment.bump_generation();
                ResetStatus::Done
            }
            Err(_) => ResetStatus::RefusedBusy,
        };
        control.complete_reset(request, status);
    }
    if let Some(request) = control.pending_snapshot() {
        let json = serde_json::to_vec(&manager.tree_snapshot(request.depth)).unwrap();
        control.publish_snapshot(request, &json).unwrap();
    }
    segment.counters().set(Counter::LastPollNs, monotonic_ns());
}

/// Caches `hashes` (a chain of three full blocks of 16 tokens) through one finished request.
fn cache_chain(manager: &mut CacheManager, request: u64, hashes: &[BlockHash]) {
    let request = RequestId(request);
    let tokens = hashes.len() * 16;
    manager.match_prefix(request, hashes, tokens).unwrap();
    manager.allocate(request, tokens, 0).unwrap();
    manager.commit(request, tokens, hashes).unwrap();
    manager.finish(request).unwrap();
}

#[test]
fn tree_prints_the_schedulers_snapshot_and_reset_is_refused_until_forced() {
    let name = unique_name("answered");
    let _cleanup = Cleanup(name.clone());
    let segment = Segment::create(&name, &SegmentConfig::default()).unwrap();
    let mut manager = CacheManager::new(CacheConfig::new(16, 64)).unwrap();
    let hashes = [BlockHash(0xa1), BlockHash(0xa2), BlockHash(0xa3)];
    cache_chain(&mut manager, 1, &hashes);
    let snapshot =
        kvctl_while(&["tree", name.as_str(), "--json"], || poll_once(&segment, &mut manager))
            .assert_ok()
            .json();
    assert_eq!(snapshot["total_nodes"], 3);
    let nodes = snapshot["nodes"].as_array().unwrap();
    let listed: Vec<_> = nodes.iter().map(|node| node["hash"].as_str().unwrap()).collect();
    assert_eq!(listed, hashes.map(|hash| hash.to_string()));
    assert_eq!(nodes[2]["depth"], 3);

    let shallow =
        kvctl_while(&["tree", name.as_str(), "--depth", "2"], || poll_once(&segment, &mut manager));
    let text = &shallow.assert_ok().stdout;
    assert!(text.contains("3 cached blocks; showing 2 (down to depth 2)"), "{text}");
    assert!(text.contains("\n  000000000000  device") && text.contains("(+1 below)"), "{text}");

    // A request that holds the cached prefix makes a plain reset refuse.
    manager.match_prefix(RequestId(2), &hashes, 48).unwrap();
    let generation = segment.generation();
    let refused =
        kvctl_while(&["reset", name.as_str(), "--json"], || poll_once(&segment, &mut manager));
    refused.assert_fails_saying(&["refused", "--force"]);
    assert_eq!(refused.json()["outcome"], "refused_busy");
    assert_eq!(segment.generation(), generation);

    let done =
        kvctl_while(&["reset", name.as_str(), "--force"], || poll_once(&segment, &mut manager));
    let expected = format!("cache reset, generation {generation} -> {}", generation + 1);
    assert!(done.assert_ok().stdout.contains(&expected), "{}", done.stdout);
    assert_eq!(manager.tree_snapshot(u32::MAX).total_nodes, 0);
}
