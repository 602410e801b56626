//! The local-disk storage back-end: round trips with checksums, a restart that finds its records,
//! damaged records read as misses, capacity and leaf-first reuse, and, in real child processes,
//! a SIGKILL at every step of a write and a full disk (a file size limit).
//!
//! Child processes are this test binary re-executed with [`CHILD_ENV`] naming the role.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use kvshm::hash::BlockHash;
use kvshm::storage::direct_io::{AlignedBuf, IoMode};
use kvshm::storage::disk::{CrashHook, CrashPoint};
use kvshm::storage::disk_index::{blocks_on_every_rank, read_index, IndexError};
use kvshm::storage::{
    BlockBytes, BlockBytesMut, BlockKey, BlockLayout, DiskBackend, DiskError, DiskOptions, Failure,
    GetBlock, GetMiss, PutBlock, StorageBackend,
};

use crate::support::{pattern_bytes, rerun_test, Scratch};

/// Set in a re-executed copy of this binary: the child's role and its arguments.
const CHILD_ENV: &str = "KVSHM_TEST_STORAGE_DISK_CHILD";

fn layout(block_bytes: u64) -> BlockLayout {
    BlockLayout::new(block_bytes, 2, 1).unwrap()
}

/// Opens a slab, waiting while its lock is busy: a test of this binary that spawns a child
/// process shares every descriptor with that child from its fork to its exec, the lock of a
/// slab another test just closed with them.
fn open(options: &DiskOptions) -> Result<DiskBackend, DiskError> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match DiskBackend::open(options) {
            Err(DiskError::Index(IndexError::Busy { .. })) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            result => return result,
        }
    }
}

fn options(dir: &Path, block_bytes: u64, capacity: u64) -> DiskOptions {
    DiskOptions {
        dir: dir.to_owned(),
        namespace: "test".into(),
        rank: 0,
        layout: layout(block_bytes),
        capacity_blocks: capacity,
        prefer_direct: true,
        crash: None,
    }
}

/// The bytes of block `tag`.
fn content(tag: u64, len: usize) -> Vec<u8> {
    pattern_bytes(tag, len)
}

fn key(tag: u64) -> BlockKey {
    BlockKey::new(BlockHash(u128::from(tag) << 64 | 0xb10c), BlockHash(u128::from(tag)), tag as u32)
}

/// Page-aligned memory holding blocks `tags` back to back, like a host tier.
fn host_tier(tags: &[u64], block: usize) -> AlignedBuf {
    let mut buf = AlignedBuf::zeroed(tags.len() * block);
    for (chunk, &tag) in buf.as_mut_slice().chunks_mut(block).zip(tags) {
        chunk.copy_from_slice(&content(tag, block));
    }
    buf
}

fn put(backend: &mut DiskBackend, tags: &[u64], block: usize) -> Vec<Result<(), Failure>> {
    let tier = host_tier(tags, block);
    let blocks: Vec<PutBlock<'_>> = tags
        .iter()
        .zip(tier.as_slice().chunks(block))
        .map(|(&tag, bytes)| PutBlock { key: key(tag), bytes: BlockBytes::new(bytes) })
        .collect();
    let mut outcomes = Vec::new();
    backend.put(&blocks, &mut outcomes);
    backend.check_invariants();
    outcomes
}

/// Gets `tags`; every hit must hold exactly its block's bytes (the test never trusts a hit).
fn get(backend: &mut DiskBackend, tags: &[u64], block: usize) -> Vec<Result<(), GetMiss>> {
    let mut tier = AlignedBuf::zeroed(tags.len() * block);
    let mut blocks: Vec<GetBlock<'_>> = tags
        .iter()
        .zip(tier.as_mut_slice().chunks_mut(block))
        .map(|(&tag, dest)| GetBlock { hash: key(tag).hash, dest: BlockBytesMut::new(dest) })
        .collect();
    let mut outcomes = Vec::new();
    backend.get(&mut blocks, &mut outcomes);
    backend.check_invariants();
    for ((tag, block_bytes), outcome) in
        tags.iter().zip(tier.as_slice().chunks(block)).zip(&outcomes)
    {
        if outcome.is_ok() {
            assert!(
                block_bytes == content(*tag, block).as_slice(),
                "block {tag} came back with wrong bytes"
            );
        }
    }
    outcomes
}

