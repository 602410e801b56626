//! `kvshm worker`: the copy worker of one tensor-parallel rank of a segment.
//!
//! Parses the options into [`WorkerOptions`], runs [`run_worker`], and turns its ending into an
//! exit status: 0 when stopped by SIGTERM/SIGINT or when the scheduler is gone, non-zero (with the
//! error's message) when the worker cannot start, loses its rank or finds its command ring broken.
//!
//! Test hook: the environment variable [`LAYER_DELAY_ENV`] (`KVSHM_WORKER_LAYER_DELAY_US`) makes
//! the worker sleep that many microseconds after each layer of each copy, so that tests can kill it
//! in the middle of a copy. It is meant for tests only.

use std::time::Duration;

use anyhow::Context;
use kvshm_ipc::name::SegmentName;

use super::checks;
use crate::worker::process::{run_worker, BackendChoice, WorkerOptions};
use crate::worker::run::{ServeExit, ServeOptions, DEFAULT_MAX_BATCH};

/// The test hook's environment variable (module documentation).
pub const LAYER_DELAY_ENV: &str = "KVSHM_WORKER_LAYER_DELAY_US";

#[derive(Debug, clap::Args)]
#[command(after_help = "Test hook: KVSHM_WORKER_LAYER_DELAY_US=N sleeps N microseconds after \
    each layer of each copy, so that a test can kill the worker in the middle of a copy. Not for \
    production use.")]
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
    /// Seconds to keep retrying while the segment does not exist yet or the rank still belongs to
    /// a dead worker the scheduler has not reclaimed.
    #[arg(long, default_value_t = 10.0)]
    attach_timeout: f64,
    /// Seconds a cuda worker waits for the engine to publish its device handles.
    #[arg(long, default_value_t = 300.0)]
    handles_timeout: f64,
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
        serve: ServeOptions { max_batch: DEFAULT_MAX_BATCH, layer_delay: layer_delay()? },
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

fn layer_delay() -> anyhow::Result<Option<Duration>> {
    match std::env::var(LAYER_DELAY_ENV) {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(error) => Err(error).context(LAYER_DELAY_ENV),
        Ok(text) => {
            let micros: u64 = text.trim().parse().with_context(|| {
                format!("{LAYER_DELAY_ENV} must be a whole number of microseconds, not {text:?}")
            })?;
            Ok((micros > 0).then(|| Duration::from_micros(micros)))
        }
    }
}
