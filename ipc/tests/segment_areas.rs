//! The areas of a segment behave the same through every handle of it: what the creator writes, an
//! attacher reads, and the other way round.

mod common;

use std::time::Duration;

use common::{unique_name, Cleanup};
use kvshm_ipc::arena::{ArenaError, ArenaKind};
use kvshm_ipc::config::{Backend, SegmentConfig, WritePolicy};
use kvshm_ipc::control::ResetStatus;
use kvshm_ipc::counters::Counter;
use kvshm_ipc::device_handles::{DeviceHandleError, DeviceRegionHandle};
use kvshm_ipc::doorbell::{WaitOutcome, WaitPolicy};
use kvshm_ipc::record::{CommandHeader, CommandSlot, Completion, Op};
use kvshm_ipc::ring::RingError;
use kvshm_ipc::segment::{Segment, SegmentError, FIRST_GENERATION};

fn config() -> SegmentConfig {
    SegmentConfig { tp_size: 2, regions: 4, layers: 2, ..SegmentConfig::default() }
        .with_write_policy(WritePolicy::WriteThroughSelective { threshold: 2 })
}

#[test]
fn an_attacher_sees_the_creators_configuration_and_generation() {
    let name = unique_name("config");
    let _cleanup = Cleanup(name.clone());
    let created = Segment::create(&name, &config()).unwrap();
    let attached = Segment::attach(&name).unwrap();
    assert_eq!(attached.config(), &config());
    assert_eq!(
        attached.config().write_policy(),
        Ok(WritePolicy::WriteThroughSelective { threshold: 2 })
    );
    assert_eq!(attached.generation(), FIRST_GENERATION);
    assert_eq!(created.bump_generation(), FIRST_GENERATION + 1);
    assert_eq!(attached.generation(), FIRST_GENERATION + 1);
    assert!(!attached.is_creator());
    assert_eq!(attached.size(), created.size());
}

#[test]
fn commands_and_completions_flow_between_handles() {
    let name = unique_name("rings");
    let _cleanup = Cleanup(name.clone());
    let scheduler = Segment::create(&name, &config()).unwrap();
    let worker = Segment::attach(&name).unwrap();
    let mut commands = scheduler.command_producer(1).unwrap();
    let mut inbox = worker.command_consumer(1).unwrap();
    let mut completions = worker.completion_producer(1).unwrap();
    let mut outbox = scheduler.completion_consumer(1).unwrap();

    let header = CommandHeader::new(Op::Ping, 7, scheduler.generation(), 0);
    commands.push(CommandSlot::from_header(&header)).unwrap();
    scheduler.command_doorbell(1).unwrap().ring();
    assert_eq!(inbox.pop().unwrap().unwrap().header(), header);
    completions.push(Completion::ok(7, header.generation)).unwrap();
    worker.scheduler_doorbell().ring();
    assert_eq!(outbox.pop().unwrap(), Some(Completion::ok(7, header.generation)));
    assert_eq!(outbox.pop().unwrap(), None);
    // Rank 0's rings are separate.
    assert_eq!(scheduler.completion_consumer(0).unwrap().pop().unwrap(), None);
}

#[test]
fn a_completion_bell_wakes_its_waiter_once_a_completion_ring_moves_past_what_it_noted() {
    let name = unique_name("bell");
    let _cleanup = Cleanup(name.clone());
    let scheduler = Segment::create(&name, &config()).unwrap();
    let worker = Segment::attach(&name).unwrap();
    let bell = scheduler.completion_bell().unwrap();
    let mut seen = Vec::new();
    bell.tails(&mut seen);
    assert_eq!(seen, vec![0, 0], "one tail per rank, nothing pushed yet");
    let slice = WaitPolicy::new(Duration::ZERO, Duration::from_millis(5));
    assert_eq!(
        bell.wait_for_answers(&seen, slice.within(Duration::from_millis(20))),
        WaitOutcome::TimedOut
    );
    // A worker answers on rank 1 from another thread while the bell's waiter sleeps.
    let answer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        let mut completions = worker.completion_producer(1).unwrap();
        completions.push(Completion::ok(1, FIRST_GENERATION)).unwrap();
        worker.scheduler_doorbell().ring();
    });
    let waited = bell.wait_for_answers(&seen, slice.within(Duration::from_secs(60)));
    assert_eq!(waited, WaitOutcome::Ready);
    answer.join().unwrap();
    bell.tails(&mut seen);
    assert_eq!(seen, vec![0, 1]);
    // The bell keeps the mapping alive after the segment handle is gone.
    drop(scheduler);
    assert_eq!(bell.wait_for_answers(&seen, slice.within(Duration::ZERO)), WaitOutcome::TimedOut);
}

