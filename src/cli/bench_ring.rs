//! `kvshm bench ring`: command-to-completion round trips and streaming rate of the shared-memory
//! rings between two processes, against a pipe ping-pong measured in the same run.
//!
//! The driver (this process) creates a shared-memory object holding a command ring, a completion
//! ring and their doorbells ([`channel`]), and spawns the current executable as the peer
//! (`kvshm bench ring --peer OBJECT`, [`peer`]) with its stdin and stdout on pipes. Then:
//!
//! 1. busy round trips: push one command, ring, spin until its completion arrives; the peer spins
//!    on the command ring too;
//! 2. futex round trips: the same, but both sides sleep on the doorbell at once (no spinning), so
//!    every message costs a futex wake-up;
//! 3. stream: push batches of records as fast as the peer drains them (the driver spins briefly,
//!    then yields while the ring is full; the peer spins briefly, then sleeps on the doorbell while
//!    it is empty), then one end marker whose completion carries the peer's count; records per
//!    second from the first push to that completion;
//! 4. pipe round trips: write the same 64-byte record to the peer's stdin, read a 32-byte answer
//!    from its stdout (both sides block in the kernel, as a program using pipes would).
//!
//! Each phase runs the requested count after a warm-up, or stops early when its time budget is
//! spent; the counts actually measured are reported. The output is one JSON object with `--json`.

mod channel;
mod peer;

use std::io::{Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context};
use kvshm_ipc::doorbell::{WaitOutcome, WaitPolicy};
use kvshm_ipc::record::{CommandHeader, CommandSlot, Completion, Op};
use kvshm_ipc::ring::{Consumer, Producer};
use kvshm_ipc::shm;
use serde_json::json;

use super::checks;
use channel::{
    Channel, COMMAND_CAPACITY, PHASE_BUSY, PHASE_EXIT, PHASE_FUTEX, PHASE_STREAM, PHASE_STREAM_END,
};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print one JSON object instead of a summary.
    #[arg(long)]
    pub json: bool,
    /// Round trips measured per mode (busy ring, futex ring, pipe), after a warm-up.
    #[arg(long, default_value_t = 100_000)]
    pub round_trips: u64,
    /// Records in the one-way stream.
    #[arg(long, default_value_t = 20_000_000)]
    pub stream_records: u64,
    /// Records per push in the stream (at most the command ring's capacity, 1024).
    #[arg(long, default_value_t = 64)]
    pub stream_batch: usize,
    /// Time budget of each of the four phases; a phase stops early when it is spent.
    #[arg(long, default_value_t = 3.0)]
    pub seconds_per_phase: f64,
    /// Run as the peer of the benchmark that created shared-memory object OBJECT (internal).
    #[arg(long, hide = true, value_name = "OBJECT")]
    pub peer: Option<String>,
}

/// The most round trips a phase may be asked for (each keeps an 8-byte sample).
const MAX_ROUND_TRIPS: u64 = 1 << 30;
/// Samples reserved up front; a phase that runs longer grows its vector.
const RESERVED_SAMPLES: u64 = 1 << 20;
/// Round trips run before measuring, in every round-trip phase.
const WARMUP_ROUND_TRIPS: u64 = 1_000;
/// How long either side waits for the other before giving up.
const PEER_PATIENCE: Duration = Duration::from_secs(30);

/// Spin (practically) without end: the busy-polling mode.
fn busy_policy() -> WaitPolicy {
    WaitPolicy::new(u32::MAX, Duration::from_millis(10))
}

/// Spin briefly, then sleep on the doorbell: how a consumer of a stream waits.
fn stream_policy() -> WaitPolicy {
    WaitPolicy::default()
}

