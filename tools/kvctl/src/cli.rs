//! kvctl's command line and the dispatch of one command to its report.
//!
//! Every command builds a plain report struct and writes it as text or, with `--json`, as one JSON
//! document on stdout (`stat` also as Prometheus exposition). Errors go back to `main` as a
//! [`KvctlError`], which prints them on stderr and exits non-zero. A command that produced a report
//! and still failed (a refused reset, an incomplete cleanup) writes the report first.

use std::io::Write;
use std::time::Duration;

use clap::{Parser, Subcommand};
use serde::Serialize;

use kvshm_ipc::config::SegmentConfig;
use kvshm_ipc::segment::Segment;

use crate::cleanup;
use crate::error::KvctlError;
use crate::listing;
use crate::open::{open_segment, parse_name};
use crate::prometheus;
use crate::reset;
use crate::stat::StatReport;
use crate::tier;
use crate::tree;
use crate::workers::WorkersReport;

/// The default wait for the scheduler to answer a request.
pub const DEFAULT_TIMEOUT: &str = "2s";

#[derive(Debug, Parser)]
#[command(name = "kvctl", version, about = "Inspect and operate kvshm segments")]
pub struct Cli {
    /// Print one JSON document on stdout instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    /// How long `tree` and `reset` wait for the scheduler: `2s`, `500ms`, `1.5` (seconds).
    #[arg(long, global = true, default_value = DEFAULT_TIMEOUT, value_parser = parse_timeout)]
    pub timeout: Duration,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// List every kvshm segment under /dev/shm: live, stale, unreadable or orphaned.
    Ls {
        /// Only these segments.
        names: Vec<String>,
    },
    /// A segment's configuration, scheduler liveness, live counters and hit rates.
    Stat {
        name: String,
        /// Print Prometheus text exposition instead.
        #[arg(long, conflicts_with = "json")]
        prometheus: bool,
    },
    /// Each rank's worker: state, pid, heartbeat age, attach count, alive or dead.
    Workers { name: String },
    /// A host tier several engines share: its owner, and each client with the chunks charged
    /// to it, its pins and its pending stores.
    Tier { name: String },
    /// The scheduler's prefix tree (asked for through the segment).
    Tree {
        name: String,
        /// Levels below the root to show (all when absent).
        #[arg(long)]
        depth: Option<u32>,
    },
    /// Ask the scheduler to drop every cached block and bump the generation.
    Reset {
        name: String,
        /// Reset even while requests hold blocks.
        #[arg(long)]
        force: bool,
    },
    /// Drop every block stored under a storage namespace (all ranks, all services using it): the
    /// disk tier's slabs and indexes (refused while a worker serves the namespace), or the
    /// namespace's Redis keys.
    ResetStorage {
        /// `disk:DIR` or `redis://HOST[:PORT][/DB]`, as the workers were given it.
        #[arg(required_unless_present = "storage_from_env", conflicts_with = "storage_from_env")]
        storage: Option<String>,
        /// Read the storage spec from `KVSHM_STORAGE` instead, as workers started with
        /// `--storage-from-env` do: a Redis URL with a password stays off the command line,
        /// which every user of the machine can read.
        #[arg(long)]
        storage_from_env: bool,
        /// The namespace to drop.
        #[arg(long, default_value = kvshm::storage::spec::DEFAULT_NAMESPACE)]
        namespace: String,
    },
    /// Remove stale segments, garbage under the kvshm prefix and orphaned data objects.
    Cleanup {
        /// Only these segments (all when none are named).
        names: Vec<String>,
        /// Say what would be removed without removing anything.
        #[arg(long)]
        dry_run: bool,
    },
}

/// Parses `2s`, `500ms`, `1.5s` or a bare number of seconds.
pub fn parse_timeout(text: &str) -> Result<Duration, String> {
    let (number, scale) = if let Some(number) = text.strip_suffix("ms") {
        (number, 1e-3)
    } else if let Some(number) = text.strip_suffix('s') {
        (number, 1.0)
    } else {
        (text, 1.0)
    };
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a duration like 2s or 500ms"))?;
    Duration::try_from_secs_f64(value * scale).map_err(|_| {
        format!("{text:?} is no duration kvctl can wait: it must be finite and not negative")
    })
}

