//! A worker SIGKILLed in the middle of a swap: the service fails and rolls back what it had in
//! flight, leaks nothing, and a new worker for the rank serves the intact host tier. Workers that
//! stop, whose rings or slots are written over, are fenced before anything of theirs fails, and
//! only the process the service saw attach is ever killed.

use std::time::{Duration, Instant};

use kvshm::hash::BlockHash;
use kvshm::manager::{CacheConfig, RequestId, WritePolicy};
use kvshm::service::{RankState, Service, ServiceConfig, TicketReady, WaitError};
use kvshm_ipc::layout::SegmentLayout;
use kvshm_ipc::liveness::ProcessIdentity;
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::record::CommandError;
use kvshm_ipc::worker_slot::{OwnerWord, WorkerState};

use crate::support::*;

const BLOCK_TOKENS: u32 = 16;
const DEVICE_BLOCKS: u32 = 16;
const WAIT: Duration = Duration::from_secs(20);

fn service(name: &SegmentName) -> Service {
    let cache = CacheConfig::new(BLOCK_TOKENS, DEVICE_BLOCKS)
        .with_host_blocks(64)
        .with_write_policy(WritePolicy::WriteBack);
    // 4 layers x (K, V) x 64 KiB: big enough that a delayed copy is visibly in flight.
    let config = ServiceConfig::new(cache, 2, 4, 8, 64 * 1024);
    Service::create(name, config).expect("creating the service")
}

/// A TP-1 service of 4 layers (16 KiB regions) under `policy`, and its one worker, up, which
/// copies `layer_delay_us` per layer.
fn one_slow_worker(
    test: &str,
    policy: WritePolicy,
    layer_delay_us: u64,
) -> (Service, WorkerProcess, SegmentName) {
    let name = unique_name(test);
    let cache = CacheConfig::new(BLOCK_TOKENS, DEVICE_BLOCKS)
        .with_host_blocks(64)
        .with_write_policy(policy);
    let mut service =
        Service::create(&name, ServiceConfig::new(cache, 1, 4, 8, 16 * 1024)).unwrap();
    let worker = WorkerProcess::spawn(&name, 0, Some(layer_delay_us));
    service.wait_for_workers(Duration::from_secs(10)).unwrap();
    (service, worker, name)
}

/// The host block of every node whose hash is in `hashes`.
fn host_blocks_of(service: &Service, hashes: &[BlockHash]) -> Vec<(BlockHash, u32)> {
    let snapshot = service.cache().tree_snapshot(u32::MAX);
    snapshot
        .nodes
        .iter()
        .filter(|node| hashes.contains(&node.hash))
        .filter_map(|node| node.host.map(|block| (node.hash, block)))
        .collect()
}

