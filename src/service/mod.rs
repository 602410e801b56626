//! The running service: the cache manager wired to the segment and the worker processes.
//!
//! [`Service`] lives inside the engine's scheduler process, on one thread. It owns the segment
//! (created by name), the [`CacheManager`], one [`RankChannel`] per tensor-parallel rank and the
//! [`CommandTracker`] that joins per-rank completions into per-transfer outcomes.
//!
//! One swap-in, start to end:
//!
//! 1. the engine calls [`Service::allocate`]; the manager claims blocks and queues a host-to-device
//!    transfer, returning a ticket;
//! 2. [`Service::wait`] (or any [`Service::poll`]) takes the transfer, encodes one command per rank
//!    (several if its pair list is longer than a ring can hold), queues them on every rank and
//!    pumps them into the command rings as credits allow, ringing each worker's doorbell;
//! 3. every worker copies its rank's bytes and pushes a completion, ringing the scheduler doorbell;
//! 4. `poll` reaps completions; when the last command of the transfer has completed on every rank,
//!    the tracker hands the outcome to the manager, which applies the transition (or rolls it back
//!    on any failure) and settles the ticket;
//! 5. `wait` returns once the ticket is ready, or with the failure.
//!
//! `poll` also watches the workers (a dead one fails its commands, and its rank is reclaimed so
//! that a new worker can attach), probes a storage tier that is down ([`tier_probe`]), carries
//! out kvctl's requests (reset, tree snapshot) and publishes the live counters kvctl reads.

mod control;
mod deadline;
mod direct;
mod inflight;
mod liveness;
mod memory;
mod rank;
mod storage_meta;
#[cfg(test)]
mod tests;
mod tier_probe;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvshm_ipc::arena::ArenaKind;
use kvshm_ipc::config::SegmentConfig;
use kvshm_ipc::doorbell::{deadline_after, DEFAULT_SPIN};
use kvshm_ipc::record::{
    command_slot_count, BlockPair, CommandError, CommandHeader, Op, FLAG_LAYERWISE, PAIRS_PER_SLOT,
};
use kvshm_ipc::ring::RingError;
use kvshm_ipc::worker_watch::WorkerWatch;
use tracing::{info, warn};

use crate::hash::BlockHash;
use crate::manager::{
    AllocateError, Allocation, AllocationCheck, BlockOutcome, CacheConfig, CacheManager,
    CommitError, Committed, ConfigError as CacheConfigError, FinishError, MatchError,
    PrefetchError, PrefixMatch, RequestId, ResetError, ResizeError, TicketError, TicketId,
    TicketStatus, Transfer, TransferFailure, TransferId, TransferKind, TransferStage,
};
use crate::worker::{Geometry, GeometryError, GeometryParams};

pub use deadline::DEFAULT_COMMAND_DEADLINE;
pub use direct::{DirectCopyId, DirectCopyOutcome};
pub use inflight::{CommandTracker, CompletionMismatch, RankFailure};
// The shared-memory types that appear in this module's API, so that an engine needs no direct
// dependency on kvshm-ipc.
pub use kvshm_ipc::arena::ArenaError;
pub use kvshm_ipc::config::Backend;
pub use kvshm_ipc::counters::Counter;
pub use kvshm_ipc::device_handles::{DeviceHandleError, DeviceRegionHandle, CUDA_IPC_HANDLE_BYTES};
pub use kvshm_ipc::doorbell::{WaitOutcome, WaitPolicy};
pub use kvshm_ipc::name::{NameError, SegmentName};
pub use kvshm_ipc::segment::{CompletionBell, CreateError, Segment, SegmentError};
pub use memory::{BlockAccessError, RankMemory};
pub use rank::{RankChannel, RankState};
pub use tier_probe::{TierBackoff, TierBackoffError, DEFAULT_TIER_BACKOFF};

/// How long `wait` sleeps on the doorbell before it polls again (and so checks liveness).
pub const WAIT_SLICE: Duration = Duration::from_millis(5);
/// How long `wait` spins on the doorbell before it sleeps: a copy of a few blocks often lands
/// within it, and it is about what a wake-up would cost (`kvshm_ipc::doorbell`, "How long to
/// spin").
pub const WAIT_SPIN: Duration = DEFAULT_SPIN;
/// Completions reaped per ring per batch.
const REAP_BATCH: usize = 256;
/// The most bytes one command asks one rank to copy, unless configured otherwise.
pub const DEFAULT_MAX_COMMAND_BYTES: u64 = 64 * 1024 * 1024;

