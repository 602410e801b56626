//! The running service: the cache manager on top of the [`Transport`] to the worker processes.
//!
//! [`Service`] lives inside the engine's scheduler process, on one thread. It owns the
//! [`CacheManager`] and a [`Transport`] (the segment, one ring pair per tensor-parallel rank, the
//! workers' liveness), and hands the manager's transfers to the transport and their outcomes
//! back (`copies`).
//!
//! One swap-in, start to end:
//!
//! 1. the engine calls [`Service::allocate`]; the manager claims blocks and queues a host-to-device
//!    transfer, returning a ticket;
//! 2. [`Service::wait`] (or any [`Service::poll`]) takes the transfer and queues it on the
//!    transport as one job ([`ServiceJob::Transfer`]), which encodes one command per rank
//!    (several when its pairs exceed half a command ring or `max_command_bytes`) and pumps them
//!    into the command rings as credits allow, ringing each worker's doorbell;
//! 3. every worker copies its rank's bytes and pushes a completion, ringing the scheduler doorbell;
//! 4. `poll` has the transport reap completions; when the last command of the transfer has
//!    completed on every rank, the transport reports its outcome and the service hands it to the
//!    manager, which applies the transition (or rolls it back on any failure) and settles the
//!    ticket;
//! 5. `wait` returns once the ticket is ready, or with the failure.
//!
//! `poll` also has the transport watch the workers (a dead one fails its commands, and its rank
//! is reclaimed so that a new worker can attach), probes a storage tier that is down
//! (`tier_probe`), sends the storage tier's QUERYs and FORGETs (`storage_meta`), carries out
//! kvctl's requests (reset, tree snapshot: `control`) and publishes the live counters kvctl
//! reads.

mod config;
mod control;
mod copies;
mod storage_meta;
#[cfg(test)]
mod tests;
mod tier_probe;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvshm_ipc::doorbell::deadline_after;
use tracing::info;

use crate::hash::BlockHash;
use crate::manager::{
    AllocateError, Allocation, AllocationCheck, BlockOutcome, CacheManager, CommitError, Committed,
    ConfigError as CacheConfigError, FinishError, MatchError, PrefetchError, PrefixMatch,
    RequestId, ResetError, ResizeError, TicketError, TicketId, TicketStatus, Transfer,
    TransferFailure, TransferId, TransferStage,
};
use crate::transport::Event;
use crate::worker::Geometry;

// The transport's types that appear in this module's API, so that an engine needs one import.
pub use crate::transport::{
    ArenaError, Backend, BlockAccessError, CompletionBell, Counter, CreateError, DeviceHandleError,
    DeviceRegionHandle, NameError, RankMemory, RankState, Segment, SegmentConfig, SegmentError,
    SegmentName, Transport, TransportConfig, TransportError, WaitOutcome, WaitPolicy,
    WorkerMissing, CUDA_IPC_HANDLE_BYTES, DEFAULT_COMMAND_DEADLINE, DEFAULT_COMMAND_RING_SLOTS,
    DEFAULT_COMPLETION_RING_SLOTS, DEFAULT_MAX_COMMAND_BYTES, WAIT_SLICE, WAIT_SPIN,
};
pub use config::ServiceConfig;
pub use storage_meta::{MetaId, MAX_FORGET_BACKLOG};
pub use tier_probe::{TierBackoff, TierBackoffError, DEFAULT_TIER_BACKOFF};

/// Why a service could not start, or its workers did not come.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("cache configuration: {0}")]
    Cache(#[from] CacheConfigError),
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error(transparent)]
    WorkerMissing(#[from] WorkerMissing),
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

/// What the service names a job of its transport with: the one place that says what an outcome
/// belongs to is `Service::apply_events`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ServiceJob {
    /// One of the cache manager's transfers (a swap, a backup, a STORE or LOAD).
    Transfer(TransferId),
    /// A QUERY or FORGET of the storage tier, or a probe of it (`storage_meta`).
    Meta(MetaId),
}

/// Figures the service keeps besides the manager's statistics: its transport's, and its own.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct ServiceStats {
    pub commands_issued: u64,
    pub commands_completed: u64,
    /// Bytes copied by all ranks together for transfers that succeeded.
    pub bytes_copied: u64,
    pub copy_failures: u64,
    pub worker_deaths: u64,
    pub resets: u64,
    /// Completions that matched no command in the ring (a misbehaving worker, or one written
    /// over in its ring).
    pub stray_completions: u64,
    /// Commands whose answer a later answer of their lane overtook: failed as lost.
    pub lost_answers: u64,
    /// Times a rank owed answers past the command deadline and its worker was fenced.
    pub command_deadlines_missed: u64,
    /// Times commands waited past the command deadline for a rank's worker to set up, and
    /// failed unsent.
    pub setup_waits_failed: u64,
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

