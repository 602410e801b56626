//! The worker's serving loop: commands in, copies done, completions out, for one claimed rank.
//!
//! Core types: [`Server`] (the loop over one rank's rings and copy engine), [`ServeOptions`],
//! [`ServeExit`] (why the loop ended cleanly) and [`ServeError`] (why it had to stop).
//! [`super::process`] attaches, claims the rank and builds the engine before it calls
//! [`Server::serve`].
//!
//! One turn of the loop:
//!
//! 1. heartbeat the claim (a lost claim ends the loop: the scheduler reclaimed the rank); if a stop
//!    was requested (SIGTERM, SIGINT) or, checked every [`LIVENESS_CHECK_INTERVAL`], the segment's
//!    creator is gone, end cleanly. A stop is honoured between batches only, so every command
//!    popped from the ring has been answered when the loop ends and a successor worker can take
//!    over the rings where this one left them;
//! 2. pop a batch of command slots ([`CommandReader`]); if there is none, sleep on the rank's
//!    command doorbell for at most one [`IDLE_SLICE`] (after spinning for
//!    [`kvshm_ipc::doorbell::DEFAULT_SPIN`]) and start over. The
//!    sleep ends as soon as commands arrive, the scheduler closes the segment (it rings every
//!    command doorbell after marking the segment closed) or a stop signal arrives (it interrupts
//!    the futex wait; the flag is part of the wait's condition; a signal that lands between the
//!    last check and the sleep costs at most the slice);
//! 3. for each command of the batch, in order: heartbeat, validate it against the segment's
//!    current generation, and execute it. While a copy runs, the engine reports its progress at
//!    least every [`COPY_CHUNK_BYTES`](super::engine::COPY_CHUNK_BYTES) it moves and after each
//!    layer ([`CopyWatch`]): on every report the worker heartbeats, so its liveness does not depend
//!    on the size of a copy, and at most every [`LIVENESS_CHECK_INTERVAL`] it checks that the
//!    scheduler still runs; once it does not, the copy is abandoned and the loop ends (nobody will
//!    read the answer). After each layer the worker also publishes layer progress
//!    (`FLAG_LAYERWISE` commands) and sleeps the layer-delay test hook if one is configured. FLUSH
//!    and PING complete at once: commands run in order, so when a FLUSH is reached every earlier
//!    command of the rank has completed;
//! 4. publish the completions (push them, ring the scheduler doorbell) after every copy, so that
//!    a copy's completion never waits behind the next copy, and at the end of the batch.
//!
//! With a storage tier, step 3 hands storage commands and FLUSH to the storage thread instead
//! ([`super::storage_lane`], which also says what order completions keep); both threads push
//! completions through one [`CompletionSink`].
//!
//! Every command gets exactly one completion, which echoes its id and generation: OK, the
//! refusal's error and detail (`InvalidCommand::to_wire`), or `CopyFailed` with the engine's
//! detail. The scheduler keeps at most `completion_ring_slots` commands in a rank's rings, so the
//! completion ring has room; if it has none anyway, the worker waits for room (heartbeating and
//! watching the scheduler), never dropping a completion.
//!
//! The loop stops with an error when the command ring is out of step with its producer (a header
//! whose pair slots are not in the ring is answered `Malformed` first, in its lane's order) or
//! its indices are corrupt, and when a stop arrives while it waits for room for answers
//! ([`ServeError::StoppedUnanswered`]): the worker then exits without releasing its rank, and the
//! scheduler finds the rank departed and reclaims it (resetting its rings). A claim lost in the middle of a copy
//! ends the process on the spot ([`abandon_rank`]): the CUDA engine's enqueued copies cannot be
//! cancelled, and the rank's blocks may already serve other copies.
//!
//! # Test hooks
//!
//! [`ServeOptions::layer_delay`] (from the `KVSHM_WORKER_LAYER_DELAY_US` environment variable, see
//! `kvshm worker --help`) sleeps after every layer of every copy, so that a test can kill a worker
//! reliably in the middle of a copy. The worker keeps heartbeating while it sleeps.
//! [`ServeOptions::copy_rate_limit`] (`KVSHM_WORKER_COPY_RATE`) slows the host engine's copy itself
//! (it sleeps inside the copy, between chunks), so that a test can run one layer for a second.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use kvshm_ipc::counters::Counter;
use kvshm_ipc::doorbell::{Doorbell, WaitOutcome, WaitPolicy, DEFAULT_SPIN};
use kvshm_ipc::progress::LayerProgress;
use kvshm_ipc::record::{BlockPair, CommandError, CommandHeader, CommandSlot, Completion, Op};
use kvshm_ipc::ring::Consumer;
use kvshm_ipc::segment::{Mapped, RankClaim, Segment};
use kvshm_ipc::worker_slot::ClaimLost;

