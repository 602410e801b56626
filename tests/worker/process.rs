//! `kvshm worker` as a real process, driven the way the scheduler drives it: the test creates a
//! segment in-process, spawns the worker binary for a rank, writes commands into the rank's
//! command ring, rings its doorbell, and reads the completions and the tiers' bytes back.
//!
//! Block layouts the bytes are checked against (DESIGN §2.4): the host backend's device arena
//! is region-major (region `r` of block `b` at `(r * device_blocks + b) * region_bytes`), the host
//! tier block-major (at `(b * regions + r) * region_bytes`).

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use kvshm_ipc::arena::{Arena, ArenaKind};
use kvshm_ipc::config::{Backend, SegmentConfig};
use kvshm_ipc::counters::Counter;
use kvshm_ipc::listing;
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::record::{CommandError, CommandHeader, CommandSlot, Completion, Op, FLAG_LAYERWISE};
use kvshm_ipc::segment::Segment;
use kvshm_ipc::worker_slot::{ClaimError, RankStatus};
use nix::sys::signal::Signal;

use crate::support::{rerun_test, unique_name, RingDriver, Worker};

const LAYER_DELAY_ENV: &str = "KVSHM_WORKER_LAYER_DELAY_US";
const COPY_RATE_ENV: &str = "KVSHM_WORKER_COPY_RATE";
/// Set in a re-executed copy of this test binary that plays the segment's creator.
const CREATOR_ENV: &str = "KVSHM_TEST_WORKER_CREATOR";
/// Generous bound for anything the tests wait for; reaching it is a failure, not a measurement.
const PATIENCE: Duration = Duration::from_secs(10);

fn config() -> SegmentConfig {
    SegmentConfig {
        tp_size: 2,
        device_blocks: 32,
        host_blocks: 64,
        regions: 4,
        layers: 2,
        region_bytes: 512,
        command_ring_slots: 256,
        completion_ring_slots: 64,
        ..SegmentConfig::default()
    }
}

/// The byte at `offset` of region `region` of a block tagged `tag`.
fn pattern(tag: u32, region: u32, offset: u64) -> u8 {
    (tag.wrapping_mul(31) ^ region.wrapping_mul(7) ^ offset as u32) as u8
}

/// One rank's tiers as the test sees them.
struct Tiers {
    config: SegmentConfig,
    device: Arena,
    host: Arena,
}

impl Tiers {
    fn open(segment: &Segment, rank: u32) -> Tiers {
        Tiers {
            config: *segment.config(),
            device: segment.open_arena(ArenaKind::Device, rank).unwrap(),
            host: segment.open_arena(ArenaKind::Host, rank).unwrap(),
        }
    }

    fn device_offset(&self, block: u32, region: u32) -> usize {
        let c = &self.config;
        ((u64::from(region) * u64::from(c.device_blocks) + u64::from(block)) * c.region_bytes)
            as usize
    }

    fn host_offset(&self, block: u32, region: u32) -> usize {
        let c = &self.config;
        ((u64::from(block) * u64::from(c.regions) + u64::from(region)) * c.region_bytes) as usize
    }

    fn fill(&self, arena: &Arena, at: impl Fn(u32) -> usize, tag: u32) {
        for region in 0..self.config.regions {
            let bytes: Vec<u8> =
                (0..self.config.region_bytes).map(|offset| pattern(tag, region, offset)).collect();
            // The worker touches no block of this test while the test writes it (no command for
            // it is in flight).
            arena.write_data(at(region), &bytes).expect("a region inside the arena");
        }
    }

    fn holds(&self, arena: &Arena, at: impl Fn(u32) -> usize, tag: u32) -> bool {
        let mut bytes = vec![0u8; self.config.region_bytes as usize];
        (0..self.config.regions).all(|region| {
            // The copy that wrote it has completed.
            arena.read_data(at(region), &mut bytes).expect("a region inside the arena");
            (0..self.config.region_bytes)
                .all(|offset| bytes[offset as usize] == pattern(tag, region, offset))
        })
    }

    fn fill_device(&self, block: u32, tag: u32) {
        self.fill(&self.device, |region| self.device_offset(block, region), tag);
    }

