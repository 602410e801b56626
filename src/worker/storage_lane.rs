//! The worker's storage thread: STORE, LOAD, QUERY and FORGET commands run here, beside the copy loop,
//! so that storage I/O (milliseconds per block on disk, a network round trip to Redis, seconds
//! when Redis is away) never stalls the rank's device copies.
//!
//! Core types: [`StorageLane`] (the copy loop's handle on the thread), [`LaneContext`],
//! [`HostBlocks`] (the rank's host blocks as the thread sees them). Opening the back-end before
//! the lane starts is [`super::storage_open`]'s.
//!
//! One storage command:
//!
//! 1. the worker opened its rank's back-end before serving ([`open_backend`](super::storage_open::open_backend): heartbeating while
//!    a large slab is created, retrying while a worker being replaced still holds the slab);
//! 2. the copy loop reads commands in ring order; it hands every storage command, valid or not,
//!    to the lane ([`StorageLane::takes`], [`StorageLane::submit`]), which validates it and queues
//!    the job (a refusal is queued as its completion); with a lane, a FLUSH is queued too, after
//!    the loop published its own earlier completions;
//! 3. the storage thread takes the jobs in queue order: it heartbeats (a rank lost to the
//!    scheduler ends the process at once, as during a copy), runs the command on the back-end
//!    over the host blocks' memory, adds the outcomes to the segment's storage counters, and
//!    pushes the completion (its `detail` the per-entry [`StorageResults`], flagged when the
//!    tier could not be reached for some block of a STORE or LOAD) through the shared
//!    [`CompletionSink`], ringing the scheduler's doorbell;
//! 4. when the loop ends the queue closes, and the thread answers every queued job and syncs the
//!    back-end before it exits, so every command popped from the ring is answered; the worker's
//!    main thread heartbeats meanwhile ([`StorageLane::close`]), however long one job takes. A
//!    stop that finds no room in the completion ring for an answer (the scheduler stopped
//!    reaping) leaves that job and the rest unanswered: the worker then exits without releasing
//!    its rank, as the copy loop does ([`super::run::ServeError::StoppedUnanswered`]).
//!
//! Order, as the scheduler sees it: copies complete in ring order among themselves (the loop runs
//! them one by one); storage commands complete in ring order among themselves (one thread, one
//! FIFO queue); a FLUSH completes after every command before it, of either kind (the loop has
//! finished and published its copies before it queues the FLUSH behind the storage jobs). A copy
//! and a storage command have no order between them: the scheduler never issues a command that
//! touches a host block another outstanding command writes (block ownership: DESIGN §6,
//! invariant 2), so it waits for a LOAD's completion before copying its host blocks to the device, and for a
//! STORE's before reusing its host blocks.

use std::ptr::NonNull;
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::{Scope, ScopedJoinHandle};
use std::time::{Duration, Instant};

use kvshm_ipc::counters::{Counter, Counters};
use kvshm_ipc::record::{BlockPair, CommandError, CommandHeader, Completion, Op};
use kvshm_ipc::segment::{RankClaim, Segment};
use kvshm_ipc::storage_record::{storage_answer, StorageResults};
use kvshm_ipc::worker_slot::{ClaimLost, HEARTBEAT_INTERVAL};

use super::completion_sink::CompletionSink;
use super::geometry::Geometry;
use super::host_engine::MappedArea;
use super::run::{ServeError, EXIT_CLAIM_LOST};
use super::storage_command::{StorageCommand, StorageOp};
use super::validate::{validate, ValidCommand};
use crate::hash::BlockHash;
use crate::storage::tally::Tally;
use crate::storage::{
    BlockBytes, BlockBytesMut, BlockKey, Failure, GetBlock, GetMiss, GetOutcome, PutBlock,
    PutOutcome, StorageBackend,
};

/// How often a storage thread facing a full completion ring looks for room.
const FULL_RING_POLL: Duration = Duration::from_micros(500);

/// The rank's host tier as the storage thread reads and writes it: block `b` is `block_bytes`
/// at `b * block_bytes` (block-major, as the copy engines lay it out).
#[derive(Clone, Copy, Debug)]
pub struct HostBlocks {
    area: MappedArea,
    block_bytes: usize,
    blocks: u32,
}

