//! `kvshm demo`: a service, its TP worker processes and a conversation replayed with real data.
//!
//! 1. create the service (segment, arenas, cache manager) for a small model shape; with
//!    `--backend cuda`, allocate each rank's KV buffers on a GPU (rank `r` on device `r % devices`)
//!    and publish their IPC handles in the segment;
//! 2. spawn one `kvshm worker` process per rank (with `--storage`, each with its storage tier)
//!    and wait until each has attached; a storage tier that already holds blocks of this layout
//!    (a previous run's, or another service's) has them put back into the cache (a disk tier
//!    through its persisted index, Redis through its keys);
//! 3. replay the requests through [`DemoEngine`], which writes and verifies block bytes;
//! 4. print the report (text, or one JSON object with `--json`);
//! 5. with `--hold SECONDS`, keep serving (kvctl can be tried against it), then shut down: the
//!    segment is removed and the workers, seeing their scheduler gone, exit.
//!
//! SIGINT or SIGTERM (Ctrl-C) ends the replay or the hold early the same clean way, so that an
//! interrupted demo leaves nothing in /dev/shm.
//!
//! [`engine`] is the engine stand-in, [`workload`] the conversations it serves without a trace,
//! [`storage`] what the `--storage` options make of the workers and the tier.

mod engine;
mod storage;
mod workload;

use kvshm_ipc::sync::{AtomicBool, Ordering};
use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvshm_ipc::config::{MAX_RANKS, MAX_REGIONS};
use kvshm_ipc::doorbell::deadline_after;
use kvshm_ipc::name::SegmentName;
use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};

use engine::{DemoEngine, DemoReport};
use kvshm::cli::checks::{at_least, fits_in_dev_shm, fits_in_memory, human_bytes, within};
use kvshm::manager::{CacheConfig, EvictionPolicy, StorageWritePolicy, WritePolicy};
use kvshm::service::{Backend, Service, ServiceConfig};
use kvshm::storage::spec::{StorageNamespace, StorageSpec, STORAGE_ENV};
use kvshm::trace::{read_trace, TraceRequest};
use kvshm::worker::CopyMethod;
use storage::{adopt_stored_blocks, storage_backoff, storage_blocks, worker_storage_args};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Tensor-parallel size: worker processes, one per rank.
    #[arg(long, default_value_t = 2)]
    tp: u32,
    /// Mooncake-format trace to replay; defaults to the repository's traces/, else a built-in
    /// synthetic conversation workload.
    #[arg(long, conflicts_with = "synthetic")]
    trace: Option<PathBuf>,
    /// Use the built-in synthetic conversation workload even when a trace is available.
    #[arg(long)]
    synthetic: bool,
    /// Replay at most this many requests of the trace.
    #[arg(long, default_value_t = 4000)]
    limit: usize,
    /// Tokens per block (the Mooncake trace uses 512).
    #[arg(long, default_value_t = 512)]
    block_tokens: u32,
    /// Device blocks per rank.
    #[arg(long, default_value_t = 1024)]
    device_blocks: u32,
    /// Host-tier blocks per rank (0: no host tier).
    #[arg(long, default_value_t = 4096)]
    host_blocks: u32,
    /// write_back, write_through or write_through_selective:T.
    #[arg(long, default_value = "write_back")]
    write_policy: WritePolicy,
    /// Device blocks that `poll` keeps free by evicting ahead of demand (0: evict on demand only),
    /// so that swap-outs overlap with compute instead of delaying the next allocation.
    #[arg(long, default_value_t = 0)]
    free_watermark: u32,
    /// The eviction policy ordering what leaves each tier first: lru or conv.
    #[arg(long, default_value_t = EvictionPolicy::default())]
    eviction: EvictionPolicy,
    /// A storage tier below host: `disk:DIR` (a slab per rank under DIR/NAMESPACE) or
    /// `redis://HOST[:PORT][/DB]`; what it holds at start (an earlier run's blocks, another
    /// service's) is hit.
    #[arg(long)]
    storage: Option<StorageSpec>,
    /// Storage blocks per rank (default: 4 times the host tier): the disk slab's slots, or for
    /// Redis the budget the scheduler keeps to.
    #[arg(long)]
    storage_blocks: Option<u32>,
    /// The storage namespace: runs that should share blocks use the same one.
    #[arg(long, default_value = kvshm::storage::spec::DEFAULT_NAMESPACE)]
    storage_namespace: String,
    /// When host blocks are written to storage: write_back (on host eviction), write_through, or
    /// write_through_selective:T (blocks with at least T hits written through).
    #[arg(long, default_value_t = StorageWritePolicy::WriteBack)]
    storage_write_policy: StorageWritePolicy,
    /// Milliseconds before the first probe of a storage tier that is down (while it is down no
    /// request hits, writes back to or prefetches from it); each failed probe doubles the wait.
    #[arg(long, default_value_t = 1000)]
    storage_backoff_ms: u64,
    /// The longest wait between probes of a storage tier that is down, in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    storage_backoff_max_ms: u64,
    /// Model layers (a block holds K and V of each: 2 regions per layer).
    #[arg(long, default_value_t = 4)]
    layers: u32,
    /// Bytes of one region (one layer's K or V of one block on one rank).
    #[arg(long, default_value_t = 4096)]
    region_bytes: u64,
    /// Segment name; defaults to demo-PID-RANDOM (16 random hex digits, so that nobody can
    /// create the name first).
    #[arg(long)]
    name: Option<String>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Where the engine's KV blocks live: host (a shared-memory arena per rank) or cuda (GPU
    /// buffers, copied by `kvshm worker --backend cuda`; needs the cuda feature).
    #[arg(long, value_enum, default_value_t = DemoBackend::Host)]
    backend: DemoBackend,
    /// How cuda workers move a layer's blocks: kernel or calls (see `kvshm worker`).
    #[arg(long, default_value_t = CopyMethod::default())]
    cuda_copy: CopyMethod,
    /// Keep the service running this many seconds after the replay (try kvctl against it).
    #[arg(long, default_value_t = 0)]
    hold: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum DemoBackend {
    Host,
    Cuda,
}

