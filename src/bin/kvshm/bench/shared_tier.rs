//! `kvshm bench shared-tier`: the host tier's index work per request, one `SharedTierIndex` shared
//! by every instance (in process, and through the rings of an owner process) against today's
//! per-instance `OffloadManager` (the baseline), in one run.
//!
//! [`measure`]:
//! 1. read the trace; route its requests round-robin over `--instances`; key each full block by
//!    its chained hash;
//! 2. build the baseline (one `OffloadManager` per instance, `--host-blocks / N` chunks each),
//!    the shared tier in process (one `SharedTierIndex` of `--host-blocks` chunks, one client per
//!    instance) and, with `--rings`, the shared tier across processes: a `kvshm tier-owner` child
//!    of `--host-blocks` chunks and one `TierClient` per instance;
//! 3. serve the requests in scheduler steps of `--step` requests an instance, each step on each
//!    way in turn (which goes first rotates, so that the machine's load hits all alike), timing
//!    the calls an engine's connector makes for each request: the leading loadable keys looked
//!    up and pinned, the loads released, every full block offered for storing (write-through),
//!    the store completed, the request finished. Through the rings a step is two batches, each
//!    one round trip: the last step's completions and ends with this step's lookups, then the
//!    loads' releases with the stores. A step's time over its requests is each one's figure.
//!
//! One JSON object with `--json`.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use serde::Serialize;

use kvshm::hash::BlockHash;
use kvshm::offload::shared::{TierArenas, DEFAULT_FREE_CHUNKS};
use kvshm::offload::{
    CallAnswer, ClientId, ClientOptions, LookupResult, OffloadConfig, OffloadKey, OffloadManager,
    PreparedStore, SharedTierIndex, StoreEnd, TierCall, TierClient, TierIdentity,
};
use kvshm::percentiles::Percentiles;
use kvshm::trace::read_trace;
use kvshm_ipc::name::SegmentName;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The trace to serve.
    #[arg(long, default_value = "traces/mooncake_conversation_trace.jsonl")]
    pub trace: PathBuf,
    /// Tokens per block.
    #[arg(long, default_value_t = 512)]
    pub block_tokens: usize,
    /// Engine instances the requests are spread over (round-robin).
    #[arg(long, default_value_t = 4)]
    pub instances: u32,
    /// Host blocks of the node, all instances together.
    #[arg(long, default_value_t = 23_436)]
    pub host_blocks: u32,
    /// Serve only the first N requests.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Also serve through the rings of a `kvshm tier-owner` child process.
    #[arg(long)]
    pub rings: bool,
    /// The owner's `--free-chunks` (chunks it keeps free ahead of demand), with --rings.
    #[arg(long, default_value_t = DEFAULT_FREE_CHUNKS)]
    pub owner_free_chunks: u32,
    /// Requests each instance serves in one scheduler step: through the rings, a step's calls
    /// go as two batches; the figures are per request (a step's time over its requests).
    #[arg(long, default_value_t = 1)]
    pub step: usize,
    /// Print one JSON object instead of a summary.
    #[arg(long)]
    pub json: bool,
}

/// One way of keeping the host tier, over all requests.
#[derive(Debug, Clone, Serialize)]
pub struct TierFigures {
    pub us_per_request: Percentiles,
    /// Blocks loaded from the tier, over all requests.
    pub hit_blocks: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub requests: usize,
    pub instances: u32,
    /// Requests an instance serves in one step.
    pub step: usize,
    pub host_blocks: u32,
    /// Baseline: one `OffloadManager` per instance.
    pub per_instance: TierFigures,
    /// One `SharedTierIndex` for all instances, in process.
    pub shared: TierFigures,
    /// Shared over per-instance, at p50.
    pub p50_ratio: f64,
    /// One `SharedTierIndex` in an owner process, asked through the rings (`--rings`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rings: Option<TierFigures>,
    /// Through the rings over per-instance, at p50.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rings_p50_ratio: Option<f64>,
    /// The owner's `--free-chunks`, with `--rings`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner_free_chunks: Option<u32>,
}