// SAFETY: the tier is a shared mapping that outlives the worker's threads (MappedArea's premise);
// moving the description to the storage thread moves no ownership, and the thread touches the
// bytes only under the block-ownership protocol (see `block`).
unsafe impl Send for HostBlocks {}

impl HostBlocks {
    /// The host tier over `area`; `None` when the area cannot hold the geometry's host blocks or
    /// the geometry has none.
    pub fn new(area: MappedArea, geometry: &Geometry) -> Option<HostBlocks> {
        let block_bytes = usize::try_from(geometry.block_bytes()).ok()?;
        let needed = block_bytes.checked_mul(geometry.host_blocks() as usize)?;
        (geometry.host_blocks() > 0 && area.len() >= needed).then_some(HostBlocks {
            area,
            block_bytes,
            blocks: geometry.host_blocks(),
        })
    }

    /// Where host block `block` starts.
    ///
    /// # Panics
    ///
    /// If `block` is out of range: validation refuses such ids, so this is a programming error.
    fn start(&self, block: u32) -> NonNull<u8> {
        assert!(block < self.blocks, "host block {block} out of range is a programming error");
        // SAFETY: block * block_bytes + block_bytes <= the area's length (checked in `new` and
        // above), so the offset stays inside the mapped area; forming the pointer reads nothing.
        let start = unsafe { self.area.as_ptr().add(block as usize * self.block_bytes) };
        NonNull::new(start).expect("a mapped area is not at null")
    }

    /// The bytes of host block `block`, to be stored.
    ///
    /// # Safety
    ///
    /// Trusted peer: while the view is used, no process or thread writes the block (the
    /// scheduler hands a block to one command at a time; a STORE only reads it).
    unsafe fn block<'a>(&self, block: u32) -> BlockBytes<'a> {
        // SAFETY: the block lies in the mapped area, which outlives the storage thread (the
        // MappedArea premise); the caller guarantees no one writes it meanwhile.
        unsafe { BlockBytes::from_raw(self.start(block), self.block_bytes) }
    }

    /// The bytes of host block `block`, to be loaded into.
    ///
    /// # Safety
    ///
    /// Trusted peer: while the view is used, no other process or thread reads or writes the
    /// block (a LOAD owns its destinations), and no other view of it exists (validation refuses
    /// a LOAD into one block twice).
    unsafe fn block_mut<'a>(&self, block: u32) -> BlockBytesMut<'a> {
        // SAFETY: as in `block`; exclusive use is the caller's guarantee.
        unsafe { BlockBytesMut::from_raw(self.start(block), self.block_bytes) }
    }
}

/// What the storage thread needs from the worker.
pub struct LaneContext<'env> {
    pub segment: &'env Segment,
    pub claim: &'env RankClaim,
    pub host: HostBlocks,
    pub sink: CompletionSink,
    /// Whether a stop was requested: polled while an answer waits for room in the ring.
    pub stop_requested: &'env (dyn Fn() -> bool + Sync),
}

enum Job {
    Run {
        id: u64,
        generation: u64,
        command: StorageCommand,
    },
    /// A refusal, answered in its place in the queue.
    Answer(Completion),
    Flush {
        id: u64,
        generation: u64,
    },
}

/// The copy loop's handle on the storage thread (module documentation).
pub struct StorageLane<'scope> {
    jobs: Option<Sender<Job>>,
    /// Returns how many jobs it could not answer ([`serve_jobs`]).
    thread: Option<ScopedJoinHandle<'scope, usize>>,
    /// The worker's claim, heartbeaten while the thread drains its queue at exit.
    claim: &'scope RankClaim,
    geometry: Geometry,
    kind: &'static str,
}

