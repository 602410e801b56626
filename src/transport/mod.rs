//! The transport: one segment, its per-rank rings and the worker processes behind them, with no
//! cache in it. [`Service`](crate::service::Service) puts the cache manager on top of it; the
//! vLLM host tier ([`crate::offload::HostTier`]) uses it alone, for the copies the engine asks
//! for.
//!
//! [`Transport`] owns the segment (created by name), one [`RankChannel`] per tensor-parallel rank,
//! the [`WorkerWatch`] of each rank's worker, and the [`CommandTracker`] that joins per-rank
//! completions into one outcome per job. What a command was issued for is an [`Issuer`]: a job of
//! the owner's (its own type `J`: the service's transfers and storage queries) or a
//! [`direct`] copy, which the transport carries out itself and issues again when a worker dies
//! under it. `Transport::settle` is the one place that decides where an outcome goes.
//!
//! One job, start to end:
//!
//! 1. the owner queues it ([`Transport::queue_copy`], [`Transport::queue_storage`]): one command
//!    per rank, several where its pairs are more than a command may carry;
//! 2. [`Transport::pump`] moves the queued commands into the command rings as credits allow and
//!    rings each worker's doorbell;
//! 3. every worker copies its rank's bytes and pushes a completion;
//! 4. [`Transport::poll`] watches the workers (`liveness`), reaps the completions and checks the
//!    command deadline (`deadline`); when the last command of a job has completed on every
//!    rank (or failed, or its worker died), the job's [`Event::Ended`] waits for the owner, who
//!    takes the events with [`Transport::take_events`].
//!
//! The owner publishes its own counters after the transport's ([`Transport::publish_counters`]).

mod config;
mod deadline;
pub mod direct;
mod liveness;
mod memory;
mod rank;
pub mod tracker;

use std::collections::HashMap;
use std::convert::Infallible;
use std::fmt::Debug;
use std::hash::Hash;
use std::time::{Duration, Instant};

use kvshm_ipc::arena::{Arena, ArenaKind};
use kvshm_ipc::doorbell::{deadline_after, DEFAULT_SPIN};
use kvshm_ipc::record::{
    command_slot_count, BlockPair, CommandError, CommandHeader, Completion, Op, FLAG_LAYERWISE,
    PAIRS_PER_SLOT,
};
use kvshm_ipc::ring::RingError;
use kvshm_ipc::storage_record::{
    storage_pair_count, tier_unreachable, StorageEntry, StorageResults,
};
use kvshm_ipc::worker_watch::WorkerWatch;
use tracing::warn;

use crate::worker::Geometry;
use rank::Answered;

pub use config::{TransportConfig, TransportError, TransportStats, WorkerMissing};
pub use deadline::DEFAULT_COMMAND_DEADLINE;
pub use direct::{CopyKind, DirectCopyId, DirectCopyOutcome};
// The shared-memory types that appear in this module's API, so that an engine needs no direct
// dependency on kvshm-ipc.
pub use kvshm_ipc::arena::ArenaError;
pub use kvshm_ipc::config::{Backend, SegmentConfig};
pub use kvshm_ipc::counters::Counter;
pub use kvshm_ipc::device_handles::{DeviceHandleError, DeviceRegionHandle, CUDA_IPC_HANDLE_BYTES};
pub use kvshm_ipc::doorbell::{WaitOutcome, WaitPolicy};
pub use kvshm_ipc::name::{NameError, SegmentName};
pub use kvshm_ipc::segment::{CompletionBell, CreateError, Segment, SegmentError};
pub use memory::{BlockAccessError, RankMemory};
pub use rank::{RankChannel, RankState};
pub use tracker::{CommandTracker, CompletionMismatch, RankFailure};

/// How long a wait sleeps on the doorbell before it polls again (and so checks liveness).
pub const WAIT_SLICE: Duration = Duration::from_millis(5);
/// How long a wait spins on the doorbell before it sleeps: a copy of a few blocks often lands
/// within it, and it is about what a wake-up would cost (`kvshm_ipc::doorbell`, "How long to
/// spin").
pub const WAIT_SPIN: Duration = DEFAULT_SPIN;
/// Completions reaped per ring per batch.
const REAP_BATCH: usize = 256;
/// The most bytes one command asks one rank to copy, unless configured otherwise.
pub const DEFAULT_MAX_COMMAND_BYTES: u64 = 64 * 1024 * 1024;
/// Ring sizes for typical batches.
pub const DEFAULT_COMMAND_RING_SLOTS: u32 = 4096;
pub const DEFAULT_COMPLETION_RING_SLOTS: u32 = 256;

