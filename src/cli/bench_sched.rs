//! `kvshm bench sched`: the scheduler's operations with a million cached blocks, against a plain
//! hash map lookup of the same hashes measured in the same run, and the memory per cached block.
//!
//! [`measure`] (shared with `benches/scheduler.rs`):
//! 1. fill a device-only cache with `cached_blocks` blocks: paths of `request_blocks` random
//!    hashes, each matched, allocated, committed and finished; the heap grown by that, divided by
//!    the blocks, is the memory per cached block (measured by the caller's heap probe: glibc's
//!    `mallinfo2` here, a counting global allocator in the bench binary);
//! 2. match (all blocks hit), lookup and finish of random cached paths, and `HashMap<u128, u32>`
//!    gets of the same hashes, SipHash-hashed and multiply-hashed (the baselines; the second is a
//!    plain probe of each key, the one the operations are compared with);
//! 3. requests that hit half of a cached path and allocate and commit the other half, while free
//!    blocks last (the pool has exactly that much headroom);
//! 4. the same at capacity, where every allocation evicts as many least recently used blocks.
//!
//! Times are per block (and per operation for match), as 50th and 99th percentiles over the
//! samples. The output is one JSON object with `--json`.

use std::collections::HashMap;
use std::hint::black_box;
use std::time::Instant;

use serde::Serialize;

use crate::hash::BlockHash;
use crate::manager::ids::IdMap;
use crate::manager::{CacheConfig, CacheManager, EvictionPolicy, RequestId};
use crate::percentiles::Percentiles;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print one JSON object instead of a summary.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub options: BenchOptions,
}

/// The sizes of one run.
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct BenchOptions {
    /// Blocks cached before measuring.
    #[arg(long, default_value_t = 1_000_000)]
    pub cached_blocks: usize,
    /// Blocks per request (prompt length).
    #[arg(long, default_value_t = 64)]
    pub request_blocks: usize,
    /// Requests measured per phase.
    #[arg(long, default_value_t = 5_000)]
    pub samples: usize,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    pub block_tokens: u32,
    /// The eviction policy of the cache (an online one).
    #[arg(long, default_value_t = EvictionPolicy::default())]
    pub eviction: EvictionPolicy,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            cached_blocks: 1_000_000,
            request_blocks: 64,
            samples: 5_000,
            block_tokens: 16,
            eviction: EvictionPolicy::default(),
        }
    }
}

/// The most blocks a pool of u32 block ids holds (one id is kept as a marker).
const MAX_BLOCKS: usize = u32::MAX as usize - 1;
/// Heap per cached block the run needs, with room to spare: its hash (16 bytes), the cache
/// (about 170), and the baseline hash map's entry (about 40).
const BYTES_PER_CACHED_BLOCK: u128 = 256;

impl BenchOptions {
    /// Refuses sizes the run cannot have (naming the option); returns the number of cached
    /// paths and the device blocks the cache needs (the paths plus the allocation headroom).
    pub fn check(&self) -> anyhow::Result<(usize, u32)> {
        use super::checks::{at_least, fits_in_memory, within};
        within(self.request_blocks, 2..=MAX_BLOCKS, "--request-blocks")?;
        within(self.cached_blocks, self.request_blocks..=MAX_BLOCKS, "--cached-blocks")?;
        at_least(self.samples, 1, "--samples")?;
        at_least(self.block_tokens, 1, "--block-tokens")?;
        anyhow::ensure!(
            !self.eviction.is_offline(),
            "--eviction {} needs a trace's future: only `kvshm replay` runs it",
            self.eviction
        );
        let paths = self.cached_blocks.div_ceil(self.request_blocks);
        let fresh = self.request_blocks - self.request_blocks / 2;
        let device_blocks = paths
            .checked_mul(self.request_blocks)
            .zip(self.samples.checked_mul(fresh))
            .and_then(|(cached, headroom)| cached.checked_add(headroom))
            .filter(|&blocks| blocks <= MAX_BLOCKS);
        let Some(device_blocks) = device_blocks else {
            anyhow::bail!(
                "--cached-blocks {} with --samples {} of {fresh} new blocks each needs more than \
                 the {MAX_BLOCKS} blocks a pool of u32 block ids holds",
                self.cached_blocks,
                self.samples
            );
        };
        fits_in_memory(
            device_blocks as u128 * BYTES_PER_CACHED_BLOCK,
            format_args!("--cached-blocks {} (and the samples' headroom)", self.cached_blocks),
        )?;
        Ok((paths, device_blocks as u32))
    }
}

