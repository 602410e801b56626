//! The support `tests/replay_figures.rs` includes under this name (that test stays as it is):
//! the Mooncake trace's path, from `tests/support/`, which every other test binary includes.

#[path = "../support/traces.rs"]
mod traces;

pub use traces::mooncake_trace;