fn all_ok<E: std::fmt::Debug>(outcomes: &[Result<(), E>]) -> bool {
    outcomes.iter().all(Result::is_ok)
}

#[test]
fn blocks_round_trip_through_the_slab_in_any_order() {
    let scratch = Scratch::new("roundtrip");
    let block = 64 * 1024;
    let mut backend = open(&options(&scratch.0, block as u64, 64)).unwrap();
    println!("io mode: {:?}", backend.io_mode());
    let tags: Vec<u64> = (1..=40).collect();
    assert!(all_ok(&put(&mut backend, &tags, block)));
    assert_eq!(backend.len(), 40);
    // Consecutive, reversed and scattered reads, and a block asked for twice.
    assert!(all_ok(&get(&mut backend, &tags, block)));
    let reversed: Vec<u64> = tags.iter().rev().copied().collect();
    assert!(all_ok(&get(&mut backend, &reversed, block)));
    assert!(all_ok(&get(&mut backend, &[17, 3, 39, 3, 22], block)));
    assert_eq!(get(&mut backend, &[5, 99], block)[1], Err(GetMiss::Absent));

    let mut present = Vec::new();
    backend.contains(&[key(1).hash, key(99).hash], &mut present);
    assert_eq!(present, vec![Ok(true), Ok(false)]);
    let mut removed = Vec::new();
    backend.remove(&[key(1).hash, key(99).hash], &mut removed);
    assert!(all_ok(&removed));
    assert_eq!(get(&mut backend, &[1], block), vec![Err(GetMiss::Absent)]);
    backend.check_invariants();
}

#[test]
fn blocks_that_are_not_page_sized_and_buffered_io_round_trip_too() {
    for (block, prefer_direct) in [(6000usize, true), (6000, false), (8192, false)] {
        let scratch = Scratch::new(&format!("odd-{block}-{prefer_direct}"));
        let mut options = options(&scratch.0, block as u64, 16);
        options.prefer_direct = prefer_direct;
        let mut backend = open(&options).unwrap();
        if !prefer_direct {
            assert_eq!(backend.io_mode(), IoMode::Buffered);
        }
        assert_eq!(backend.slot_bytes() % 4096, 0);
        let tags: Vec<u64> = (100..110).collect();
        assert!(all_ok(&put(&mut backend, &tags, block)));
        assert!(all_ok(&get(&mut backend, &[109, 100, 104, 105, 106], block)));
        // Unaligned source and destination memory (offset by one byte).
        let source = content(200, block);
        let mut outcomes = Vec::new();
        backend.put(&[PutBlock { key: key(200), bytes: BlockBytes::new(&source) }], &mut outcomes);
        assert!(all_ok(&outcomes));
        let mut raw = vec![0u8; block + 1];
        let mut gets = Vec::new();
        let dest = BlockBytesMut::new(&mut raw[1..]);
        backend.get(&mut [GetBlock { hash: key(200).hash, dest }], &mut gets);
        assert!(all_ok(&gets));
        assert!(raw[1..] == source[..]);
    }
}

#[test]
fn a_reopened_slab_finds_its_blocks_and_their_prefix_chain() {
    let scratch = Scratch::new("restart");
    let block = 16 * 1024;
    let tags: Vec<u64> = (1..=12).collect();
    {
        let mut backend = open(&options(&scratch.0, block as u64, 32)).unwrap();
        assert!(all_ok(&put(&mut backend, &tags, block)));
    }
    let mut backend = open(&options(&scratch.0, block as u64, 32)).unwrap();
    assert_eq!(backend.len(), 12);
    assert!(all_ok(&get(&mut backend, &tags, block)));
    drop(backend);

    // What a restarted scheduler reads: every block with its parent and depth, parents first.
    let namespace_dir = scratch.0.join("test");
    let indexed = read_index(&namespace_dir, 0, &layout(block as u64)).unwrap();
    assert_eq!(indexed.len(), 12);
    let listed = blocks_on_every_rank(&namespace_dir, &layout(block as u64)).unwrap();
    let depths: Vec<u32> = listed.iter().map(|b| b.depth).collect();
    assert_eq!(depths, (1..=12).collect::<Vec<u32>>());
    for indexed in &listed {
        let tag = u64::from(indexed.depth);
        assert_eq!((indexed.hash, indexed.parent), (key(tag).hash, key(tag).parent));
    }
}