    fn fill_host(&self, block: u32, tag: u32) {
        self.fill(&self.host, |region| self.host_offset(block, region), tag);
    }

    fn device_holds(&self, block: u32, tag: u32) -> bool {
        self.holds(&self.device, |region| self.device_offset(block, region), tag)
    }

    fn host_holds(&self, block: u32, tag: u32) -> bool {
        self.holds(&self.host, |region| self.host_offset(block, region), tag)
    }
}

/// A `kvshm worker` for `rank` with `extra` arguments and `env`, its stderr kept for the test.
fn spawn_worker(name: &SegmentName, rank: u32, extra: &[&str], env: &[(&str, &str)]) -> Worker {
    let args: Vec<String> = extra.iter().map(|arg| arg.to_string()).collect();
    let env: Vec<(&str, String)> =
        env.iter().map(|&(key, value)| (key, value.to_owned())).collect();
    Worker::spawn(name, rank, &args, &env, None)
}

/// The scheduler's side of one rank.
type Rank<'a> = RingDriver<'a>;

fn ok(header: &CommandHeader) -> Completion {
    Completion::ok(header.command_id, header.generation)
}

fn failed(header: &CommandHeader, error: CommandError, detail: u64) -> Completion {
    Completion::failed(header.command_id, header.generation, error, detail)
}

#[test]
fn copies_move_device_blocks_to_host_blocks_and_back() {
    let name = unique_name("copy");
    let segment = Segment::create(&name, &config()).unwrap();
    let tiers = Tiers::open(&segment, 1);
    let mut rank = Rank::new(&segment, 1);
    let worker = spawn_worker(&name, 1, &[], &[]);
    for (block, tag) in [(3, 103), (4, 104), (5, 105), (31, 131)] {
        tiers.fill_device(block, tag);
    }

    let d2h = rank.copy(Op::CopyDeviceToHost, &[(3, 10), (4, 11), (5, 63), (31, 0)]);
    rank.send([&d2h]);
    assert_eq!(rank.completions(1), vec![ok(&d2h.0)]);
    for (block, tag) in [(10, 103), (11, 104), (63, 105), (0, 131)] {
        assert!(tiers.host_holds(block, tag), "host block {block} lacks device tag {tag}");
    }
    assert!(!tiers.host_holds(12, 105), "an untouched host block changed");

    let h2d = rank.copy(Op::CopyHostToDevice, &[(63, 0), (10, 1), (11, 2), (0, 30)]);
    rank.send([&h2d]);
    assert_eq!(rank.completions(1), vec![ok(&h2d.0)]);
    for (block, tag) in [(0, 105), (1, 103), (2, 104), (30, 131)] {
        assert!(tiers.device_holds(block, tag), "device block {block} lacks host tag {tag}");
    }
    assert!(tiers.device_holds(3, 103), "a source block changed");

    let block_bytes = config().block_bytes();
    assert_eq!(segment.counters().get(Counter::WorkerCopyBytes), 8 * block_bytes);
    assert!(segment.counters().get(Counter::WorkerCopyNs) > 0);
    drop(worker);
}

