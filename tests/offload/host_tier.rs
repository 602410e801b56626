//! One rank's host tier for an engine that keeps its own tensors: in-process stores and loads
//! of real bytes, groups that own some tensors only, the refusals of the worker mode, and
//! workers copying into a shared tier's arena.

use kvshm::offload::host_tier::Backend;
use kvshm::offload::key_table::NO_PARENT;
use kvshm::offload::shared::{open_rank_arena, TierArenas};
use kvshm::offload::tensor_memory::TensorMemory;
use kvshm::offload::transfer::{Direction, EngineLayout};
use kvshm::offload::{HostTier, HostTierError, StoredKey, TableEpoch, TierEngine, TierOptions};
use kvshm::service::SegmentName;

use crate::support::WorkerProcess;

const PAGE: usize = 32;
const BLOCKS: usize = 16;

fn name(test: &str) -> SegmentName {
    SegmentName::new(&format!("t-hosttier-{test}-{}", std::process::id())).unwrap()
}

fn layout(groups: Vec<Vec<u32>>) -> EngineLayout {
    EngineLayout {
        page_bytes: PAGE as u64,
        tensors: 2,
        device_blocks: BLOCKS as u32,
        chunks: 6,
        blocks_per_chunk: 2,
        groups,
        page_format: String::new(),
    }
}

fn tensors_of(buffers: &mut [Vec<u8>]) -> Vec<(usize, u64, u64)> {
    buffers
        .iter_mut()
        .map(|buffer| (buffer.as_mut_ptr() as usize, BLOCKS as u64, PAGE as u64))
        .collect()
}

#[test]
fn blocks_stored_in_process_load_back_byte_for_byte_into_other_blocks() {
    let mut buffers: Vec<Vec<u8>> = (0..2)
        .map(|tensor| (0..BLOCKS * PAGE).map(|i| (i * 7 + tensor * 31) as u8).collect())
        .collect();
    let original = buffers.clone();
    let layout = layout(vec![vec![0, 1], vec![1]]);
    // SAFETY: the buffers outlive the tier and nothing else touches them while it copies.
    let memory = unsafe { TensorMemory::new(&layout, &tensors_of(&mut buffers)) }.unwrap();
    let mut tier =
        HostTier::create(&name("roundtrip"), layout, TierEngine::InProcess(memory)).unwrap();
    // Group 0: device blocks 3, 4, 5 from request block 0 -> chunks 1 (2 blocks) and 4 (1 block).
    // Group 1: device block 9, request block 1 -> second half of chunk 2.
    tier.submit(7, Direction::Store, &[3, 4, 5, 9], &[3, 1], &[0, 1], &[1, 4, 2]).unwrap();
    let mut done = Vec::new();
    tier.take_finished(&mut done);
    assert_eq!(
        (done[0].job, done[0].success, done[0].bytes),
        (7, true, (3 * 2 + 1) as u64 * PAGE as u64)
    );
    // Wipe the sources, load into other blocks.
    for buffer in &mut buffers {
        buffer.fill(0);
    }
    tier.submit(8, Direction::Load, &[10, 11, 12, 13], &[3, 1], &[0, 1], &[1, 4, 2]).unwrap();
    for (tensor, buffer) in buffers.iter().enumerate() {
        for (from, to) in [(3, 10), (4, 11), (5, 12)] {
            assert_eq!(buffer[to * PAGE..][..PAGE], original[tensor][from * PAGE..][..PAGE]);
        }
    }
    // Group 1 owns tensor 1 only: tensor 0's block 13 was not written.
    assert_eq!(buffers[1][13 * PAGE..][..PAGE], original[1][9 * PAGE..][..PAGE]);
    assert!(buffers[0][13 * PAGE..][..PAGE].iter().all(|&byte| byte == 0));
    // Chunk 1 holds device blocks 3 and 4, tensor 0 then tensor 1 in each host block.
    let host = tier.host_block(2).unwrap();
    assert_eq!(host[..PAGE], original[0][3 * PAGE..][..PAGE]);
    assert_eq!(host[PAGE..], original[1][3 * PAGE..][..PAGE]);
}