/// The shape of every rank's blocks and the service's rings.
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    pub cache: CacheConfig,
    pub tp_size: u32,
    pub layers: u32,
    /// Regions per block per rank (a multiple of `layers`).
    pub regions: u32,
    pub region_bytes: u64,
    pub backend: Backend,
    pub command_ring_slots: u32,
    pub completion_ring_slots: u32,
    /// Ask workers for per-layer progress of every copy.
    pub layerwise: bool,
    /// The most bytes one command asks one rank to copy (all its layers together): transfers are
    /// split into commands of at most this many bytes (at least one block each), so that one
    /// command ends within a bounded time (the command deadline relies on it).
    pub max_command_bytes: u64,
    /// How long a rank that owes answers may give none before its worker is fenced and its
    /// commands fail, as if it had crashed (`deadline` module).
    pub command_deadline: Duration,
    /// How long to wait before probing a storage tier that is down, and how that wait grows
    /// (`tier_probe` module).
    pub storage_backoff: TierBackoff,
    /// The segment is an engine's host tier ([`crate::offload::HostTier`]): the service's cache
    /// manager is unused, so its poll publishes only the service's own counters (commands,
    /// workers, generation); the tier and the engine's manager publish the rest.
    pub engine_tier: bool,
    /// The engine's process copies blocks itself (no worker attaches); the header says so.
    pub copies_in_engine: bool,
    /// Take over the host tier arenas a gone creator of the name left, bytes and all
    /// ([`Segment::create_keeping_host_tier`]); [`Service::host_tier_kept`] says if it did.
    pub keep_host_tier: bool,
}

impl ServiceConfig {
    /// A host-backend service with rings sized for typical batches.
    pub fn new(
        cache: CacheConfig,
        tp_size: u32,
        layers: u32,
        regions: u32,
        region_bytes: u64,
    ) -> Self {
        ServiceConfig {
            cache,
            tp_size,
            layers,
            regions,
            region_bytes,
            backend: Backend::HostArena,
            command_ring_slots: 4096,
            completion_ring_slots: 256,
            layerwise: true,
            max_command_bytes: DEFAULT_MAX_COMMAND_BYTES,
            command_deadline: DEFAULT_COMMAND_DEADLINE,
            storage_backoff: DEFAULT_TIER_BACKOFF,
            engine_tier: false,
            copies_in_engine: false,
            keep_host_tier: false,
        }
    }

    /// The segment header's configuration.
    pub fn segment_config(&self) -> SegmentConfig {
        let (write_policy, write_threshold) = self.cache.write_policy.to_wire();
        SegmentConfig {
            block_tokens: self.cache.block_tokens,
            tp_size: self.tp_size,
            device_blocks: self.cache.device_blocks,
            host_blocks: self.cache.host_blocks,
            regions: self.regions,
            layers: self.layers,
            region_bytes: self.region_bytes,
            write_policy,
            write_threshold,
            command_ring_slots: self.command_ring_slots,
            completion_ring_slots: self.completion_ring_slots,
            backend: self.backend.to_wire(),
            copies: if self.copies_in_engine {
                SegmentConfig::COPIES_IN_ENGINE
            } else {
                SegmentConfig::COPIES_BY_WORKERS
            },
            ..SegmentConfig::default()
        }
    }

    fn geometry(&self) -> Result<Geometry, GeometryError> {
        Geometry::new(GeometryParams {
            layers: self.layers,
            regions: self.regions,
            region_bytes: self.region_bytes,
            device_blocks: self.cache.device_blocks,
            host_blocks: self.cache.host_blocks,
        })
    }
}

