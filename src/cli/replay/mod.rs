//! `kvshm replay`: a Mooncake-format trace through the scheduler, one request at a time, under
//! the rules an engine follows.
//!
//! A trace request names one id per 512-token block of its prompt, the last possibly partial.
//! Engines cache only full blocks, so only the first `input_length / block_tokens` ids are
//! blocks; and a match follows `match_prefix`'s last-token rule, so at most
//! `(input_length - 1) / block_tokens` of them hit. Per request ([`replay`]):
//! 1. `poll` (backups, watermark evictions), completing the copies at once;
//! 2. match the prompt's full blocks;
//! 3. allocate the rest of the prompt plus `output_length` tokens (only the prompt with
//!    `--prompt-only`, as vLLM's manager is driven by `benches/vllm_kv_manager.py`); a request
//!    that cannot fit is counted and aborted;
//! 4. complete every copy at once, successfully;
//! 5. commit the prompt's full blocks and finish.
//!
//! The time of steps 1 to 5 is the scheduler's time per request. Hit tokens are hit blocks times
//! `block_tokens`.
//!
//! With `--prompt-only` this reproduces vLLM's own `KVCacheManager` request for request: vLLM
//! keeps block 0 of its pool as a null block, so vLLM with `N` blocks caches what kvshm does with
//! `N - 1` (the harness checks it).
//!
//! `--eviction optimal` replays with the offline optimum (farthest next use first, see
//! `tree::policy::optimal`): before serving, the replay records in which requests each block may
//! hit ([`future_uses`]). It is an upper bound for the online policies, not a policy to serve
//! with.
//!
//! [`reference_lru`] replays the same rules through a plain LRU cache of blocks, the reference
//! the figures are compared with.

mod instances;
mod reference;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use serde::Serialize;

use crate::hash::BlockHash;
use crate::manager::{
    AllocateError, CacheConfig, CacheManager, EvictionPolicy, FutureUses, RequestId,
    StorageWritePolicy, TransferId, WritePolicy,
};
use crate::percentiles::Percentiles;
use crate::trace::{read_trace, TraceRequest};

pub use instances::{
    replay_instances, InstanceArgs, InstanceConfig, InstanceReplayer, InstancesReport, Route,
};
pub use reference::{reference_lru, ReferenceLru};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The trace, JSON lines of {timestamp, input_length, output_length, hash_ids}.
    #[arg(long)]
    pub trace: PathBuf,
    /// Tokens per block (one hash id per block).
    #[arg(long, default_value_t = 512)]
    pub block_tokens: u32,
    /// Blocks of the device tier.
    #[arg(long)]
    pub device_blocks: u32,
    /// Blocks of the host tier (0: no host tier).
    #[arg(long, default_value_t = 0)]
    pub host_blocks: u32,
    /// Blocks of the storage tier below host (0: none; needs a host tier). Its LOADs and STOREs
    /// complete at once, as the copies between device and host do.
    #[arg(long, default_value_t = 0)]
    pub storage_blocks: u32,
    /// When host blocks are written to storage: write_back (on host eviction), write_through, or
    /// write_through_selective:T (blocks with at least T hits written through).
    #[arg(long, default_value_t = StorageWritePolicy::WriteBack)]
    pub storage_write_policy: StorageWritePolicy,
    /// Also replay a plain LRU cache of device + host + storage blocks (the reference the tiers
    /// are compared with) and report its hit rate.
    #[arg(long)]
    pub reference_lru: bool,
    /// write_back, write_through or write_through_selective:T.
    #[arg(long, default_value_t = WritePolicy::WriteBack)]
    pub write_policy: WritePolicy,
    /// Device blocks `poll` keeps free ahead of demand.
    #[arg(long, default_value_t = 0)]
    pub free_watermark: u32,
    /// The eviction policy ordering what leaves each tier first: lru, conv, or optimal (the
    /// offline optimum, an upper bound: it reads the whole trace first).
    #[arg(long, default_value_t = EvictionPolicy::default())]
    pub eviction: EvictionPolicy,
    /// Replay only the first N requests.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Allocate only the prompt of each request, not its `output_length` tokens more.
    #[arg(long)]
    pub prompt_only: bool,
    /// Write the hit blocks of every request, one number per line, to this file.
    #[arg(long)]
    pub per_request_hits: Option<PathBuf>,
    /// Print one JSON object instead of a summary.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub instances: InstanceArgs,
}