/// Heap memory measured around filling the cache.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryReport {
    /// How the heap was measured.
    pub method: String,
    /// Heap grown by filling the cache, per cached block (pools and index included).
    pub bytes_per_cached_block: Option<f64>,
    /// The manager's own estimate from its containers' capacities, per cached block.
    pub estimated_bytes_per_cached_block: f64,
}

/// Operations per block against a plain probe of the same keys (p50 over p50).
#[derive(Debug, Clone, Serialize)]
pub struct OverProbe {
    pub matching: f64,
    pub lookup: f64,
    pub allocate_evicting: f64,
    pub commit: f64,
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct SchedBenchReport {
    pub options: BenchOptions,
    pub cached_blocks: usize,
    /// Filling: match, allocate, commit and finish per block, averaged, while the tree grows.
    pub fill_ns_per_block: f64,
    pub match_ns_per_op: Percentiles,
    pub match_ns_per_block: Percentiles,
    pub lookup_ns_per_block: Percentiles,
    /// Finishing a request that holds `request_blocks` cached blocks, per block.
    pub finish_ns_per_block: Percentiles,
    /// Allocating the uncached half of a request while free blocks last, per new block.
    pub allocate_ns_per_block: Percentiles,
    /// The same at capacity: each new block evicts a least recently used one.
    pub allocate_evicting_ns_per_block: Percentiles,
    pub commit_ns_per_block: Percentiles,
    /// A baseline: `std::collections::HashMap<u128, u32>` (SipHash) gets of the same hashes a
    /// match walks, per block.
    pub baseline_hashmap_get_ns_per_block: Percentiles,
    /// The stricter baseline: the same gets from a `HashMap<u128, u32>` hashed by one multiply
    /// (as the tree's index hashes), per block: the cost of a plain probe of each key.
    pub baseline_probe_ns_per_block: Percentiles,
    /// `match_ns_per_block.p50 / baseline_hashmap_get_ns_per_block.p50`.
    pub match_over_baseline_p50: f64,
    /// Each operation's p50 per block over `baseline_probe_ns_per_block.p50`.
    pub over_probe_p50: OverProbe,
    pub memory: MemoryReport,
}

/// A seeded xorshift64* generator: the bench needs random hashes and picks, not quality.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn hash(&mut self) -> BlockHash {
        BlockHash(u128::from(self.next()) << 64 | u128::from(self.next()))
    }

    fn below(&mut self, bound: usize) -> usize {
        (self.next() % bound as u64) as usize
    }
}

fn nanos_since(start: Instant) -> f64 {
    start.elapsed().as_nanos() as f64
}

/// The heap in use according to glibc (`mallinfo2`), where available.
pub fn glibc_heap_in_use() -> Option<usize> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 takes no arguments, only reads the allocator's statistics and
        // returns them by value; it is safe to call from any thread at any time.
        let info = unsafe { libc::mallinfo2() };
        Some(info.uordblks + info.hblkhd)
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        None
    }
}