/// Why a service could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("cache configuration: {0}")]
    Cache(#[from] CacheConfigError),
    #[error("block geometry: {0}")]
    Geometry(#[from] GeometryError),
    #[error("creating the segment: {0}")]
    Create(#[from] CreateError),
    #[error("segment: {0}")]
    Segment(#[from] SegmentError),
    #[error("opening an arena: {0}")]
    Arena(#[from] ArenaError),
    #[error("arena layout: {0}")]
    Memory(#[from] BlockAccessError),
    #[error("rank {rank} has no worker after {waited:?}")]
    WorkerMissing { rank: u32, waited: Duration },
    #[error("storage back-off: {0}")]
    StorageBackoff(#[from] TierBackoffError),
}

/// How a ticket became ready.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TicketReady {
    /// Every hit of the allocation is in its blocks.
    AllHits,
    /// The storage tier missed some hits: the first `cached_blocks` positions of the request's
    /// block table hold cached KV, and the engine computes the rest into `block_table`, the
    /// request's table *now* (see [`TicketStatus::Shortened`]). From `cached_blocks` on it may
    /// differ from the table `allocate` returned (a request that shared a LOAD with another one
    /// gets blocks of its own there): the engine must drop the old table and use this one (or
    /// read [`Service::block_table`] again). Empty for a prefetch's ticket.
    Shortened { cached_blocks: u32, block_table: Vec<u32> },
}

/// Why waiting on a ticket ended without the blocks being ready.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    #[error(transparent)]
    Ticket(#[from] TicketError),
    #[error("a copy the ticket waited on failed: {0}")]
    TransferFailed(TransferFailure),
    #[error("ticket {ticket:?} is not ready after {waited:?}")]
    TimedOut { ticket: TicketId, waited: Duration },
}

/// Why the device tier could not be resized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceResizeError {
    #[error(transparent)]
    Cache(#[from] ResizeError),
    /// Workers check block ids against the size the segment was created with, and the host
    /// backend's device arenas have that size.
    #[error("{blocks} device blocks is more than the {capacity} the segment was created with")]
    BeyondSegment { blocks: u32, capacity: u32 },
}

/// What the service remembers of a transfer in flight.
#[derive(Clone, Copy, Debug)]
struct TransferMeta {
    pairs: usize,
    kind: TransferKind,
}

/// Figures the service keeps besides the manager's statistics.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct ServiceStats {
    pub commands_issued: u64,
    pub commands_completed: u64,
    /// Bytes copied by all ranks together for transfers that succeeded.
    pub bytes_copied: u64,
    pub copy_failures: u64,
    pub worker_deaths: u64,
    pub resets: u64,
    /// Completions that matched no command in flight (a misbehaving worker).
    pub stray_completions: u64,
    /// Times a rank owed answers past the command deadline and its worker was fenced.
    pub command_deadlines_missed: u64,
    /// Blocks of storage commands (STORE, LOAD) that a rank reported missed (missing, damaged,
    /// or not written), counted once per rank and command.
    pub storage_misses: u64,
    /// Blocks sent in FORGET commands (to the ranks with a worker), FORGET commands that failed
    /// on some rank (sent once more), and blocks given up: a second failure, or past a
    /// worker-less rank's backlog (`storage_meta`).
    pub storage_forgets_sent: u64,
    pub storage_forget_failures: u64,
    pub storage_forgets_dropped: u64,
    /// Probes sent to a storage tier that was down, and those that did not reach it on every
    /// rank (`tier_probe`).
    pub storage_tier_probes: u64,
    pub storage_tier_probes_failed: u64,
}

/// The cache manager driving worker processes through a shared-memory segment.
pub struct Service {
    segment: Segment,
    manager: CacheManager,
    ranks: Vec<RankChannel>,
    /// Per rank, the worker the service saw attach (the only process it ever signals).
    watches: Vec<WorkerWatch>,
    tracker: CommandTracker,
    transfers: HashMap<u64, TransferMeta>,
    memory: Vec<RankMemory>,
    geometry: Geometry,
    layerwise: bool,
    /// `ServiceConfig::engine_tier`: publish only the service's own counters.
    engine_tier: bool,
    /// Per rank, whether creation took over a host tier left by a gone creator.
    host_tier_kept: Vec<bool>,
    max_pairs_per_command: usize,
    /// The most blocks one STORE or LOAD carries: 32 (the result bits), and bounded as a copy is
    /// (half a ring, one slot per block; `max_command_bytes` of each rank's bytes).
    max_storage_entries: usize,
    command_deadline: Duration,
    answer_clocks: deadline::AnswerClocks,
    liveness_checked_at: Option<Instant>,
    stats: ServiceStats,
    transfer_scratch: Vec<Transfer>,
    completion_scratch: Vec<kvshm_ipc::record::Completion>,
    /// Requests that a forced reset asked for by kvctl ended, until the engine takes them.
    requests_dropped_by_kvctl: Vec<RequestId>,
    /// Copies the engine asked for directly (see [`direct`]).
    direct: direct::DirectCopies,
    /// Each storage command in flight, by (rank index, command id): its transfer, and the
    /// transfer's blocks it carries (first, count).
    storage_commands: HashMap<(usize, u64), (u64, usize, usize)>,
    /// Per storage transfer in flight, per block: what the ranks said so far (a block landed only
    /// if it did on every rank; missing on one rank, it is missing).
    storage_landed: HashMap<u64, Vec<BlockOutcome>>,
    /// QUERY and FORGET commands in flight (see [`storage_meta`]).
    meta: storage_meta::MetaCommands,
    /// The storage tier's back-off and its outage under way (see [`tier_probe`]).
    tier_backoff: TierBackoff,
    tier_watch: tier_probe::TierWatch,
}

impl Service {
    /// Creates segment `name` (replacing a stale one) with its arenas, and the cache manager.
    ///
    /// Workers attach afterwards (`kvshm worker --name NAME --rank R`); see
    /// [`wait_for_workers`](Self::wait_for_workers).
    pub fn create(name: &SegmentName, config: ServiceConfig) -> Result<Service, ServiceError> {
        let geometry = config.geometry()?;
        config.cache.validate()?;
        config.storage_backoff.validate()?;
        // The segment before the manager: creating it checks every size and backs the arenas (a
        // size /dev/shm cannot hold fails here), before the pools are allocated for those blocks.
        let (segment, host_tier_kept) = if config.keep_host_tier {
            Segment::create_keeping_host_tier(name, &config.segment_config())?
        } else {
            (Segment::create(name, &config.segment_config())?, Vec::new())
        };
        let manager = CacheManager::new(config.cache.clone())?;
        let ranks = (0..config.tp_size)
            .map(|rank| RankChannel::open(&segment, rank))
            .collect::<Result<Vec<_>, _>>()?;
        let watches =
            (0..config.tp_size).map(|_| segment.worker_watch()).collect::<Result<Vec<_>, _>>()?;
        let memory = if config.backend == Backend::HostArena {
            (0..config.tp_size)
                .map(|rank| {
                    let device = segment.open_arena(ArenaKind::Device, rank)?;
                    let host = if config.cache.host_blocks > 0 {
                        Some(segment.open_arena(ArenaKind::Host, rank)?)
                    } else {
                        None
                    };
                    Ok(RankMemory::new(&geometry, device, host)?)
                })
                .collect::<Result<Vec<_>, ServiceError>>()?
        } else {
            Vec::new()
        };
        // A command must fit in half a ring, so that one long command never waits for a ring
        // that can only hold it when empty behind another long one.
        let pair_slots = (config.command_ring_slots as usize / 2).saturating_sub(1).max(1);
        // And a command carries at most max_command_bytes per rank, so that it ends in bounded
        // time (at least one block, whatever the limit).
        let block_bytes = geometry.block_bytes();
        let pairs_by_bytes = (config.max_command_bytes / block_bytes.max(1)).max(1);
        let max_pairs_per_command = (pair_slots * PAIRS_PER_SLOT)
            .min(usize::try_from(pairs_by_bytes).unwrap_or(usize::MAX));
        debug_assert!(
            command_slot_count(max_pairs_per_command) <= config.command_ring_slots as usize
        );
        let max_storage_entries = kvshm_ipc::storage_record::MAX_STORAGE_ENTRIES
            .min(pair_slots)
            .min(usize::try_from(pairs_by_bytes).unwrap_or(usize::MAX));
        let service = Service {
            tracker: CommandTracker::new(config.tp_size as usize),
            segment,
            manager,
            ranks,
            watches,
            transfers: HashMap::new(),
            memory,
            geometry,
            layerwise: config.layerwise,
            max_pairs_per_command,
            max_storage_entries,
            command_deadline: config.command_deadline,
            answer_clocks: deadline::AnswerClocks::new(config.tp_size as usize),
            liveness_checked_at: None,
            stats: ServiceStats::default(),
            transfer_scratch: Vec::new(),
            completion_scratch: Vec::new(),
            requests_dropped_by_kvctl: Vec::new(),
            direct: direct::DirectCopies::default(),
            storage_commands: HashMap::new(),
            meta: storage_meta::MetaCommands::default(),
            storage_landed: HashMap::new(),
            tier_backoff: config.storage_backoff,
            tier_watch: tier_probe::TierWatch::default(),
            engine_tier: config.engine_tier,
            host_tier_kept,
        };
        service.publish_counters();
        Ok(service)
    }

    pub fn segment(&self) -> &Segment {
        &self.segment
    }

    /// Whether `rank`'s host tier was taken over at creation, bytes and all
    /// (`ServiceConfig::keep_host_tier`).
    pub fn host_tier_kept(&self, rank: u32) -> bool {
        self.host_tier_kept.get(rank as usize).copied().unwrap_or(false)
    }

    /// Leaves the host tier arenas behind when the service drops, for the next creator of the
    /// name that keeps host tiers (the rest of the segment goes).
    pub fn keep_host_tier_on_drop(&mut self) {
        self.segment.keep_host_tier_on_drop();
    }

    /// The cache manager, read-only: lookup, stats, tree, invariants.
    pub fn cache(&self) -> &CacheManager {
        &self.manager
    }

    /// Puts blocks the workers' storage tier already holds into the cache as storage-only blocks
    /// (see [`CacheManager::adopt_stored_blocks`]): a restarted service finds its disk blocks
    /// through the persisted index (`storage::disk_index::blocks_on_every_rank`). Returns how
    /// many were adopted.
    pub fn adopt_stored_blocks(
        &mut self,
        blocks: impl IntoIterator<Item = (BlockHash, BlockHash, u32)>,
    ) -> usize {
        self.manager.adopt_stored_blocks(blocks)
    }

    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    pub fn stats(&self) -> ServiceStats {
        self.stats
    }

    /// The engine's view of `rank`'s block bytes (host backend only).
    pub fn memory(&self, rank: u32) -> Option<&RankMemory> {
        self.memory.get(rank as usize)
    }

    pub fn rank_states(&self) -> Vec<RankState> {
        self.ranks.iter().map(RankChannel::state).collect()
    }

    /// Polls until every rank has a live worker, or fails after `timeout`.
    pub fn wait_for_workers(&mut self, timeout: Duration) -> Result<(), ServiceError> {
        let started = Instant::now();
        loop {
            match self.poll_workers() {
                None => return Ok(()),
                Some(rank) if started.elapsed() >= timeout => {
                    return Err(ServiceError::WorkerMissing { rank, waited: started.elapsed() })
                }
                Some(_) => std::thread::sleep(Duration::from_millis(2)),
            }
        }
    }

    /// One step of [`wait_for_workers`](Self::wait_for_workers): watches the workers now (not
    /// only when the liveness interval has passed) and polls; returns the first rank without a
    /// worker, `None` once every rank has one.
    pub fn poll_workers(&mut self) -> Option<u32> {
        self.liveness_checked_at = None;
        self.poll();
        self.ranks.iter().find(|rank| !rank.is_up()).map(RankChannel::rank)
    }

    /// What a thread needs to sleep until a worker answers without holding the service (see
    /// [`CompletionBell`]); the `poll_*` methods are the steps it takes between sleeps.
    pub fn completion_bell(&self) -> Result<CompletionBell, SegmentError> {
        self.segment.completion_bell()
    }

    /// Matches the request's leading blocks and holds them, leaving at least the last
    /// prompt token to compute (the last-token rule of [`CacheManager::match_prefix`]).
    pub fn match_prefix(
        &mut self,
        request: RequestId,
        hashes: &[BlockHash],
        prompt_tokens: usize,
    ) -> Result<PrefixMatch, MatchError> {
        self.manager.match_prefix(request, hashes, prompt_tokens)
    }

    /// Extends the held prefix of a request that has not allocated with blocks cached since
    /// (see [`CacheManager::rematch`]).
    pub fn rematch(
        &mut self,
        request: RequestId,
        hashes: &[BlockHash],
        prompt_tokens: usize,
    ) -> Result<PrefixMatch, MatchError> {
        self.manager.rematch(request, hashes, prompt_tokens)
    }

    /// Gives back the holds of a request that has not allocated (its allocation failed and it
    /// waits); see [`CacheManager::release_match`].
    pub fn release_match(&mut self, request: RequestId) -> Result<(), MatchError> {
        self.manager.release_match(request)
    }

    /// Whether `allocate` with these arguments would succeed now; changes nothing.
    pub fn can_allocate(
        &mut self,
        request: RequestId,
        new_tokens: usize,
        lookahead_tokens: usize,
    ) -> Result<AllocationCheck, AllocateError> {
        self.manager.can_allocate(request, new_tokens, lookahead_tokens)
    }

    /// Starts bringing `hashes`' blocks on the storage tier up to host before their request is
    /// scheduled, and asks every rank's tier about the blocks past the cache's end if the tier is
    /// shared (Redis: another service may have written them; a disk slab is not asked), as
    /// [`CacheManager::prefetch`], with the
    /// commands handed to the workers. Wait on the ticket with [`wait`](Self::wait) or read it
    /// with [`prefetch_status`](Self::prefetch_status) (which forgets it once done).
    pub fn prefetch(&mut self, hashes: &[BlockHash]) -> Result<Option<TicketId>, PrefetchError> {
        // Only a tier other services write to is asked about blocks past the tree: a worker
        // with a shared back-end says so before it serves.
        let shared = self.segment.counters().get(Counter::StorageSharedTier) != 0;
        self.manager.set_storage_shared(shared);
        let ticket = self.manager.prefetch(hashes)?;
        self.issue_transfers();
        Ok(ticket)
    }

    /// Where prefetch ticket `ticket` stands after a poll; forgotten once read as done.
    pub fn prefetch_status(&mut self, ticket: TicketId) -> Result<TicketStatus, TicketError> {
        self.poll();
        self.manager.prefetch_status(ticket)
    }

    /// Blocks for the host hits and the new tokens; returns the request's block table,
    /// how many blocks this call added at its end, and the ticket to wait on before touching
    /// them (as [`CacheManager::allocate`], with the copies handed to the workers).
    pub fn allocate(
        &mut self,
        request: RequestId,
        new_tokens: usize,
        lookahead_tokens: usize,
    ) -> Result<Allocation<'_>, AllocateError> {
        let allocation = self.manager.allocate(request, new_tokens, lookahead_tokens)?;
        let (ticket, new_blocks) = (allocation.ticket, allocation.new_blocks);
        self.issue_transfers();
        let block_table = self.manager.block_table(request).expect(
            "a request stays live until finished or aborted: a programming error otherwise",
        );
        Ok(Allocation { ticket, block_table, new_blocks })
    }

    /// Caches the full blocks among the request's first `computed_tokens` tokens.
    pub fn commit(
        &mut self,
        request: RequestId,
        computed_tokens: usize,
        hashes: &[BlockHash],
    ) -> Result<Committed, CommitError> {
        self.manager.commit(request, computed_tokens, hashes)
    }

    /// Releases the request's holds and private blocks.
    pub fn finish(&mut self, request: RequestId) -> Result<(), FinishError> {
        self.manager.finish(request)
    }

    /// As `finish`, for a request that will not complete.
    pub fn abort(&mut self, request: RequestId) -> Result<(), FinishError> {
        self.manager.abort(request)
    }

    /// Grows or shrinks the device tier, within the blocks the segment was created
    /// with; shrinking needs every block at or above `blocks` free.
    pub fn resize_device(&mut self, blocks: u32) -> Result<(), DeviceResizeError> {
        let capacity = self.geometry.device_blocks();
        if blocks > capacity {
            return Err(DeviceResizeError::BeyondSegment { blocks, capacity });
        }
        self.manager.resize_device(blocks)?;
        self.publish_counters();
        Ok(())
    }

    /// Drops every cached block and bumps the generation (in the manager and in the
    /// segment, so that workers refuse commands of the old one). Copies of the old generation
    /// still in flight keep their blocks reserved in the manager until their completions arrive.
    /// Returns the requests a forced reset ended, in id order.
    pub fn reset(&mut self, force: bool) -> Result<Vec<RequestId>, ResetError> {
        let dropped = self.manager.reset(force)?;
        let generation = self.segment.bump_generation();
        self.stats.resets += 1;
        info!(generation, force, "cache reset");
        self.publish_counters();
        Ok(dropped)
    }

    /// The requests that forced resets asked for by kvctl (`kvctl reset --force`, carried out in
    /// `poll`) ended since the last call: the engine must drop them too.
    pub fn take_requests_dropped_by_kvctl(&mut self) -> Vec<RequestId> {
        std::mem::take(&mut self.requests_dropped_by_kvctl)
    }

    /// Reaps completions, watches the workers, issues pending copies, serves kvctl and publishes
    /// the counters. Call it often (`wait` does).
    pub fn poll(&mut self) {
        self.check_workers();
        self.reap_completions();
        self.check_command_deadlines();
        self.watch_storage_tier();
        self.manager.poll();
        self.issue_transfers();
        self.serve_control_requests();
        self.publish_counters();
    }

    /// The block table of a live request, as it is now (a storage miss may have changed it
    /// from the position where the hit was shortened on: [`TicketReady::Shortened`]).
    pub fn block_table(&self, request: RequestId) -> Option<&[u32]> {
        self.manager.block_table(request)
    }

    /// Whether `ticket`'s blocks are ready, without waiting.
    pub fn ticket_status(&self, ticket: TicketId) -> Result<TicketStatus, TicketError> {
        self.manager.ticket_status(ticket)
    }

    /// Waits until `ticket` is ready: polls, spins briefly on the scheduler doorbell, then sleeps
    /// on it in short slices so that worker deaths are still noticed. Says whether every hit is
    /// cached, or the storage tier missed some and the engine computes them into the block table
    /// that [`TicketReady::Shortened`] carries (not the one `allocate` returned):
    ///
    /// ```text
    /// let (table, cached) = match service.wait(ticket, timeout)? {
    ///     TicketReady::AllHits => (allocated_table, matched_blocks),
    ///     TicketReady::Shortened { cached_blocks, block_table } => (block_table, cached_blocks),
    /// };
    /// ```
    pub fn wait(&mut self, ticket: TicketId, timeout: Duration) -> Result<TicketReady, WaitError> {
        let started = Instant::now();
        let deadline = deadline_after(timeout);
        loop {
            if let Some(ready) = self.poll_ticket(ticket)? {
                return Ok(ready);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(WaitError::TimedOut { ticket, waited: now - started });
            }
            self.sleep_until_completion(deadline.min(now + WAIT_SLICE));
        }
    }

    /// One step of [`wait`](Self::wait): polls, then says whether `ticket` is ready and how
    /// (`None` while pending; an error if a copy it waited on failed).
    pub fn poll_ticket(&mut self, ticket: TicketId) -> Result<Option<TicketReady>, WaitError> {
        self.poll();
        match self.manager.ticket_status(ticket)? {
            TicketStatus::Ready => Ok(Some(TicketReady::AllHits)),
            TicketStatus::Shortened { cached_blocks } => {
                let block_table = self
                    .manager
                    .ticket_request(ticket)
                    .and_then(|request| self.manager.block_table(request))
                    .map(<[u32]>::to_vec)
                    .unwrap_or_default();
                Ok(Some(TicketReady::Shortened { cached_blocks, block_table }))
            }
            TicketStatus::Failed(failure) => Err(WaitError::TransferFailed(failure)),
            TicketStatus::Pending => Ok(None),
        }
    }

    /// The positions of `ticket`'s block table still cached, when a storage miss shortened the
    /// request's hit (`None` otherwise). Known once the ticket's storage LOADs have completed,
    /// which is before any layer of the swap-ins behind them lands: a layer-wise engine reads it
    /// once [`ticket_layers_ready`](Self::ticket_layers_ready) is above 0, and computes the
    /// positions from there on.
    pub fn ticket_cached_blocks(&self, ticket: TicketId) -> Result<Option<u32>, TicketError> {
        self.manager.ticket_cached_blocks(ticket)
    }

    /// Bandwidth of the workers while copying, from their own counters: bytes over the time they
    /// spent in copies, summed over ranks (so the figure is per worker, not for the whole group).
    pub fn worker_copy_gb_per_s(&self) -> f64 {
        let counters = self.segment.counters();
        let nanos = counters.get(Counter::WorkerCopyNs);
        if nanos == 0 {
            return 0.0;
        }
        counters.get(Counter::WorkerCopyBytes) as f64 / nanos as f64
    }

    /// Polls until no copy is in flight (or `timeout` passes); returns whether none is.
    ///
    /// An allocation can fail only because the blocks it would evict are still being copied (a
    /// backup, a swap-out); an engine waits for them and retries.
    pub fn wait_for_copies(&mut self, timeout: Duration) -> bool {
        let deadline = deadline_after(timeout);
        loop {
            if self.poll_copies() {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            self.sleep_until_completion(deadline.min(now + WAIT_SLICE));
        }
    }

    /// One step of [`wait_for_copies`](Self::wait_for_copies): polls, then says whether no copy
    /// of the manager's is in flight.
    pub fn poll_copies(&mut self) -> bool {
        self.poll();
        self.manager.transfers_in_flight() == 0
    }

    /// How many leading layers of `ticket`'s blocks the engine may use already: every copy the
    /// ticket waits on has moved those layers on every rank. All layers once it is ready; none
    /// while a copy is queued or runs without layer-wise progress.
    pub fn ticket_layers_ready(&self, ticket: TicketId) -> Result<u32, WaitError> {
        match self.manager.ticket_status(ticket)? {
            TicketStatus::Ready | TicketStatus::Shortened { .. } => Ok(self.geometry.layers()),
            TicketStatus::Failed(failure) => Err(WaitError::TransferFailed(failure)),
            TicketStatus::Pending => Ok(self
                .manager
                .ticket_transfers(ticket)
                .map(|transfer| self.transfer_layers_ready(transfer))
                .min()
                .unwrap_or(0)),
        }
    }

    /// Layers of `transfer` that have landed on every rank: none while it is queued (held back
    /// behind other copies, so no worker has started it), all of them once it completed.
    pub fn transfer_layers_ready(&self, transfer: TransferId) -> u32 {
        let layers = self.geometry.layers();
        match self.manager.transfer_stage(transfer) {
            TransferStage::Queued => return 0,
            TransferStage::Done => return layers,
            TransferStage::Issued => {}
        }
        self.tracker
            .outstanding_commands(transfer.0)
            .map(|(rank, command)| {
                self.segment
                    .layer_progress(rank as u32)
                    .ok()
                    .and_then(|progress| progress.layers_done(command))
                    .unwrap_or(0)
                    .min(layers)
            })
            .min()
            .unwrap_or(layers)
    }

    /// Spins, then sleeps on the scheduler doorbell until a completion is waiting or `until`.
    pub(crate) fn sleep_until_completion(&mut self, until: Instant) {
        let Service { segment, ranks, .. } = self;
        segment.scheduler_doorbell().wait_until(
            || ranks.iter_mut().any(|rank| !rank.is_down() && rank.has_completions()),
            WaitPolicy::new(WAIT_SPIN, WAIT_SLICE).until(until),
        );
    }

    fn issue_transfers(&mut self) {
        self.issue_storage_meta();
        let mut transfers = std::mem::take(&mut self.transfer_scratch);
        self.manager.take_transfers_into(&mut transfers);
        for transfer in transfers.drain(..) {
            self.issue(transfer);
        }
        self.transfer_scratch = transfers;
        self.issue_waiting_direct();
        let now = Instant::now();
        for index in 0..self.ranks.len() {
            if !self.owes_answers(index) {
                // Step 3 of the deadline flow: the wait for an answer starts with these commands.
                self.answer_clocks.restart(index, now);
            }
            let rank = &mut self.ranks[index];
            if rank.pump() > 0 {
                self.segment
                    .command_doorbell(rank.rank())
                    .expect("a rank of the segment has a doorbell")
                    .ring();
            }
            if let Some(fault) = rank.command_ring_fault() {
                self.drop_broken_rank(index, "command", fault);
            }
        }
    }

    fn issue(&mut self, transfer: Transfer) {
        if let Some(down) = self.ranks.iter().find(|rank| rank.is_down()) {
            let failure =
                TransferFailure { rank: down.rank(), error: CommandError::WorkerDied, detail: 0 };
            // `settle` counts the failure.
            self.settle(transfer.id, Err(failure));
            return;
        }
        if transfer.pairs.is_empty() {
            self.settle(transfer.id, Ok(()));
            return;
        }
        if transfer.kind.is_storage() {
            self.queue_storage_commands(&transfer);
        } else {
            self.queue_commands(transfer.id.0, transfer.kind, &transfer.pairs);
        }
    }

    /// Queues the STOREs or LOADs of storage copy `transfer` on every rank, at most
    /// `max_storage_entries` blocks per command, and remembers each command's entry count.
    fn queue_storage_commands(&mut self, transfer: &Transfer) {
        use kvshm_ipc::storage_record::{storage_pair_count, StorageEntry};
        let op = match transfer.kind {
            TransferKind::HostToStorage => Op::StorageStore,
            TransferKind::StorageToHost => Op::StorageLoad,
            kind => unreachable!("{kind:?} is not a storage copy"),
        };
        let entries: Vec<StorageEntry> = transfer
            .pairs
            .iter()
            .zip(&transfer.blocks)
            .map(|(pair, block)| {
                StorageEntry::new(block.hash.0, block.parent.0, block.depth, pair.src)
            })
            .collect();
        let generation = self.segment.generation();
        for (chunk_index, chunk) in entries.chunks(self.max_storage_entries).enumerate() {
            let first = chunk_index * self.max_storage_entries;
            let header = CommandHeader::new(op, 0, generation, storage_pair_count(chunk.len()));
            for (index, rank) in self.ranks.iter_mut().enumerate() {
                let command_id = rank.queue_storage(header, chunk);
                self.tracker.begin(transfer.id.0, rank.rank() as usize, command_id);
                self.storage_commands
                    .insert((index, command_id), (transfer.id.0, first, chunk.len()));
                self.stats.commands_issued += 1;
            }
        }
        self.storage_landed.insert(transfer.id.0, vec![BlockOutcome::Landed; entries.len()]);
        self.transfers.insert(
            transfer.id.0,
            TransferMeta { pairs: transfer.pairs.len(), kind: transfer.kind },
        );
    }

    /// Applies the result bits of a storage command's completion to its transfer's blocks: a
    /// block a rank did not report done missed (per block, not a failure of the command): it is
    /// missing, or unavailable when the rank says its tier failed. A failed completion is a
    /// failure of the whole command, which the tracker reports.
    fn record_storage_results(&mut self, index: usize, completion: &kvshm_ipc::record::Completion) {
        use kvshm_ipc::storage_record::StorageResults;
        let Some((transfer, first, entries)) =
            self.storage_commands.remove(&(index, completion.command_id))
        else {
            return;
        };
        if !completion.is_ok() {
            return;
        }
        let results = StorageResults::from_detail(completion.detail).masked(entries);
        let Some(landed) = self.storage_landed.get_mut(&transfer) else { return };
        for (entry, outcome) in landed.iter_mut().skip(first).take(entries).enumerate() {
            if results.is_done(entry) {
                continue;
            }
            self.stats.storage_misses += 1;
            *outcome = match (*outcome, results.is_failed(entry)) {
                (BlockOutcome::Missing, _) | (_, false) => BlockOutcome::Missing,
                (_, true) => BlockOutcome::Unavailable,
            };
        }
    }

    /// Queues the commands of copy `id` on every rank (split to fit the rings) and remembers it.
    fn queue_commands(&mut self, id: u64, kind: TransferKind, pairs: &[BlockPair]) {
        let op = match kind {
            TransferKind::DeviceToHost => Op::CopyDeviceToHost,
            TransferKind::HostToDevice => Op::CopyHostToDevice,
            TransferKind::HostToStorage | TransferKind::StorageToHost => {
                unreachable!("storage copies are queued by queue_storage_commands")
            }
        };
        // Swap-outs report layers too: a new block claimed from a swap-out may be written layer
        // by layer as soon as the copy has read that layer.
        let flags = if self.layerwise { FLAG_LAYERWISE } else { 0 };
        let generation = self.segment.generation();
        for chunk in pairs.chunks(self.max_pairs_per_command) {
            let header =
                CommandHeader::new(op, 0, generation, chunk.len() as u32).with_flags(flags);
            for rank in &mut self.ranks {
                let command_id = rank.queue(header, chunk);
                self.tracker.begin(id, rank.rank() as usize, command_id);
                self.stats.commands_issued += 1;
            }
        }
        self.transfers.insert(id, TransferMeta { pairs: pairs.len(), kind });
    }

    fn reap_completions(&mut self) {
        for index in 0..self.ranks.len() {
            // A Starting rank may hold answers of a predecessor that left cleanly.
            if self.ranks[index].is_down() {
                continue;
            }
            if let Err(error) = self.reap_rank(index) {
                self.drop_broken_rank(index, "completion", error);
            }
        }
    }

    /// Applies every completion waiting in the completion ring of rank `index`.
    fn reap_rank(&mut self, index: usize) -> Result<(), RingError> {
        let mut completions = std::mem::take(&mut self.completion_scratch);
        let result = loop {
            completions.clear();
            match self.ranks[index].reap(&mut completions, REAP_BATCH) {
                Ok(0) => break Ok(()),
                Ok(_) => {}
                Err(error) => break Err(error),
            }
            self.stats.commands_completed += completions.len() as u64;
            for completion in &completions {
                let given_up = self.meta.note_completion(index, completion);
                self.stats.storage_forgets_dropped += given_up as u64;
                self.record_storage_results(index, completion);
                let matched = self.tracker.complete(index, completion);
                if matched.is_ok() {
                    self.answer_clocks.restart(index, Instant::now());
                }
                match matched {
                    Ok(Some((transfer, outcome))) => {
                        let outcome = outcome.map_err(failure_of);
                        self.settle(TransferId(transfer), outcome);
                    }
                    Ok(None) => {}
                    Err(mismatch) => {
                        self.stats.stray_completions += 1;
                        warn!(%mismatch, "ignoring a completion");
                    }
                }
            }
        };
        self.completion_scratch = completions;
        result
    }

    /// Hands a transfer's outcome to the manager (or to the engine, for a direct copy).
    fn settle(&mut self, transfer: TransferId, outcome: Result<(), TransferFailure>) {
        if direct::is_direct(transfer.0) {
            self.settle_direct(transfer.0, outcome);
            return;
        }
        if storage_meta::is_meta(transfer.0) {
            self.settle_meta(transfer.0, outcome);
            return;
        }
        let meta = self.transfers.remove(&transfer.0);
        match (&outcome, meta) {
            (Ok(()), Some(meta)) if !meta.kind.is_storage() => {
                let bytes =
                    meta.pairs as u64 * self.geometry.block_bytes() * self.ranks.len() as u64;
                self.stats.bytes_copied += bytes;
            }
            (Ok(()), Some(_)) => {}
            (Err(failure), _) => {
                self.stats.copy_failures += 1;
                warn!(transfer = transfer.0, %failure, "copy failed; rolling back");
            }
            (Ok(()), None) => {}
        }
        let landed = self.storage_landed.remove(&transfer.0);
        let completed = match landed {
            Some(landed) => self
                .manager
                .complete_storage_transfer(transfer, outcome.map(|()| Some(landed.as_slice()))),
            None => self.manager.complete_transfer(transfer, outcome),
        };
        if let Err(error) = completed {
            warn!(transfer = transfer.0, %error, "the cache manager refused a completion");
        }
    }
}

pub(crate) fn failure_of(failure: RankFailure) -> TransferFailure {
    TransferFailure {
        rank: failure.rank as u32,
        // A code this build does not know is still a failed copy.
        error: failure.error.unwrap_or(CommandError::CopyFailed),
        detail: failure.detail,
    }
}