impl<'scope> StorageLane<'scope> {
    /// Starts the storage thread in `scope` over `backend`.
    pub fn spawn<'env>(
        scope: &'scope Scope<'scope, 'env>,
        backend: Box<dyn StorageBackend>,
        context: LaneContext<'env>,
        geometry: Geometry,
    ) -> std::io::Result<StorageLane<'scope>> {
        let (jobs, queue) = mpsc::channel();
        let kind = backend.kind();
        if backend.is_shared() {
            // Before the rank is marked serving: the scheduler asks a shared tier about blocks
            // it does not know (prefetch discovery), and only a shared one.
            context.segment.counters().set(Counter::StorageSharedTier, 1);
        }
        let claim = context.claim;
        let thread = std::thread::Builder::new()
            .name(format!("kvshm-storage-{}", context.claim.rank()))
            .spawn_scoped(scope, move || serve_jobs(backend, context, queue))?;
        Ok(StorageLane { jobs: Some(jobs), thread: Some(thread), claim, geometry, kind })
    }

    /// `"disk"` or `"redis"`.
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    /// Whether the lane answers this command: every storage op, and FLUSH (which must wait for
    /// the storage commands before it).
    pub fn takes(&self, header: &CommandHeader) -> bool {
        Op::from_wire(header.op).is_some_and(|op| op.is_storage() || op == Op::Flush)
    }

    /// Queues `completion`, the copy loop's answer to a command the lane takes but cannot be
    /// handed (its pair slots are not in the ring), behind the lane's earlier jobs: answers keep
    /// the lane's order.
    pub fn answer(&self, completion: Completion) {
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(Job::Answer(completion));
        }
    }

    /// Validates a command the lane takes and queues it (step 2 of the module documentation).
    pub fn submit(&self, header: &CommandHeader, pairs: &[BlockPair], generation: u64) {
        let (id, command_generation) = (header.command_id, header.generation);
        let job = match validate(header, pairs, &self.geometry, generation) {
            Ok(ValidCommand::Storage(command)) => {
                Job::Run { id, generation: command_generation, command }
            }
            Ok(ValidCommand::Flush) => Job::Flush { id, generation: command_generation },
            Ok(_) => Job::Answer(Completion::failed(
                id,
                command_generation,
                CommandError::Malformed,
                header.op.into(),
            )),
            Err(refusal) => {
                tracing::debug!(command = id, %refusal, "refusing a storage command");
                let (error, detail) = refusal.to_wire();
                Job::Answer(Completion::failed(id, command_generation, error, detail))
            }
        };
        if let Some(jobs) = &self.jobs {
            // The thread only ends when this sender is dropped, or when it panicked: the copy
            // loop then stops the worker at its next turn ([`StorageLane::has_ended`]).
            let _ = jobs.send(job);
        }
    }
}

impl StorageLane<'_> {
    /// Whether the thread ended while the queue is open: it panicked.
    pub fn has_ended(&self) -> bool {
        self.jobs.is_some() && self.thread.as_ref().is_some_and(|thread| thread.is_finished())
    }

    /// Closes the queue and waits until the thread answered every job (step 4), heartbeating
    /// meanwhile: one job (a Redis part waiting out its timeout, the exit sync of a large slab)
    /// may take far longer than the heartbeat timeout, and the storage thread heartbeats only
    /// between jobs. Fails when a job went unanswered: a stop arrived while an answer waited
    /// for room in the completion ring, or the thread panicked (the commands queued since went
    /// unanswered too).
    pub fn close(&mut self) -> Result<(), ServeError> {
        drop(self.jobs.take());
        let Some(thread) = self.thread.take() else { return Ok(()) };
        while !thread.is_finished() {
            // A lost claim: the storage thread ends the process at its next heartbeat.
            let _ = self.claim.heartbeat();
            std::thread::sleep(HEARTBEAT_INTERVAL);
        }
        match thread.join() {
            Ok(0) => Ok(()),
            Ok(unanswered) => Err(ServeError::StoppedUnanswered { unanswered }),
            Err(_) => {
                tracing::error!("the storage thread panicked");
                Err(ServeError::StorageThreadPanicked)
            }
        }
    }
}

impl Drop for StorageLane<'_> {
    /// [`StorageLane::close`], for a lane the copy loop did not close (it ended on an error).
    fn drop(&mut self) {
        let _ = self.close();
    }
}

