//! [`HostTier`]: one rank's shared-memory host tier and the copies in and out of it, for an
//! engine that keeps its own KV tensors (vLLM's offloading worker, one per TP rank).
//!
//! Each rank gets its own segment (TP size 1): the engine's worker process creates it and drives
//! its rings, so no other process stands between it and its copies. The segment's host arena
//! holds the chunks; the device tier is the engine's tensors, reached in one of two ways:
//! - [`TierEngine::InProcess`]: the tensors are in this process's memory (CPU tensors); copies run
//!   in the calling thread, and a job is done when `submit` returns;
//! - [`TierEngine::Workers`]: the tensors are on a GPU; the engine publishes their CUDA IPC
//!   handles ([`HostTier::publish_device_handles`]) and a `kvshm worker --backend cuda` process
//!   copies, driven through the rings of the tier's [`Transport`] as direct copies
//!   ([`crate::transport::direct`]), which a worker crash does not fail: they are issued again on
//!   the restarted worker.
//!
//! The segment is the transport's alone: no cache manager sits on it (the engine's scheduler
//! keeps an [`super::OffloadManager`] in its own process). Its header names the tier's shape and
//! who copies (the engine's process, or workers).
//!
//! One job: 1. [`HostTier::submit`] plans its pairs ([`EngineLayout::plan`]); 2. copies them or
//! hands them to the worker; 3. [`HostTier::poll`] collects the workers' outcomes; 4.
//! [`HostTier::take_finished`] hands out the results.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvshm_ipc::arena::{Arena, ArenaError, ArenaKind};
use kvshm_ipc::device_handles::{DeviceHandleError, DeviceRegionHandle};
use kvshm_ipc::doorbell::deadline_after;
use kvshm_ipc::name::SegmentName;

use super::key::OffloadKey;
use super::key_table::KeyTable;
use super::shared::{open_rank_arena, TierArenaError};
use super::tensor_memory::{CopyError, TensorMemory};
use super::transfer::{Direction, EngineLayout, PlanError};
pub use crate::transport::Backend;
use crate::transport::{
    CompletionBell, CopyKind, Counter, DirectCopyId, DirectCopyOutcome, RankMemory, RankState,
    SegmentConfig, SegmentError, Transport, TransportConfig, TransportError,
    DEFAULT_COMMAND_RING_SLOTS, DEFAULT_COMPLETION_RING_SLOTS, WAIT_SLICE,
};

/// How the host tier reaches the engine's tensors.
#[derive(Debug)]
pub enum TierEngine {
    /// The tensors are in this process's memory: copies run in process.
    InProcess(TensorMemory),
    /// A kvshm worker process copies: on `Backend::Cuda` between the engine's GPU tensors (their
    /// IPC handles published) and the host tier; on `Backend::HostArena` the device tier is a
    /// shared-memory arena of the segment (machines without a GPU, and tests).
    Workers(Backend),
}

/// Why a host tier cannot be made or a job cannot be taken; nothing was copied.
#[derive(Debug, thiserror::Error)]
pub enum HostTierError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Copy(#[from] CopyError),
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("opening the host tier: {0}")]
    Arena(#[from] ArenaError),
    #[error(transparent)]
    DeviceHandles(#[from] DeviceHandleError),
    #[error(
        "group {group} uses {used} of the {tensors} tensors: a worker process copies whole \
         blocks, so every KV-cache group must span all tensors (use CPU tensors, or a model with \
         one KV-cache group)"
    )]
    PartialGroup { group: usize, used: usize, tensors: u32 },
    #[error("job {job} is already in flight")]
    DuplicateJob { job: u64 },
    #[error("the tensors are in this process; there are no device handles to publish")]
    NoWorkers,
    #[error("{keys} keys for a store of {chunks} chunks")]
    KeyCount { keys: usize, chunks: usize },
    #[error("reading the host tier's keys: {0}")]
    Attach(#[from] kvshm_ipc::segment::AttachError),
    #[error(transparent)]
    SharedArena(#[from] TierArenaError),
    #[error("a shared tier keeps no key table of its own: warm restart is the tier owner's")]
    SharedTierPersistent,
}

/// How one job ended.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct JobResult {
    pub job: u64,
    pub success: bool,
    /// Bytes moved.
    pub bytes: u64,
    /// Seconds from submit to completion.
    pub seconds: f64,
}

