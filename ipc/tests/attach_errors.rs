//! Every way attaching or creating a segment can fail gives its own typed error, and nothing that
//! a file under /dev/shm contains makes the attacher panic or read out of bounds.

mod common;

use common::{
    dead_identity, forge, segment_bytes, set_ready, shm_path, unique_name, write_control, Cleanup,
};
use kvshm_ipc::config::{ConfigError, SegmentConfig};
use kvshm_ipc::layout::{LAYOUT_VERSION, READY};
use kvshm_ipc::listing::{self, ListingState};
use kvshm_ipc::liveness::ProcessIdentity;
use kvshm_ipc::name::{NameError, SegmentName};
use kvshm_ipc::segment::{AttachError, CorruptReason, CreateError, Segment};

#[test]
fn attaching_a_missing_segment_is_not_found() {
    let name = unique_name("missing");
    assert!(matches!(Segment::attach(&name), Err(AttachError::NotFound { .. })));
}

#[test]
fn attaching_another_users_segment_is_foreign_owner() {
    let name = unique_name("foreign");
    let _cleanup = Cleanup(name.clone());
    let segment = Segment::create(&name, &SegmentConfig::default()).unwrap();
    let me = nix::unistd::geteuid().as_raw();
    if me != 0 {
        // Only root can give a file away; the owner check itself is unit-tested in shm.rs.
        eprintln!("not root: cannot chown, skipping the object-level half of this test");
        return;
    }
    let stranger = 54321;
    std::os::unix::fs::chown(shm_path(&name.control_object()), Some(stranger), None).unwrap();
    match Segment::attach(&name) {
        Err(AttachError::ForeignOwner { owner, expected }) => {
            assert_eq!((owner, expected), (stranger, me));
        }
        other => panic!("expected ForeignOwner, got {other:?}"),
    }
    drop(segment);
}

#[test]
fn attaching_a_truncated_segment_is_truncated() {
    let name = unique_name("truncated");
    let _cleanup = Cleanup(name.clone());
    let bytes = segment_bytes(&name);
    write_control(&name, &bytes[..bytes.len() / 2]);
    match Segment::attach(&name) {
        Err(AttachError::Truncated { len, expected }) => {
            assert_eq!((len, expected), (bytes.len() as u64 / 2, bytes.len() as u64));
        }
        other => panic!("expected Truncated, got {other:?}"),
    }
}

#[test]
fn attaching_a_segment_shorter_than_its_header_is_truncated() {
    for len in [0usize, 100] {
        let name = unique_name("stub");
        let _cleanup = Cleanup(name.clone());
        write_control(&name, &vec![0u8; len]);
        match Segment::attach(&name) {
            Err(AttachError::Truncated { len: found, expected: 320 }) => {
                assert_eq!(found, len as u64)
            }
            other => panic!("expected Truncated for {len} bytes, got {other:?}"),
        }
    }
}

#[test]
fn attaching_another_layout_version_is_a_version_mismatch() {
    let name = unique_name("version");
    let _cleanup = Cleanup(name.clone());
    forge(&name, |fields| fields.layout_version = LAYOUT_VERSION + 7);
    match Segment::attach(&name) {
        Err(AttachError::VersionMismatch { found, expected }) => {
            assert_eq!((found, expected), (LAYOUT_VERSION + 7, LAYOUT_VERSION));
        }
        other => panic!("expected VersionMismatch, got {other:?}"),
    }
}

#[test]
fn attaching_without_the_magic_is_bad_magic() {
    let name = unique_name("magic");
    let _cleanup = Cleanup(name.clone());
    forge(&name, |fields| fields.magic = u64::from_le_bytes(*b"NOTKVSHM"));
    assert!(matches!(Segment::attach(&name), Err(AttachError::BadMagic)));
}

