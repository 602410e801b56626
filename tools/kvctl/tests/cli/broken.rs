//! Objects under our prefix that are not (or no longer) usable segments.

use std::mem::offset_of;
use std::os::unix::fs::MetadataExt;

use kvshm_ipc::config::SegmentConfig;
use kvshm_ipc::layout::HeaderFields;
use kvshm_ipc::liveness::ProcessIdentity;
use kvshm_ipc::segment::Segment;

use crate::support::*;

fn ls_row(name: &str) -> serde_json::Value {
    let listing = kvctl(&["ls", name, "--json"]).assert_ok().json();
    let rows = listing["segments"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{listing}");
    rows[0].clone()
}

fn removed_objects(report: &serde_json::Value) -> Vec<String> {
    report["removed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|removed| removed["object"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn garbage_under_our_prefix_is_listed_unreadable_refused_by_stat_and_cleaned_up() {
    let name = unique_name("garbage");
    let _cleanup = Cleanup(name.clone());
    let object = name.control_object();
    write_object(&object, &garbage(4096, 7));

    let row = ls_row(name.as_str());
    assert_eq!(row["state"], "unreadable");
    assert!(row["reason"].as_str().unwrap().contains("magic"), "{row}");
    assert_eq!(row["removable"], true);
    let text = kvctl(&["ls", name.as_str()]).assert_ok().stdout.clone();
    assert!(text.contains("unreadable") && text.contains("kvctl cleanup"), "{text}");

    for command in ["stat", "workers", "tree"] {
        kvctl(&[command, name.as_str()]).assert_fails_saying(&["not a usable kvshm segment"]);
    }

    let report = kvctl(&["cleanup", name.as_str(), "--json"]).assert_ok().json();
    assert_eq!(removed_objects(&report), vec![object.clone()]);
    assert!(!exists(&object));
}

#[test]
fn a_fresh_creatorless_object_is_left_alone_until_the_creation_grace_has_passed() {
    let name = unique_name("fresh");
    let _cleanup = Cleanup(name.clone());
    let object = name.control_object();
    // Shorter than the creator word: nothing says who made it, so only its age can tell.
    write_object(&object, &garbage(40, 11));

    let row = ls_row(name.as_str());
    assert_eq!(
        (row["state"].as_str(), row["removable"].as_bool()),
        (Some("unreadable"), Some(false))
    );
    let report = kvctl(&["cleanup", name.as_str(), "--json"]).assert_ok().json();
    assert!(removed_objects(&report).is_empty(), "{report}");
    assert!(exists(&object));

    age_object(&object);
    assert_eq!(ls_row(name.as_str())["removable"], true);
    let report = kvctl(&["cleanup", name.as_str(), "--json"]).assert_ok().json();
    assert_eq!(removed_objects(&report), vec![object.clone()]);
}

#[test]
fn a_truncated_segment_of_a_live_creator_is_named_truncated_and_kept() {
    let name = unique_name("truncated");
    let _cleanup = Cleanup(name.clone());
    let segment = Segment::create(&name, &SegmentConfig::default()).unwrap();
    // Nothing in this test touches the mapping again; the drop only reads the first page.
    std::fs::File::options()
        .write(true)
        .open(path(&name.control_object()))
        .unwrap()
        .set_len(4096)
        .unwrap();

    kvctl(&["stat", name.as_str()]).assert_fails_saying(&["truncated", "4096"]);
    let row = ls_row(name.as_str());
    assert_eq!(row["state"], "unreadable");
    assert!(row["reason"].as_str().unwrap().contains("is 4096 bytes"), "{row}");
    assert_eq!(row["removable"], false);
    let report = kvctl(&["cleanup", name.as_str(), "--json"]).assert_ok().json();
    assert!(removed_objects(&report).is_empty(), "{report}");
    assert!(exists(&name.control_object()));
    drop(segment);
}

#[test]
fn a_missing_segment_is_named_missing() {
    let name = unique_name("missing");
    for command in ["stat", "workers", "tree", "reset"] {
        kvctl(&[command, name.as_str()]).assert_fails_saying(&["no segment named", name.as_str()]);
    }
    kvctl(&["stat", "bad/name"]).assert_fails_saying(&["not a segment name"]);
}

/// A copy of a live segment's objects under `stale`, with a creator no process can be.
fn make_stale_copy(live: &Segment, stale: &kvshm_ipc::name::SegmentName) {
    let mut bytes = std::fs::read(path(&live.name().control_object())).unwrap();
    let at = offset_of!(HeaderFields, creator);
    let nobody = ProcessIdentity::new(u32::MAX - 1, 1);
    bytes[at..at + size_of::<ProcessIdentity>()].copy_from_slice(bytemuck::bytes_of(&nobody));
    write_object(&stale.control_object(), &bytes);
    let host = std::fs::read(path(&live.name().host_tier_object(0))).unwrap();
    write_object(&stale.host_tier_object(0), &host);
}

#[test]
fn a_stale_segment_is_reported_with_a_cleanup_hint_and_removed_with_its_data() {
    let live_name = unique_name("original");
    let stale_name = unique_name("stale");
    let (_live_cleanup, _stale_cleanup) = (Cleanup(live_name.clone()), Cleanup(stale_name.clone()));
    let live = Segment::create(&live_name, &SegmentConfig::default()).unwrap();
    make_stale_copy(&live, &stale_name);

    let row = ls_row(stale_name.as_str());
    assert_eq!(row["state"], "stale");
    assert_eq!(row["removable"], true);
    assert_eq!(row["creator_pid"], u32::MAX - 1);
    assert_eq!(row["block_tokens"], 16);
    kvctl(&["stat", stale_name.as_str()]).assert_fails_saying(&[
        "stale",
        "is dead",
        &format!("kvctl cleanup {stale_name}"),
    ]);

    let report = kvctl(&["cleanup", stale_name.as_str(), "--json"]).assert_ok().json();
    let mut removed = removed_objects(&report);
    removed.sort();
    let mut expected = vec![stale_name.control_object(), stale_name.host_tier_object(0)];
    expected.sort();
    assert_eq!(removed, expected);
    assert_eq!(ls_row(live_name.as_str())["state"], "live");
}

#[test]
fn orphaned_data_objects_are_removed_only_when_their_creator_is_dead() {
    let live_name = unique_name("arena-owner");
    let orphan_name = unique_name("orphan");
    let (_live_cleanup, _orphan_cleanup) =
        (Cleanup(live_name.clone()), Cleanup(orphan_name.clone()));
    let live = Segment::create(&live_name, &SegmentConfig::default()).unwrap();
    // A copy of a live arena names a live creator (ours): it could be a segment being created.
    let arena = std::fs::read(path(&live.name().host_tier_object(0))).unwrap();
    write_object(&orphan_name.host_tier_object(0), &arena);

    let row = ls_row(orphan_name.as_str());
    assert_eq!(
        (row["state"].as_str(), row["removable"].as_bool()),
        (Some("orphaned"), Some(false))
    );
    let report = kvctl(&["cleanup", orphan_name.as_str(), "--json"]).assert_ok().json();
    assert!(removed_objects(&report).is_empty(), "{report}");

    // Garbage arenas go once they are past the creation grace.
    write_object(&orphan_name.host_tier_object(0), &garbage(8192, 3));
    age_object(&orphan_name.host_tier_object(0));
    let dry_run =
        kvctl(&["cleanup", orphan_name.as_str(), "--dry-run", "--json"]).assert_ok().json();
    assert_eq!(removed_objects(&dry_run), vec![orphan_name.host_tier_object(0)]);
    assert!(exists(&orphan_name.host_tier_object(0)));
    let report = kvctl(&["cleanup", orphan_name.as_str(), "--json"]).assert_ok().json();
    assert_eq!(removed_objects(&report), vec![orphan_name.host_tier_object(0)]);
    assert!(!exists(&orphan_name.host_tier_object(0)));
}

#[test]
fn a_segment_of_another_user_is_refused_and_never_removed() {
    let name = unique_name("foreign");
    let _cleanup = Cleanup(name.clone());
    let object = name.control_object();
    write_object(&object, &garbage(4096, 5));
    if std::fs::metadata(path(&object)).unwrap().uid() != 0 {
        // Only root can give a file away; as anyone else there is no foreign object to test with.
        eprintln!("not root: cannot create an object owned by another uid");
        return;
    }
    std::os::unix::fs::chown(path(&object), Some(65534), Some(65534)).unwrap();
    kvctl(&["stat", name.as_str()]).assert_fails_saying(&["belongs to uid 65534"]);
    let row = ls_row(name.as_str());
    assert_eq!(
        (row["state"].as_str(), row["removable"].as_bool()),
        (Some("unreadable"), Some(false))
    );
    age_object(&object);
    let report = kvctl(&["cleanup", name.as_str(), "--json"]).assert_ok().json();
    assert!(removed_objects(&report).is_empty(), "{report}");
    assert!(exists(&object));
}
