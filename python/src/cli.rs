//! The command-line tools inside the extension, so that the wheel needs no separate binaries:
//! `python -m kvshm worker ...` runs the copy worker of one rank in this process,
//! `python -m kvshm tier-owner ...` the owner of a shared host tier, and `python -m kvshm kvctl
//! ...` the operator tool. Both parse their arguments with the same
//! definitions as the `kvshm` and `kvctl` binaries.

use std::io::Write;

use clap::Parser;
use pyo3::prelude::*;

/// `kvshm worker`'s arguments, as the binary parses them.
#[derive(Debug, Parser)]
#[command(
    name = "python -m kvshm worker",
    bin_name = "python -m kvshm worker",
    about = "Run the copy worker of one rank of a segment"
)]
struct WorkerCli {
    #[command(flatten)]
    args: kvshm::cli::worker::Args,
}

/// Prints clap's message (help or usage error) and returns the exit status it asks for.
fn clap_exit(error: clap::Error) -> i32 {
    let _ = error.print();
    error.exit_code()
}

/// Runs the copy worker until it stops (GIL released); returns the process exit status.
#[pyfunction]
pub fn run_worker(py: Python<'_>, argv: Vec<String>) -> i32 {
    let cli = match WorkerCli::try_parse_from(std::iter::once("worker".to_owned()).chain(argv)) {
        Ok(cli) => cli,
        Err(error) => return clap_exit(error),
    };
    match py.detach(|| kvshm::cli::worker::run(cli.args)) {
        Ok(()) => 0,
        Err(error) => {
            eprintln!("kvshm worker: {error:#}");
            1
        }
    }
}

/// `kvshm tier-owner`'s arguments, as the binary parses them.
#[derive(Debug, Parser)]
#[command(
    name = "python -m kvshm tier-owner",
    bin_name = "python -m kvshm tier-owner",
    about = "Run the owner of a host tier several engines share"
)]
struct TierOwnerCli {
    #[command(flatten)]
    args: kvshm::cli::tier_owner::Args,
}

/// Runs a shared tier's owner until it stops (GIL released); returns the process exit status.
#[pyfunction]
pub fn run_tier_owner(py: Python<'_>, argv: Vec<String>) -> i32 {
    let cli =
        match TierOwnerCli::try_parse_from(std::iter::once("tier-owner".to_owned()).chain(argv)) {
            Ok(cli) => cli,
            Err(error) => return clap_exit(error),
        };
    match py.detach(|| kvshm::cli::tier_owner::run(cli.args)) {
        Ok(()) => 0,
        Err(error) => {
            eprintln!("kvshm tier-owner: {error:#}");
            1
        }
    }
}

/// Runs `kvctl` with `argv`; returns the process exit status.
#[pyfunction]
pub fn run_kvctl(py: Python<'_>, argv: Vec<String>) -> i32 {
    let program = "python -m kvshm kvctl".to_owned();
    let cli = match kvctl::Cli::try_parse_from(std::iter::once(program).chain(argv)) {
        Ok(cli) => cli,
        Err(error) => return clap_exit(error),
    };
    py.detach(|| {
        let mut out = std::io::BufWriter::new(std::io::stdout().lock());
        let result = kvctl::run(&cli, &mut out);
        let flushed = out.flush();
        match result {
            Ok(()) if flushed.is_ok() => 0,
            Err(error) if error.is_broken_pipe() => 1,
            Err(error) => {
                eprintln!("kvctl: {error}");
                1
            }
            Ok(()) => 1,
        }
    })
}