#[test]
fn attaching_with_another_record_size_names_the_record() {
    let name = unique_name("records");
    let _cleanup = Cleanup(name.clone());
    forge(&name, |fields| fields.record_sizes.completion = 40);
    match Segment::attach(&name) {
        Err(AttachError::RecordSizeMismatch { record, found, expected }) => {
            assert_eq!((record, found, expected), ("Completion", 40, 32));
        }
        other => panic!("expected RecordSizeMismatch, got {other:?}"),
    }
}

#[test]
fn attaching_with_an_invalid_stored_config_is_corrupt() {
    let name = unique_name("config");
    let _cleanup = Cleanup(name.clone());
    forge(&name, |fields| fields.config.tp_size = 0);
    match Segment::attach(&name) {
        Err(AttachError::Corrupt(CorruptReason::Config(ConfigError::TpSizeOutOfRange {
            tp_size: 0,
            ..
        }))) => {}
        other => panic!("expected a corrupt config, got {other:?}"),
    }
}

#[test]
fn attaching_with_moved_area_offsets_is_corrupt() {
    let name = unique_name("offsets");
    let _cleanup = Cleanup(name.clone());
    let mut moved = 0;
    forge(&name, |fields| {
        moved = fields.offsets.command_ring + (1 << 40);
        fields.offsets.command_ring = moved;
    });
    match Segment::attach(&name) {
        Err(AttachError::Corrupt(CorruptReason::Offset {
            area: "command_ring", found, ..
        })) => {
            assert_eq!(found, moved);
        }
        other => panic!("expected corrupt offsets, got {other:?}"),
    }
}

#[test]
fn attaching_with_a_wrong_total_size_is_corrupt() {
    let name = unique_name("total");
    let _cleanup = Cleanup(name.clone());
    forge(&name, |fields| fields.total_size -= 4096);
    assert!(matches!(
        Segment::attach(&name),
        Err(AttachError::Corrupt(CorruptReason::TotalSize { .. }))
    ));
}

#[test]
fn attaching_a_half_initialised_segment_of_a_live_creator_is_not_ready() {
    let name = unique_name("half-live");
    let _cleanup = Cleanup(name.clone());
    let mut bytes = segment_bytes(&name);
    set_ready(&mut bytes, 0);
    write_control(&name, &bytes);
    match Segment::attach(&name) {
        Err(AttachError::NotReady { pid }) => assert_eq!(pid, std::process::id()),
        other => panic!("expected NotReady, got {other:?}"),
    }
    // Its live creator keeps others from taking it over.
    assert!(matches!(
        Segment::create(&name, &SegmentConfig::default()),
        Err(CreateError::InUse { pid }) if pid == std::process::id()
    ));
}

#[test]
fn a_half_initialised_segment_of_a_dead_creator_is_stale() {
    let name = unique_name("half-dead");
    let _cleanup = Cleanup(name.clone());
    let dead = dead_identity();
    let mut bytes = forge(&name, |fields| fields.creator = dead);
    std::fs::remove_file(shm_path(&name.control_object())).unwrap();
    set_ready(&mut bytes, 0);
    write_control(&name, &bytes);
    match Segment::attach(&name) {
        Err(AttachError::CreatorDead { pid }) => assert_eq!(pid, dead.pid),
        other => panic!("expected CreatorDead, got {other:?}"),
    }
}

#[test]
fn a_ready_segment_of_a_dead_creator_is_stale() {
    let name = unique_name("ready-dead");
    let _cleanup = Cleanup(name.clone());
    let dead = dead_identity();
    forge(&name, |fields| fields.creator = dead);
    match Segment::attach(&name) {
        Err(AttachError::CreatorDead { pid }) => assert_eq!(pid, dead.pid),
        other => panic!("expected CreatorDead, got {other:?}"),
    }
    let listed = listing::list().into_iter().find(|listing| listing.name == name).unwrap();
    assert_eq!(listed.state, ListingState::Stale);
    assert_eq!(listed.creator, Some(dead));
}

