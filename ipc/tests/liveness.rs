//! Each side of a segment notices, with real processes, that the other side died: the scheduler
//! sees a killed (or hung) worker as dead, and a worker sees a killed creator; what a killed
//! worker leaves behind (a doorbell registration) goes with the reclaim of its rank, and what a
//! killed engine leaves behind (a half-published device-handle table) with its next publish.
//!
//! The child processes are this test binary re-executed with `KVSHM_TEST_CHILD_ROLE` set; the test
//! `child_process_entry` does nothing in a normal run.

mod common;

use std::io::Write;
use std::time::Duration;

use common::{time_until, ChildProcess, Cleanup, CHILD_ROLE, CHILD_SEGMENT};
use kvshm_ipc::config::{Backend, SegmentConfig};
use kvshm_ipc::device_handles::{DeviceHandleError, DeviceRegionHandle};
use kvshm_ipc::doorbell::WaitPolicy;
use kvshm_ipc::listing::{self, ListingState};
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::segment::{AttachError, Segment};
use kvshm_ipc::worker_slot::{ClaimError, RankStatus, HEARTBEAT_INTERVAL};
use nix::sys::signal::Signal;

/// Generous: a loaded CI machine may be slow to schedule a child, and no test asserts speed.
const PATIENCE: Duration = Duration::from_secs(20);
/// Exit code of a worker child that learnt it lost its rank.
const EXIT_CLAIM_LOST: i32 = 3;

const ENTRY: &str = "child_process_entry";

