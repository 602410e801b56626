//! Objects under our prefix that someone else planted, or that are not shared memory at all: the
//! library never blocks on them, never follows a link, never maps more than a segment can be,
//! never removes what another user owns, and names the object and its owner when one is in the
//! way. What a creator made is removed on drop whatever was scribbled into it since.
//!
//! "Another user" is made with a real chown to an unused uid, which only root can do; these tests
//! run as root in CI (`scripts/test`), and say so when they cannot.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, SystemTime};

use common::{dead_identity, forge, shm_path, unique_name, Cleanup};
use kvshm_ipc::config::SegmentConfig;
use kvshm_ipc::layout::HeaderFields;
use kvshm_ipc::listing::{self, ListingState};
use kvshm_ipc::liveness::ProcessIdentity;
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::segment::{AttachError, Segment};
use kvshm_ipc::shm::{SharedMemory, ShmError};

/// A uid no process of the test machine runs as.
const STRANGER: u32 = 54_321;

fn running_as_root() -> bool {
    let root = nix::unistd::geteuid().is_root();
    if !root {
        eprintln!("not root: cannot give an object to another uid; this test needs root");
    }
    root
}

/// Gives `object` (not following a link) to [`STRANGER`].
fn give_away(object: &str) {
    std::os::unix::fs::lchown(shm_path(object), Some(STRANGER), Some(STRANGER)).unwrap();
}

fn make_fifo(object: &str) {
    nix::unistd::mkfifo(shm_path(object).as_str(), nix::sys::stat::Mode::from_bits_truncate(0o600))
        .unwrap();
}

fn age(object: &str) {
    let file = std::fs::File::options().write(true).open(shm_path(object)).unwrap();
    file.set_modified(SystemTime::now() - Duration::from_secs(60)).unwrap();
}

fn exists(object: &str) -> bool {
    std::fs::symlink_metadata(shm_path(object)).is_ok()
}

fn listed(name: &SegmentName) -> listing::SegmentListing {
    listing::list().into_iter().find(|listing| &listing.name == name).expect("listed")
}

#[test]
fn attaching_a_fifo_is_refused_as_not_a_regular_file() {
    let name = unique_name("fifo-attach");
    let _cleanup = Cleanup(name.clone());
    make_fifo(&name.control_object());
    match Segment::attach(&name) {
        Err(AttachError::Shm(ShmError::NotRegularFile { object, kind, .. })) => {
            assert_eq!((object.as_str(), kind), (name.control_object().as_str(), "fifo"));
        }
        other => panic!("expected NotRegularFile, got {other:?}"),
    }
    assert!(
        matches!(listed(&name).state, ListingState::Unreadable(reason) if reason.contains("fifo"))
    );
}

#[test]
fn a_symbolic_link_under_our_prefix_is_never_followed() {
    let name = unique_name("link");
    let target = unique_name("link-target");
    let _cleanups = [Cleanup(name.clone()), Cleanup(target.clone())];
    let _segment = Segment::create(&target, &SegmentConfig::default()).unwrap();
    std::os::unix::fs::symlink(
        shm_path(&target.control_object()),
        shm_path(&name.control_object()),
    )
    .unwrap();
    let error = SharedMemory::open(&name.control_object()).unwrap_err();
    assert!(matches!(&error, ShmError::NotRegularFile { kind: "symbolic link", .. }), "{error:?}");
    assert!(Segment::attach(&name).is_err());
    assert!(matches!(listed(&name).state, ListingState::Unreadable(_)));
}

#[test]
fn creating_over_another_users_control_object_names_it_and_its_owner() {
    if !running_as_root() {
        return;
    }
    let name = unique_name("foreign-control");
    let _cleanup = Cleanup(name.clone());
    std::fs::write(shm_path(&name.control_object()), b"planted").unwrap();
    give_away(&name.control_object());
    age(&name.control_object());
    let error = Segment::create(&name, &SegmentConfig::default()).unwrap_err().to_string();
    assert!(error.contains(&name.control_object()), "{error}");
    assert!(error.contains(&format!("uid {STRANGER}")), "{error}");
    assert!(exists(&name.control_object()), "another user's object was removed");
}