/// What an owner names its jobs with (the service: a transfer or a storage query).
pub trait Job: Copy + Eq + Hash + Debug {}
impl<T: Copy + Eq + Hash + Debug> Job for T {}

/// What a command was issued for: the one distinction `Transport::settle` makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Issuer<J> {
    /// A job of the transport's owner: its outcome goes to the owner as an [`Event`].
    Owner(J),
    /// A direct copy: the transport retries it or hands out its outcome ([`direct`]).
    Direct(DirectCopyId),
}

/// What the transport tells its owner, in the order it happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event<J> {
    /// A storage command of `job` succeeded on one rank: `results` of its entries
    /// `first..first + entries` (a block a rank did not report done missed there), and whether
    /// the rank could not reach the tier for some of them (`unreachable`: its failed entries
    /// failed for the tier, not for the blocks).
    StorageAnswered {
        job: J,
        first: usize,
        entries: usize,
        results: StorageResults,
        unreachable: bool,
    },
    /// Every command of `job` ended on every rank: success, or the first failure (a dead worker's
    /// commands fail with `WorkerDied`, once no process of it can touch the job's blocks).
    Ended { job: J, outcome: Result<(), RankFailure> },
}

/// One segment's rings and workers (module flow), for an owner that names its jobs `J`; a
/// transport used for direct copies alone has no jobs of an owner (`Infallible`).
pub struct Transport<J: Job = Infallible> {
    segment: Segment,
    ranks: Vec<RankChannel>,
    /// Per rank, the worker the transport saw attach (the only process it ever signals).
    watches: Vec<WorkerWatch>,
    tracker: CommandTracker<Issuer<J>>,
    /// Per block copy in flight: its pairs, for the bytes it copied once it succeeds.
    copy_pairs: HashMap<Issuer<J>, usize>,
    /// Each storage command in flight, by (rank index, command id): its job, and the job's
    /// entries it carries (first, count).
    storage_commands: HashMap<(usize, u64), (J, usize, usize)>,
    /// Outcomes and storage answers for the owner, oldest first.
    events: Vec<Event<J>>,
    memory: Vec<RankMemory>,
    geometry: Geometry,
    layerwise: bool,
    /// Per rank, whether creation took over a host tier left by a gone creator.
    host_tier_kept: Vec<bool>,
    max_pairs_per_command: usize,
    /// The most entries one storage command carries: 32 (the result bits), and bounded as a
    /// copy is (half a ring, one slot per block; `max_command_bytes` of each rank's bytes).
    max_storage_entries: usize,
    command_deadline: Duration,
    answer_clocks: deadline::AnswerClocks,
    liveness_checked_at: Option<Instant>,
    stats: TransportStats,
    completion_scratch: Vec<Completion>,
    direct: direct::DirectCopies,
}

