//! The storage tier through the whole service, with real processes: `kvshm demo --storage
//! disk:DIR` runs the scheduler and one worker per rank; blocks go device -> host -> disk and
//! back, and every hit is checked byte for byte on every rank and region. A second run of the
//! whole service over the same directory finds the first run's blocks through the persisted
//! index and hits them; damaged records are misses for their blocks, and the requests that hit
//! them compute those blocks instead (never aborted). With `--storage redis://...` the same round
//! trip goes through Redis.

use std::process::{Command, Stdio};

use serde_json::Value;

use crate::support::Scratch;

/// Runs the demo on the synthetic workload with a small device and host tier over a disk tier in
/// `dir`, two ranks; returns its JSON report.
fn demo_over(dir: &Scratch, extra: &[&str]) -> Value {
    demo_with(&format!("disk:{}", dir.0.display()), extra)
}

/// Like [`demo_over`] with any `--storage` specification.
fn demo_with(storage: &str, extra: &[&str]) -> Value {
    let output = Command::new(env!("CARGO_BIN_EXE_kvshm"))
        .args(["demo", "--synthetic", "--json", "--tp", "2", "--limit", "500"])
        .args(["--layers", "1", "--region-bytes", "2048"])
        .args(["--device-blocks", "128", "--host-blocks", "64"])
        .args(["--storage", storage, "--storage-blocks", "4096"])
        .args(extra)
        .stdin(Stdio::null())
        .output()
        .expect("run kvshm demo");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "demo failed: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|error| panic!("{error}: {stdout}"))
}

fn number(report: &Value, field: &str) -> u64 {
    report[field].as_u64().unwrap_or_else(|| panic!("no {field} in {report}"))
}

#[test]
fn blocks_make_the_three_tier_round_trip_with_their_bytes_intact_on_every_rank() {
    let dir = Scratch::new("round-trip");
    let report = demo_over(&dir, &[]);
    assert!(number(&report, "storage_hit_blocks") > 100, "{report}");
    assert!(number(&report, "storage_stores") > 100, "{report}");
    assert_eq!(number(&report, "storage_loads"), number(&report, "storage_hit_blocks"));
    assert_eq!(number(&report, "verified_blocks"), number(&report, "hit_blocks"), "{report}");
    assert_eq!(number(&report, "corrupted_blocks"), 0, "{report}");
    assert_eq!(number(&report, "failed_requests"), 0, "{report}");
    assert_eq!(number(&report, "adopted_storage_blocks"), 0, "a fresh directory holds nothing");
}

#[test]
fn a_restarted_service_finds_its_disk_blocks_and_hits_them_with_the_right_bytes() {
    let dir = Scratch::new("restart");
    let first = demo_over(&dir, &[]);
    let second = demo_over(&dir, &[]);
    let found = number(&second, "adopted_storage_blocks");
    assert!(found > 500, "{second}");
    // The second run hits on disk what the first run computed, prompts it never saw itself.
    let first_storage = number(&first, "storage_hit_blocks");
    let second_storage = number(&second, "storage_hit_blocks");
    assert!(second_storage > 0, "{second}");
    let first_device = number(&first, "device_hit_blocks");
    let second_hits = number(&second, "hit_blocks");
    assert!(second_hits >= first_device + first_storage / 2, "first {first}\nsecond {second}");
    assert_eq!(number(&second, "verified_blocks"), second_hits, "{second}");
    assert_eq!(number(&second, "corrupted_blocks"), 0, "{second}");
    assert_eq!(number(&second, "failed_requests"), 0, "{second}");
}

#[test]
fn damaged_disk_records_are_misses_for_their_blocks_and_every_request_is_still_served() {
    let dir = Scratch::new("damaged");
    let first = demo_over(&dir, &[]);
    assert!(number(&first, "storage_stores") > 100, "{first}");
    // Flip one byte in every other 4 KiB record of rank 0's slab (a block is 4 KiB per rank
    // here): those blocks fail their checksum there.
    let slab = dir.0.join("default").join("rank-0.slab");
    let mut bytes = std::fs::read(&slab).unwrap();
    for offset in (100..bytes.len()).step_by(2 * 4096) {
        bytes[offset] ^= 0x5a;
    }
    std::fs::write(&slab, &bytes).unwrap();
    let second = demo_over(&dir, &[]);
    assert!(number(&second, "adopted_storage_blocks") > 500, "{second}");
    // Served, not aborted: the requests whose hits missed computed those blocks.
    assert_eq!(number(&second, "failed_requests"), 0, "{second}");
    assert!(number(&second, "shortened_requests") > 0, "{second}");
    assert!(number(&second, "storage_missed_blocks") > 0, "{second}");
    assert!(number(&second, "storage_misses") > 0, "counted by the service: {second}");
    assert!(number(&second, "storage_hit_blocks") > 0, "the intact records still hit: {second}");
    assert_eq!(number(&second, "verified_blocks"), number(&second, "hit_blocks"), "{second}");
    assert_eq!(number(&second, "corrupted_blocks"), 0, "{second}");
}

