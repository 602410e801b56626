//! `kvshm bench hash`: chained block hashing of the trace's prompts, against raw XXH3 of the
//! same bytes and, when a Python with vLLM is at hand, vLLM's own block hasher, in one run.
//!
//! [`measure`]:
//! 1. read the prompt lengths of the trace's requests; build one token sequence as long as the
//!    longest prompt (pseudo-random ids below 2^17, like a large vocabulary);
//! 2. for each request, in turn and interleaved so that the machine's load hits all alike, time:
//!    XXH3-128 of the raw bytes of each of its full blocks (the floor: the hash function reading
//!    the same bytes, block by block, with no chaining and no framing);
//!    [`BlockHasher::extend`] over the prompt (kvshm's keys); the same with one multimodal item
//!    spanning the prompt (one extra key per block);
//! 3. with a vLLM Python (`--vllm-python`, or `$KVSHM_VLLM_VENV/bin/python`), run
//!    `benches/vllm_block_hash.py` (compiled in) over the same prompt lengths: vLLM's request
//!    block hasher with its default `sha256` (pickle, then SHA-256), without and with a LoRA
//!    adapter (an extra key per block).
//!
//! Throughput is token bytes (4 per token, full blocks only) per second of hashing; times per
//! request are percentiles. Each request is hashed three times per method and the fastest time
//! kept (the machine is shared). The output is one JSON object with `--json`.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::Context;
use serde::Serialize;

use kvshm::hash::{BlockHash, BlockHasher, MultimodalItem, Namespace};
use kvshm::percentiles::Percentiles;
use kvshm::trace::read_trace;

/// vLLM's side, run by the Python of a venv with vLLM.
const VLLM_SCRIPT: &str = include_str!("../../../../benches/vllm_block_hash.py");

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The trace whose prompt lengths are hashed.
    #[arg(long, default_value = "traces/mooncake_conversation_trace.jsonl")]
    pub trace: PathBuf,
    /// Tokens per block.
    #[arg(long, default_value_t = 512)]
    pub block_tokens: usize,
    /// Hash only the first N requests.
    #[arg(long)]
    pub limit: Option<usize>,
    /// A Python interpreter with vLLM installed; defaults to `$KVSHM_VLLM_VENV/bin/python`.
    #[arg(long)]
    pub vllm_python: Option<PathBuf>,
    /// Print one JSON object instead of a summary.
    #[arg(long)]
    pub json: bool,
}

/// One way of hashing, over all requests.
#[derive(Debug, Clone, Serialize)]
pub struct HashFigures {
    /// Token bytes hashed per second of hashing, in GB/s.
    pub gb_per_s: f64,
    pub us_per_request: Percentiles,
}

/// vLLM's hasher, as the Python side reported it.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct VllmFigures {
    pub vllm_version: String,
    pub hash_algorithm: String,
    pub gb_per_s: f64,
    pub us_per_request: Percentiles,
    /// With a LoRA adapter: one extra key per block.
    pub extra_keys: VllmExtra,
}

#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct VllmExtra {
    pub gb_per_s: f64,
    pub us_per_request: Percentiles,
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct HashBenchReport {
    pub requests: usize,
    pub block_tokens: usize,
    /// Full blocks hashed per pass, and their token bytes.
    pub blocks: u64,
    pub bytes: u64,
    /// The floor: XXH3-128 of each full block's raw token bytes.
    pub xxh3_floor: HashFigures,
    /// kvshm's chained keys ([`BlockHasher`]).
    pub kvshm: HashFigures,
    /// kvshm's chained keys with one extra (multimodal) key per block.
    pub kvshm_extra_keys: HashFigures,
    /// Total hashing time of kvshm over that of the floor (the goal is at most 1.2).
    pub kvshm_over_xxh3: f64,
    pub kvshm_extra_keys_over_xxh3: f64,
    /// vLLM's default hasher in the same run, when a vLLM Python was at hand.
    pub vllm: Option<VllmFigures>,
    /// Why there is no vLLM figure, when there is none.
    pub vllm_missing: Option<String>,
    /// vLLM's total time over kvshm's, when measured.
    pub vllm_over_kvshm: Option<f64>,
}

