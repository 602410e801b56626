//! Reading Mooncake-format request traces.
//!
//! A trace is JSON lines, one request each: `timestamp` (ms), `input_length` and `output_length`
//! (tokens) and `hash_ids`: one id per block of the prompt, the last possibly partial, where
//! equal ids at equal positions mean equal prefixes. Core type: [`TraceRequest`].
//!
//! Reading ([`read_trace`]): 1. open the file; 2. parse each non-empty line, naming the line of a
//! bad one; 3. refuse a request longer than [`MAX_REQUEST_TOKENS`] (lengths near 2^64 would wrap
//! in the arithmetic of replay and the demo); 4. stop after `limit` requests when given.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::hash::BlockHash;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct TraceRequest {
    #[serde(default)]
    pub timestamp: u64,
    pub input_length: usize,
    pub output_length: usize,
    pub hash_ids: Vec<u64>,
}

impl TraceRequest {
    /// The hashes of the prompt's full blocks of `block_tokens` tokens, the only blocks an engine
    /// caches: the first `input_length / block_tokens` ids (the trace names a trailing partial
    /// block too, which is left out). A trace id names a whole prefix already (equal ids at equal
    /// positions mean equal prefixes), so no chaining is needed; each id is spread over 128 bits
    /// ([`trace_block_hash`]) so that trace blocks look and index like real block hashes.
    pub fn full_block_hashes(
        &self,
        block_tokens: usize,
    ) -> impl ExactSizeIterator<Item = BlockHash> + '_ {
        let full = (self.input_length / block_tokens).min(self.hash_ids.len());
        self.hash_ids[..full].iter().map(|&id| trace_block_hash(id))
    }
}

/// Seed of [`trace_block_hash`]: "kvshm trace ids", fixed forever (replays must stay comparable).
const TRACE_HASH_SEED: u64 = 0x6b76_7368_6d5f_7472;

/// The block hash standing for trace id `id`: XXH3-128 of its little-endian bytes, with a seed
/// of our own.
pub fn trace_block_hash(id: u64) -> BlockHash {
    BlockHash(xxhash_rust::xxh3::xxh3_128_with_seed(&id.to_le_bytes(), TRACE_HASH_SEED))
}

/// The longest prompt or output a trace request may have, in tokens: far beyond any model's
/// context, and small enough that no sum of two lengths overflows.
pub const MAX_REQUEST_TOKENS: usize = u32::MAX as usize;

/// A trace that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("cannot read trace {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("trace {path}, line {line}: {source}")]
    Parse { path: PathBuf, line: usize, source: serde_json::Error },
    #[error("trace {path}, line {line}: {field} {value} is more than the {max} tokens a request may have")]
    TooLong { path: PathBuf, line: usize, field: &'static str, value: usize, max: usize },
}

impl TraceRequest {
    /// The first length field above [`MAX_REQUEST_TOKENS`], with its value.
    fn too_long(&self) -> Option<(&'static str, usize)> {
        [("input_length", self.input_length), ("output_length", self.output_length)]
            .into_iter()
            .find(|&(_, value)| value > MAX_REQUEST_TOKENS)
    }
}

/// Reads the requests of a trace, at most `limit` of them when given.
pub fn read_trace(path: &Path, limit: Option<usize>) -> Result<Vec<TraceRequest>, TraceError> {
    let io = |source| TraceError::Io { path: path.to_owned(), source };
    let reader = BufReader::new(File::open(path).map_err(io)?);
    let mut requests = Vec::new();
    for (index, line) in reader.lines().enumerate() {
        if limit.is_some_and(|limit| requests.len() >= limit) {
            break;
        }
        let line = line.map_err(io)?;
        if line.trim().is_empty() {
            continue;
        }
        let request: TraceRequest = serde_json::from_str(&line).map_err(|source| {
            TraceError::Parse { path: path.to_owned(), line: index + 1, source }
        })?;
        if let Some((field, value)) = request.too_long() {
            return Err(TraceError::TooLong {
                path: path.to_owned(),
                line: index + 1,
                field,
                value,
                max: MAX_REQUEST_TOKENS,
            });
        }
        requests.push(request);
    }
    Ok(requests)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, text: &str) -> PathBuf {
        let path =
            std::env::temp_dir().join(format!("kvshm-trace-{}-{name}.jsonl", std::process::id()));
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn a_trace_is_read_up_to_the_limit() {
        let line =
            r#"{"timestamp": 3, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]}"#;
        let path = write("limit", &format!("{line}\n\n{line}\n{line}\n"));
        let requests = read_trace(&path, Some(2)).unwrap();
        assert_eq!(requests.len(), 2);
        assert_eq!(
            requests[0],
            TraceRequest {
                timestamp: 3,
                input_length: 700,
                output_length: 5,
                hash_ids: vec![0, 1]
            }
        );
        assert_eq!(read_trace(&path, None).unwrap().len(), 3);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn trace_ids_map_to_distinct_spread_hashes() {
        let hashes: Vec<BlockHash> = (0..1000).map(trace_block_hash).collect();
        let distinct: std::collections::HashSet<_> = hashes.iter().collect();
        assert_eq!(distinct.len(), hashes.len());
        assert_eq!(trace_block_hash(7), trace_block_hash(7));
        assert!(hashes.iter().filter(|hash| hash.0 >> 64 == 0).count() < 2, "high bits are used");
    }

    #[test]
    fn a_trailing_partial_block_is_not_a_block() {
        let request = TraceRequest {
            timestamp: 0,
            input_length: 1100,
            output_length: 1,
            hash_ids: vec![4, 5, 6],
        };
        let hashes: Vec<BlockHash> = request.full_block_hashes(512).collect();
        assert_eq!(hashes, vec![trace_block_hash(4), trace_block_hash(5)]);
        let aligned = TraceRequest { input_length: 1536, ..request };
        assert_eq!(aligned.full_block_hashes(512).len(), 3);
    }

    #[test]
    fn a_bad_line_is_named() {
        let path = write(
            "bad",
            "{\"input_length\": 1, \"output_length\": 1, \"hash_ids\": []}\nnot json\n",
        );
        let error = read_trace(&path, None).unwrap_err();
        assert!(matches!(error, TraceError::Parse { line: 2, .. }), "{error}");
        std::fs::remove_file(path).unwrap();
    }
}
