//! `kvshm bench tier`: how a worker's set-up and exit grow with the size of its host tier, in huge
//! pages where the kernel gives them (what kvshm does) against small pages only (the baseline),
//! measured in the same run.
//!
//! For each `--gib` size and each of `--runs` runs, one case after the other (never two tiers at
//! once), the baseline first:
//! 1. small pages: huge pages turned off for this process and the processes it starts
//!    ([`huge_pages::refuse_in_this_process`]), as on a system without them; then, as for every
//!    case:
//! 2. a service of one rank with a host tier of that size: the time to create it (the scheduler
//!    backs the tier here);
//! 3. a `kvshm worker` process: the time from its spawn to the rank serving (the worker maps the
//!    tier in), and the bytes of its mapping of the tier that huge pages back (its `smaps`);
//! 4. the service dropped (the segment closed): the time until the worker process has exited;
//! 5. huge pages: the same with huge pages allowed again (what the kernel gives).
//!
//! One JSON object (`--json`) or a table.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvshm_ipc::huge_pages::{self, Settings};
use kvshm_ipc::name::SegmentName;
use serde::Serialize;

use kvshm::manager::CacheConfig;
use kvshm::service::{Service, ServiceConfig};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Host tier sizes to measure, in GiB, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1u32, 4])]
    gib: Vec<u32>,
    /// Runs of each size and case, interleaved.
    #[arg(long, default_value_t = 1)]
    runs: u32,
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
    /// What this machine says about huge pages ([`Settings`]).
    system: String,
    cases: Vec<Case>,
}

#[derive(Debug, Serialize)]
struct Case {
    tier_gib: u32,
    run: u32,
    /// "small" (the baseline) or "huge".
    pages: &'static str,
    /// Creating the service, host tier backed.
    create_s: f64,
    /// From the worker's spawn to its rank serving.
    worker_set_up_s: f64,
    /// From the segment's close to the worker's exit.
    worker_exit_s: f64,
    /// Bytes of the worker's mapping of the host tier that huge pages back.
    huge_page_bytes: u64,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    check(&args)?;
    let mut cases = Vec::new();
    for run in 0..args.runs {
        for &gib in &args.gib {
            for pages in ["small", "huge"] {
                huge_pages::refuse_in_this_process(pages == "small")
                    .context("turning huge pages off or on for this process")?;
                let case = one_case(gib, run, pages)
                    .with_context(|| format!("a worker over {gib} GiB in {pages} pages"));
                huge_pages::refuse_in_this_process(false).context("allowing huge pages again")?;
                cases.push(case?);
            }
        }
    }
    let report = Report {
        bench: "tier",
        baseline: "pages: small, the same service and worker with huge pages turned off \
                   (prctl PR_SET_THP_DISABLE), as on a system without them",
        system: Settings::read().to_string(),
        cases,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{}", report.system);
        println!(
            "{:>8} {:>5} {:>9} {:>12} {:>12} {:>9}",
            "tier GiB", "pages", "create s", "worker up s", "worker exit s", "huge MiB"
        );
        for case in &report.cases {
            println!(
                "{:>8} {:>5} {:>9.3} {:>12.3} {:>12.3} {:>9}",
                case.tier_gib,
                case.pages,
                case.create_s,
                case.worker_set_up_s,
                case.worker_exit_s,
                case.huge_page_bytes >> 20
            );
        }
    }
    Ok(())
}

fn check(args: &Args) -> anyhow::Result<()> {
    use kvshm::cli::checks::{at_least, fits_in_dev_shm, fits_in_memory, within};
    at_least(args.gib.len(), 1, "--gib")?;
    within(args.runs, 1..=100, "--runs")?;
    for &gib in &args.gib {
        within(gib, 1..=1024, "--gib")?;
        // One tier exists at a time.
        let bytes = u128::from(gib) * u128::from(GIB);
        fits_in_dev_shm(bytes, format_args!("--gib {gib}"))?;
        fits_in_memory(bytes, format_args!("--gib {gib}"))?;
    }
    Ok(())
}

/// Steps 2 to 4 of the module flow.
fn one_case(gib: u32, run: u32, pages: &'static str) -> anyhow::Result<Case> {
    let name = SegmentName::new(&format!("bench-tier-{}-{gib}", std::process::id()))?;
    let host_blocks = u32::try_from(u64::from(gib) * GIB / (2 * REGION_BYTES))?;
    let cache = CacheConfig::new(16, 16).with_host_blocks(host_blocks);
    let started = Instant::now();
    let mut service = Service::create(&name, ServiceConfig::new(cache, 1, 1, 2, REGION_BYTES))?;
    let create_s = started.elapsed().as_secs_f64();
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
    let worker_set_up_s = started.elapsed().as_secs_f64();
    let tier_path = format!("/dev/shm{}", name.host_tier_object(0));
    let huge_page_bytes = huge_pages::mapped_huge_bytes_of(worker.id(), &tier_path).unwrap_or(0);
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
    let worker_exit_s = closed.elapsed().as_secs_f64();
    Ok(Case {
        tier_gib: gib,
        run,
        pages,
        create_s,
        worker_set_up_s,
        worker_exit_s,
        huge_page_bytes,
    })
}