/// What a replay measured.
#[derive(Clone, Debug, Serialize)]
pub struct ReplayReport {
    pub requests: usize,
    /// Requests whose allocation could not be satisfied (aborted).
    pub failed_requests: usize,
    /// Full prompt blocks (the blocks an engine caches and can hit).
    pub blocks: u64,
    pub hit_blocks: u64,
    pub device_hit_blocks: u64,
    pub host_hit_blocks: u64,
    pub storage_hit_blocks: u64,
    pub hit_rate_blocks: f64,
    pub input_tokens: u64,
    pub hit_tokens: u64,
    pub hit_rate_tokens: f64,
    /// Blocks evicted from the device tier (dropped, demoted to their backup, or written back).
    pub evictions: u64,
    /// Blocks that left the host tier (dropped, or to storage).
    pub host_evictions: u64,
    /// Blocks copied host to device, and device to host by evictions.
    pub swaps_in: u64,
    pub swaps_out: u64,
    /// Blocks backed up to host (write-through).
    pub backups: u64,
    /// Blocks written to storage (STOREs landed) and read back (LOADs landed).
    pub storage_stores: u64,
    pub storage_loads: u64,
    /// Storage-only blocks dropped to make room on the storage tier.
    pub storage_evictions: u64,
    pub sched_us_per_request: Percentiles,
    pub block_tokens: u32,
    pub device_blocks: u32,
    pub host_blocks: u32,
    pub storage_blocks: u32,
    pub write_policy: String,
    pub storage_write_policy: String,
    pub eviction: String,
    pub prompt_only: bool,
    /// With `--reference-lru`: a plain LRU cache of the tiers' combined capacity on the same
    /// trace under the same rules.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reference_lru: Option<ReferenceLru>,
}

/// A replay's report and the hit blocks of each request, in trace order.
#[derive(Clone, Debug)]
pub struct Replayed {
    pub report: ReplayReport,
    pub hits_per_request: Vec<u32>,
}

/// Completes every copy the manager has to hand out, successfully, until none is left.
/// `taken` is scratch space.
fn complete_all(cache: &mut CacheManager, taken: &mut Vec<TransferId>) -> anyhow::Result<()> {
    loop {
        taken.clear();
        cache.take_transfers_with(|transfer| taken.push(transfer.id));
        if taken.is_empty() {
            return Ok(());
        }
        for &transfer in taken.iter() {
            cache.complete_transfer(transfer, Ok(()))?;
        }
    }
}

/// A replay in progress: a fresh manager, served one trace request at a time (module flow).
pub struct Replayer {
    cache: CacheManager,
    block_tokens: usize,
    prompt_only: bool,
    write_policy: String,
    storage_write_policy: String,
    eviction: String,
    /// Buffers reused from request to request, so that serving one allocates nothing.
    hashes: Vec<BlockHash>,
    taken: Vec<TransferId>,
    /// The blocks the tree dropped from a storage tier (no tier to tell here): drained per request.
    forgotten: Vec<crate::hash::BlockHash>,
    times: Vec<f64>,
    hits_per_request: Vec<u32>,
    requests: usize,
    failed_requests: usize,
    blocks: u64,
    device_hits: u64,
    host_hits: u64,
    storage_hits: u64,
    input_tokens: u64,
    hit_tokens: u64,
}

impl Replayer {
    /// A replayer with room for the figures of `expected_requests` requests; its eviction
    /// policy must be online.
    pub fn new(
        config: CacheConfig,
        prompt_only: bool,
        expected_requests: usize,
    ) -> anyhow::Result<Replayer> {
        let cache = CacheManager::new(config.clone())?;
        Ok(Replayer::with_cache(cache, config, prompt_only, expected_requests))
    }

    /// A replayer whose offline eviction policy orders by `future` (see [`future_uses`]): the
    /// requests must then be served in the order `future` was built from.
    pub fn with_future(
        config: CacheConfig,
        prompt_only: bool,
        future: FutureUses,
    ) -> anyhow::Result<Replayer> {
        let expected_requests = future.requests() as usize;
        let cache = CacheManager::with_future(config.clone(), future)?;
        Ok(Replayer::with_cache(cache, config, prompt_only, expected_requests))
    }

    fn with_cache(
        cache: CacheManager,
        config: CacheConfig,
        prompt_only: bool,
        expected_requests: usize,
    ) -> Replayer {
        Replayer {
            block_tokens: config.block_tokens as usize,
            write_policy: config.write_policy.to_string(),
            storage_write_policy: config.storage_write_policy.to_string(),
            eviction: config.eviction.to_string(),
            cache,
            prompt_only,
            hashes: Vec::new(),
            taken: Vec::new(),
            forgotten: Vec::new(),
            times: Vec::with_capacity(expected_requests),
            hits_per_request: Vec::with_capacity(expected_requests),
            requests: 0,
            failed_requests: 0,
            blocks: 0,
            device_hits: 0,
            host_hits: 0,
            storage_hits: 0,
            input_tokens: 0,
            hit_tokens: 0,
        }
    }

