//! `kvshm bench copy --backend cuda`: swap bandwidth between GPU KV buffers and the host tier
//! through a real `kvshm worker --backend cuda` process, against one contiguous pinned
//! `cuMemcpyAsync` measured in the same run, and how early a swap-in's first layer lands.
//!
//! 1. Baseline: one `cuMemcpyAsync` of the whole device buffer (`--tier-mib`) to and from pinned
//!    host memory, timed with events (best of five): the copy engine with no per-block work.
//! 2. For 64 KiB and 1 MiB blocks (`2 * --layers` regions each, K and V of a layer adjacent as in
//!    [`DeviceKvBuffers`]): a transport over a host tier of `--tier-mib`, the KV buffers on GPU
//!    `--device` with their IPC handles published; for each `--cuda-copy` method a worker process
//!    started with it, then for consecutive and scattered block ids, device-to-host and
//!    host-to-device, direct copies of `--command-mib` each submitted at once until
//!    `--mib-per-case` bytes are queued, timed from the first submit to the last completion.
//! 3. Layer-wise readiness (the first method): 64 blocks of 1 MiB backed up to host
//!    (write-through), pushed off the device, then hit again: the swap-in's
//!    `ticket_layers_ready` is polled and the time each layer count is first seen recorded.
//! 4. One JSON object (`--json`) or a table.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::record::BlockPair;
use serde::Serialize;

use super::copy::{command_pairs, gbps, Args, BLOCK_SIZES, MIB};
use kvshm::hash::BlockHash;
use kvshm::manager::{CacheConfig, RequestId, WritePolicy};
use kvshm::service::{Service, ServiceConfig};
use kvshm::transport::{
    Backend, CopyKind, DirectCopyOutcome, RankState, SegmentConfig, Transport, TransportConfig,
};
use kvshm::worker::cuda::DeviceKvBuffers;
use kvshm::worker::{CopyMethod, Direction};

/// How long a case, a worker start or a swap-in may take before the bench gives up.
const PATIENCE: Duration = Duration::from_secs(120);

#[derive(Debug, Serialize)]
struct Report {
    bench: &'static str,
    backend: &'static str,
    device: u32,
    tier_bytes: usize,
    bytes_per_case: usize,
    command_bytes: usize,
    layers: u32,
    regions: u32,
    baseline: Baseline,
    cases: Vec<Case>,
    /// Methods that could not be measured, and why (the bench exits non-zero after the report).
    failures: Vec<String>,
    layerwise: Option<Layerwise>,
}

#[derive(Debug, Serialize)]
struct Baseline {
    what: &'static str,
    bytes: usize,
    device_to_host_gbps: f64,
    host_to_device_gbps: f64,
}

#[derive(Debug, Serialize)]
struct Case {
    method: &'static str,
    direction: &'static str,
    ids: &'static str,
    block_bytes: usize,
    region_bytes: u64,
    pairs_per_command: usize,
    commands: usize,
    gbps: f64,
    vs_baseline: f64,
}

#[derive(Debug, Serialize)]
struct Layerwise {
    method: &'static str,
    blocks: usize,
    block_bytes: usize,
    layers: u32,
    /// Microseconds from the allocation that issued the swap-in until `ticket_layers_ready`
    /// first read `n`, for n = 1..=layers (0 where a count was skipped between two reads).
    layer_ready_us: Vec<f64>,
    first_layer_us: f64,
    all_layers_us: f64,
    first_layer_fraction: f64,
}

