//! `kvshm replay --instances N`: a trace spread over `N` engine instances on one node, each with
//! a device prefix cache of its own, in front of either one host tier per instance or one host
//! tier shared by all (DESIGN §12.6).
//!
//! Each instance is a device-only [`CacheManager`] (the engine's own prefix cache, vLLM's rules)
//! and a client of a [`SharedTierIndex`]: one index for all with `--shared-host-tier`, else one
//! per instance with `--host-blocks / N` chunks, so that the two differ only in sharing. Keys are
//! the blocks' chained hashes. A request goes to the instance `--route` picks, then
//! ([`InstanceReplayer::serve`]):
//! 1. match its full blocks on the instance's device;
//! 2. `acquire_prefix` of the blocks that follow, up to the last-token bound, on its host tier,
//!    and release them at once (the copies into device blocks complete at once);
//! 3. allocate the rest of the prompt plus `output_length` tokens on the device (host hits are
//!    loaded into new device blocks); a new block that held a cached key was evicted from the
//!    device for this allocation;
//! 4. commit the prompt's full blocks and finish on the device;
//! 5. the write policy: `write_through` offers every full prompt block to the host tier (what
//!    vLLM's connector does), `write_back` the blocks step 3 evicted, each under its parent;
//! 6. `finish_request` on the host tier (recency); then, untimed, the shared tier's eviction
//!    ahead of demand, as its owner evicts once it has answered (`SharedTierIndex::evict_ahead`;
//!    a per-instance tier keeps no chunk free, as today's per-instance managers).
//!
//! Hit tokens are (device hits + host hits) times `block_tokens`.

use std::collections::HashMap;
use std::time::Instant;

use serde::Serialize;

use crate::hash::BlockHash;
use crate::manager::{AllocateError, CacheConfig, CacheManager, RequestId, WritePolicy};
use crate::offload::shared::DEFAULT_FREE_CHUNKS;
use crate::offload::{
    ClientId, OffloadConfig, OffloadKey, PreparedStore, SharedTierIndex, TierIdentity,
};
use crate::percentiles::Percentiles;
use crate::trace::TraceRequest;

/// The options of a replay over several instances.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct InstanceArgs {
    /// Spread the trace over N engine instances, each with --device-blocks of its own, in front
    /// of host tiers over engine keys (DESIGN §12.6); --host-blocks is the node's total.
    #[arg(long)]
    pub instances: Option<u32>,
    /// How requests are spread over instances: round-robin, random, or sticky (every turn of a
    /// conversation on the instance of its first turn).
    #[arg(long, value_enum)]
    pub route: Option<Route>,
    /// One host tier shared by every instance, instead of --host-blocks / N per instance.
    #[arg(long)]
    pub shared_host_tier: bool,
    /// With --shared-host-tier: at most this many host blocks charged to one instance.
    #[arg(long)]
    pub host_quota: Option<u32>,
    /// With --shared-host-tier: host blocks the tier keeps free ahead of demand, as its owner
    /// does (`kvshm tier-owner --free-chunks`; by default 64, at most a 256th of the tier).
    #[arg(long)]
    pub host_free_blocks: Option<u32>,
    /// Seed of --route random.
    #[arg(long, default_value_t = 1)]
    pub route_seed: u64,
}

/// How requests are spread over instances.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Route {
    #[default]
    RoundRobin,
    /// Uniformly at random (seeded).
    Random,
    /// A conversation (a trace's second block id: its first past the shared system prompt)
    /// stays on the instance its first turn went to; new conversations go round-robin.
    Sticky,
}

/// The shape of one replay over instances.
#[derive(Clone, Debug)]
pub struct InstanceConfig {
    pub instances: u32,
    pub route: Route,
    pub route_seed: u64,
    /// Each instance's device tier (only `block_tokens`, `device_blocks` and the eviction
    /// policy are used).
    pub device: CacheConfig,
    /// Host blocks of the node, all instances together.
    pub host_blocks: u32,
    pub shared_host_tier: bool,
    pub host_quota: Option<u32>,
    /// Host blocks the shared tier keeps free ahead of demand (before its cap).
    pub host_free_blocks: u32,
    /// `WriteBack` or `WriteThrough`.
    pub write_policy: WritePolicy,
    pub prompt_only: bool,
}

