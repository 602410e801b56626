//! Absurd numbers on the command line: every `kvshm` subcommand refuses them with an error that
//! names the option, and a non-zero exit, before doing any work. Never a panic, an abort, a wrap
//! or a process killed for memory.
//!
//! The real binary runs each case under an address-space limit, so that a defect that tries to
//! allocate terabytes fails at once instead of pushing a shared machine out of memory.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The address space a case may use: far more than any refusal needs.
const ADDRESS_SPACE_LIMIT: u64 = 8 << 30;
/// How long a case may take before the test calls it hung: far more than a refusal needs.
const TIME_LIMIT: Duration = Duration::from_secs(120);

/// Runs `kvshm ARGS`; returns its stderr after checking that it failed cleanly.
fn refused(args: &[&str]) -> String {
    let mut command = Command::new(env!("CARGO_BIN_EXE_kvshm"));
    command.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    // SAFETY: the closure runs in the forked child before exec and only calls setrlimit, which is
    // async-signal-safe; it touches no memory shared with the parent.
    unsafe {
        command.pre_exec(|| {
            let limit =
                libc::rlimit { rlim_cur: ADDRESS_SPACE_LIMIT, rlim_max: ADDRESS_SPACE_LIMIT };
            if libc::setrlimit(libc::RLIMIT_AS, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let mut child = command.spawn().expect("spawn kvshm");
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > TIME_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kvshm {args:?} still ran after {TIME_LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    let code = output.status.code();
    assert!(code.is_some(), "kvshm {args:?} was killed ({}): {stderr}", output.status);
    assert_ne!(code, Some(0), "kvshm {args:?} succeeded: {stderr}");
    assert!(!stderr.contains("panicked"), "kvshm {args:?} panicked: {stderr}");
    stderr
}

/// Asserts that `kvshm ARGS` is refused with a message containing every one of `words`.
fn refused_saying(args: &[&str], words: &[&str]) {
    let stderr = refused(args);
    for word in words {
        assert!(stderr.contains(word), "kvshm {args:?}: stderr lacks {word:?}: {stderr}");
    }
}

/// A trace file of one request with the given lengths.
fn trace_with(tag: &str, input_length: &str, output_length: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("kvshm-args-{tag}-{}.jsonl", std::process::id()));
    let mut file = std::fs::File::create(&path).unwrap();
    writeln!(
        file,
        r#"{{"timestamp": 0, "input_length": {input_length}, "output_length": {output_length}, "hash_ids": [1, 2]}}"#
    )
    .unwrap();
    path
}

#[test]
fn bench_ring_refuses_durations_and_counts_it_cannot_run() {
    for seconds in ["1e300", "nan", "-1", "0", "inf", "1e-300"] {
        let option = format!("--seconds-per-phase={seconds}");
        refused_saying(&["bench", "ring", &option], &["--seconds-per-phase"]);
    }
    refused_saying(&["bench", "ring", "--round-trips", "18446744073709551615"], &["--round-trips"]);
    refused_saying(&["bench", "ring", "--round-trips", "0"], &["--round-trips"]);
    refused_saying(&["bench", "ring", "--stream-records", "0"], &["--stream-records"]);
    refused_saying(&["bench", "ring", "--stream-batch", "0"], &["--stream-batch"]);
}

#[test]
fn bench_sched_refuses_sizes_it_cannot_run() {
    refused_saying(&["bench", "sched", "--cached-blocks", "0"], &["--cached-blocks"]);
    refused_saying(
        &["bench", "sched", "--cached-blocks", "18446744073709551615"],
        &["--cached-blocks"],
    );
    refused_saying(
        &["bench", "sched", "--request-blocks", "18446744073709551615"],
        &["--request-blocks"],
    );
    refused_saying(&["bench", "sched", "--request-blocks", "1"], &["--request-blocks"]);
    refused_saying(&["bench", "sched", "--samples", "18446744073709551615"], &["--samples"]);
    refused_saying(&["bench", "sched", "--samples", "0"], &["--samples"]);
    refused_saying(&["bench", "sched", "--block-tokens", "0"], &["--block-tokens"]);
    refused_saying(&["bench", "sched", "--eviction", "optimal"], &["--eviction optimal"]);
    refused_saying(&["bench", "hash", "--block-tokens", "0"], &["--block-tokens"]);
}

#[test]
fn bench_copy_refuses_sizes_that_overflow_or_do_not_fit() {
    let max = "18446744073709551615";
    refused_saying(&["bench", "copy", "--tier-mib", max], &["--tier-mib"]);
    refused_saying(&["bench", "copy", "--tier-mib", "0"], &["--tier-mib"]);
    refused_saying(&["bench", "copy", "--mib-per-case", max], &["--mib-per-case"]);
    refused_saying(&["bench", "copy", "--mib-per-case", "0"], &["--mib-per-case"]);
    refused_saying(&["bench", "copy", "--layers", "4294967295"], &["--layers"]);
    refused_saying(&["bench", "copy", "--layers", "0"], &["--layers"]);
    refused_saying(&["bench", "copy", "--pairs-per-command", max], &["--pairs-per-command"]);
    let cuda = ["bench", "copy", "--backend", "cuda"];
    refused_saying(&[&cuda[..], &["--command-mib", "0"]].concat(), &["--command-mib"]);
    refused_saying(&[&cuda[..], &["--command-mib", max]].concat(), &["--command-mib"]);
    refused_saying(
        &[&cuda[..], &["--tier-mib", "4", "--command-mib", "8"]].concat(),
        &["--command-mib"],
    );
    refused_saying(&[&cuda[..], &["--cuda-copy", "dma"]].concat(), &["--cuda-copy", "dma"]);
}

#[test]
fn demo_refuses_shapes_the_machine_cannot_hold_before_allocating_them() {
    let demo = ["demo", "--synthetic"];
    let with = |extra: &[&'static str]| [&demo[..], extra].concat();
    refused_saying(&with(&["--device-blocks", "4294967294"]), &["--device-blocks"]);
    refused_saying(&with(&["--device-blocks", "4294967295"]), &["--device-blocks"]);
    refused_saying(&with(&["--device-blocks", "0"]), &["--device-blocks"]);
    refused_saying(&with(&["--host-blocks", "4294967294"]), &["--host-blocks"]);
    refused_saying(&with(&["--region-bytes", "18446744073709551615"]), &["--region-bytes"]);
    refused_saying(&with(&["--region-bytes", "0"]), &["--region-bytes"]);
    refused_saying(&with(&["--layers", "4294967295"]), &["--layers"]);
    refused_saying(&with(&["--layers", "0"]), &["--layers"]);
    refused_saying(&with(&["--tp", "0"]), &["--tp"]);
    refused_saying(&with(&["--tp", "4294967295"]), &["--tp"]);
    refused_saying(&with(&["--block-tokens", "0"]), &["--block-tokens"]);
    refused_saying(&with(&["--free-watermark", "5000"]), &["--free-watermark"]);
    refused_saying(&with(&["--eviction", "optimal"]), &["--eviction optimal", "kvshm replay"]);
    refused_saying(&with(&["--storage-backoff-ms", "0"]), &["--storage-backoff-ms", "at least"]);
    refused_saying(
        &with(&["--storage-backoff-ms", "5000", "--storage-backoff-max-ms", "100"]),
        &["--storage-backoff-max-ms", "below"],
    );
    refused_saying(
        &with(&["--storage-backoff-max-ms", "18446744073709551615"]),
        &["--storage-backoff-max-ms", "more than a day"],
    );
}

#[test]
fn trace_lengths_near_two_to_the_64_are_refused_by_replay_and_the_demo() {
    let max = "18446744073709551615";
    for (tag, input, output) in [("input", max, "10"), ("output", "1000", max)] {
        let trace = trace_with(tag, input, output);
        let path = trace.to_str().unwrap();
        let field = if tag == "input" { "input_length" } else { "output_length" };
        refused_saying(&["replay", "--trace", path, "--device-blocks", "64"], &[field, "line 1"]);
        refused_saying(&["demo", "--trace", path, "--limit", "1"], &[field, "line 1"]);
        std::fs::remove_file(trace).unwrap();
    }
}

#[test]
fn replay_refuses_pools_the_machine_cannot_hold() {
    let trace = trace_with("pools", "1000", "10");
    let path = trace.to_str().unwrap();
    refused_saying(
        &["replay", "--trace", path, "--device-blocks", "4294967294"],
        &["--device-blocks"],
    );
    refused_saying(
        &["replay", "--trace", path, "--device-blocks", "64", "--host-blocks", "4294967294"],
        &["--host-blocks"],
    );
    refused_saying(&["replay", "--trace", path, "--device-blocks", "0"], &["--device-blocks"]);
    refused_saying(
        &["replay", "--trace", path, "--device-blocks", "64", "--block-tokens", "0"],
        &["--block-tokens"],
    );
    refused_saying(
        &["replay", "--trace", path, "--device-blocks", "64", "--storage-blocks", "4294967295"],
        &["--storage-blocks"],
    );
    refused_saying(
        &["replay", "--trace", path, "--device-blocks", "64", "--storage-blocks", "8"],
        &["--storage-blocks", "--host-blocks"],
    );
    std::fs::remove_file(trace).unwrap();
}

#[test]
fn replay_refuses_instance_options_it_cannot_model() {
    let trace = trace_with("instances", "1000", "10");
    let path = trace.to_str().unwrap();
    let base = ["replay", "--trace", path, "--device-blocks", "64", "--host-blocks", "64"];
    let with = |extra: &[&'static str]| [&base[..], extra].concat();
    refused_saying(&with(&["--shared-host-tier"]), &["--shared-host-tier", "--instances"]);
    refused_saying(&with(&["--route", "sticky"]), &["--route", "--instances"]);
    refused_saying(&with(&["--instances", "0"]), &["--instances"]);
    refused_saying(&with(&["--instances", "4294967295"]), &["--instances"]);
    refused_saying(&with(&["--instances", "128"]), &["--host-blocks", "128 tiers"]);
    refused_saying(&with(&["--instances", "2", "--host-quota", "8"]), &["--host-quota"]);
    refused_saying(
        &with(&["--instances", "2", "--write-policy", "write_through_selective:2"]),
        &["write_back or write_through"],
    );
    refused_saying(
        &with(&["--instances", "2", "--eviction", "optimal"]),
        &["--eviction optimal", "--instances"],
    );
    refused_saying(
        &[
            &base[..3],
            &["--device-blocks", "10000000", "--host-blocks", "64", "--instances", "4096"],
        ]
        .concat(),
        &["4096 instances"],
    );
    std::fs::remove_file(trace).unwrap();
}

#[test]
fn bench_tier_refuses_sizes_it_cannot_hold() {
    refused_saying(&["bench", "tier", "--gib", "0"], &["--gib"]);
    refused_saying(&["bench", "tier", "--gib", "1,4096"], &["--gib"]);
    refused_saying(&["bench", "tier", "--gib", "1000"], &["--gib"]);
}

#[test]
fn the_cuda_options_are_refused_clearly_in_every_build() {
    refused_saying(
        &["worker", "--name", "x", "--rank", "0", "--cuda-copy", "batch"],
        &["--cuda-copy"],
    );
    refused_saying(&["demo", "--cuda-copy", "fast"], &["--cuda-copy"]);
    // Without the cuda feature the GPU backends say how to get them; with it, on a machine
    // without a driver, they say what is missing. Either way nothing is left in /dev/shm.
    let expected = if cfg!(feature = "cuda") { "CUDA" } else { "cuda feature" };
    refused_saying(&["demo", "--backend", "cuda", "--synthetic", "--limit", "2"], &[expected]);
    refused_saying(
        &["bench", "copy", "--backend", "cuda", "--tier-mib", "16", "--command-mib", "4"],
        &[expected],
    );
}

#[test]
fn worker_refuses_timeouts_it_cannot_wait() {
    for option in ["--attach-timeout", "--handles-timeout"] {
        for seconds in ["1e300", "nan", "-1"] {
            let given = format!("{option}={seconds}");
            refused_saying(&["worker", "--name", "nobody-here", "--rank", "0", &given], &[option]);
        }
    }
    refused_saying(&["worker", "--name", "bad/name", "--rank", "0"], &["segment name"]);
}

#[test]
fn worker_refuses_storage_options_that_do_not_apply_to_its_tier() {
    let worker = ["worker", "--name", "nobody-here", "--rank", "0"];
    let disk = [&worker[..], &["--storage", "disk:/nonexistent-kvshm-test"]].concat();
    let redis = [&worker[..], &["--storage", "redis://127.0.0.1:1"]].concat();
    for option in
        [&["--storage-ttl", "5"][..], &["--storage-connections", "2"], &["--storage-timeout", "1"]]
    {
        refused_saying(&[&disk[..], option].concat(), &[option[0], "Redis tier only"]);
        refused_saying(&[&worker[..], option].concat(), &[option[0], "no --storage"]);
    }
    for option in [&["--storage-blocks", "8"][..], &["--storage-buffered"]] {
        refused_saying(&[&redis[..], option].concat(), &[option[0], "disk tier only"]);
        refused_saying(&[&worker[..], option].concat(), &[option[0], "no --storage"]);
    }
}

/// `kvshm ARGS` with `KVSHM_STORAGE` set to `storage`: its exit code and standard error.
fn run_with_storage_env(args: &[&str], storage: &str) -> (Option<i32>, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_kvshm"))
        .args(args)
        .env("KVSHM_STORAGE", storage)
        .stdin(Stdio::null())
        .output()
        .expect("run kvshm");
    (output.status.code(), String::from_utf8_lossy(&output.stderr).into_owned())
}

/// A storage spec in `KVSHM_STORAGE` is read with `--storage-from-env` only: one exported in a
/// shell gives no worker a tier; an empty one is refused naming the variable; and the owner of a
/// shared tier refuses a spec of another scheme without printing it (a password in it).
#[test]
fn the_storage_spec_comes_from_the_environment_when_asked_and_stays_out_of_errors() {
    let worker = ["worker", "--name", "nobody-here", "--rank", "0", "--storage-ttl", "5"];
    let (code, stderr) = run_with_storage_env(&worker, "redis://127.0.0.1:1");
    assert!(code != Some(0) && stderr.contains("no --storage"), "{stderr}");
    let from_env = [&worker[..], &["--storage-from-env"]].concat();
    let (code, stderr) = run_with_storage_env(&from_env, "");
    assert!(code != Some(0) && stderr.contains("KVSHM_STORAGE"), "{stderr}");
    let owner = [
        "tier-owner",
        "--name",
        "nobody-here",
        "--model",
        "m",
        "--block-bytes",
        "64",
        "--chunks",
        "4",
    ];
    for (spec, args) in [
        ("rediss://app:s3cret@cache:6380", &["--storage-from-env"][..]),
        ("", &["--storage", "rediss://app:s3cret@cache:6380"][..]),
    ] {
        let (code, stderr) = run_with_storage_env(&[&owner[..], args].concat(), spec);
        assert!(code != Some(0) && stderr.contains("rediss://app:***@cache"), "{stderr}");
        assert!(!stderr.contains("s3cret"), "{stderr}");
    }
}

#[test]
fn worker_refuses_a_rank_the_segment_does_not_have() {
    use kvshm_ipc::segment::Segment;
    let name =
        kvshm_ipc::name::SegmentName::new(&format!("args-rank-{}", std::process::id())).unwrap();
    let segment = Segment::create(&name, &Default::default()).unwrap();
    for rank in ["1", "4294967295"] {
        refused_saying(
            &["worker", "--name", name.as_str(), "--rank", rank, "--attach-timeout", "1"],
            &[&format!("rank {rank}")],
        );
    }
    drop(segment);
}

#[test]
fn tier_owner_and_worker_refuse_shared_tier_options_that_do_not_fit() {
    let tier = ["tier-owner", "--name", "nobody-tier", "--model", "m", "--block-bytes", "64"];
    refused_saying(&[&tier[..], &["--chunks", "4", "--ranks", "0"]].concat(), &["--ranks"]);
    refused_saying(
        &[&tier[..], &["--chunks", "4", "--ranks", "4000000000"]].concat(),
        &["--ranks"],
    );
    refused_saying(&[&tier[..], &["--chunks", "4", "--adopt-arenas"]].concat(), &["--chunks"]);
    refused_saying(&tier, &["--chunks"]);
    let worker = ["worker", "--name", "nobody-here", "--rank", "0"];
    refused_saying(&[&worker[..], &["--shared-tier", "t"]].concat(), &["--shared-tier-rank"]);
    refused_saying(&[&worker[..], &["--shared-tier-rank", "1"]].concat(), &["--shared-tier"]);
}
