//! `kvshm demo` end to end: a service, two worker processes and a conversation workload replayed
//! with real bytes that are checked on every hit. The built-in synthetic workload keeps the test
//! independent of the trace beside the checkout (whose first requests share little).

use std::process::Command;

fn demo(write_policy: &str) -> serde_json::Value {
    let output = Command::new(env!("CARGO_BIN_EXE_kvshm"))
        .args(["demo", "--synthetic", "--tp", "2", "--limit", "300", "--device-blocks", "96"])
        .args(["--host-blocks", "512", "--region-bytes", "1024", "--json"])
        .args(["--write-policy", write_policy])
        .output()
        .expect("running kvshm demo");
    assert!(
        output.status.success(),
        "kvshm demo failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("kvshm demo --json prints one JSON object")
}

fn count(report: &serde_json::Value, field: &str) -> u64 {
    report[field].as_u64().unwrap_or_else(|| panic!("{field} missing in {report}"))
}

#[test]
fn tp2_write_back_replay_hits_on_both_tiers_with_no_corrupted_block() {
    let report = demo("write_back");
    assert_eq!(count(&report, "corrupted_blocks"), 0, "{report}");
    assert_eq!(count(&report, "requests"), 300);
    assert_eq!(count(&report, "skipped_requests") + count(&report, "failed_requests"), 0);
    assert!(count(&report, "device_hit_blocks") > 0, "{report}");
    assert!(
        count(&report, "host_hit_blocks") > 0,
        "a small device tier sends hits to host: {report}"
    );
    assert!(
        count(&report, "swap_in_blocks") > 0 && count(&report, "swap_out_blocks") > 0,
        "{report}"
    );
    assert_eq!(
        count(&report, "verified_blocks"),
        count(&report, "hit_blocks"),
        "every hit block was checked: {report}"
    );
}

#[test]
fn tp2_write_through_replay_backs_blocks_up_with_no_corrupted_block() {
    let report = demo("write_through");
    assert_eq!(count(&report, "corrupted_blocks"), 0, "{report}");
    assert_eq!(count(&report, "skipped_requests") + count(&report, "failed_requests"), 0);
    assert!(count(&report, "backup_blocks") > 0, "{report}");
    assert!(count(&report, "host_hit_blocks") > 0, "{report}");
}
