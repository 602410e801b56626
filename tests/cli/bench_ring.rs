//! `kvshm bench ring --json` end to end: two real processes, one JSON object with every figure.

use std::process::Command;

#[test]
fn bench_ring_prints_one_json_object_with_every_figure() {
    let output = Command::new(env!("CARGO_BIN_EXE_kvshm"))
        .args(["bench", "ring", "--json", "--round-trips", "300", "--stream-records", "50000"])
        .args(["--stream-batch", "100"])
        .output()
        .expect("run kvshm bench ring");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8(output.stdout).unwrap();
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    for latency in ["ring_busy_rtt_ns", "ring_futex_rtt_ns", "ring_sleep_rtt_ns", "pipe_rtt_ns"] {
        let p50 = report[latency]["p50"].as_u64().unwrap_or_else(|| panic!("{latency}.p50"));
        let p99 = report[latency]["p99"].as_u64().unwrap_or_else(|| panic!("{latency}.p99"));
        assert!(0 < p50 && p50 <= p99, "{latency}: {}", report[latency]);
    }
    for count in [
        "ring_busy_round_trips",
        "ring_futex_round_trips",
        "ring_sleep_round_trips",
        "pipe_round_trips",
    ] {
        let measured = report[count].as_u64().unwrap();
        assert!((1..=300).contains(&measured), "{count}: {measured}");
    }
    // Sleeping at once does sleep.
    assert!(report["ring_sleep_sleeps_per_round_trip"].as_f64().unwrap() > 0.0, "{report}");
    assert!(report["ring_futex_sleeps_per_round_trip"].as_f64().unwrap() >= 0.0);
    assert!(report["ring_futex_spin_ns"].as_u64().unwrap() > 0);
    for phase in ["ring_futex", "ring_sleep", "pipe"] {
        let fraction = report["peer_on_driver_cpu"][phase].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&fraction), "{phase}: {fraction}");
    }
    assert!(report["ring_records_per_s"].as_f64().unwrap() > 0.0);
    assert_eq!(report["ring_stream_batch"], 100);
    assert!(report["ring_stream_records"].as_u64().unwrap() > 0);
}

#[test]
fn bench_ring_refuses_a_batch_larger_than_the_ring() {
    let output = Command::new(env!("CARGO_BIN_EXE_kvshm"))
        .args(["bench", "ring", "--json", "--stream-batch", "5000"])
        .output()
        .expect("run kvshm bench ring");
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("--stream-batch"));
}