/// What a replay over instances measured (one JSON object).
#[derive(Clone, Debug, Serialize)]
pub struct InstancesReport {
    pub instances: u32,
    pub route: Route,
    pub shared_host_tier: bool,
    pub write_policy: String,
    pub block_tokens: u32,
    pub device_blocks_per_instance: u32,
    /// Host blocks of the node, all instances together.
    pub host_blocks: u32,
    pub host_quota: Option<u32>,
    /// Host blocks the shared tier kept free ahead of demand (its cap applied).
    pub host_free_blocks: Option<usize>,
    pub requests: usize,
    pub requests_per_instance: Vec<u64>,
    /// Requests whose device allocation could not be satisfied (aborted).
    pub failed_requests: usize,
    pub blocks: u64,
    pub hit_blocks: u64,
    pub device_hit_blocks: u64,
    pub host_hit_blocks: u64,
    pub hit_rate_blocks: f64,
    pub input_tokens: u64,
    pub hit_tokens: u64,
    pub hit_rate_tokens: f64,
    /// Blocks written to a host tier, and dropped from one.
    pub host_stores: u64,
    pub host_evictions: u64,
    /// Stores a host tier refused (nothing evictable, or over the quota).
    pub host_stores_refused: u64,
    /// Device time and host-tier index time per request, in process.
    pub us_per_request: Percentiles,
}

/// The key of a block in a host tier: its chained hash.
fn key_of(hash: BlockHash) -> OffloadKey {
    OffloadKey::new(&hash.0.to_le_bytes()).expect("16 bytes fit a key")
}

/// One engine instance: its device cache and its place in a host tier.
struct Instance {
    device: CacheManager,
    tier: usize,
    client: ClientId,
    /// Per device block, the key it caches and that key's parent, as far as the replay knows.
    holders: Vec<Option<(BlockHash, Option<BlockHash>)>>,
    requests: u64,
}

/// A replay over instances in progress (module flow).
pub struct InstanceReplayer {
    config: InstanceConfig,
    instances: Vec<Instance>,
    tiers: Vec<SharedTierIndex>,
    /// Sticky routing: conversation -> instance.
    conversations: HashMap<u64, u32>,
    next_instance: u32,
    rng: u64,
    // Scratch reused from request to request.
    hashes: Vec<BlockHash>,
    keys: Vec<OffloadKey>,
    chunks: Vec<u32>,
    table: Vec<u32>,
    evicted: Vec<(BlockHash, Option<BlockHash>)>,
    out: PreparedStore,
    times: Vec<f64>,
    // Figures.
    requests: usize,
    failed_requests: usize,
    blocks: u64,
    device_hits: u64,
    host_hits: u64,
    input_tokens: u64,
}

impl InstanceReplayer {
    pub fn new(config: InstanceConfig) -> anyhow::Result<InstanceReplayer> {
        let count = config.instances;
        anyhow::ensure!(count >= 1, "--instances must be at least 1");
        anyhow::ensure!(
            matches!(config.write_policy, WritePolicy::WriteBack | WritePolicy::WriteThrough),
            "--instances replays write_back or write_through, not {}",
            config.write_policy
        );
        let identity = TierIdentity {
            model: "trace".into(),
            kv_dtype: "none".into(),
            block_tokens: config.device.block_tokens,
            block_bytes: 0,
            blocks_per_chunk: 1,
            layout: "replay".into(),
        };
        let tier_count = if config.shared_host_tier { 1 } else { count };
        let chunks = config.host_blocks / tier_count;
        anyhow::ensure!(
            chunks >= 1,
            "--host-blocks {} leaves no host block for each of {tier_count} tiers",
            config.host_blocks
        );
        let mut tiers = Vec::new();
        for _ in 0..tier_count {
            let mut tier = SharedTierIndex::new(identity.clone(), OffloadConfig::new(chunks))?;
            // Today's per-instance managers evict only when a store needs the room.
            tier.keep_free(if config.shared_host_tier { config.host_free_blocks } else { 0 });
            tiers.push(tier);
        }
        let mut instances = Vec::new();
        for number in 0..count {
            let tier = if config.shared_host_tier { 0 } else { number as usize };
            let quota = if config.shared_host_tier { config.host_quota } else { None };
            let client = tiers[tier].attach(&identity, &format!("instance-{number}"), quota)?;
            let device = CacheManager::new(
                CacheConfig::new(config.device.block_tokens, config.device.device_blocks)
                    .with_eviction(config.device.eviction),
            )?;
            instances.push(Instance {
                holders: vec![None; config.device.device_blocks as usize],
                device,
                tier,
                client,
                requests: 0,
            });
        }
        Ok(InstanceReplayer {
            rng: config.route_seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
            config,
            instances,
            tiers,
            conversations: HashMap::new(),
            next_instance: 0,
            hashes: Vec::new(),
            keys: Vec::new(),
            chunks: Vec::new(),
            table: Vec::new(),
            evicted: Vec::new(),
            out: PreparedStore::default(),
            times: Vec::new(),
            requests: 0,
            failed_requests: 0,
            blocks: 0,
            device_hits: 0,
            host_hits: 0,
            input_tokens: 0,
        })
    }