#[test]
fn a_block_on_only_some_ranks_is_not_listed_for_the_scheduler() {
    let scratch = Scratch::new("ranks");
    let block = 8192;
    let two_ranks = BlockLayout::new(block as u64, 2, 2).unwrap();
    for (rank, tags) in [(0u32, vec![1u64, 2, 3]), (1, vec![2, 3, 4])] {
        let mut backend =
            open(&DiskOptions { rank, layout: two_ranks, ..options(&scratch.0, block as u64, 8) })
                .unwrap();
        assert!(all_ok(&put(&mut backend, &tags, block)));
    }
    let listed = blocks_on_every_rank(&scratch.0.join("test"), &two_ranks).unwrap();
    let hashes: Vec<BlockHash> = listed.iter().map(|b| b.hash).collect();
    assert_eq!(hashes, vec![key(2).hash, key(3).hash]);
}

#[test]
fn a_damaged_record_is_a_miss_and_is_dropped() {
    // Small blocks are verified inline, batches of 1 MiB or more on a second thread.
    for block in [8192usize, 512 * 1024] {
        let scratch = Scratch::new(&format!("corrupt-{block}"));
        let mut backend = open(&options(&scratch.0, block as u64, 8)).unwrap();
        assert!(all_ok(&put(&mut backend, &[1, 2, 3], block)));
        let slot = backend.slot_of(key(2).hash).unwrap();
        let slab = backend.slab_path().to_owned();
        let slot_bytes = backend.slot_bytes();
        drop(backend);
        // One flipped bit in the middle of block 2's bytes.
        let mut bytes = std::fs::read(&slab).unwrap();
        bytes[(u64::from(slot) * slot_bytes + 5000) as usize] ^= 0x10;
        std::fs::write(&slab, &bytes).unwrap();

        let mut backend = open(&options(&scratch.0, block as u64, 8)).unwrap();
        let outcomes = get(&mut backend, &[1, 2, 3], block);
        assert_eq!(outcomes, vec![Ok(()), Err(GetMiss::Corrupt), Ok(())], "{block}");
        assert_eq!(
            get(&mut backend, &[2], block),
            vec![Err(GetMiss::Absent)],
            "dropped after the miss"
        );
        drop(backend);
        let backend = open(&options(&scratch.0, block as u64, 8)).unwrap();
        assert_eq!(backend.len(), 2, "the damaged record stays dropped after a restart");
    }
}

#[test]
fn a_damaged_index_record_is_zeroed_at_open() {
    let scratch = Scratch::new("torn-index");
    let block = 8192;
    let mut backend = open(&options(&scratch.0, block as u64, 8)).unwrap();
    assert!(all_ok(&put(&mut backend, &[1, 2], block)));
    let slot = backend.slot_of(key(1).hash).unwrap();
    let index = backend.index_path().to_owned();
    drop(backend);
    let mut bytes = std::fs::read(&index).unwrap();
    bytes[4096 + slot as usize * 64 + 20] ^= 1;
    std::fs::write(&index, &bytes).unwrap();
    let mut backend = open(&options(&scratch.0, block as u64, 8)).unwrap();
    assert_eq!(backend.damaged_at_open(), 1);
    assert_eq!(get(&mut backend, &[1, 2], block), vec![Err(GetMiss::Absent), Ok(())]);
}

