//! What `kvshm bench storage` stores blocks into and loads them from: a back-end called in this
//! process ([`BackendTarget`]), or a real `kvshm worker` process driven through a segment's rings
//! with STORE and LOAD commands ([`WorkerTarget`]), the path the scheduler uses.
//!
//! Both take lists of (block tag, host block) and answer how many blocks were stored or loaded;
//! both split the lists into commands of at most `MAX_STORAGE_ENTRIES` blocks.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvshm_ipc::arena::{Arena, ArenaKind};
use kvshm_ipc::config::SegmentConfig;
use kvshm_ipc::doorbell::{WaitPolicy, DEFAULT_SPIN};
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::record::{CommandHeader, CommandSlot, Completion, Op};
use kvshm_ipc::ring::{Consumer, Producer};
use kvshm_ipc::segment::{Mapped, Segment};
use kvshm_ipc::storage_record::{
    encode_storage_command, storage_pair_count, StorageEntry, StorageResults, MAX_STORAGE_ENTRIES,
};
use kvshm_ipc::worker_slot::RankStatus;

use kvshm::hash::BlockHash;
use kvshm::storage::direct_io::AlignedBuf;
use kvshm::storage::{BlockBytes, BlockBytesMut, BlockKey, GetBlock, PutBlock, StorageBackend};

/// The hash a bench block is stored under: the tag, salted with the run so that runs sharing a
/// Redis never see each other's blocks.
pub fn bench_hash(salt: u64, tag: u64) -> BlockHash {
    BlockHash((u128::from(salt) << 64) | u128::from(tag))
}

/// Something blocks are stored into and loaded from.
pub trait Target {
    /// Stores block `tag` from host block `block` for every pair; how many were stored.
    fn store(&mut self, blocks: &[(u64, u32)]) -> anyhow::Result<usize>;
    /// Loads block `tag` into host block `block` for every pair; how many hit.
    fn load(&mut self, blocks: &[(u64, u32)]) -> anyhow::Result<usize>;
}

/// A back-end called in this process over page-aligned memory standing in for the host tier.
pub struct BackendTarget<'a> {
    pub backend: Box<dyn StorageBackend>,
    pub host: &'a mut AlignedBuf,
    pub block_bytes: usize,
    pub salt: u64,
}

impl Target for BackendTarget<'_> {
    fn store(&mut self, blocks: &[(u64, u32)]) -> anyhow::Result<usize> {
        let mut stored = 0;
        let mut outcomes = Vec::new();
        let host = self.host.as_slice();
        for chunk in blocks.chunks(MAX_STORAGE_ENTRIES) {
            let puts: Vec<PutBlock<'_>> = chunk
                .iter()
                .map(|&(tag, block)| {
                    let hash = bench_hash(self.salt, tag);
                    let start = block as usize * self.block_bytes;
                    PutBlock {
                        key: BlockKey::new(hash, BlockHash(0), 0),
                        bytes: BlockBytes::new(&host[start..start + self.block_bytes]),
                    }
                })
                .collect();
            self.backend.put(&puts, &mut outcomes);
            stored += outcomes.iter().filter(|outcome| outcome.is_ok()).count();
        }
        Ok(stored)
    }

    fn load(&mut self, blocks: &[(u64, u32)]) -> anyhow::Result<usize> {
        let mut hits = 0;
        let mut outcomes = Vec::new();
        for chunk in blocks.chunks(MAX_STORAGE_ENTRIES) {
            // Distinct host blocks: hand out disjoint slices in chunk order.
            let mut by_block: Vec<(u32, u64)> =
                chunk.iter().map(|&(tag, block)| (block, tag)).collect();
            by_block.sort_unstable();
            let mut gets: Vec<GetBlock<'_>> = Vec::with_capacity(chunk.len());
            let mut rest = self.host.as_mut_slice();
            let mut consumed = 0usize;
            for &(block, tag) in &by_block {
                let start = block as usize * self.block_bytes;
                anyhow::ensure!(start >= consumed, "a bench load names host block {block} twice");
                let (_, tail) = std::mem::take(&mut rest).split_at_mut(start - consumed);
                let (dest, tail) = tail.split_at_mut(self.block_bytes);
                rest = tail;
                consumed = start + self.block_bytes;
                gets.push(GetBlock {
                    hash: bench_hash(self.salt, tag),
                    dest: BlockBytesMut::new(dest),
                });
            }
            self.backend.get(&mut gets, &mut outcomes);
            hits += outcomes.iter().filter(|outcome| outcome.is_ok()).count();
        }
        Ok(hits)
    }
}

/// A `kvshm worker --storage …` process on a segment of its own, driven through the rings.
pub struct WorkerTarget {
    segment: Segment,
    commands: Mapped<Producer<CommandSlot>>,
    completions: Mapped<Consumer<Completion>>,
    host: Arena,
    child: Option<Child>,
    next_id: u64,
    salt: u64,
    /// Commands kept in flight at once.
    window: usize,
}

/// How long the bench waits for a worker to attach or a command to complete.
const PATIENCE: Duration = Duration::from_secs(120);