/// Runs the benchmark (module flow). `heap_in_use` probes the heap (see [`MemoryReport`]).
pub fn measure(
    options: &BenchOptions,
    heap_in_use: &dyn Fn() -> Option<usize>,
    heap_method: &str,
) -> anyhow::Result<SchedBenchReport> {
    let (paths, device_blocks) = options.check()?;
    let request_blocks = options.request_blocks;
    let half = request_blocks / 2;
    let tokens = |blocks: usize| blocks * options.block_tokens as usize;
    let cached_blocks = paths * request_blocks;
    let mut rng = Rng(0x5EED_1234_ABCD_0001);
    let hashes: Vec<BlockHash> = (0..cached_blocks).map(|_| rng.hash()).collect();
    let path = |index: usize| &hashes[index * request_blocks..(index + 1) * request_blocks];
    let mut next_request = 0u64;
    let mut request = || {
        next_request += 1;
        RequestId(next_request)
    };

    // 1. Fill.
    let heap_before = heap_in_use();
    let config =
        CacheConfig::new(options.block_tokens, device_blocks).with_eviction(options.eviction);
    let mut cache = CacheManager::new(config)?;
    let start = Instant::now();
    for index in 0..paths {
        let id = request();
        cache.match_prefix(id, path(index), tokens(request_blocks))?;
        cache.allocate(id, tokens(request_blocks), 0)?;
        cache.commit(id, tokens(request_blocks), path(index))?;
        cache.finish(id)?;
    }
    let fill_ns_per_block = nanos_since(start) / cached_blocks as f64;
    let heap_after = heap_in_use();
    let memory = MemoryReport {
        method: heap_method.to_owned(),
        bytes_per_cached_block: heap_before
            .zip(heap_after)
            .map(|(before, after)| after.saturating_sub(before) as f64 / cached_blocks as f64),
        estimated_bytes_per_cached_block: cache.heap_bytes() as f64 / cached_blocks as f64,
    };
    anyhow::ensure!(
        cache.tree().len() == cached_blocks,
        "the cache holds {} blocks",
        cache.tree().len()
    );

    // 2. Match, lookup, finish, and the baseline.
    let baseline: HashMap<u128, u32> =
        hashes.iter().enumerate().map(|(index, hash)| (hash.0, index as u32)).collect();
    let probe: IdMap<u128, u32> =
        hashes.iter().enumerate().map(|(index, hash)| (hash.0, index as u32)).collect();
    let samples = options.samples;
    let per_block = |nanos: f64, blocks: usize| nanos / blocks as f64;
    let (mut match_op, mut match_block, mut lookup, mut finish, mut base, mut probed) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // A prompt one token longer than a path, so that every block of the path may hit (the
    // last-token rule). Each operation walks its own random path, so none finds the caches
    // warmed by another.
    let whole_path_prompt = tokens(request_blocks) + 1;
    for _ in 0..samples {
        let start = Instant::now();
        black_box(cache.lookup(black_box(path(rng.below(paths))), whole_path_prompt)?);
        lookup.push(per_block(nanos_since(start), request_blocks));
        let blocks = path(rng.below(paths));
        let start = Instant::now();
        for hash in blocks {
            black_box(baseline.get(&black_box(hash.0)));
        }
        base.push(per_block(nanos_since(start), request_blocks));
        let blocks = path(rng.below(paths));
        let start = Instant::now();
        for hash in blocks {
            black_box(probe.get(&black_box(hash.0)));
        }
        probed.push(per_block(nanos_since(start), request_blocks));
        let blocks = path(rng.below(paths));
        let id = request();
        let start = Instant::now();
        let found = cache.match_prefix(id, blocks, whole_path_prompt)?;
        let nanos = nanos_since(start);
        anyhow::ensure!(found.device_blocks == request_blocks, "a cached path missed");
        match_op.push(nanos);
        match_block.push(per_block(nanos, request_blocks));
        let start = Instant::now();
        cache.finish(id)?;
        finish.push(per_block(nanos_since(start), request_blocks));
    }

    // 3 and 4. Allocate and commit the uncached half, with free blocks, then at capacity (where
    // the picked path may have been evicted in part, so that more is allocated).
    let fresh = request_blocks - half;
    let (mut allocate, mut evicting, mut commit) = (Vec::new(), Vec::new(), Vec::new());
    let mut blocks = Vec::with_capacity(request_blocks);
    for phase in 0..2 {
        for _ in 0..samples {
            blocks.clear();
            blocks.extend_from_slice(&path(rng.below(paths))[..half]);
            blocks.extend((0..fresh).map(|_| rng.hash()));
            let id = request();
            let found = cache.match_prefix(id, &blocks, tokens(request_blocks))?;
            let start = Instant::now();
            let new_blocks =
                cache.allocate(id, tokens(request_blocks) - found.cached_tokens, 0)?.new_blocks;
            let nanos = per_block(nanos_since(start), new_blocks);
            if phase == 0 { &mut allocate } else { &mut evicting }.push(nanos);
            let start = Instant::now();
            cache.commit(id, tokens(request_blocks), &blocks)?;
            commit.push(per_block(nanos_since(start), new_blocks));
            cache.finish(id)?;
        }
        if phase == 0 {
            anyhow::ensure!(cache.free_device_blocks() == 0, "the headroom was not used up");
        }
    }
    anyhow::ensure!(
        cache.stats().counters.evictions.device_total() >= (samples * fresh) as u64,
        "too few evictions"
    );

    let match_ns_per_block = Percentiles::of(&mut match_block);
    let baseline_hashmap_get_ns_per_block = Percentiles::of(&mut base);
    let baseline_probe_ns_per_block = Percentiles::of(&mut probed);
    let lookup_ns_per_block = Percentiles::of(&mut lookup);
    let allocate_evicting_ns_per_block = Percentiles::of(&mut evicting);
    let commit_ns_per_block = Percentiles::of(&mut commit);
    let over = |p: &Percentiles| p.p50 / baseline_probe_ns_per_block.p50;
    let over_probe_p50 = OverProbe {
        matching: over(&match_ns_per_block),
        lookup: over(&lookup_ns_per_block),
        allocate_evicting: over(&allocate_evicting_ns_per_block),
        commit: over(&commit_ns_per_block),
    };
    Ok(SchedBenchReport {
        options: options.clone(),
        cached_blocks,
        fill_ns_per_block,
        match_ns_per_op: Percentiles::of(&mut match_op),
        match_over_baseline_p50: match_ns_per_block.p50 / baseline_hashmap_get_ns_per_block.p50,
        match_ns_per_block,
        lookup_ns_per_block,
        finish_ns_per_block: Percentiles::of(&mut finish),
        allocate_ns_per_block: Percentiles::of(&mut allocate),
        allocate_evicting_ns_per_block,
        commit_ns_per_block,
        baseline_hashmap_get_ns_per_block,
        baseline_probe_ns_per_block,
        over_probe_p50,
        memory,
    })
}

