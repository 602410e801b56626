//! `kvshm bench copy`: host-backend swap bandwidth through the worker's copy path, against a plain
//! single-threaded memcpy of the same number of bytes measured in the same run. With `--backend
//! cuda` (feature `cuda`), GPU swap bandwidth through a real worker process instead
//! ([`super::copy_cuda`]).
//!
//! 1. Create two shared-memory objects (device arena and host tier, `--tier-mib` each), unlink
//!    them at once (the mappings stay; nothing is left behind if the run dies), and touch every page.
//! 2. Baseline: one `copy_nonoverlapping` of a whole tier into the other, repeated until
//!    `--mib-per-case` bytes have moved, each direction.
//! 3. For 64 KiB and 1 MiB blocks (`2 * --layers` regions each), consecutive and scattered ids,
//!    device-to-host and host-to-device: encode commands of `--pairs-per-command` pairs into ring
//!    slots beforehand, then time what the worker does per command — decode the slots, validate,
//!    coalesce and execute on [`HostCopyEngine`] — until `--mib-per-case` bytes have moved.
//! 4. Print one JSON object (`--json`) or a table: GB/s per case and its ratio to the memcpy of the
//!    same direction.

use std::time::Instant;

use anyhow::Context;
use kvshm_ipc::config::MAX_REGIONS;
use kvshm_ipc::record::{
    command_slot_count, decode_command, encode_command, BlockPair, CommandHeader, CommandSlot, Op,
};
use kvshm_ipc::shm::{self, SharedMemory};
use serde::Serialize;

use kvshm::worker::{
    validate, CopyEngine, CopyMethod, Geometry, GeometryParams, HostCopyEngine, MappedArea,
    ValidCommand,
};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub(super) json: bool,
    /// Size of each tier's shared-memory mapping, in MiB.
    #[arg(long, default_value_t = 512)]
    pub(super) tier_mib: usize,
    /// Bytes each case moves, in MiB (commands repeat over the tiers).
    #[arg(long, default_value_t = 2048)]
    pub(super) mib_per_case: usize,
    /// Layers per block; a block has two regions (K and V) per layer.
    #[arg(long, default_value_t = 16)]
    pub(super) layers: u32,
    /// Block pairs per command (host backend).
    #[arg(long, default_value_t = 32)]
    pairs_per_command: usize,
    /// host: the host backend's engine, in process; cuda: `kvshm worker --backend cuda`
    /// processes between GPU buffers and the host tier (needs the cuda feature).
    #[arg(long, value_enum, default_value_t = BenchBackend::Host)]
    pub(super) backend: BenchBackend,
    /// cuda: the GPU the KV buffers live on.
    #[arg(long, default_value_t = 0)]
    pub(super) device: u32,
    /// cuda: the copy methods to measure, comma-separated (kernel, calls).
    #[arg(long, value_delimiter = ',', default_values_t = CopyMethod::ALL)]
    pub(super) cuda_copy: Vec<CopyMethod>,
    /// cuda: bytes per command, in MiB (the scheduler sends up to 64 MiB per command).
    #[arg(long, default_value_t = 16)]
    pub(super) command_mib: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum BenchBackend {
    Host,
    Cuda,
}

pub(super) const MIB: usize = 1 << 20;
pub(super) const BLOCK_SIZES: [usize; 2] = [64 << 10, 1 << 20];

#[derive(Debug, Serialize)]
struct Report {
    bench: &'static str,
    backend: &'static str,
    tier_bytes: usize,
    bytes_per_case: usize,
    layers: u32,
    regions: u32,
    pairs_per_command: usize,
    baseline: Baseline,
    cases: Vec<Case>,
}

#[derive(Debug, Serialize)]
struct Baseline {
    what: &'static str,
    device_to_host_gbps: f64,
    host_to_device_gbps: f64,
}

#[derive(Debug, Serialize)]
struct Case {
    direction: &'static str,
    ids: &'static str,
    block_bytes: usize,
    region_bytes: u64,
    commands: usize,
    runs_per_command: f64,
    gbps: f64,
    vs_memcpy: f64,
}

