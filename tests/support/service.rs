//! Set-up for the tests that run a service (or a transport) with real worker processes: the
//! workers, block bytes written and checked through the ranks' memory, a request run end to end,
//! and polls until a condition holds.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvshm::cli::pattern::{self, RegionIdentity};
use kvshm::hash::BlockHash;
use kvshm::manager::RequestId;
use kvshm::service::{RankMemory, Service};
use kvshm::transport::{Job, Transport};
use kvshm::worker::Geometry;
use kvshm_ipc::name::SegmentName;

/// A `kvshm worker` process for `rank`; killed when dropped.
pub struct WorkerProcess {
    pub child: Child,
}

impl WorkerProcess {
    pub fn spawn(name: &SegmentName, rank: u32, layer_delay_us: Option<u64>) -> WorkerProcess {
        let delay = layer_delay_us.map(|delay| delay.to_string());
        let env: Vec<(&str, &str)> =
            delay.iter().map(|delay| ("KVSHM_WORKER_LAYER_DELAY_US", delay.as_str())).collect();
        WorkerProcess::spawn_with_env(name, rank, &env)
    }

    /// A worker for `rank` with extra environment variables (the test hooks of `kvshm worker`).
    pub fn spawn_with_env(name: &SegmentName, rank: u32, env: &[(&str, &str)]) -> WorkerProcess {
        WorkerProcess::spawn_with(name, rank, &[], env)
    }