/// Steps 3 and 4 of the module documentation, on the storage thread. Returns how many jobs
/// went unanswered: once a stop finds no room for an answer, the jobs left are not run.
fn serve_jobs(
    mut backend: Box<dyn StorageBackend>,
    context: LaneContext<'_>,
    queue: Receiver<Job>,
) -> usize {
    let counters = context.segment.counters();
    let block_bytes = backend.layout().block_bytes;
    let mut runner = Runner { last_evictions: backend.stats().evictions, ..Runner::default() };
    let mut unanswered = 0;
    for job in queue {
        if unanswered > 0 {
            unanswered += 1;
            continue;
        }
        if let Err(lost) = context.claim.heartbeat() {
            abandon_rank(lost);
        }
        let completion = match job {
            Job::Answer(completion) => completion,
            Job::Flush { id, generation } => Completion::ok(id, generation),
            Job::Run { id, generation, command } => {
                let started = Instant::now();
                let ran = runner.run(backend.as_mut(), &context.host, &command);
                counters.add(Counter::StorageIoNs, started.elapsed().as_nanos() as u64);
                runner.publish_counters(counters, backend.as_ref(), block_bytes);
                ran.completion(id, generation)
            }
        };
        if publish(&context, completion) == Published::StoppedWithoutRoom {
            tracing::warn!("stopped while the completion ring had no room for a storage answer");
            unanswered = 1;
        }
    }
    if let Err(failure) = backend.sync() {
        tracing::warn!(%failure, "cannot sync the storage tier at exit");
    }
    unanswered
}

/// How [`publish`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Published {
    /// In the ring (or not needed: the scheduler is gone).
    Done,
    /// A stop was requested while the ring had no room: the answer is owed.
    StoppedWithoutRoom,
}

/// Pushes one completion, waiting for room (heartbeating) while the scheduler lives and no stop
/// is requested (once a stop is, one more wait for room, as the copy loop gives its answers).
fn publish(context: &LaneContext<'_>, completion: Completion) -> Published {
    let mut stop_seen = false;
    loop {
        if context.sink.push_available(&[completion]) == 1 {
            context.segment.scheduler_doorbell().ring();
            return Published::Done;
        }
        if !context.segment.creator_alive() {
            return Published::Done;
        }
        if (context.stop_requested)() {
            if stop_seen {
                return Published::StoppedWithoutRoom;
            }
            stop_seen = true;
        }
        std::thread::sleep(FULL_RING_POLL);
        if let Err(lost) = context.claim.heartbeat() {
            abandon_rank(lost);
        }
    }
}

/// Ends the process: the scheduler reclaimed the rank while storage commands were queued, and
/// their host blocks may already belong to other commands.
fn abandon_rank(lost: ClaimLost) -> ! {
    tracing::error!(%lost, "rank reclaimed with storage commands queued; exiting at once");
    eprintln!("kvshm worker: the scheduler reclaimed this rank during storage I/O ({lost})");
    std::process::exit(EXIT_CLAIM_LOST);
}

/// What one command met on the back-end: its per-entry results, and whether the tier could not
/// be reached for some block of a STORE or LOAD ([`Failure::is_unreachable`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Ran {
    results: StorageResults,
    unreachable: bool,
}

impl Ran {
    /// The command's answer: its results, flagged when the tier could not be reached
    /// ([`TIER_UNREACHABLE`](kvshm_ipc::storage_record::TIER_UNREACHABLE)). Without the flag,
    /// results that mix landed blocks with failed ones say one bad block, which the scheduler
    /// drops while the tier stays up; with it, the tier is failing and the failed blocks may
    /// still be there.
    fn completion(self, id: u64, generation: u64) -> Completion {
        storage_answer(id, generation, self.results, self.unreachable)
    }
}

/// Whether a put failed because the tier could not be reached.
fn put_unreachable(outcome: &PutOutcome) -> bool {
    outcome.as_ref().is_err_and(Failure::is_unreachable)
}

/// Whether a get failed because the tier could not be reached.
fn get_unreachable(outcome: &GetOutcome) -> bool {
    matches!(outcome, Err(GetMiss::Failed(failure)) if failure.is_unreachable())
}

/// Runs commands and keeps what the counters need between them.
#[derive(Default)]
struct Runner {
    tally: Tally,
    last_evictions: u64,
    put_outcomes: Vec<PutOutcome>,
    get_outcomes: Vec<GetOutcome>,
    contains_outcomes: Vec<crate::storage::ContainsOutcome>,
}

