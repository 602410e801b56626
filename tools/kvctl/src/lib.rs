//! kvctl: inspect and operate kvshm segments from any shell on the host (DESIGN §5.7).
//!
//! kvctl never stops the scheduler and never writes cache state. It reads what the segment
//! publishes (header, live counters, worker slots) and leaves requests in the segment's control
//! area (reset, tree snapshot) that the scheduler carries out in its `poll()`.
//!
//! - [`cli`]: the command line and the dispatch of one command to its report.
//! - [`listing`]: `ls`, every kvshm object under `/dev/shm` judged live, stale, unreadable or
//!   orphaned.
//! - [`cleanup`]: `cleanup`, removing stale segments, garbage and orphaned data objects.
//! - [`stat`]: `stat`, configuration, scheduler liveness, live counters and hit rates.
//! - [`prometheus`]: `stat --prometheus`, the same figures in the text exposition format.
//! - [`workers`]: `workers`, one row per rank with its liveness judgement.
//! - [`tree`]: `tree`, the scheduler's snapshot of the radix tree.
//! - [`tier`]: `tier`, a shared host tier's owner and clients (pins, pending stores).
//! - [`reset`]: `reset`, asking the scheduler to empty the cache.
//! - [`open`]: attaching to a segment by name, with errors that say what to do.
//! - [`probe`]: reading a control object's header bytes without attaching, to name what is wrong.
//! - [`error`]: [`KvctlError`], the failures a command reports.
//! - [`text`]: human formatting helpers (sizes, ages, tables).
//!
//! One command, e.g. `kvctl stat NAME --json`:
//! 1. [`cli::Cli`] parses the arguments; [`cli::run`] validates the name;
//! 2. [`open::open_segment`] attaches and turns attach failures into actionable errors;
//! 3. the command module builds its report from the segment (a plain serializable struct);
//! 4. the report is written as one JSON document, as text, or as Prometheus exposition.

pub mod cleanup;
pub mod cli;
pub mod error;
pub mod listing;
pub mod open;
pub mod probe;
pub mod prometheus;
pub mod reset;
pub mod stat;
pub mod text;
pub mod tier;
pub mod tree;
pub mod workers;

pub use cli::{run, Cli};
pub use error::KvctlError;
