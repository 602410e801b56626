//! kvctl as a person runs it: the real binary against real objects under `/dev/shm`.
//!
//! - `arguments`: absurd timeouts and depths on the command line.
//! - `broken`: garbage under our prefix, a truncated segment, a missing one, a stale one, a foreign
//!   one and orphaned data objects; what `ls`, `stat` and `cleanup` make of each.
//! - `live`: a live segment created by the test process, whose scheduler never polls: `stat`,
//!   `--prometheus`, `workers`, timeouts of `tree` and `reset`, and `cleanup` leaving it alone.
//! - `service`: a live `kvshm::service::Service` in the test process, polled while kvctl runs:
//!   `stat`, `--prometheus`, `tree`, and `reset` refused and then forced.
//! - `tier`: a live shared tier (its owner served by the test) and a client holding pins and
//!   pending stores: `tier` lists them, and no longer lists the client once it detached.
//! - `planted`: FIFOs, links, other users' objects and huge sparse files under our prefix: `ls` and
//!   `cleanup` never hang, never follow, never remove what is not ours.
mod arguments;
mod broken;
mod live;
mod planted;
mod service;
mod storage;
mod support;
mod tier;
