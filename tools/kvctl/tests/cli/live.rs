//! A live segment whose "scheduler" is the test process and never polls: everything kvctl reads
//! without asking the scheduler, and the clear failure of what needs an answer.

use std::time::Duration;

use kvshm_ipc::config::{SegmentConfig, WritePolicy};
use kvshm_ipc::counters::Counter;
use kvshm_ipc::liveness::monotonic_ns;
use kvshm_ipc::segment::Segment;

use crate::support::*;

fn create(tag: &str, config: SegmentConfig) -> (Segment, Cleanup) {
    let name = unique_name(tag);
    let cleanup = Cleanup(name.clone());
    (Segment::create(&name, &config).unwrap(), cleanup)
}

fn with_counters(segment: &Segment) {
    let counters = segment.counters();
    counters.set(Counter::DeviceHitBlocks, 6);
    counters.set(Counter::HostHitBlocks, 2);
    counters.set(Counter::MissBlocks, 2);
    counters.set(Counter::CachedNodes, 5);
    counters.set(Counter::Lookups, 4);
    counters.set(Counter::WorkerCopyBytes, 3 << 30);
    counters.set(Counter::WorkerCopyNs, 1_500_000_000);
    counters.set(Counter::LastPollNs, monotonic_ns());
}

#[test]
fn stat_reads_the_configuration_counters_and_hit_rate() {
    let config = SegmentConfig { tp_size: 2, regions: 4, layers: 2, ..SegmentConfig::default() }
        .with_write_policy(WritePolicy::WriteThroughSelective { threshold: 3 });
    let (segment, _cleanup) = create("stat", config);
    with_counters(&segment);
    let name = segment.name().as_str();

    let report = kvctl(&["stat", name, "--json"]).assert_ok().json();
    assert_eq!(report["segment"], name);
    assert_eq!(report["creator_pid"], std::process::id());
    assert_eq!(report["generation"], segment.generation());
    let config_json = &report["config"];
    assert_eq!(config_json["tp_size"], 2);
    assert_eq!(config_json["layers"], 2);
    assert_eq!(config_json["block_bytes"], 4 * 4096);
    assert_eq!(config_json["write_policy"], "write_through_selective");
    assert_eq!(config_json["write_threshold"], 3);
    assert_eq!(config_json["backend"], "host_arena");
    assert_eq!(config_json["kind"], "scheduler");
    assert_eq!(report["counters"]["cached_nodes"], 5);
    assert_eq!(report["counters"].as_object().unwrap().len(), Counter::ALL.len());
    assert_eq!(report["hit_rate"]["total"], 0.8);
    assert_eq!(report["scheduler"]["polling"], true);
    assert_eq!(report["worker_copy"]["bytes_per_second"], f64::from(2u32 << 30));

    let text = kvctl(&["stat", name]).assert_ok().stdout.clone();
    assert!(text.contains("copies     3.0 GiB in 1.5 s (2.0 GiB/s while copying)"), "{text}");
    assert!(text.contains("80.0% of 10 queried blocks"), "{text}");
    assert!(text.contains("write_through_selective (threshold 3)"), "{text}");
    assert!(text.contains("scheduler  polling"), "{text}");
    assert!(!text.contains("storage    "), "no storage tier, no storage line: {text}");
}

/// An engine's host tier (vLLM's offloading connector): the engine decides what to store and its
/// process polls, so kvctl names the engine, and no write policy that nothing applies.
#[test]
fn stat_describes_an_engines_host_tier_as_the_engines() {
    let config = SegmentConfig {
        kind: SegmentConfig::KIND_ENGINE_HOST_TIER,
        copies: SegmentConfig::COPIES_IN_ENGINE,
        ..SegmentConfig::default()
    };
    let (segment, _cleanup) = create("engine", config);
    with_counters(&segment);
    let name = segment.name().as_str();
    let report = kvctl(&["stat", name, "--json"]).assert_ok().json();
    assert_eq!(report["config"]["kind"], "engine_host_tier");
    assert_eq!(report["config"]["write_policy"], serde_json::Value::Null);
    assert_eq!(report["config"]["backend"], "in_process");
    let text = kvctl(&["stat", name]).assert_ok().stdout.clone();
    assert!(text.contains("engine     polling"), "{text}");
    assert!(text.contains("backend in_process, stores decided by the engine"), "{text}");
    assert!(!text.contains("write_back") && !text.contains("scheduler"), "{text}");
    let metrics = kvctl(&["stat", name, "--prometheus"]).assert_ok().stdout.clone();
    assert!(metrics.contains("kind=\"engine_host_tier\""), "{metrics}");
    assert!(!metrics.contains("write_policy"), "{metrics}");
}