use super::command_reader::{CommandReader, ReadError};
use super::completion_sink::CompletionSink;
use super::engine::{CopyEngine, CopyFailure, CopyProgress};
use super::plan::CopyPlan;
use super::storage_lane::StorageLane;
use super::validate::{validate, ValidCommand};

/// How often a busy worker checks that the segment's creator still runs (an idle one checks every
/// [`IDLE_SLICE`]).
pub const LIVENESS_CHECK_INTERVAL: Duration = Duration::from_millis(10);
/// The longest sleep of an idle worker between heartbeats and liveness checks.
pub const IDLE_SLICE: Duration = Duration::from_millis(10);
/// The most command slots popped at once.
pub const DEFAULT_MAX_BATCH: usize = 64;
/// The exit status of a process that lost its rank in the middle of a copy.
pub const EXIT_CLAIM_LOST: i32 = 3;

/// How the loop behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServeOptions {
    /// The most command slots popped per batch.
    pub max_batch: usize,
    /// Test hook: sleep this long after each layer of each copy (module documentation).
    pub layer_delay: Option<Duration>,
    /// Test hook: the host engine copies at most this many bytes per second (module
    /// documentation).
    pub copy_rate_limit: Option<u64>,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions { max_batch: DEFAULT_MAX_BATCH, layer_delay: None, copy_rate_limit: None }
    }
}

/// Why the loop ended cleanly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServeExit {
    /// The segment's creator (the scheduler) is gone.
    SchedulerGone { pid: u32 },
    /// SIGTERM or SIGINT (or the caller's stop condition) asked the worker to stop.
    StopRequested,
}

/// Why the loop had to stop.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("the scheduler reclaimed the rank: {0}")]
    ClaimLost(#[from] ClaimLost),
    #[error(transparent)]
    CommandRing(#[from] ReadError),
    /// A stop arrived while the completion ring had no room for `unanswered` answers (the
    /// scheduler stopped reaping): the rank is left to the scheduler to reclaim, not released.
    #[error("stopped with {unanswered} answers the completion ring had no room for")]
    StoppedUnanswered { unanswered: usize },
    /// The storage thread panicked: the storage commands given to it since went unanswered, so
    /// the rank is left to the scheduler to reclaim.
    #[error("the storage thread panicked; storage commands went unanswered")]
    StorageThreadPanicked,
}

/// How one step of the loop can end it.
enum Halt {
    Exit(ServeExit),
    Error(ServeError),
}

impl From<ServeError> for Halt {
    fn from(error: ServeError) -> Self {
        Halt::Error(error)
    }
}

impl From<ClaimLost> for Halt {
    fn from(lost: ClaimLost) -> Self {
        Halt::Error(lost.into())
    }
}

impl From<ReadError> for Halt {
    fn from(error: ReadError) -> Self {
        Halt::Error(error.into())
    }
}

/// The serving loop of one claimed rank (module documentation).
pub struct Server<'a> {
    segment: &'a Segment,
    claim: &'a RankClaim,
    engine: &'a mut dyn CopyEngine,
    stop_requested: &'a dyn Fn() -> bool,
    options: ServeOptions,
    commands: Mapped<Consumer<CommandSlot>>,
    completions: CompletionSink,
    command_doorbell: &'a Doorbell,
    progress: LayerProgress<'a>,
    reader: CommandReader,
    pairs: Vec<BlockPair>,
    pending: Vec<Completion>,
    last_liveness_check: Instant,
    /// The storage thread, when the worker has a storage tier ([`super::storage_lane`]).
    storage: Option<StorageLane<'a>>,
}