pub fn run(args: &Args, tier_bytes: usize, bytes_per_case: usize) -> anyhow::Result<()> {
    let command_bytes = args.command_mib * MIB;
    let mut cases = Vec::new();
    let mut failures = Vec::new();
    let mut baseline = None;
    for block_bytes in BLOCK_SIZES {
        let mut bench = BlockBench::create(args, tier_bytes, block_bytes)?;
        if baseline.is_none() {
            let measure = |direction| bench.buffers.contiguous_copy_gbps(direction, tier_bytes, 5);
            baseline = Some(Baseline {
                what: "one contiguous cuMemcpyAsync of the device buffer to or from pinned host \
                       memory, timed with CUDA events, best of 5",
                bytes: tier_bytes,
                device_to_host_gbps: measure(Direction::DeviceToHost)?,
                host_to_device_gbps: measure(Direction::HostToDevice)?,
            });
        }
        let reference = baseline.as_ref().expect("measured above");
        for &method in &args.cuda_copy {
            let measured = bench.measure_method(method, command_bytes, bytes_per_case, reference);
            match measured {
                Ok(method_cases) => cases.extend(method_cases),
                Err(error) => {
                    failures.push(format!("{method}, {block_bytes}-byte blocks: {error:#}"))
                }
            }
        }
    }
    let layerwise = match layerwise(args, args.cuda_copy[0]) {
        Ok(layerwise) => Some(layerwise),
        Err(error) => {
            failures.push(format!("layer-wise swap-in: {error:#}"));
            None
        }
    };
    let report = Report {
        bench: "copy",
        backend: "cuda",
        device: args.device,
        tier_bytes,
        bytes_per_case,
        command_bytes,
        layers: args.layers,
        regions: 2 * args.layers,
        baseline: baseline.expect("BLOCK_SIZES is not empty"),
        cases,
        failures,
        layerwise,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report);
    }
    if !report.failures.is_empty() {
        bail!("{} part(s) of the bench failed: {:?}", report.failures.len(), report.failures);
    }
    Ok(())
}

/// A transport, its GPU buffers and the blocks of one block size.
struct BlockBench {
    transport: Transport,
    buffers: DeviceKvBuffers,
    name: SegmentName,
    blocks: usize,
    block_bytes: usize,
    region_bytes: u64,
    device: u32,
}

impl BlockBench {
    fn create(args: &Args, tier_bytes: usize, block_bytes: usize) -> anyhow::Result<BlockBench> {
        let regions = 2 * args.layers;
        let blocks = tier_bytes / block_bytes;
        let region_bytes = (block_bytes / regions as usize) as u64;
        let name = bench_name(block_bytes)?;
        let segment = SegmentConfig {
            device_blocks: u32::try_from(blocks)?,
            host_blocks: u32::try_from(blocks)?,
            layers: args.layers,
            regions,
            region_bytes,
            backend: Backend::Cuda.to_wire(),
            command_ring_slots: kvshm::transport::DEFAULT_COMMAND_RING_SLOTS,
            completion_ring_slots: kvshm::transport::DEFAULT_COMPLETION_RING_SLOTS,
            ..SegmentConfig::default()
        };
        let config = TransportConfig {
            max_command_bytes: (args.command_mib * MIB) as u64,
            ..TransportConfig::new(segment)
        };
        let transport =
            Transport::create(&name, &config).context("creating the bench's transport")?;
        let buffers = DeviceKvBuffers::allocate(args.device, transport.geometry())
            .with_context(|| format!("allocating the KV buffers on GPU {}", args.device))?;
        transport.segment().publish_device_handles(0, &buffers.region_handles())?;
        Ok(BlockBench {
            transport,
            buffers,
            name,
            blocks,
            block_bytes,
            region_bytes,
            device: args.device,
        })
    }

    fn start_worker(&mut self, method: CopyMethod) -> anyhow::Result<BenchWorker> {
        let worker = BenchWorker::spawn(&self.name, self.device, method)?;
        self.transport
            .wait_for_workers(PATIENCE)
            .with_context(|| format!("waiting for the {method} worker"))?;
        Ok(worker)
    }

    /// Every case of `method`: a worker started with it, then consecutive and scattered ids in
    /// both directions, each against the baseline of its direction.
    fn measure_method(
        &mut self,
        method: CopyMethod,
        command_bytes: usize,
        bytes_per_case: usize,
        reference: &Baseline,
    ) -> anyhow::Result<Vec<Case>> {
        let worker = self.start_worker(method)?;
        let mut cases = Vec::new();
        for scattered in [false, true] {
            for kind in [CopyKind::DeviceToHost, CopyKind::HostToDevice] {
                let mut case = self
                    .measure(method, kind, scattered, command_bytes, bytes_per_case)
                    .with_context(|| format!("{kind:?}, scattered: {scattered}"))?;
                case.vs_baseline = case.gbps
                    / match kind {
                        CopyKind::DeviceToHost => reference.device_to_host_gbps,
                        CopyKind::HostToDevice => reference.host_to_device_gbps,
                    };
                cases.push(case);
            }
        }
        let transport = &mut self.transport;
        worker.stop(|| {
            transport.poll();
            transport.rank_states()
        })?;
        Ok(cases)
    }