/// The cache manager driving worker processes through a [`Transport`].
pub struct Service {
    transport: Transport<ServiceJob>,
    manager: CacheManager,
    /// The service's own figures (the transport's are added in [`Service::stats`]).
    stats: ServiceStats,
    transfer_scratch: Vec<Transfer>,
    event_scratch: Vec<Event<ServiceJob>>,
    /// Requests that a forced reset asked for by kvctl ended, until the engine takes them.
    requests_dropped_by_kvctl: Vec<RequestId>,
    /// Per storage transfer in flight, per block: what the ranks said so far (a block landed only
    /// if it did on every rank; missing on one rank, it is missing).
    storage_landed: HashMap<TransferId, Vec<BlockOutcome>>,
    /// QUERY and FORGET commands in flight (see `storage_meta`).
    meta: storage_meta::MetaCommands,
    /// The storage tier's back-off and its outage under way (see `tier_probe`).
    tier_backoff: TierBackoff,
    tier_watch: tier_probe::TierWatch,
}

impl Service {
    /// Creates segment `name` (replacing a stale one) with its arenas, and the cache manager.
    ///
    /// Workers attach afterwards (`kvshm worker --name NAME --rank R`); see
    /// [`wait_for_workers`](Self::wait_for_workers).
    pub fn create(name: &SegmentName, config: ServiceConfig) -> Result<Service, ServiceError> {
        config.cache.validate()?;
        config.storage_backoff.validate()?;
        // The segment before the manager: creating it checks every size and backs the arenas (a
        // size /dev/shm cannot hold fails here), before the pools are allocated for those blocks.
        let transport = Transport::create(name, &config.transport_config())?;
        let manager = CacheManager::new(config.cache.clone())?;
        let service = Service {
            transport,
            manager,
            stats: ServiceStats::default(),
            transfer_scratch: Vec::new(),
            event_scratch: Vec::new(),
            requests_dropped_by_kvctl: Vec::new(),
            storage_landed: HashMap::new(),
            meta: storage_meta::MetaCommands::default(),
            tier_backoff: config.storage_backoff,
            tier_watch: tier_probe::TierWatch::default(),
        };
        service.publish_counters();
        Ok(service)
    }

    pub fn segment(&self) -> &Segment {
        self.transport.segment()
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
        self.transport.geometry()
    }

    /// The service's figures: its transport's and its own.
    pub fn stats(&self) -> ServiceStats {
        let transport = self.transport.stats();
        ServiceStats {
            commands_issued: transport.commands_issued,
            commands_completed: transport.commands_completed,
            bytes_copied: transport.bytes_copied,
            copy_failures: self.stats.copy_failures + transport.copy_failures,
            worker_deaths: transport.worker_deaths,
            stray_completions: transport.stray_completions,
            lost_answers: transport.lost_answers,
            command_deadlines_missed: transport.command_deadlines_missed,
            setup_waits_failed: transport.setup_waits_failed,
            ..self.stats
        }
    }

    /// The engine's view of `rank`'s block bytes (host backend only).
    pub fn memory(&self, rank: u32) -> Option<&RankMemory> {
        self.transport.memory(rank)
    }

    pub fn rank_states(&self) -> Vec<RankState> {
        self.transport.rank_states()
    }

    /// Polls until every rank has a live worker, or fails after `timeout`.
    pub fn wait_for_workers(&mut self, timeout: Duration) -> Result<(), ServiceError> {
        Ok(crate::transport::wait_for_workers(timeout, || self.poll_workers())?)
    }

    /// One step of [`wait_for_workers`](Self::wait_for_workers): watches the workers now (not
    /// only when the liveness interval has passed) and polls; returns the first rank without a
    /// worker, `None` once every rank has one.
    pub fn poll_workers(&mut self) -> Option<u32> {
        self.transport.watch_workers_now();
        self.poll();
        self.transport.first_rank_not_up()
    }

    /// What a thread needs to sleep until a worker answers without holding the service (see
    /// [`CompletionBell`]); the `poll_*` methods are the steps it takes between sleeps.
    pub fn completion_bell(&self) -> Result<CompletionBell, SegmentError> {
        self.transport.completion_bell()
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
        let shared = self.transport.segment().counters().get(Counter::StorageSharedTier) != 0;
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
        let capacity = self.transport.geometry().device_blocks();
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
        let generation = self.transport.segment().bump_generation();
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
        self.transport.poll();
        self.apply_events();
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
            self.transport.sleep_until_completion(deadline.min(now + WAIT_SLICE));
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

    /// Bandwidth of the workers while copying (see [`Transport::worker_copy_gb_per_s`]).
    pub fn worker_copy_gb_per_s(&self) -> f64 {
        self.transport.worker_copy_gb_per_s()
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
            self.transport.sleep_until_completion(deadline.min(now + WAIT_SLICE));
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
            TicketStatus::Ready | TicketStatus::Shortened { .. } => {
                Ok(self.transport.geometry().layers())
            }
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
        match self.manager.transfer_stage(transfer) {
            TransferStage::Queued => 0,
            TransferStage::Done => self.transport.geometry().layers(),
            TransferStage::Issued => self.transport.layers_ready(ServiceJob::Transfer(transfer)),
        }
    }
}