/// A seeded xorshift64* generator for token ids.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// Times each request's hashing this many times and keeps the fastest: on a shared machine
/// the slower ones measure the neighbours.
const REPEATS: usize = 3;

/// Accumulates the times of one way of hashing.
#[derive(Default)]
struct Timing {
    micros: Vec<f64>,
    total_s: f64,
}

impl Timing {
    /// Runs `work` [`REPEATS`] times and records the fastest run.
    fn time<R>(&mut self, mut work: impl FnMut() -> R) {
        let mut fastest = f64::INFINITY;
        for _ in 0..REPEATS {
            let start = Instant::now();
            std::hint::black_box(work());
            fastest = fastest.min(start.elapsed().as_secs_f64());
        }
        self.total_s += fastest;
        self.micros.push(fastest * 1e6);
    }

    fn figures(mut self, bytes: u64) -> HashFigures {
        HashFigures {
            gb_per_s: bytes as f64 / self.total_s / 1e9,
            us_per_request: Percentiles::of(&mut self.micros),
        }
    }
}

/// Runs the benchmark over `prompts` (prompt lengths in tokens), module flow.
pub fn measure(
    prompts: &[usize],
    block_tokens: usize,
    vllm_python: Option<PathBuf>,
) -> anyhow::Result<HashBenchReport> {
    let hasher = BlockHasher::new(Namespace::new("bench", None, None), block_tokens)?;
    let longest = prompts.iter().copied().max().unwrap_or(0);
    let mut rng = Rng(0x7E57_AB1E_0000_0001);
    let tokens: Vec<u32> = (0..longest).map(|_| (rng.next() >> 47) as u32).collect();
    let blocks: u64 = prompts.iter().map(|&prompt| (prompt / block_tokens) as u64).sum();
    let bytes = blocks * block_tokens as u64 * 4;
    let mut hashes: Vec<BlockHash> = Vec::with_capacity(longest / block_tokens);
    let (mut floor, mut plain, mut extra) =
        (Timing::default(), Timing::default(), Timing::default());
    // Warm the caches and the branch predictors on the first requests, unmeasured.
    for pass in 0..2 {
        let measured = pass == 1;
        let requests = if measured { prompts } else { &prompts[..prompts.len().min(200)] };
        for &prompt in requests {
            let prompt_tokens = &tokens[..prompt];
            let full = prompt / block_tokens * block_tokens;
            let token_bytes: &[u8] = bytemuck::cast_slice(&prompt_tokens[..full]);
            let image = [MultimodalItem { start: 0, len: prompt, content_hash: 0xC0FFEE }];
            let mut run_floor = || {
                let mut all = 0u128;
                for block in token_bytes.chunks_exact(block_tokens * 4) {
                    all ^= xxhash_rust::xxh3::xxh3_128(block);
                }
                all
            };
            let mut run_kvshm = |items: &[MultimodalItem]| {
                hashes.clear();
                hasher.extend(&mut hashes, prompt_tokens, items);
                hashes.last().copied()
            };
            if measured {
                floor.time(&mut run_floor);
                plain.time(|| run_kvshm(&[]));
                extra.time(|| run_kvshm(&image));
            } else {
                std::hint::black_box((run_floor(), run_kvshm(&[]), run_kvshm(&image)));
            }
        }
    }
    let (floor_s, plain_s, extra_s) = (floor.total_s, plain.total_s, extra.total_s);
    let (vllm, vllm_missing) = match vllm_python.or_else(default_vllm_python) {
        Some(python) => match run_vllm(&python, prompts, block_tokens) {
            Ok(figures) => (Some(figures), None),
            Err(error) => (None, Some(format!("{}: {error:#}", python.display()))),
        },
        None => (None, Some("no --vllm-python and KVSHM_VLLM_VENV is not set".into())),
    };
    let kvshm = plain.figures(bytes);
    let vllm_over_kvshm = vllm.as_ref().map(|vllm| kvshm.gb_per_s / vllm.gb_per_s);
    Ok(HashBenchReport {
        requests: prompts.len(),
        block_tokens,
        blocks,
        bytes,
        xxh3_floor: floor.figures(bytes),
        kvshm,
        kvshm_extra_keys: extra.figures(bytes),
        kvshm_over_xxh3: plain_s / floor_s,
        kvshm_extra_keys_over_xxh3: extra_s / floor_s,
        vllm,
        vllm_missing,
        vllm_over_kvshm,
    })
}