#[test]
fn stat_shows_the_storage_tier_capacity_use_and_hits() {
    let (segment, _cleanup) = create("storage", SegmentConfig::default());
    with_counters(&segment);
    let counters = segment.counters();
    counters.set(Counter::DeviceHitBlocks, 5);
    counters.set(Counter::StorageHitBlocks, 1);
    counters.set(Counter::StorageBlocksTotal, 4096);
    counters.set(Counter::StorageBlocksUsed, 1500);
    counters.set(Counter::StorageStoredBlocks, 1700);
    counters.set(Counter::StorageLoadHits, 300);
    let name = segment.name().as_str();
    let report = kvctl(&["stat", name, "--json"]).assert_ok().json();
    assert_eq!(report["counters"]["storage_blocks_used"], 1500);
    assert_eq!(report["hit_rate"]["storage"], 0.1);
    assert_eq!(report["hit_rate"]["total"], 0.8);
    let text = kvctl(&["stat", name]).assert_ok().stdout.clone();
    assert!(
        text.contains("storage    1500 of 4096 blocks used; 1700 stored, 300 loaded"),
        "{text}"
    );
    assert!(text.contains("device 50.0%, host 20.0%, storage 10.0%"), "{text}");
}

#[test]
fn stat_says_when_the_scheduler_has_not_polled() {
    let (segment, _cleanup) = create("quiet", SegmentConfig::default());
    let name = segment.name().as_str();
    let text = kvctl(&["stat", name]).assert_ok().stdout.clone();
    assert!(text.contains("scheduler  never polled"), "{text}");
    let old = monotonic_ns().saturating_sub(Duration::from_secs(30).as_nanos() as u64);
    segment.counters().set(Counter::LastPollNs, old);
    let report = kvctl(&["stat", name, "--json"]).assert_ok().json();
    assert_eq!(report["scheduler"]["polling"], false);
    assert!(report["scheduler"]["last_poll_age_seconds"].as_f64().unwrap() >= 30.0);
}

#[test]
fn stat_prometheus_is_valid_exposition_labelled_with_the_segment() {
    let (segment, _cleanup) = create("prom", SegmentConfig::default());
    with_counters(&segment);
    let name = segment.name().as_str();
    let text = kvctl(&["stat", name, "--prometheus"]).assert_ok().stdout.clone();
    let (samples, types) =
        parse_prometheus(&text).unwrap_or_else(|error| panic!("{error}\n{text}"));
    for counter in Counter::ALL {
        let metric = kvctl::prometheus::metric_name(counter);
        let expected_type = if counter.is_gauge() { "gauge" } else { "counter" };
        assert_eq!(types.get(&metric).map(String::as_str), Some(expected_type), "{metric}");
        let sample = samples.iter().find(|sample| sample.name == metric).unwrap();
        assert_eq!(sample.labels["segment"], name);
        assert_eq!(sample.value, segment.counters().get(counter) as f64, "{metric}");
    }
    assert!(samples.iter().any(|s| s.name == "kvshm_lookups_total" && s.value == 4.0));
    assert!(samples.iter().any(|s| s.name == "kvshm_scheduler_polling" && s.value == 1.0));
}

