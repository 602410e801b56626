//! The traces the repository carries in `traces/`.

use std::path::PathBuf;

/// The Mooncake conversation trace.
///
/// # Panics
/// When it is missing: the tests that need it must not pass without it.
pub fn mooncake_trace() -> PathBuf {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("traces/mooncake_conversation_trace.jsonl");
    assert!(path.is_file(), "the Mooncake trace is missing at {}", path.display());
    path
}