    /// The instance `request` goes to.
    fn route(&mut self, request: &TraceRequest) -> usize {
        let count = self.config.instances;
        let mut round_robin = || {
            let next = self.next_instance;
            self.next_instance = (next + 1) % count;
            next
        };
        let instance = match self.config.route {
            Route::RoundRobin => round_robin(),
            Route::Random => {
                // xorshift64
                self.rng ^= self.rng << 13;
                self.rng ^= self.rng >> 7;
                self.rng ^= self.rng << 17;
                (self.rng % u64::from(count)) as u32
            }
            Route::Sticky => {
                let conversation =
                    request.hash_ids.get(1).or(request.hash_ids.first()).copied().unwrap_or(0);
                match self.conversations.get(&conversation) {
                    Some(&instance) => instance,
                    None => {
                        let instance = round_robin();
                        self.conversations.insert(conversation, instance);
                        instance
                    }
                }
            }
        };
        instance as usize
    }

    /// Serves the next request of the trace on the instance its route picks (module flow).
    pub fn serve(&mut self, request: &TraceRequest) -> anyhow::Result<()> {
        let number = self.route(request);
        let block_tokens = self.config.device.block_tokens as usize;
        let id = RequestId(self.requests as u64);
        let name = self.requests.to_string();
        self.requests += 1;
        self.hashes.clear();
        self.hashes.extend(request.full_block_hashes(block_tokens));
        self.keys.clear();
        self.keys.extend(self.hashes.iter().map(|&hash| key_of(hash)));
        let bound = (request.input_length.saturating_sub(1) / block_tokens).min(self.hashes.len());
        let start = Instant::now();
        let instance = &mut self.instances[number];
        let tier = &mut self.tiers[instance.tier];
        instance.requests += 1;
        // 1 and 2: device, then host.
        let device_hits =
            instance.device.match_prefix(id, &self.hashes, request.input_length)?.blocks();
        let host_keys = &self.keys[device_hits.min(bound)..bound];
        let host_hits = tier.acquire_prefix(instance.client, &name, host_keys, &mut self.chunks)?;
        tier.release_loads(instance.client, &host_keys[..host_hits])?;
        // 3 and 4: the device.
        let output_tokens = if self.config.prompt_only { 0 } else { request.output_length };
        let new_tokens = request.input_length - device_hits * block_tokens + output_tokens;
        self.evicted.clear();
        match instance.device.allocate(id, new_tokens, 0) {
            Ok(_) => {
                self.table.clear();
                self.table.extend_from_slice(
                    instance.device.block_table(id).expect("allocated just above"),
                );
                for &block in &self.table[device_hits..] {
                    if let Some(held) = instance.holders[block as usize].take() {
                        self.evicted.push(held);
                    }
                }
                let on_device = instance.device.cached_prefix(&self.hashes).device_blocks;
                instance.device.commit(id, self.hashes.len() * block_tokens, &self.hashes)?;
                instance.device.finish(id)?;
                // Blocks past what was on device became new nodes with this request's blocks.
                for position in on_device.max(device_hits)..self.hashes.len() {
                    let parent = position.checked_sub(1).map(|parent| self.hashes[parent]);
                    instance.holders[self.table[position] as usize] =
                        Some((self.hashes[position], parent));
                }
            }
            Err(AllocateError::OutOfBlocks { .. }) => {
                self.failed_requests += 1;
                instance.device.abort(id)?;
            }
            Err(error) => return Err(error.into()),
        }
        // 5 and 6: the host tier.
        match self.config.write_policy {
            WritePolicy::WriteThrough => {
                tier.prepare_store(instance.client, &name, &self.keys, &mut self.out)?;
                complete(tier, instance.client, &self.keys, &self.out)?;
            }
            _ => write_back(tier, instance.client, &mut self.evicted, &mut self.out)?,
        }
        tier.finish_request(instance.client, &name)?;
        self.times.push(start.elapsed().as_secs_f64() * 1e6);
        // As the owner does once it has answered (no engine waits on it).
        tier.evict_ahead(usize::MAX);
        self.blocks += self.hashes.len() as u64;
        self.device_hits += device_hits as u64;
        self.host_hits += host_hits as u64;
        self.input_tokens += request.input_length as u64;
        Ok(())
    }

