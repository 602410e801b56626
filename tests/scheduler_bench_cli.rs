//! `kvshm bench sched --json` end to end, at a small size: one JSON object with the operations,
//! the baseline and the memory per cached block.

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