/// How a tier is made beyond its copy layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierOptions {
    /// Tokens of one device block (the segment header's, for `kvctl stat`).
    pub block_tokens: u32,
    /// Model layers whose KV the tensors hold; the header's `layers` when it divides the tensor
    /// count (the header's rule), else 1.
    pub layers: u32,
    /// Keep the tier's chunks and a [`KeyTable`] of their keys across engine restarts: the
    /// arena outlives the tier (a clean close and a crash alike), and the next tier of the same
    /// name and shape takes it over ([`HostTier::restored`]).
    pub persistent: bool,
}

impl Default for TierOptions {
    fn default() -> Self {
        TierOptions { block_tokens: 1, layers: 1, persistent: false }
    }
}

/// A store's key for one chunk, written to the [`KeyTable`] of a persistent tier once the
/// chunk's copy succeeded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoredKey {
    pub key: OffloadKey,
    /// The chunk of the key it is chained under, or [`super::key_table::NO_PARENT`].
    pub parent_chunk: u32,
    /// The epoch of the manager that chose the store ([`super::key_table`]): a reset since
    /// makes the key stale.
    pub epoch: u32,
}

/// What the tier copied, published as the segment's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopyTotals {
    pub jobs: u64,
    /// Device blocks written into the host tier (stores).
    pub blocks_stored: u64,
    /// Device blocks written from the host tier (loads).
    pub blocks_loaded: u64,
    pub bytes: u64,
    /// Time spent copying in process.
    pub copy_ns: u64,
    pub failed_jobs: u64,
}

/// One rank's host tier (module flow).
pub struct HostTier {
    layout: EngineLayout,
    transport: Transport,
    host: Arena,
    engine: TierEngine,
    /// Jobs handed to the worker: copy id -> (job, submitted at).
    jobs: HashMap<DirectCopyId, (u64, Instant)>,
    finished: Vec<JobResult>,
    outcomes: Vec<DirectCopyOutcome>,
    /// Per job handed to the worker: its direction and blocks, counted when it ends.
    job_blocks: HashMap<DirectCopyId, (Direction, u64)>,
    totals: CopyTotals,
    /// A persistent tier's table, and the keys of each store job in flight to a worker.
    table: Option<KeyTable>,
    job_keys: HashMap<DirectCopyId, Vec<(u32, StoredKey)>>,
    restored: bool,
}

impl HostTier {
    /// Creates segment `name` with a host arena of `layout.chunks * layout.blocks_per_chunk`
    /// blocks of `layout.host_block_bytes()`.
    pub fn create(
        name: &SegmentName,
        layout: EngineLayout,
        engine: TierEngine,
    ) -> Result<HostTier, HostTierError> {
        HostTier::create_with(name, layout, engine, TierOptions::default())
    }

    /// [`create`](Self::create), with [`TierOptions`].
    pub fn create_with(
        name: &SegmentName,
        layout: EngineLayout,
        engine: TierEngine,
        labels: TierOptions,
    ) -> Result<HostTier, HostTierError> {
        HostTier::make(name, layout, engine, labels, None)
    }

    /// A tier whose chunks are rank `rank`'s arena of the shared tier `tier` (DESIGN §12.2),
    /// copied by `engine`: in this process, or by workers started with `--shared-tier TIER
    /// --shared-tier-rank RANK` (Python's `CudaHostTier` starts them so). Segment `name` is this
    /// engine's own (its rings and counters) and holds no host arena. The tier has as many
    /// chunks as the arena holds (the owner's index hands out any of them), whatever
    /// `layout.chunks` says.
    ///
    /// # Errors
    /// [`HostTierError::SharedArena`] when the tier's arena is missing or holds other blocks,
    /// [`HostTierError::SharedTierPersistent`] for a persistent tier.
    pub fn create_on_shared_tier(
        name: &SegmentName,
        layout: EngineLayout,
        engine: TierEngine,
        labels: TierOptions,
        tier: &SegmentName,
        rank: u32,
    ) -> Result<HostTier, HostTierError> {
        HostTier::make(name, layout, engine, labels, Some((tier, rank)))
    }

