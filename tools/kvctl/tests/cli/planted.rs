//! Objects someone else planted under our prefix: FIFOs, links, directories, other users' files,
//! sparse files of hundreds of terabytes. `ls` and `cleanup` never hang on them, never follow them, never
//! remove another user's objects, and say what each one is.
//!
//! Another user's object is made with a real chown to an unused uid, which needs root; these tests
//! run as root in CI (`scripts/test`) and say so when they cannot.

use std::time::Duration;

use kvshm_ipc::config::SegmentConfig;
use kvshm_ipc::layout::HeaderFields;
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::segment::Segment;
use kvshm_ipc::shm::SharedMemory;

use crate::support::*;

/// A uid no process of the test machine runs as.
const STRANGER: u32 = 54_321;

/// How long kvctl may take before the test calls it hung: far more than it ever needs.
const HANG_LIMIT: Duration = Duration::from_secs(60);

fn running_as_root() -> bool {
    let root =
        std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m)).ok()
            == Some(0);
    if !root {
        eprintln!("not root: cannot give an object to another uid; this test needs root");
    }
    root
}

fn give_away(object: &str) {
    std::os::unix::fs::lchown(path(object), Some(STRANGER), Some(STRANGER)).unwrap();
}

fn make_fifo(object: &str) {
    let status = std::process::Command::new("mkfifo").arg(path(object)).status().unwrap();
    assert!(status.success());
}

/// kvctl that must finish within [`HANG_LIMIT`].
fn kvctl_unhung(args: &[&str]) -> Run {
    kvctl_within(args, HANG_LIMIT).unwrap_or_else(|| panic!("kvctl {args:?} hung"))
}

