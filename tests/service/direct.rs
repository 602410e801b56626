//! Direct copies (an engine's own blocks, copied by the workers through a transport with no cache
//! manager): they land byte for byte, wait for a worker, and survive a worker killed in the middle
//! of one.

use std::time::{Duration, Instant};

use kvshm::hash::BlockHash;
use kvshm::manager::BlockPair;
use kvshm::transport::{CopyKind, DirectCopyOutcome, SegmentConfig, Transport, TransportConfig};

use crate::support::*;

const LAYERS: u32 = 2;

fn service(test: &str, tp_size: u32) -> Transport {
    service_with(test, tp_size, |_| {})
}

/// As [`service`], with `adjust` applied to the configuration first.
fn service_with(test: &str, tp_size: u32, adjust: impl FnOnce(&mut TransportConfig)) -> Transport {
    let segment = SegmentConfig {
        block_tokens: 16,
        tp_size,
        device_blocks: 16,
        host_blocks: 16,
        regions: 2 * LAYERS,
        layers: LAYERS,
        region_bytes: 4096,
        ..SegmentConfig::default()
    };
    let mut config = TransportConfig::new(segment);
    adjust(&mut config);
    Transport::create(&unique_name(test), &config).unwrap()
}

/// Plays rank 0's worker on `worker`: pops every command published to it and answers each with
/// success; how many it answered.
fn answer_every_command(worker: &kvshm::service::Segment) -> usize {
    let mut slots = Vec::new();
    worker.command_consumer(0).unwrap().pop_into(&mut slots, usize::MAX).unwrap();
    let mut completions = worker.completion_producer(0).unwrap();
    let (mut pairs, mut rest, mut answered) = (Vec::new(), &slots[..], 0);
    while !rest.is_empty() {
        let (header, used) = kvshm_ipc::record::decode_command(rest, &mut pairs).unwrap();
        let answer = kvshm_ipc::record::Completion::ok(header.command_id, header.generation);
        completions.push(answer).unwrap();
        (rest, answered) = (&rest[used..], answered + 1);
    }
    answered
}

/// Polls until `count` direct copies have ended.
fn outcomes(service: &mut Transport, count: usize, timeout: Duration) -> Vec<DirectCopyOutcome> {
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    while out.len() < count {
        assert!(Instant::now() < deadline, "direct copies still pending after {timeout:?}");
        service.poll();
        service.pump();
        service.take_direct_outcomes(&mut out);
        std::thread::sleep(Duration::from_millis(1));
    }
    out
}

#[test]
fn a_direct_copy_lands_on_every_rank_byte_for_byte() {
    let mut service = service("direct", 2);
    let _workers = [
        WorkerProcess::spawn(service.segment().name(), 0, None),
        WorkerProcess::spawn(service.segment().name(), 1, None),
    ];
    service.wait_for_workers(Duration::from_secs(10)).unwrap();
    for block in 0..4 {
        write_block(&service, BlockHash(500 + u128::from(block)), block);
    }
    let pairs = (0..4).map(|block| BlockPair::new(block, 10 + block)).collect();
    let id = service.submit_direct_copy(CopyKind::DeviceToHost, pairs);
    let done = outcomes(&mut service, 1, Duration::from_secs(20));
    assert_eq!((done[0].id, done[0].result, done[0].issued), (id, Ok(()), 1));
    for block in 0..4 {
        assert!(host_block_holds(&service, BlockHash(500 + u128::from(block)), 10 + block));
    }
    // And back, into other device blocks.
    let pairs = (0..4).map(|block| BlockPair::new(10 + block, 8 + block)).collect();
    service.submit_direct_copy(CopyKind::HostToDevice, pairs);
    outcomes(&mut service, 1, Duration::from_secs(20));
    for block in 0..4 {
        assert!(device_block_holds(&service, BlockHash(500 + u128::from(block)), 8 + block));
    }
    assert_eq!(service.stats().copy_failures, 0);
}

#[test]
fn a_direct_copy_waits_for_a_worker_and_survives_one_killed_in_the_middle_of_it() {
    let mut service = service("direct-crash", 1);
    for block in 0..8 {
        write_block(&service, BlockHash(900 + u128::from(block)), block);
    }
    let pairs: Vec<BlockPair> = (0..8).map(|block| BlockPair::new(block, block)).collect();
    // No worker yet: the copy waits instead of failing.
    service.submit_direct_copy(CopyKind::DeviceToHost, pairs);
    service.poll();
    service.pump();
    let mut early = Vec::new();
    service.take_direct_outcomes(&mut early);
    assert!(early.is_empty());
    assert_eq!(service.direct_copies_pending(), 1);

    // A slow worker (300 ms per layer) takes it and is killed in the middle.
    let mut slow = WorkerProcess::spawn(service.segment().name(), 0, Some(300_000));
    service.wait_for_workers(Duration::from_secs(10)).unwrap();
    service.poll();
    service.pump();
    std::thread::sleep(Duration::from_millis(100));
    slow.kill_hard();
    let deadline = Instant::now() + Duration::from_secs(5);
    while service.rank_states()[0] != kvshm::service::RankState::Down {
        assert!(Instant::now() < deadline, "the death is noticed");
        service.poll();
        std::thread::sleep(Duration::from_millis(2));
    }
    service.take_direct_outcomes(&mut early);
    assert!(early.is_empty(), "a worker crash is not a failed copy: {early:?}");

    // The restarted worker carries it out.
    let _worker = WorkerProcess::spawn(service.segment().name(), 0, None);
    let done = outcomes(&mut service, 1, Duration::from_secs(20));
    assert_eq!(done[0].result, Ok(()));
    assert_eq!(done[0].issued, 2, "issued again on the new worker");
    for block in 0..8 {
        assert!(host_block_holds(&service, BlockHash(900 + u128::from(block)), block));
    }
}