#[test]
fn a_full_slab_reuses_its_least_recent_slots_leaves_before_parents() {
    let scratch = Scratch::new("lru");
    let block = 4096;
    let mut backend = open(&options(&scratch.0, block as u64, 4)).unwrap();
    // A prefix of three blocks stored together, then one more block and one more after that.
    assert!(all_ok(&put(&mut backend, &[1, 2, 3], block)));
    assert!(all_ok(&put(&mut backend, &[10], block)));
    assert!(all_ok(&put(&mut backend, &[11], block)));
    // The deepest block of the prefix went first.
    assert_eq!(get(&mut backend, &[3], block), vec![Err(GetMiss::Absent)]);
    assert!(all_ok(&get(&mut backend, &[1, 2, 10, 11], block)));
    assert_eq!(backend.stats().evictions, 1);
    // A read makes blocks recent: 10 and 11 were read last but one... read 1 and 2 again.
    assert!(all_ok(&get(&mut backend, &[1, 2], block)));
    assert!(all_ok(&put(&mut backend, &[12, 13], block)));
    assert_eq!(
        get(&mut backend, &[10, 11], block),
        vec![Err(GetMiss::Absent), Err(GetMiss::Absent)]
    );
    // Storing a block that is there already writes nothing and counts as stored.
    assert!(all_ok(&put(&mut backend, &[1], block)));
    assert_eq!(backend.stats().evictions, 3);
    // A batch larger than the slab stores what fits; the rest is "no space".
    let outcomes = put(&mut backend, &[20, 21, 22, 23, 24, 25], block);
    assert_eq!(outcomes.iter().filter(|o| o.is_ok()).count(), 4);
    assert_eq!(outcomes[5], Err(Failure::NoSpace));
}

#[test]
fn a_reopened_slab_still_gives_up_a_prefix_leaves_first() {
    let scratch = Scratch::new("lru-reopen");
    let block = 4096;
    let mut backend = open(&options(&scratch.0, block as u64, 4)).unwrap();
    assert!(all_ok(&put(&mut backend, &[1, 2, 3, 4], block)));
    drop(backend);
    let mut backend = open(&options(&scratch.0, block as u64, 4)).unwrap();
    assert!(all_ok(&put(&mut backend, &[5], block)));
    assert_eq!(get(&mut backend, &[4], block), vec![Err(GetMiss::Absent)], "the deepest goes");
    assert!(all_ok(&get(&mut backend, &[1, 2, 3, 5], block)));
}

#[test]
fn a_slab_grows_and_shrinks_with_the_capacity_it_is_reopened_with() {
    let scratch = Scratch::new("resize");
    let block = 4096;
    {
        let mut backend = open(&options(&scratch.0, block as u64, 4)).unwrap();
        assert!(all_ok(&put(&mut backend, &[1, 2, 3, 4], block)));
    }
    {
        let mut backend = open(&options(&scratch.0, block as u64, 8)).unwrap();
        assert!(all_ok(&put(&mut backend, &[5, 6, 7, 8], block)));
        assert!(all_ok(&get(&mut backend, &[1, 2, 3, 4, 5, 6, 7, 8], block)));
    }
    let mut backend = open(&options(&scratch.0, block as u64, 2)).unwrap();
    assert_eq!(backend.len(), 2);
    let outcomes = get(&mut backend, &[1, 2, 3, 4, 5, 6, 7, 8], block);
    assert_eq!(outcomes.iter().filter(|o| o.is_ok()).count(), 2);
    let slab = std::fs::metadata(backend.slab_path()).unwrap().len();
    assert_eq!(slab, 2 * 4096);
}

#[test]
fn a_slab_of_another_layout_or_held_by_another_process_is_refused_clearly() {
    let scratch = Scratch::new("refuse");
    let held = open(&options(&scratch.0, 4096, 4)).unwrap();
    let busy = DiskBackend::open(&options(&scratch.0, 4096, 4)).unwrap_err();
    assert!(matches!(busy, DiskError::Index(IndexError::Busy { .. })), "{busy}");
    drop(held);
    let other = open(&options(&scratch.0, 8192, 4)).unwrap_err();
    assert!(matches!(other, DiskError::Index(IndexError::LayoutMismatch { .. })), "{other}");
    assert!(other.to_string().contains("another storage namespace"), "{other}");
    // A file that is not ours is never overwritten.
    let foreign = scratch.0.join("test").join("rank-1.index");
    std::fs::write(&foreign, b"not a kvshm index at all, but somebody's data").unwrap();
    let refused = open(&DiskOptions { rank: 1, ..options(&scratch.0, 4096, 4) }).unwrap_err();
    assert!(matches!(refused, DiskError::Index(IndexError::Foreign { .. })), "{refused}");
    assert!(std::fs::read(&foreign).unwrap().starts_with(b"not a kvshm"));
}