/// Why a server cannot be set up over a rank.
#[derive(Debug, thiserror::Error)]
#[error("cannot reach the rings of rank {rank}: {reason}")]
pub struct ServerSetupError {
    rank: u32,
    reason: kvshm_ipc::segment::SegmentError,
}

impl<'a> Server<'a> {
    /// Takes the worker ends of `claim`'s rank: the command consumer and the completion producer.
    /// `stop_requested` is polled between batches and while idle.
    pub fn new(
        segment: &'a Segment,
        claim: &'a RankClaim,
        engine: &'a mut dyn CopyEngine,
        stop_requested: &'a dyn Fn() -> bool,
        options: ServeOptions,
    ) -> Result<Server<'a>, ServerSetupError> {
        let rank = claim.rank();
        let setup = |reason| ServerSetupError { rank, reason };
        Ok(Server {
            commands: segment.command_consumer(rank).map_err(setup)?,
            completions: CompletionSink::new(segment.completion_producer(rank).map_err(setup)?),
            command_doorbell: segment.command_doorbell(rank).map_err(setup)?,
            progress: segment.layer_progress(rank).map_err(setup)?,
            segment,
            claim,
            engine,
            stop_requested,
            options,
            reader: CommandReader::new(options.max_batch),
            pairs: Vec::new(),
            pending: Vec::new(),
            last_liveness_check: Instant::now(),
            storage: None,
        })
    }

    /// The completion producer, for the storage thread to push through too.
    pub fn completion_sink(&self) -> CompletionSink {
        self.completions.clone()
    }

    /// Hands storage commands (and FLUSH) to `lane` from now on.
    pub fn set_storage(&mut self, lane: StorageLane<'a>) {
        self.storage = Some(lane);
    }

    /// Serves commands until a stop is requested, the scheduler is gone, or the rank is lost or
    /// its command ring broken (module documentation), then waits for the storage thread to
    /// answer what it was given ([`StorageLane::close`]).
    pub fn serve(&mut self) -> Result<ServeExit, ServeError> {
        let served = self.serve_commands();
        let storage = self.storage.as_mut().map_or(Ok(()), StorageLane::close);
        match (served, storage) {
            (Ok(_), Err(error)) => Err(error),
            (served, _) => served,
        }
    }

    /// [`Server::serve`]'s loop over the command ring.
    fn serve_commands(&mut self) -> Result<ServeExit, ServeError> {
        loop {
            let turn = self.check_exit().and_then(|()| {
                if self.reader.fill(&mut self.commands)? {
                    self.serve_batch()
                } else {
                    self.wait_for_work(IDLE_SLICE);
                    Ok(())
                }
            });
            match turn {
                Ok(()) => {}
                Err(Halt::Exit(exit)) => return Ok(exit),
                Err(Halt::Error(error)) => return Err(error),
            }
        }
    }

    /// Step 1 of the loop.
    fn check_exit(&mut self) -> Result<(), Halt> {
        self.claim.heartbeat()?;
        if (self.stop_requested)() {
            return Err(Halt::Exit(ServeExit::StopRequested));
        }
        if self.storage.as_ref().is_some_and(StorageLane::has_ended) {
            // It panicked: the storage commands handed to it are answered by no one, and the
            // copies would keep the rank's deadline from ever noticing.
            return Err(ServeError::StorageThreadPanicked.into());
        }
        if self.last_liveness_check.elapsed() >= LIVENESS_CHECK_INTERVAL {
            self.last_liveness_check = Instant::now();
            if !self.segment.creator_alive() {
                return Err(Halt::Exit(ServeExit::SchedulerGone {
                    pid: self.segment.creator().pid,
                }));
            }
        }
        Ok(())
    }

    /// Step 2 of the loop: waits on the command doorbell for at most `slice`, until commands
    /// arrive, the segment is closed or a stop is requested; `Ready` in these three cases.
    fn wait_for_work(&mut self, slice: Duration) -> WaitOutcome {
        let (segment, stop_requested) = (self.segment, self.stop_requested);
        let commands = &mut self.commands;
        // A corrupt ring reads as "ready": the next pop reports it.
        self.command_doorbell.wait_until(
            || {
                segment.is_closed()
                    || stop_requested()
                    || commands.len().map_or(true, |len| len > 0)
            },
            WaitPolicy::new(DEFAULT_SPIN, slice).within(slice),
        )
    }

    /// Step 3 and 4 of the loop for the slots just popped.
    fn serve_batch(&mut self) -> Result<(), Halt> {
        loop {
            let header = match self.reader.next_command(&mut self.commands, &mut self.pairs) {
                Ok(Some(header)) => header,
                Ok(None) => break,
                Err(error) => {
                    if let ReadError::MissingPairSlots { header, .. } = error {
                        let refusal = Completion::failed(
                            header.command_id,
                            header.generation,
                            CommandError::Malformed,
                            header.pair_count.into(),
                        );
                        // Answered in its lane's order: the scheduler takes an answer that
                        // overtakes earlier commands of its lane for their answers lost.
                        match self.storage.as_ref().filter(|lane| lane.takes(&header)) {
                            Some(lane) => lane.answer(refusal),
                            None => self.pending.push(refusal),
                        }
                    }
                    self.publish_completions()?;
                    return Err(error.into());
                }
            };
            self.claim.heartbeat()?;
            if self.storage.as_ref().is_some_and(|lane| lane.takes(&header)) {
                if header.op == Op::Flush as u32 {
                    // A FLUSH queued behind storage commands must also follow this loop's copies.
                    self.publish_completions()?;
                }
                let lane = self.storage.as_ref().expect("checked above");
                lane.submit(&header, &self.pairs, self.segment.generation());
                continue;
            }
            let (completion, copied) = self.execute(&header)?;
            self.pending.push(completion);
            if copied {
                self.publish_completions()?;
            }
        }
        self.publish_completions()
    }

    /// Validates and executes one command; returns its completion and whether it was a copy.
    fn execute(&mut self, header: &CommandHeader) -> Result<(Completion, bool), Halt> {
        let (id, generation) = (header.command_id, header.generation);
        let current = self.segment.generation();
        Ok(match validate(header, &self.pairs, self.engine.geometry(), current) {
            Err(refusal) => {
                tracing::debug!(command = id, %refusal, "refusing a command");
                let (error, detail) = refusal.to_wire();
                (Completion::failed(id, generation, error, detail), false)
            }
            Ok(ValidCommand::Flush | ValidCommand::Ping) => (Completion::ok(id, generation), false),
            // With a storage tier the lane takes these before execute (serve_batch).
            Ok(ValidCommand::Storage(_)) => (
                Completion::failed(id, generation, CommandError::NoStorage, header.op.into()),
                false,
            ),
            Ok(ValidCommand::Copy { plan, layerwise }) => {
                (self.copy(id, generation, &plan, layerwise)?, true)
            }
        })
    }

    /// Executes a copy, heartbeating on every progress report of the engine (module
    /// documentation, step 3). `Err` when the copy was stopped because the scheduler is gone.
    fn copy(
        &mut self,
        id: u64,
        generation: u64,
        plan: &CopyPlan,
        layerwise: bool,
    ) -> Result<Completion, Halt> {
        if layerwise {
            self.progress.begin(id);
        }
        let mut watch = CopyWatch {
            segment: self.segment,
            claim: self.claim,
            progress: layerwise.then_some((self.progress, id)),
            layer_delay: self.options.layer_delay,
            last_liveness_check: &mut self.last_liveness_check,
            scheduler_gone: None,
        };
        let started = Instant::now();
        let result = self.engine.execute(plan, &mut |report| watch.on(report));
        let counters = self.segment.counters();
        counters.add(Counter::WorkerCopyNs, started.elapsed().as_nanos() as u64);
        match result {
            Ok(()) => {
                let bytes = plan.blocks().saturating_mul(self.engine.geometry().block_bytes());
                counters.add(Counter::WorkerCopyBytes, bytes);
                Ok(Completion::ok(id, generation))
            }
            Err(CopyFailure::Stopped) => {
                let exit = watch
                    .scheduler_gone
                    .unwrap_or(ServeExit::SchedulerGone { pid: self.segment.creator().pid });
                tracing::info!(command = id, "scheduler gone; copy abandoned");
                Err(Halt::Exit(exit))
            }
            Err(failure) => {
                tracing::warn!(command = id, %failure, "copy failed");
                Ok(Completion::failed(id, generation, CommandError::CopyFailed, failure.detail()))
            }
        }
    }

    /// Step 4 of the loop: pushes every pending completion (waiting for room if the scheduler let
    /// the ring fill up) and rings the scheduler doorbell.
    fn publish_completions(&mut self) -> Result<(), Halt> {
        let mut pushed = 0;
        let mut warned = false;
        while pushed < self.pending.len() {
            let room = self.completions.push_available(&self.pending[pushed..]);
            if room > 0 {
                pushed += room;
                self.segment.scheduler_doorbell().ring();
                continue;
            }
            if !warned {
                tracing::warn!(
                    waiting = self.pending.len() - pushed,
                    "completion ring full: the scheduler has more commands in flight than the \
                     ring holds; waiting for room"
                );
                warned = true;
            }
            std::thread::sleep(FULL_RING_POLL);
            self.claim.heartbeat()?;
            if !self.segment.creator_alive() {
                return Err(Halt::Exit(ServeExit::SchedulerGone {
                    pid: self.segment.creator().pid,
                }));
            }
            if (self.stop_requested)() {
                // Not a clean stop: answers are owed (these, and maybe more commands popped).
                return Err(ServeError::StoppedUnanswered {
                    unanswered: self.pending.len() - pushed,
                }
                .into());
            }
        }
        self.pending.clear();
        Ok(())
    }
}