#[test]
fn creating_over_another_users_data_object_names_it_leaves_it_and_leaves_nothing_of_ours() {
    if !running_as_root() {
        return;
    }
    let name = unique_name("foreign-data");
    let _cleanup = Cleanup(name.clone());
    let planted = name.host_tier_object(0);
    std::fs::write(shm_path(&planted), b"planted").unwrap();
    give_away(&planted);
    let error = Segment::create(&name, &SegmentConfig::default()).unwrap_err().to_string();
    assert!(error.contains(&planted) && error.contains(&format!("uid {STRANGER}")), "{error}");
    assert_eq!(std::fs::read(shm_path(&planted)).unwrap(), b"planted");
    assert!(!exists(&name.control_object()), "our half-made control object was left behind");
}

#[test]
fn unlinking_a_segment_never_removes_another_users_objects() {
    if !running_as_root() {
        return;
    }
    let name = unique_name("foreign-unlink");
    let _cleanup = Cleanup(name.clone());
    let dead = dead_identity();
    forge(&name, |fields| fields.creator = dead);
    let planted = name.host_tier_object(0);
    std::fs::write(shm_path(&planted), b"planted").unwrap();
    give_away(&planted);
    let error = listing::unlink(&name).unwrap_err();
    assert!(
        matches!(&error, ShmError::ForeignOwner { object, owner: STRANGER, .. } if object == &planted),
        "{error:?}"
    );
    assert!(exists(&planted));
    std::fs::remove_file(shm_path(&planted)).unwrap();
    assert_eq!(listing::unlink(&name).unwrap(), 1);
}

#[test]
fn a_huge_sparse_garbage_object_is_judged_by_its_creator_word_and_taken_over() {
    let name = unique_name("sparse");
    let _cleanup = Cleanup(name.clone());
    let object = name.control_object();
    let file = std::fs::File::create(shm_path(&object)).unwrap();
    file.set_len(200 << 40).unwrap();
    drop(file);
    age(&object);
    let listing = listed(&name);
    assert_eq!(listing.state, ListingState::Stale, "{listing:?}");
    assert_eq!(listing.size, 200 << 40);
    let segment = Segment::create(&name, &SegmentConfig::default()).unwrap();
    assert_eq!(std::fs::metadata(shm_path(&object)).unwrap().len(), segment.size() as u64);
}

#[test]
fn a_huge_sparse_object_naming_a_dead_creator_is_stale() {
    let name = unique_name("sparse-dead");
    let _cleanup = Cleanup(name.clone());
    let dead = dead_identity();
    forge(&name, |fields| fields.creator = dead);
    std::fs::File::options()
        .write(true)
        .open(shm_path(&name.control_object()))
        .unwrap()
        .set_len(200 << 40)
        .unwrap();
    let listing = listed(&name);
    assert_eq!((listing.state, listing.creator), (ListingState::Stale, Some(dead)));
}

#[test]
fn the_creator_removes_its_objects_on_drop_even_when_its_creator_word_was_scribbled() {
    let name = unique_name("scribbled");
    let _cleanup = Cleanup(name.clone());
    let segment = Segment::create(&name, &SegmentConfig::default()).unwrap();
    let at = std::mem::offset_of!(HeaderFields, creator);
    let scribble = ProcessIdentity::new(7, 7);
    let control =
        std::fs::File::options().write(true).open(shm_path(&name.control_object())).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&control, bytemuck::bytes_of(&scribble), at as u64)
        .unwrap();
    let host =
        std::fs::File::options().write(true).open(shm_path(&name.host_tier_object(0))).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&host, &[0xEE; 128], 0).unwrap();
    drop(segment);
    for object in [name.control_object(), name.host_tier_object(0), name.device_arena_object(0)] {
        assert!(!exists(&object), "{object} was left behind");
    }
}

#[test]
fn the_creator_leaves_alone_an_object_that_replaced_its_own() {
    let name = unique_name("replaced");
    let _cleanup = Cleanup(name.clone());
    let segment = Segment::create(&name, &SegmentConfig::default()).unwrap();
    // Someone cleaned up under our feet and made a new host tier of the same name.
    let host = name.host_tier_object(0);
    std::fs::remove_file(shm_path(&host)).unwrap();
    std::fs::write(shm_path(&host), b"someone else's").unwrap();
    let inode = std::fs::metadata(shm_path(&host)).unwrap().ino();
    drop(segment);
    assert_eq!(std::fs::metadata(shm_path(&host)).unwrap().ino(), inode);
    assert!(!exists(&name.control_object()));
    assert!(Path::new(&shm_path(&host)).exists());
}
