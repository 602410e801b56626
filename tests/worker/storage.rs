//! `kvshm worker --storage …` as real processes, driven the way the scheduler will drive them:
//! STORE, LOAD and QUERY through the rings with per-block results, every rank's bytes checked;
//! a restarted worker finding its disk blocks; two services sharing one Redis; damaged records;
//! Redis going away and coming back; storage I/O that does not hold up copies; SIGKILL in the
//! middle of disk and Redis writes; a full disk.

use std::time::{Duration, Instant};

use kvshm::storage::disk_index::blocks_on_every_rank;
use kvshm::storage::BlockLayout;
use kvshm_ipc::config::SegmentConfig;
use kvshm_ipc::counters::Counter;
use kvshm_ipc::record::{CommandError, CommandSlot, Op};
use kvshm_ipc::segment::Segment;
use kvshm_ipc::storage_record::{
    storage_pair_count, tier_unreachable, StorageEntry, StorageResults, MAX_STORAGE_ENTRIES,
    NO_HOST_BLOCK,
};
use kvshm_ipc::worker_slot::RankStatus;

use crate::support::{
    block_hash, connect, entry, kill_after, redis_for_test, silent_redis, storage_config,
    unique_name, unique_namespace, RankDriver, RedisServer, Scratch, Worker,
};