#[test]
fn the_demo_refuses_a_storage_tier_without_a_host_tier() {
    let dir = Scratch::new("refused");
    let storage = format!("disk:{}", dir.0.display());
    let output = Command::new(env!("CARGO_BIN_EXE_kvshm"))
        .args(["demo", "--synthetic", "--host-blocks", "0", "--storage", &storage])
        .stdin(Stdio::null())
        .output()
        .expect("run kvshm demo");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--storage") && stderr.contains("--host-blocks"), "{stderr}");
    let output = Command::new(env!("CARGO_BIN_EXE_kvshm"))
        .args(["demo", "--synthetic", "--storage-blocks", "8"])
        .stdin(Stdio::null())
        .output()
        .expect("run kvshm demo");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--storage disk:DIR"), "{stderr}");
}

#[test]
fn blocks_make_the_round_trip_through_redis_with_their_bytes_intact() {
    let redis = crate::support::redis_for_test();
    let namespace = crate::support::unique_namespace("demo");
    let report = demo_with(&redis.url(), &["--storage-namespace", &namespace]);
    assert!(number(&report, "storage_hit_blocks") > 100, "{report}");
    assert_eq!(number(&report, "verified_blocks"), number(&report, "hit_blocks"), "{report}");
    assert_eq!(number(&report, "corrupted_blocks"), 0, "{report}");
    assert_eq!(number(&report, "failed_requests"), 0, "{report}");
    let mut connection = crate::support::connect(&redis.url());
    let keys: Vec<String> =
        redis::cmd("KEYS").arg(format!("kvshm:{namespace}:*")).query(&mut connection).unwrap();
    assert!(keys.len() >= 2 * 100, "both ranks stored their parts: {} keys", keys.len());
    let _: i64 = redis::cmd("DEL").arg(&keys).query(&mut connection).unwrap();
}

#[test]
fn a_second_service_on_the_same_redis_namespace_hits_the_first_ones_blocks() {
    let redis = crate::support::redis_for_test();
    let namespace = crate::support::unique_namespace("shared");
    let first = demo_with(&redis.url(), &["--storage-namespace", &namespace]);
    let second = demo_with(&redis.url(), &["--storage-namespace", &namespace]);
    assert_eq!(number(&first, "adopted_storage_blocks"), 0, "{first}");
    assert!(number(&second, "adopted_storage_blocks") > 500, "{second}");
    let second_hits = number(&second, "hit_blocks");
    assert!(
        second_hits
            >= number(&first, "device_hit_blocks") + number(&first, "storage_hit_blocks") / 2,
        "first {first}\nsecond {second}"
    );
    assert_eq!(number(&second, "verified_blocks"), second_hits, "{second}");
    assert_eq!(number(&second, "corrupted_blocks"), 0, "{second}");
    assert_eq!(number(&second, "failed_requests"), 0, "{second}");
    let mut connection = crate::support::connect(&redis.url());
    let keys: Vec<String> =
        redis::cmd("KEYS").arg(format!("kvshm:{namespace}:*")).query(&mut connection).unwrap();
    let _: i64 = redis::cmd("DEL").arg(&keys).query(&mut connection).unwrap();
}

/// The demo gives its workers the storage spec in their environment, not on their command line,
/// which every user of the machine can read (a Redis URL may carry a password).
#[test]
fn the_demo_gives_its_workers_the_storage_spec_out_of_their_command_lines() {
    use std::io::{BufRead, BufReader};
    let dir = Scratch::new("spec-env");
    let storage = format!("disk:{}", dir.0.display());
    let name = format!("spec-env-{}", std::process::id());
    /// Kills the demo (and so its workers, once it is gone) if the test fails while it holds.
    struct KillOnDrop(std::process::Child);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let demo = Command::new(env!("CARGO_BIN_EXE_kvshm"))
        .args(["demo", "--synthetic", "--limit", "20", "--tp", "2", "--hold", "600"])
        .args(["--device-blocks", "64", "--host-blocks", "64", "--name", &name])
        .args(["--storage", &storage, "--storage-blocks", "256"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvshm demo");
    let mut demo = KillOnDrop(demo);
    let mut stderr = BufReader::new(demo.0.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("holding segment") {
        line.clear();
        assert_ne!(stderr.read_line(&mut line).unwrap(), 0, "the demo ended before holding");
    }
    let mut workers = 0;
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        let parent = stat.rsplit(')').next().and_then(|rest| rest.split_whitespace().nth(1));
        if parent != Some(&demo.0.id().to_string()) {
            continue;
        }
        let command_line = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let environment = std::fs::read(entry.path().join("environ")).unwrap_or_default();
        let (command_line, environment) =
            (String::from_utf8_lossy(&command_line), String::from_utf8_lossy(&environment));
        assert!(command_line.contains("worker"), "{command_line}");
        assert!(!command_line.contains(&storage), "the spec is on {command_line}");
        assert!(environment.split('\0').any(|pair| pair == format!("KVSHM_STORAGE={storage}")));
        workers += 1;
    }
    assert_eq!(workers, 2);
    let pid = nix::unistd::Pid::from_raw(demo.0.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    assert!(demo.0.wait().unwrap().code().is_some(), "the demo died of the signal");
}