#[test]
fn creating_over_a_stale_segment_replaces_it_and_its_data_objects() {
    let name = unique_name("takeover");
    let _cleanup = Cleanup(name.clone());
    let dead = dead_identity();
    forge(&name, |fields| fields.creator = dead);
    // A leftover data object of the dead creator, of the wrong size.
    std::fs::write(shm_path(&name.host_tier_object(0)), b"old host tier").unwrap();
    let segment = Segment::create(&name, &SegmentConfig::default()).unwrap();
    assert_eq!(segment.creator(), ProcessIdentity::current());
    let host = segment.open_arena(kvshm_ipc::arena::ArenaKind::Host, 0).unwrap();
    assert_eq!(host.blocks(), u64::from(SegmentConfig::default().host_blocks));
    let attached = Segment::attach(&name).unwrap();
    assert_eq!(attached.creator(), ProcessIdentity::current());
}

#[test]
fn creating_over_old_creatorless_garbage_replaces_it() {
    let name = unique_name("garbage");
    let _cleanup = Cleanup(name.clone());
    write_control(&name, &[0xAB; 10]);
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
    let file = std::fs::File::options().write(true).open(shm_path(&name.control_object())).unwrap();
    file.set_modified(old).unwrap();
    let listed = listing::list().into_iter().find(|listing| listing.name == name).unwrap();
    assert_eq!(listed.state, ListingState::Stale);
    Segment::create(&name, &SegmentConfig::default()).unwrap();
}

#[test]
fn creating_over_fresh_creatorless_garbage_is_refused_as_being_created() {
    let name = unique_name("fresh");
    let _cleanup = Cleanup(name.clone());
    write_control(&name, &[]);
    assert!(matches!(
        Segment::create(&name, &SegmentConfig::default()),
        Err(CreateError::BeingCreated { .. })
    ));
}

#[test]
fn creating_over_a_live_segment_is_in_use() {
    let name = unique_name("live");
    let _cleanup = Cleanup(name.clone());
    let _first = Segment::create(&name, &SegmentConfig::default()).unwrap();
    match Segment::create(&name, &SegmentConfig::default()) {
        Err(CreateError::InUse { pid }) => assert_eq!(pid, std::process::id()),
        other => panic!("expected InUse, got {other:?}"),
    }
}

#[test]
fn creating_more_than_dev_shm_holds_is_no_space_and_leaves_nothing() {
    let name = unique_name("full");
    let _cleanup = Cleanup(name.clone());
    let stat = nix::sys::statvfs::statvfs(listing::SHM_DIR).unwrap();
    // One region larger than the whole file system, so that tmpfs refuses at once.
    let whole = stat.blocks() as u64 * stat.fragment_size() as u64;
    let config = SegmentConfig {
        device_blocks: 1,
        host_blocks: 1,
        regions: 1,
        layers: 1,
        region_bytes: whole + (64 << 20),
        ..SegmentConfig::default()
    };
    assert!(matches!(Segment::create(&name, &config), Err(CreateError::NoSpace { .. })));
    assert!(listing::list().iter().all(|listing| listing.name != name), "objects were left behind");
}

#[test]
fn creating_with_an_invalid_config_names_the_field() {
    let name = unique_name("badconfig");
    let config = SegmentConfig { regions: 5, layers: 2, ..SegmentConfig::default() };
    assert!(matches!(
        Segment::create(&name, &config),
        Err(CreateError::InvalidConfig(ConfigError::RegionsNotMultipleOfLayers {
            regions: 5,
            layers: 2
        }))
    ));
}

#[test]
fn names_with_a_slash_empty_or_too_long_are_refused() {
    assert!(matches!(SegmentName::new("a/b"), Err(NameError::InvalidChar { ch: '/', .. })));
    assert_eq!(SegmentName::new(""), Err(NameError::Empty));
    assert!(matches!(SegmentName::new(&"n".repeat(65)), Err(NameError::TooLong { .. })));
}