    /// Serves the next request of the trace (module flow), timing steps 1 to 5.
    pub fn serve(&mut self, request: &TraceRequest) -> anyhow::Result<()> {
        let id = RequestId(self.requests as u64);
        self.requests += 1;
        self.hashes.clear();
        self.hashes.extend(request.full_block_hashes(self.block_tokens));
        let cache = &mut self.cache;
        let start = Instant::now();
        cache.poll();
        complete_all(cache, &mut self.taken)?;
        let found = cache.match_prefix(id, &self.hashes, request.input_length)?;
        let output_tokens = if self.prompt_only { 0 } else { request.output_length };
        let new_tokens = request.input_length - found.cached_tokens + output_tokens;
        match cache.allocate(id, new_tokens, 0) {
            Ok(_) => {
                complete_all(cache, &mut self.taken)?;
                cache.commit(id, self.hashes.len() * self.block_tokens, &self.hashes)?;
                cache.finish(id)?;
            }
            Err(AllocateError::OutOfBlocks { .. } | AllocateError::OutOfHostBlocks { .. }) => {
                self.failed_requests += 1;
                cache.abort(id)?;
            }
            Err(error) => return Err(error.into()),
        }
        self.times.push(start.elapsed().as_secs_f64() * 1e6);
        self.cache.take_forgotten_blocks(&mut self.forgotten);
        self.forgotten.clear();
        self.blocks += self.hashes.len() as u64;
        self.device_hits += found.device_blocks as u64;
        self.host_hits += found.host_blocks as u64;
        self.storage_hits += found.storage_blocks as u64;
        self.input_tokens += request.input_length as u64;
        self.hit_tokens += found.cached_tokens as u64;
        self.hits_per_request.push(found.blocks() as u32);
        Ok(())
    }

    /// The cache manager being replayed into (for inspection and invariant checks).
    pub fn cache(&self) -> &CacheManager {
        &self.cache
    }

    /// The report of the requests served so far.
    pub fn finish(mut self) -> Replayed {
        let stats = self.cache.stats();
        let ratio =
            |part: u64, whole: u64| if whole == 0 { 0.0 } else { part as f64 / whole as f64 };
        let hit_blocks = self.device_hits + self.host_hits + self.storage_hits;
        let report = ReplayReport {
            requests: self.requests,
            failed_requests: self.failed_requests,
            blocks: self.blocks,
            hit_blocks,
            device_hit_blocks: self.device_hits,
            host_hit_blocks: self.host_hits,
            storage_hit_blocks: self.storage_hits,
            hit_rate_blocks: ratio(hit_blocks, self.blocks),
            input_tokens: self.input_tokens,
            hit_tokens: self.hit_tokens,
            hit_rate_tokens: ratio(self.hit_tokens, self.input_tokens),
            evictions: stats.counters.evictions.device_total(),
            host_evictions: stats.counters.evictions.host_dropped
                + stats.counters.evictions.host_written_back
                + stats.counters.evictions.host_to_storage_metadata,
            swaps_in: stats.counters.swap_in_blocks,
            swaps_out: stats.counters.swap_out_blocks,
            backups: stats.counters.backup_blocks,
            storage_stores: stats.counters.stored_blocks,
            storage_loads: stats.counters.loaded_blocks,
            storage_evictions: stats.counters.evictions.storage_dropped,
            sched_us_per_request: Percentiles::of(&mut self.times),
            block_tokens: stats.block_tokens,
            device_blocks: stats.device_blocks,
            host_blocks: stats.host_blocks,
            storage_blocks: stats.storage_blocks,
            write_policy: self.write_policy,
            storage_write_policy: self.storage_write_policy,
            eviction: self.eviction,
            prompt_only: self.prompt_only,
            reference_lru: None,
        };
        Replayed { report, hits_per_request: self.hits_per_request }
    }
}

/// In which of `requests` each block may hit: its position is below the request's last-token
/// bound, `(input_length - 1) / block_tokens` (the future the offline optimum orders by).
pub fn future_uses(requests: &[TraceRequest], block_tokens: u32) -> FutureUses {
    let block_tokens = block_tokens as usize;
    let mut future = FutureUses::default();
    for request in requests {
        let bound = request.input_length.saturating_sub(1) / block_tokens;
        future.push_request(request.full_block_hashes(block_tokens).take(bound));
    }
    future
}

