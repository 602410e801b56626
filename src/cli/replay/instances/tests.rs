//! Replays over instances on crafted workloads whose hits are known.

use super::*;

fn request(input_length: usize, hash_ids: &[u64]) -> TraceRequest {
    TraceRequest { timestamp: 0, input_length, output_length: 10, hash_ids: hash_ids.to_vec() }
}

fn config(route: Route, shared: bool, policy: WritePolicy, device_blocks: u32) -> InstanceConfig {
    InstanceConfig {
        instances: 2,
        route,
        route_seed: 1,
        device: CacheConfig::new(512, device_blocks),
        host_blocks: 16,
        shared_host_tier: shared,
        host_quota: None,
        host_free_blocks: DEFAULT_FREE_CHUNKS,
        write_policy: policy,
        prompt_only: false,
    }
}

fn hits(trace: &[TraceRequest], config: InstanceConfig) -> (u64, u64) {
    let report = replay_instances(trace, config).unwrap();
    assert_eq!(report.failed_requests, 0, "{report:?}");
    (report.device_hit_blocks, report.host_hit_blocks)
}

/// A prompt served twice in a row: round-robin sends its second turn to the other instance.
fn twice() -> [TraceRequest; 2] {
    [request(1100, &[0, 1, 2]), request(1100, &[0, 1, 2])]
}

#[test]
fn a_turn_on_another_instance_hits_a_shared_tier_written_through_and_misses_its_own_tier() {
    let (rr, wt) = (Route::RoundRobin, WritePolicy::WriteThrough);
    assert_eq!(hits(&twice(), config(rr, true, wt, 8)), (0, 2));
    assert_eq!(hits(&twice(), config(rr, false, wt, 8)), (0, 0));
    // Written back, the blocks are still only on the first instance's device: a miss.
    assert_eq!(hits(&twice(), config(rr, true, WritePolicy::WriteBack, 8)), (0, 0));
}

#[test]
fn sticky_routing_hits_the_device_of_the_conversations_instance() {
    let (sticky, wt) = (Route::Sticky, WritePolicy::WriteThrough);
    assert_eq!(hits(&twice(), config(sticky, false, wt, 8)), (2, 0));
    assert_eq!(hits(&twice(), config(sticky, true, wt, 8)), (2, 0));
}

#[test]
fn a_block_the_device_evicts_is_written_back_to_the_shared_tier_for_every_instance() {
    // Three device blocks an instance: a request of two full blocks and its output fill it.
    let trace = [
        request(1100, &[0, 1, 2]), // instance 0 caches 0 and 1
        request(1100, &[7, 8, 9]), // instance 1 caches 7 and 8
        request(1100, &[4, 5, 6]), // instance 0 evicts 0 and 1: written back
        request(1100, &[0, 1, 2]), // instance 1: both on host, if the tier is shared
    ];
    let (rr, wb) = (Route::RoundRobin, WritePolicy::WriteBack);
    assert_eq!(hits(&trace, config(rr, true, wb, 3)), (0, 2));
    assert_eq!(hits(&trace, config(rr, false, wb, 3)), (0, 0));
    let report = replay_instances(&trace, config(rr, true, wb, 3)).unwrap();
    // 0 and 1 at the third request, 7 and 8 at the fourth.
    assert_eq!(report.host_stores, 4, "{report:?}");
}

#[test]
fn per_instance_tiers_divide_the_host_blocks() {
    let trace = [
        request(1100, &[0, 1, 2]), // instance 0 stores 0 and 1
        request(600, &[9, 10]),    // instance 1 stores 9
        request(1100, &[3, 4, 5]), // instance 0 stores 3 and 4
    ];
    let mut config = config(Route::RoundRobin, false, WritePolicy::WriteThrough, 8);
    config.host_blocks = 4;
    // Two host blocks an instance: instance 0 evicts its first prompt for its second.
    let report = replay_instances(&trace, config.clone()).unwrap();
    assert_eq!((report.host_stores, report.host_evictions), (5, 2), "{report:?}");
    // One tier of four: one eviction makes room, the least recently used block of any instance.
    config.shared_host_tier = true;
    let report = replay_instances(&trace, config).unwrap();
    assert_eq!((report.host_stores, report.host_evictions), (5, 1), "{report:?}");
}

#[test]
fn a_host_quota_keeps_one_instance_from_flushing_the_other() {
    // Round-robin: instance 0 stores one prompt and then serves prompts without a full block;
    // instance 1 stores three prompts, then asks for instance 0's.
    let mut trace = vec![request(1100, &[0, 1, 2])];
    for conversation in 1..=3u64 {
        trace.push(request(1100, &[100 * conversation, 100 * conversation + 1, 999]));
        trace.push(request(300, &[998]));
    }
    trace.push(request(1100, &[0, 1, 2]));
    let mut shared = config(Route::RoundRobin, true, WritePolicy::WriteThrough, 8);
    shared.host_blocks = 6;
    let flushed = replay_instances(&trace, shared.clone()).unwrap();
    shared.host_quota = Some(4);
    let kept = replay_instances(&trace, shared).unwrap();
    assert_eq!(flushed.requests_per_instance, vec![4, 4]);
    assert_eq!((flushed.host_hit_blocks, kept.host_hit_blocks), (0, 2));
    // Flushed: 0 and 1 for the third prompt, and two more to store them again at the end.
    assert_eq!((flushed.host_evictions, kept.host_evictions), (4, 2));
}