/// A direct copy waits for every rank's worker to serve before any command of it is queued, so
/// the command deadline's bound on a backlog waiting for a worker that sets up never fails it
/// (vLLM takes a failed copy for a fatal error); once the worker serves, the copy is issued.
#[test]
fn a_direct_copy_outwaits_a_worker_that_sets_up_past_the_command_deadline() {
    let mut service = service_with("direct-setting-up", 1, |config| {
        config.command_deadline = Duration::from_millis(100);
    });
    let worker = kvshm::service::Segment::attach(service.segment().name()).unwrap();
    let claim = worker.claim_rank(0).unwrap();
    service.watch_workers_now();
    service.poll();
    assert!(matches!(service.rank_states()[0], kvshm::service::RankState::Starting { .. }));
    let pairs: Vec<BlockPair> = (0..2).map(|block| BlockPair::new(block, block)).collect();
    service.submit_direct_copy(CopyKind::DeviceToHost, pairs);
    let mut early = Vec::new();
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(150));
        claim.heartbeat().unwrap();
        service.poll();
        service.pump();
        service.take_direct_outcomes(&mut early);
    }
    assert!(early.is_empty(), "a worker that sets up failed the copy: {early:?}");
    assert_eq!((service.stats().copy_failures, service.direct_copies_pending()), (0, 1));

    // It comes up and answers the copy it is sent.
    claim.mark_serving().unwrap();
    service.watch_workers_now();
    service.poll();
    service.pump();
    assert_eq!(answer_every_command(&worker), 1);
    let done = outcomes(&mut service, 1, Duration::from_secs(5));
    assert_eq!((done[0].result, done[0].issued), (Ok(()), 1));
}

/// A worker exits cleanly and a successor takes its rank over, still setting up, with a direct
/// copy in the rank's backlog (the completion ring's credits were all in use): past the command
/// deadline the backlog fails unsent (`WorkerNotServing`), and the direct copy goes back to
/// waiting, counted as no failure (vLLM takes a failed copy for a fatal error), to be issued
/// again once the successor serves.
#[test]
fn a_direct_copy_in_the_backlog_of_a_rank_taken_over_is_issued_again_not_failed() {
    let mut service = service_with("direct-takeover", 1, |config| {
        config.segment.completion_ring_slots = 2;
        config.command_deadline = Duration::from_millis(100);
    });
    let worker = kvshm::service::Segment::attach(service.segment().name()).unwrap();
    let first = worker.claim_rank(0).unwrap();
    first.mark_serving().unwrap();
    service.wait_for_workers(Duration::from_secs(5)).unwrap();
    for block in 0..3 {
        service.submit_direct_copy(CopyKind::DeviceToHost, vec![BlockPair::new(block, block)]);
    }
    service.poll();
    service.pump();
    // Two commands in the ring (its two credits), the third in the backlog. The worker exits
    // cleanly without popping them, and its successor claims the rank at once.
    drop(first);
    let successor = worker.claim_rank(0).unwrap();
    service.watch_workers_now();
    service.poll();
    assert!(matches!(service.rank_states()[0], kvshm::service::RankState::Starting { .. }));
    let mut early = Vec::new();
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(80));
        successor.heartbeat().unwrap();
        service.watch_workers_now();
        service.poll();
        service.pump();
        service.take_direct_outcomes(&mut early);
    }
    assert!(early.is_empty(), "{early:?}");
    assert_eq!(service.stats().setup_waits_failed, 1, "{:?}", service.stats());

    // The successor serves: it answers the two commands left in the ring and the third, sent
    // again.
    successor.mark_serving().unwrap();
    let mut done = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while done.len() < 3 {
        assert!(Instant::now() < deadline, "only {done:?} ended");
        successor.heartbeat().unwrap();
        service.watch_workers_now();
        service.poll();
        service.pump();
        answer_every_command(&worker);
        service.take_direct_outcomes(&mut done);
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(done.iter().all(|outcome| outcome.result.is_ok()), "{done:?}");
    assert_eq!(done.iter().map(|outcome| outcome.issued).max(), Some(2), "{done:?}");
    assert_eq!(service.stats().copy_failures, 0, "a worker that set up failed nothing");
}