impl<J: Job> Transport<J> {
    /// Creates segment `name` (replacing a stale one) with its arenas and takes the scheduler's
    /// ends of its rings. Workers attach afterwards (`kvshm worker --name NAME --rank R`).
    pub fn create(name: &SegmentName, config: &TransportConfig) -> Result<Self, TransportError> {
        let geometry = config.geometry()?;
        let header = &config.segment;
        if header.host_tier_is_shared() != config.shared_tier.is_some() {
            return Err(TransportError::SharedTierName);
        }
        let (segment, host_tier_kept) = if config.keep_host_tier {
            Segment::create_keeping_host_tier(name, header)?
        } else {
            (Segment::create(name, header)?, Vec::new())
        };
        let ranks = (0..header.tp_size)
            .map(|rank| RankChannel::open(&segment, rank))
            .collect::<Result<Vec<_>, _>>()?;
        let watches =
            (0..header.tp_size).map(|_| segment.worker_watch()).collect::<Result<Vec<_>, _>>()?;
        let memory = if header.backend == Backend::HostArena.to_wire() {
            (0..header.tp_size)
                .map(|rank| {
                    let device = segment.open_arena(ArenaKind::Device, rank)?;
                    let host = match &config.shared_tier {
                        // One rank (validated): the tier's rank `tier_rank` is the segment's 0.
                        Some((tier, tier_rank)) => {
                            Some(Arena::open(tier, ArenaKind::Host, *tier_rank)?)
                        }
                        None if header.host_blocks > 0 => {
                            Some(segment.open_arena(ArenaKind::Host, rank)?)
                        }
                        None => None,
                    };
                    Ok(RankMemory::new(&geometry, device, host)?)
                })
                .collect::<Result<Vec<_>, TransportError>>()?
        } else {
            Vec::new()
        };
        // A command must fit in half a ring, so that one long command never waits for a ring
        // that can only hold it when empty behind another long one.
        let pair_slots = (header.command_ring_slots as usize / 2).saturating_sub(1).max(1);
        // And a command carries at most max_command_bytes per rank, so that it ends in bounded
        // time (at least one block, whatever the limit).
        let pairs_by_bytes = (config.max_command_bytes / geometry.block_bytes().max(1)).max(1);
        let pairs_by_bytes = usize::try_from(pairs_by_bytes).unwrap_or(usize::MAX);
        let max_pairs_per_command = (pair_slots * PAIRS_PER_SLOT).min(pairs_by_bytes);
        debug_assert!(
            command_slot_count(max_pairs_per_command) <= header.command_ring_slots as usize
        );
        let max_storage_entries =
            kvshm_ipc::storage_record::MAX_STORAGE_ENTRIES.min(pair_slots).min(pairs_by_bytes);
        let transport = Transport {
            tracker: CommandTracker::new(header.tp_size as usize),
            copy_pairs: HashMap::new(),
            storage_commands: HashMap::new(),
            events: Vec::new(),
            answer_clocks: deadline::AnswerClocks::new(header.tp_size as usize),
            segment,
            ranks,
            watches,
            memory,
            geometry,
            layerwise: config.layerwise,
            host_tier_kept,
            max_pairs_per_command,
            max_storage_entries,
            command_deadline: config.command_deadline,
            liveness_checked_at: None,
            stats: TransportStats::default(),
            completion_scratch: Vec::new(),
            direct: direct::DirectCopies::default(),
        };
        transport.publish_counters();
        Ok(transport)
    }

    pub fn segment(&self) -> &Segment {
        &self.segment
    }

    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    pub fn stats(&self) -> TransportStats {
        self.stats
    }

    /// The engine's view of `rank`'s block bytes (host backend only).
    pub fn memory(&self, rank: u32) -> Option<&RankMemory> {
        self.memory.get(rank as usize)
    }

    pub fn rank_states(&self) -> Vec<RankState> {
        self.ranks.iter().map(RankChannel::state).collect()
    }

    /// The first rank without a live worker (`None`: every rank has one and serves).
    pub fn first_rank_not_up(&self) -> Option<u32> {
        self.ranks.iter().find(|rank| !rank.is_up()).map(RankChannel::rank)
    }

    /// The first rank no worker holds at all (its jobs would fail at once).
    pub fn first_rank_down(&self) -> Option<u32> {
        self.ranks.iter().find(|rank| rank.is_down()).map(RankChannel::rank)
    }

    /// Whether no worker holds rank `index`.
    pub fn is_down(&self, index: usize) -> bool {
        self.ranks[index].is_down()
    }

    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Whether `rank`'s host tier was taken over at creation, bytes and all
    /// ([`TransportConfig::keep_host_tier`]).
    pub fn host_tier_kept(&self, rank: u32) -> bool {
        self.host_tier_kept.get(rank as usize).copied().unwrap_or(false)
    }

    /// Leaves the host tier arenas behind when the transport drops, for the next creator of the
    /// name that keeps host tiers (the rest of the segment goes).
    pub fn keep_host_tier_on_drop(&mut self) {
        self.segment.keep_host_tier_on_drop();
    }