#[test]
fn every_bad_command_gets_its_error_and_the_worker_keeps_serving() {
    let name = unique_name("bad");
    let segment = Segment::create(&name, &config()).unwrap();
    let tiers = Tiers::open(&segment, 0);
    let mut rank = Rank::new(&segment, 0);
    let mut worker = spawn_worker(&name, 0, &[], &[]);
    for block in 0..3 {
        tiers.fill_device(block, 500 + block);
    }
    for block in 1..3 {
        tiers.fill_host(block, 600 + block);
    }

    let stale = rank.copy(Op::CopyDeviceToHost, &[(0, 0)]);
    segment.bump_generation();
    let mut unknown_op = rank.ping();
    unknown_op.0.op = 99;
    let source_out = rank.copy(Op::CopyDeviceToHost, &[(1, 1), (32, 2)]);
    let destination_out = rank.copy(Op::CopyHostToDevice, &[(1, 1), (2, 40)]);
    let duplicate = rank.copy(Op::CopyDeviceToHost, &[(0, 5), (1, 6), (2, 5)]);
    let mut bad_flags = rank.ping();
    bad_flags.0 = bad_flags.0.with_flags(FLAG_LAYERWISE | 0x80);
    let ping = rank.ping();
    tiers.fill_device(7, 77);
    let good = rank.copy(Op::CopyDeviceToHost, &[(7, 9)]);
    rank.send([
        &stale,
        &unknown_op,
        &source_out,
        &destination_out,
        &duplicate,
        &bad_flags,
        &ping,
        &good,
    ]);

    assert_eq!(
        rank.completions(8),
        vec![
            failed(&stale.0, CommandError::StaleGeneration, stale.0.generation),
            failed(&unknown_op.0, CommandError::UnknownOp, 99),
            failed(&source_out.0, CommandError::SourceOutOfRange, 32),
            failed(&destination_out.0, CommandError::DestinationOutOfRange, 40),
            failed(&duplicate.0, CommandError::Malformed, 5),
            failed(&bad_flags.0, CommandError::Malformed, 0x80),
            ok(&ping.0),
            ok(&good.0),
        ]
    );
    assert!(tiers.host_holds(9, 77));
    let untouched = !tiers.host_holds(0, 500)
        && tiers.host_holds(1, 601)
        && tiers.device_holds(1, 501)
        && !tiers.host_holds(5, 500)
        && !tiers.host_holds(5, 502)
        && !tiers.host_holds(6, 501);
    assert!(untouched, "a refused copy wrote");
    assert!(worker.is_running());
}

#[test]
fn ping_and_flush_complete_in_order_even_around_commands_split_across_batches() {
    let name = unique_name("flush");
    let segment = Segment::create(&name, &config()).unwrap();
    let tiers = Tiers::open(&segment, 0);
    let mut rank = Rank::new(&segment, 0);
    let _worker = spawn_worker(&name, 0, &[], &[]);
    for block in 0..32 {
        tiers.fill_device(block, 1000 + block);
    }

    // 60 one-slot pings, then a 32-pair copy (5 slots) that straddles the worker's 64-slot batch,
    // then a flush and a last ping.
    let mut commands: Vec<_> = (0..60).map(|_| rank.ping()).collect();
    let pairs: Vec<(u32, u32)> = (0..32).map(|block| (block, 63 - block)).collect();
    commands.push(rank.copy(Op::CopyDeviceToHost, &pairs));
    commands.push((rank.header(Op::Flush, 0), Vec::new()));
    commands.push(rank.ping());
    rank.send(&commands);

    let expected: Vec<Completion> = commands.iter().map(|(header, _)| ok(header)).collect();
    assert_eq!(rank.completions(expected.len()), expected);
    assert!((0..32).all(|block| tiers.host_holds(63 - block, 1000 + block)));
}

#[test]
fn a_layerwise_copy_publishes_its_progress_layer_by_layer() {
    let name = unique_name("layers");
    let config = SegmentConfig { layers: 4, regions: 8, ..config() };
    let segment = Segment::create(&name, &config).unwrap();
    let mut rank = Rank::new(&segment, 0);
    let _worker = spawn_worker(&name, 0, &[], &[(LAYER_DELAY_ENV, "20000")]);
    let progress = segment.layer_progress(0).unwrap();

    let plain = rank.copy(Op::CopyHostToDevice, &[(1, 1)]);
    let mut layerwise = rank.copy(Op::CopyHostToDevice, &[(2, 2), (3, 3)]);
    layerwise.0 = layerwise.0.with_flags(FLAG_LAYERWISE);
    rank.send([&plain, &layerwise]);

    let id = layerwise.0.command_id;
    let mut seen = Vec::new();
    let deadline = Instant::now() + PATIENCE;
    let completions = loop {
        if let Some(layers) = progress.layers_done(id) {
            if seen.last() != Some(&layers) {
                seen.push(layers);
            }
        }
        if rank.waiting_completions() == 2 {
            break rank.completions(2);
        }
        assert!(Instant::now() < deadline, "the copies never completed");
        std::thread::sleep(Duration::from_micros(500));
    };
    assert_eq!(completions, vec![ok(&plain.0), ok(&layerwise.0)]);
    assert_eq!(progress.layers_done(id), Some(4));
    assert_eq!(progress.layers_done(plain.0.command_id), None, "a plain copy published progress");
    println!("layer progress seen while copying: {seen:?}");
    assert!(seen.windows(2).all(|pair| pair[0] < pair[1]), "progress went backwards: {seen:?}");
    assert!(seen.iter().any(|&layers| layers < 4), "no progress was seen before the end");
}