#[test]
fn workers_judges_each_rank_alive_dead_or_empty() {
    let config = SegmentConfig { tp_size: 4, ..SegmentConfig::default() };
    let (segment, _cleanup) = create("workers", config);
    let alive = segment.claim_rank(0).unwrap();
    let silent = segment.claim_rank(1).unwrap();
    silent.mark_serving().unwrap();
    let setting_up = segment.claim_rank(3).unwrap();
    // Ranks 1 and 3 never beat again: past the serving limit, rank 1's worker (serving) counts
    // as dead, rank 3's (still setting up, judged by the longer set-up limit) as alive.
    std::thread::sleep(kvshm_ipc::worker_slot::HEARTBEAT_TIMEOUT + Duration::from_millis(50));
    alive.mark_serving().unwrap();

    let report = kvctl(&["workers", segment.name().as_str(), "--json"]).assert_ok().json();
    let ranks = report["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 4);
    assert_eq!(ranks[0]["verdict"], "alive");
    assert_eq!(ranks[0]["state"], "attached");
    assert_eq!(ranks[0]["pid"], std::process::id());
    assert_eq!(ranks[0]["attach_count"], 1);
    assert_eq!(ranks[0]["serving"], true);
    assert_eq!(ranks[1]["verdict"], "dead");
    assert_eq!(ranks[1]["serving"], true);
    assert!(ranks[1]["reason"].as_str().unwrap().contains("no heartbeat"), "{report}");
    assert!(ranks[1]["reason"].as_str().unwrap().contains("limit 100"), "{report}");
    assert_eq!(ranks[2]["verdict"], "empty");
    assert_eq!(ranks[2]["pid"], serde_json::Value::Null);
    assert_eq!(ranks[3]["verdict"], "alive", "a worker setting up: {report}");
    assert_eq!(ranks[3]["serving"], false);
    assert_eq!(report["setup_heartbeat_timeout_seconds"], 2.0);

    let text = kvctl(&["workers", segment.name().as_str()]).assert_ok().stdout.clone();
    assert!(
        text.contains("alive") && text.contains("dead: no heartbeat") && text.contains("no worker"),
        "{text}"
    );
    drop((alive, silent, setting_up));
}

#[test]
fn tree_and_reset_fail_clearly_when_no_scheduler_answers() {
    let (segment, _cleanup) = create("silent", SegmentConfig::default());
    let name = segment.name().as_str();
    let generation = segment.generation();
    kvctl(&["tree", name, "--timeout", "150ms"])
        .assert_fails_saying(&["did not answer within 150ms", "never polled"]);
    kvctl(&["reset", name, "--timeout", "150ms"])
        .assert_fails_saying(&["did not answer within 150ms", "stays pending"]);
    assert_eq!(segment.generation(), generation);
}

/// `tree` and `reset` ask the scheduler through the control area; an engine's host tier has
/// none (its engine keeps its own cache): kvctl refuses at once and says so, rather than wait
/// and promise that the request will be carried out.
#[test]
fn tree_and_reset_refuse_an_engines_host_tier_at_once() {
    let config = SegmentConfig {
        kind: SegmentConfig::KIND_ENGINE_HOST_TIER,
        copies: SegmentConfig::COPIES_IN_ENGINE,
        ..SegmentConfig::default()
    };
    let (segment, _cleanup) = create("engine-reset", config);
    with_counters(&segment);
    let name = segment.name().as_str();
    let generation = segment.generation();
    for command in ["tree", "reset"] {
        kvctl(&[command, name, "--timeout", "5s"]).assert_fails_saying(&[
            "an engine's host tier",
            &format!("answers no `kvctl {command}`"),
        ]);
    }
    assert_eq!(segment.generation(), generation);
    let control = segment.control();
    assert!(control.pending_reset().is_none() && control.pending_snapshot().is_none());
}

#[test]
fn cleanup_never_removes_a_live_segment() {
    let (segment, _cleanup) = create("keep", SegmentConfig::default());
    let name = segment.name().as_str();
    let report = kvctl(&["cleanup", name, "--json"]).assert_ok().json();
    assert_eq!(report["removed"].as_array().unwrap().len(), 0, "{report}");
    assert!(exists(&segment.name().control_object()));
    assert!(exists(&segment.name().host_tier_object(0)));
    let listing = kvctl(&["ls", name, "--json"]).assert_ok().json();
    assert_eq!(listing["segments"][0]["state"], "live");
    assert_eq!(listing["segments"][0]["data_objects"].as_array().unwrap().len(), 2);
}