// ---- Real processes: SIGKILL in the middle of writes, and a full disk. ----

/// Runs this binary as a child playing `role` (see [`child_main`]); returns its exit status.
fn run_child(test: &str, role: &str) -> std::process::ExitStatus {
    rerun_test(module_path!(), test)
        .args(["--test-threads", "1"])
        .env(CHILD_ENV, role)
        .stdout(Stdio::null())
        .status()
        .unwrap()
}

/// The child's part; returns true when this process is a child (and has done its part).
fn child_main() -> bool {
    let Ok(role) = std::env::var(CHILD_ENV) else { return false };
    let args: Vec<&str> = role.split('|').collect();
    match args[0] {
        // crash|DIR|HOOK: fill a 4-slot slab with blocks 1..=4, then store 5 and 6 (reusing the
        // slots of 1 and 2) with the crash hook armed.
        "crash" => {
            let mut options = options(Path::new(args[1]), 8192, 4);
            options.crash = Some(args[2].parse::<CrashHook>().unwrap());
            let mut backend = DiskBackend::open(&options).unwrap();
            assert!(all_ok(&put(&mut backend, &[1, 2, 3, 4], 8192)));
            put(&mut backend, &[5], 8192);
            put(&mut backend, &[6], 8192);
            std::process::exit(0);
        }
        // fsize|DIR|LIMIT|CAPACITY: under a file size limit, open a slab and store 8 blocks.
        "fsize" => {
            set_soft_file_size_limit(args[2].parse().unwrap());
            let dir = Path::new(args[1]);
            match DiskBackend::open(&options(dir, 4096, args[3].parse().unwrap())) {
                Err(DiskError::NoSpace { .. }) => std::process::exit(10),
                Err(other) => panic!("unexpected open error: {other}"),
                Ok(mut backend) => {
                    let outcomes = put(&mut backend, &[1, 2, 3, 4, 5, 6, 7, 8], 4096);
                    let no_space = outcomes.iter().filter(|o| **o == Err(Failure::NoSpace)).count();
                    let stored = outcomes.iter().filter(|o| o.is_ok()).count();
                    assert_eq!(stored + no_space, 8, "{outcomes:?}");
                    std::process::exit(20 + stored as i32);
                }
            }
        }
        // full-spell|DIR: with the soft file size limit at the index's header (every record
        // write fails for room), store 9..=16 one call each into a full 8-slot slab; then with
        // the limit lifted, 17..=24. Exit 10 x blocks kept after the first + stored after.
        "full-spell" => {
            let mut backend = DiskBackend::open(&options(Path::new(args[1]), 4096, 8)).unwrap();
            set_soft_file_size_limit(4096);
            let during = stored_one_by_one(&mut backend, 9..=16);
            assert_eq!(during, 0);
            let kept = backend.len() as i32;
            set_soft_file_size_limit(libc::RLIM_INFINITY);
            let after = stored_one_by_one(&mut backend, 17..=24);
            std::process::exit(10 * kept + after);
        }
        // bad-slot|DIR: with the soft file size limit at slot 7 of 8 (1..=7 fill slots 0..=6),
        // store 8..=20 one call each; exit 20 + how many stored.
        "bad-slot" => {
            let mut backend = DiskBackend::open(&options(Path::new(args[1]), 4096, 8)).unwrap();
            set_soft_file_size_limit(7 * 4096);
            std::process::exit(20 + stored_one_by_one(&mut backend, 8..=20));
        }
        // bad-tail|DIR: with the soft file size limit at slot 13 of 16 (1..=13 fill slots
        // 0..=12), store 40 batches of 3 new blocks; exit 20 + how many of the last 20 batches'
        // 60 blocks were stored.
        "bad-tail" => {
            let mut backend = DiskBackend::open(&options(Path::new(args[1]), 4096, 16)).unwrap();
            set_soft_file_size_limit(13 * 4096);
            let mut stored = 0;
            for batch in 0..40u64 {
                let tags: Vec<u64> = (0..3).map(|i| 100 + 3 * batch + i).collect();
                let outcomes = put(&mut backend, &tags, 4096);
                if batch >= 20 {
                    stored += outcomes.iter().filter(|o| o.is_ok()).count();
                }
                backend.check_invariants();
            }
            std::process::exit(20 + stored as i32);
        }
        other => panic!("unknown child role {other}"),
    }
}