/// The owner process, stopped with SIGTERM when dropped (and the arena it leaves removed).
struct OwnerProcess(Child, String);

impl OwnerProcess {
    fn start(name: &str, args: &Args) -> anyhow::Result<Self> {
        let mut child = Command::new(std::env::current_exe()?)
            .args(["tier-owner", "--name", name, "--model", "trace", "--kv-dtype", "none"])
            .args(["--block-tokens", &args.block_tokens.to_string(), "--block-bytes", "0"])
            .args(["--layout", "bench", "--chunks", &args.host_blocks.to_string()])
            .args(["--clients", &args.instances.to_string()])
            .args(["--free-chunks", &args.owner_free_chunks.to_string()])
            .stdout(Stdio::piped())
            .spawn()?;
        let mut ready = String::new();
        BufReader::new(child.stdout.as_mut().expect("piped")).read_line(&mut ready)?;
        anyhow::ensure!(ready.contains("\"tier\""), "the tier's owner did not start: {ready:?}");
        Ok(OwnerProcess(child, name.to_owned()))
    }
}

impl Drop for OwnerProcess {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.0.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let _ = self.0.wait();
        if let Ok(name) = SegmentName::new(&self.1) {
            TierArenas::unlink(&name, 1);
        }
    }
}

/// One instance's client of the owner process, with the calls its last request left to send.
struct RingInstance {
    client: TierClient,
    /// The last step's requests and the keys each stored, completed with the next batch.
    pending: Vec<(String, Vec<OffloadKey>)>,
}

/// One request, keyed: its name, its full blocks' keys, and how many of them it may load.
struct Keyed {
    name: String,
    keys: Vec<OffloadKey>,
    bound: usize,
}

/// A step of one instance's requests through the rings: two batches for all of them (the last
/// step's completions and ends with this step's lookups, then the loads' releases with the
/// stores); returns the blocks loaded.
fn serve_rings(
    instance: &mut RingInstance,
    step: &[&Keyed],
    answers: &mut Vec<CallAnswer>,
) -> anyhow::Result<u64> {
    let pending = std::mem::take(&mut instance.pending);
    let mut calls = Vec::with_capacity(2 * pending.len() + step.len());
    for (last, stored) in &pending {
        calls.push(TierCall::CompleteStore { keys: stored, end: StoreEnd::Stored });
        calls.push(TierCall::FinishRequest { request: last });
    }
    let first_lookup = calls.len();
    for request in step {
        calls.push(TierCall::AcquirePrefix {
            request: &request.name,
            keys: &request.keys[..request.bound],
        });
    }
    instance.client.call(&calls, answers)?;
    let mut hits = Vec::with_capacity(step.len());
    for answer in &answers[first_lookup..] {
        match answer {
            CallAnswer::Prefix { chunks, .. } => hits.push(chunks.len()),
            other => anyhow::bail!("a lookup answered {other:?}"),
        }
    }
    let mut calls = Vec::with_capacity(2 * step.len());
    for (request, &hit) in step.iter().zip(&hits) {
        calls.push(TierCall::ReleaseLoads { keys: &request.keys[..hit] });
        calls.push(TierCall::PrepareStore { request: &request.name, keys: &request.keys });
    }
    instance.client.call(&calls, answers)?;
    for (request, answer) in step.iter().zip(answers.chunks(2)) {
        let stored = match &answer[1] {
            CallAnswer::Store { to_store, .. } => {
                to_store.iter().map(|&i| request.keys[i as usize]).collect()
            }
            other => anyhow::bail!("a store answered {other:?}"),
        };
        instance.pending.push((request.name.clone(), stored));
    }
    Ok(hits.iter().sum::<usize>() as u64)
}

fn key_of(hash: BlockHash) -> OffloadKey {
    OffloadKey::new(&hash.0.to_le_bytes()).expect("16 bytes fit a key")
}