#[test]
fn a_worker_exits_soon_after_the_segment_creator_dies() {
    if let Ok(name) = std::env::var(CREATOR_ENV) {
        play_creator(&name);
        return;
    }
    let name = unique_name("orphan");
    let (mut creator, segment) =
        spawn_creator("a_worker_exits_soon_after_the_segment_creator_dies", &name);
    let mut worker = spawn_worker(&name, 0, &[], &[]);
    Rank::new(&segment, 0).wait_alive(worker.pid());

    creator.kill().unwrap();
    let killed = Instant::now();
    let (status, stderr) = worker.wait_exit_within(Duration::from_secs(5));
    println!("worker exited {:?} after its scheduler was killed", killed.elapsed());
    creator.wait().unwrap();
    listing::unlink(&name).unwrap();
    assert!(status.success(), "worker failed: {stderr}");
    assert!(stderr.contains("scheduler"), "no word about the scheduler: {stderr}");
}

/// The creator's role in a re-executed test binary: create the segment, then wait to be killed.
fn play_creator(name: &str) {
    play_creator_of(name, &config());
}

fn play_creator_of(name: &str, config: &SegmentConfig) {
    let name = SegmentName::new(name).unwrap();
    let _segment = Segment::create(&name, config).unwrap();
    std::thread::sleep(PATIENCE * 3);
}