/// A slab of `capacity` blocks of 4 KiB in a new scratch directory, holding blocks `tags`
/// (stored in one call), closed again.
fn slab_holding(name: &str, capacity: u64, tags: &[u64]) -> Scratch {
    let scratch = Scratch::new(name);
    let mut backend = open(&options(&scratch.0, 4096, capacity)).unwrap();
    assert!(all_ok(&put(&mut backend, tags, 4096)));
    scratch
}

/// Stores blocks `tags` one call each, checking the invariants after each; how many were stored.
fn stored_one_by_one(backend: &mut DiskBackend, tags: std::ops::RangeInclusive<u64>) -> i32 {
    let mut stored = 0;
    for tag in tags {
        stored += put(backend, &[tag], 4096).iter().filter(|o| o.is_ok()).count() as i32;
        backend.check_invariants();
    }
    stored
}

/// The soft RLIMIT_FSIZE of this process, at most its hard one (left as it is, so that the soft
/// one can be raised again), with SIGXFSZ ignored so that writes beyond it fail with EFBIG.
fn set_soft_file_size_limit(bytes: libc::rlim_t) {
    use nix::sys::signal::{signal, SigHandler, Signal};
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct we pass, which outlives the call.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_FSIZE, &mut limit) }, 0);
    limit.rlim_cur = bytes.min(limit.rlim_max);
    // SAFETY: setrlimit reads the struct we pass; the soft limit stays within the hard one.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_FSIZE, &limit) }, 0);
    // SAFETY: SIG_IGN installs no handler code; nothing else in this child relies on SIGXFSZ.
    unsafe { signal(Signal::SIGXFSZ, SigHandler::SigIgn) }.unwrap();
}

#[test]
fn a_writer_killed_at_any_step_of_a_write_leaves_no_record_with_wrong_bytes() {
    if child_main() {
        return;
    }
    use std::os::unix::process::ExitStatusExt;
    let cases = [
        ("after-invalidate@5", CrashPoint::AfterInvalidate),
        ("mid-payload@5", CrashPoint::MidPayload),
        ("before-record@5", CrashPoint::BeforeRecord),
        ("mid-payload@6", CrashPoint::MidPayload),
    ];
    for (hook, point) in cases {
        let scratch = Scratch::new(&format!("crash-{}", hook.replace('@', "-")));
        let role = format!("crash|{}|{hook}", scratch.0.display());
        let status = run_child(
            "a_writer_killed_at_any_step_of_a_write_leaves_no_record_with_wrong_bytes",
            &role,
        );
        assert_eq!(
            status.signal(),
            Some(libc::SIGKILL),
            "{hook}: the child was not killed ({status:?})"
        );

        let mut backend = open(&options(&scratch.0, 8192, 4)).unwrap();
        assert_eq!(backend.damaged_at_open(), 0, "{hook}");
        // `get` checks every hit's bytes; what matters is which blocks are there.
        let outcomes = get(&mut backend, &[1, 2, 3, 4, 5, 6], 8192);
        let present: Vec<u64> = [1, 2, 3, 4, 5, 6]
            .into_iter()
            .zip(&outcomes)
            .filter(|(_, o)| o.is_ok())
            .map(|(t, _)| t)
            .collect();
        assert!(
            outcomes.iter().all(|o| *o == Ok(()) || *o == Err(GetMiss::Absent)),
            "{hook}: {outcomes:?}"
        );
        // Blocks 1..=4 were stored as one prefix, so the slab reuses the deepest first.
        let expected: &[u64] = if hook.ends_with('6') {
            // Block 5 is complete (in block 4's slot); block 6 was not; block 3's slot was
            // emptied for it.
            &[1, 2, 5]
        } else {
            // Block 5 was never complete; block 4's slot was emptied for it.
            &[1, 2, 3]
        };
        assert_eq!(present, expected, "{hook} ({point:?})");
    }
}