/// Sleep on the doorbell at once: the futex mode.
fn sleep_policy() -> WaitPolicy {
    WaitPolicy::new(0, Duration::from_millis(100))
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if let Some(object) = &args.peer {
        return peer::run(object);
    }
    checks::within(args.round_trips, 1..=MAX_ROUND_TRIPS, "--round-trips")?;
    checks::at_least(args.stream_records, 1, "--stream-records")?;
    checks::within(args.stream_batch, 1..=COMMAND_CAPACITY, "--stream-batch")?;
    let budget = checks::positive_seconds(args.seconds_per_phase, "--seconds-per-phase")?;
    // Each round-trip phase keeps one 8-byte sample per round trip.
    checks::fits_in_memory(
        u128::from(args.round_trips) * 8,
        format_args!("--round-trips {}: the samples of one phase", args.round_trips),
    )?;

    let object = format!("/kvshm-bench-ring-{}", std::process::id());
    let channel = Channel::create(&object)?;
    let unlink = UnlinkOnDrop(object.clone());
    let executable = std::env::current_exe().context("locating the kvshm executable")?;
    let child = Command::new(executable)
        .args(["bench", "ring", "--peer", &object])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("spawning the benchmark peer")?;
    let mut driver = Driver {
        commands: channel.command_producer()?,
        completions: channel.completion_consumer()?,
        channel: &channel,
        peer: PeerProcess(child),
        next_id: 0,
    };

    let busy = driver.round_trips(PHASE_BUSY, busy_policy(), args.round_trips, budget)?;
    // The peer has attached: nobody needs the name any more.
    drop(unlink);
    let futex = driver.round_trips(PHASE_FUTEX, sleep_policy(), args.round_trips, budget)?;
    let stream = driver.stream(args.stream_records, args.stream_batch, budget)?;
    driver.send(PHASE_EXIT)?;
    let pipe = driver.pipe_round_trips(args.round_trips, budget)?;
    let status = driver.peer.finish()?;
    ensure!(status.success(), "the benchmark peer failed: {status}");

    let busy = Summary::of(busy);
    let futex = Summary::of(futex);
    let pipe = Summary::of(pipe);
    let records_per_s = stream.records as f64 / stream.elapsed.as_secs_f64();
    if args.json {
        let report = json!({
            "bench": "ring",
            "command_bytes": size_of::<CommandSlot>(),
            "completion_bytes": size_of::<Completion>(),
            "warmup_round_trips": WARMUP_ROUND_TRIPS,
            "ring_busy_rtt_ns": busy.to_json(),
            "ring_busy_round_trips": busy.count,
            "ring_futex_rtt_ns": futex.to_json(),
            "ring_futex_round_trips": futex.count,
            "pipe_rtt_ns": pipe.to_json(),
            "pipe_round_trips": pipe.count,
            "ring_records_per_s": records_per_s.round(),
            "ring_stream_records": stream.records,
            "ring_stream_batch": args.stream_batch,
            "ring_stream_seconds": stream.elapsed.as_secs_f64(),
            "pipe_p50_over_ring_busy_p50": ratio(pipe.p50, busy.p50),
            "pipe_p50_over_ring_futex_p50": ratio(pipe.p50, futex.p50),
            "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        });
        println!("{report}");
    } else {
        println!("round trip, ns      p50        p99       mean   count");
        for (name, summary) in [("ring busy", &busy), ("ring futex", &futex), ("pipe", &pipe)] {
            println!(
                "{name:<14} {:>10} {:>10} {:>10} {:>7}",
                summary.p50, summary.p99, summary.mean, summary.count
            );
        }
        println!(
            "ring stream: {records_per_s:.0} records/s ({} records of {} bytes, batches of {})",
            stream.records,
            size_of::<CommandSlot>(),
            args.stream_batch
        );
    }
    Ok(())
}

/// The driver's side of the benchmark: both rings and the peer process.
struct Driver<'a> {
    channel: &'a Channel,
    commands: Producer<CommandSlot>,
    completions: Consumer<Completion>,
    peer: PeerProcess,
    next_id: u64,
}

struct Stream {
    records: u64,
    elapsed: Duration,
}

/// Runs [`WARMUP_ROUND_TRIPS`] unmeasured round trips, then up to `count` measured ones (fewer if
/// `budget` runs out); `round_trip(round)` performs one and says how long it took. Returns the
/// measured times in nanoseconds.
fn measure_round_trips(
    count: u64,
    budget: Duration,
    mut round_trip: impl FnMut(u64) -> anyhow::Result<Duration>,
) -> anyhow::Result<Vec<u64>> {
    let mut samples = Vec::with_capacity(count.min(RESERVED_SAMPLES) as usize);
    let mut started = Instant::now();
    for round in 0..WARMUP_ROUND_TRIPS + count {
        if round == WARMUP_ROUND_TRIPS {
            started = Instant::now();
        }
        if round > WARMUP_ROUND_TRIPS && started.elapsed() > budget {
            break;
        }
        let elapsed = round_trip(round)?;
        if round >= WARMUP_ROUND_TRIPS {
            samples.push(elapsed.as_nanos() as u64);
        }
    }
    Ok(samples)
}

impl Driver<'_> {
    /// Measures `count` command-to-completion round trips (fewer if `budget` runs out).
    fn round_trips(
        &mut self,
        phase: u64,
        policy: WaitPolicy,
        count: u64,
        budget: Duration,
    ) -> anyhow::Result<Vec<u64>> {
        measure_round_trips(count, budget, |_| {
            let sent_at = Instant::now();
            let id = self.send(phase)?;
            let completion = self.await_completion(policy)?;
            let elapsed = sent_at.elapsed();
            ensure!(
                completion.command_id == id && completion.generation == phase,
                "completion {} of phase {} answers command {id} of phase {phase}",
                completion.command_id,
                completion.generation
            );
            Ok(elapsed)
        })
    }

    /// Streams up to `records` records in batches of `batch`, then waits for the peer's count.
    fn stream(&mut self, records: u64, batch: usize, budget: Duration) -> anyhow::Result<Stream> {
        let mut slots = Vec::with_capacity(batch);
        let started = Instant::now();
        let mut sent = 0u64;
        let mut batches = 0u64;
        while sent < records {
            if batches % 256 == 0 && started.elapsed() > budget {
                break;
            }
            let size = (batch as u64).min(records - sent);
            slots.clear();
            slots.extend((sent..sent + size).map(|id| command(id, PHASE_STREAM)));
            let mut attempts = 0u64;
            while self.commands.push_all(&slots).is_err() {
                attempts += 1;
                if attempts % (1 << 16) == 0 {
                    self.peer.ensure_running()?;
                }
                // Spin a little, then give the core away: on a machine with fewer free cores than
                // spinning processes, the peer may need this one to drain the ring.
                if attempts < 128 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
            self.channel.commands_bell().ring();
            sent += size;
            batches += 1;
        }
        self.send(PHASE_STREAM_END)?;
        let completion = self.await_completion(busy_policy())?;
        let elapsed = started.elapsed();
        ensure!(
            completion.generation == PHASE_STREAM_END && completion.detail == sent,
            "the peer counted {} stream records where {sent} were sent",
            completion.detail
        );
        Ok(Stream { records: sent, elapsed })
    }

    /// Measures `count` pipe round trips (fewer if `budget` runs out), then closes the pipes.
    fn pipe_round_trips(&mut self, count: u64, budget: Duration) -> anyhow::Result<Vec<u64>> {
        let child = &mut self.peer.0;
        let mut to_peer = child.stdin.take().ok_or_else(|| anyhow!("peer stdin is not a pipe"))?;
        let mut from_peer =
            child.stdout.take().ok_or_else(|| anyhow!("peer stdout is not a pipe"))?;
        let mut answer = Completion::default();
        measure_round_trips(count, budget, |round| {
            let message = command(round, 0);
            let sent_at = Instant::now();
            to_peer.write_all(bytemuck::bytes_of(&message)).context("writing to the peer")?;
            from_peer
                .read_exact(bytemuck::bytes_of_mut(&mut answer))
                .context("reading the peer")?;
            let elapsed = sent_at.elapsed();
            ensure!(answer.command_id == round, "pipe answer {} for {round}", answer.command_id);
            Ok(elapsed)
        })
    }

    /// Pushes one command of `phase` and rings; returns its id.
    fn send(&mut self, phase: u64) -> anyhow::Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        let deadline = Instant::now() + PEER_PATIENCE;
        while self.commands.push(command(id, phase)).is_err() {
            ensure!(Instant::now() < deadline, "the peer stopped draining the command ring");
            self.peer.ensure_running()?;
            std::thread::yield_now();
        }
        self.channel.commands_bell().ring();
        Ok(id)
    }

    /// Waits for the next completion with `policy`, checking that the peer still runs.
    fn await_completion(&mut self, policy: WaitPolicy) -> anyhow::Result<Completion> {
        let deadline = Instant::now() + PEER_PATIENCE;
        loop {
            if let Some(completion) = self.completions.pop().context("reading completions")? {
                return Ok(completion);
            }
            let completions = &mut self.completions;
            let outcome = self.channel.completions_bell().wait_until(
                || !completions.is_empty().unwrap_or(true),
                policy.within(Duration::from_secs(1)),
            );
            if outcome == WaitOutcome::TimedOut {
                self.peer.ensure_running()?;
                ensure!(Instant::now() < deadline, "no completion for {PEER_PATIENCE:?}");
            }
        }
    }
}

