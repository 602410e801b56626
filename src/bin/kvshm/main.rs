//! The `kvshm` binary: the demo, the worker process, a shared tier's owner, trace replay and
//! benchmarks.
//!
//! `main` parses the command line and dispatches. The worker process, the trace replay and the
//! scheduler benchmark are library code ([`kvshm::cli`]: the Python package, the tests and
//! `cargo bench` run them too); the demo ([`demo`]) and the other benchmarks ([`bench`]) live
//! here, one module each.

mod bench;
mod demo;

use clap::{Parser, Subcommand};
use kvshm::cli;

#[derive(Debug, Parser)]
#[command(name = "kvshm", version, about = "KV-cache manager: demo, worker, replay and benchmarks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Play an engine: a service, TP worker processes and a trace replayed with real data.
    Demo(demo::Args),
    /// Run the copy worker of one tensor-parallel rank of a segment.
    Worker(cli::worker::Args),
    /// Replay a Mooncake-format trace through the scheduler and print hit rates.
    Replay(cli::replay::Args),
    /// Own a host tier that several engine instances on this node share.
    TierOwner(cli::tier_owner::Args),
    /// Benchmarks that print one JSON object with a baseline measured in the same run.
    #[command(subcommand)]
    Bench(Bench),
}

#[derive(Debug, Subcommand)]
enum Bench {
    /// Command-to-completion round trips and streaming rate of the rings, against a pipe.
    Ring(bench::ring::Args),
    /// Host-backend swap bandwidth against a plain memcpy.
    Copy(bench::copy::Args),
    /// Scheduler operations with one million cached blocks.
    Sched(cli::bench_sched::Args),
    /// Storage tier (disk, Redis) bandwidth against plain pwrite/pread and SET/GET.
    Storage(bench::storage::Args),
    /// Chained block hashing of the trace's prompts, against XXH3 and vLLM's hasher.
    Hash(bench::hash::Args),
    /// A worker's set-up and exit against the size of its host tier, in huge pages against small
    /// pages only.
    Tier(bench::tier::Args),
    /// The host tier's index work per request: one index shared by every instance, against
    /// today's per-instance offload managers.
    SharedTier(bench::shared_tier::Args),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Demo(args) => demo::run(args),
        Command::Worker(args) => cli::worker::run(args),
        Command::Replay(args) => cli::replay::run(args),
        Command::TierOwner(args) => cli::tier_owner::run(args),
        Command::Bench(Bench::Ring(args)) => bench::ring::run(args),
        Command::Bench(Bench::Copy(args)) => bench::copy::run(args),
        Command::Bench(Bench::Sched(args)) => cli::bench_sched::run(args),
        Command::Bench(Bench::Storage(args)) => bench::storage::run(args),
        Command::Bench(Bench::Hash(args)) => bench::hash::run(args),
        Command::Bench(Bench::Tier(args)) => bench::tier::run(args),
        Command::Bench(Bench::SharedTier(args)) => bench::shared_tier::run(args),
    }
}
