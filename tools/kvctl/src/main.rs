//! The `kvctl` binary: parses the command line and hands it to the library ([`kvctl::run`]).
use std::io::{BufWriter, Write};
use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = kvctl::Cli::parse();
    let mut out = BufWriter::new(std::io::stdout().lock());
    let result = kvctl::run(&cli, &mut out).and_then(|()| Ok(out.flush()?));
    // Whatever was written before a failure (a refused reset's report) still goes out.
    let flushed = out.flush();
    match result {
        Ok(()) if flushed.is_ok() => ExitCode::SUCCESS,
        Err(error) if error.is_broken_pipe() => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("kvctl: {error}");
            ExitCode::FAILURE
        }
        Ok(()) => ExitCode::FAILURE,
    }
}
