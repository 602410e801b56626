//! `kvshm bench sched --json` and `kvshm bench hash --json` end to end, at a small size: each
//! prints one JSON object with its baselines (and the memory per cached block, for sched).

use std::process::Command;

#[test]
fn bench_sched_prints_one_json_object_with_a_baseline() {
    let output = Command::new(env!("CARGO_BIN_EXE_kvshm"))
        .args(["bench", "sched", "--json", "--cached-blocks", "4096", "--samples", "50"])
        .output()
        .expect("the kvshm binary runs");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let report: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("one JSON object");
    for field in [
        "match_ns_per_block",
        "allocate_ns_per_block",
        "allocate_evicting_ns_per_block",
        "commit_ns_per_block",
        "finish_ns_per_block",
        "baseline_hashmap_get_ns_per_block",
        "baseline_probe_ns_per_block",
    ] {
        let p50 =
            report[field]["p50"].as_f64().unwrap_or_else(|| panic!("{field} missing: {report}"));
        assert!(p50 > 0.0 && p50 <= report[field]["p99"].as_f64().unwrap(), "{field}");
    }
    assert_eq!(report["cached_blocks"], 4096);
    assert!(report["memory"]["estimated_bytes_per_cached_block"].as_f64().unwrap() > 0.0);
    for ratio in ["matching", "lookup", "allocate_evicting", "commit"] {
        assert!(report["over_probe_p50"][ratio].as_f64().unwrap() > 0.0, "{ratio}: {report}");
    }
}

#[test]
fn bench_hash_prints_one_json_object_with_the_xxh3_floor() {
    let trace = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("traces/mooncake_conversation_trace.jsonl");
    let output = Command::new(env!("CARGO_BIN_EXE_kvshm"))
        .args(["bench", "hash", "--json", "--limit", "50", "--vllm-python", "/nonexistent/python"])
        .arg("--trace")
        .arg(trace)
        .output()
        .expect("the kvshm binary runs");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let report: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("one JSON object");
    for field in ["xxh3_floor", "kvshm", "kvshm_extra_keys"] {
        assert!(report[field]["gb_per_s"].as_f64().unwrap() > 0.0, "{field}: {report}");
    }
    assert_eq!(report["requests"], 50);
    assert!(report["vllm"].is_null());
    assert!(report["vllm_missing"].as_str().unwrap().contains("/nonexistent/python"));
}