/// What the worker does on each progress report of a running copy: heartbeat, publish layer
/// progress, sleep the layer-delay test hook, and stop the copy once the scheduler is gone.
struct CopyWatch<'a> {
    segment: &'a Segment,
    claim: &'a RankClaim,
    /// The layer-progress table and the command's id, for `FLAG_LAYERWISE` commands.
    progress: Option<(LayerProgress<'a>, u64)>,
    layer_delay: Option<Duration>,
    last_liveness_check: &'a mut Instant,
    /// Set when a report found the scheduler gone and stopped the copy.
    scheduler_gone: Option<ServeExit>,
}

impl CopyWatch<'_> {
    fn on(&mut self, report: CopyProgress) -> ControlFlow<()> {
        if let CopyProgress::Layers(layers_done) = report {
            if let Some((progress, id)) = self.progress {
                progress.publish(id, layers_done);
            }
            if let Some(delay) = self.layer_delay {
                sleep_heartbeating(delay, self.claim);
            }
        }
        if let Err(lost) = self.claim.heartbeat() {
            abandon_rank(lost);
        }
        if self.last_liveness_check.elapsed() >= LIVENESS_CHECK_INTERVAL {
            *self.last_liveness_check = Instant::now();
            if !self.segment.creator_alive() {
                self.scheduler_gone =
                    Some(ServeExit::SchedulerGone { pid: self.segment.creator().pid });
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    }
}

/// How often a worker facing a full completion ring looks for room.
const FULL_RING_POLL: Duration = Duration::from_micros(500);

/// Sleeps `delay` in slices short enough that the heartbeat never goes stale.
fn sleep_heartbeating(delay: Duration, claim: &RankClaim) {
    let deadline = Instant::now() + delay;
    loop {
        let now = Instant::now();
        if now >= deadline {
            return;
        }
        std::thread::sleep((deadline - now).min(IDLE_SLICE));
        if let Err(lost) = claim.heartbeat() {
            abandon_rank(lost);
        }
    }
}

/// Ends the process at once with [`EXIT_CLAIM_LOST`]: the scheduler reclaimed the rank while a
/// copy was running. No engine can be cancelled mid-plan, and the blocks of the copy may already
/// belong to other copies, so the copy must not go on; nothing else of the process is worth saving.
fn abandon_rank(lost: ClaimLost) -> ! {
    tracing::error!(%lost, "rank reclaimed in the middle of a copy; exiting at once");
    eprintln!("kvshm worker: the scheduler reclaimed this rank in the middle of a copy ({lost})");
    std::process::exit(EXIT_CLAIM_LOST);
}

#[cfg(test)]
mod tests;