    /// What a thread needs to sleep until a worker answers without holding the transport (see
    /// [`CompletionBell`]).
    pub fn completion_bell(&self) -> Result<CompletionBell, SegmentError> {
        self.segment.completion_bell()
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

    /// Queues block copy `job` of `pairs` on every rank (step 1 of the module flow), split into
    /// commands that fit the rings and `max_command_bytes`.
    pub fn queue_copy(&mut self, job: J, kind: CopyKind, pairs: &[BlockPair]) {
        self.queue_pairs(Issuer::Owner(job), kind, pairs);
    }

    fn queue_pairs(&mut self, issuer: Issuer<J>, kind: CopyKind, pairs: &[BlockPair]) {
        // Swap-outs report layers too: a new block claimed from a swap-out may be written layer
        // by layer as soon as the copy has read that layer.
        let flags = if self.layerwise { FLAG_LAYERWISE } else { 0 };
        let generation = self.segment.generation();
        for chunk in pairs.chunks(self.max_pairs_per_command) {
            let header =
                CommandHeader::new(kind.op(), 0, generation, chunk.len() as u32).with_flags(flags);
            for rank in &mut self.ranks {
                let command_id = rank.queue(header, chunk);
                self.tracker.begin(issuer, rank.rank() as usize, command_id);
                self.stats.commands_issued += 1;
            }
        }
        self.copy_pairs.insert(issuer, pairs.len());
    }

    /// Queues storage job `job` (STORE, LOAD, QUERY or FORGET of `entries`) on the ranks of
    /// index `ranks`, or on every rank for `None`, at most `max_storage_entries` entries per
    /// command. Each command's success comes back as an [`Event::StorageAnswered`].
    pub fn queue_storage(
        &mut self,
        job: J,
        op: Op,
        entries: &[StorageEntry],
        ranks: Option<&[usize]>,
    ) {
        let generation = self.segment.generation();
        let chunk_len = self.max_storage_entries;
        for (chunk_index, chunk) in entries.chunks(chunk_len).enumerate() {
            let header = CommandHeader::new(op, 0, generation, storage_pair_count(chunk.len()));
            for (index, rank) in self.ranks.iter_mut().enumerate() {
                if ranks.is_some_and(|ranks| !ranks.contains(&index)) {
                    continue;
                }
                let command_id = rank.queue_storage(header, chunk);
                self.tracker.begin(Issuer::Owner(job), index, command_id);
                let first = chunk_index * chunk_len;
                self.storage_commands.insert((index, command_id), (job, first, chunk.len()));
                self.stats.commands_issued += 1;
            }
        }
    }

    /// Layers of `job`'s blocks that have landed on every rank: all of them once no command of
    /// it is outstanding (the owner tells a job not yet queued from one that ended), none once a
    /// command of it failed (its blocks will not hold what the job copies, on that rank at
    /// least, however far the other ranks got).
    pub fn layers_ready(&self, job: J) -> u32 {
        let layers = self.geometry.layers();
        if self.tracker.has_failed(Issuer::Owner(job)) {
            return 0;
        }
        self.tracker
            .outstanding_commands(Issuer::Owner(job))
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

    /// Step 4 of the module flow: watches the workers, reaps every completion, checks the
    /// command deadline. The owner then takes the events.
    pub fn poll(&mut self) {
        self.check_workers();
        self.reap_completions();
        self.check_command_deadlines();
    }

    /// Moves the outcomes and storage answers that arrived since the last call into `out`.
    pub fn take_events(&mut self, out: &mut Vec<Event<J>>) {
        out.append(&mut self.events);
    }

    /// Step 2 of the module flow: issues the waiting direct copies if every rank has a worker,
    /// then moves queued commands into the rings as credits allow and rings the doorbells.
    pub fn pump(&mut self) {
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

    /// Watches the workers on the next poll, however recently they were watched.
    pub fn watch_workers_now(&mut self) {
        self.liveness_checked_at = None;
    }

    /// One step of [`wait_for_workers`](Self::wait_for_workers): watches the workers now, polls
    /// and pumps; returns the first rank without a worker, `None` once every rank has one.
    pub fn poll_workers(&mut self) -> Option<u32> {
        self.watch_workers_now();
        self.poll();
        self.pump();
        self.first_rank_not_up()
    }

    /// Polls until every rank has a live worker, or fails after `timeout`.
    pub fn wait_for_workers(&mut self, timeout: Duration) -> Result<(), WorkerMissing> {
        wait_for_workers(timeout, || self.poll_workers())
    }

    /// Spins, then sleeps on the scheduler doorbell until a completion is waiting or `until`.
    pub fn sleep_until_completion(&mut self, until: Instant) {
        let Transport { segment, ranks, .. } = self;
        segment.scheduler_doorbell().wait_until(
            || ranks.iter_mut().any(|rank| !rank.is_down() && rank.has_completions()),
            WaitPolicy::new(WAIT_SPIN, WAIT_SLICE).until(until),
        );
    }

    /// Stores the transport's figures in the segment's live counters (kvctl); the owner stores
    /// the copies' outcomes (failures, bytes) and its own.
    pub fn publish_counters(&self) {
        let counters = self.segment.counters();
        let in_flight: usize = self.ranks.iter().map(RankChannel::in_rings).sum();
        let values = [
            (Counter::CommandsIssued, self.stats.commands_issued),
            (Counter::CommandsCompleted, self.stats.commands_completed),
            (Counter::CommandsInFlight, in_flight as u64),
            (Counter::Generation, self.segment.generation()),
            (Counter::WorkerDeaths, self.stats.worker_deaths),
            (Counter::LastPollNs, kvshm_ipc::liveness::monotonic_ns()),
        ];
        for (counter, value) in values {
            counters.set(counter, value);
        }
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
                self.apply(index, completion);
            }
        };
        self.completion_scratch = completions;
        result
    }

    /// One completion of rank `index`: a stray (no command of it in the ring) is counted and
    /// ignored; the commands of its lane it overtook fail first, their answers lost
    /// ([`rank::Answered`]); then it is applied ([`Transport::apply_answer`]).
    fn apply(&mut self, index: usize, completion: &Completion) {
        let lost = match self.ranks[index].answered(completion.command_id) {
            Answered::InRing { lost } => lost,
            Answered::NotInRing => {
                self.stats.stray_completions += 1;
                warn!(
                    rank = index,
                    command = completion.command_id,
                    "ignoring a completion of no command in the ring"
                );
                return;
            }
        };
        for command_id in lost {
            self.stats.lost_answers += 1;
            warn!(rank = index, command = command_id, "a later answer overtook it: answer lost");
            let failed =
                Completion::failed(command_id, completion.generation, CommandError::AnswerLost, 0);
            self.apply_answer(index, &failed);
        }
        self.apply_answer(index, completion);
    }

    /// An answer to a command in the ring: a storage command's per-entry results go to its job's
    /// owner, and the job settles once this was its last command.
    fn apply_answer(&mut self, index: usize, completion: &Completion) {
        let storage = self.storage_commands.remove(&(index, completion.command_id));
        if let (Some((job, first, entries)), true) = (storage, completion.is_ok()) {
            let results = StorageResults::from_detail(completion.detail).masked(entries);
            let unreachable = tier_unreachable(completion);
            self.events.push(Event::StorageAnswered { job, first, entries, results, unreachable });
        }
        match self.tracker.complete(index, completion) {
            Ok(ended) => {
                self.answer_clocks.restart(index, Instant::now());
                if let Some((issuer, outcome)) = ended {
                    self.settle(issuer, outcome);
                }
            }
            Err(mismatch) => {
                self.stats.stray_completions += 1;
                warn!(%mismatch, "ignoring a completion");
            }
        }
    }

    /// Where the outcome of a job goes: the owner's jobs become events, direct copies are
    /// retried or handed out ([`direct`]). A block copy that succeeded counts its bytes.
    fn settle(&mut self, issuer: Issuer<J>, outcome: Result<(), RankFailure>) {
        let bytes = match (self.copy_pairs.remove(&issuer), outcome) {
            (Some(pairs), Ok(())) => {
                pairs as u64 * self.geometry.block_bytes() * self.ranks.len() as u64
            }
            _ => 0,
        };
        self.stats.bytes_copied += bytes;
        match issuer {
            Issuer::Owner(job) => self.events.push(Event::Ended { job, outcome }),
            Issuer::Direct(id) => self.settle_direct(id, outcome, bytes),
        }
    }
}

/// Polls with `step` until it finds no rank without a worker, or fails after `timeout`.
pub(crate) fn wait_for_workers(
    timeout: Duration,
    mut step: impl FnMut() -> Option<u32>,
) -> Result<(), WorkerMissing> {
    let started = Instant::now();
    let deadline = deadline_after(timeout);
    loop {
        match step() {
            None => return Ok(()),
            Some(rank) if Instant::now() >= deadline => {
                return Err(WorkerMissing { rank, waited: started.elapsed() })
            }
            Some(_) => std::thread::sleep(Duration::from_millis(2)),
        }
    }
}
