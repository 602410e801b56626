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
//!   copies, driven through the rings as direct copies ([`crate::service`]), which a worker crash
//!   does not fail: they are issued again on the restarted worker.
//!
//! One job: 1. [`HostTier::submit`] plans its pairs ([`EngineLayout::plan`]); 2. copies them or
//! hands them to the worker; 3. [`HostTier::poll`] collects the workers' outcomes; 4.
//! [`HostTier::take_finished`] hands out the results.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvshm_ipc::arena::{Arena, ArenaError, ArenaKind};
pub use kvshm_ipc::config::Backend;
use kvshm_ipc::device_handles::{DeviceHandleError, DeviceRegionHandle};
use kvshm_ipc::doorbell::deadline_after;
use kvshm_ipc::name::SegmentName;

use super::tensor_memory::{CopyError, TensorMemory};
use super::transfer::{Direction, EngineLayout, PlanError};
use crate::manager::{CacheConfig, TransferKind};
use crate::service::{
    CompletionBell, DirectCopyId, DirectCopyOutcome, Service, ServiceConfig, ServiceError,
    WAIT_SLICE,
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
    Service(#[from] ServiceError),
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

/// One rank's host tier (module flow).
pub struct HostTier {
    layout: EngineLayout,
    service: Service,
    host: Arena,
    engine: TierEngine,
    /// Jobs handed to the worker: copy id -> (job, submitted at).
    jobs: HashMap<DirectCopyId, (u64, Instant)>,
    finished: Vec<JobResult>,
    outcomes: Vec<DirectCopyOutcome>,
}

impl HostTier {
    /// Creates segment `name` with a host arena of `layout.chunks * layout.blocks_per_chunk`
    /// blocks of `layout.host_block_bytes()`.
    pub fn create(
        name: &SegmentName,
        layout: EngineLayout,
        engine: TierEngine,
    ) -> Result<HostTier, HostTierError> {
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
        let cache =
            CacheConfig::new(1, layout.device_blocks).with_host_blocks(layout.host_blocks()?);
        let mut config = ServiceConfig::new(cache, 1, 1, layout.tensors, layout.page_bytes);
        config.backend = match engine {
            // The device tier is the engine's own memory, never an arena of the segment.
            TierEngine::InProcess(_) => Backend::Cuda,
            TierEngine::Workers(backend) => backend,
        };
        config.layerwise = false;
        let service = Service::create(name, config)?;
        let host = service.segment().open_arena(ArenaKind::Host, 0)?;
        Ok(HostTier {
            layout,
            service,
            host,
            engine,
            jobs: HashMap::new(),
            finished: Vec::new(),
            outcomes: Vec::new(),
        })
    }

    pub fn name(&self) -> &SegmentName {
        self.service.segment().name()
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
        Ok(self.service.segment().publish_device_handles(0, handles)?)
    }

    /// The device arena of a `Workers(Backend::HostArena)` tier, where the engine's blocks live.
    pub fn device_memory(&self) -> Option<&crate::service::RankMemory> {
        self.service.memory(0)
    }

    /// Whether the rank has a live worker (always true for in-process copies).
    pub fn worker_up(&self) -> bool {
        match self.engine {
            TierEngine::InProcess(_) => true,
            TierEngine::Workers(_) => self
                .service
                .rank_states()
                .iter()
                .all(|state| matches!(state, crate::service::RankState::Up { .. })),
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
        if self.jobs.values().any(|&(pending, _)| pending == job) {
            return Err(HostTierError::DuplicateJob { job });
        }
        let started = Instant::now();
        let copies = self.layout.plan(direction, device, group_sizes, block_indices, chunks)?;
        match &self.engine {
            TierEngine::InProcess(memory) => {
                let mut bytes = 0;
                for copy in &copies {
                    bytes += memory.copy(&self.layout, &self.host, direction, copy)?;
                }
                let seconds = started.elapsed().as_secs_f64();
                self.finished.push(JobResult { job, success: true, bytes, seconds });
            }
            TierEngine::Workers(_) => {
                let kind = match direction {
                    Direction::Store => TransferKind::DeviceToHost,
                    Direction::Load => TransferKind::HostToDevice,
                };
                let pairs = copies.into_iter().flat_map(|copy| copy.pairs).collect();
                let id = self.service.submit_direct_copy(kind, pairs);
                self.jobs.insert(id, (job, started));
                self.collect();
            }
        }
        Ok(())
    }

    /// Reaps the worker's completions, watches it, and collects ended jobs (step 3).
    pub fn poll(&mut self) {
        if let TierEngine::Workers(_) = self.engine {
            self.service.poll();
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
    /// on the scheduler doorbell between polls, as [`Service::wait`] does.
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
            self.service.sleep_until_completion(deadline.min(now + WAIT_SLICE));
        }
    }

    /// One step of [`wait`](Self::wait): polls, then says whether none of `jobs` is pending.
    pub fn poll_jobs(&mut self, jobs: &[u64]) -> bool {
        self.poll();
        !self.jobs.values().any(|(job, _)| jobs.contains(job))
    }

    /// What a thread needs to sleep until the worker answers without holding the tier (see
    /// [`CompletionBell`]); [`poll_jobs`](Self::poll_jobs) is the step between sleeps.
    pub fn completion_bell(&self) -> Result<CompletionBell, ServiceError> {
        Ok(self.service.completion_bell()?)
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
        self.service.take_direct_outcomes(&mut self.outcomes);
        for outcome in self.outcomes.drain(..) {
            let Some((job, started)) = self.jobs.remove(&outcome.id) else { continue };
            self.finished.push(JobResult {
                job,
                success: outcome.result.is_ok(),
                bytes: outcome.bytes,
                seconds: started.elapsed().as_secs_f64(),
            });
        }
    }
}