#[test]
fn a_bad_spec_copies_nothing_and_is_reported() {
    let mut buffers = vec![vec![1u8; BLOCKS * PAGE]; 2];
    let layout = layout(vec![vec![0, 1]]);
    // SAFETY: as above.
    let memory = unsafe { TensorMemory::new(&layout, &tensors_of(&mut buffers)) }.unwrap();
    let mut tier =
        HostTier::create(&name("badspec"), layout, TierEngine::InProcess(memory)).unwrap();
    assert!(matches!(
        tier.submit(1, Direction::Store, &[99], &[1], &[0], &[0]),
        Err(HostTierError::Plan(_))
    ));
    assert!(tier.host_block(0).unwrap().iter().all(|&byte| byte == 0));
    assert!(matches!(tier.publish_device_handles(&[]), Err(HostTierError::NoWorkers)));
}

#[test]
fn tensors_smaller_than_the_layout_are_refused() {
    let mut buffers = vec![vec![0u8; 4 * PAGE]; 2];
    let layout = layout(vec![vec![0, 1]]);
    // SAFETY: as above.
    let result = unsafe {
        TensorMemory::new(
            &layout,
            &[
                (buffers[0].as_mut_ptr() as usize, 4, PAGE as u64),
                (buffers[1].as_mut_ptr() as usize, 4, PAGE as u64),
            ],
        )
    };
    assert!(result.is_err());
}

#[test]
fn worker_copies_need_every_group_to_span_every_tensor() {
    let result = HostTier::create(
        &name("partial"),
        layout(vec![vec![0, 1], vec![1]]),
        TierEngine::Workers(Backend::Cuda),
    );
    assert!(matches!(result, Err(HostTierError::PartialGroup { group: 1, used: 1, tensors: 2 })));
    let tier = HostTier::create(
        &name("workers"),
        layout(vec![vec![0, 1]]),
        TierEngine::Workers(Backend::Cuda),
    )
    .unwrap();
    assert!(!tier.worker_up(), "no worker attached yet");
}

use std::time::{Duration, Instant};

#[test]
fn a_worker_killed_in_the_middle_of_a_job_is_replaced_and_the_job_still_succeeds() {
    // The device tier is an arena of the segment here (no GPU): the same relay as on CUDA.
    let layout = EngineLayout {
        page_bytes: 4096,
        tensors: 2,
        device_blocks: 16,
        chunks: 16,
        blocks_per_chunk: 1,
        groups: vec![vec![0, 1]],
        page_format: String::new(),
    };
    let mut tier =
        HostTier::create(&name("relay"), layout, TierEngine::Workers(Backend::HostArena)).unwrap();
    let memory = tier.device_memory().unwrap();
    let page = |block: u32, region: u32| vec![(block * 7 + region) as u8 + 1; 4096];
    for block in 0..8 {
        for region in 0..2 {
            memory.write_device_region(block, region, &page(block, region)).unwrap();
        }
    }
    // No worker yet: the job waits rather than failing.
    let device: Vec<i64> = (0..8).collect();
    let chunks: Vec<i64> = (8..16).collect();
    tier.submit(1, Direction::Store, &device, &[8], &[0], &chunks).unwrap();
    let mut done = Vec::new();
    tier.take_finished(&mut done);
    assert!(done.is_empty());
    // A slow worker (400 ms per layer) takes the job and dies in the middle of it.
    let mut slow = WorkerProcess::spawn(tier.name(), 0, Some(400_000));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !tier.worker_up() {
        assert!(Instant::now() < deadline, "the worker attaches");
        tier.poll();
        std::thread::sleep(Duration::from_millis(2));
    }
    std::thread::sleep(Duration::from_millis(100));
    slow.kill_hard();
    let deadline = Instant::now() + Duration::from_secs(5);
    while tier.worker_up() {
        assert!(Instant::now() < deadline, "the death is noticed");
        tier.poll();
        std::thread::sleep(Duration::from_millis(2));
    }
    tier.take_finished(&mut done);
    assert!(done.is_empty(), "a worker crash is not a failed job: {done:?}");
    // Its replacement carries the job out.
    let _worker = WorkerProcess::spawn(tier.name(), 0, None);
    assert!(tier.wait(&[1], Duration::from_secs(20)));
    tier.take_finished(&mut done);
    assert_eq!((done[0].job, done[0].success), (1, true));
    for block in 0..8 {
        let host = tier.host_block(8 + block).unwrap();
        assert_eq!(host[..4096], page(block, 0)[..]);
        assert_eq!(host[4096..], page(block, 1)[..]);
    }
}

fn key(n: u8) -> kvshm::offload::OffloadKey {
    kvshm::offload::OffloadKey::new(&[n; 36]).unwrap()
}

