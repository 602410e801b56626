//! `kvshm worker`: the copy worker of one tensor-parallel rank of a segment.
//!
//! Parses the options into [`WorkerOptions`], runs [`run_worker`], and turns its ending into an
//! exit status: 0 when stopped by SIGTERM/SIGINT or when the scheduler is gone, non-zero (with the
//! error's message) when the worker cannot start, loses its rank or finds its command ring broken.
//!
//! `--storage disk:DIR` or `--storage redis://…` gives the worker a storage tier below host
//! (`crate::storage`); the `--storage-*` options tune it, and one that does not apply to the tier
//! chosen (or given without `--storage`) is refused rather than ignored.
//!
//! Test hooks, meant for tests only:
//! - [`LAYER_DELAY_ENV`] (`KVSHM_WORKER_LAYER_DELAY_US`) makes the worker sleep that many
//!   microseconds after each layer of each copy (heartbeating meanwhile), so that tests can kill
//!   it in the middle of a copy;
//! - [`COPY_RATE_ENV`] (`KVSHM_WORKER_COPY_RATE`) makes the host engine copy at most that many
//!   bytes per second, sleeping inside the copy itself: a slow copy, as a large copy on a slow or
//!   busy machine would be;
//! - [`STORAGE_CRASH_ENV`] (`KVSHM_STORAGE_CRASH=POINT@N`) makes a disk tier kill its process at a
//!   step of its N-th block write (or, `panic@N`, panic its storage thread there).

use std::time::Duration;

use anyhow::Context;
use kvshm_ipc::name::SegmentName;

use super::checks;
use crate::storage::spec::{spec_given, StorageNamespace, StorageOptions, StorageSpec};
use crate::worker::process::{run_worker, BackendChoice, WorkerOptions};
use crate::worker::run::{ServeExit, ServeOptions, DEFAULT_MAX_BATCH};
use crate::worker::CopyMethod;

/// The layer-delay test hook's environment variable (module documentation).
pub const LAYER_DELAY_ENV: &str = "KVSHM_WORKER_LAYER_DELAY_US";
/// The copy-rate test hook's environment variable (module documentation).
pub const COPY_RATE_ENV: &str = "KVSHM_WORKER_COPY_RATE";
/// The disk tier's crash hook (module documentation).
pub const STORAGE_CRASH_ENV: &str = "KVSHM_STORAGE_CRASH";
/// The most Redis connections one worker may open.
const MAX_CONNECTIONS: usize = 256;

#[derive(Debug, clap::Args)]
#[command(after_help = "Test hooks, not for production use: KVSHM_WORKER_LAYER_DELAY_US=N \
    sleeps N microseconds after each layer of each copy, so that a test can kill the worker in the \
    middle of a copy; KVSHM_WORKER_COPY_RATE=N makes the host engine copy at most N bytes per \
    second, so that a test can make one copy as slow as it likes.")]