#[test]
fn the_creator_removes_its_objects_on_drop_unless_told_to_keep_them() {
    let name = unique_name("drop");
    let _cleanup = Cleanup(name.clone());
    let segment = Segment::create(&name, &SegmentConfig::default()).unwrap();
    assert!(std::path::Path::new(&shm_path(&name.host_tier_object(0))).exists());
    drop(segment);
    assert!(listing::list().iter().all(|listing| listing.name != name));

    let mut kept = Segment::create(&name, &SegmentConfig::default()).unwrap();
    kept.keep_on_drop();
    drop(kept);
    let listed = listing::list().into_iter().find(|listing| listing.name == name).unwrap();
    assert_eq!(listed.state, ListingState::Live);
    assert_eq!(listed.data_objects.len(), 2);
}

#[test]
fn list_shows_live_stale_and_orphaned_segments() {
    let (live, stale, orphan) =
        (unique_name("ls-live"), unique_name("ls-stale"), unique_name("ls-orphan"));
    let _cleanups = [Cleanup(live.clone()), Cleanup(stale.clone()), Cleanup(orphan.clone())];
    let _segment = Segment::create(&live, &SegmentConfig::default()).unwrap();
    let dead = dead_identity();
    forge(&stale, |fields| fields.creator = dead);
    std::fs::write(shm_path(&orphan.device_arena_object(1)), b"x").unwrap();

    let listings = listing::list();
    let find = |name: &SegmentName| listings.iter().find(|listing| &listing.name == name).unwrap();
    let live_listing = find(&live);
    assert_eq!(live_listing.state, ListingState::Live);
    assert_eq!(live_listing.config, Some(SegmentConfig::default()));
    assert_eq!(live_listing.creator.map(|creator| creator.pid), Some(std::process::id()));
    assert_eq!(live_listing.data_objects.len(), 2);
    assert!(live_listing.size > 0);
    assert_eq!(find(&stale).state, ListingState::Stale);
    let orphan_listing = find(&orphan);
    assert_eq!(orphan_listing.state, ListingState::Orphaned);
    assert_eq!(orphan_listing.data_objects[0].rank, 1);

    assert_eq!(listing::unlink(&orphan).unwrap(), 1);
    assert!(listing::list().iter().all(|listing| listing.name != orphan));
}

#[test]
fn random_header_damage_never_panics() {
    let name = unique_name("fuzz");
    let _cleanup = Cleanup(name.clone());
    let pristine = segment_bytes(&name);
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..300 {
        let mut bytes = pristine.clone();
        for _ in 0..1 + next() % 4 {
            let at = (next() % 320) as usize;
            bytes[at] = next() as u8;
        }
        set_ready(&mut bytes, READY);
        let _ = std::fs::remove_file(shm_path(&name.control_object()));
        write_control(&name, &bytes);
        // Any error is fine; a panic or a fault fails the test.
        if let Ok(segment) = Segment::attach(&name) {
            assert_eq!(segment.config().validate(), Ok(()));
        }
    }
}

#[test]
fn a_damaged_ring_header_is_an_error_of_that_ring_not_a_panic() {
    let name = unique_name("ring");
    let _cleanup = Cleanup(name.clone());
    let mut bytes = segment_bytes(&name);
    let layout = kvshm_ipc::layout::SegmentLayout::compute(&SegmentConfig::default()).unwrap();
    let ring = layout.rank_area(0) + layout.offsets.completion_ring as usize;
    bytes[ring..ring + 64].fill(0xEE);
    write_control(&name, &bytes);
    let segment = Segment::attach(&name).unwrap();
    assert!(matches!(
        segment.completion_consumer(0),
        Err(kvshm_ipc::segment::SegmentError::Ring { ring: "completion", rank: 0, .. })
    ));
    assert!(segment.command_consumer(0).is_ok());
}