    fn measure(
        &mut self,
        method: CopyMethod,
        kind: CopyKind,
        scattered: bool,
        command_bytes: usize,
        bytes_per_case: usize,
    ) -> anyhow::Result<Case> {
        let per_command = (command_bytes / self.block_bytes).clamp(1, self.blocks);
        let commands = bytes_per_case.div_ceil(per_command * self.block_bytes);
        let pairs: Vec<Vec<BlockPair>> =
            command_pairs(self.blocks, per_command, commands, scattered).collect();
        // A warm-up pass over a few commands: first-touch costs stay out of the figure.
        copy_all(&mut self.transport, kind, &pairs[..pairs.len().min(4)])?;
        let seconds = copy_all(&mut self.transport, kind, &pairs)?;
        Ok(Case {
            method: method.name(),
            direction: match kind {
                CopyKind::DeviceToHost => "device_to_host",
                CopyKind::HostToDevice => "host_to_device",
            },
            ids: if scattered { "scattered" } else { "consecutive" },
            block_bytes: self.block_bytes,
            region_bytes: self.region_bytes,
            pairs_per_command: per_command,
            commands,
            gbps: gbps(commands * per_command * self.block_bytes, seconds),
            vs_baseline: 0.0,
        })
    }
}

/// Submits every command at once as a direct copy and polls until all have completed; the
/// seconds from the first submit to the last completion.
fn copy_all(
    transport: &mut Transport,
    kind: CopyKind,
    commands: &[Vec<BlockPair>],
) -> anyhow::Result<f64> {
    let started = Instant::now();
    for pairs in commands {
        transport.submit_direct_copy(kind, pairs.clone());
    }
    let mut outcomes: Vec<DirectCopyOutcome> = Vec::new();
    let mut done = 0;
    while done < commands.len() {
        transport.poll();
        transport.pump();
        transport.take_direct_outcomes(&mut outcomes);
        for outcome in outcomes.drain(..) {
            if let Err(failure) = outcome.result {
                bail!("a copy failed: {failure}");
            }
            done += 1;
        }
        if started.elapsed() > PATIENCE {
            bail!("{} of {} commands done after {PATIENCE:?}", done, commands.len());
        }
    }
    Ok(started.elapsed().as_secs_f64())
}

/// A `kvshm worker --backend cuda` process of the bench; killed if the bench leaves early.
struct BenchWorker(Option<Child>);

impl BenchWorker {
    fn spawn(name: &SegmentName, device: u32, method: CopyMethod) -> anyhow::Result<BenchWorker> {
        let exe = std::env::current_exe().context("locating the kvshm executable")?;
        let child = Command::new(exe)
            .args(["worker", "--name", name.as_str(), "--rank", "0", "--backend", "cuda"])
            .args(["--device", &device.to_string(), "--cuda-copy", method.name()])
            .stdin(Stdio::null())
            .spawn()
            .context("spawning the bench's worker")?;
        Ok(BenchWorker(Some(child)))
    }