fn default_vllm_python() -> Option<PathBuf> {
    let venv = std::env::var_os("KVSHM_VLLM_VENV")?;
    Some(PathBuf::from(venv).join("bin/python"))
}

/// Runs vLLM's side: the script reads the prompt lengths on stdin and prints one JSON object.
fn run_vllm(
    python: &PathBuf,
    prompts: &[usize],
    block_tokens: usize,
) -> anyhow::Result<VllmFigures> {
    let mut child = Command::new(python)
        .args(["-c", VLLM_SCRIPT, "--block-tokens", &block_tokens.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting the vLLM Python")?;
    let mut lengths = String::with_capacity(prompts.len() * 6);
    for prompt in prompts {
        lengths.push_str(&prompt.to_string());
        lengths.push('\n');
    }
    child
        .stdin
        .take()
        .expect("stdin was piped")
        .write_all(lengths.as_bytes())
        .context("sending the prompt lengths")?;
    let output = child.wait_with_output().context("waiting for the vLLM Python")?;
    anyhow::ensure!(
        output.status.success(),
        "the vLLM side failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr).lines().last().unwrap_or_default()
    );
    serde_json::from_slice(&output.stdout).context("reading the vLLM side's JSON")
}

pub fn run(args: Args) -> anyhow::Result<()> {
    // A block of more tokens than a prompt could ever hold measures nothing.
    kvshm::cli::checks::within(args.block_tokens, 1..=1 << 24, "--block-tokens")?;
    let requests = read_trace(&args.trace, args.limit)?;
    let prompts: Vec<usize> = requests.iter().map(|request| request.input_length).collect();
    let report = measure(&prompts, args.block_tokens, args.vllm_python)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    let line = |name: &str, figures: &HashFigures| {
        println!(
            "{name:<28} {:>7.2} GB/s   p50 {:>8.1} us   p99 {:>8.1} us",
            figures.gb_per_s, figures.us_per_request.p50, figures.us_per_request.p99
        )
    };
    println!(
        "{} requests, {} blocks of {} tokens ({:.1} MB)",
        report.requests,
        report.blocks,
        report.block_tokens,
        report.bytes as f64 / 1e6
    );
    line("XXH3-128 of the bytes", &report.xxh3_floor);
    line("kvshm chained keys", &report.kvshm);
    line("kvshm, one extra key/block", &report.kvshm_extra_keys);
    if let Some(vllm) = &report.vllm {
        let figures = HashFigures { gb_per_s: vllm.gb_per_s, us_per_request: vllm.us_per_request };
        line(&format!("vLLM {} {}", vllm.vllm_version, vllm.hash_algorithm), &figures);
    }
    if let Some(missing) = &report.vllm_missing {
        println!("vLLM not measured: {missing}");
    }
    println!("kvshm / XXH3 time: {:.2}", report.kvshm_over_xxh3);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_run_measures_every_hasher_and_says_why_vllm_is_missing() {
        let report =
            measure(&[100, 1_100, 2_048, 7], 512, Some("/nonexistent/python".into())).unwrap();
        assert_eq!((report.requests, report.blocks, report.bytes), (4, 6, 6 * 512 * 4));
        assert!(report.kvshm.gb_per_s > 0.0 && report.xxh3_floor.gb_per_s > 0.0);
        assert!(report.kvshm_over_xxh3 > 0.0);
        assert!(report.vllm.is_none());
        assert!(report.vllm_missing.unwrap().contains("/nonexistent/python"));
    }
}