/// Replays `requests` one at a time through a fresh manager (module flow); an offline eviction
/// policy gets their future first.
pub fn replay(
    requests: &[TraceRequest],
    config: CacheConfig,
    prompt_only: bool,
) -> anyhow::Result<Replayed> {
    let mut replayer = if config.eviction.is_offline() {
        let future = future_uses(requests, config.block_tokens);
        Replayer::with_future(config, prompt_only, future)?
    } else {
        Replayer::new(config, prompt_only, requests.len())?
    };
    for request in requests {
        replayer.serve(request)?;
    }
    Ok(replayer.finish())
}

/// Refuses sizes the replay cannot have, naming the option, before anything is allocated.
fn check(args: &Args) -> anyhow::Result<()> {
    use super::checks::{at_least, fits_in_memory, within};
    const MAX_BLOCKS: u32 = u32::MAX - 1;
    at_least(args.block_tokens, 1, "--block-tokens")?;
    within(args.device_blocks, 1..=MAX_BLOCKS, "--device-blocks")?;
    within(args.host_blocks, 0..=MAX_BLOCKS, "--host-blocks")?;
    within(args.storage_blocks, 0..=MAX_BLOCKS, "--storage-blocks")?;
    if args.storage_blocks > 0 && args.host_blocks == 0 {
        anyhow::bail!("--storage-blocks needs a host tier (--host-blocks): blocks reach storage through host blocks");
    }
    within(args.free_watermark, 0..=args.device_blocks, "--free-watermark")?;
    // The block pools (two u32 per block) and the tree's index sized for every block are allocated up
    // front.
    let blocks = u128::from(args.device_blocks) + u128::from(args.host_blocks);
    fits_in_memory(
        blocks * (8 + crate::tree::PRESIZED_BYTES_PER_BLOCK as u128),
        format_args!(
            "the block pools and the cache's index of --device-blocks {} + --host-blocks {}",
            args.device_blocks, args.host_blocks
        ),
    )
}