/// Runs test `test` of this binary again as the creator of segment `name`.
fn spawn_creator(test: &str, name: &SegmentName) -> (Child, Segment) {
    let creator = rerun_test(module_path!(), test)
        .env(CREATOR_ENV, name.as_str())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + PATIENCE;
    let segment = loop {
        match Segment::attach(name) {
            Ok(segment) => break segment,
            Err(error) => assert!(Instant::now() < deadline, "creator never made it: {error}"),
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    (creator, segment)
}

#[test]
fn a_worker_in_the_middle_of_a_long_copy_exits_once_its_scheduler_dies() {
    // Blocks of 4 regions of 128 KiB over 2 layers: a copy of 32 blocks moves 16 MiB.
    let large = SegmentConfig {
        tp_size: 1,
        device_blocks: 32,
        host_blocks: 32,
        region_bytes: 128 * 1024,
        ..config()
    };
    if let Ok(name) = std::env::var(CREATOR_ENV) {
        play_creator_of(&name, &large);
        return;
    }
    let name = unique_name("orphan-copy");
    let (mut creator, segment) =
        spawn_creator("a_worker_in_the_middle_of_a_long_copy_exits_once_its_scheduler_dies", &name);
    // At 1 MiB/s the copy runs for 16 s, longer than the test waits for the worker to exit; it
    // reports progress every 256 KiB, a quarter of a second.
    let mut worker = spawn_worker(&name, 0, &[], &[(COPY_RATE_ENV, "1048576")]);
    let mut rank = Rank::new(&segment, 0);
    rank.wait_alive(worker.pid());
    let pairs: Vec<(u32, u32)> = (0..32).map(|block| (block, block)).collect();
    let mut copy = rank.copy(Op::CopyDeviceToHost, &pairs);
    copy.0 = copy.0.with_flags(FLAG_LAYERWISE);
    let id = copy.0.command_id;
    rank.send([&copy]);
    let progress = segment.layer_progress(0).unwrap();
    let deadline = Instant::now() + PATIENCE;
    while progress.layers_done(id).is_none() {
        assert!(Instant::now() < deadline, "the copy never started");
        std::thread::sleep(Duration::from_millis(1));
    }

    creator.kill().unwrap();
    let killed = Instant::now();
    let (status, stderr) = worker.wait_exit_within(PATIENCE);
    println!("worker exited {:?} after its scheduler was killed mid-copy", killed.elapsed());
    creator.wait().unwrap();
    listing::unlink(&name).unwrap();
    assert!(status.success(), "worker failed: {stderr}");
    assert!(stderr.contains("scheduler"), "no word about the scheduler: {stderr}");
    assert_eq!(rank.waiting_completions(), 0, "nobody was left to answer");
}

#[test]
fn sigterm_stops_a_worker_cleanly_and_frees_its_rank() {
    let name = unique_name("term");
    let segment = Segment::create(&name, &config()).unwrap();
    let mut rank = Rank::new(&segment, 1);
    let mut worker = spawn_worker(&name, 1, &[], &[]);
    let ping = rank.ping();
    rank.send([&ping]);
    assert_eq!(rank.completions(1), vec![ok(&ping.0)]);

    worker.signal(Signal::SIGTERM);
    let (status, stderr) = worker.wait_exit_within(PATIENCE);
    assert!(status.success(), "worker failed on SIGTERM: {stderr}");
    assert_eq!(segment.rank_status(1).unwrap(), RankStatus::Empty);
    let claim = segment.claim_rank(1).expect("the rank is claimable after a clean exit");
    drop(claim);

    // A successor takes over the rings where the first worker left them.
    let _successor = spawn_worker(&name, 1, &[], &[]);
    let ping = rank.ping();
    rank.send([&ping]);
    assert_eq!(rank.completions(1), vec![ok(&ping.0)]);
}

#[test]
fn a_worker_stopped_while_its_answers_wait_for_room_leaves_its_rank_to_be_reclaimed() {
    let name = unique_name("term-unanswered");
    let segment = Segment::create(&name, &config()).unwrap();
    let mut rank = Rank::new(&segment, 1);
    let mut worker = spawn_worker(&name, 1, &[], &[]);
    // More commands than the completion ring holds, never reaped: a misbehaving scheduler. The
    // worker answers until the ring is full, then waits for room with the rest unpushed.
    let room = config().completion_ring_slots as usize;
    let pings: Vec<_> = (0..room + 8).map(|_| rank.ping()).collect();
    rank.send(&pings);
    let deadline = Instant::now() + PATIENCE;
    while rank.waiting_completions() < room {
        assert!(Instant::now() < deadline, "the worker never filled its completion ring");
        std::thread::sleep(Duration::from_millis(2));
    }

    worker.signal(Signal::SIGTERM);
    let (status, stderr) = worker.wait_exit_within(PATIENCE);
    assert!(!status.success(), "a stop with unanswered commands passed for a clean exit: {stderr}");
    assert!(stderr.contains("no room"), "{stderr}");
    // The slot still names the exited worker: the rank must be reclaimed (its rings reset), not
    // taken over as it is by a successor.
    assert_eq!(segment.rank_status(1).unwrap(), RankStatus::Dead { pid: worker.pid() });
    assert!(matches!(segment.claim_rank(1), Err(ClaimError::NotReclaimed { .. })));
}

/// A worker that cannot take its rank's ring ends (their descriptions were written over) exits
/// without releasing the rank: the scheduler reclaims it and resets the rings, and the next
/// worker serves. Released, the rank would go to every next worker with the same broken rings.
#[test]
fn a_worker_whose_rings_were_written_over_leaves_its_rank_to_be_reclaimed_and_reset() {
    use std::os::unix::fs::FileExt;

    let name = unique_name("ring-scribbled");
    let segment = Segment::create(&name, &config()).unwrap();
    let object = format!("{}{}", listing::SHM_DIR, name.control_object());
    let control = std::fs::OpenOptions::new().write(true).open(object).unwrap();
    let layout = segment.layout();
    // A ring's description: magic, element size, capacity, one 8-byte word each.
    let capacity_at = layout.rank_area(1) as u64 + layout.offsets.command_ring + 16;
    control.write_all_at(&1u64.to_ne_bytes(), capacity_at).unwrap();

    let mut broken = spawn_worker(&name, 1, &[], &[]);
    let (status, stderr) = broken.wait_exit_within(PATIENCE);
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("capacity"), "{stderr}");
    let verdict = segment.rank_verdict(1).unwrap();
    assert_eq!(verdict.status, RankStatus::Dead { pid: broken.pid() }, "{stderr}");

    segment.reclaim_rank(1, verdict.word).unwrap();
    let mut rank = Rank::new(&segment, 1);
    let worker = spawn_worker(&name, 1, &[], &[]);
    rank.wait_alive(worker.pid());
    let ping = rank.ping();
    rank.send([&ping]);
    assert_eq!(rank.completions(1), vec![ok(&ping.0)]);
}

#[test]
fn a_second_worker_for_a_rank_held_by_a_live_worker_is_refused() {
    let name = unique_name("twice");
    let segment = Segment::create(&name, &config()).unwrap();
    let mut rank = Rank::new(&segment, 0);
    let first = spawn_worker(&name, 0, &[], &[]);
    rank.wait_alive(first.pid());

    let mut second = spawn_worker(&name, 0, &["--attach-timeout", "0.5"], &[]);
    let (status, stderr) = second.wait_exit_within(PATIENCE);
    assert!(!status.success());
    assert!(
        stderr.contains(&format!("rank 0 of segment {name}"))
            && stderr.contains(&format!("live worker pid {}", first.pid())),
        "unclear refusal: {stderr}"
    );
    let ping = rank.ping();
    rank.send([&ping]);
    assert_eq!(rank.completions(1), vec![ok(&ping.0)], "the first worker was disturbed");
}

#[test]
fn a_worker_started_before_its_segment_waits_for_it() {
    let name = unique_name("early");
    let worker = spawn_worker(&name, 0, &[], &[]);
    std::thread::sleep(Duration::from_millis(50));
    let segment = Segment::create(&name, &config()).unwrap();
    let mut rank = Rank::new(&segment, 0);
    rank.wait_alive(worker.pid());
    let ping = rank.ping();
    rank.send([&ping]);
    assert_eq!(rank.completions(1), vec![ok(&ping.0)]);
}

#[test]
fn a_missing_segment_is_reported_once_the_attach_timeout_passes() {
    let name = unique_name("never");
    let mut worker = spawn_worker(&name, 0, &["--attach-timeout", "0.2"], &[]);
    let (status, stderr) = worker.wait_exit_within(PATIENCE);
    assert!(!status.success());
    assert!(stderr.contains("does not exist"), "unclear error: {stderr}");
}

#[test]
fn a_command_whose_pair_slots_never_arrive_is_malformed_and_stops_the_worker() {
    let name = unique_name("torn");
    let segment = Segment::create(&name, &config()).unwrap();
    let mut rank = Rank::new(&segment, 0);
    let mut worker = spawn_worker(&name, 0, &[], &[]);
    let ping = rank.ping();
    // Announces 20 pairs (3 pair slots) but only one pair slot is published behind it.
    let torn = rank.header(Op::CopyDeviceToHost, 20);
    rank.send_slots(&[
        CommandSlot::from_header(&ping.0),
        CommandSlot::from_header(&torn),
        CommandSlot::default(),
    ]);
    assert_eq!(rank.completions(2), vec![ok(&ping.0), failed(&torn, CommandError::Malformed, 20)]);
    let (status, stderr) = worker.wait_exit_within(PATIENCE);
    assert!(!status.success());
    assert!(stderr.contains("out of step"), "unclear error: {stderr}");
    // The rank stays blocked until the scheduler resets its out-of-step rings.
    let verdict = segment.rank_verdict(0).unwrap();
    assert_eq!(verdict.status, RankStatus::Dead { pid: worker.pid() });
    assert!(matches!(segment.claim_rank(0), Err(ClaimError::NotReclaimed { .. })));
    segment.reclaim_rank(0, verdict.word).unwrap();
    assert!(segment.claim_rank(0).is_ok());
}

#[test]
fn a_worker_killed_in_the_middle_of_a_copy_leaves_a_dead_rank_that_a_new_worker_serves() {
    let name = unique_name("killed");
    let segment = Segment::create(&name, &config()).unwrap();
    let mut rank = Rank::new(&segment, 0);
    let mut slow = spawn_worker(&name, 0, &[], &[(LAYER_DELAY_ENV, "200000")]);
    let mut copy = rank.copy(Op::CopyHostToDevice, &[(0, 0)]);
    copy.0 = copy.0.with_flags(FLAG_LAYERWISE);
    let id = copy.0.command_id;
    rank.send([&copy]);
    let progress = segment.layer_progress(0).unwrap();
    let deadline = Instant::now() + PATIENCE;
    while progress.layers_done(id) != Some(1) {
        assert!(Instant::now() < deadline, "the first layer never landed");
        std::thread::sleep(Duration::from_millis(1));
    }
    slow.signal(Signal::SIGKILL);
    slow.wait_exit_within(PATIENCE);
    assert_eq!(rank.waiting_completions(), 0, "a killed copy completed");
    let verdict = segment.rank_verdict(0).unwrap();
    assert_eq!(verdict.status, RankStatus::Dead { pid: slow.pid() });

    segment.reclaim_rank(0, verdict.word).unwrap();
    let mut rank = rank.after_reclaim();
    let worker = spawn_worker(&name, 0, &[], &[]);
    rank.wait_alive(worker.pid());
    let ping = rank.ping();
    rank.send([&ping]);
    assert_eq!(rank.completions(1), vec![ok(&ping.0)]);
}

#[cfg(not(feature = "cuda"))]
#[test]
fn a_cuda_segment_needs_a_build_with_the_cuda_feature() {
    let name = unique_name("cuda");
    let segment = Segment::create(&name, &config().with_backend(Backend::Cuda)).unwrap();
    let mut worker = spawn_worker(&name, 0, &[], &[]);
    let (status, stderr) = worker.wait_exit_within(PATIENCE);
    assert!(!status.success());
    assert!(stderr.contains("built without the cuda feature"), "unclear error: {stderr}");
    assert_eq!(
        segment.rank_status(0).unwrap(),
        RankStatus::Empty,
        "the failed worker kept its rank"
    );
}

#[test]
fn a_host_worker_refuses_a_segment_of_another_backend() {
    let name = unique_name("mismatch");
    let _segment = Segment::create(&name, &config().with_backend(Backend::Cuda)).unwrap();
    let mut worker = spawn_worker(&name, 0, &["--backend", "host"], &[]);
    let (status, stderr) = worker.wait_exit_within(PATIENCE);
    assert!(!status.success());
    assert!(stderr.contains("uses the cuda backend"), "unclear error: {stderr}");
}

#[cfg(feature = "cuda")]
#[test]
fn a_cuda_worker_gives_up_when_the_engine_never_publishes_its_device_handles() {
    let name = unique_name("nohandles");
    let segment = Segment::create(&name, &config().with_backend(Backend::Cuda)).unwrap();
    let mut worker = spawn_worker(&name, 0, &["--handles-timeout", "0.2"], &[]);
    let (status, stderr) = worker.wait_exit_within(PATIENCE);
    assert!(!status.success());
    assert!(stderr.contains("has not published the device handles"), "unclear error: {stderr}");
    assert_eq!(
        segment.rank_status(0).unwrap(),
        RankStatus::Empty,
        "the failed worker kept its rank"
    );
}

#[test]
fn a_worker_facing_a_full_completion_ring_waits_for_room_and_drops_nothing() {
    let name = unique_name("full");
    let config = SegmentConfig { completion_ring_slots: 4, ..config() };
    let segment = Segment::create(&name, &config).unwrap();
    let mut rank = Rank::new(&segment, 0);
    let worker = spawn_worker(&name, 0, &[], &[]);
    // Twice as many commands as the completion ring holds: a scheduler breaking its credits.
    let pings: Vec<_> = (0..8).map(|_| rank.ping()).collect();
    rank.send(&pings);
    let deadline = Instant::now() + PATIENCE;
    while rank.waiting_completions() < 4 {
        assert!(Instant::now() < deadline, "the first completions never arrived");
        std::thread::sleep(Duration::from_millis(1));
    }
    // Stay away longer than the heartbeat timeout: the waiting worker must keep its rank.
    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(segment.rank_status(0).unwrap(), RankStatus::Alive { pid: worker.pid() });
    let expected: Vec<Completion> = pings.iter().map(|(header, _)| ok(header)).collect();
    assert_eq!(rank.completions(8), expected);
}
