//! `kvshm replay` end to end: the binary on a slice of the Mooncake trace (see
//! [`crate::support::mooncake_trace`]).

use std::process::Command;

use crate::support::mooncake_trace as trace;

fn replay(extra: &[&str]) -> serde_json::Value {
    let output = Command::new(env!("CARGO_BIN_EXE_kvshm"))
        .args(["replay", "--trace"])
        .arg(trace())
        .args(["--block-tokens", "512", "--limit", "300", "--json"])
        .args(extra)
        .output()
        .expect("the kvshm binary runs");
    assert!(output.status.success(), "replay failed: {}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8(output.stdout).unwrap();
    serde_json::from_str(stdout.trim())
        .unwrap_or_else(|error| panic!("not one JSON object ({error}): {stdout}"))
}

fn check_sanity(report: &serde_json::Value) {
    for field in [
        "requests",
        "blocks",
        "hit_blocks",
        "device_hit_blocks",
        "host_hit_blocks",
        "hit_rate_blocks",
        "hit_rate_tokens",
        "evictions",
        "swaps_in",
        "swaps_out",
    ] {
        assert!(report[field].is_number(), "{field} missing in {report}");
    }
    assert_eq!(report["requests"], 300);
    let number = |field: &str| report[field].as_f64().unwrap();
    for rate in ["hit_rate_blocks", "hit_rate_tokens"] {
        assert!((0.0..=1.0).contains(&number(rate)), "{rate} = {}", number(rate));
    }
    assert_eq!(number("hit_blocks"), number("device_hit_blocks") + number("host_hit_blocks"));
    assert!(number("hit_blocks") <= number("blocks"));
    let latency = &report["sched_us_per_request"];
    assert!(latency["p50"].as_f64().unwrap() <= latency["p99"].as_f64().unwrap());
}

#[test]
fn replaying_a_trace_slice_prints_sane_hit_rates() {
    let report = replay(&["--device-blocks", "2000"]);
    check_sanity(&report);
    assert!(report["hit_blocks"].as_u64().unwrap() > 0, "a conversation trace shares prefixes");
    assert_eq!(report["host_hit_blocks"], 0, "no host tier");
}

#[test]
fn a_host_tier_turns_evictions_into_host_hits() {
    let report = replay(&[
        "--device-blocks",
        "200",
        "--host-blocks",
        "8000",
        "--write-policy",
        "write_back",
    ]);
    check_sanity(&report);
    assert!(report["host_hit_blocks"].as_u64().unwrap() > 0, "{report}");
    assert!(report["swaps_out"].as_u64().unwrap() > 0 && report["swaps_in"].as_u64().unwrap() > 0);
}

#[test]
fn the_eviction_policy_is_chosen_by_name_and_an_unknown_one_is_refused() {
    let mut hit_blocks = Vec::new();
    for policy in ["lru", "conv", "optimal"] {
        let report = replay(&["--device-blocks", "300", "--eviction", policy]);
        check_sanity(&report);
        assert_eq!(report["eviction"], policy);
        hit_blocks.push(report["hit_blocks"].as_u64().unwrap());
    }
    // The offline optimum bounds the online policies from above.
    assert!(hit_blocks[2] > hit_blocks[0] && hit_blocks[2] >= hit_blocks[1], "{hit_blocks:?}");
    let output = Command::new(env!("CARGO_BIN_EXE_kvshm"))
        .args(["replay", "--trace"])
        .arg(trace())
        .args(["--device-blocks", "100", "--limit", "10", "--eviction", "clairvoyant"])
        .output()
        .expect("the kvshm binary runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("unknown eviction policy") && stderr.contains("lru"), "{stderr}");
}

/// The trace slice over 4 instances with host tiers of 2,000 blocks in all, per instance or
/// shared: (hit tokens, host hit blocks).
fn over_instances(route: &str, shared: bool, policy: &str) -> (u64, u64) {
    let mut args = vec!["--device-blocks", "100", "--host-blocks", "2000", "--instances", "4"];
    args.extend(["--route", route, "--write-policy", policy]);
    if shared {
        args.push("--shared-host-tier");
    }
    let report = replay(&args);
    assert_eq!(report["requests"], 300);
    assert_eq!(report["shared_host_tier"], shared);
    let rate = report["hit_rate_tokens"].as_f64().unwrap();
    assert!((0.0..1.0).contains(&rate), "{report}");
    (report["hit_tokens"].as_u64().unwrap(), report["host_hit_blocks"].as_u64().unwrap())
}

#[test]
fn a_shared_host_tier_hits_turns_that_land_on_other_instances() {
    for policy in ["write_back", "write_through"] {
        let (own, own_host) = over_instances("round-robin", false, policy);
        let (shared, shared_host) = over_instances("round-robin", true, policy);
        assert!(shared > own && shared_host > own_host, "{policy}: {shared} vs {own}");
    }
    // Written through, every computed block is in the one tier whichever instance asks.
    let (round_robin, _) = over_instances("round-robin", true, "write_through");
    let (random, _) = over_instances("random", true, "write_through");
    assert_eq!(round_robin, random);
}