    /// The report of the requests served so far.
    pub fn finish(mut self) -> InstancesReport {
        let ratio =
            |part: u64, whole: u64| if whole == 0 { 0.0 } else { part as f64 / whole as f64 };
        let block_tokens = self.config.device.block_tokens;
        let hit_blocks = self.device_hits + self.host_hits;
        let hit_tokens = hit_blocks * u64::from(block_tokens);
        let stats: Vec<_> = self.tiers.iter().map(SharedTierIndex::stats).collect();
        InstancesReport {
            instances: self.config.instances,
            route: self.config.route,
            shared_host_tier: self.config.shared_host_tier,
            write_policy: self.config.write_policy.to_string(),
            block_tokens,
            device_blocks_per_instance: self.config.device.device_blocks,
            host_blocks: self.config.host_blocks,
            host_quota: self.config.host_quota.filter(|_| self.config.shared_host_tier),
            host_free_blocks: self.config.shared_host_tier.then(|| self.tiers[0].free_target()),
            requests: self.requests,
            requests_per_instance: self
                .instances
                .iter()
                .map(|instance| instance.requests)
                .collect(),
            failed_requests: self.failed_requests,
            blocks: self.blocks,
            hit_blocks,
            device_hit_blocks: self.device_hits,
            host_hit_blocks: self.host_hits,
            hit_rate_blocks: ratio(hit_blocks, self.blocks),
            input_tokens: self.input_tokens,
            hit_tokens,
            hit_rate_tokens: ratio(hit_tokens, self.input_tokens),
            host_stores: stats.iter().map(|stats| stats.keys_stored).sum(),
            host_evictions: stats.iter().map(|stats| stats.evictions).sum(),
            host_stores_refused: stats.iter().map(|stats| stats.stores_refused).sum(),
            us_per_request: Percentiles::of(&mut self.times),
        }
    }
}

/// Completes the store `out` prepared for `keys`, successfully (the copies land at once).
fn complete(
    tier: &mut SharedTierIndex,
    client: ClientId,
    keys: &[OffloadKey],
    out: &PreparedStore,
) -> anyhow::Result<()> {
    if out.to_store.is_empty() {
        return Ok(());
    }
    let stored: Vec<OffloadKey> = out.to_store.iter().map(|&index| keys[index as usize]).collect();
    tier.complete_store(client, &stored, true)?;
    Ok(())
}

/// Stores the blocks the device evicted, each under its parent where the tier holds it, parents
/// first.
fn write_back(
    tier: &mut SharedTierIndex,
    client: ClientId,
    evicted: &mut Vec<(BlockHash, Option<BlockHash>)>,
    out: &mut PreparedStore,
) -> anyhow::Result<()> {
    const REQUEST: &str = "write-back";
    while !evicted.is_empty() {
        // Those whose parent is not waiting to be stored too go first.
        let (mut ready, mut waiting): (Vec<_>, Vec<_>) =
            evicted.iter().copied().partition(|(_, parent)| {
                parent.is_none_or(|parent| evicted.iter().all(|&(hash, _)| hash != parent))
            });
        if ready.is_empty() {
            // Chained hashes make no cycles; should one appear, store the rest as they come.
            std::mem::swap(&mut ready, &mut waiting);
        }
        for (hash, parent) in ready {
            if let Some(parent) = parent {
                tier.link_parent(client, REQUEST, &key_of(parent))?;
            }
            let key = [key_of(hash)];
            tier.prepare_store(client, REQUEST, &key, out)?;
            complete(tier, client, &key, out)?;
        }
        *evicted = waiting;
    }
    tier.finish_request(client, REQUEST)?;
    Ok(())
}