fn ls_row(name: &str) -> serde_json::Value {
    let listing = kvctl_unhung(&["ls", name, "--json"]).assert_ok().json();
    let rows = listing["segments"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{listing}");
    rows[0].clone()
}

/// A control object of segment `stale` whose creator is dead (a real segment's, the creator
/// word rewritten).
fn plant_stale_control_object(stale: &SegmentName) {
    let live_name = unique_name("planted-original");
    let _cleanup = Cleanup(live_name.clone());
    let live = Segment::create(&live_name, &SegmentConfig::default()).unwrap();
    let mut bytes = std::fs::read(path(&live.name().control_object())).unwrap();
    let at = std::mem::offset_of!(HeaderFields, creator);
    bytes[at..at + 16].copy_from_slice(bytemuck::bytes_of(
        &kvshm_ipc::liveness::ProcessIdentity::new(u32::MAX - 1, 1),
    ));
    write_object(&stale.control_object(), &bytes);
}

fn removed(report: &serde_json::Value) -> Vec<String> {
    report["removed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|removed| removed["object"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn a_fifo_under_our_prefix_never_hangs_ls_or_cleanup() {
    let orphan = unique_name("fifo-orphan");
    let control = unique_name("fifo-control");
    let _cleanups = [Cleanup(orphan.clone()), Cleanup(control.clone())];
    make_fifo(&orphan.host_tier_object(0));
    make_fifo(&control.control_object());
    age_object_by_path(&orphan.host_tier_object(0));
    age_object_by_path(&control.control_object());

    let row = ls_row(orphan.as_str());
    let data = &row["data_objects"][0];
    assert!(data["reason"].as_str().unwrap().contains("fifo"), "{row}");
    let row = ls_row(control.as_str());
    assert!(row["reason"].as_str().unwrap().contains("fifo"), "{row}");
    kvctl_unhung(&["ls"]).assert_ok();

    if running_as_root() {
        give_away(&orphan.host_tier_object(0));
        give_away(&control.control_object());
        for name in [&orphan, &control] {
            let row = ls_row(name.as_str());
            assert_eq!(row["removable"], false, "{row}");
        }
        let report = kvctl_unhung(&["cleanup", "--json"]).assert_ok().json();
        let removed = removed(&report);
        assert!(!removed.iter().any(|object| object.contains(orphan.as_str())), "{report}");
        assert!(!removed.iter().any(|object| object.contains(control.as_str())), "{report}");
        assert!(exists(&orphan.host_tier_object(0)) && exists(&control.control_object()));
        std::fs::remove_file(path(&orphan.host_tier_object(0))).unwrap();
        std::fs::remove_file(path(&control.control_object())).unwrap();
        make_fifo(&orphan.host_tier_object(0));
        make_fifo(&control.control_object());
        age_object_by_path(&orphan.host_tier_object(0));
        age_object_by_path(&control.control_object());
    }

    // Our own FIFOs are garbage under our prefix: cleanup removes them (the names, never a peer).
    let report =
        kvctl_unhung(&["cleanup", orphan.as_str(), control.as_str(), "--json"]).assert_ok().json();
    let mut removed = removed(&report);
    removed.sort();
    let mut expected = vec![orphan.host_tier_object(0), control.control_object()];
    expected.sort();
    assert_eq!(removed, expected, "{report}");
}

#[test]
fn cleanup_never_removes_another_users_orphaned_data_objects() {
    if !running_as_root() {
        return;
    }
    let name = unique_name("foreign-orphan");
    let _cleanup = Cleanup(name.clone());
    let object = name.host_tier_object(0);
    write_object(&object, &garbage(8192, 9));
    age_object(&object);
    give_away(&object);

    let row = ls_row(name.as_str());
    let data = &row["data_objects"][0];
    assert_eq!(
        (row["removable"].as_bool(), data["removable"].as_bool()),
        (Some(false), Some(false))
    );
    assert!(data["reason"].as_str().unwrap().contains(&format!("uid {STRANGER}")), "{row}");
    let report = kvctl_unhung(&["cleanup", name.as_str(), "--json"]).assert_ok().json();
    assert!(removed(&report).is_empty(), "{report}");
    assert!(exists(&object));
}

#[test]
fn cleanup_of_a_stale_segment_keeps_a_data_object_another_user_planted() {
    if !running_as_root() {
        return;
    }
    let stale = unique_name("planted-stale");
    let _cleanup = Cleanup(stale.clone());
    plant_stale_control_object(&stale);
    write_object(&stale.host_tier_object(0), b"ours");
    write_object(&stale.device_arena_object(0), b"theirs");
    give_away(&stale.device_arena_object(0));

    let row = ls_row(stale.as_str());
    assert_eq!(row["state"], "stale");
    let report = kvctl_unhung(&["cleanup", stale.as_str(), "--json"]).assert_ok().json();
    let mut removed = removed(&report);
    removed.sort();
    let mut expected = vec![stale.control_object(), stale.host_tier_object(0)];
    expected.sort();
    assert_eq!(removed, expected, "{report}");
    assert_eq!(std::fs::read(path(&stale.device_arena_object(0))).unwrap(), b"theirs");
    let text = kvctl_unhung(&["cleanup", stale.as_str()]).assert_ok().stdout.clone();
    assert!(text.contains(&format!("uid {STRANGER}")), "{text}");
}

#[test]
fn a_symbolic_link_under_our_prefix_is_never_followed() {
    let name = unique_name("link");
    let _cleanup = Cleanup(name.clone());
    let target = std::env::temp_dir().join(format!("kvctl-link-target-{}", std::process::id()));
    std::fs::write(&target, garbage(4096, 1)).unwrap();
    std::os::unix::fs::symlink(&target, path(&name.host_tier_object(0))).unwrap();
    if running_as_root() {
        give_away(&name.host_tier_object(0));
    }
    let row = ls_row(name.as_str());
    assert!(row["data_objects"][0]["reason"].as_str().unwrap().contains("symbolic link"), "{row}");
    kvctl_unhung(&["cleanup", name.as_str()]).assert_ok();
    assert!(target.exists(), "the link's target was touched");
    std::fs::remove_file(target).unwrap();
}

#[test]
fn an_empty_directory_of_ours_is_removed_and_one_with_files_is_kept_as_ls_says() {
    let empty = unique_name("dir-empty");
    let full = unique_name("dir-full");
    // As control objects, and as an orphaned data object.
    let objects = [empty.control_object(), full.control_object(), full.host_tier_object(1)];
    for object in &objects {
        std::fs::create_dir(path(object)).unwrap();
    }
    let inside = [1, 2].map(|at| format!("{}/keep", path(&objects[at])));
    for file in &inside {
        std::fs::write(file, b"someone's file").unwrap();
    }
    for object in &objects {
        age_object_by_path(object);
    }
    let remove_dirs = || {
        for file in &inside {
            let _ = std::fs::remove_file(file);
        }
        for object in &objects {
            let _ = std::fs::remove_dir(path(object));
        }
    };

    // What ls calls removable, cleanup removes: the empty directory.
    let row = ls_row(empty.as_str());
    assert_eq!(row["removable"], true, "{row}");
    let report = kvctl_unhung(&["cleanup", empty.as_str(), "--json"]);
    let listed_removed = report.success.then(|| removed(&report.json()));
    let removed_empty = !exists(&empty.control_object());
    // A directory with a file in it is not called removable, and cleanup leaves it and its file.
    let row = ls_row(full.as_str());
    let full_removable = row["removable"].clone();
    let data_removable = row["data_objects"][0]["removable"].clone();
    let refused = kvctl_unhung(&["cleanup", full.as_str()]);
    let kept = inside.iter().all(|file| std::path::Path::new(file).exists());
    remove_dirs();
    assert!(report.success, "cleanup of an empty directory failed: {}", report.stderr);
    assert!(removed_empty, "the empty directory is still there");
    assert_eq!(listed_removed, Some(vec![empty.control_object()]));
    assert_eq!(full_removable, false, "{row}");
    assert_eq!(data_removable, false, "{row}");
    assert!(row["reason"].as_str().unwrap().contains("directory with files"), "{row}");
    assert!(kept, "cleanup removed a directory with a file in it");
    assert!(refused.success || refused.stderr.contains("not empty"), "{}", refused.stderr);
}

#[test]
fn a_huge_sparse_garbage_object_is_judged_and_cleaned_up() {
    let name = unique_name("sparse");
    let _cleanup = Cleanup(name.clone());
    let object = name.control_object();
    std::fs::File::create(path(&object)).unwrap().set_len(200 << 40).unwrap();
    age_object(&object);
    let row = ls_row(name.as_str());
    assert_eq!(row["removable"], true, "{row}");
    assert!(row["reason"].as_str().unwrap().contains("magic"), "{row}");
    let report = kvctl_unhung(&["cleanup", name.as_str(), "--json"]).assert_ok().json();
    assert_eq!(removed(&report), vec![object.clone()]);
    assert!(!exists(&object));
}

/// A stale segment's data object that a running process maps (here this test: kvctl runs in
/// a process of its own) is in use: `ls` says so, and `cleanup` removes the control object and
/// keeps the mapped object until no process maps it.
#[test]
fn cleanup_keeps_a_data_object_a_running_process_maps() {
    let stale = unique_name("mapped-stale");
    let _cleanup = Cleanup(stale.clone());
    plant_stale_control_object(&stale);
    let mapped = stale.host_tier_object(0);
    write_object(&mapped, &[0; 4096]);
    write_object(&stale.host_tier_object(1), &[0; 4096]);
    let mapping = SharedMemory::open(&mapped).unwrap();

    let row = ls_row(stale.as_str());
    let data = row["data_objects"].as_array().unwrap();
    let reason = format!("in use: process {} maps it", std::process::id());
    assert_eq!((&data[0]["removable"], &data[0]["reason"]), (&false.into(), &reason.into()));
    assert_eq!(data[1]["removable"], true, "{row}");
    let report = kvctl_unhung(&["cleanup", stale.as_str(), "--json"]).assert_ok().json();
    let mut first = removed(&report);
    first.sort();
    assert_eq!(first, [stale.control_object(), stale.host_tier_object(1)], "{report}");
    assert!(exists(&mapped));

    drop(mapping);
    age_object(&mapped); // an orphan without an arena header goes once unchanged a while
    let report = kvctl_unhung(&["cleanup", stale.as_str(), "--json"]).assert_ok().json();
    assert_eq!(removed(&report), [mapped], "{report}");
}