    fn make(
        name: &SegmentName,
        mut layout: EngineLayout,
        engine: TierEngine,
        labels: TierOptions,
        shared: Option<(&SegmentName, u32)>,
    ) -> Result<HostTier, HostTierError> {
        if shared.is_some() && labels.persistent {
            return Err(HostTierError::SharedTierPersistent);
        }
        // A shared tier is as large as its arenas: its owner hands out chunks of all of them.
        let shared_arena = match shared {
            Some((tier, rank)) => {
                let per_chunk = u64::from(layout.blocks_per_chunk.max(1));
                let arena = open_rank_arena(
                    tier,
                    rank,
                    per_chunk,
                    layout.page_bytes * u64::from(layout.tensors),
                )?;
                layout.chunks = u32::try_from(arena.blocks() / per_chunk).unwrap_or(u32::MAX);
                Some(arena)
            }
            None => None,
        };
        layout.validate()?;
        if let TierEngine::Workers(_) = engine {
            for (group, tensors) in layout.groups.iter().enumerate() {
                let mut used = tensors.clone();
                used.sort_unstable();
                used.dedup();
                if used.len() != layout.tensors as usize {
                    return Err(HostTierError::PartialGroup {
                        group,
                        used: used.len(),
                        tensors: layout.tensors,
                    });
                }
            }
        }
        let layers = if labels.layers > 0 && layout.tensors % labels.layers == 0 {
            labels.layers
        } else {
            1
        };
        let table_blocks = if labels.persistent {
            KeyTable::blocks(layout.chunks, layout.host_block_bytes())
        } else {
            0
        };
        // A shared tier's chunks are in its arenas, not the segment's: the segment counts them
        // (its workers check host ids against them) and makes none (`host_tier`).
        let host_blocks =
            u32::try_from(u64::from(layout.host_blocks()?) + table_blocks).map_err(|_| {
                PlanError::TooManyHostBlocks {
                    chunks: layout.chunks,
                    blocks_per_chunk: layout.blocks_per_chunk,
                }
            })?;
        let segment = SegmentConfig {
            block_tokens: labels.block_tokens.max(1),
            tp_size: 1,
            device_blocks: layout.device_blocks,
            host_blocks,
            regions: layout.tensors,
            layers,
            region_bytes: layout.page_bytes,
            command_ring_slots: DEFAULT_COMMAND_RING_SLOTS,
            completion_ring_slots: DEFAULT_COMPLETION_RING_SLOTS,
            backend: match engine {
                // The device tier is the engine's own memory, never an arena of the segment.
                TierEngine::InProcess(_) => Backend::Cuda,
                TierEngine::Workers(backend) => backend,
            }
            .to_wire(),
            copies: match engine {
                TierEngine::InProcess(_) => SegmentConfig::COPIES_IN_ENGINE,
                TierEngine::Workers(_) => SegmentConfig::COPIES_BY_WORKERS,
            },
            kind: SegmentConfig::KIND_ENGINE_HOST_TIER,
            host_tier: match shared {
                Some(_) => SegmentConfig::HOST_TIER_SHARED,
                None => SegmentConfig::HOST_TIER_OWN,
            },
            ..SegmentConfig::default()
        };
        let config = TransportConfig {
            layerwise: false,
            keep_host_tier: labels.persistent,
            shared_tier: shared.map(|(tier, rank)| (tier.clone(), rank)),
            ..TransportConfig::new(segment)
        };
        let mut transport = Transport::create(name, &config)?;
        let host = match shared_arena {
            Some(arena) => arena,
            None => transport.segment().open_arena(ArenaKind::Host, 0)?,
        };
        let (table, restored) = if labels.persistent {
            transport.keep_host_tier_on_drop();
            let (table, kept) = KeyTable::open(&host, &layout, transport.host_tier_kept(0))?;
            (Some(table), kept)
        } else {
            (None, false)
        };
        let tier = HostTier {
            layout,
            transport,
            host,
            engine,
            jobs: HashMap::new(),
            finished: Vec::new(),
            outcomes: Vec::new(),
            job_blocks: HashMap::new(),
            totals: CopyTotals::default(),
            table,
            job_keys: HashMap::new(),
            restored,
        };
        let counters = tier.transport.segment().counters();
        counters.set(Counter::DeviceBlocksTotal, u64::from(tier.layout.device_blocks));
        counters.set(Counter::HostBlocksTotal, u64::from(tier.layout.host_blocks()?));
        tier.publish_totals();
        Ok(tier)
    }

    /// What the tier copied so far.
    pub fn totals(&self) -> CopyTotals {
        self.totals
    }

    /// Whether this persistent tier took over the chunks and key table an earlier tier of its
    /// name and shape left (the engine's manager then reads the keys back with
    /// [`super::key_table::read_tier_keys`]).
    pub fn restored(&self) -> bool {
        self.restored
    }