    /// SIGTERM, then waits for the exit and for the scheduler side to see the rank free again
    /// (`poll_ranks` polls and says the ranks' states).
    fn stop(mut self, mut poll_ranks: impl FnMut() -> Vec<RankState>) -> anyhow::Result<()> {
        let Some(child) = &mut self.0 else { return Ok(()) };
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
        let deadline = Instant::now() + PATIENCE;
        while child.try_wait()?.is_none() {
            if Instant::now() > deadline {
                bail!("the bench's worker (pid {pid}) did not stop");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.0 = None;
        while poll_ranks().iter().any(|state| *state != RankState::Down) {
            if Instant::now() > deadline {
                bail!("the scheduler still sees the bench's worker (pid {pid}) after it exited");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }
}

impl Drop for BenchWorker {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn bench_name(block_bytes: usize) -> anyhow::Result<SegmentName> {
    let name = format!("bench-copy-{}-{}", std::process::id(), block_bytes);
    Ok(SegmentName::new(&name)?)
}

/// Step 3 of the module flow.
fn layerwise(args: &Args, method: CopyMethod) -> anyhow::Result<Layerwise> {
    // A request of 63 blocks takes all 64 device blocks (one more for its last token).
    const BLOCKS: usize = 63;
    const BLOCK_TOKENS: u32 = 16;
    let block_bytes = BLOCK_SIZES[1];
    let regions = 2 * args.layers;
    let cache = CacheConfig::new(BLOCK_TOKENS, BLOCKS as u32 + 1)
        .with_host_blocks(4 * BLOCKS as u32)
        .with_write_policy(WritePolicy::WriteThrough);
    let mut config =
        ServiceConfig::new(cache, 1, args.layers, regions, (block_bytes / regions as usize) as u64);
    config.backend = Backend::Cuda;
    let name = bench_name(0)?;
    let mut service = Service::create(&name, config).context("creating the layer-wise service")?;
    let buffers = DeviceKvBuffers::allocate(args.device, service.geometry())?;
    service.segment().publish_device_handles(0, &buffers.region_handles())?;
    let worker = BenchWorker::spawn(&name, args.device, method)?;
    service.wait_for_workers(PATIENCE)?;

    let tokens = BLOCKS * BLOCK_TOKENS as usize;
    let prefix: Vec<BlockHash> = (0..BLOCKS as u128).map(|i| BlockHash(1 + i)).collect();
    let other: Vec<BlockHash> = (0..BLOCKS as u128).map(|i| BlockHash(10_000 + i)).collect();
    // Compute the prefix (its backup lands on host), then another request pushes it off the
    // device.
    for (id, hashes) in [(1, &prefix), (2, &other)] {
        let request = RequestId(id);
        // One token past the blocks: the request takes every device block.
        service.match_prefix(request, hashes, tokens + 1)?;
        let ticket = service.allocate(request, tokens + 1, 0)?.ticket;
        service.wait(ticket, PATIENCE)?;
        service.commit(request, tokens, hashes)?;
        service.finish(request)?;
        service.poll();
        anyhow::ensure!(service.wait_for_copies(PATIENCE), "the backups did not land");
    }
    let request = RequestId(3);
    // One token past the prefix, so that every block of it may hit (the last-token rule).
    let matched = service.match_prefix(request, &prefix, tokens + 1)?;
    anyhow::ensure!(matched.host_blocks == BLOCKS, "the prefix is on host: {matched:?}");
    let started = Instant::now();
    let ticket = service.allocate(request, tokens + 1 - matched.cached_tokens, 0)?.ticket;
    let layers = args.layers;
    let mut ready_at = vec![0.0; layers as usize];
    let mut seen = 0;
    while seen < layers {
        let now = service.ticket_layers_ready(ticket)?;
        if now > seen {
            ready_at[now as usize - 1] = started.elapsed().as_secs_f64() * 1e6;
            seen = now;
        }
        if started.elapsed() > PATIENCE {
            bail!("the swap-in has {seen} of {layers} layers after {PATIENCE:?}");
        }
        service.poll();
    }
    service.wait(ticket, PATIENCE)?;
    service.abort(request)?;
    worker.stop(|| {
        service.poll();
        service.rank_states()
    })?;
    drop(service);
    drop(buffers);
    let first = ready_at.iter().copied().find(|&at| at > 0.0).unwrap_or(0.0);
    let all = ready_at[layers as usize - 1];
    Ok(Layerwise {
        method: method.name(),
        blocks: BLOCKS,
        block_bytes,
        layers,
        layer_ready_us: ready_at,
        first_layer_us: first,
        all_layers_us: all,
        first_layer_fraction: if all > 0.0 { first / all } else { 0.0 },
    })
}

fn print_table(report: &Report) {
    println!(
        "contiguous cuMemcpyAsync of {} MiB: device->host {:.2} GB/s, host->device {:.2} GB/s",
        report.baseline.bytes / MIB,
        report.baseline.device_to_host_gbps,
        report.baseline.host_to_device_gbps
    );
    println!(
        "{:<7} {:<15} {:<12} {:>8} {:>9} {:>9} {:>9}",
        "method", "direction", "ids", "block", "pairs/cmd", "GB/s", "vs copy"
    );
    for case in &report.cases {
        println!(
            "{:<7} {:<15} {:<12} {:>8} {:>9} {:>9.2} {:>9.2}",
            case.method,
            case.direction,
            case.ids,
            case.block_bytes,
            case.pairs_per_command,
            case.gbps,
            case.vs_baseline
        );
    }
    for failure in &report.failures {
        println!("FAILED: {failure}");
    }
    let Some(layerwise) = &report.layerwise else { return };
    println!(
        "layer-wise swap-in ({}, {} blocks of {} KiB, {} layers): layer 1 after {:.0} us, all after \
         {:.0} us ({:.0}%)",
        layerwise.method,
        layerwise.blocks,
        layerwise.block_bytes / 1024,
        layerwise.layers,
        layerwise.first_layer_us,
        layerwise.all_layers_us,
        layerwise.first_layer_fraction * 100.0
    );
}
