//! `kvshm bench shared-tier --json` end to end: one JSON object with both ways of keeping the
//! host tier, served the same requests; with `--rings`, the third way through an owner process.

use std::process::Command;

#[test]
fn bench_shared_tier_prints_one_json_object_with_the_baseline_beside_it() {
    let output = Command::new(env!("CARGO_BIN_EXE_kvshm"))
        .args(["bench", "shared-tier", "--json", "--limit", "600", "--host-blocks", "2000"])
        .output()
        .expect("run kvshm bench shared-tier");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8(output.stdout).unwrap();
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    assert_eq!((report["requests"].as_u64(), report["instances"].as_u64()), (Some(600), Some(4)));
    for way in ["per_instance", "shared"] {
        let latency = &report[way]["us_per_request"];
        let (p50, p99) = (latency["p50"].as_f64().unwrap(), latency["p99"].as_f64().unwrap());
        assert!(0.0 < p50 && p50 <= p99, "{way}: {latency}");
    }
    let hits = |way: &str| report[way]["hit_blocks"].as_u64().unwrap();
    assert!(hits("shared") > hits("per_instance"), "round-robin turns hit a shared tier: {report}");
    assert!(report["p50_ratio"].as_f64().unwrap() > 0.0);
}

#[test]
fn bench_shared_tier_with_rings_serves_the_same_requests_through_an_owner_process() {
    let output = Command::new(env!("CARGO_BIN_EXE_kvshm"))
        // Steps of 22 requests an instance: a step's first batch (the last step's 44 completions
        // and ends, its 22 lookups) is more than one batch carries, so the client splits it.
        .args(["bench", "shared-tier", "--json", "--rings", "--step", "22", "--limit", "600"])
        .args(["--host-blocks", "2000"])
        .output()
        .expect("run kvshm bench shared-tier --rings");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8(output.stdout).unwrap();
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    let latency = &report["rings"]["us_per_request"];
    let (p50, p99) = (latency["p50"].as_f64().unwrap(), latency["p99"].as_f64().unwrap());
    assert!(0.0 < p50 && p50 <= p99, "rings: {latency}");
    let hits = |way: &str| report[way]["hit_blocks"].as_u64().unwrap();
    assert!(hits("rings") > 0, "the owner's index answers hits: {report}");
    assert!(report["rings_p50_ratio"].as_f64().unwrap() > 0.0);
    assert_eq!(report["step"].as_u64(), Some(22));
}
