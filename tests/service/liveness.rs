//! Liveness judged on progress, not on copy size (real worker processes): a worker busy on one
//! long layer keeps heartbeating from inside the copy and is never fenced, while a stopped worker
//! still is.

use std::time::{Duration, Instant};

use kvshm::manager::{CacheConfig, RequestId, WritePolicy};
use kvshm::service::{RankState, Service, ServiceConfig};

use crate::support::*;

const BLOCK_TOKENS: u32 = 16;
const DEVICE_BLOCKS: u32 = 16;
/// One layer of two 256 KiB regions per block: a write-back of 16 blocks moves 8 MiB in its one
/// layer, in two pieces of 4 MiB.
const REGION_BYTES: u64 = 256 * 1024;
/// The copy-rate test hook: 8 MiB per second, so that the one layer of a 16-block copy takes about
/// a second, ten times the heartbeat timeout.
const COPY_RATE: &str = "8388608";
const WAIT: Duration = Duration::from_secs(60);

fn service(name: &kvshm_ipc::name::SegmentName) -> Service {
    let cache = CacheConfig::new(BLOCK_TOKENS, DEVICE_BLOCKS)
        .with_host_blocks(64)
        .with_write_policy(WritePolicy::WriteBack);
    Service::create(name, ServiceConfig::new(cache, 1, 1, 2, REGION_BYTES))
        .expect("creating the service")
}

#[test]
fn a_worker_copying_one_layer_for_a_second_is_never_fenced_and_its_write_back_lands() {
    let name = unique_name("long-layer");
    let mut service = service(&name);
    let mut worker =
        WorkerProcess::spawn_with_env(&name, 0, &[("KVSHM_WORKER_COPY_RATE", COPY_RATE)]);
    service.wait_for_workers(Duration::from_secs(10)).unwrap();

    // A fills the device tier; B evicts all of it, so that A's 16 blocks are written back in one
    // transfer whose one layer takes about a second; B's ticket waits for that write-back.
    let prefix_a = hashes(1_000, DEVICE_BLOCKS as usize);
    let prefix_b = hashes(2_000, DEVICE_BLOCKS as usize);
    run_request(&mut service, 1, &prefix_a, WAIT);
    let started = Instant::now();
    run_request(&mut service, 2, &prefix_b, WAIT);
    eprintln!("the write-back of A took {:?}", started.elapsed());

    assert_eq!(service.stats().worker_deaths, 0, "the busy worker was fenced");
    assert_eq!(service.stats().copy_failures, 0);
    assert!(worker.child.try_wait().unwrap().is_none(), "the busy worker was killed");
    assert_eq!(service.rank_states(), [RankState::Up { pid: worker.pid() }]);
    // A comes back from the host tier intact (its swap-in is slow too).
    let (device_hits, host_hits) = run_request(&mut service, 3, &prefix_a, WAIT);
    assert_eq!(device_hits, 0);
    // All of A (but its last block, where the last-token rule applies) hits on host.
    assert!(host_hits >= DEVICE_BLOCKS as usize - 1, "only {host_hits} blocks of A hit on host");
    assert_eq!(service.stats().worker_deaths, 0);
}