#[test]
fn a_full_disk_is_a_clear_error_at_creation_and_a_counted_no_space_when_writing() {
    if child_main() {
        return;
    }
    let test = "a_full_disk_is_a_clear_error_at_creation_and_a_counted_no_space_when_writing";
    // Creation: a slab of 64 blocks of 4 KiB does not fit under a 100 KiB limit, and nothing is
    // left behind.
    let scratch = Scratch::new("full-create");
    let status = run_child(test, &format!("fsize|{}|102400|64", scratch.0.display()));
    assert_eq!(status.code(), Some(10), "{status:?}");
    let left: Vec<_> = std::fs::read_dir(scratch.0.join("test")).unwrap().collect();
    assert!(left.is_empty(), "a failed creation left {left:?}");

    // Writing: a slab made without a limit, then written under a limit that covers only its
    // first 3 slots: 3 blocks stored, 5 "no space", and the stored ones read back.
    let scratch = Scratch::new("full-write");
    drop(open(&options(&scratch.0, 4096, 8)).unwrap());
    let status = run_child(test, &format!("fsize|{}|{}|8", scratch.0.display(), 3 * 4096));
    assert_eq!(status.code(), Some(23), "{status:?}");
    let mut backend = open(&options(&scratch.0, 4096, 8)).unwrap();
    assert!(all_ok(&get(&mut backend, &[1, 2, 3], 4096)));
    assert_eq!(backend.len(), 3);
}

/// A reference model of the slab's membership and recency: the same rules in the plainest form.
struct ModelSlab {
    capacity: usize,
    /// Stored tags, least recently used first.
    order: Vec<u64>,
    sequence: std::collections::HashMap<u64, u64>,
    next_sequence: u64,
}

impl ModelSlab {
    fn touch(&mut self, tag: u64) {
        self.order.retain(|&t| t != tag);
        self.order.push(tag);
    }

    fn put(&mut self, tags: &[u64]) -> Vec<bool> {
        let mut pinned: Vec<u64> = Vec::new();
        let mut new: Vec<u64> = Vec::new();
        let mut stored = Vec::new();
        for &tag in tags {
            if self.order.contains(&tag) {
                pinned.push(tag);
                stored.push(true);
            } else if new.contains(&tag) {
                stored.push(true);
            } else if self.order.len() + new.len() < self.capacity {
                new.push(tag);
                stored.push(true);
            } else if let Some(victim) = self.order.iter().position(|t| !pinned.contains(t)) {
                let evicted = self.order.remove(victim);
                self.sequence.remove(&evicted);
                new.push(tag);
                stored.push(true);
            } else {
                stored.push(false);
            }
        }
        // The batch's last block first: a reopened slab orders by sequence, leaves first.
        for &tag in new.iter().rev() {
            self.sequence.insert(tag, self.next_sequence);
            self.next_sequence += 1;
        }
        for (&tag, _) in tags.iter().zip(&stored).rev().filter(|(_, &ok)| ok) {
            self.touch(tag);
        }
        stored
    }

    fn get(&mut self, tags: &[u64]) -> Vec<bool> {
        let hits: Vec<bool> = tags.iter().map(|t| self.order.contains(t)).collect();
        for (&tag, _) in tags.iter().zip(&hits).rev().filter(|(_, &hit)| hit) {
            self.touch(tag);
        }
        hits
    }

    fn remove(&mut self, tags: &[u64]) {
        self.order.retain(|t| !tags.contains(t));
    }

    /// After a restart only the write order is known.
    fn reopen(&mut self) {
        let sequence = &self.sequence;
        self.order.sort_by_key(|t| sequence[t]);
    }
}

#[test]
fn a_full_file_system_costs_a_few_blocks_and_the_slab_fills_again_after() {
    if child_main() {
        return;
    }
    let test = "a_full_file_system_costs_a_few_blocks_and_the_slab_fills_again_after";
    let scratch = slab_holding("full-spell", 8, &[1, 2, 3, 4, 5, 6, 7, 8]);
    // While the file system is full, 8 stores fail and evict 4 blocks (for the 1st, 2nd, 4th
    // and 8th write of the run), retrying their slots otherwise; once there is room, all 8 are
    // stored.
    let status = run_child(test, &format!("full-spell|{}", scratch.0.display()));
    assert_eq!(status.code(), Some(48), "{status:?}");
    let mut backend = open(&options(&scratch.0, 4096, 8)).unwrap();
    assert_eq!(backend.len(), 8);
    assert!(all_ok(&get(&mut backend, &[17, 18, 19, 20, 21, 22, 23, 24], 4096)));
}

