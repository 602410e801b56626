//! `kvshm bench tier`: how a worker's set-up and exit grow with the size of its host tier, against
//! the kernel's own cost for the same bytes measured in the same run.
//!
//! For each `--gib` size:
//! 1. baseline: one shared-memory object of that size, created and backed as a segment's arena is
//!    (`posix_fallocate`), mapped in with `MADV_POPULATE_WRITE` (as the worker's pre-fault does)
//!    and unmapped, each timed; the bytes of it mapped with huge pages (`ShmemPmdMapped`) say
//!    whether the system gave any (a `/dev/shm` mounted with `huge=within_size` or `always`);
//! 2. a service of one rank with a host tier of that size and a `kvshm worker` process: the time
//!    from its spawn to the rank serving;
//! 3. the service dropped (the segment closed): the time until the worker process has exited.
//!
//! One JSON object (`--json`) or a table.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::shm::{self, SharedMemory};
use serde::Serialize;

use kvshm::manager::CacheConfig;
use kvshm::service::{Service, ServiceConfig};
use kvshm::worker::prefault::{populate, Populated};
use kvshm::worker::MappedArea;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Host tier sizes to measure, in GiB, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1u32, 4])]
    gib: Vec<u32>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

const GIB: u64 = 1 << 30;
/// The host tier's blocks: 2 MiB (two regions of 1 MiB).
const REGION_BYTES: u64 = 1 << 20;
/// How long a worker may take to come up or to exit before the bench gives up.
const PATIENCE: Duration = Duration::from_secs(120);

#[derive(Debug, Serialize)]
struct Report {
    bench: &'static str,
    baseline: &'static str,
    sizes: Vec<SizeCase>,
}

#[derive(Debug, Serialize)]
struct SizeCase {
    tier_gib: u32,
    /// Baseline: `MADV_POPULATE_WRITE` of the object in one process.
    populate_s: f64,
    /// Baseline: `munmap` of it.
    unmap_s: f64,
    /// Baseline: bytes of the mapping backed by huge pages, once populated.
    huge_page_bytes: u64,
    /// From the worker's spawn to its rank serving.
    worker_set_up_s: f64,
    /// From the segment's close to the worker's exit.
    worker_exit_s: f64,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    check(&args)?;
    let mut sizes = Vec::new();
    for &gib in &args.gib {
        let (populate_s, unmap_s, huge_page_bytes) =
            kernel_floor(gib).with_context(|| format!("the baseline of {gib} GiB"))?;
        let (worker_set_up_s, worker_exit_s) =
            worker_times(gib).with_context(|| format!("a worker over {gib} GiB"))?;
        sizes.push(SizeCase {
            tier_gib: gib,
            populate_s,
            unmap_s,
            huge_page_bytes,
            worker_set_up_s,
            worker_exit_s,
        });
    }
    let report = Report {
        bench: "tier",
        baseline:
            "one process: MADV_POPULATE_WRITE of a posix_fallocate'd shared-memory object of \
                   the same size, then munmap",
        sizes,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{:>8} {:>11} {:>9} {:>10} {:>12} {:>11}",
            "tier GiB", "populate s", "unmap s", "huge MiB", "worker up s", "worker exit s"
        );
        for case in &report.sizes {
            println!(
                "{:>8} {:>11.3} {:>9.3} {:>10} {:>12.3} {:>11.3}",
                case.tier_gib,
                case.populate_s,
                case.unmap_s,
                case.huge_page_bytes >> 20,
                case.worker_set_up_s,
                case.worker_exit_s
            );
        }
    }
    Ok(())
}

fn check(args: &Args) -> anyhow::Result<()> {
    use kvshm::cli::checks::{at_least, fits_in_dev_shm, fits_in_memory, within};
    at_least(args.gib.len(), 1, "--gib")?;
    for &gib in &args.gib {
        within(gib, 1..=1024, "--gib")?;
        // The baseline's object and the service's tier exist one after the other, never at once.
        let bytes = u128::from(gib) * u128::from(GIB);
        fits_in_dev_shm(bytes, format_args!("--gib {gib}"))?;
        fits_in_memory(bytes, format_args!("--gib {gib}"))?;
    }
    Ok(())
}

/// Step 1 of the module flow: (populate seconds, unmap seconds, huge-page bytes).
fn kernel_floor(gib: u32) -> anyhow::Result<(f64, f64, u64)> {
    let object = format!("/kvshm-bench-tier.{}", std::process::id());
    let len = usize::try_from(u64::from(gib) * GIB)?;
    let memory = SharedMemory::create(&object, len)?;
    shm::unlink(&object)?;
    // SAFETY: the mapping lives until `memory` drops below, after the last use of the area; no
    // other process knows the unlinked object.
    let area = unsafe { MappedArea::new(memory.as_ptr(), memory.len()) }
        .expect("a mapping is never at null");
    let started = Instant::now();
    let populated = populate(area, || Ok::<(), std::convert::Infallible>(()));
    let populate_s = started.elapsed().as_secs_f64();
    if let Ok(Populated::Partly { errno, .. }) = populated {
        bail!(
            "the kernel refused MADV_POPULATE_WRITE: {}",
            std::io::Error::from_raw_os_error(errno)
        );
    }
    let huge_page_bytes = huge_page_kib(memory.as_ptr()).unwrap_or(0) * 1024;
    let started = Instant::now();
    drop(memory);
    Ok((populate_s, started.elapsed().as_secs_f64(), huge_page_bytes))
}

/// `ShmemPmdMapped` of this process's mapping that starts at `base`, in KiB.
fn huge_page_kib(base: *mut u8) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let start = format!("{:x}-", base as usize);
    let mut lines = smaps.lines().skip_while(|line| !line.starts_with(&start)).skip(1);
    let line = lines.find(|line| line.starts_with("ShmemPmdMapped:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Steps 2 and 3 of the module flow: (set-up seconds, exit seconds).
fn worker_times(gib: u32) -> anyhow::Result<(f64, f64)> {
    let name = SegmentName::new(&format!("bench-tier-{}-{gib}", std::process::id()))?;
    let host_blocks = u32::try_from(u64::from(gib) * GIB / (2 * REGION_BYTES))?;
    let cache = CacheConfig::new(16, 16).with_host_blocks(host_blocks);
    let mut service = Service::create(&name, ServiceConfig::new(cache, 1, 1, 2, REGION_BYTES))?;
    let exe = std::env::current_exe().context("locating the kvshm executable")?;
    let started = Instant::now();
    let mut worker = Command::new(exe)
        .args(["worker", "--name", name.as_str(), "--rank", "0"])
        .stdin(Stdio::null())
        .spawn()
        .context("spawning the worker")?;
    while service.poll_workers().is_some() {
        if let Some(status) = worker.try_wait()? {
            bail!("the worker exited before it came up ({status}): fenced, or it failed to start");
        }
        if started.elapsed() > PATIENCE {
            let _ = worker.kill();
            let _ = worker.wait();
            bail!("the worker did not come up within {PATIENCE:?}");
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let set_up_s = started.elapsed().as_secs_f64();
    let closed = Instant::now();
    drop(service);
    while worker.try_wait()?.is_none() {
        if closed.elapsed() > PATIENCE {
            let _ = worker.kill();
            let _ = worker.wait();
            bail!("the worker did not exit {PATIENCE:?} after its segment closed");
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok((set_up_s, closed.elapsed().as_secs_f64()))
}