/// Replays `requests` over instances (module flow).
pub fn replay_instances(
    requests: &[TraceRequest],
    config: InstanceConfig,
) -> anyhow::Result<InstancesReport> {
    let mut replayer = InstanceReplayer::new(config)?;
    for request in requests {
        replayer.serve(request)?;
    }
    Ok(replayer.finish())
}

/// `kvshm replay --instances N`: refuses the options a replay over instances does not model,
/// replays, and prints the report.
pub(super) fn run(args: &super::Args) -> anyhow::Result<()> {
    use crate::cli::checks::{fits_in_memory, within};
    let options = &args.instances;
    let instances = options.instances.expect("called with --instances");
    within(instances, 1..=4096, "--instances")?;
    anyhow::ensure!(args.host_blocks > 0, "--instances needs a host tier (--host-blocks)");
    anyhow::ensure!(args.storage_blocks == 0, "--instances replays no storage tier");
    anyhow::ensure!(
        args.free_watermark == 0,
        "--instances replays no --free-watermark (it sees device evictions at allocations)"
    );
    anyhow::ensure!(!args.reference_lru, "--reference-lru is not replayed with --instances");
    anyhow::ensure!(
        args.per_request_hits.is_none(),
        "--per-request-hits is not written with --instances"
    );
    anyhow::ensure!(
        !args.eviction.is_offline(),
        "--eviction {} needs one cache that sees the whole trace, not --instances",
        args.eviction
    );
    anyhow::ensure!(
        (options.host_quota.is_none() && options.host_free_blocks.is_none())
            || options.shared_host_tier,
        "--host-quota and --host-free-blocks need --shared-host-tier"
    );
    fits_in_memory(
        u128::from(instances)
            * u128::from(args.device_blocks)
            * (24 + crate::tree::PRESIZED_BYTES_PER_BLOCK as u128),
        format_args!("{instances} instances of --device-blocks {}", args.device_blocks),
    )?;
    let requests = crate::trace::read_trace(&args.trace, args.limit)?;
    let config = InstanceConfig {
        instances,
        route: options.route.unwrap_or_default(),
        route_seed: options.route_seed,
        device: CacheConfig::new(args.block_tokens, args.device_blocks)
            .with_eviction(args.eviction),
        host_blocks: args.host_blocks,
        shared_host_tier: options.shared_host_tier,
        host_quota: options.host_quota,
        host_free_blocks: options.host_free_blocks.unwrap_or(DEFAULT_FREE_CHUNKS),
        write_policy: args.write_policy,
        prompt_only: args.prompt_only,
    };
    let report = replay_instances(&requests, config)
        .map_err(|error| error.context("replaying the trace over instances"))?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{} requests over {} instances ({:?}, {} host tier, {}): hit rate {:.4} by tokens \
             ({} device + {} host blocks of {})",
            report.requests,
            report.instances,
            report.route,
            if report.shared_host_tier { "one shared" } else { "a per-instance" },
            report.write_policy,
            report.hit_rate_tokens,
            report.device_hit_blocks,
            report.host_hit_blocks,
            report.blocks
        );
        println!(
            "host stores {}, evictions {}, refused {}; failed requests {}; p50 {:.1} us per request",
            report.host_stores,
            report.host_evictions,
            report.host_stores_refused,
            report.failed_requests,
            report.us_per_request.p50
        );
    }
    Ok(())
}

/// Refuses the options of a replay over instances without `--instances`.
pub(super) fn refuse_without_instances(options: &InstanceArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        options.route.is_none()
            && !options.shared_host_tier
            && options.host_quota.is_none()
            && options.host_free_blocks.is_none(),
        "--route, --shared-host-tier, --host-quota and --host-free-blocks need --instances"
    );
    Ok(())
}

#[cfg(test)]
mod tests;
