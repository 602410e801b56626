//! `kvctl reset-storage`: a disk namespace goes whole, never while a worker holds it; bad
//! specifications and namespaces are refused.

use std::fs::File;
use std::path::PathBuf;

use kvshm::storage::direct_io::{lock_exclusive, unlock};

use crate::support::*;

/// A disk tier directory with namespace `ns` holding two ranks' files.
fn planted_tier(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvctl-storage-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("ns")).unwrap();
    for name in ["rank-0.index", "rank-0.slab", "rank-1.index", "rank-1.slab"] {
        std::fs::write(dir.join("ns").join(name), [7u8; 4096]).unwrap();
    }
    dir
}

#[test]
fn reset_storage_drops_a_disk_namespace_unless_a_worker_holds_it() {
    let dir = planted_tier("disk");
    let spec = format!("disk:{}", dir.display());
    // A worker serving rank 0 holds its index's lock.
    let worker = File::open(dir.join("ns/rank-0.index")).unwrap();
    assert!(lock_exclusive(&worker).unwrap());
    kvctl(&["reset-storage", &spec, "--namespace", "ns"])
        .assert_fails_saying(&["rank-0.index", "stop the service"]);
    assert!(dir.join("ns/rank-1.slab").exists(), "a refused drop removes nothing");
    // Unlocked, not only closed: a child process another test starts meanwhile may hold a
    // duplicate of the descriptor for a moment, and with it the lock.
    unlock(&worker).unwrap();
    drop(worker);
    let report = kvctl(&["reset-storage", &spec, "--namespace", "ns", "--json"]).assert_ok().json();
    assert_eq!((report["files"].as_u64(), report["bytes"].as_u64()), (Some(4), Some(4 * 4096)));
    assert!(!dir.join("ns").exists());
    std::fs::remove_dir_all(dir).unwrap();
}

/// The spec may come from `KVSHM_STORAGE`, as the workers' does, so that a Redis password stays
/// off the command line; the flag without the variable is refused, and so is the flag with a
/// spec.
#[test]
fn reset_storage_takes_the_spec_from_the_environment_when_told_to() {
    let dir = planted_tier("env");
    let spec = format!("disk:{}", dir.display());
    let args = ["reset-storage", "--storage-from-env", "--namespace", "ns", "--json"];
    kvctl_with_env(&args, &[("KVSHM_STORAGE", "")]).assert_fails_saying(&["KVSHM_STORAGE"]);
    assert!(dir.join("ns/rank-0.slab").exists());
    let report = kvctl_with_env(&args, &[("KVSHM_STORAGE", &spec)]).assert_ok().json();
    assert_eq!(report["files"].as_u64(), Some(4));
    assert!(!dir.join("ns").exists());
    kvctl(&["reset-storage", &spec, "--storage-from-env"]).assert_fails_saying(&["cannot be used"]);
    kvctl(&["reset-storage"]).assert_fails_saying(&["required"]);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn reset_storage_refuses_what_is_not_a_storage_tier_or_a_namespace() {
    kvctl(&["reset-storage", "ftp://x"]).assert_fails_saying(&["disk:DIR"]);
    kvctl(&["reset-storage", "disk:/tmp", "--namespace", "../etc"])
        .assert_fails_saying(&["namespace"]);
}

/// A mistyped directory is refused, not reported dropped; a namespace nothing was stored under
/// says so.
#[test]
fn reset_storage_says_when_there_is_nothing_to_drop() {
    let missing = std::env::temp_dir().join(format!("kvctl-no-such-dir-{}", std::process::id()));
    let spec = format!("disk:{}", missing.display());
    kvctl(&["reset-storage", &spec, "--namespace", "ns"])
        .assert_fails_saying(&["no such storage directory"]);
    let dir = planted_tier("empty-ns");
    let spec = format!("disk:{}", dir.display());
    let run = kvctl(&["reset-storage", &spec, "--namespace", "other"]).assert_ok().stdout.clone();
    assert!(run.contains("nothing was stored under namespace other"), "{run}");
    assert!(dir.join("ns/rank-0.slab").exists(), "another namespace is left alone");
    std::fs::remove_dir_all(dir).unwrap();
}