fn disk_args(dir: &Scratch, extra: &[&str]) -> Vec<String> {
    let mut args = vec!["--storage".to_owned(), format!("disk:{}", dir.0.display())];
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn redis_args(url: &str, namespace: &str, extra: &[&str]) -> Vec<String> {
    let mut args = vec![
        "--storage".to_owned(),
        url.to_owned(),
        "--storage-namespace".to_owned(),
        namespace.to_owned(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// Results with the first `done` entries done and nothing failed.
fn all_done(entries: usize) -> StorageResults {
    StorageResults { done: ((1u64 << entries) - 1) as u32, failed: 0 }
}

/// Stores blocks `tags` from host blocks `0..` on every rank, then loads them into host blocks
/// `32..` and checks every byte on every rank.
fn store_then_load(ranks: &mut [RankDriver<'_>], tags: &[u64]) {
    let stores: Vec<StorageEntry> =
        tags.iter().enumerate().map(|(i, &t)| entry(t, i as u32)).collect();
    for rank in ranks.iter_mut() {
        for (i, &tag) in tags.iter().enumerate() {
            rank.fill_host(i as u32, tag);
        }
        assert_eq!(rank.storage(Op::StorageStore, &stores), all_done(tags.len()));
    }
    let loads: Vec<StorageEntry> =
        tags.iter().enumerate().map(|(i, &t)| entry(t, 32 + i as u32)).collect();
    for rank in ranks.iter_mut() {
        for i in 0..tags.len() {
            rank.clear_host(32 + i as u32);
        }
        assert_eq!(rank.storage(Op::StorageLoad, &loads), all_done(tags.len()));
        for (i, &tag) in tags.iter().enumerate() {
            assert!(
                rank.host_holds(32 + i as u32, tag),
                "rank {} host block {} lacks block {tag}",
                rank.rank,
                32 + i
            );
        }
    }
}

#[test]
fn blocks_go_to_disk_and_back_on_every_rank_with_per_block_results() {
    let dir = Scratch::new("ws-disk");
    let name = unique_name("disk");
    let segment = Segment::create(&name, &storage_config(2, false)).unwrap();
    let workers: Vec<Worker> =
        (0..2).map(|rank| Worker::spawn(&name, rank, &disk_args(&dir, &[]), &[], None)).collect();
    let mut ranks: Vec<RankDriver<'_>> =
        (0..2).map(|rank| RankDriver::new(&segment, rank)).collect();
    for (rank, worker) in ranks.iter().zip(&workers) {
        rank.wait_alive(worker);
    }
    let tags: Vec<u64> = (1..=MAX_STORAGE_ENTRIES as u64).collect();
    store_then_load(&mut ranks, &tags);

    // A load of present and absent blocks: per-block bits, absent is a miss, not a failure.
    let mixed = [entry(3, 40), entry(1000, 41), entry(5, 42)];
    for rank in &mut ranks {
        let results = rank.storage(Op::StorageLoad, &mixed);
        assert_eq!(results, StorageResults { done: 0b101, failed: 0 });
        assert!(rank.host_holds(40, 3) && rank.host_holds(42, 5));
        let query = [
            StorageEntry::new(block_hash(7), 0, 7, NO_HOST_BLOCK),
            StorageEntry::new(block_hash(999), 0, 9, NO_HOST_BLOCK),
        ];
        assert_eq!(
            rank.storage(Op::StorageQuery, &query),
            StorageResults { done: 0b01, failed: 0 }
        );
        // FORGET frees the slot: the block is absent afterwards (an absent one is forgotten too).
        let forget = [
            StorageEntry::new(block_hash(7), 0, 0, NO_HOST_BLOCK),
            StorageEntry::new(block_hash(999), 0, 0, NO_HOST_BLOCK),
        ];
        assert_eq!(
            rank.storage(Op::StorageForget, &forget),
            StorageResults { done: 0b11, failed: 0 }
        );
        assert_eq!(
            rank.storage(Op::StorageQuery, &query[..1]),
            StorageResults { done: 0, failed: 0 }
        );
    }
    let counters = segment.counters();
    let n = tags.len() as u64;
    assert_eq!(counters.get(Counter::StorageStoredBlocks), 2 * n);
    assert_eq!(counters.get(Counter::StorageLoadHits), 2 * (n + 2));
    assert_eq!(counters.get(Counter::StorageLoadMisses), 2);
    assert_eq!(counters.get(Counter::StorageQueryBlocks), 6);
    assert_eq!(counters.get(Counter::StorageForgottenBlocks), 4);
    assert_eq!(counters.get(Counter::StorageBytesWritten), 2 * n * 4096);
    assert_eq!(
        counters.get(Counter::StorageErrors) + counters.get(Counter::StorageCorruptBlocks),
        0
    );
    drop(workers);
}

#[test]
fn a_restarted_worker_finds_its_disk_blocks_and_the_index_rebuilds_their_chain() {
    let dir = Scratch::new("ws-restart");
    let name = unique_name("restart");
    let config = storage_config(2, true);
    let segment = Segment::create(&name, &config).unwrap();
    let args = disk_args(&dir, &["--storage-blocks", "100"]);
    let mut workers: Vec<Worker> =
        (0..2).map(|rank| Worker::spawn(&name, rank, &args, &[], None)).collect();
    let mut ranks: Vec<RankDriver<'_>> =
        (0..2).map(|rank| RankDriver::new(&segment, rank)).collect();
    for (rank, worker) in ranks.iter().zip(&workers) {
        rank.wait_alive(worker);
    }
    let tags: Vec<u64> = (1..=10).collect();
    store_then_load(&mut ranks, &tags);
    for worker in &mut workers {
        worker.stop();
    }
    drop(workers);

    // What a restarted scheduler reads: the blocks every rank holds, parents before children.
    let layout = BlockLayout::new(config.block_bytes(), config.regions, config.tp_size).unwrap();
    let listed = blocks_on_every_rank(&dir.0.join("default"), &layout).unwrap();
    let depths: Vec<u32> = listed.iter().map(|b| b.depth).collect();
    assert_eq!(depths, (1..=10).collect::<Vec<u32>>());
    assert!(listed.iter().all(|b| b.parent.0 == block_hash(u64::from(b.depth) - 1)));

    let workers: Vec<Worker> =
        (0..2).map(|rank| Worker::spawn(&name, rank, &args, &[], None)).collect();
    for (rank, worker) in ranks.iter().zip(&workers) {
        rank.wait_alive(worker);
    }
    let loads: Vec<StorageEntry> = tags.iter().map(|&t| entry(t, 50 + t as u32)).collect();
    for rank in &mut ranks {
        for &t in &tags {
            rank.clear_host(50 + t as u32);
        }
        assert_eq!(rank.storage(Op::StorageLoad, &loads), all_done(tags.len()));
        assert!(tags.iter().all(|&t| rank.host_holds(50 + t as u32, t)));
    }
    drop(workers);
}

#[test]
fn storage_commands_are_validated_and_a_worker_without_storage_refuses_them() {
    let name = unique_name("refuse");
    let segment = Segment::create(&name, &storage_config(1, false)).unwrap();
    let worker = Worker::spawn(&name, 0, &[], &[], None);
    let mut rank = RankDriver::new(&segment, 0);
    rank.wait_alive(&worker);
    let header = rank.send_storage(Op::StorageLoad, &[entry(1, 0)]);
    let completion = rank.completions(1)[0];
    assert_eq!(completion.error, CommandError::NoStorage as u32, "{completion:?}");
    assert_eq!(completion.command_id, header.command_id);
    drop(worker);

    let dir = Scratch::new("ws-refuse");
    let name = unique_name("refuse2");
    let segment = Segment::create(&name, &storage_config(1, false)).unwrap();
    let worker = Worker::spawn(&name, 0, &disk_args(&dir, &[]), &[], None);
    let mut rank = RankDriver::new(&segment, 0);
    rank.wait_alive(&worker);
    // Out of range, loaded twice, a query naming a host block: refused with the offending value;
    // the worker goes on serving.
    let bad = [
        (Op::StorageStore, vec![entry(1, 64)], CommandError::SourceOutOfRange, 64),
        (Op::StorageLoad, vec![entry(1, 3), entry(2, 3)], CommandError::Malformed, 3),
        (Op::StorageQuery, vec![entry(1, 3)], CommandError::Malformed, 0),
    ];
    for (op, entries, error, detail) in bad {
        rank.send_storage(op, &entries);
        let completion = rank.completions(1)[0];
        assert_eq!((completion.error, completion.detail), (error as u32, detail), "{op:?}");
    }
    rank.fill_host(0, 77);
    assert_eq!(rank.storage(Op::StorageStore, &[entry(77, 0)]), all_done(1));
}

#[test]
fn a_damaged_disk_record_is_a_counted_miss_for_that_block_only() {
    let dir = Scratch::new("ws-corrupt");
    let name = unique_name("corrupt");
    let segment = Segment::create(&name, &storage_config(1, false)).unwrap();
    let args = disk_args(&dir, &["--storage-blocks", "8"]);
    let mut worker = Worker::spawn(&name, 0, &args, &[], None);
    let mut rank = RankDriver::new(&segment, 0);
    rank.wait_alive(&worker);
    for (block, tag) in [(0, 1), (1, 2), (2, 3)] {
        rank.fill_host(block, tag);
    }
    assert_eq!(
        rank.storage(Op::StorageStore, &[entry(1, 0), entry(2, 1), entry(3, 2)]),
        all_done(3)
    );
    worker.stop();
    // Slots fill front to back: block 2 is in slot 1. Flip one byte of it.
    let slab = dir.0.join("default").join("rank-0.slab");
    let mut bytes = std::fs::read(&slab).unwrap();
    bytes[4096 + 123] ^= 0x40;
    std::fs::write(&slab, &bytes).unwrap();

    let worker = Worker::spawn(&name, 0, &args, &[], None);
    rank.wait_alive(&worker);
    let results = rank.storage(Op::StorageLoad, &[entry(1, 10), entry(2, 11), entry(3, 12)]);
    assert_eq!(results, StorageResults { done: 0b101, failed: 0 });
    assert!(rank.host_holds(10, 1) && rank.host_holds(12, 3));
    assert_eq!(segment.counters().get(Counter::StorageCorruptBlocks), 1);
    drop(worker);
}

#[test]
fn two_services_on_one_redis_load_each_others_blocks() {
    let redis = redis_for_test();
    let namespace = unique_namespace("services");
    let config = storage_config(2, false);
    let (first_name, second_name) = (unique_name("svc-a"), unique_name("svc-b"));
    let first = Segment::create(&first_name, &config).unwrap();
    let second = Segment::create(&second_name, &config).unwrap();
    let args = redis_args(&redis.url(), &namespace, &[]);
    let mut workers = Vec::new();
    for (name, segment) in [(&first_name, &first), (&second_name, &second)] {
        for rank in 0..2 {
            let worker = Worker::spawn(name, rank, &args, &[], None);
            RankDriver::new(segment, rank).wait_alive(&worker);
            workers.push(worker);
        }
    }
    let tags: Vec<u64> = (1..=12).collect();
    let mut writers: Vec<RankDriver<'_>> =
        (0..2).map(|rank| RankDriver::new(&first, rank)).collect();
    let stores: Vec<StorageEntry> = tags.iter().map(|&t| entry(t, t as u32)).collect();
    for rank in &mut writers {
        for &t in &tags {
            rank.fill_host(t as u32, t);
        }
        assert_eq!(rank.storage(Op::StorageStore, &stores), all_done(tags.len()));
    }
    // The other service never wrote these blocks: it asks, then loads them.
    let mut readers: Vec<RankDriver<'_>> =
        (0..2).map(|rank| RankDriver::new(&second, rank)).collect();
    let queries: Vec<StorageEntry> = tags
        .iter()
        .map(|&t| StorageEntry::new(block_hash(t), 0, t as u32, NO_HOST_BLOCK))
        .collect();
    let loads: Vec<StorageEntry> = tags.iter().map(|&t| entry(t, 40 + t as u32)).collect();
    for rank in &mut readers {
        assert_eq!(rank.storage(Op::StorageQuery, &queries), all_done(tags.len()));
        assert_eq!(rank.storage(Op::StorageLoad, &loads), all_done(tags.len()));
        assert!(tags.iter().all(|&t| rank.host_holds(40 + t as u32, t)), "rank {}", rank.rank);
        // A FORGET leaves a shared tier's values alone: the first service may count them.
        assert_eq!(rank.storage(Op::StorageForget, &queries), all_done(tags.len()));
        assert_eq!(rank.storage(Op::StorageQuery, &queries), all_done(tags.len()));
    }
    assert_eq!(second.counters().get(Counter::StorageLoadHits), 2 * tags.len() as u64);
    drop(workers);
}

#[test]
fn a_damaged_redis_value_is_a_miss_for_that_block() {
    let redis = redis_for_test();
    let namespace = unique_namespace("wcorrupt");
    let name = unique_name("rcorrupt");
    let config = storage_config(1, false);
    let segment = Segment::create(&name, &config).unwrap();
    let worker = Worker::spawn(&name, 0, &redis_args(&redis.url(), &namespace, &[]), &[], None);
    let mut rank = RankDriver::new(&segment, 0);
    rank.wait_alive(&worker);
    rank.fill_host(0, 1);
    rank.fill_host(1, 2);
    assert_eq!(rank.storage(Op::StorageStore, &[entry(1, 0), entry(2, 1)]), all_done(2));
    let key = format!("kvshm:{namespace}:tp1-r4x1024:{:032x}:0", block_hash(2));
    let mut raw = connect(&redis.url());
    let _: i64 =
        redis::cmd("SETRANGE").arg(&key).arg(80 + 17).arg(&b"!"[..]).query(&mut raw).unwrap();
    let results = rank.storage(Op::StorageLoad, &[entry(1, 10), entry(2, 11)]);
    assert_eq!(results, StorageResults { done: 0b01, failed: 0 });
    assert_eq!(segment.counters().get(Counter::StorageCorruptBlocks), 1);
    drop(worker);
}

#[test]
fn redis_stopped_mid_run_gives_counted_misses_and_the_worker_recovers_when_it_returns() {
    let mut server = RedisServer::start();
    let name = unique_name("away");
    let segment = Segment::create(&name, &storage_config(1, false)).unwrap();
    let args = redis_args(&server.url(), &unique_namespace("away"), &["--storage-timeout", "2"]);
    let worker = Worker::spawn(&name, 0, &args, &[], None);
    let mut rank = RankDriver::new(&segment, 0);
    rank.wait_alive(&worker);
    rank.fill_host(0, 1);
    assert_eq!(rank.storage(Op::StorageStore, &[entry(1, 0)]), all_done(1));

    server.kill();
    // A failed tier, not an absent block, and one the worker could not reach.
    for (op, entries) in [(Op::StorageLoad, [entry(1, 5)]), (Op::StorageStore, [entry(1, 0)])] {
        let answer = rank.storage_completion(op, &entries);
        assert!(tier_unreachable(&answer), "{op:?}: {answer:?}");
        assert_eq!(
            StorageResults::from_detail(answer.detail),
            StorageResults { done: 0, failed: 1 }
        );
    }
    let counters = segment.counters();
    assert!(
        counters.get(Counter::StorageUnavailable) + counters.get(Counter::StorageTimeouts) >= 2
    );
    // Copies go on meanwhile.
    rank.send_copy(Op::Ping, &[]);
    assert!(rank.completions(1)[0].is_ok());

    server.restart();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if rank.storage(Op::StorageStore, &[entry(1, 0)]) == all_done(1) {
            break;
        }
        assert!(Instant::now() < deadline, "the worker never reconnected");
        std::thread::sleep(Duration::from_millis(100));
    }
    rank.clear_host(5);
    assert_eq!(rank.storage(Op::StorageLoad, &[entry(1, 5)]), all_done(1));
    assert!(rank.host_holds(5, 1));
    drop(worker);
}

#[test]
fn a_slow_storage_tier_does_not_hold_up_copies_and_a_flush_waits_for_it() {
    // A "Redis" that accepts connections and never answers: every storage command waits for
    // the worker's timeout.
    let url = silent_redis();
    let name = unique_name("slow");
    let segment = Segment::create(&name, &storage_config(1, false)).unwrap();
    let args = redis_args(&url, "slow", &["--storage-timeout", "3", "--storage-connections", "1"]);
    let worker = Worker::spawn(&name, 0, &args, &[], None);
    let mut rank = RankDriver::new(&segment, 0);
    rank.wait_alive(&worker);

    let load = rank.send_storage(Op::StorageLoad, &[entry(1, 0)]);
    let copy = rank.send_copy(Op::CopyDeviceToHost, &[(0, 9)]);
    let flush = rank.send_copy(Op::Flush, &[]);
    let sent = Instant::now();
    let first = rank.completions(1)[0];
    let first_after = sent.elapsed();
    assert_eq!(first.command_id, copy.command_id, "the copy waited for the storage command");
    let rest = rank.completions(2);
    let rest_after = sent.elapsed();
    assert_eq!(rest[0].command_id, load.command_id);
    assert!(tier_unreachable(&rest[0]), "timed out: {:?}", rest[0]);
    assert_eq!(StorageResults::from_detail(rest[0].detail), StorageResults { done: 0, failed: 1 });
    assert_eq!(rest[1].command_id, flush.command_id, "the flush did not wait for the load");
    let counters = segment.counters();
    assert!(
        counters.get(Counter::StorageTimeouts) + counters.get(Counter::StorageUnavailable) >= 1
    );
    println!("copy answered after {first_after:?}, the timed-out load after {rest_after:?}");
    drop(worker);
}

/// Stores `tags` in batches of 8 through a worker, one batch at a time, until it dies; returns
/// how many batches were answered.
fn store_until_killed(rank: &mut RankDriver<'_>, tags: &[u64]) -> usize {
    let alive = |rank: &RankDriver<'_>| {
        matches!(rank.segment.rank_status(rank.rank).unwrap(), RankStatus::Alive { .. })
    };
    let mut answered = 0;
    for batch in tags.chunks(8) {
        if !alive(rank) {
            break;
        }
        let entries: Vec<StorageEntry> =
            batch.iter().enumerate().map(|(i, &t)| entry(t, i as u32)).collect();
        for (i, &t) in batch.iter().enumerate() {
            rank.fill_host(i as u32, t);
        }
        rank.send_storage(Op::StorageStore, &entries);
        let mut got = Vec::new();
        while !rank.try_completions(&mut got) {
            if !alive(rank) {
                return answered;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        answered += 1;
    }
    answered
}

/// After a writer died: every block either loads with exactly its bytes or misses.
fn check_no_wrong_bytes(rank: &mut RankDriver<'_>, tags: &[u64]) -> usize {
    let mut hits = 0;
    for chunk in tags.chunks(MAX_STORAGE_ENTRIES) {
        let loads: Vec<StorageEntry> =
            chunk.iter().enumerate().map(|(i, &t)| entry(t, 32 + i as u32)).collect();
        for i in 0..chunk.len() {
            rank.clear_host(32 + i as u32);
        }
        let results = rank.storage(Op::StorageLoad, &loads);
        assert_eq!(results.failed, 0);
        for (i, &t) in chunk.iter().enumerate() {
            if results.is_done(i) {
                assert!(rank.host_holds(32 + i as u32, t), "block {t} loaded with wrong bytes");
                hits += 1;
            }
        }
    }
    hits
}

#[test]
fn a_worker_killed_in_the_middle_of_disk_writes_never_serves_wrong_bytes_afterwards() {
    let dir = Scratch::new("ws-kill-disk");
    let name = unique_name("killdisk");
    let segment = Segment::create(&name, &storage_config(1, false)).unwrap();
    // A small slab, so that later writes reuse the slots of earlier blocks.
    let args = disk_args(&dir, &["--storage-blocks", "24"]);
    let mut rank = RankDriver::new(&segment, 0);
    let tags: Vec<u64> = (1..=64).collect();
    // Deterministic kills at each step of the 30th block write (a reused slot), then a kill from
    // outside at an arbitrary moment.
    let hooks = ["after-invalidate@30", "mid-payload@30", "before-record@30", "mid-payload@45"];
    for hook in hooks.iter().map(Some).chain([None]) {
        let env: Vec<(&str, String)> =
            hook.map(|h| vec![("KVSHM_STORAGE_CRASH", h.to_string())]).unwrap_or_default();
        let mut worker = Worker::spawn(&name, 0, &args, &env, None);
        rank.wait_alive(&worker);
        if hook.is_some() {
            store_until_killed(&mut rank, &tags);
            let (status, _) = worker.wait_exit();
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(status.signal(), Some(libc::SIGKILL), "{hook:?}: {status:?}");
        } else {
            let killer = kill_after(worker.pid(), Duration::from_millis(3));
            store_until_killed(&mut rank, &tags);
            killer.join().unwrap();
            worker.kill_hard();
        }
        rank.reclaim_after_kill();
        rank = RankDriver::new(&segment, 0);
        let checker = Worker::spawn(&name, 0, &args, &[], None);
        rank.wait_alive(&checker);
        let hits = check_no_wrong_bytes(&mut rank, &tags);
        println!("{hook:?}: {hits} blocks readable afterwards, all with their bytes");
        if hook.is_some() {
            // Two whole batches of 8 survive: the slab holds three, and the batch being written
            // had emptied the oldest one's slots.
            assert!(hits >= 16, "{hook:?}: only {hits} blocks survived");
        }
        assert_eq!(segment.counters().get(Counter::StorageCorruptBlocks), 0, "{hook:?}");
        drop(checker);
        rank.reclaim_after_kill();
        rank = RankDriver::new(&segment, 0);
    }
}

#[test]
fn a_worker_killed_in_the_middle_of_redis_writes_never_serves_wrong_bytes_afterwards() {
    let redis = redis_for_test();
    let name = unique_name("killredis");
    let segment = Segment::create(&name, &storage_config(1, false)).unwrap();
    let args = redis_args(&redis.url(), &unique_namespace("kill"), &[]);
    let mut rank = RankDriver::new(&segment, 0);
    let tags: Vec<u64> = (1..=400).collect();
    let mut worker = Worker::spawn(&name, 0, &args, &[], None);
    rank.wait_alive(&worker);
    let killer = kill_after(worker.pid(), Duration::from_millis(20));
    let answered = store_until_killed(&mut rank, &tags);
    killer.join().unwrap();
    worker.kill_hard();
    rank.reclaim_after_kill();
    let mut rank = RankDriver::new(&segment, 0);
    let checker = Worker::spawn(&name, 0, &args, &[], None);
    rank.wait_alive(&checker);
    let hits = check_no_wrong_bytes(&mut rank, &tags);
    println!(
        "{answered} batches answered before the kill; {hits} blocks readable, all with their bytes"
    );
    assert!(hits >= answered * 8);
    drop(checker);
}

#[test]
fn a_full_disk_refuses_the_blocks_that_do_not_fit_without_saying_the_tier_failed() {
    let dir = Scratch::new("ws-full");
    let name = unique_name("full");
    let segment = Segment::create(&name, &storage_config(1, false)).unwrap();
    let args = disk_args(&dir, &["--storage-blocks", "8"]);
    // A slab too large for the limit: the worker refuses to start, saying why.
    let mut refused = Worker::spawn(&name, 0, &args, &[], Some(16 * 1024));
    let (status, stderr) = refused.wait_exit();
    assert!(!status.success());
    assert!(stderr.contains("no room for") && stderr.contains("rank-0.slab"), "{stderr}");

    // A slab made without a limit, then written under one that covers its first 3 slots.
    let mut rank = RankDriver::new(&segment, 0);
    let mut maker = Worker::spawn(&name, 0, &args, &[], None);
    rank.wait_alive(&maker);
    maker.stop();
    let worker = Worker::spawn(&name, 0, &args, &[], Some(3 * 4096));
    rank.wait_alive(&worker);
    let entries: Vec<StorageEntry> = (0..8).map(|i| entry(100 + i, i as u32)).collect();
    for i in 0..8 {
        rank.fill_host(i, 100 + u64::from(i));
    }
    let results = rank.storage(Op::StorageStore, &entries);
    // Not written, but not failed either: a full tier works (the scheduler must not mark it
    // down); the worker counts them as no space.
    assert_eq!(results, StorageResults { done: 0b0000_0111, failed: 0 });
    assert_eq!(segment.counters().get(Counter::StorageNoSpace), 5);
    let results = rank.storage(Op::StorageLoad, &[entry(100, 20), entry(101, 21), entry(102, 22)]);
    assert_eq!(results, all_done(3));
    drop(worker);
}

#[test]
fn a_worker_stopped_with_storage_commands_queued_answers_every_one_before_it_exits() {
    // A "Redis" that never answers: queued loads take their timeouts.
    let url = silent_redis();
    let name = unique_name("drain");
    let segment = Segment::create(&name, &storage_config(1, false)).unwrap();
    let args = redis_args(&url, "drain", &["--storage-timeout", "1", "--storage-connections", "1"]);
    let mut worker = Worker::spawn(&name, 0, &args, &[], None);
    let mut rank = RankDriver::new(&segment, 0);
    rank.wait_alive(&worker);
    let sent: Vec<u64> = (0..3)
        .map(|i| rank.send_storage(Op::StorageLoad, &[entry(i, i as u32)]).command_id)
        .collect();
    // Stop the worker while the loads are queued behind the first.
    std::thread::sleep(Duration::from_millis(100));
    let pid = nix::unistd::Pid::from_raw(worker.pid() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    // The drain takes seconds (a timeout per load); the exiting worker keeps heartbeating all
    // along, so the scheduler never takes it for a hung one.
    let mut answered = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while answered.len() < sent.len() {
        assert!(Instant::now() < deadline, "only {answered:?} of {sent:?} were answered");
        // Alive while it drains; empty once it answered the last and let go of the rank.
        let status = segment.rank_status(0).unwrap();
        assert!(
            !matches!(status, RankStatus::Dead { .. }),
            "the draining worker stopped heartbeating: {status:?}"
        );
        rank.try_completions(&mut answered);
        std::thread::sleep(Duration::from_millis(5));
    }
    let answered: Vec<u64> = answered.iter().map(|c| c.command_id).collect();
    assert_eq!(answered, sent, "every queued storage command is answered, in order");
    let (status, stderr) = worker.wait_exit();
    assert!(status.success(), "worker did not stop cleanly: {stderr}");
}

/// A stop while the storage thread waits for room for an answer (the scheduler stopped reaping)
/// does not hang the worker: it exits without releasing the rank, which the scheduler then
/// reclaims, as it does when the copy loop's answers find no room.
#[test]
fn a_worker_stopped_while_storage_answers_wait_for_room_leaves_its_rank_to_be_reclaimed() {
    let dir = Scratch::new("ws-full-ring");
    let name = unique_name("storage-full-ring");
    let config = SegmentConfig { completion_ring_slots: 4, ..storage_config(1, false) };
    let segment = Segment::create(&name, &config).unwrap();
    let mut worker = Worker::spawn(&name, 0, &disk_args(&dir, &[]), &[], None);
    let mut rank = RankDriver::new(&segment, 0);
    rank.wait_alive(&worker);
    let room = config.completion_ring_slots as usize;
    let query = [StorageEntry::new(block_hash(7), 0, 7, NO_HOST_BLOCK)];
    for _ in 0..room + 4 {
        rank.send_storage(Op::StorageQuery, &query);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while rank.waiting_completions() < room {
        assert!(Instant::now() < deadline, "the worker never filled its completion ring");
        std::thread::sleep(Duration::from_millis(2));
    }

    worker.signal(nix::sys::signal::Signal::SIGTERM);
    let (status, stderr) = worker.wait_exit_within(Duration::from_secs(10));
    assert!(!status.success(), "a stop with unanswered commands passed for a clean exit: {stderr}");
    assert!(stderr.contains("no room"), "{stderr}");
    assert_eq!(segment.rank_status(0).unwrap(), RankStatus::Dead { pid: worker.pid() });
}

/// A storage thread that panicked answers nothing more, and copies would keep the rank's
/// command deadline from noticing: the worker stops at once, without releasing the rank (the
/// storage commands given to the thread went unanswered), which the scheduler must reclaim,
/// resetting the rings, as after a crash.
#[test]
fn a_worker_whose_storage_thread_panicked_stops_and_leaves_its_rank_to_be_reclaimed() {
    let dir = Scratch::new("ws-panic");
    let name = unique_name("storage-panic");
    let segment = Segment::create(&name, &storage_config(1, false)).unwrap();
    let env = [("KVSHM_STORAGE_CRASH", "panic@1".to_owned())];
    let mut worker = Worker::spawn(&name, 0, &disk_args(&dir, &[]), &env, None);
    let mut rank = RankDriver::new(&segment, 0);
    rank.wait_alive(&worker);
    rank.fill_host(0, 7);
    rank.send_storage(Op::StorageStore, &[entry(7, 0)]);
    let query = [StorageEntry::new(block_hash(7), 0, 7, NO_HOST_BLOCK)];
    rank.send_storage(Op::StorageQuery, &query);

    let (status, stderr) = worker.wait_exit_within(Duration::from_secs(10));
    assert!(!status.success(), "a worker with unanswered commands exited cleanly: {stderr}");
    assert!(stderr.contains("storage thread panicked"), "{stderr}");
    assert_eq!(rank.waiting_completions(), 0, "the storage commands were never answered");
    assert_eq!(segment.rank_status(0).unwrap(), RankStatus::Dead { pid: worker.pid() });
}

/// A storage command whose entry slots never reach the ring is refused (`Malformed`) behind the
/// storage commands before it, in the storage lane's order, before the worker stops on the ring
/// out of step: the scheduler takes an answer that overtakes earlier commands of its lane for
/// their answers lost, and would reuse the host blocks a LOAD still writes.
#[test]
fn a_storage_command_cut_short_in_the_ring_is_refused_after_the_storage_commands_before_it() {
    // A "Redis" that never answers: the LOAD takes its timeout.
    let url = silent_redis();
    let name = unique_name("cut");
    let segment = Segment::create(&name, &storage_config(1, false)).unwrap();
    let args = redis_args(&url, "cut", &["--storage-timeout", "1", "--storage-connections", "1"]);
    let worker = Worker::spawn(&name, 0, &args, &[], None);
    let mut rank = RankDriver::new(&segment, 0);
    rank.wait_alive(&worker);
    let load = rank.send_storage(Op::StorageLoad, &[entry(1, 0)]);
    let cut = rank.header(Op::StorageStore, storage_pair_count(4));
    rank.send_slots(&[CommandSlot::from_header(&cut)]);
    let answers = rank.completions(2);
    assert_eq!(
        answers.iter().map(|answer| answer.command_id).collect::<Vec<_>>(),
        [load.command_id, cut.command_id],
        "answered out of the lane's order: {answers:?}"
    );
    assert_eq!(CommandError::from_wire(answers[1].error), Some(CommandError::Malformed));
    drop(worker);
}
