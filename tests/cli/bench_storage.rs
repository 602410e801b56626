//! `kvshm bench storage --json` end to end, on tiny sizes: one JSON object with the headline
//! ratios, the disk table (both paths, both block sizes, both patterns) and the Redis table.

use std::process::Command;

use crate::support::{redis_for_test, Scratch};

#[test]
fn bench_storage_prints_one_json_object_with_disk_and_redis_figures() {
    let redis = redis_for_test();
    let dir = Scratch::new("bench-cli");
    let output = Command::new(env!("CARGO_BIN_EXE_kvshm"))
        .args(["bench", "storage", "--json", "--mib", "4", "--redis-mib", "2"])
        .arg("--dir")
        .arg(&dir.0)
        .args(["--redis", &redis.url()])
        .output()
        .expect("run kvshm bench storage");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8(output.stdout).unwrap();
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    assert!(report["disk_write_over_baseline"].as_f64().unwrap() > 0.0);
    assert!(report["disk_read_over_baseline"].as_f64().unwrap() > 0.0);
    let disk = report["disk"].as_array().unwrap();
    assert_eq!(disk.len(), 8, "2 paths x 2 block sizes x 2 patterns");
    for row in disk {
        for figure in ["write_gbps", "read_gbps", "baseline_write_gbps", "baseline_read_gbps"] {
            assert!(row[figure].as_f64().unwrap() > 0.0, "{figure} in {row}");
        }
    }
    let rows = report["redis"]["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "2 paths x 2 block sizes");
    for row in rows {
        assert!(row["get_ms_per_block"].as_f64().unwrap() > 0.0, "{row}");
        assert!(row["baseline_set_gbps"].as_f64().unwrap() > 0.0, "{row}");
    }
    // The bench leaves nothing behind in its directory.
    assert_eq!(std::fs::read_dir(&dir.0).unwrap().count(), 0);
}

#[test]
fn bench_storage_refuses_absurd_sizes() {
    let output = Command::new(env!("CARGO_BIN_EXE_kvshm"))
        .args(["bench", "storage", "--json", "--mib", "0"])
        .output()
        .expect("run kvshm bench storage");
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("--mib"));
}