const CUDA_NOT_BUILT: &str = "--backend cuda needs a kvshm built with the cuda feature \
    (cargo build --release --features kvshm/cuda)";

/// The most blocks a tier can have: block ids are u32 with one value kept as a marker.
const MAX_BLOCKS: u32 = u32::MAX - 1;

/// The worker processes; killed if the demo leaves early.
struct Workers(Vec<Child>);

impl Workers {
    /// Spawns one worker per rank, rank `r` given `args_of(r)`: its backend and `--storage-*`
    /// options, and its storage spec, if any.
    fn spawn(
        name: &str,
        tp: u32,
        args_of: impl Fn(u32) -> (Vec<String>, Option<String>),
    ) -> anyhow::Result<Workers> {
        let exe = std::env::current_exe().context("locating the kvshm executable")?;
        let mut workers = Workers(Vec::new());
        for rank in 0..tp {
            let (args, storage) = args_of(rank);
            let mut command = Command::new(&exe);
            command.args(["worker", "--name", name, "--rank", &rank.to_string()]).args(args);
            // The storage spec goes in the environment, not on the command line every user can
            // read: a Redis URL may carry a password.
            match storage {
                Some(spec) => command.env(STORAGE_ENV, spec),
                None => command.env_remove(STORAGE_ENV),
            };
            let child = command
                .stdin(Stdio::null())
                .spawn()
                .with_context(|| format!("spawning the worker of rank {rank}"))?;
            workers.0.push(child);
        }
        Ok(workers)
    }