impl WorkerTarget {
    /// Creates segment `name` with `host_blocks` host blocks of `block_bytes` (two regions) and
    /// starts a worker for rank 0 with `storage_args`.
    /// Its stderr goes to `log`, quoted when it fails to attach.
    pub fn start(
        name: &SegmentName,
        block_bytes: usize,
        host_blocks: u32,
        storage_args: &[String],
        salt: u64,
        log: &std::path::Path,
    ) -> anyhow::Result<WorkerTarget> {
        let config = SegmentConfig {
            tp_size: 1,
            device_blocks: 1,
            host_blocks,
            regions: 2,
            layers: 1,
            region_bytes: (block_bytes / 2) as u64,
            command_ring_slots: 1024,
            completion_ring_slots: 64,
            ..SegmentConfig::default()
        };
        let segment = Segment::create(name, &config).context("creating the bench segment")?;
        let host = segment.open_arena(ArenaKind::Host, 0).context("opening the host tier")?;
        let exe = std::env::current_exe().context("locating the kvshm executable")?;
        let child = Command::new(exe)
            .args(["worker", "--name", name.as_str(), "--rank", "0"])
            .args(storage_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).context("creating the worker log")?)
            .spawn()
            .context("spawning the bench worker")?;
        let mut target = WorkerTarget {
            commands: segment.command_producer(0)?,
            completions: segment.completion_consumer(0)?,
            segment,
            host,
            child: Some(child),
            next_id: 1,
            salt,
            window: 8,
        };
        if let Err(error) = target.wait_attached() {
            let said = std::fs::read_to_string(log).unwrap_or_default();
            return Err(error.context(said.trim().to_owned()));
        }
        Ok(target)
    }

    fn wait_attached(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let RankStatus::Alive { .. } = self.segment.rank_status(0)? {
                return Ok(());
            }
            if let Some(child) = &mut self.child {
                if let Some(status) = child.try_wait()? {
                    bail!("the bench worker exited before attaching ({status})");
                }
            }
            if Instant::now() > deadline {
                bail!("the bench worker did not attach within {PATIENCE:?}");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The host tier's bytes, to fill before storing.
    pub fn host_mut(&mut self) -> &mut [u8] {
        // SAFETY: the arena maps data_len() bytes; the worker touches host blocks only while a
        // command naming them is in flight, and none is while the bench holds this slice (it is
        // borrowed from &mut self, which every command needs).
        unsafe { std::slice::from_raw_parts_mut(self.host.data_ptr(), self.host.data_len()) }
    }

    /// Sends the blocks as commands of `op`, keeping `window` in flight; the done bits counted.
    fn run(&mut self, op: Op, blocks: &[(u64, u32)]) -> anyhow::Result<usize> {
        let commands: Vec<Vec<StorageEntry>> = blocks
            .chunks(MAX_STORAGE_ENTRIES)
            .map(|chunk| {
                chunk
                    .iter()
                    .map(|&(tag, block)| {
                        StorageEntry::new(bench_hash(self.salt, tag).0, 0, 0, block)
                    })
                    .collect()
            })
            .collect();
        let (mut sent, mut answered, mut done) = (0usize, 0usize, 0usize);
        let mut slots = Vec::new();
        let mut popped = Vec::new();
        let mut deadline = Instant::now() + PATIENCE;
        while answered < commands.len() {
            while sent < commands.len() && sent - answered < self.window {
                let entries = &commands[sent];
                let header = CommandHeader::new(
                    op,
                    self.next_id,
                    self.segment.generation(),
                    storage_pair_count(entries.len()),
                );
                self.next_id += 1;
                slots.clear();
                encode_storage_command(&header, entries, &mut slots);
                self.commands.push_all(&slots).map_err(|full| anyhow::anyhow!("{full}"))?;
                self.segment.command_doorbell(0)?.ring();
                sent += 1;
            }
            popped.clear();
            self.completions.pop_into(&mut popped, usize::MAX)?;
            if popped.is_empty() {
                if Instant::now() > deadline {
                    bail!("the bench worker answered {answered} of {} commands", commands.len());
                }
                let completions = &mut self.completions;
                self.segment.scheduler_doorbell().wait_until(
                    || completions.len().map_or(true, |len| len > 0),
                    WaitPolicy::new(DEFAULT_SPIN, Duration::from_millis(1))
                        .within(Duration::from_millis(10)),
                );
                continue;
            }
            deadline = Instant::now() + PATIENCE;
            for completion in &popped {
                anyhow::ensure!(completion.is_ok(), "a storage command failed: {completion:?}");
                done += StorageResults::from_detail(completion.detail).done.count_ones() as usize;
            }
            answered += popped.len();
        }
        Ok(done)
    }

    /// Stops the worker (SIGTERM), waiting for it to exit.
    pub fn stop(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            child.wait()?;
        }
        Ok(())
    }
}

impl Target for WorkerTarget {
    fn store(&mut self, blocks: &[(u64, u32)]) -> anyhow::Result<usize> {
        self.run(Op::StorageStore, blocks)
    }

    fn load(&mut self, blocks: &[(u64, u32)]) -> anyhow::Result<usize> {
        self.run(Op::StorageLoad, blocks)
    }
}

impl Drop for WorkerTarget {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}