fn stored(n: u8, parent_chunk: u32) -> StoredKey {
    StoredKey { key: key(n), parent_chunk, epoch: 0 }
}

fn persistent_tier(name: &SegmentName, layout: EngineLayout, buffers: &mut [Vec<u8>]) -> HostTier {
    // SAFETY: the buffers outlive the tier and nothing else touches them while it copies.
    let memory = unsafe { TensorMemory::new(&layout, &tensors_of(buffers)) }.unwrap();
    let options = TierOptions { block_tokens: 16, layers: 2, persistent: true };
    HostTier::create_with(name, layout, TierEngine::InProcess(memory), options).unwrap()
}

#[test]
fn a_persistent_tier_left_behind_is_taken_over_with_its_bytes_and_keys() {
    let name = name("persist");
    let mut buffers: Vec<Vec<u8>> = (0..2)
        .map(|tensor| (0..BLOCKS * PAGE).map(|i| (i * 5 + tensor * 17) as u8).collect())
        .collect();
    let original = buffers.clone();
    let one_group = || layout(vec![vec![0, 1]]);
    let mut tier = persistent_tier(&name, one_group(), &mut buffers);
    assert!(!tier.restored());
    // Blocks 0..4 into chunks 3 and 1 (two blocks each), chained: key 2 under key 1.
    let keys = [stored(1, NO_PARENT), stored(2, 3)];
    tier.submit_keyed(1, Direction::Store, &[0, 1, 2, 3], &[4], &[0], &[3, 1], &keys).unwrap();
    // A store without keys still clears its chunk's slot: chunk 5 names no key.
    tier.submit_keyed(2, Direction::Store, &[4, 5], &[2], &[0], &[5], &[]).unwrap();
    let host_block = tier.host_block(3 * 2).unwrap();
    drop(tier);

    let mut entries = read_back(&name);
    assert!(entries.is_empty(), "no segment to read once the tier is gone: {entries:?}");
    for buffer in &mut buffers {
        buffer.fill(0);
    }
    let mut tier = persistent_tier(&name, one_group(), &mut buffers);
    assert!(tier.restored());
    assert_eq!(tier.host_block(3 * 2).unwrap(), host_block);
    entries = read_back(&name);
    entries.sort_by_key(|entry| entry.seq);
    assert_eq!(
        entries.iter().map(|e| (e.chunk, e.key, e.parent.map(|p| p.0))).collect::<Vec<_>>(),
        vec![(3, key(1), None), (1, key(2), Some(3))]
    );
    assert_eq!(entries[1].parent, Some((3, entries[0].seq)));
    // The chunks load back what was stored.
    tier.submit(3, Direction::Load, &[8, 9, 10, 11], &[4], &[0], &[3, 1]).unwrap();
    for (tensor, buffer) in buffers.iter().enumerate() {
        let page = |block: usize| &buffer[block * PAGE..(block + 1) * PAGE];
        for (src, dst) in [(0, 8), (1, 9), (2, 10), (3, 11)] {
            assert_eq!(page(dst), &original[tensor][src * PAGE..(src + 1) * PAGE]);
        }
    }
    // Overwriting a chunk replaces its key; a tier of another format or shape starts empty.
    tier.submit_keyed(4, Direction::Store, &[4, 5], &[2], &[0], &[3], &[stored(9, NO_PARENT)])
        .unwrap();
    let chunk_keys: Vec<_> = read_back(&name).iter().map(|e| (e.chunk, e.key)).collect();
    assert!(chunk_keys.contains(&(3, key(9))) && chunk_keys.contains(&(1, key(2))));
    drop(tier);
    // A tier of the same shape whose pages lay their bytes out otherwise takes no key back.
    let mut other_format = one_group();
    other_format.page_format = "LBHNC".to_owned();
    let tier = persistent_tier(&name, other_format, &mut buffers);
    assert!(!tier.restored());
    assert!(read_back(&name).is_empty());
    drop(tier);
    let mut wider = one_group();
    wider.chunks = 7;
    let tier = persistent_tier(&name, wider, &mut buffers);
    assert!(!tier.restored());
    assert!(kvshm::offload::read_tier_keys(&name, 7, 2).unwrap().is_empty());
    drop(tier);
    // Removes the host tier left behind: a plain segment made over the name, then dropped.
    kvshm::service::Segment::create(&name, &Default::default()).map(drop).unwrap();
}