#[test]
fn a_worker_killed_mid_swap_is_recovered_and_the_host_tier_stays_intact() {
    let name = unique_name("recovery");
    let mut service = service(&name);
    let _rank0 = WorkerProcess::spawn(&name, 0, None);
    let mut slow_rank1 = WorkerProcess::spawn(&name, 1, Some(150_000));
    service.wait_for_workers(Duration::from_secs(10)).unwrap();

    // Cache prefix A on device, then push it to host with prefix B (write-back evictions).
    let prefix_a = hashes(1_000, 8);
    let prefix_b = hashes(2_000, 16);
    assert_eq!(run_request(&mut service, 1, &prefix_a, WAIT), (0, 0));
    assert_eq!(run_request(&mut service, 2, &prefix_b, WAIT), (0, 0));
    let on_host = host_blocks_of(&service, &prefix_a);
    assert_eq!(on_host.len(), 8, "every block of A was written back to host");
    for &(hash, block) in &on_host {
        assert!(host_block_holds(&service, hash, block), "host copy of {hash:?} is intact");
    }

    // Ask for A again: a swap-in (and write-backs of B to make room), slowed down on rank 1.
    let request = RequestId(3);
    let tokens = prefix_a.len() * BLOCK_TOKENS as usize;
    // A prompt one token past A, so that all 8 blocks may hit (the last-token rule).
    let matched = service.match_prefix(request, &prefix_a, tokens + 1).unwrap();
    assert_eq!(matched.host_blocks, 8);
    let ticket = service.allocate(request, tokens - matched.cached_tokens, 0).unwrap().ticket;
    let kill_at = Instant::now() + Duration::from_millis(200);
    while Instant::now() < kill_at {
        service.poll();
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(
        matches!(service.ticket_status(ticket), Ok(kvshm::manager::TicketStatus::Pending)),
        "the swap is still in flight when the worker is killed"
    );
    slow_rank1.kill_hard();

    let killed = Instant::now();
    match service.wait(ticket, WAIT) {
        Err(WaitError::TransferFailed(failure)) => {
            assert_eq!(failure.error, CommandError::WorkerDied);
            assert_eq!(failure.rank, 1);
        }
        other => panic!("the ticket must fail when a rank dies, got {other:?}"),
    }
    eprintln!("worker death noticed and rolled back after {:?}", killed.elapsed());
    assert_eq!(service.rank_states()[1], RankState::Down);
    service.cache().check_invariants().expect("no block leaked by the rollback");
    service.abort(request).unwrap();
    service.cache().check_invariants().unwrap();

    // A new worker for rank 1; A is still on host, byte for byte, and swaps in correctly.
    let _new_rank1 = WorkerProcess::spawn(&name, 1, None);
    service.wait_for_workers(Duration::from_secs(10)).unwrap();
    for &(hash, block) in &host_blocks_of(&service, &prefix_a) {
        assert!(host_block_holds(&service, hash, block), "host copy of {hash:?} survived");
    }
    let (device_hits, host_hits) = run_request(&mut service, 4, &prefix_a, WAIT);
    // A's last block is recomputed (the last-token rule); the rest hits.
    assert_eq!(device_hits + host_hits, 7, "all of A hits after the recovery");
    assert!(host_hits > 0, "and some of it came back from host");
    assert!(service.stats().worker_deaths >= 1);
}

#[test]
fn workers_exit_soon_after_the_scheduler_dies() {
    let name = unique_name("orphan");
    let mut scheduler = std::process::Command::new(env!("CARGO_BIN_EXE_kvshm"))
        .args([
            "demo",
            "--tp",
            "2",
            "--limit",
            "5",
            "--hold",
            "60",
            "--json",
            "--name",
            name.as_str(),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawning kvshm demo");
    // The demo prints its report once the workers have attached and the replay ran.
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(scheduler.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert!(line.contains("corrupted_blocks"), "demo report: {line}");
    let segment = kvshm_ipc::segment::Segment::attach(&name).expect("attaching the demo's segment");
    let workers: Vec<_> =
        (0..2).map(|rank| segment.worker_slot(rank).unwrap().view().worker).collect();
    assert!(workers.iter().all(|worker| worker.is_alive()), "both workers run");
    drop(segment);

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(scheduler.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    scheduler.wait().unwrap();
    let killed = Instant::now();
    while workers.iter().any(|worker| worker.is_alive()) {
        assert!(killed.elapsed() < Duration::from_secs(5), "workers outlived their scheduler");
        std::thread::sleep(Duration::from_millis(5));
    }
    eprintln!("both workers exited {:?} after the scheduler died", killed.elapsed());
    kvshm_ipc::listing::unlink(&name).expect("removing the stale segment");
}

#[test]
fn a_successor_that_attaches_before_the_scheduler_notices_a_clean_exit_loses_no_copy() {
    let (mut service, mut first, name) =
        one_slow_worker("successor", WritePolicy::WriteBack, 40_000);

    let prefix_a = hashes(3_000, 8);
    let prefix_b = hashes(4_000, 16);
    run_request(&mut service, 1, &prefix_a, WAIT);
    run_request(&mut service, 2, &prefix_b, WAIT);

    // A swap-in (plus write-backs) in flight on the slow worker; stop it politely and start a
    // successor at once, before the scheduler polls again.
    let request = RequestId(3);
    let tokens = prefix_a.len() * BLOCK_TOKENS as usize;
    // A prompt one token past A, so that all 8 blocks may hit (the last-token rule).
    let matched = service.match_prefix(request, &prefix_a, tokens + 1).unwrap();
    assert_eq!(matched.host_blocks, 8);
    let allocation = service.allocate(request, tokens - matched.cached_tokens, 0).unwrap();
    let (table, ticket) = (allocation.block_table.to_vec(), allocation.ticket);
    service.poll();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(first.pid() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(first.wait_exit(Duration::from_secs(10)).is_some_and(|status| status.success()));
    let _successor = WorkerProcess::spawn(&name, 0, None);

    // Whatever the first worker had not answered, the successor (or a clean failure) finishes.
    match service.wait(ticket, WAIT) {
        Ok(TicketReady::AllHits) => {
            for (index, &block) in table.iter().enumerate() {
                assert!(device_block_holds(&service, prefix_a[index], block), "block {index}");
            }
            service.commit(request, tokens, &prefix_a).unwrap();
            service.finish(request).unwrap();
        }
        Ok(ready @ TicketReady::Shortened { .. }) => panic!("no storage tier, yet {ready:?}"),
        Err(WaitError::TransferFailed(failure)) => {
            assert_eq!(failure.error, CommandError::WorkerDied);
            service.abort(request).unwrap();
        }
        Err(other) => panic!("the ticket neither landed nor failed cleanly: {other}"),
    }
    service.cache().check_invariants().unwrap();
    service.wait_for_workers(Duration::from_secs(10)).unwrap();
    let (device_hits, host_hits) = run_request(&mut service, 4, &prefix_a, WAIT);
    assert_eq!(device_hits + host_hits, 7, "all of A but its recomputed last block");
}

#[test]
fn a_worker_stopped_mid_copy_is_killed_before_its_copies_are_rolled_back() {
    let (mut service, mut worker, _) =
        one_slow_worker("stopped", WritePolicy::WriteThrough, 100_000);

    // Commit a prefix: its write-through backup is a slow copy (100 ms per layer) that the worker
    // is running when it is stopped. Stopped, it sends no heartbeat; resumed, it would go on
    // copying into blocks the rollback handed out again.
    let prefix = hashes(5_000, 4);
    start_backup(&mut service, RequestId(1), &prefix);
    let pid = nix::unistd::Pid::from_raw(worker.pid() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();

    poll_until(&mut service, WAIT, "the stopped worker's copy never failed", |service| {
        service.cache().transfers_in_flight() == 0
    });
    let exited = worker.child.try_wait().expect("try_wait");
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
    assert!(
        exited.is_some(),
        "the copy was rolled back while the stopped worker could still resume it"
    );
    assert_eq!(service.rank_states(), [RankState::Down]);
    assert_eq!(service.stats().copy_failures, 1);
    service.cache().check_invariants().unwrap();
}

#[test]
fn a_live_worker_whose_completion_ring_is_corrupt_is_killed_and_its_rank_recovers() {
    // Another process scribbles over the completion ring's tail (128 bytes into the ring).
    let service = a_rank_whose_ring_is_scribbled_over(
        "corrupt",
        |layout| layout.offsets.completion_ring + 128,
        "a rank with a corrupt completion ring stays up",
        "the worker of the broken rank was stopped before the rank was reclaimed",
    );
    service.cache().check_invariants().unwrap();
}

#[test]
fn a_live_worker_whose_command_ring_head_is_corrupt_is_killed_and_its_rank_recovers() {
    // Another process scribbles over the command ring's head (256 bytes into the ring): the
    // scheduler could never tell again which slots the worker has released.
    a_rank_whose_ring_is_scribbled_over(
        "corrupt-head",
        |layout| layout.offsets.command_ring + 256,
        "a rank with a corrupt command ring stays up",
        "the worker was stopped first",
    );
}

/// A service whose one worker serves until another process writes a nonsensical index at
/// `offset` (in rank 0's area) of the control object: the rank goes down (`stays_up` if not),
/// its worker stopped first (`stopped_first` if not), and a successor brings it back up.
fn a_rank_whose_ring_is_scribbled_over(
    test: &str,
    offset: impl Fn(&SegmentLayout) -> u64,
    stays_up: &str,
    stopped_first: &str,
) -> Service {
    let name = unique_name(test);
    let cache = CacheConfig::new(BLOCK_TOKENS, DEVICE_BLOCKS).with_host_blocks(16);
    let mut service = Service::create(&name, ServiceConfig::new(cache, 1, 1, 2, 1024)).unwrap();
    let mut worker = WorkerProcess::spawn(&name, 0, None);
    service.wait_for_workers(Duration::from_secs(10)).unwrap();

    let layout = service.segment().layout();
    let at = layout.rank_area(0) as u64 + offset(layout);
    scribble(&service, at, &(u64::MAX / 2).to_le_bytes());

    poll_until(&mut service, WAIT, stays_up, |service| service.rank_states()[0] == RankState::Down);
    assert!(worker.wait_exit(Duration::from_secs(5)).is_some(), "{stopped_first}");
    let _successor = WorkerProcess::spawn(&name, 0, None);
    service.wait_for_workers(Duration::from_secs(10)).unwrap();
    service
}

/// Writes `bytes` at `offset` of the service's control object, as another process of the same
/// user can at any time.
fn scribble(service: &Service, offset: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    let object =
        format!("{}{}", kvshm_ipc::listing::SHM_DIR, service.segment().name().control_object());
    let control = std::fs::OpenOptions::new().write(true).open(object).unwrap();
    control.write_all_at(bytes, offset).unwrap();
}

/// Offset of rank `rank`'s worker slot in the control object.
fn slot_offset(service: &Service, rank: u32) -> u64 {
    service.segment().layout().offsets.worker_slots + u64::from(rank) * 64
}

/// Writes a complete, long-silent claim by `identity` into rank `rank`'s slot: owner word,
/// fields_of, start time, and a heartbeat of long ago (the first four words of the slot).
fn scribble_claim(service: &Service, rank: u32, identity: ProcessIdentity) {
    let word = OwnerWord::new(WorkerState::Attached, identity.pid, 4_000).to_raw();
    let words = [word, word, identity.start_time, 1];
    scribble(service, slot_offset(service, rank), bytemuck::cast_slice(&words));
}

/// Polls for `duration`.
fn poll_for(service: &mut Service, duration: Duration) {
    let until = Instant::now() + duration;
    while Instant::now() < until {
        service.poll();
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn a_worker_slot_scribbled_with_an_unrelated_process_never_gets_that_process_killed() {
    let name = unique_name("stranger");
    let cache = CacheConfig::new(BLOCK_TOKENS, DEVICE_BLOCKS).with_host_blocks(16);
    let mut service = Service::create(&name, ServiceConfig::new(cache, 1, 1, 2, 1024)).unwrap();
    let mut worker = WorkerProcess::spawn(&name, 0, None);
    service.wait_for_workers(Duration::from_secs(10)).unwrap();
    let mut stranger = std::process::Command::new("sleep").arg("600").spawn().unwrap();
    let stranger_identity = ProcessIdentity::of_pid(stranger.id()).expect("sleep runs");

    // "Attached, pid of an unrelated process, silent for ages" over the live worker's claim.
    scribble_claim(&service, 0, stranger_identity);
    poll_until(
        &mut service,
        WAIT,
        "the rank with a scribbled slot was never taken back",
        |service| service.rank_states()[0] == RankState::Down,
    );
    assert!(worker.wait_exit(WAIT).is_some(), "the recorded worker was stopped first");
    poll_for(&mut service, Duration::from_millis(300));
    assert!(stranger.try_wait().unwrap().is_none(), "the unrelated process was killed");

    // The same scribble into the empty slot of a rank that has no worker.
    scribble_claim(&service, 0, stranger_identity);
    poll_for(&mut service, Duration::from_millis(300));
    assert!(stranger.try_wait().unwrap().is_none(), "the unrelated process was killed");
    assert_eq!(service.rank_states(), [RankState::Down]);

    // The rank was taken back from the scribble: a real worker can claim it again.
    let _successor = WorkerProcess::spawn(&name, 0, None);
    service.wait_for_workers(Duration::from_secs(10)).unwrap();
    assert!(stranger.try_wait().unwrap().is_none());
    stranger.kill().unwrap();
    stranger.wait().unwrap();
}

#[test]
fn a_slot_marked_dead_under_a_live_worker_fails_its_copy_only_once_the_worker_is_gone() {
    // 100 ms per layer: the backup below runs for 400 ms.
    let (mut service, mut worker, name) =
        one_slow_worker("marked-dead", WritePolicy::WriteThrough, 100_000);

    let prefix = hashes(6_000, 4);
    start_backup(&mut service, RequestId(1), &prefix);

    // Something writes "dead" over the worker's slot while it copies.
    let dead = OwnerWord::new(WorkerState::Dead, worker.pid(), 4_000).to_raw();
    scribble(&service, slot_offset(&service, 0), &dead.to_le_bytes());
    poll_until(&mut service, WAIT, "the copy of the worker marked dead never failed", |service| {
        service.cache().transfers_in_flight() == 0
    });
    assert!(
        worker.child.try_wait().unwrap().is_some(),
        "the copy failed while the worker that runs it was still alive"
    );
    assert_eq!(service.stats().copy_failures, 1);
    service.cache().check_invariants().unwrap();
    let _successor = WorkerProcess::spawn(&name, 0, None);
    service.wait_for_workers(Duration::from_secs(10)).unwrap();
}

#[test]
fn a_command_whose_id_is_corrupted_in_the_ring_fails_its_transfer_at_the_deadline() {
    use std::os::unix::fs::FileExt;

    let name = unique_name("deadline");
    let cache = CacheConfig::new(BLOCK_TOKENS, DEVICE_BLOCKS)
        .with_host_blocks(64)
        .with_write_policy(WritePolicy::WriteThrough);
    // Two layers of 400 ms each: one backup command takes 0.8 s, well inside the deadline.
    let mut config = ServiceConfig::new(cache, 1, 2, 4, 16 * 1024);
    config.command_deadline = Duration::from_secs(3);
    let command_ring_slots = u64::from(config.command_ring_slots);
    let mut service = Service::create(&name, config).unwrap();
    let mut worker = WorkerProcess::spawn(&name, 0, Some(400_000));
    service.wait_for_workers(Duration::from_secs(10)).unwrap();

    let layout = service.segment().layout();
    let ring_at = layout.rank_area(0) as u64 + layout.offsets.command_ring;
    let control = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("{}{}", kvshm_ipc::listing::SHM_DIR, name.control_object()))
        .unwrap();
    let read_word = |at: u64| {
        let mut word = [0u8; 8];
        control.read_exact_at(&mut word, at).unwrap();
        u64::from_le_bytes(word)
    };
    let (tail_at, head_at) = (ring_at + 128, ring_at + 256);
    let commit = |service: &mut Service, id: u64, first: u128| {
        commit_new_blocks(service, RequestId(id), &hashes(first, 4));
    };

    // The first backup: wait until the worker has popped it (it then copies for 0.8 s).
    commit(&mut service, 1, 6_000);
    let issued = Instant::now();
    while read_word(head_at) != read_word(tail_at) {
        assert!(issued.elapsed() < WAIT, "the worker never took the first backup");
        std::thread::sleep(Duration::from_millis(1));
    }
    // The second backup waits in the ring behind it (a header slot and one pair slot); another
    // process scribbles over its command id (8 bytes into the header).
    commit(&mut service, 2, 7_000);
    assert_eq!(service.cache().transfers_in_flight(), 2);
    let header_index = read_word(tail_at) - 2;
    assert!(read_word(head_at) <= header_index, "the worker already took the second backup");
    let id_at = ring_at + 384 + (header_index % command_ring_slots) * 64 + 8;
    let id = read_word(id_at);
    control.write_all_at(&(id + 1_000_000).to_le_bytes(), id_at).unwrap();

    // The worker copies it and answers an id nobody issued; the real command is never answered.
    let scribbled =
        poll_until(&mut service, WAIT, "the unanswered command stayed in flight", |service| {
            service.cache().transfers_in_flight() == 0
        });
    eprintln!("the unanswered transfer failed {:?} after the scribble", scribbled);
    let stats = service.stats();
    assert_eq!(stats.stray_completions, 1);
    assert_eq!(stats.command_deadlines_missed, 1);
    assert_eq!(stats.copy_failures, 1, "only the unanswered backup failed");
    let status = worker.wait_exit(Duration::from_secs(5)).expect("the silent worker was fenced");
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9));
    assert_eq!(service.rank_states(), [RankState::Down]);
    service.cache().check_invariants().unwrap();

    // Like after a crash, a new worker takes the rank over.
    let _successor = WorkerProcess::spawn(&name, 0, None);
    service.wait_for_workers(Duration::from_secs(10)).unwrap();
    run_request(&mut service, 3, &hashes(8_000, 4), WAIT);
    assert_eq!(service.stats().command_deadlines_missed, 1);
}
