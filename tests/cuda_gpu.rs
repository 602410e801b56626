//! The CUDA backend on a real GPU (feature `cuda`; these tests need a GPU and a driver, and fail
//! without one: `scripts/gpu-check` runs them on a GPU machine, CI has none). The test plays the
//! engine: it allocates each rank's KV buffers on the GPU ([`DeviceKvBuffers`]), publishes their
//! IPC handles, starts real `kvshm worker --backend cuda` processes (two ranks share GPU 0),
//! writes pattern bytes on the device and checks every byte after swap-outs, swap-ins and
//! write-through backups, on the device and in the host tier; a worker SIGKILLed mid-copy is
//! rolled back and replaced; a swap-in's layers are reported one by one as they land.
//!
//! `KVSHM_BIN` names the kvshm executable to start workers from (default: this build's).
#![cfg(feature = "cuda")]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvshm::cli::pattern::{self, RegionIdentity};
use kvshm::hash::BlockHash;
use kvshm::manager::{CacheConfig, RequestId, TicketStatus, WritePolicy};
use kvshm::service::{Backend, RankState, Service, ServiceConfig, WaitError};
use kvshm::worker::cuda::{device_count, DeviceKvBuffers};
use kvshm::worker::{CopyMethod, HostLayout};
use kvshm_ipc::arena::{Arena, ArenaKind};
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::record::CommandError;

const BLOCK_TOKENS: u32 = 16;
const WAIT: Duration = Duration::from_secs(30);

/// A service on the CUDA backend, its ranks' GPU buffers and host tiers, and their workers.
struct GpuService {
    service: Service,
    buffers: Vec<DeviceKvBuffers>,
    hosts: Vec<Arena>,
    workers: Vec<Option<Child>>,
    name: SegmentName,
    method: CopyMethod,
}

fn copy_method() -> CopyMethod {
    std::env::var("KVSHM_CUDA_COPY").map_or(CopyMethod::default(), |text| {
        text.parse().expect("KVSHM_CUDA_COPY names a copy method")
    })
}

impl GpuService {
    fn create(
        test: &str,
        tp: u32,
        layers: u32,
        region_bytes: u64,
        cache: CacheConfig,
    ) -> GpuService {
        assert!(device_count() > 0, "these tests need a CUDA device and driver");
        let name = SegmentName::new(&format!("t-gpu-{test}-{}", std::process::id())).unwrap();
        let mut config = ServiceConfig::new(cache, tp, layers, 2 * layers, region_bytes);
        config.backend = Backend::Cuda;
        let service = Service::create(&name, config).expect("creating the service");
        let mut buffers = Vec::new();
        let mut hosts = Vec::new();
        for rank in 0..tp {
            let rank_buffers = DeviceKvBuffers::allocate(0, service.geometry()).unwrap();
            service.segment().publish_device_handles(rank, &rank_buffers.region_handles()).unwrap();
            buffers.push(rank_buffers);
            hosts.push(service.segment().open_arena(ArenaKind::Host, rank).unwrap());
        }
        let workers = (0..tp).map(|_| None).collect();
        GpuService { service, buffers, hosts, workers, name, method: copy_method() }
    }

    /// Starts rank `rank`'s worker on GPU 0, sleeping `layer_delay_us` after each layer.
    fn start_worker(&mut self, rank: u32, layer_delay_us: Option<u64>) {
        let exe = std::env::var("KVSHM_BIN").unwrap_or(env!("CARGO_BIN_EXE_kvshm").to_owned());
        let mut command = Command::new(exe);
        command
            .args(["worker", "--name", self.name.as_str(), "--rank", &rank.to_string()])
            .args(["--backend", "cuda", "--device", "0", "--cuda-copy", self.method.name()])
            .env_remove("KVSHM_WORKER_LAYER_DELAY_US")
            .stdin(Stdio::null());
        if let Some(delay) = layer_delay_us {
            command.env("KVSHM_WORKER_LAYER_DELAY_US", delay.to_string());
        }
        self.workers[rank as usize] = Some(command.spawn().expect("spawning kvshm worker"));
    }

    fn kill_worker(&mut self, rank: u32) {
        let mut child = self.workers[rank as usize].take().expect("a worker runs");
        child.kill().expect("SIGKILL");
        child.wait().expect("reaping the killed worker");
    }

    fn ranks(&self) -> u32 {
        self.buffers.len() as u32
    }

