//! The `kvshm` binary: the demo, the worker process, trace replay and benchmarks.
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
    Demo(cli::demo::Args),
    /// Run the copy worker of one tensor-parallel rank of a segment.
    Worker(cli::worker::Args),
    /// Replay a Mooncake-format trace through the scheduler and print hit rates.
    Replay(cli::replay::Args),
    /// Benchmarks that print one JSON object with a baseline measured in the same run.
    #[command(subcommand)]
    Bench(Bench),
}

#[derive(Debug, Subcommand)]
enum Bench {
    /// Command-to-completion round trips and streaming rate of the rings, against a pipe.
    Ring(cli::bench_ring::Args),
    /// Host-backend swap bandwidth against a plain memcpy.
    Copy(cli::bench_copy::Args),
    /// Scheduler operations with one million cached blocks.
    Sched(cli::bench_sched::Args),
    /// Storage tier (disk, Redis) bandwidth against plain pwrite/pread and SET/GET.
    Storage(cli::bench_storage::Args),
    /// Chained block hashing of the trace's prompts, against XXH3 and vLLM's hasher.
    Hash(cli::bench_hash::Args),
    /// A worker's set-up and exit against the size of its host tier, against the kernel's own
    /// mapping and unmapping of the same bytes.
    Tier(cli::bench_tier::Args),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Demo(args) => cli::demo::run(args),
        Command::Worker(args) => cli::worker::run(args),
        Command::Replay(args) => cli::replay::run(args),
        Command::Bench(Bench::Ring(args)) => cli::bench_ring::run(args),
        Command::Bench(Bench::Copy(args)) => cli::bench_copy::run(args),
        Command::Bench(Bench::Sched(args)) => cli::bench_sched::run(args),
        Command::Bench(Bench::Storage(args)) => cli::bench_storage::run(args),
        Command::Bench(Bench::Hash(args)) => cli::bench_hash::run(args),
        Command::Bench(Bench::Tier(args)) => cli::bench_tier::run(args),
    }
}