/// The child side. `claim`: attach, claim rank 1, heartbeat until the claim is lost. `sleep`:
/// attach, claim rank 1 and sleep on its command doorbell until killed. `create`: create the
/// segment and sleep until killed. `publish`: publish the CUDA device handles of rank 0 over and
/// over until killed.
#[test]
fn child_process_entry() {
    let Ok(role) = std::env::var(CHILD_ROLE) else { return };
    let name = SegmentName::new(&std::env::var(CHILD_SEGMENT).unwrap()).unwrap();
    let mut stdout = std::io::stdout();
    match role.as_str() {
        "claim" => {
            let segment = Segment::attach(&name).unwrap();
            let claim = segment.claim_rank(1).unwrap();
            writeln!(stdout, "claimed").unwrap();
            stdout.flush().unwrap();
            while claim.heartbeat().is_ok() {
                std::thread::sleep(HEARTBEAT_INTERVAL);
            }
            std::process::exit(EXIT_CLAIM_LOST);
        }
        "sleep" => {
            let segment = Segment::attach(&name).unwrap();
            let _claim = segment.claim_rank(1).unwrap();
            writeln!(stdout, "claimed").unwrap();
            stdout.flush().unwrap();
            let forever = WaitPolicy::new(Duration::ZERO, Duration::from_secs(3600));
            segment.command_doorbell(1).unwrap().wait_until(|| false, forever);
            unreachable!("a wait without a deadline for a condition that never holds returned");
        }
        "publish" => {
            let segment = Segment::attach(&name).unwrap();
            let handles = device_handles(1, segment.config().regions);
            writeln!(stdout, "publishing").unwrap();
            stdout.flush().unwrap();
            loop {
                segment.publish_device_handles(0, &handles).unwrap();
            }
        }
        "create" => {
            let _segment =
                Segment::create(&name, &SegmentConfig { tp_size: 2, ..Default::default() })
                    .unwrap();
            writeln!(stdout, "created").unwrap();
            stdout.flush().unwrap();
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        other => panic!("unknown child role {other}"),
    }
}

/// A two-rank segment whose rank 1 a child process has claimed (and heartbeats).
fn segment_with_worker_on_rank_1(name: &SegmentName) -> (Segment, ChildProcess, u32) {
    let segment =
        Segment::create(name, &SegmentConfig { tp_size: 2, ..Default::default() }).unwrap();
    let mut worker = ChildProcess::spawn(ENTRY, "claim", name);
    worker.wait_for_line("claimed");
    let pid = worker.pid();
    (segment, worker, pid)
}

#[test]
fn the_scheduler_sees_a_killed_worker_die_and_can_reclaim_its_rank() {
    let name = common::unique_name("worker-kill");
    let _cleanup = Cleanup(name.clone());
    let (segment, mut worker, pid) = segment_with_worker_on_rank_1(&name);
    assert_eq!(segment.rank_status(1).unwrap(), RankStatus::Alive { pid });
    assert_eq!(segment.rank_status(0).unwrap(), RankStatus::Empty);
    assert!(matches!(segment.claim_rank(1), Err(ClaimError::Occupied { pid: p }) if p == pid));

    worker.signal(Signal::SIGKILL);
    let latency =
        time_until(PATIENCE, || segment.rank_status(1).unwrap() == RankStatus::Dead { pid })
            .expect("the killed worker was never seen dead");
    println!("{{\"worker_death_detected_after_us\":{}}}", latency.as_micros());

    // Until the scheduler reclaims the rank, a new worker may not take it.
    assert!(matches!(segment.claim_rank(1), Err(ClaimError::NotReclaimed { pid: p }) if p == pid));
    worker.child.wait().unwrap();
    let verdict = segment.rank_verdict(1).unwrap();
    assert_eq!(verdict.status, RankStatus::Dead { pid });
    segment.reclaim_rank(1, verdict.word).unwrap();
    assert_eq!(segment.rank_status(1).unwrap(), RankStatus::Empty);
    let claim = segment.claim_rank(1).unwrap();
    assert_eq!(segment.rank_status(1).unwrap(), RankStatus::Alive { pid: std::process::id() });
    drop(claim);
    assert_eq!(segment.rank_status(1).unwrap(), RankStatus::Empty);
}

#[test]
fn a_hung_worker_is_declared_dead_by_its_heartbeat_and_learns_it_lost_the_rank() {
    let name = common::unique_name("worker-hang");
    let _cleanup = Cleanup(name.clone());
    let (segment, mut worker, pid) = segment_with_worker_on_rank_1(&name);

    worker.signal(Signal::SIGSTOP);
    let latency =
        time_until(PATIENCE, || segment.rank_status(1).unwrap() == RankStatus::Dead { pid })
            .expect("the stopped worker was never seen dead");
    println!("{{\"hung_worker_detected_after_us\":{}}}", latency.as_micros());
    let verdict = segment.rank_verdict(1).unwrap();
    segment.reclaim_rank(1, verdict.word).unwrap();
    worker.signal(Signal::SIGCONT);
    let status = worker.child.wait().unwrap();
    assert_eq!(status.code(), Some(EXIT_CLAIM_LOST));
}

#[test]
fn a_worker_killed_asleep_on_its_doorbell_stops_costing_rings_once_its_rank_is_reclaimed() {
    let name = common::unique_name("sleeper-kill");
    let _cleanup = Cleanup(name.clone());
    let segment =
        Segment::create(&name, &SegmentConfig { tp_size: 2, ..Default::default() }).unwrap();
    let mut worker = ChildProcess::spawn(ENTRY, "sleep", &name);
    worker.wait_for_line("claimed");
    let doorbell = segment.command_doorbell(1).unwrap();
    time_until(PATIENCE, || doorbell.sleepers() == 1).expect("the worker never went to sleep");

    worker.signal(Signal::SIGKILL);
    worker.child.wait().unwrap();
    assert_eq!(doorbell.sleepers(), 1, "a waiter killed in its sleep never deregisters");
    let verdict = segment.rank_verdict(1).unwrap();
    assert_eq!(verdict.status, RankStatus::Dead { pid: worker.pid() });
    segment.reclaim_rank(1, verdict.word).unwrap();
    assert_eq!(doorbell.sleepers(), 0, "the reclaim forgets the dead worker's registration");
    assert_eq!(segment.command_doorbell(0).unwrap().sleepers(), 0);
}

#[test]
fn a_worker_sees_a_killed_creator_die_and_the_segment_turns_stale() {
    let name = common::unique_name("creator-kill");
    let _cleanup = Cleanup(name.clone());
    let mut creator = ChildProcess::spawn(ENTRY, "create", &name);
    creator.wait_for_line("created");
    let attached = Segment::attach(&name).unwrap();
    assert_eq!(attached.creator().pid, creator.pid());
    assert!(attached.creator_alive());
    assert_eq!(listed_state(&name), ListingState::Live);

    creator.signal(Signal::SIGKILL);
    let latency = time_until(PATIENCE, || !attached.creator_alive())
        .expect("the killed creator was never seen dead");
    println!("{{\"creator_death_detected_after_us\":{}}}", latency.as_micros());

    // Stale whether the dead creator is still a zombie or already reaped.
    assert_eq!(listed_state(&name), ListingState::Stale);
    creator.child.wait().unwrap();
    assert_eq!(listed_state(&name), ListingState::Stale);
    assert!(
        matches!(Segment::attach(&name), Err(AttachError::CreatorDead { pid }) if pid == creator.pid())
    );

    // The data objects of the dead creator are still there, and a new creator takes over.
    let listed = listing::list().into_iter().find(|listing| listing.name == name).unwrap();
    assert_eq!(listed.data_objects.len(), 4);
    let replacement = Segment::create(&name, &SegmentConfig::default()).unwrap();
    assert!(replacement.creator_alive());
    drop(attached);
    assert_eq!(listed_state(&name), ListingState::Live);
}

/// `regions` region handles whose bytes say `generation`.
fn device_handles(generation: u8, regions: u32) -> Vec<DeviceRegionHandle> {
    (0..regions as u8)
        .map(|region| DeviceRegionHandle::new([generation; 64], u64::from(region), 4096, 64))
        .collect()
}

/// The seqlock version of rank 0's device-handle table, read from the control object's bytes.
fn device_handles_version(segment: &Segment) -> u64 {
    use std::os::unix::fs::FileExt;
    let layout = segment.layout();
    let offset = layout.rank_area(0) as u64 + layout.offsets.device_handles;
    let object = common::shm_path(&segment.name().control_object());
    let mut version = [0u8; 8];
    std::fs::File::open(object).unwrap().read_exact_at(&mut version, offset).unwrap();
    u64::from_le_bytes(version)
}

#[test]
fn device_handles_left_half_published_by_a_killed_engine_are_published_again_by_the_next() {
    let name = common::unique_name("publisher-kill");
    let _cleanup = Cleanup(name.clone());
    // 64 regions: a write stores 1,000 words, so a publisher spends most of its time inside one.
    let config =
        SegmentConfig { tp_size: 2, regions: 64, ..Default::default() }.with_backend(Backend::Cuda);
    let segment = Segment::create(&name, &config).unwrap();
    // Kill publishers until one dies inside a write.
    let mut attempts = 0;
    while device_handles_version(&segment) % 2 == 0 {
        attempts += 1;
        assert!(attempts <= 200, "no publisher died inside a write in 200 attempts");
        let mut publisher = ChildProcess::spawn(ENTRY, "publish", &name);
        publisher.wait_for_line("publishing");
        std::thread::sleep(Duration::from_millis(1));
        publisher.signal(Signal::SIGKILL);
        publisher.child.wait().unwrap();
    }
    println!("{{\"publisher_kills_until_one_died_mid_write\":{attempts}}}");
    assert!(matches!(segment.device_handles(0), Err(DeviceHandleError::Busy)));

    let handles = device_handles(2, segment.config().regions);
    segment.publish_device_handles(0, &handles).expect("the dead publisher's lock is taken over");
    assert_eq!(segment.device_handles(0).unwrap(), Some(handles));
}

fn listed_state(name: &SegmentName) -> ListingState {
    listing::list()
        .into_iter()
        .find(|listing| &listing.name == name)
        .map(|listing| listing.state)
        .unwrap()
}

#[test]
fn a_claim_dropped_by_a_panic_is_not_released_as_a_clean_exit() {
    let name = common::unique_name("claim-panic");
    let _cleanup = Cleanup(name.clone());
    let segment =
        Segment::create(&name, &SegmentConfig { tp_size: 2, ..Default::default() }).unwrap();
    let unwound = std::panic::catch_unwind(|| {
        let _claim = segment.claim_rank(1).unwrap();
        panic!("a bug while commands are popped and unanswered");
    });
    assert!(unwound.is_err());
    // The slot still names this process: a successor cannot take the rings over as they are.
    let word = segment.worker_slot(1).unwrap().owner();
    assert_eq!(word.state(), kvshm_ipc::worker_slot::WorkerState::Attached);
    assert_eq!(word.pid(), std::process::id());
    assert!(segment.claim_rank(1).is_err(), "a successor took the rank over as it was");
    // The scheduler takes it back from exactly that word once it judges the worker gone.
    segment.reclaim_rank(1, word).unwrap();
    assert!(segment.claim_rank(1).is_ok());
}