/// A request's calls on a per-instance manager; returns the blocks loaded.
fn serve_alone(
    manager: &mut OffloadManager,
    name: &str,
    keys: &[OffloadKey],
    bound: usize,
    chunks: &mut Vec<u32>,
    out: &mut PreparedStore,
) -> anyhow::Result<u64> {
    manager.on_new_request(name);
    let hits = keys[..bound]
        .iter()
        .take_while(|key| manager.lookup(name, key) == LookupResult::Hit)
        .count();
    manager.prepare_load(name, &keys[..hits], chunks)?;
    manager.complete_load(&keys[..hits])?;
    if manager.prepare_store(name, keys, out) {
        let stored: Vec<OffloadKey> = out.to_store.iter().map(|&i| keys[i as usize]).collect();
        manager.complete_store(&stored, true);
    }
    manager.on_request_finished(name, None)?;
    Ok(hits as u64)
}

/// The same request's calls on the shared index, as `client`; returns the blocks loaded.
fn serve_shared(
    tier: &mut SharedTierIndex,
    client: ClientId,
    name: &str,
    keys: &[OffloadKey],
    bound: usize,
    chunks: &mut Vec<u32>,
    out: &mut PreparedStore,
) -> anyhow::Result<u64> {
    let hits = tier.acquire_prefix(client, name, &keys[..bound], chunks)?;
    tier.release_loads(client, &keys[..hits])?;
    if tier.prepare_store(client, name, keys, out)? {
        let stored: Vec<OffloadKey> = out.to_store.iter().map(|&i| keys[i as usize]).collect();
        tier.complete_store(client, &stored, true)?;
    }
    tier.finish_request(client, name)?;
    Ok(hits as u64)
}

