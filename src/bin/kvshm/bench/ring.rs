//! `kvshm bench ring`: command-to-completion round trips and streaming rate of the shared-memory
//! rings between two processes, against a pipe ping-pong measured in the same run.
//!
//! The driver (this process) creates a shared-memory object holding a command ring, a completion
//! ring and their doorbells ([`channel`]), and spawns the current executable as the peer
//! (`kvshm bench ring --peer OBJECT`, [`peer`]) with its stdin and stdout on pipes. Then:
//!
//! 1. busy round trips: push one command, ring, spin until its completion arrives; the peer spins
//!    on the command ring too;
//! 2. futex round trips: the same, both sides waiting the way kvshm's worker and scheduler wait:
//!    spin for [`DEFAULT_SPIN`], then sleep on the doorbell's futex;
//! 3. sleep round trips: the same, both sides sleeping on the futex at once (no spinning), so
//!    that every message costs a futex wake-up: the kernel's share of the sleeping path alone;
//! 4. stream: push batches of records as fast as the peer drains them (the driver spins briefly,
//!    then yields while the ring is full; the peer spins briefly, then sleeps on the doorbell while
//!    it is empty), then one end marker whose completion carries the peer's count; records per
//!    second from the first push to that completion;
//! 5. pipe round trips: write the same 64-byte record to the peer's stdin, read a 32-byte answer
//!    from its stdout (both sides block in the kernel, as a program using pipes would).
//!
//! Each phase runs the requested count after a warm-up, or stops early when its time budget is
//! spent; the counts actually measured are reported. Besides the latencies, the report says how
//! often each ring phase really slept (futex sleeps per round trip, both sides together) and, for
//! each phase that can sleep, in what fraction of round trips the peer answered from the driver's
//! CPU: a wake-up that the kernel runs on the waker's CPU costs a context switch, one that goes to
//! another, idle CPU costs a CPU wake-up as well (see `kvshm_ipc::doorbell`, "How long to spin").
//! The load average at the start is reported too: timings on a loaded machine differ. The output
//! is one JSON object with `--json`.

mod channel;
mod peer;

use std::io::{Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context};
use kvshm_ipc::doorbell::{futex_sleeps, WaitOutcome, WaitPolicy, DEFAULT_SPIN};
use kvshm_ipc::record::{CommandHeader, CommandSlot, Completion, Op};
use kvshm_ipc::ring::{Consumer, Producer};
use kvshm_ipc::shm;
use serde_json::json;

use channel::{
    Channel, COMMAND_CAPACITY, PHASE_BUSY, PHASE_EXIT, PHASE_FUTEX, PHASE_SLEEP, PHASE_STREAM,
    PHASE_STREAM_END,
};
use kvshm::cli::checks;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print one JSON object instead of a summary.
    #[arg(long)]
    pub json: bool,
    /// Round trips measured per mode (busy ring, futex ring, sleep ring, pipe), after a warm-up.
    #[arg(long, default_value_t = 100_000)]
    pub round_trips: u64,
    /// Records in the one-way stream.
    #[arg(long, default_value_t = 20_000_000)]
    pub stream_records: u64,
    /// Records per push in the stream (at most the command ring's capacity, 1024).
    #[arg(long, default_value_t = 64)]
    pub stream_batch: usize,
    /// Time budget of each of the five phases; a phase stops early when it is spent.
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

/// Spin without end: the busy-polling mode.
fn busy_policy() -> WaitPolicy {
    WaitPolicy::new(Duration::MAX, Duration::from_millis(10))
}

/// Spin for [`DEFAULT_SPIN`], then sleep on the doorbell: how kvshm's worker and scheduler wait
/// for each other, and how a consumer of a stream waits.
fn futex_policy() -> WaitPolicy {
    WaitPolicy::new(DEFAULT_SPIN, Duration::from_millis(100))
}

/// Sleep on the doorbell at once: the sleep mode.
fn sleep_policy() -> WaitPolicy {
    WaitPolicy::new(Duration::ZERO, Duration::from_millis(100))
}