    fn region_bytes(&self) -> usize {
        self.service.geometry().region_bytes() as usize
    }

    fn write_block(&self, hash: BlockHash, block: u32) {
        let mut bytes = vec![0; self.region_bytes()];
        for rank in 0..self.ranks() {
            for region in 0..self.service.geometry().regions() {
                pattern::fill(RegionIdentity { block_hash: hash.0, region, rank }, &mut bytes);
                self.buffers[rank as usize].write_region(block, region, &bytes).unwrap();
            }
        }
    }

    /// Regions of device block `block` not holding `hash`'s bytes, over every rank.
    fn device_block_damage(&self, hash: BlockHash, block: u32) -> usize {
        let mut bytes = vec![0; self.region_bytes()];
        let mut damaged = 0;
        for rank in 0..self.ranks() {
            for region in 0..self.service.geometry().regions() {
                self.buffers[rank as usize].read_region(block, region, &mut bytes).unwrap();
                let identity = RegionIdentity { block_hash: hash.0, region, rank };
                damaged += usize::from(pattern::verify(identity, &bytes).is_err());
            }
        }
        damaged
    }

    /// Regions of host block `block` not holding `hash`'s bytes, over every rank.
    fn host_block_damage(&self, hash: BlockHash, block: u32) -> usize {
        let layout = HostLayout::new(self.service.geometry());
        let mut bytes = vec![0; self.region_bytes()];
        let mut damaged = 0;
        for rank in 0..self.ranks() {
            for region in 0..self.service.geometry().regions() {
                let offset = layout.region_offset(block, region).unwrap() as usize;
                self.hosts[rank as usize].read_data(offset, &mut bytes).unwrap();
                let identity = RegionIdentity { block_hash: hash.0, region, rank };
                damaged += usize::from(pattern::verify(identity, &bytes).is_err());
            }
        }
        damaged
    }

    /// (hash, host block) of every cached node with a host copy.
    fn host_copies(&self) -> Vec<(BlockHash, u32)> {
        let snapshot = self.service.cache().tree_snapshot(u32::MAX);
        snapshot.nodes.iter().filter_map(|node| node.host.map(|block| (node.hash, block))).collect()
    }

    /// Runs a request over `hashes`: match, allocate, wait, check every hit block's bytes on the
    /// device, write the new ones, commit, finish. Returns (device hits, host hits, damaged
    /// regions among the hits).
    fn run_request(&mut self, id: u64, hashes: &[BlockHash]) -> (usize, usize, usize) {
        let request = RequestId(id);
        let tokens = hashes.len() * BLOCK_TOKENS as usize;
        // One token past the blocks, so that every one of them may hit (the last-token rule).
        let matched = self.service.match_prefix(request, hashes, tokens + 1).unwrap();
        let allocation = self.service.allocate(request, tokens + 1 - matched.cached_tokens, 0);
        let allocation = allocation.unwrap();
        let (table, ticket) = (allocation.block_table.to_vec(), allocation.ticket);
        self.service.wait(ticket, WAIT).expect("the request's copies land");
        let mut damaged = 0;
        for (index, (&hash, &block)) in hashes.iter().zip(&table).enumerate() {
            if index < matched.blocks() {
                damaged += self.device_block_damage(hash, block);
            } else {
                self.write_block(hash, block);
            }
        }
        self.service.commit(request, tokens, hashes).unwrap();
        self.service.finish(request).unwrap();
        self.service.poll();
        self.service.cache().check_invariants().unwrap();
        (matched.device_blocks, matched.host_blocks, damaged)
    }
}