    /// A worker for `rank` with extra arguments (a storage tier) and environment variables.
    pub fn spawn_with(
        name: &SegmentName,
        rank: u32,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> WorkerProcess {
        let mut command = Command::new(env!("CARGO_BIN_EXE_kvshm"));
        command
            .args(["worker", "--name", name.as_str(), "--rank", &rank.to_string()])
            .args(args)
            .env_remove("KVSHM_WORKER_LAYER_DELAY_US")
            .env_remove("KVSHM_WORKER_COPY_RATE")
            .stdin(Stdio::null());
        for (key, value) in env {
            command.env(key, value);
        }
        WorkerProcess { child: command.spawn().expect("spawning kvshm worker") }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, and reap it so that it does not linger as a zombie.
    pub fn kill_hard(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).expect("SIGKILL");
        self.child.wait().expect("reaping the killed worker");
    }

    /// Waits for the process to exit on its own; its exit status, or `None` after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        None
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What holds the ranks' block bytes on the host backend: a service, or a transport alone.
pub trait RankBlocks {
    fn geometry(&self) -> &Geometry;
    fn ranks(&self) -> u32;
    fn memory(&self, rank: u32) -> Option<&RankMemory>;
}

impl RankBlocks for Service {
    fn geometry(&self) -> &Geometry {
        Service::geometry(self)
    }
    fn ranks(&self) -> u32 {
        self.rank_states().len() as u32
    }
    fn memory(&self, rank: u32) -> Option<&RankMemory> {
        Service::memory(self, rank)
    }
}

impl<J: Job> RankBlocks for Transport<J> {
    fn geometry(&self) -> &Geometry {
        Transport::geometry(self)
    }
    fn ranks(&self) -> u32 {
        Transport::ranks(self) as u32
    }
    fn memory(&self, rank: u32) -> Option<&RankMemory> {
        Transport::memory(self, rank)
    }
}

/// Writes the pattern bytes of `hash` into device block `block` on every rank and region.
pub fn write_block(service: &impl RankBlocks, hash: BlockHash, block: u32) {
    let regions = service.geometry().regions();
    let mut bytes = vec![0; service.geometry().region_bytes() as usize];
    for rank in 0..service.ranks() {
        for region in 0..regions {
            pattern::fill(RegionIdentity { block_hash: hash.0, region, rank }, &mut bytes);
            service.memory(rank).unwrap().write_device_region(block, region, &bytes).unwrap();
        }
    }
}

/// Whether device block `block` holds the pattern bytes of `hash` on every rank and region.
pub fn device_block_holds(service: &impl RankBlocks, hash: BlockHash, block: u32) -> bool {
    let regions = service.geometry().regions();
    let mut bytes = vec![0; service.geometry().region_bytes() as usize];
    (0..service.ranks()).all(|rank| {
        (0..regions).all(|region| {
            service.memory(rank).unwrap().read_device_region(block, region, &mut bytes).unwrap();
            pattern::verify(RegionIdentity { block_hash: hash.0, region, rank }, &bytes).is_ok()
        })
    })
}

/// Whether host block `block` holds the pattern bytes of `hash` on every rank and region.
pub fn host_block_holds(service: &impl RankBlocks, hash: BlockHash, block: u32) -> bool {
    let regions = service.geometry().regions();
    let mut bytes = vec![0; service.geometry().region_bytes() as usize];
    (0..service.ranks()).all(|rank| {
        (0..regions).all(|region| {
            service.memory(rank).unwrap().read_host_region(block, region, &mut bytes).unwrap();
            pattern::verify(RegionIdentity { block_hash: hash.0, region, rank }, &bytes).is_ok()
        })
    })
}

/// Block hashes `first..first + count`.
pub fn hashes(first: u128, count: usize) -> Vec<BlockHash> {
    (0..count as u128).map(|i| BlockHash(first + i)).collect()
}

/// Runs one request over `hashes` to the end: match, allocate, wait (at most `wait`) for its
/// copies, check that the hit blocks hold their bytes, write the new blocks, commit, finish.
/// Returns how many blocks hit on device and on host.
pub fn run_request(
    service: &mut Service,
    id: u64,
    hashes: &[BlockHash],
    wait: Duration,
) -> (usize, usize) {
    let request = RequestId(id);
    let tokens = hashes.len() * service.cache().config().block_tokens as usize;
    let matched = service.match_prefix(request, hashes, tokens).unwrap();
    let allocation = service.allocate(request, tokens - matched.cached_tokens, 0).unwrap();
    let (table, ticket) = (allocation.block_table.to_vec(), allocation.ticket);
    service.wait(ticket, wait).expect("the request's copies land");
    for (index, &block) in table.iter().enumerate() {
        if index < matched.blocks() {
            assert!(device_block_holds(service, hashes[index], block), "hit block {index} intact");
        } else {
            write_block(service, hashes[index], block);
        }
    }
    service.commit(request, tokens, hashes).unwrap();
    service.finish(request).unwrap();
    service.cache().check_invariants().unwrap();
    (matched.device_blocks, matched.host_blocks)
}

/// Caches `hashes` as the new blocks of `request` (their bytes written, committed, finished)
/// and polls once: under write-through, that issues their backup to the host tier.
pub fn commit_new_blocks(service: &mut Service, request: RequestId, hashes: &[BlockHash]) {
    let tokens = hashes.len() * service.cache().config().block_tokens as usize;
    service.match_prefix(request, hashes, tokens).unwrap();
    let table = service.allocate(request, tokens, 0).unwrap().block_table.to_vec();
    for (&hash, &block) in hashes.iter().zip(&table) {
        write_block(service, hash, block);
    }
    service.commit(request, tokens, hashes).unwrap();
    service.finish(request).unwrap();
    service.poll();
}

/// As [`commit_new_blocks`] under write-through, then checks that the backup is in flight and
/// gives the worker a moment to pop it (it is then copying).
pub fn start_backup(service: &mut Service, request: RequestId, hashes: &[BlockHash]) {
    commit_new_blocks(service, request, hashes);
    assert_eq!(service.cache().transfers_in_flight(), 1, "the backup is in flight");
    std::thread::sleep(Duration::from_millis(20));
}

/// Polls `service` until `done` holds, failing with `what` once `within` has passed without it;
/// returns how long it took.
pub fn poll_until(
    service: &mut Service,
    within: Duration,
    what: &str,
    mut done: impl FnMut(&Service) -> bool,
) -> Duration {
    let started = Instant::now();
    while !done(service) {
        assert!(started.elapsed() < within, "{what}");
        service.poll();
        std::thread::sleep(Duration::from_millis(2));
    }
    started.elapsed()
}