pub struct Args {
    /// Name of the segment to attach to (as given to the scheduler).
    #[arg(long)]
    name: String,
    /// Tensor-parallel rank this worker serves.
    #[arg(long)]
    rank: u32,
    /// Copy engine; defaults to the backend the segment was created for.
    #[arg(long, value_enum)]
    backend: Option<BackendArg>,
    /// CUDA device ordinal (cuda backend); defaults to the rank.
    #[arg(long)]
    device: Option<u32>,
    /// The shared tier whose arena holds the segment's host tier, for an engine on a shared
    /// host tier (the segment says it is one and refuses a worker without it).
    #[arg(long, requires = "shared_tier_rank")]
    shared_tier: Option<String>,
    /// The shared tier's rank whose arena this worker copies into: the engine's
    /// tensor-parallel rank (its segment is that rank's alone, so `--rank` is 0).
    #[arg(long, requires = "shared_tier")]
    shared_tier_rank: Option<u32>,
    /// Seconds to keep retrying while the segment does not exist yet or the rank still belongs to
    /// a dead worker the scheduler has not reclaimed. Long enough for a scheduler creating a tier
    /// of tens of GiB, which zeroes its pages first (DESIGN §2.1: 4 GiB took 3 to 15 s on a busy
    /// 2-core VM), while its workers start beside it.
    #[arg(long, default_value_t = 60.0)]
    attach_timeout: f64,
    /// Seconds a cuda worker waits for the engine to publish its device handles.
    #[arg(long, default_value_t = 300.0)]
    handles_timeout: f64,
    /// How the cuda backend moves blocks: kernel (kvshm's copy kernel, one launch per group of
    /// layers) or calls (one DMA call per piece: slower on scattered small blocks, but uses no
    /// GPU threads).
    #[arg(long, default_value_t = CopyMethod::default())]
    cuda_copy: CopyMethod,
    /// A storage tier below host: `disk:DIR` (a slab per rank under DIR/NAMESPACE) or
    /// `redis://HOST[:PORT][/DB]` (shared by every service using the same namespace).
    #[arg(long)]
    storage: Option<String>,
    /// Read the storage tier's spec from `KVSHM_STORAGE`, which, unlike the command line, other
    /// users cannot read (a Redis URL may carry a password).
    #[arg(long, conflicts_with = "storage")]
    storage_from_env: bool,
    /// The storage namespace: services that should share blocks use the same one.
    #[arg(long, default_value = "default")]
    storage_namespace: String,
    /// Disk tier: blocks this rank keeps on disk (default: 4 x the host tier).
    #[arg(long)]
    storage_blocks: Option<u64>,
    /// Disk tier: use the page cache instead of O_DIRECT.
    #[arg(long)]
    storage_buffered: bool,
    /// Redis tier: seconds a stored block lives without being read (default: until Redis
    /// evicts it).
    #[arg(long)]
    storage_ttl: Option<u64>,
    /// Redis tier: connections per worker [default: 4].
    #[arg(long)]
    storage_connections: Option<usize>,
    /// Redis tier: seconds to wait for an answer (a late answer is a counted miss) [default: 2].
    #[arg(long)]
    storage_timeout: Option<f64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum BackendArg {
    Host,
    Cuda,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let name = SegmentName::new(&args.name)?;
    let options = WorkerOptions {
        name: name.clone(),
        rank: args.rank,
        backend: args.backend.map(|backend| match backend {
            BackendArg::Host => BackendChoice::Host,
            BackendArg::Cuda => BackendChoice::Cuda,
        }),
        device: args.device,
        attach_timeout: checks::seconds(args.attach_timeout, "--attach-timeout")?,
        handles_timeout: checks::seconds(args.handles_timeout, "--handles-timeout")?,
        cuda_copy: args.cuda_copy,
        serve: ServeOptions {
            max_batch: DEFAULT_MAX_BATCH,
            layer_delay: layer_delay()?,
            copy_rate_limit: copy_rate_limit()?,
        },
        storage: storage_options(&args)?,
        shared_tier: match (args.shared_tier.as_deref(), args.shared_tier_rank) {
            (Some(tier), Some(rank)) => Some((SegmentName::new(tier)?, rank)),
            _ => None,
        },
    };
    let rank = args.rank;
    match run_worker(&options)? {
        ServeExit::SchedulerGone { pid } => eprintln!(
            "kvshm worker: rank {rank} of segment {name}: the scheduler (pid {pid}) closed the \
             segment or exited; exiting"
        ),
        ServeExit::StopRequested => {
            eprintln!("kvshm worker: rank {rank} of segment {name}: stopped by a signal")
        }
    }
    Ok(())
}

/// The tier-specific `--storage-*` options given, with the tier each applies to.
fn tier_options_given(args: &Args) -> [(&'static str, bool, bool); 5] {
    // (option, given, applies to disk rather than Redis)
    [
        ("--storage-blocks", args.storage_blocks.is_some(), true),
        ("--storage-buffered", args.storage_buffered, true),
        ("--storage-ttl", args.storage_ttl.is_some(), false),
        ("--storage-connections", args.storage_connections.is_some(), false),
        ("--storage-timeout", args.storage_timeout.is_some(), false),
    ]
}

fn storage_options(args: &Args) -> anyhow::Result<Option<StorageOptions>> {
    let Some(spec) = spec_given(args.storage.as_deref(), args.storage_from_env)? else {
        if let Some((option, ..)) = tier_options_given(args).iter().find(|(_, given, _)| *given) {
            anyhow::bail!("{option} tunes a storage tier, and no --storage was given");
        }
        return Ok(None);
    };
    let spec: StorageSpec = spec.parse()?;
    let is_disk = matches!(spec, StorageSpec::Disk { .. });
    for (option, given, for_disk) in tier_options_given(args) {
        if given && for_disk != is_disk {
            let (tier, other) = if is_disk { ("disk", "Redis") } else { ("Redis", "disk") };
            anyhow::bail!(
                "{option} applies to a {other} tier only, and --storage names a {tier} tier"
            );
        }
    }
    let mut options = StorageOptions::new(spec);
    options.namespace = StorageNamespace::new(&args.storage_namespace)?;
    if let Some(blocks) = args.storage_blocks {
        checks::at_least(blocks, 1, "--storage-blocks")?;
    }
    options.capacity_blocks = args.storage_blocks;
    options.prefer_direct = !args.storage_buffered;
    if let Some(ttl) = args.storage_ttl {
        checks::at_least(ttl, 1, "--storage-ttl")?;
    }
    options.ttl = args.storage_ttl.map(Duration::from_secs);
    if let Some(connections) = args.storage_connections {
        options.connections =
            checks::within(connections, 1..=MAX_CONNECTIONS, "--storage-connections")?;
    }
    if let Some(timeout) = args.storage_timeout {
        options.io_timeout = checks::positive_seconds(timeout, "--storage-timeout")?;
    }
    options.crash = match std::env::var(STORAGE_CRASH_ENV) {
        Err(std::env::VarError::NotPresent) => None,
        Err(error) => return Err(error).context(STORAGE_CRASH_ENV),
        Ok(text) => Some(text.parse().map_err(anyhow::Error::msg).context(STORAGE_CRASH_ENV)?),
    };
    Ok(Some(options))
}

fn layer_delay() -> anyhow::Result<Option<Duration>> {
    Ok(whole_number_env(LAYER_DELAY_ENV, "microseconds")?.map(Duration::from_micros))
}

fn copy_rate_limit() -> anyhow::Result<Option<u64>> {
    whole_number_env(COPY_RATE_ENV, "bytes per second")
}

/// The positive whole number in environment variable `name`; `None` when unset or 0.
fn whole_number_env(name: &str, unit: &str) -> anyhow::Result<Option<u64>> {
    match std::env::var(name) {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(error) => Err(error).context(name.to_owned()),
        Ok(text) => {
            let value: u64 = text.trim().parse().with_context(|| {
                format!("{name} must be a whole number of {unit}, not {text:?}")
            })?;
            Ok((value > 0).then_some(value))
        }
    }
}