impl Drop for GpuService {
    fn drop(&mut self) {
        for child in self.workers.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn hashes(first: u128, count: usize) -> Vec<BlockHash> {
    (0..count as u128).map(|i| BlockHash(first + i)).collect()
}

/// A conversation-like workload over a device tier a quarter of its working set: prefixes come
/// back after being pushed to host, so every kind of copy runs; every hit is checked on the
/// device, and after the run every host copy in the host tier.
fn every_byte_survives_swaps(write_policy: WritePolicy, tp: u32) {
    let cache =
        CacheConfig::new(BLOCK_TOKENS, 48).with_host_blocks(256).with_write_policy(write_policy);
    let test = format!("bytes-{}-tp{tp}", write_policy.to_string().replace('_', "-"));
    let mut gpu = GpuService::create(&test, tp, 4, 16 * 1024, cache);
    for rank in 0..tp {
        gpu.start_worker(rank, None);
    }
    gpu.service.wait_for_workers(WAIT).unwrap();
    let (mut device_hits, mut host_hits, mut damaged) = (0, 0, 0);
    let mut id = 0;
    for round in 0..6u128 {
        for conversation in 0..8u128 {
            id += 1;
            // Conversation c's prompt: its 4-block prefix, then 4 more blocks per round.
            let prompt = hashes(conversation * 1_000, 4 + 4 * (round as usize % 3));
            let (device, host, bad) = gpu.run_request(id, &prompt);
            device_hits += device;
            host_hits += host;
            damaged += bad;
        }
    }
    assert!(gpu.service.wait_for_copies(WAIT), "every copy lands");
    let copies = gpu.host_copies();
    let host_damage: usize =
        copies.iter().map(|&(hash, block)| gpu.host_block_damage(hash, block)).sum();
    let stats = gpu.service.cache().stats();
    eprintln!(
        "{test}: {id} requests, {device_hits} device hits, {host_hits} host hits (every byte \
         checked: {damaged} regions damaged), {} host copies checked ({host_damage} damaged), \
         swap-ins {}, swap-outs {}, backups {}",
        copies.len(),
        stats.counters.swap_in_blocks,
        stats.counters.swap_out_blocks,
        stats.counters.backup_blocks
    );
    assert_eq!(damaged, 0, "hit blocks hold their bytes");
    assert_eq!(host_damage, 0, "host copies hold their bytes");
    assert!(host_hits > 0 && stats.counters.swap_in_blocks > 0, "blocks came back from host");
    match write_policy {
        WritePolicy::WriteBack => assert!(stats.counters.swap_out_blocks > 0),
        _ => assert!(stats.counters.backup_blocks > 0),
    }
}

#[test]
fn write_back_on_one_rank_keeps_every_byte() {
    every_byte_survives_swaps(WritePolicy::WriteBack, 1);
}

#[test]
fn write_through_on_two_ranks_keeps_every_byte() {
    every_byte_survives_swaps(WritePolicy::WriteThrough, 2);
}

#[test]
fn write_back_on_two_ranks_keeps_every_byte() {
    every_byte_survives_swaps(WritePolicy::WriteBack, 2);
}

#[test]
fn a_worker_killed_mid_swap_is_rolled_back_and_replaced_with_the_host_tier_intact() {
    let cache = CacheConfig::new(BLOCK_TOKENS, 16)
        .with_host_blocks(64)
        .with_write_policy(WritePolicy::WriteBack);
    let mut gpu = GpuService::create("recovery", 2, 4, 64 * 1024, cache);
    gpu.start_worker(0, None);
    // Rank 1 sleeps 150 ms after each layer: its copies are visibly in flight.
    gpu.start_worker(1, Some(150_000));
    gpu.service.wait_for_workers(WAIT).unwrap();

    // Prefix A on device, then pushed to host by prefix B (write-back evictions): B's request
    // takes all 16 device blocks (15 blocks and its last token's).
    let prefix_a = hashes(1_000, 8);
    let prefix_b = hashes(2_000, 15);
    gpu.run_request(1, &prefix_a);
    gpu.run_request(2, &prefix_b);
    let a_on_host: Vec<_> =
        gpu.host_copies().into_iter().filter(|(hash, _)| prefix_a.contains(hash)).collect();
    assert_eq!(a_on_host.len(), 8, "every block of A was written back to host");
    for &(hash, block) in &a_on_host {
        assert_eq!(gpu.host_block_damage(hash, block), 0, "host copy of {hash:?} intact");
    }

    // A again: a swap-in (and write-backs of B), slowed on rank 1; kill rank 1 in the middle.
    let request = RequestId(3);
    let tokens = prefix_a.len() * BLOCK_TOKENS as usize;
    let matched = gpu.service.match_prefix(request, &prefix_a, tokens + 1).unwrap();
    assert_eq!(matched.host_blocks, 8);
    let ticket =
        gpu.service.allocate(request, tokens + 1 - matched.cached_tokens, 0).unwrap().ticket;
    let kill_at = Instant::now() + Duration::from_millis(200);
    while Instant::now() < kill_at {
        gpu.service.poll();
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(
        matches!(gpu.service.ticket_status(ticket), Ok(TicketStatus::Pending)),
        "the swap is still in flight when the worker is killed"
    );
    gpu.kill_worker(1);
    let killed = Instant::now();
    match gpu.service.wait(ticket, WAIT) {
        Err(WaitError::TransferFailed(failure)) => {
            assert_eq!(failure.error, CommandError::WorkerDied);
            assert_eq!(failure.rank, 1);
        }
        other => panic!("the ticket must fail when a rank dies, got {other:?}"),
    }
    eprintln!("recovery: worker death noticed and rolled back after {:?}", killed.elapsed());
    assert_eq!(gpu.service.rank_states()[1], RankState::Down);
    gpu.service.cache().check_invariants().expect("no block leaked by the rollback");
    gpu.service.abort(request).unwrap();

    // A new worker for rank 1; A is still on host byte for byte, and swaps in correctly.
    gpu.start_worker(1, None);
    gpu.service.wait_for_workers(WAIT).unwrap();
    let a_on_host: Vec<_> =
        gpu.host_copies().into_iter().filter(|(hash, _)| prefix_a.contains(hash)).collect();
    assert_eq!(a_on_host.len(), 8);
    for &(hash, block) in &a_on_host {
        assert_eq!(gpu.host_block_damage(hash, block), 0, "host copy of {hash:?} survived");
    }
    let (device_hits, host_hits, damaged) = gpu.run_request(4, &prefix_a);
    assert_eq!(device_hits + host_hits, 8, "all of A hits after the recovery");
    assert!(host_hits > 0, "and some of it came back from host");
    assert_eq!(damaged, 0, "every byte of it");
    assert!(gpu.service.stats().worker_deaths >= 1);
}

#[test]
fn a_swap_in_reports_its_layers_one_by_one_as_they_land() {
    const LAYERS: u32 = 32;
    // A request of 63 blocks takes all 64 device blocks (one more for its last token).
    const BLOCKS: usize = 63;
    let cache = CacheConfig::new(BLOCK_TOKENS, BLOCKS as u32 + 1)
        .with_host_blocks(4 * BLOCKS as u32)
        .with_write_policy(WritePolicy::WriteThrough);
    // 63 blocks of 32 layers x (K, V) x 16 KiB: 63 MiB, about 2 MiB per layer.
    let mut gpu = GpuService::create("layers", 1, LAYERS, 16 * 1024, cache);
    gpu.start_worker(0, None);
    gpu.service.wait_for_workers(WAIT).unwrap();
    let prefix = hashes(7_000, BLOCKS);
    gpu.run_request(1, &prefix);
    assert!(gpu.service.wait_for_copies(WAIT), "the backups land");
    gpu.run_request(2, &hashes(8_000, BLOCKS));
    assert!(gpu.service.wait_for_copies(WAIT));

    let request = RequestId(3);
    let tokens = BLOCKS * BLOCK_TOKENS as usize;
    let matched = gpu.service.match_prefix(request, &prefix, tokens + 1).unwrap();
    assert_eq!(matched.host_blocks, BLOCKS, "the prefix was pushed to host");
    let allocation = gpu.service.allocate(request, tokens + 1 - matched.cached_tokens, 0).unwrap();
    let (table, ticket) = (allocation.block_table.to_vec(), allocation.ticket);
    let started = Instant::now();
    let mut seen: Vec<(u32, Duration)> = Vec::new();
    loop {
        let layers = gpu.service.ticket_layers_ready(ticket).unwrap();
        if seen.last().map(|&(last, _)| last) != Some(layers) {
            seen.push((layers, started.elapsed()));
        }
        if layers == LAYERS {
            break;
        }
        assert!(started.elapsed() < WAIT, "the swap-in landed {layers} of {LAYERS} layers");
    }
    eprintln!(
        "layers: {:?}",
        seen.iter().map(|(layers, at)| (layers, at.as_micros())).collect::<Vec<_>>()
    );
    assert!(seen.windows(2).all(|pair| pair[0].0 < pair[1].0), "layers only grow: {seen:?}");
    let partial = seen.iter().filter(|&&(layers, _)| 0 < layers && layers < LAYERS).count();
    assert!(partial >= 2, "layers were reported before the whole copy landed: {seen:?}");
    gpu.service.wait(ticket, WAIT).unwrap();
    for (&hash, &block) in prefix.iter().zip(&table) {
        assert_eq!(gpu.device_block_damage(hash, block), 0);
    }
    gpu.service.abort(request).unwrap();
    gpu.service.cache().check_invariants().unwrap();
}