    /// Waits for the workers to exit on their own (they do once the segment's creator is gone).
    fn join(mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        for child in &mut self.0 {
            loop {
                if child.try_wait()?.is_some() {
                    break;
                }
                if Instant::now() >= deadline {
                    bail!("worker pid {} did not exit after the service stopped", child.id());
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        self.0.clear();
        Ok(())
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn load_requests(args: &Args) -> anyhow::Result<(Vec<TraceRequest>, String)> {
    let trace = match args.synthetic {
        true => None,
        false => args.trace.clone().or_else(workload::default_trace),
    };
    let (mut requests, source) = match trace {
        Some(path) => {
            let requests = read_trace(&path, Some(args.limit))
                .with_context(|| format!("reading {}", path.display()))?;
            (requests, path.display().to_string())
        }
        None => (
            workload::synthetic_conversations(64, 24, 4, 3, args.block_tokens),
            "synthetic conversations".to_string(),
        ),
    };
    requests.truncate(args.limit);
    Ok((requests, source))
}

/// `demo-PID-RANDOM`: the pid for the person reading `kvctl ls`, 64 random bits so that another
/// user cannot guess the name and create its objects first.
fn default_name() -> anyhow::Result<String> {
    let mut random = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut file| file.read_exact(&mut random))
        .context("reading /dev/urandom for the segment name")?;
    Ok(format!("demo-{}-{:016x}", std::process::id(), u64::from_ne_bytes(random)))
}

/// Refuses a shape the machine cannot run, naming the option, before anything is allocated.
fn check(args: &Args) -> anyhow::Result<()> {
    within(args.tp, 1..=MAX_RANKS, "--tp")?;
    within(args.layers, 1..=MAX_REGIONS / 2, "--layers")?;
    at_least(args.region_bytes, 1, "--region-bytes")?;
    at_least(args.block_tokens, 1, "--block-tokens")?;
    within(args.device_blocks, 1..=MAX_BLOCKS, "--device-blocks")?;
    within(args.host_blocks, 0..=MAX_BLOCKS, "--host-blocks")?;
    within(args.free_watermark, 0..=args.device_blocks, "--free-watermark")?;
    if args.backend == DemoBackend::Cuda && !cfg!(feature = "cuda") {
        bail!(CUDA_NOT_BUILT);
    }
    anyhow::ensure!(
        !args.eviction.is_offline(),
        "--eviction {} needs a trace's future: only `kvshm replay` runs it",
        args.eviction
    );
    if args.storage.is_some() {
        if args.host_blocks == 0 {
            bail!("--storage needs a host tier (--host-blocks): blocks reach storage through host blocks");
        }
        within(storage_blocks(args), 1..=MAX_BLOCKS, "--storage-blocks")?;
        StorageNamespace::new(&args.storage_namespace)?;
    } else if args.storage_blocks.is_some() {
        bail!("--storage-blocks needs --storage disk:DIR or --storage redis://...");
    }
    storage_backoff(args)?;
    let block_bytes = u128::from(args.layers) * 2 * u128::from(args.region_bytes);
    // On the cuda backend the device tier is GPU memory, not /dev/shm.
    let device_blocks = if args.backend == DemoBackend::Cuda { 0 } else { args.device_blocks };
    let blocks = u128::from(device_blocks) + u128::from(args.host_blocks);
    fits_in_dev_shm(
        u128::from(args.tp) * blocks * block_bytes,
        format_args!(
            "the arenas of --tp {} x (--device-blocks {} + --host-blocks {}) blocks of {} \
             (--layers {} x 2 x --region-bytes {})",
            args.tp,
            args.device_blocks,
            args.host_blocks,
            human_bytes(block_bytes),
            args.layers,
            args.region_bytes
        ),
    )?;
    // The block pools (two u32 per block), the tree's index sized for every block, and one region of
    // scratch for the byte checks.
    let per_block = 8 + kvshm::tree::PRESIZED_BYTES_PER_BLOCK as u128;
    fits_in_memory(
        blocks * per_block + u128::from(args.region_bytes),
        format_args!(
            "the block pools and the cache's index of --device-blocks {} + --host-blocks {}",
            args.device_blocks, args.host_blocks
        ),
    )
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// True once SIGINT or SIGTERM arrived: the demo stops, removes its segment and leaves.
fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

extern "C" fn on_interrupt(_signal: libc::c_int) {
    // Only an atomic store: async-signal-safe. Relaxed: the flag carries no other data.
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// Ctrl-C (or a kill) during the replay or `--hold` ends the demo cleanly instead of leaving its
/// segment and arenas in /dev/shm for `kvctl cleanup`.
fn catch_interrupts() -> anyhow::Result<()> {
    let action =
        SigAction::new(SigHandler::Handler(on_interrupt), SaFlags::empty(), SigSet::empty());
    for signal in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to a static atomic, which is async-signal-safe, and
        // replaces the default action (exit), which nothing else in the demo relies on.
        unsafe { sigaction(signal, &action) }.context("installing the interrupt handler")?;
    }
    Ok(())
}

pub fn run(args: Args) -> anyhow::Result<()> {
    check(&args)?;
    catch_interrupts()?;
    let name = match &args.name {
        Some(name) => name.clone(),
        None => default_name()?,
    };
    let name = SegmentName::new(&name).context("segment name")?;
    let (requests, source) = load_requests(&args)?;

    let cache = CacheConfig::new(args.block_tokens, args.device_blocks)
        .with_host_blocks(args.host_blocks)
        .with_write_policy(args.write_policy)
        .with_free_watermark(args.free_watermark)
        .with_eviction(args.eviction)
        .with_storage_blocks(if args.storage.is_some() { storage_blocks(&args) } else { 0 })
        .with_storage_write_policy(args.storage_write_policy);
    let mut config =
        ServiceConfig::new(cache, args.tp, args.layers, args.layers * 2, args.region_bytes);
    config.storage_backoff = storage_backoff(&args)?;
    if args.backend == DemoBackend::Cuda {
        config.backend = Backend::Cuda;
    }
    let mut service = Service::create(&name, config).context("creating the service")?;
    let gpu = GpuBuffers::allocate(&args, &service)?;
    let (storage_args, storage_spec) = worker_storage_args(&args);
    let workers = Workers::spawn(name.as_str(), args.tp, |rank| {
        let mut worker_args = gpu.worker_args(rank, args.cuda_copy);
        worker_args.extend(storage_args.iter().cloned());
        (worker_args, storage_spec.clone())
    })?;
    // A storage tier takes a while to open (a slab is preallocated).
    let attach = if args.storage.is_some() { 120 } else { 10 };
    service.wait_for_workers(Duration::from_secs(attach)).context("waiting for the workers")?;
    let adopted = adopt_stored_blocks(&args, &mut service)?;

    let started = Instant::now();
    let mut engine = gpu.engine(&mut service);
    // Two requests per engine step, as a batching engine schedules them.
    for (step, batch) in requests.chunks(2).enumerate() {
        if interrupted() {
            let done = 2 * step;
            drop(engine);
            drop(service);
            bail!("interrupted by a signal after {done} requests; segment {name} removed");
        }
        engine.run_batch(batch)?;
    }
    let report = engine.report(started.elapsed());
    service.cache().check_invariants().context("cache invariants after the replay")?;

    if args.json {
        let mut value = serde_json::to_value(&report)?;
        value["tp"] = args.tp.into();
        value["backend"] = gpu.backend_name().into();
        value["trace"] = source.into();
        value["write_policy"] = args.write_policy.to_string().into();
        value["eviction"] = args.eviction.to_string().into();
        value["storage"] = args.storage.as_ref().map(|spec| spec.to_string()).into();
        value["storage_blocks"] = service.cache().config().storage_blocks.into();
        value["adopted_storage_blocks"] = adopted.into();
        value["storage_misses"] = service.stats().storage_misses.into();
        println!("{value}");
    } else {
        print_report(&args, &name, &source, &report);
        if let Some(spec) = &args.storage {
            println!(
                "  storage         {spec}: {} blocks per rank, {} found from a previous run; {:.1}% \
                 of blocks hit there, {} stored, {} loaded",
                storage_blocks(&args),
                adopted,
                percent(report.storage_hit_rate_blocks),
                report.storage_stores,
                report.storage_loads
            );
        }
    }

    if args.hold > 0 {
        eprintln!(
            "holding segment {name} for {} s (Ctrl-C ends it): from the checkout, try \
             `cargo kvctl stat {name}` or `cargo kvctl tree {name} --depth 2`",
            args.hold,
        );
        let until = deadline_after(Duration::from_secs(args.hold));
        while Instant::now() < until && !interrupted() {
            service.poll();
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    drop(service);
    workers.join(Duration::from_secs(5))?;
    if report.corrupted_blocks > 0 {
        bail!("{} blocks held the wrong bytes", report.corrupted_blocks);
    }
    Ok(())
}

/// The ranks' KV buffers on GPUs (`--backend cuda`), or none (`--backend host`).
struct GpuBuffers {
    /// Rank `r`'s buffers, and the device they are on.
    #[cfg(feature = "cuda")]
    ranks: Vec<kvshm::worker::cuda::DeviceKvBuffers>,
    #[cfg(feature = "cuda")]
    devices: Vec<u32>,
}

impl GpuBuffers {
    /// With `--backend cuda`, allocates each rank's buffers (rank `r` on device `r % devices`)
    /// and publishes their handles in the service's segment.
    fn allocate(args: &Args, service: &Service) -> anyhow::Result<GpuBuffers> {
        if args.backend == DemoBackend::Host {
            return Ok(GpuBuffers {
                #[cfg(feature = "cuda")]
                ranks: Vec::new(),
                #[cfg(feature = "cuda")]
                devices: Vec::new(),
            });
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = service;
            bail!(CUDA_NOT_BUILT);
        }
        #[cfg(feature = "cuda")]
        {
            use kvshm::worker::cuda::{device_count, DeviceKvBuffers};
            let devices = device_count();
            anyhow::ensure!(devices > 0, "--backend cuda: no CUDA device or driver found");
            let (mut ranks, mut rank_devices) = (Vec::new(), Vec::new());
            for rank in 0..args.tp {
                let device = rank % devices;
                let buffers =
                    DeviceKvBuffers::allocate(device, service.geometry()).with_context(|| {
                        format!("allocating rank {rank}'s KV buffers on GPU {device}")
                    })?;
                service
                    .segment()
                    .publish_device_handles(rank, &buffers.region_handles())
                    .with_context(|| format!("publishing rank {rank}'s device handles"))?;
                ranks.push(buffers);
                rank_devices.push(device);
            }
            Ok(GpuBuffers { ranks, devices: rank_devices })
        }
    }

    fn backend_name(&self) -> &'static str {
        #[cfg(feature = "cuda")]
        if !self.ranks.is_empty() {
            return "cuda";
        }
        "host"
    }

    /// The backend options of rank `rank`'s worker.
    fn worker_args(&self, rank: u32, copy: CopyMethod) -> Vec<String> {
        #[cfg(feature = "cuda")]
        if let Some(device) = self.devices.get(rank as usize) {
            let device = device.to_string();
            return ["--backend", "cuda", "--device", &device, "--cuda-copy", copy.name()]
                .map(String::from)
                .to_vec();
        }
        let _ = (rank, copy);
        Vec::new()
    }

    fn engine<'a>(&'a self, service: &'a mut Service) -> DemoEngine<'a> {
        #[cfg(feature = "cuda")]
        if !self.ranks.is_empty() {
            return DemoEngine::on_gpu(service, &self.ranks);
        }
        DemoEngine::new(service)
    }
}

fn percent(rate: f64) -> f64 {
    rate * 100.0
}

fn print_report(args: &Args, name: &SegmentName, source: &str, report: &DemoReport) {
    println!(
        "kvshm demo: segment {}, tp {}, {}, {} eviction",
        name.as_str(),
        args.tp,
        args.write_policy,
        args.eviction
    );
    println!("  workload        {source}");
    println!(
        "  requests        {} ({} skipped as too large, {} failed)",
        report.requests, report.skipped_requests, report.failed_requests
    );
    println!(
        "  hit rate        {:.1}% of {} blocks: device {:.1}%, host {:.1}%",
        percent(report.hit_rate_blocks),
        report.blocks,
        percent(report.device_hit_rate_blocks),
        percent(report.host_hit_rate_blocks)
    );
    println!(
        "  swaps           {} blocks in, {} out, {} backups, {} evictions",
        report.swap_in_blocks, report.swap_out_blocks, report.backup_blocks, report.evictions
    );
    println!(
        "  copies          {:.2} GB moved, {:.2} GB/s per worker while copying",
        report.bytes_copied as f64 / 1e9,
        report.copy_gb_per_s
    );
    println!(
        "  ticket wait     p50 {:.1} us, p99 {:.1} us (swap-ins: p50 {:.1} us, p99 {:.1} us)",
        report.ticket_wait_us.p50,
        report.ticket_wait_us.p99,
        report.swap_in_wait_us.p50,
        report.swap_in_wait_us.p99
    );
    println!(
        "  verified        {} hit blocks on every rank and region: {} corrupted",
        report.verified_blocks, report.corrupted_blocks
    );
    println!("  elapsed         {:.2} s", report.elapsed_s);
}