#[test]
fn a_slot_that_keeps_failing_is_tried_less_and_less_often() {
    if child_main() {
        return;
    }
    let test = "a_slot_that_keeps_failing_is_tried_less_and_less_often";
    let scratch = slab_holding("bad-slot", 8, &[1, 2, 3, 4, 5, 6, 7]);
    // Slot 7 fails (past the limit) at stores 8, 10, 13 and 18: after 1, 2, then 4 successes
    // elsewhere; the other 9 of 13 stores evict a block and land.
    let status = run_child(test, &format!("bad-slot|{}|", scratch.0.display()));
    assert_eq!(status.code(), Some(29), "{status:?}");
    let backend = open(&options(&scratch.0, 4096, 8)).unwrap();
    assert_eq!(backend.len(), 7);
}

#[test]
fn slots_that_keep_failing_at_the_end_of_the_slab_fail_few_batches() {
    if child_main() {
        return;
    }
    let test = "slots_that_keep_failing_at_the_end_of_the_slab_fail_few_batches";
    let scratch = slab_holding("bad-tail", 16, &(1..=13).collect::<Vec<u64>>());
    // The three failing slots are tried after 1, 2, 4, 8, ... writes elsewhere: fewer and fewer
    // blocks fail, and the slab goes on storing in the slots that write.
    let status = run_child(test, &format!("bad-tail|{}", scratch.0.display()));
    let stored = status.code().expect("the child exits") - 20;
    println!("{stored} of the last 60 blocks stored past 3 slots that always fail");
    assert!(stored >= 54, "{stored} of the last 60 stored ({status:?})");
}

#[test]
fn the_index_takes_its_disk_space_when_made_as_the_slab_does() {
    use std::os::unix::fs::MetadataExt;
    let scratch = Scratch::new("index-space");
    let backend = open(&options(&scratch.0, 4096, 8192)).unwrap();
    let index = std::fs::metadata(backend.index_path()).unwrap();
    assert!(
        index.blocks() * 512 >= index.len(),
        "{} of {} bytes",
        index.blocks() * 512,
        index.len()
    );
    drop(backend);
}

#[test]
fn the_slab_matches_a_reference_lru_over_random_batches_and_restarts() {
    let scratch = Scratch::new("random");
    let block = 4096;
    let capacity = 12;
    let mut backend = open(&options(&scratch.0, block as u64, capacity)).unwrap();
    let mut model = ModelSlab {
        capacity: capacity as usize,
        order: Vec::new(),
        sequence: Default::default(),
        next_sequence: 0,
    };
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = |bound: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % bound
    };
    for step in 0..4000 {
        // A tiny vocabulary, so that batches collide with what is stored all the time.
        let len = 1 + next(16) as usize;
        let tags: Vec<u64> = (0..len).map(|_| 1 + next(24)).collect();
        match next(10) {
            0..=3 => {
                let stored: Vec<bool> =
                    put(&mut backend, &tags, block).iter().map(Result::is_ok).collect();
                assert_eq!(stored, model.put(&tags), "step {step}: put {tags:?}");
            }
            4..=7 => {
                // A load writes each host block once: distinct tags only.
                let mut distinct = tags.clone();
                distinct.sort_unstable();
                distinct.dedup();
                let hits: Vec<bool> =
                    get(&mut backend, &distinct, block).iter().map(Result::is_ok).collect();
                assert_eq!(hits, model.get(&distinct), "step {step}: get {distinct:?}");
            }
            8 => {
                let hashes: Vec<BlockHash> = tags.iter().map(|&t| key(t).hash).collect();
                let mut outcomes = Vec::new();
                backend.remove(&hashes, &mut outcomes);
                backend.check_invariants();
                assert!(all_ok(&outcomes));
                model.remove(&tags);
            }
            _ => {
                drop(backend);
                backend = open(&options(&scratch.0, block as u64, capacity)).unwrap();
                backend.check_invariants();
                model.reopen();
            }
        }
        assert_eq!(backend.len(), model.order.len(), "step {step}");
    }
}