/// The wait policy of a round-trip phase, on both sides.
fn phase_policy(phase: u64) -> WaitPolicy {
    match phase {
        PHASE_BUSY => busy_policy(),
        PHASE_SLEEP => sleep_policy(),
        _ => futex_policy(),
    }
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
    let load_average = load_average();

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

    let busy = driver.round_trips(PHASE_BUSY, args.round_trips, budget)?;
    // The peer has attached: nobody needs the name any more.
    drop(unlink);
    let futex = driver.round_trips(PHASE_FUTEX, args.round_trips, budget)?;
    let sleep = driver.round_trips(PHASE_SLEEP, args.round_trips, budget)?;
    let stream = driver.stream(args.stream_records, args.stream_batch, budget)?;
    driver.send(PHASE_EXIT)?;
    let pipe = driver.pipe_round_trips(args.round_trips, budget)?;
    let status = driver.peer.finish()?;
    ensure!(status.success(), "the benchmark peer failed: {status}");

    let records_per_s = stream.records as f64 / stream.elapsed.as_secs_f64();
    let (busy_rtt, futex_rtt) = (Summary::of(&busy.nanos), Summary::of(&futex.nanos));
    let (sleep_rtt, pipe_rtt) = (Summary::of(&sleep.nanos), Summary::of(&pipe.nanos));
    if args.json {
        let report = json!({
            "bench": "ring",
            "command_bytes": size_of::<CommandSlot>(),
            "completion_bytes": size_of::<Completion>(),
            "warmup_round_trips": WARMUP_ROUND_TRIPS,
            "ring_busy_rtt_ns": busy_rtt.to_json(),
            "ring_busy_round_trips": busy_rtt.count,
            "ring_futex_rtt_ns": futex_rtt.to_json(),
            "ring_futex_round_trips": futex_rtt.count,
            "ring_futex_spin_ns": DEFAULT_SPIN.as_nanos() as u64,
            "ring_futex_sleeps_per_round_trip": futex.sleeps_per_round_trip(),
            "ring_sleep_rtt_ns": sleep_rtt.to_json(),
            "ring_sleep_round_trips": sleep_rtt.count,
            "ring_sleep_sleeps_per_round_trip": sleep.sleeps_per_round_trip(),
            "pipe_rtt_ns": pipe_rtt.to_json(),
            "pipe_round_trips": pipe_rtt.count,
            "peer_on_driver_cpu": {
                "ring_futex": futex.same_cpu_fraction(),
                "ring_sleep": sleep.same_cpu_fraction(),
                "pipe": pipe.same_cpu_fraction(),
            },
            "ring_records_per_s": records_per_s.round(),
            "ring_stream_records": stream.records,
            "ring_stream_batch": args.stream_batch,
            "ring_stream_seconds": stream.elapsed.as_secs_f64(),
            "pipe_p50_over_ring_busy_p50": ratio(pipe_rtt.p50, busy_rtt.p50),
            "pipe_p50_over_ring_futex_p50": ratio(pipe_rtt.p50, futex_rtt.p50),
            "pipe_p50_over_ring_sleep_p50": ratio(pipe_rtt.p50, sleep_rtt.p50),
            "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            "load_average_1m": load_average,
        });
        println!("{report}");
    } else {
        println!("round trip, ns      p50        p99       mean   count  sleeps/rt  same cpu");
        for (name, phase) in
            [("ring busy", &busy), ("ring futex", &futex), ("ring sleep", &sleep), ("pipe", &pipe)]
        {
            let summary = Summary::of(&phase.nanos);
            println!(
                "{name:<14} {:>10} {:>10} {:>10} {:>7} {:>10.2} {:>9.2}",
                summary.p50,
                summary.p99,
                summary.mean,
                summary.count,
                phase.sleeps_per_round_trip(),
                phase.same_cpu_fraction()
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

/// What one round trip saw.
struct RoundTrip {
    elapsed: Duration,
    /// The CPU the peer answered from.
    peer_cpu: u32,
    /// Futex sleeps of the peer so far (cumulative).
    peer_sleeps: u64,
}

/// The measured round trips of one phase.
struct RoundTrips {
    nanos: Vec<u64>,
    /// Round trips whose answer came from the CPU the driver ran on when it arrived.
    same_cpu: u64,
    /// Futex sleeps of both sides during the measured round trips.
    sleeps: u64,
}

impl RoundTrips {
    fn sleeps_per_round_trip(&self) -> f64 {
        rounded(self.sleeps as f64 / self.nanos.len().max(1) as f64)
    }

    fn same_cpu_fraction(&self) -> f64 {
        rounded(self.same_cpu as f64 / self.nanos.len().max(1) as f64)
    }
}

/// Runs [`WARMUP_ROUND_TRIPS`] unmeasured round trips, then up to `count` measured ones (fewer if
/// `budget` runs out); `round_trip(round)` performs one and says what it saw.
fn measure_round_trips(
    count: u64,
    budget: Duration,
    mut round_trip: impl FnMut(u64) -> anyhow::Result<RoundTrip>,
) -> anyhow::Result<RoundTrips> {
    let mut measured = RoundTrips {
        nanos: Vec::with_capacity(count.min(RESERVED_SAMPLES) as usize),
        same_cpu: 0,
        sleeps: 0,
    };
    let mut started = Instant::now();
    let (mut driver_sleeps, mut peer_sleeps) = (0, 0);
    for round in 0..WARMUP_ROUND_TRIPS + count {
        if round == WARMUP_ROUND_TRIPS {
            started = Instant::now();
            driver_sleeps = futex_sleeps();
        }
        if round > WARMUP_ROUND_TRIPS && started.elapsed() > budget {
            break;
        }
        let trip = round_trip(round)?;
        let driver_cpu = current_cpu();
        if round >= WARMUP_ROUND_TRIPS {
            measured.nanos.push(trip.elapsed.as_nanos() as u64);
            measured.same_cpu += u64::from(Some(trip.peer_cpu) == driver_cpu);
            measured.sleeps = futex_sleeps() - driver_sleeps + trip.peer_sleeps - peer_sleeps;
        } else {
            peer_sleeps = trip.peer_sleeps;
        }
    }
    Ok(measured)
}

/// The CPU the calling thread runs on, if the kernel says.
pub(crate) fn current_cpu() -> Option<u32> {
    // SAFETY: sched_getcpu has no preconditions.
    u32::try_from(unsafe { libc::sched_getcpu() }).ok()
}

/// The 1-minute load average, from `/proc/loadavg`.
fn load_average() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

impl Driver<'_> {
    /// Measures `count` command-to-completion round trips of `phase` (fewer if `budget` runs out).
    fn round_trips(
        &mut self,
        phase: u64,
        count: u64,
        budget: Duration,
    ) -> anyhow::Result<RoundTrips> {
        let policy = phase_policy(phase);
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
            Ok(RoundTrip { elapsed, peer_cpu: completion.error, peer_sleeps: completion.detail })
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
    fn pipe_round_trips(&mut self, count: u64, budget: Duration) -> anyhow::Result<RoundTrips> {
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
            Ok(RoundTrip { elapsed, peer_cpu: answer.error, peer_sleeps: 0 })
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
    fn of(samples: &[u64]) -> Self {
        let mut samples = samples.to_vec();
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
    rounded(numerator as f64 / denominator as f64)
}

/// `value` to two decimals.
fn rounded(value: f64) -> f64 {
    (value * 100.0).round() / 100.0
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