#[test]
fn ranks_beyond_tp_size_are_refused() {
    let name = unique_name("ranks");
    let _cleanup = Cleanup(name.clone());
    let segment = Segment::create(&name, &config()).unwrap();
    assert!(matches!(
        segment.command_producer(2),
        Err(SegmentError::RankOutOfRange { rank: 2, tp_size: 2 })
    ));
    assert!(segment.worker_slot(9).is_err());
    assert!(segment.layer_progress(2).is_err());
    assert!(segment.command_doorbell(2).is_err());
    assert!(matches!(segment.device_handles(5), Err(DeviceHandleError::RankOutOfRange { .. })));
}

#[test]
fn reclaiming_a_rank_empties_its_rings_and_progress() {
    let name = unique_name("reclaim");
    let _cleanup = Cleanup(name.clone());
    let segment = Segment::create(&name, &config()).unwrap();
    let mut commands = segment.command_producer(0).unwrap();
    for id in 0..3 {
        commands.push(CommandSlot::from_header(&CommandHeader::new(Op::Ping, id, 1, 0))).unwrap();
    }
    segment.layer_progress(0).unwrap().begin(1);
    segment.layer_progress(0).unwrap().publish(1, 2);
    let empty = segment.worker_slot(0).unwrap().owner();
    segment.reclaim_rank(0, empty).unwrap();
    assert_eq!(segment.command_consumer(0).unwrap().pop().unwrap(), None);
    assert_eq!(segment.layer_progress(0).unwrap().layers_done(1), None);
}

/// A ring whose capacity a peer rewrote in place (to 1: still a valid description) is refused
/// by every end of it, the workers' and the scheduler's, until a reclaim describes it again;
/// the completion bell, which only reads tails, still serves waits.
#[test]
fn every_end_refuses_a_ring_whose_capacity_was_rewritten_until_the_reclaim() {
    use std::os::unix::fs::FileExt;

    let name = unique_name("capacity");
    let _cleanup = Cleanup(name.clone());
    let segment = Segment::create(&name, &config()).unwrap();
    let object = format!("{}{}", kvshm_ipc::listing::SHM_DIR, name.control_object());
    let control = std::fs::OpenOptions::new().write(true).open(object).unwrap();
    let layout = segment.layout();
    let (command, completion) = (layout.offsets.command_ring, layout.offsets.completion_ring);
    // A ring's description: magic, element size, capacity, one 8-byte word each.
    for ring in [command, completion] {
        let capacity_at = layout.rank_area(1) as u64 + ring + 16;
        control.write_all_at(&1u64.to_ne_bytes(), capacity_at).unwrap();
    }
    let refused = |result: Result<(), SegmentError>, ring: &str, expected: u32| {
        assert!(
            matches!(
                &result,
                Err(SegmentError::Ring {
                    ring: found,
                    rank: 1,
                    source: RingError::CapacityMismatch { found: 1, expected: slots },
                }) if *found == ring && *slots == u64::from(expected)
            ),
            "{ring} ring: {result:?}"
        );
    };
    let config = segment.config();
    let (commands, completions) = (config.command_ring_slots, config.completion_ring_slots);
    refused(segment.command_producer(1).map(drop), "command", commands);
    refused(segment.command_consumer(1).map(drop), "command", commands);
    refused(segment.completion_producer(1).map(drop), "completion", completions);
    refused(segment.completion_consumer(1).map(drop), "completion", completions);
    assert!(segment.completion_bell().is_ok(), "the bell reads tails only");
    assert!(segment.command_consumer(0).is_ok(), "rank 0's rings are untouched");

    let empty = segment.worker_slot(1).unwrap().owner();
    segment.reclaim_rank(1, empty).unwrap();
    assert_eq!(segment.command_consumer(1).unwrap().capacity(), commands as usize);
    assert_eq!(segment.completion_producer(1).unwrap().capacity(), completions as usize);
    assert!(segment.completion_bell().is_ok());
}

#[test]
fn counters_written_by_the_scheduler_are_read_by_kvctl() {
    let name = unique_name("counters");
    let _cleanup = Cleanup(name.clone());
    let scheduler = Segment::create(&name, &config()).unwrap();
    let kvctl = Segment::attach(&name).unwrap();
    scheduler.counters().set(Counter::DeviceBlocksTotal, 64);
    scheduler.counters().add(Counter::Lookups, 3);
    let snapshot = kvctl.counters().snapshot();
    assert!(snapshot.contains(&(Counter::DeviceBlocksTotal, 64)));
    assert!(snapshot.contains(&(Counter::Lookups, 3)));
    assert!(snapshot.contains(&(Counter::Evictions, 0)));
}