/// The two tiers, mapped from unlinked shared-memory objects.
struct Tiers {
    device: SharedMemory,
    host: SharedMemory,
}

impl Tiers {
    fn create(len: usize) -> anyhow::Result<Tiers> {
        let prefix = format!("/kvshm-bench-copy.{}", std::process::id());
        let make = |suffix: &str| -> anyhow::Result<SharedMemory> {
            let object = format!("{prefix}.{suffix}");
            let memory = SharedMemory::create(&object, len)
                .with_context(|| format!("creating {object} of {len} bytes"))?;
            shm::unlink(&object).with_context(|| format!("unlinking {object}"))?;
            // Touch every page now so that page faults stay out of the measurements.
            // SAFETY: the mapping is ours alone (created O_EXCL, unlinked) and `len` bytes long.
            unsafe { std::ptr::write_bytes(memory.as_ptr(), 0x5a, memory.len()) };
            Ok(memory)
        };
        Ok(Tiers { device: make("dev")?, host: make("host")? })
    }

    fn areas(&self) -> (MappedArea, MappedArea) {
        // SAFETY: both mappings live as long as `self`, which outlives every engine built from
        // these areas in `run`; no other process knows the (unlinked) objects.
        unsafe {
            (
                MappedArea::new(self.device.as_ptr(), self.device.len())
                    .expect("a mapping at null is a programming error"),
                MappedArea::new(self.host.as_ptr(), self.host.len())
                    .expect("a mapping at null is a programming error"),
            )
        }
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let (tier_bytes, bytes_per_case) = check(&args)?;
    if args.backend == BenchBackend::Cuda {
        #[cfg(feature = "cuda")]
        return super::copy_cuda::run(&args, tier_bytes, bytes_per_case);
        #[cfg(not(feature = "cuda"))]
        anyhow::bail!(
            "--backend cuda needs a kvshm built with the cuda feature (cargo build --release \
             --features kvshm/cuda)"
        );
    }
    let tiers = Tiers::create(tier_bytes)?;

    let baseline = Baseline {
        what: "one single-threaded copy_nonoverlapping of a whole tier, repeated",
        device_to_host_gbps: memcpy_gbps(&tiers, true, bytes_per_case),
        host_to_device_gbps: memcpy_gbps(&tiers, false, bytes_per_case),
    };
    let mut cases = Vec::new();
    for block_bytes in BLOCK_SIZES {
        for scattered in [false, true] {
            for op in [Op::CopyDeviceToHost, Op::CopyHostToDevice] {
                let case = measure_case(&args, &tiers, block_bytes, scattered, op, &baseline)?;
                cases.push(case);
            }
        }
    }
    let report = Report {
        bench: "copy",
        backend: "host",
        tier_bytes,
        bytes_per_case,
        layers: args.layers,
        regions: 2 * args.layers,
        pairs_per_command: args.pairs_per_command,
        baseline,
        cases,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

/// Refuses sizes the run cannot have, naming the option; returns the bytes of each tier and of
/// each case.
fn check(args: &Args) -> anyhow::Result<(usize, usize)> {
    use kvshm::cli::checks::{at_least, fits_in_dev_shm, fits_in_memory, mib_to_bytes, within};
    // Both block sizes must split into 2 * layers regions: layers is a power of two up to half
    // the regions of the smaller block (64 KiB), and at most what a segment holds.
    let max_layers = (MAX_REGIONS / 2).min(BLOCK_SIZES[0] as u32 / 2);
    within(args.layers, 1..=max_layers, "--layers")?;
    anyhow::ensure!(
        args.layers.is_power_of_two(),
        "--layers {} must be a power of two, so that 64 KiB and 1 MiB blocks split into its regions",
        args.layers
    );
    within(args.pairs_per_command, 1..=MAX_PAIRS_PER_COMMAND, "--pairs-per-command")?;
    at_least(args.tier_mib, 1, "--tier-mib")?;
    at_least(args.mib_per_case, 1, "--mib-per-case")?;
    let tier_bytes = mib_to_bytes(args.tier_mib as u64, "--tier-mib")?;
    if args.backend == BenchBackend::Cuda {
        // A command of 64 KiB blocks must fit in half of the service's command ring.
        within(args.command_mib, 1..=512, "--command-mib")?;
        at_least(args.cuda_copy.len(), 1, "--cuda-copy")?;
        anyhow::ensure!(
            args.tier_mib >= args.command_mib,
            "--tier-mib {} must hold at least one command (--command-mib {})",
            args.tier_mib,
            args.command_mib
        );
        // The host tier is in /dev/shm; the device tier on the GPU.
        fits_in_dev_shm(u128::from(tier_bytes), format_args!("--tier-mib {}", args.tier_mib))?;
        let bytes_per_case = mib_to_bytes(args.mib_per_case as u64, "--mib-per-case")?;
        let as_usize = |bytes: u64| usize::try_from(bytes).unwrap_or(usize::MAX);
        return Ok((as_usize(tier_bytes), as_usize(bytes_per_case)));
    }
    let largest = (BLOCK_SIZES[1] * args.pairs_per_command) as u64;
    anyhow::ensure!(
        tier_bytes >= largest,
        "--tier-mib {} must hold at least one command of 1 MiB blocks ({} MiB)",
        args.tier_mib,
        largest / MIB as u64
    );
    fits_in_dev_shm(
        u128::from(tier_bytes) * 2,
        format_args!("--tier-mib {}: two tiers", args.tier_mib),
    )?;
    let bytes_per_case = mib_to_bytes(args.mib_per_case as u64, "--mib-per-case")?;
    // Every case encodes its commands beforehand; the smallest blocks make the most commands.
    let commands = bytes_per_case.div_ceil((BLOCK_SIZES[0] * args.pairs_per_command) as u64);
    let slot_bytes = u128::from(commands)
        * command_slot_count(args.pairs_per_command) as u128
        * size_of::<CommandSlot>() as u128;
    fits_in_memory(
        slot_bytes,
        format_args!("--mib-per-case {}: the encoded commands of one case", args.mib_per_case),
    )?;
    let as_usize = |bytes: u64, option: &str| {
        usize::try_from(bytes)
            .map_err(|_| anyhow::anyhow!("{option} is too large for this machine"))
    };
    Ok((as_usize(tier_bytes, "--tier-mib")?, as_usize(bytes_per_case, "--mib-per-case")?))
}

/// The most pairs one command may carry in this bench (a command fits in half of any ring).
const MAX_PAIRS_PER_COMMAND: usize = 1 << 16;

/// GB/s of whole-tier memcpys between the two mappings until `bytes` have moved.
fn memcpy_gbps(tiers: &Tiers, device_to_host: bool, bytes: usize) -> f64 {
    let len = tiers.device.len().min(tiers.host.len());
    let (src, dst) = if device_to_host {
        (tiers.device.as_ptr(), tiers.host.as_ptr())
    } else {
        (tiers.host.as_ptr(), tiers.device.as_ptr())
    };
    let copies = bytes.div_ceil(len);
    let start = Instant::now();
    for _ in 0..copies {
        // SAFETY: both mappings hold at least `len` bytes, are distinct objects (so they do not
        // overlap), and nothing else touches them: no other process knows the unlinked objects,
        // and this thread is the only one copying (no data race).
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
    }
    gbps(copies * len, start.elapsed().as_secs_f64())
}

fn measure_case(
    args: &Args,
    tiers: &Tiers,
    block_bytes: usize,
    scattered: bool,
    op: Op,
    baseline: &Baseline,
) -> anyhow::Result<Case> {
    let regions = 2 * args.layers;
    anyhow::ensure!(
        block_bytes % regions as usize == 0,
        "{block_bytes}-byte blocks do not split into {regions} regions"
    );
    let blocks = tiers.device.len().min(tiers.host.len()) / block_bytes;
    let geometry = Geometry::new(GeometryParams {
        layers: args.layers,
        regions,
        region_bytes: (block_bytes / regions as usize) as u64,
        device_blocks: u32::try_from(blocks)?,
        host_blocks: u32::try_from(blocks)?,
    })?;
    let (device, host) = tiers.areas();
    let mut engine = HostCopyEngine::new(geometry, device, host)?;

    let per_command = args.pairs_per_command;
    let commands = (args.mib_per_case * MIB).div_ceil(per_command * block_bytes);
    let slots = encode_commands(op, blocks, per_command, commands, scattered);

    let mut pairs = Vec::with_capacity(per_command);
    let mut runs = 0usize;
    let mut at = 0;
    let start = Instant::now();
    while at < slots.len() {
        pairs.clear();
        let (header, used) = decode_command(&slots[at..], &mut pairs)?;
        at += used;
        let ValidCommand::Copy { plan, .. } = validate(&header, &pairs, engine.geometry(), 0)?
        else {
            anyhow::bail!("the bench only issues copies");
        };
        runs += plan.runs().len();
        engine.execute(&plan, &mut |_| std::ops::ControlFlow::Continue(()))?;
    }
    let seconds = start.elapsed().as_secs_f64();
    let rate = gbps(commands * per_command * block_bytes, seconds);
    let (direction, reference) = match op {
        Op::CopyDeviceToHost => ("device_to_host", baseline.device_to_host_gbps),
        _ => ("host_to_device", baseline.host_to_device_gbps),
    };
    Ok(Case {
        direction,
        ids: if scattered { "scattered" } else { "consecutive" },
        block_bytes,
        region_bytes: geometry.region_bytes(),
        commands,
        runs_per_command: runs as f64 / commands as f64,
        gbps: rate,
        vs_memcpy: rate / reference,
    })
}

/// `commands` commands of `per_command` pairs over `blocks` blocks per tier, encoded as ring slots
/// (pairs from [`command_pairs`]).
fn encode_commands(
    op: Op,
    blocks: usize,
    per_command: usize,
    commands: usize,
    scattered: bool,
) -> Vec<CommandSlot> {
    let mut slots = Vec::new();
    for (command, pairs) in command_pairs(blocks, per_command, commands, scattered).enumerate() {
        let header = CommandHeader::new(op, command as u64, 0, per_command as u32);
        encode_command(&header, &pairs, &mut slots);
    }
    slots
}

/// The pairs of `commands` commands of `per_command` pairs over `blocks` blocks per tier.
/// Consecutive: command `k` copies a run starting at a multiple of `per_command`; scattered: pairs
/// follow two independent random permutations of the block ids (distinct within a command).
pub(super) fn command_pairs(
    blocks: usize,
    per_command: usize,
    commands: usize,
    scattered: bool,
) -> impl Iterator<Item = Vec<BlockPair>> {
    let mut sources: Vec<u32> = (0..blocks as u32).collect();
    let mut destinations = sources.clone();
    if scattered {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        shuffle(&mut sources, &mut state);
        shuffle(&mut destinations, &mut state);
    } else {
        // Destination runs start half a tier away from their sources.
        destinations.rotate_left((blocks / per_command / 2) * per_command);
    }
    let windows = blocks / per_command;
    (0..commands).map(move |command| {
        let first = (command % windows) * per_command;
        (first..first + per_command).map(|i| BlockPair::new(sources[i], destinations[i])).collect()
    })
}

/// Fisher-Yates with splitmix64: deterministic, no dependency.
fn shuffle(ids: &mut [u32], state: &mut u64) {
    for i in (1..ids.len()).rev() {
        *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        ids.swap(i, (z % (i as u64 + 1)) as usize);
    }
}

pub(super) fn gbps(bytes: usize, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

fn print_table(report: &Report) {
    println!(
        "memcpy baseline: device->host {:.2} GB/s, host->device {:.2} GB/s",
        report.baseline.device_to_host_gbps, report.baseline.host_to_device_gbps
    );
    println!(
        "{:<15} {:<12} {:>10} {:>8} {:>9} {:>9}",
        "direction", "ids", "block", "runs/cmd", "GB/s", "vs memcpy"
    );
    for case in &report.cases {
        println!(
            "{:<15} {:<12} {:>10} {:>8.1} {:>9.2} {:>9.2}",
            case.direction,
            case.ids,
            case.block_bytes,
            case.runs_per_command,
            case.gbps,
            case.vs_memcpy
        );
    }
}