/// Module flow.
pub fn measure(args: &Args) -> anyhow::Result<Report> {
    anyhow::ensure!(args.block_tokens > 0, "--block-tokens must be at least 1");
    anyhow::ensure!(args.step > 0, "--step must be at least 1");
    anyhow::ensure!((1..=4096).contains(&args.instances), "--instances must be between 1 and 4096");
    let per_instance_blocks = args.host_blocks / args.instances;
    anyhow::ensure!(
        per_instance_blocks > 0,
        "--host-blocks {} leaves no block for each of {} instances",
        args.host_blocks,
        args.instances
    );
    let requests = read_trace(&args.trace, args.limit)?;
    let identity = TierIdentity {
        model: "trace".into(),
        kv_dtype: "none".into(),
        block_tokens: args.block_tokens as u32,
        block_bytes: 0,
        blocks_per_chunk: 1,
        layout: "bench".into(),
    };
    let mut alone = Vec::new();
    for _ in 0..args.instances {
        alone.push(OffloadManager::new(OffloadConfig::new(per_instance_blocks))?);
    }
    let mut shared = SharedTierIndex::new(identity.clone(), OffloadConfig::new(args.host_blocks))?;
    let mut clients = Vec::new();
    for number in 0..args.instances {
        clients.push(shared.attach(&identity, &format!("instance-{number}"), None)?);
    }
    let tier_name = format!("bench-tier-{}", std::process::id());
    let owner = match args.rings {
        true => Some(OwnerProcess::start(&tier_name, args)?),
        false => None,
    };
    let mut ring_instances = Vec::new();
    if owner.is_some() {
        for _ in 0..args.instances {
            let name = SegmentName::new(&tier_name)?;
            let client = TierClient::new(name, identity.clone(), ClientOptions::default())?;
            anyhow::ensure!(client.is_connected(), "not attached: {:?}", client.last_error());
            ring_instances.push(RingInstance { client, pending: Vec::new() });
        }
    }
    let ways = if args.rings { 3 } else { 2 };
    let (mut chunks, mut out, mut answers) = (Vec::new(), PreparedStore::default(), Vec::new());
    let (mut alone_times, mut shared_times, mut ring_times) = (Vec::new(), Vec::new(), Vec::new());
    let (mut alone_hits, mut shared_hits, mut ring_hits) = (0, 0, 0);
    let keyed: Vec<Keyed> = requests
        .iter()
        .enumerate()
        .map(|(number, request)| {
            let keys: Vec<OffloadKey> =
                request.full_block_hashes(args.block_tokens).map(key_of).collect();
            let bound =
                (request.input_length.saturating_sub(1) / args.block_tokens).min(keys.len());
            Keyed { name: number.to_string(), keys, bound }
        })
        .collect();
    let instances = args.instances as usize;
    for (step_number, step) in keyed.chunks(args.step * instances).enumerate() {
        for instance in 0..instances {
            // This instance's requests of the step (round-robin routing).
            let mine: Vec<&Keyed> = step.iter().skip(instance).step_by(instances).collect();
            if mine.is_empty() {
                continue;
            }
            let per_request =
                |start: Instant| start.elapsed().as_secs_f64() * 1e6 / mine.len() as f64;
            for turn in 0..ways {
                let start = Instant::now();
                match (turn + step_number + instance) % ways {
                    0 => {
                        let manager = &mut alone[instance];
                        for request in &mine {
                            let (name, keys, bound) = (&request.name, &request.keys, request.bound);
                            alone_hits +=
                                serve_alone(manager, name, keys, bound, &mut chunks, &mut out)?;
                        }
                        alone_times.extend(std::iter::repeat_n(per_request(start), mine.len()));
                    }
                    1 => {
                        let client = clients[instance];
                        for request in &mine {
                            let (name, keys, bound) = (&request.name, &request.keys, request.bound);
                            shared_hits += serve_shared(
                                &mut shared,
                                client,
                                name,
                                keys,
                                bound,
                                &mut chunks,
                                &mut out,
                            )?;
                        }
                        shared_times.extend(std::iter::repeat_n(per_request(start), mine.len()));
                    }
                    _ => {
                        ring_hits +=
                            serve_rings(&mut ring_instances[instance], &mine, &mut answers)?;
                        ring_times.extend(std::iter::repeat_n(per_request(start), mine.len()));
                    }
                }
            }
        }
    }
    drop(ring_instances);
    drop(owner);
    let per_instance =
        TierFigures { us_per_request: Percentiles::of(&mut alone_times), hit_blocks: alone_hits };
    let shared =
        TierFigures { us_per_request: Percentiles::of(&mut shared_times), hit_blocks: shared_hits };
    let rings = args.rings.then(|| TierFigures {
        us_per_request: Percentiles::of(&mut ring_times),
        hit_blocks: ring_hits,
    });
    let baseline = per_instance.us_per_request.p50.max(f64::MIN_POSITIVE);
    Ok(Report {
        requests: requests.len(),
        instances: args.instances,
        step: args.step,
        host_blocks: args.host_blocks,
        p50_ratio: shared.us_per_request.p50 / baseline,
        rings_p50_ratio: rings.as_ref().map(|rings| rings.us_per_request.p50 / baseline),
        owner_free_chunks: rings.as_ref().map(|_| args.owner_free_chunks),
        rings,
        per_instance,
        shared,
    })
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let report = measure(&args)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        let ways = [
            ("per-instance managers", Some(&report.per_instance)),
            ("one shared index", Some(&report.shared)),
            ("through the rings", report.rings.as_ref()),
        ];
        for (what, figures) in ways.into_iter().filter_map(|(what, f)| Some((what, f?))) {
            println!(
                "{what:>22}: p50 {:.2} us, p99 {:.2} us per request, {} blocks loaded",
                figures.us_per_request.p50, figures.us_per_request.p99, figures.hit_blocks
            );
        }
        println!("shared / per-instance at p50: {:.2}", report.p50_ratio);
        if let Some(ratio) = report.rings_p50_ratio {
            println!("rings / per-instance at p50: {ratio:.2}");
        }
    }
    Ok(())
}