fn command(id: u64, phase: u64) -> CommandSlot {
    CommandSlot::from_header(&CommandHeader::new(Op::Ping, id, phase, 0))
}

/// Latency percentiles of one phase, in nanoseconds.
struct Summary {
    count: usize,
    p50: u64,
    p99: u64,
    mean: u64,
}

impl Summary {
    fn of(mut samples: Vec<u64>) -> Self {
        samples.sort_unstable();
        let count = samples.len();
        let at = |quantile: f64| {
            let index = ((count as f64 * quantile) as usize).min(count.saturating_sub(1));
            samples.get(index).copied().unwrap_or(0)
        };
        let mean = samples.iter().sum::<u64>().checked_div(count as u64).unwrap_or(0);
        Self { count, p50: at(0.50), p99: at(0.99), mean }
    }

    fn to_json(&self) -> serde_json::Value {
        json!({ "p50": self.p50, "p99": self.p99, "mean": self.mean })
    }
}

fn ratio(numerator: u64, denominator: u64) -> f64 {
    if denominator == 0 {
        return 0.0;
    }
    (numerator as f64 / denominator as f64 * 100.0).round() / 100.0
}

/// The peer child process; killed and reaped if the driver stops early.
struct PeerProcess(Child);

impl PeerProcess {
    fn ensure_running(&mut self) -> anyhow::Result<()> {
        match self.0.try_wait().context("checking the benchmark peer")? {
            None => Ok(()),
            Some(status) => bail!("the benchmark peer exited early: {status}"),
        }
    }

    fn finish(&mut self) -> anyhow::Result<ExitStatus> {
        self.0.wait().context("waiting for the benchmark peer")
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Removes the shared-memory object's name when dropped.
struct UnlinkOnDrop(String);

impl Drop for UnlinkOnDrop {
    fn drop(&mut self) {
        let _ = shm::unlink(&self.0);
    }
}