/// A reset of the engine's manager raises the epoch of the tier's key table: the keys stored
/// before it are no longer read back, nor is a store chosen before it whose copy lands after it;
/// the epoch outlives the tier (a take-over keeps it) and the table's own header writes.
#[test]
fn keys_stored_before_a_reset_epoch_are_not_read_back() {
    let name = name("epoch");
    let mut buffers = vec![vec![7u8; BLOCKS * PAGE]; 2];
    let one_group = || layout(vec![vec![0, 1]]);
    let mut tier = persistent_tier(&name, one_group(), &mut buffers);
    let in_epoch = |n: u8, epoch: u32| StoredKey { key: key(n), parent_chunk: NO_PARENT, epoch };
    tier.submit_keyed(1, Direction::Store, &[0, 1], &[2], &[0], &[3], &[in_epoch(1, 0)]).unwrap();
    let segment = kvshm::service::Segment::attach(&name).unwrap();
    let (table, epoch) = TableEpoch::open(&segment, 6, 2).unwrap().expect("a persistent table");
    assert_eq!((epoch, read_back(&name).len()), (0, 1));
    table.set(1);
    assert!(read_back(&name).is_empty(), "the key stored before the reset is stale");
    tier.submit_keyed(2, Direction::Store, &[2, 3], &[2], &[0], &[1], &[in_epoch(2, 1)]).unwrap();
    // Chosen before the reset, landed after it.
    tier.submit_keyed(3, Direction::Store, &[4, 5], &[2], &[0], &[5], &[in_epoch(3, 0)]).unwrap();
    let keys = |name: &SegmentName| read_back(name).iter().map(|e| e.key).collect::<Vec<_>>();
    assert_eq!(keys(&name), vec![key(2)]);
    // Enough stores for the table to write its header's next seq, which leaves the epoch be.
    for job in 4..1100 {
        tier.submit_keyed(job, Direction::Store, &[6, 7], &[2], &[0], &[0], &[in_epoch(4, 1)])
            .unwrap();
    }
    tier.take_finished(&mut Vec::new());
    drop((tier, table, segment));
    let tier = persistent_tier(&name, one_group(), &mut buffers);
    assert!(tier.restored());
    let segment = kvshm::service::Segment::attach(&name).unwrap();
    assert_eq!(TableEpoch::open(&segment, 6, 2).unwrap().map(|(_, epoch)| epoch), Some(1));
    let found = keys(&name);
    assert!(found.len() == 2 && found.contains(&key(2)) && found.contains(&key(4)), "{found:?}");
    drop((tier, segment));
    // Removes the host tier left behind: a plain segment made over the name, then dropped.
    kvshm::service::Segment::create(&name, &Default::default()).map(drop).unwrap();
    // A tier that is not persistent has no table to raise.
    let plain = self::name("epoch-plain");
    // SAFETY: the buffers outlive the tier and nothing else touches them while it copies.
    let memory = unsafe { TensorMemory::new(&one_group(), &tensors_of(&mut buffers)) }.unwrap();
    let _tier = HostTier::create(&plain, one_group(), TierEngine::InProcess(memory)).unwrap();
    let segment = kvshm::service::Segment::attach(&plain).unwrap();
    assert!(TableEpoch::open(&segment, 6, 2).unwrap().is_none());
}

/// An in-process tier whose engine polls without jobs still reads as polling for `kvctl stat`:
/// before, its last poll was published only with a job's copies, and an engine serving with no
/// offload for a second read as stopped.
#[test]
fn an_in_process_tier_polled_without_jobs_reads_as_polling() {
    let name = name("polling");
    let mut buffers = vec![vec![0u8; BLOCKS * PAGE]; 2];
    // SAFETY: the buffers outlive the tier and nothing else touches them while it copies.
    let memory =
        unsafe { TensorMemory::new(&layout(vec![vec![0, 1]]), &tensors_of(&mut buffers)) }.unwrap();
    let mut tier =
        HostTier::create(&name, layout(vec![vec![0, 1]]), TierEngine::InProcess(memory)).unwrap();
    let watcher = kvshm::service::Segment::attach(&name).unwrap();
    let last_poll = || watcher.counters().get(kvshm::service::Counter::LastPollNs);
    let before = last_poll();
    std::thread::sleep(Duration::from_millis(20));
    tier.take_finished(&mut Vec::new());
    assert!(last_poll() > before, "the poll was not published");
}