#[test]
fn a_worker_stopped_in_the_middle_of_a_long_layer_is_still_fenced() {
    let name = unique_name("stopped-layer");
    let cache = CacheConfig::new(BLOCK_TOKENS, DEVICE_BLOCKS)
        .with_host_blocks(64)
        .with_write_policy(WritePolicy::WriteThrough);
    let mut service =
        Service::create(&name, ServiceConfig::new(cache, 1, 1, 2, REGION_BYTES)).unwrap();
    let mut worker =
        WorkerProcess::spawn_with_env(&name, 0, &[("KVSHM_WORKER_COPY_RATE", COPY_RATE)]);
    service.wait_for_workers(Duration::from_secs(10)).unwrap();

    // Committing 16 blocks starts their write-through backup: one layer of about a second.
    let prefix = hashes(3_000, DEVICE_BLOCKS as usize);
    commit_new_blocks(&mut service, RequestId(1), &prefix);
    assert_eq!(service.cache().transfers_in_flight(), 1, "the backup is in flight");
    // Well inside the layer, past any start-up: the worker is copying when it stops.
    let copying = Instant::now();
    while copying.elapsed() < Duration::from_millis(300) {
        service.poll();
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(service.stats().worker_deaths, 0, "the copying worker was fenced before it stopped");
    let pid = nix::unistd::Pid::from_raw(worker.pid() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();

    let stopped =
        poll_until(&mut service, WAIT, "the stopped worker's copy never failed", |service| {
            service.cache().transfers_in_flight() == 0
        });
    eprintln!("the stopped worker was fenced and its copy failed {:?} after SIGSTOP", stopped);
    let exited = worker.child.try_wait().expect("try_wait");
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
    assert!(exited.is_some(), "the copy was rolled back while the stopped worker could resume it");
    assert_eq!(service.rank_states(), [RankState::Down]);
    assert_eq!(service.stats().copy_failures, 1);
    service.cache().check_invariants().unwrap();
}

/// The start-up test's host tier: 768 blocks of two 1 MiB regions, 1.5 GiB that a worker maps in
/// (prefaults) before it can copy: about a second in 4 KiB pages on an idle machine, more on a busy
/// one.
const START_UP_HOST_BLOCKS: u32 = 768;
const START_UP_REGION_BYTES: u64 = 1 << 20;
/// The command deadline of the start-up test, scaled down from 10 s: well under the set-up of the
/// tier above, and well over the copy of a few MiB by a worker that serves, even when the other
/// tests of the suite keep every CPU busy (100 ms was missed once so).
const START_UP_DEADLINE: Duration = Duration::from_millis(200);

#[test]
fn a_worker_gets_copies_only_once_its_tiers_are_mapped_so_its_set_up_never_misses_a_deadline() {
    // In 4 KiB pages, as on a system without huge pages: in huge pages the set-up is too quick
    // to test anything.
    let test =
        "a_worker_gets_copies_only_once_its_tiers_are_mapped_so_its_set_up_never_misses_a_deadline";
    if !in_child_with_small_pages(module_path!(), test) {
        return;
    }
    let name = unique_name("start-up");
    let cache = CacheConfig::new(BLOCK_TOKENS, DEVICE_BLOCKS)
        .with_host_blocks(START_UP_HOST_BLOCKS)
        .with_write_policy(WritePolicy::WriteThrough);
    let mut config = ServiceConfig::new(cache, 1, 1, 2, START_UP_REGION_BYTES);
    config.command_deadline = START_UP_DEADLINE;
    let mut service = Service::create(&name, config).expect("creating the service");
    let slots = kvshm_ipc::segment::Segment::attach(&name).unwrap();
    let mut worker = WorkerProcess::spawn(&name, 0, None);

    // The rank comes up only once its worker says it serves.
    let started = Instant::now();
    while service.poll_workers().is_some() {
        assert!(started.elapsed() < WAIT, "the worker never came up");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        slots.worker_slot(0).unwrap().view().serving,
        "the rank is up before its worker serves"
    );
    eprintln!("the worker came up after {:?}", started.elapsed());

    // A write-through backup right away: the worker answers it, nobody is fenced.
    let prefix = hashes(4_000, 4);
    commit_new_blocks(&mut service, RequestId(1), &prefix);
    poll_until(&mut service, WAIT, "the backup never landed", |service| {
        service.cache().transfers_in_flight() == 0
    });
    let stats = service.stats();
    assert_eq!(stats.command_deadlines_missed, 0, "the starting worker was taken for a silent one");
    assert_eq!((stats.worker_deaths, stats.copy_failures), (0, 0));
    assert!(worker.child.try_wait().unwrap().is_none(), "the worker was killed");
    assert_eq!(service.rank_states(), [RankState::Up { pid: worker.pid() }]);
    service.cache().check_invariants().unwrap();
}