/// Runs the command of `cli`, writing its output to `out`.
pub fn run(cli: &Cli, out: &mut dyn Write) -> Result<(), KvctlError> {
    match &cli.command {
        Command::Ls { names } => {
            let names = names.iter().map(|name| parse_name(name)).collect::<Result<Vec<_>, _>>()?;
            let listing = listing::list(&names);
            emit(cli, out, &listing, |out| listing.write_text(out))
        }
        Command::Stat { name, prometheus } => {
            let segment = open_segment(&parse_name(name)?)?;
            let report = StatReport::read(&segment);
            if *prometheus {
                Ok(prometheus::write(&report, out)?)
            } else {
                emit(cli, out, &report, |out| report.write_text(out))
            }
        }
        Command::Workers { name } => {
            let segment = open_segment(&parse_name(name)?)?;
            let report = WorkersReport::read(&segment);
            emit(cli, out, &report, |out| report.write_text(out))
        }
        Command::Tier { name } => {
            let tier = parse_name(name)?;
            let report = kvshm::offload::inspect_tier(&tier)
                .map_err(|source| KvctlError::Tier { tier: name.clone(), source })?;
            emit(cli, out, &report, |out| tier::write_text(&report, out))
        }
        Command::Tree { name, depth } => {
            let segment = open_segment(&parse_name(name)?)?;
            ensure_answers_control(&segment, "tree")?;
            let snapshot = tree::fetch(&segment, *depth, cli.timeout)?;
            if cli.json {
                Ok(snapshot.write_json(out)?)
            } else {
                Ok(snapshot.write_text(out)?)
            }
        }
        Command::Reset { name, force } => {
            let segment = open_segment(&parse_name(name)?)?;
            ensure_answers_control(&segment, "reset")?;
            let report = reset::reset(&segment, *force, cli.timeout)?;
            emit(cli, out, &report, |out| report.write_text(out))?;
            report.ensure_done()
        }
        Command::ResetStorage { storage, storage_from_env, namespace } => {
            use kvshm::storage::spec::{spec_given, StorageNamespace, StorageSpec};
            let storage = spec_given(storage.as_deref(), *storage_from_env)
                .map_err(|error| KvctlError::Storage(error.to_string()))?
                .expect("clap requires a spec or --storage-from-env");
            let spec: StorageSpec =
                storage.parse().map_err(|error| KvctlError::Storage(format!("{error}")))?;
            let namespace = StorageNamespace::new(namespace)
                .map_err(|error| KvctlError::Storage(format!("{error}")))?;
            let report = kvshm::storage::drop::drop_namespace(&spec, &namespace, cli.timeout)
                .map_err(|error| KvctlError::Storage(error.to_string()))?;
            emit(cli, out, &report, |out| {
                if report.files == 0 && report.keys == 0 {
                    return writeln!(
                        out,
                        "nothing was stored under namespace {} of {}: nothing dropped",
                        report.namespace, report.storage
                    );
                }
                writeln!(
                    out,
                    "storage namespace {} of {} dropped: {} files ({} bytes), {} keys",
                    report.namespace, report.storage, report.files, report.bytes, report.keys
                )
            })
        }
        Command::Cleanup { names, dry_run } => {
            let names = names.iter().map(|name| parse_name(name)).collect::<Result<Vec<_>, _>>()?;
            let report = cleanup::cleanup(&names, *dry_run);
            emit(cli, out, &report, |out| report.write_text(out))?;
            match report.failed.len() {
                0 => Ok(()),
                count => Err(KvctlError::CleanupIncomplete { count }),
            }
        }
    }
}

/// Writes `report` as pretty JSON with `--json`, else through `text`.
fn emit<T: Serialize>(
    cli: &Cli,
    out: &mut dyn Write,
    report: &T,
    text: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<(), KvctlError> {
    if cli.json {
        serde_json::to_writer_pretty(&mut *out, report).map_err(std::io::Error::from)?;
        writeln!(out)?;
    } else {
        text(out)?;
    }
    Ok(())
}

/// Refuses `command` (one that asks the scheduler through the control area) on an engine's host
/// tier: its engine keeps its own cache and answers no control request, so kvctl would wait for
/// nothing and leave a request no one carries out.
fn ensure_answers_control(segment: &Segment, command: &'static str) -> Result<(), KvctlError> {
    if segment.config().kind == SegmentConfig::KIND_ENGINE_HOST_TIER {
        return Err(KvctlError::NoScheduler { segment: segment.name().to_string(), command });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_accept_seconds_and_milliseconds() {
        assert_eq!(parse_timeout("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_timeout("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_timeout("1.5"), Ok(Duration::from_millis(1500)));
        assert!(parse_timeout("soon").is_err());
        assert!(parse_timeout("-1s").is_err());
    }

    #[test]
    fn json_and_timeout_are_accepted_after_the_subcommand() {
        let cli =
            Cli::try_parse_from(["kvctl", "tree", "seg", "--json", "--timeout", "250ms"]).unwrap();
        assert!(cli.json);
        assert_eq!(cli.timeout, Duration::from_millis(250));
        assert!(matches!(cli.command, Command::Tree { depth: None, .. }));
    }

    #[test]
    fn prometheus_and_json_exclude_each_other() {
        assert!(Cli::try_parse_from(["kvctl", "stat", "seg", "--prometheus", "--json"]).is_err());
    }
}