pub fn run(args: Args) -> anyhow::Result<()> {
    check(&args)?;
    if args.instances.instances.is_some() {
        return instances::run(&args);
    }
    instances::refuse_without_instances(&args.instances)?;
    let requests = read_trace(&args.trace, args.limit)?;
    let config = CacheConfig::new(args.block_tokens, args.device_blocks)
        .with_host_blocks(args.host_blocks)
        .with_write_policy(args.write_policy)
        .with_free_watermark(args.free_watermark)
        .with_eviction(args.eviction)
        .with_storage_blocks(args.storage_blocks)
        .with_storage_write_policy(args.storage_write_policy);
    let Replayed { mut report, hits_per_request } =
        replay(&requests, config, args.prompt_only).context("replaying the trace")?;
    if args.reference_lru {
        let capacity = u64::from(args.device_blocks)
            + u64::from(args.host_blocks)
            + u64::from(args.storage_blocks);
        report.reference_lru = Some(reference_lru(&requests, args.block_tokens as usize, capacity));
    }
    if let Some(path) = &args.per_request_hits {
        let mut text = String::with_capacity(hits_per_request.len() * 3);
        for hits in &hits_per_request {
            text.push_str(&hits.to_string());
            text.push('\n');
        }
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{} requests, {} blocks: hit rate {:.4} by blocks ({} device + {} host + {} storage), \
             {:.4} by tokens",
            report.requests,
            report.blocks,
            report.hit_rate_blocks,
            report.device_hit_blocks,
            report.host_hit_blocks,
            report.storage_hit_blocks,
            report.hit_rate_tokens
        );
        if let Some(reference) = &report.reference_lru {
            println!(
                "plain LRU of {} blocks: hit rate {:.4} by blocks, {:.4} by tokens",
                reference.capacity_blocks, reference.hit_rate_blocks, reference.hit_rate_tokens
            );
        }
        println!(
            "evictions {} (host {}), swaps in {} out {}, backups {}, failed requests {}",
            report.evictions,
            report.host_evictions,
            report.swaps_in,
            report.swaps_out,
            report.backups,
            report.failed_requests
        );
        println!(
            "scheduler time per request: p50 {:.1} us, p99 {:.1} us",
            report.sched_us_per_request.p50, report.sched_us_per_request.p99
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(input_length: usize, hash_ids: &[u64]) -> TraceRequest {
        TraceRequest { timestamp: 0, input_length, output_length: 10, hash_ids: hash_ids.to_vec() }
    }

    fn run(trace: &[TraceRequest], config: CacheConfig) -> ReplayReport {
        replay(trace, config, false).unwrap().report
    }

    #[test]
    fn only_full_blocks_are_cached_and_the_last_token_is_always_computed() {
        let trace = [
            request(1100, &[0, 1, 2]), // blocks 0 and 1; 2 is partial, never cached
            request(1100, &[0, 1, 2]), // 0 and 1 hit; 2 was not cached
            request(1024, &[0, 1]),    // block-aligned: 1 is recomputed
            request(100, &[0]),        // no full block
        ];
        let replayed = replay(&trace, CacheConfig::new(512, 16), false).unwrap();
        let report = &replayed.report;
        assert_eq!(replayed.hits_per_request, vec![0, 2, 1, 0]);
        assert_eq!((report.blocks, report.hit_blocks), (6, 3));
        assert_eq!((report.hit_tokens, report.input_tokens), (3 * 512, 3324));
    }

    #[test]
    fn prompt_only_allocates_no_output_blocks() {
        // Two device blocks: the prompt fits, the prompt and its output do not.
        let trace = [request(1000, &[0, 1])];
        let with_output = TraceRequest { output_length: 600, ..trace[0].clone() };
        let alone = std::slice::from_ref(&with_output);
        assert_eq!(run(alone, CacheConfig::new(512, 2)).failed_requests, 1);
        let replayed = replay(alone, CacheConfig::new(512, 2), true).unwrap();
        assert_eq!((replayed.report.failed_requests, replayed.report.prompt_only), (0, true));
    }

    #[test]
    fn a_small_device_tier_with_a_host_tier_hits_on_host() {
        let trace = [request(1024, &[0, 1]), request(1024, &[5, 6]), request(1024, &[0, 1])];
        let report = run(&trace, CacheConfig::new(512, 3).with_host_blocks(8));
        assert_eq!((report.device_hit_blocks, report.host_hit_blocks), (0, 1));
        assert!(report.swaps_in == 1 && report.swaps_out >= 2, "{report:?}");
    }

    #[test]
    fn the_reference_lru_evicts_the_least_recently_used_block_and_follows_the_last_token_rule() {
        let trace = [
            request(1100, &[0, 1, 2]), // caches 0 and 1 (2 is partial)
            request(1100, &[0, 1, 2]), // hits 0 and 1
            request(1100, &[5, 6, 7]), // with room for 3: the tail 1 goes, the head 0 stays
            request(1100, &[0, 1, 2]), // 0 hits, 1 is gone
            request(1024, &[0, 1]),    // block-aligned: at most 1 may hit
        ];
        let reference = reference_lru(&trace, 512, 3);
        assert_eq!((reference.capacity_blocks, reference.hit_blocks), (3, 4));
        assert_eq!(reference.hit_tokens, 4 * 512);
        // A prompt's tail leaves before its head: the head and what follows it still hit.
        let tail_first =
            [request(1537, &[0, 1, 2]), request(513, &[5]), request(2049, &[0, 1, 2, 9])];
        assert_eq!(reference_lru(&tail_first, 512, 3).hit_blocks, 2);
        let roomy = reference_lru(&trace, 512, 100);
        assert_eq!(roomy.hit_blocks, 2 + 2 + 1);
        assert_eq!(reference_lru(&trace, 512, 0).hit_blocks, 0);
    }

    #[test]
    fn a_storage_tier_hits_what_fell_out_of_device_and_host() {
        let trace = [
            request(1100, &[0, 1, 2]),
            request(1100, &[5, 6, 7]),
            request(1100, &[8, 9, 10]),
            request(1100, &[11, 12, 13]),
            request(1100, &[0, 1, 2]),
        ];
        let config = CacheConfig::new(512, 4).with_host_blocks(2);
        assert_eq!(run(&trace, config.clone()).hit_blocks, 0);
        let report = run(&trace, config.with_storage_blocks(8));
        assert_eq!((report.storage_hit_blocks, report.hit_blocks), (2, 2), "{report:?}");
        assert!(report.storage_stores >= 2 && report.storage_loads == 2, "{report:?}");
    }

    #[test]
    fn a_request_larger_than_the_device_tier_is_counted_and_skipped() {
        let trace = [request(4096, &[0, 1, 2, 3, 4, 5, 6, 7])];
        let report = run(&trace, CacheConfig::new(512, 4));
        assert_eq!((report.failed_requests, report.hit_blocks), (1, 0));
    }
}