/// Prints a report as one JSON object or a summary.
pub fn print(report: &SchedBenchReport, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
        return Ok(());
    }
    let line = |name: &str, p: &Percentiles| {
        println!("{name:<34} p50 {:>8.1} ns  p99 {:>8.1} ns", p.p50, p.p99)
    };
    println!(
        "{} cached blocks, requests of {} blocks",
        report.cached_blocks, report.options.request_blocks
    );
    line("match (per block)", &report.match_ns_per_block);
    line("lookup (per block)", &report.lookup_ns_per_block);
    line("baseline HashMap get (per block)", &report.baseline_hashmap_get_ns_per_block);
    line("baseline plain probe (per block)", &report.baseline_probe_ns_per_block);
    line("allocate (per new block)", &report.allocate_ns_per_block);
    line("allocate, evicting (per new block)", &report.allocate_evicting_ns_per_block);
    line("commit (per new block)", &report.commit_ns_per_block);
    line("finish (per held block)", &report.finish_ns_per_block);
    if let Some(bytes) = report.memory.bytes_per_cached_block {
        println!("memory: {bytes:.0} bytes per cached block ({})", report.memory.method);
    }
    println!(
        "memory estimate: {:.0} bytes per cached block",
        report.memory.estimated_bytes_per_cached_block
    );
    Ok(())
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let report = measure(
        &args.options,
        &glibc_heap_in_use,
        "glibc mallinfo2: heap in use before and after filling",
    )?;
    print(&report, args.json)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_run_measures_every_operation_with_every_online_policy() {
        for eviction in EvictionPolicy::online() {
            let options = BenchOptions {
                cached_blocks: 640,
                request_blocks: 8,
                samples: 20,
                block_tokens: 4,
                eviction,
            };
            small_run(&options);
        }
        let offline = BenchOptions { eviction: EvictionPolicy::Optimal, ..BenchOptions::default() };
        let error = offline.check().unwrap_err().to_string();
        assert!(error.contains("--eviction optimal"), "{error}");
    }

    fn small_run(options: &BenchOptions) {
        let report = measure(options, &glibc_heap_in_use, "mallinfo2").unwrap();
        assert_eq!(report.cached_blocks, 640);
        for percentiles in [
            report.match_ns_per_block,
            report.allocate_evicting_ns_per_block,
            report.commit_ns_per_block,
        ] {
            assert!(percentiles.p50 > 0.0 && percentiles.p50 <= percentiles.p99);
        }
        assert!(report.memory.estimated_bytes_per_cached_block > 0.0);
        let json = serde_json::to_value(&report).unwrap();
        assert!(json["baseline_hashmap_get_ns_per_block"]["p50"].is_number());
    }
}