#[test]
fn kvctl_requests_are_answered_by_a_polling_scheduler_in_another_handle() {
    let name = unique_name("control");
    let _cleanup = Cleanup(name.clone());
    let scheduler = Segment::create(&name, &config()).unwrap();
    let kvctl = Segment::attach(&name).unwrap();
    let stop = kvshm_ipc::sync::AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(kvshm_ipc::sync::Ordering::Relaxed) {
                let control = scheduler.control();
                if let Some(request) = control.pending_reset() {
                    let status =
                        if request.force { ResetStatus::Done } else { ResetStatus::RefusedBusy };
                    control.complete_reset(request, status);
                }
                if let Some(request) = control.pending_snapshot() {
                    control
                        .publish_snapshot(
                            request,
                            format!("{{\"depth\":{}}}", request.depth).as_bytes(),
                        )
                        .unwrap();
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        });
        let timeout = Duration::from_secs(20);
        let results = (
            kvctl.control().reset(false, timeout),
            kvctl.control().reset(true, timeout),
            kvctl.control().fetch_snapshot(2, timeout),
        );
        stop.store(true, kvshm_ipc::sync::Ordering::Relaxed);
        assert_eq!(results.0, Ok(ResetStatus::RefusedBusy));
        assert_eq!(results.1, Ok(ResetStatus::Done));
        assert_eq!(results.2.as_deref(), Ok("{\"depth\":2}"));
    });
}

#[test]
fn layer_progress_published_by_a_worker_is_seen_by_the_scheduler() {
    let name = unique_name("progress");
    let _cleanup = Cleanup(name.clone());
    let scheduler = Segment::create(&name, &config()).unwrap();
    let worker = Segment::attach(&name).unwrap();
    let progress = worker.layer_progress(1).unwrap();
    assert_eq!(progress.entries(), config().completion_ring_slots as usize);
    assert_eq!(scheduler.layer_progress(1).unwrap().layers_done(42), None);
    progress.begin(42);
    progress.publish(42, 1);
    assert_eq!(scheduler.layer_progress(1).unwrap().layers_done(42), Some(1));
    assert_eq!(scheduler.layer_progress(0).unwrap().layers_done(42), None);
}

#[test]
fn device_handles_published_by_the_engine_are_read_by_the_worker() {
    let name = unique_name("handles");
    let _cleanup = Cleanup(name.clone());
    let config = config().with_backend(Backend::Cuda);
    let engine = Segment::create(&name, &config).unwrap();
    let worker = Segment::attach(&name).unwrap();
    assert_eq!(worker.device_handles(1).unwrap(), None);
    let handles: Vec<_> = (0..4u8)
        .map(|region| DeviceRegionHandle::new([region; 64], u64::from(region) * 4096, 65536, 1024))
        .collect();
    assert!(matches!(
        engine.publish_device_handles(1, &handles[..3]),
        Err(DeviceHandleError::WrongCount { found: 3, expected: 4 })
    ));
    engine.publish_device_handles(1, &handles).unwrap();
    assert_eq!(worker.device_handles(1).unwrap(), Some(handles));
    assert_eq!(worker.device_handles(0).unwrap(), None);
    // The CUDA backend has no device arena, only the host tier.
    assert!(matches!(worker.open_arena(ArenaKind::Device, 0), Err(ArenaError::Shm(_))));
    assert!(worker.open_arena(ArenaKind::Host, 0).is_ok());
}

#[test]
fn arena_bytes_written_by_one_process_are_read_by_another() {
    let name = unique_name("arena");
    let _cleanup = Cleanup(name.clone());
    let segment = Segment::create(&name, &config()).unwrap();
    let writer = segment.open_arena(ArenaKind::Host, 1).unwrap();
    let reader = Segment::attach(&name).unwrap().open_arena(ArenaKind::Host, 1).unwrap();
    assert_eq!(writer.blocks(), u64::from(config().host_blocks));
    assert_eq!(writer.block_bytes(), config().block_bytes());
    assert_eq!(writer.data_len() as u64, writer.blocks() * writer.block_bytes());
    assert_eq!(writer.data_ptr() as usize % 4096, 0);
    let last = writer.data_len() - 1;
    writer.write_data(last - 10, b"hello world").unwrap();
    let mut read = [0u8; 11];
    reader.read_data(last - 10, &mut read).unwrap();
    assert_eq!(&read, b"hello world");
    assert!(matches!(
        reader.read_data(last, &mut read),
        Err(ArenaError::OutOfBounds { offset, len: 11, .. }) if offset == last
    ));
    assert!(matches!(writer.write_data(usize::MAX, b"x"), Err(ArenaError::OutOfBounds { .. })));
    // An arena of a rank the segment does not have is not found.
    assert!(matches!(
        kvshm_ipc::arena::Arena::open(&name, ArenaKind::Device, 7),
        Err(ArenaError::Shm(kvshm_ipc::shm::ShmError::NotFound { .. }))
    ));
}