impl Runner {
    /// Runs one validated command against the back-end over the host tier.
    fn run(
        &mut self,
        backend: &mut dyn StorageBackend,
        host: &HostBlocks,
        command: &StorageCommand,
    ) -> Ran {
        let mut results = StorageResults::default();
        let mut unreachable = false;
        let entries = &command.entries;
        match command.op {
            StorageOp::Store => {
                let blocks: Vec<PutBlock<'_>> = entries
                    .iter()
                    .map(|entry| PutBlock {
                        key: BlockKey::new(
                            BlockHash(entry.hash()),
                            BlockHash(entry.parent()),
                            entry.depth,
                        ),
                        // SAFETY: validated in range; the scheduler keeps a STORE's host blocks
                        // unwritten until its completion (trusted peer).
                        bytes: unsafe { host.block(entry.host_block) },
                    })
                    .collect();
                backend.put(&blocks, &mut self.put_outcomes);
                unreachable = self.put_outcomes.iter().any(put_unreachable);
                for (index, outcome) in self.put_outcomes.iter().enumerate() {
                    // A full tier refused the block: not written, but the tier did not fail
                    // (the scheduler marks a failing tier down, not a full one).
                    let failed =
                        outcome.as_ref().is_err_and(|failure| *failure != Failure::NoSpace);
                    results.set(index, outcome.is_ok(), failed);
                }
                self.tally.puts(&self.put_outcomes);
            }
            StorageOp::Load => {
                let mut blocks: Vec<GetBlock<'_>> = entries
                    .iter()
                    .map(|entry| GetBlock {
                        hash: BlockHash(entry.hash()),
                        // SAFETY: validated in range and distinct; the scheduler lets no one
                        // else touch a LOAD's host blocks until its completion (trusted peer).
                        dest: unsafe { host.block_mut(entry.host_block) },
                    })
                    .collect();
                backend.get(&mut blocks, &mut self.get_outcomes);
                unreachable = self.get_outcomes.iter().any(get_unreachable);
                for (index, outcome) in self.get_outcomes.iter().enumerate() {
                    let failed = matches!(outcome, Err(GetMiss::Failed(_)));
                    results.set(index, outcome.is_ok(), failed);
                }
                self.tally.gets(&self.get_outcomes);
            }
            StorageOp::Query => {
                let hashes: Vec<BlockHash> =
                    entries.iter().map(|entry| BlockHash(entry.hash())).collect();
                backend.contains(&hashes, &mut self.contains_outcomes);
                for (index, outcome) in self.contains_outcomes.iter().enumerate() {
                    results.set(index, *outcome == Ok(true), outcome.is_err());
                }
                self.tally.queries(&self.contains_outcomes);
            }
            StorageOp::Forget => {
                let hashes: Vec<BlockHash> =
                    entries.iter().map(|entry| BlockHash(entry.hash())).collect();
                backend.forget(&hashes, &mut self.put_outcomes);
                for (index, outcome) in self.put_outcomes.iter().enumerate() {
                    results.set(index, outcome.is_ok(), outcome.is_err());
                }
                self.tally.forgets(&self.put_outcomes);
            }
        }
        Ran { results: results.masked(entries.len()), unreachable }
    }

    /// Adds what happened since the last call to the segment's counters.
    fn publish_counters(
        &mut self,
        counters: &Counters,
        backend: &dyn StorageBackend,
        block_bytes: u64,
    ) {
        let tally = std::mem::take(&mut self.tally);
        let pairs = [
            (Counter::StorageStoredBlocks, tally.stored),
            (Counter::StorageStoreFailures, tally.store_failures),
            (Counter::StorageLoadHits, tally.load_hits),
            (Counter::StorageLoadMisses, tally.load_misses),
            (Counter::StorageCorruptBlocks, tally.corrupt),
            (Counter::StorageQueryBlocks, tally.queried),
            (Counter::StorageForgottenBlocks, tally.forgotten),
            (Counter::StorageErrors, tally.errors),
            (Counter::StorageTimeouts, tally.timeouts),
            (Counter::StorageUnavailable, tally.unavailable),
            (Counter::StorageNoSpace, tally.no_space),
            (Counter::StorageBytesWritten, tally.stored.saturating_mul(block_bytes)),
            (Counter::StorageBytesRead, tally.load_hits.saturating_mul(block_bytes)),
        ];
        for (counter, value) in pairs {
            if value > 0 {
                counters.add(counter, value);
            }
        }
        let evictions = backend.stats().evictions;
        counters.add(Counter::StorageEvictions, evictions.saturating_sub(self.last_evictions));
        self.last_evictions = evictions;
    }
}

#[cfg(test)]
mod tests;