    /// Stores [`CopyTotals`] in the segment's counters (`kvctl stat`), after the transport's
    /// own: blocks loaded as swaps in, blocks stored as swaps out; in-process copies also as
    /// commands and as the workers' copy time.
    fn publish_totals(&self) {
        self.transport.publish_counters();
        let counters = self.transport.segment().counters();
        let totals = &self.totals;
        counters.set(Counter::SwapsIn, totals.blocks_loaded);
        counters.set(Counter::SwapsOut, totals.blocks_stored);
        counters.set(Counter::BytesCopied, totals.bytes);
        match self.engine {
            TierEngine::InProcess(_) => {
                counters.set(Counter::CommandsIssued, totals.jobs);
                counters.set(Counter::CommandsCompleted, totals.jobs);
                counters.set(Counter::CopyFailures, totals.failed_jobs);
                counters.set(Counter::WorkerCopyBytes, totals.bytes);
                counters.set(Counter::WorkerCopyNs, totals.copy_ns);
            }
            TierEngine::Workers(_) => {
                counters.set(Counter::CopyFailures, self.transport.stats().copy_failures);
            }
        }
    }

    fn count_job(&mut self, direction: Direction, blocks: u64, bytes: u64, success: bool) {
        self.totals.jobs += 1;
        if !success {
            self.totals.failed_jobs += 1;
            return;
        }
        match direction {
            Direction::Store => self.totals.blocks_stored += blocks,
            Direction::Load => self.totals.blocks_loaded += blocks,
        }
        self.totals.bytes += bytes;
    }

    pub fn name(&self) -> &SegmentName {
        self.transport.segment().name()
    }

    pub fn layout(&self) -> &EngineLayout {
        &self.layout
    }

    /// Publishes the CUDA IPC handles of the engine's tensors, one per tensor, for the worker.
    pub fn publish_device_handles(
        &self,
        handles: &[DeviceRegionHandle],
    ) -> Result<(), HostTierError> {
        if let TierEngine::InProcess(_) = self.engine {
            return Err(HostTierError::NoWorkers);
        }
        Ok(self.transport.segment().publish_device_handles(0, handles)?)
    }

    /// The device arena of a `Workers(Backend::HostArena)` tier, where the engine's blocks live.
    pub fn device_memory(&self) -> Option<&RankMemory> {
        self.transport.memory(0)
    }

    /// Whether the rank has a live worker (always true for in-process copies).
    pub fn worker_up(&self) -> bool {
        match self.engine {
            TierEngine::InProcess(_) => true,
            TierEngine::Workers(_) => self
                .transport
                .rank_states()
                .iter()
                .all(|state| matches!(state, RankState::Up { .. })),
        }
    }

    /// Copies between the engine's device blocks and the host chunks (module flow, steps 1, 2):
    /// `device` grouped by `group_sizes`, each group starting at request block
    /// `block_indices[g]`; `chunks` in key order.
    pub fn submit(
        &mut self,
        job: u64,
        direction: Direction,
        device: &[i64],
        group_sizes: &[i64],
        block_indices: &[i64],
        chunks: &[i64],
    ) -> Result<(), HostTierError> {
        self.submit_keyed(job, direction, device, group_sizes, block_indices, chunks, &[])
    }

    /// [`submit`](Self::submit), with a store's keys, one per chunk in `chunks` order (or none):
    /// a persistent tier writes them into its key table once the copy succeeded. A store on a
    /// persistent tier always clears its chunks' slots first, keys or not.
    #[allow(clippy::too_many_arguments)]
    pub fn submit_keyed(
        &mut self,
        job: u64,
        direction: Direction,
        device: &[i64],
        group_sizes: &[i64],
        block_indices: &[i64],
        chunks: &[i64],
        keys: &[StoredKey],
    ) -> Result<(), HostTierError> {
        if self.jobs.values().any(|&(pending, _)| pending == job) {
            return Err(HostTierError::DuplicateJob { job });
        }
        if !keys.is_empty() && keys.len() != chunks.len() {
            return Err(HostTierError::KeyCount { keys: keys.len(), chunks: chunks.len() });
        }
        let started = Instant::now();
        let copies = self.layout.plan(direction, device, group_sizes, block_indices, chunks)?;
        let blocks = copies.iter().map(|copy| copy.pairs.len() as u64).sum();
        // The plan checked every chunk id against the tier.
        let chunk_ids = chunks.iter().map(|&chunk| chunk as u32);
        let stored: Vec<(u32, StoredKey)> = chunk_ids.clone().zip(keys.iter().copied()).collect();
        if let (Some(table), Direction::Store) = (&self.table, direction) {
            for chunk in chunk_ids {
                table.clear(&self.host, chunk)?;
            }
        }
        match &self.engine {
            TierEngine::InProcess(memory) => {
                let mut bytes = 0;
                for copy in &copies {
                    bytes += memory.copy(&self.layout, &self.host, direction, copy)?;
                }
                if let Some(table) = &mut self.table {
                    for (chunk, stored) in &stored {
                        table.write(
                            &self.host,
                            *chunk,
                            &stored.key,
                            stored.parent_chunk,
                            stored.epoch,
                        )?;
                    }
                }
                let elapsed = started.elapsed();
                self.totals.copy_ns += u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
                self.count_job(direction, blocks, bytes, true);
                self.publish_totals();
                let seconds = elapsed.as_secs_f64();
                self.finished.push(JobResult { job, success: true, bytes, seconds });
            }
            TierEngine::Workers(_) => {
                let kind = match direction {
                    Direction::Store => CopyKind::DeviceToHost,
                    Direction::Load => CopyKind::HostToDevice,
                };
                let pairs = copies.into_iter().flat_map(|copy| copy.pairs).collect();
                let id = self.transport.submit_direct_copy(kind, pairs);
                self.jobs.insert(id, (job, started));
                self.job_blocks.insert(id, (direction, blocks));
                if self.table.is_some() && !stored.is_empty() {
                    self.job_keys.insert(id, stored);
                }
                self.collect();
            }
        }
        Ok(())
    }