fn read_back(name: &SegmentName) -> Vec<kvshm::offload::TableEntry> {
    kvshm::offload::read_tier_keys(name, 6, 2).unwrap_or_default()
}

/// Two engines' host tiers on rank 1's arena of one shared tier, each copied by a worker process
/// of its own (`--shared-tier`, as a GPU engine's workers run; the device tier is an arena of the
/// engine's segment here): a block one engine stored through its worker is loaded by the other's
/// worker byte for byte, and is in the tier's arena. A worker without `--shared-tier` is refused.
#[test]
fn workers_copy_two_engines_blocks_through_one_shared_arena() {
    const PAGE: usize = 4096;
    let tier = name("shared-arena");
    // Three ranks' arenas, left for the engines to map (this process maps only theirs).
    drop(TierArenas::create_or_adopt(&tier, 3, 12, 2 * PAGE as u64).unwrap());
    let layout = EngineLayout {
        page_bytes: PAGE as u64,
        tensors: 2,
        device_blocks: 8,
        chunks: 1, // the arena's 12, for a shared tier
        blocks_per_chunk: 1,
        groups: vec![vec![0, 1]],
        page_format: String::new(),
    };
    let engine = |tag: &str| {
        let host_tier = HostTier::create_on_shared_tier(
            &name(tag),
            layout.clone(),
            TierEngine::Workers(Backend::HostArena),
            TierOptions::default(),
            &tier,
            1,
        )
        .unwrap();
        let args = ["--shared-tier", tier.as_str(), "--shared-tier-rank", "1"];
        let worker = WorkerProcess::spawn_with(host_tier.name(), 0, &args, &[]);
        (host_tier, worker)
    };
    let (mut first, _first_worker) = engine("shared-a");
    let (mut second, _second_worker) = engine("shared-b");
    let page = |block: u32, region: u32| vec![(block * 5 + region) as u8 + 3; PAGE];
    let memory = first.device_memory().unwrap();
    for block in 0..3 {
        for region in 0..2 {
            memory.write_device_region(block, region, &page(block, region)).unwrap();
        }
    }
    first.submit(1, Direction::Store, &[0, 1, 2], &[3], &[0], &[9, 10, 11]).unwrap();
    assert!(first.wait(&[1], Duration::from_secs(20)), "the first engine's store");
    second.submit(2, Direction::Load, &[5, 6, 7], &[3], &[0], &[9, 10, 11]).unwrap();
    assert!(second.wait(&[2], Duration::from_secs(20)), "the second engine's load");
    let mut done = Vec::new();
    first.take_finished(&mut done);
    second.take_finished(&mut done);
    assert!(done.iter().all(|outcome| outcome.success), "{done:?}");
    let loaded = second.device_memory().unwrap();
    let shared = open_rank_arena(&tier, 1, 12, 2 * PAGE as u64).unwrap();
    let mut bytes = vec![0; PAGE];
    for block in 0..3 {
        for region in 0..2 {
            loaded.read_device_region(5 + block, region, &mut bytes).unwrap();
            assert_eq!(bytes, page(block, region), "block {block} region {region} loaded");
            let at = (9 + block as usize) * 2 * PAGE + region as usize * PAGE;
            shared.read_data(at, &mut bytes).unwrap();
            assert_eq!(bytes, page(block, region), "block {block} region {region} in the tier");
        }
    }

    let lone = HostTier::create_on_shared_tier(
        &name("shared-c"),
        layout,
        TierEngine::Workers(Backend::HostArena),
        TierOptions::default(),
        &tier,
        0,
    )
    .unwrap();
    // A worker told no tier, or another rank's arena of it (one its engine does not map: all
    // ranks' arenas have one shape), is refused.
    let refusal = |args: &[&str]| {
        let refused = std::process::Command::new(env!("CARGO_BIN_EXE_kvshm"))
            .args(["worker", "--name", lone.name().as_str(), "--rank", "0"])
            .args(["--attach-timeout", "2"])
            .args(args)
            .output()
            .unwrap();
        assert!(!refused.status.success());
        String::from_utf8_lossy(&refused.stderr).into_owned()
    };
    let said = refusal(&[]);
    assert!(said.contains("start the worker with --shared-tier NAME --shared-tier-rank"), "{said}");
    let said = refusal(&["--shared-tier", tier.as_str(), "--shared-tier-rank", "2"]);
    assert!(said.contains("does not map it"), "{said}");
    drop((first, second, lone, shared));
    TierArenas::unlink(&tier, 3);
}