    /// Reaps the worker's completions, watches it, and collects ended jobs (step 3). Either way
    /// it marks the engine as polling for `kvctl stat`: an in-process tier has nothing else to
    /// do here, and would read as stopped between jobs otherwise.
    pub fn poll(&mut self) {
        let now = kvshm_ipc::liveness::monotonic_ns();
        self.transport.segment().counters().set(Counter::LastPollNs, now);
        if let TierEngine::Workers(_) = self.engine {
            self.transport.poll();
            self.transport.pump();
            self.collect();
        }
    }

    /// Moves the results of ended jobs into `out` (step 4).
    pub fn take_finished(&mut self, out: &mut Vec<JobResult>) {
        self.poll();
        out.append(&mut self.finished);
    }

    /// Jobs not ended yet.
    pub fn pending(&self) -> usize {
        self.jobs.len()
    }

    /// Polls until none of `jobs` is pending or `timeout` passes; returns whether none is. Sleeps
    /// on the scheduler doorbell between polls, as [`crate::service::Service::wait`] does.
    pub fn wait(&mut self, jobs: &[u64], timeout: Duration) -> bool {
        let deadline = deadline_after(timeout);
        loop {
            if self.poll_jobs(jobs) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            self.transport.sleep_until_completion(deadline.min(now + WAIT_SLICE));
        }
    }

    /// One step of [`wait`](Self::wait): polls, then says whether none of `jobs` is pending.
    pub fn poll_jobs(&mut self, jobs: &[u64]) -> bool {
        self.poll();
        !self.jobs.values().any(|(job, _)| jobs.contains(job))
    }

    /// What a thread needs to sleep until the worker answers without holding the tier (see
    /// [`CompletionBell`]); [`poll_jobs`](Self::poll_jobs) is the step between sleeps.
    pub fn completion_bell(&self) -> Result<CompletionBell, SegmentError> {
        self.transport.completion_bell()
    }

    /// The bytes of host block `block` (every tensor's page), for checks and tools. Read with
    /// atomic accesses: a copy writing the block meanwhile makes them a mix, never undefined.
    pub fn host_block(&self, block: u32) -> Option<Vec<u8>> {
        if block >= self.layout.host_blocks().ok()? {
            return None;
        }
        let bytes = self.layout.host_block_bytes() as usize;
        let mut out = vec![0; bytes];
        self.host.read_data(block as usize * bytes, &mut out).ok()?;
        Some(out)
    }

    fn collect(&mut self) {
        self.transport.take_direct_outcomes(&mut self.outcomes);
        let mut outcomes = std::mem::take(&mut self.outcomes);
        for outcome in outcomes.drain(..) {
            let Some((job, started)) = self.jobs.remove(&outcome.id) else { continue };
            let success = outcome.result.is_ok();
            if let Some((direction, blocks)) = self.job_blocks.remove(&outcome.id) {
                self.count_job(direction, blocks, outcome.bytes, success);
            }
            let keys = self.job_keys.remove(&outcome.id);
            if let (Some(table), Some(keys), true) = (&mut self.table, keys, success) {
                for (chunk, stored) in keys {
                    // A table write that fails leaves the slot cleared: a miss after a restart.
                    let _ = table.write(
                        &self.host,
                        chunk,
                        &stored.key,
                        stored.parent_chunk,
                        stored.epoch,
                    );
                }
            }
            self.finished.push(JobResult {
                job,
                success,
                bytes: outcome.bytes,
                seconds: started.elapsed().as_secs_f64(),
            });
        }
        self.outcomes = outcomes;
        self.publish_totals();
    }
}
