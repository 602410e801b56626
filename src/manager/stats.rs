//! Counters of what the manager did, and the `stats()` snapshot built from them.

use serde::Serialize;

use super::{CacheManager, Lookup};

/// Prefix hits, per tier, in blocks and in prompt tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Hits {
    pub device_blocks: u64,
    pub host_blocks: u64,
    pub device_tokens: u64,
    pub host_tokens: u64,
    pub storage_blocks: u64,
    pub storage_tokens: u64,
}

/// Blocks that left a tier to make room.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Evictions {
    /// Device copies dropped with no host copy kept (the node left the tree).
    pub device_dropped: u64,
    /// Device copies dropped because a host backup existed (metadata only).
    pub device_to_host_metadata: u64,
    /// Device copies written to host before leaving (write-back or emergency copies).
    pub device_written_back: u64,
    /// Host copies dropped (no storage copy kept: the node left the tree, or kept its device
    /// copy).
    pub host_dropped: u64,
    /// Host copies dropped because the storage tier held the block (metadata only).
    pub host_to_storage_metadata: u64,
    /// Host copies written to storage before leaving (write-back).
    pub host_written_back: u64,
    /// Storage-only blocks dropped to make room on the storage tier.
    pub storage_dropped: u64,
}

impl Evictions {
    /// Blocks evicted from the device tier, however they left.
    pub fn device_total(&self) -> u64 {
        self.device_dropped + self.device_to_host_metadata + self.device_written_back
    }
}

/// What the manager counts as it works; part of every [`CacheStats`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CacheCounters {
    /// `match_prefix` calls and the blocks they asked about.
    pub matches: u64,
    pub queried_blocks: u64,
    pub hits: Hits,
    pub evictions: Evictions,
    /// Blocks whose host-to-device copy was issued, and landed.
    pub swap_in_blocks_issued: u64,
    pub swap_in_blocks: u64,
    /// Blocks evicted to host whose copy landed.
    pub swap_out_blocks: u64,
    /// Backups issued, and landed.
    pub backups_issued: u64,
    pub backup_blocks: u64,
    /// Copies that failed as a whole (a device copy, a worker error, a dead worker, a storage
    /// command the tier failed); a storage copy with only some blocks missed is not one
    /// (`store_failed_blocks`, `load_failed_blocks` count those).
    pub failed_transfers: u64,
    /// Completions of copies from before a reset.
    pub stale_completions: u64,
    pub failed_allocations: u64,
    pub committed_blocks: u64,
    /// Committed blocks that were cached already.
    pub duplicate_blocks: u64,
    pub finished_requests: u64,
    pub aborted_requests: u64,
    pub resets: u64,
    /// Blocks whose host-to-storage write (STORE) was issued, and landed.
    pub store_blocks_issued: u64,
    pub stored_blocks: u64,
    /// Blocks whose storage-to-host read (LOAD) was issued, and landed.
    pub load_blocks_issued: u64,
    pub loaded_blocks: u64,
    /// Blocks of failed STOREs and LOADs (a miss or an error of the tier).
    pub store_failed_blocks: u64,
    pub load_failed_blocks: u64,
    /// Prefetch calls that started a LOAD or a QUERY (and returned a ticket).
    pub prefetches: u64,
    /// Blocks prefetch LOADs were issued for (also counted in `load_blocks_issued`).
    pub prefetch_load_blocks: u64,
    /// Blocks whose prefetch LOAD failed or was cancelled (storage-only again).
    pub prefetch_failed_blocks: u64,
    /// Blocks prefetches asked the tier about (QUERY), and those found and adopted.
    pub prefetch_query_blocks: u64,
    pub prefetch_found_blocks: u64,
    /// Stored blocks given up because their parent never came back (forgotten on the tier).
    pub expired_orphans: u64,
    /// Blocks a LOAD found missing or damaged on the tier, per block (each no hit from then on,
    /// dropped with its subtree once no request holds it; a holder may recompute it instead).
    pub load_missing_blocks: u64,
    /// Blocks dropped because the tier lost them: a missing block and the storage-only blocks
    /// below it, once unheld (not counted as storage evictions).
    pub lost_blocks_dropped: u64,
    /// Tickets whose hit a LOAD's miss shortened (the request computes the rest).
    pub shortened_tickets: u64,
    /// Shortenings that found no device block for a request sharing a lost block with another
    /// (its ticket failed instead).
    pub shortening_failed: u64,
    /// Write-through STOREs skipped because the tier was full of blocks it holds alone.
    pub write_through_skipped: u64,
    /// Times the storage tier was marked down (a completion said it failed), and the work
    /// not routed to it while it was down: host evictions that dropped a block instead of
    /// writing it back, write-through STOREs skipped, prefetches that did nothing, storage
    /// copies settled unissued when the tier went down, and stored blocks kept as orphans
    /// when their host-only parent was dropped (`tier_health`).
    pub storage_outages: u64,
    pub storage_down_dropped_blocks: u64,
    pub storage_down_skipped_stores: u64,
    pub storage_down_skipped_prefetches: u64,
    pub storage_down_settled_copies: u64,
    pub storage_down_orphaned_blocks: u64,
}

impl CacheCounters {
    pub fn record_match(&mut self, queried: usize, found: Lookup, block_tokens: usize) {
        self.matches += 1;
        self.queried_blocks += queried as u64;
        self.record_hits(found, block_tokens);
    }

    /// Counts hits per tier, in blocks and tokens.
    pub fn record_hits(&mut self, found: Lookup, block_tokens: usize) {
        let tokens = |blocks: usize| (blocks * block_tokens) as u64;
        self.hits.device_blocks += found.device_blocks as u64;
        self.hits.host_blocks += found.host_blocks as u64;
        self.hits.storage_blocks += found.storage_blocks as u64;
        self.hits.device_tokens += tokens(found.device_blocks);
        self.hits.host_tokens += tokens(found.host_blocks);
        self.hits.storage_tokens += tokens(found.storage_blocks);
    }
}

/// A snapshot of the manager's sizes and counters.
#[derive(Clone, Debug, Serialize)]
pub struct CacheStats {
    pub generation: u64,
    pub block_tokens: u32,
    pub device_blocks: u32,
    pub device_free: usize,
    pub host_blocks: u32,
    pub host_free: usize,
    /// Capacity of the storage tier (0: none), and the blocks it holds or is being written.
    pub storage_blocks: u32,
    pub storage_used: u32,
    /// Whether the storage tier is marked down (`CacheManager::storage_tier_down`).
    pub storage_tier_down: bool,
    /// Nodes in the tree (cached blocks, any tier).
    pub cached_blocks: usize,
    pub live_requests: usize,
    pub transfers_in_flight: usize,
    /// The counters, flattened into the same JSON object.
    #[serde(flatten)]
    pub counters: CacheCounters,
}

impl CacheManager {
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            generation: self.generation,
            block_tokens: self.config.block_tokens,
            device_blocks: self.device.capacity(),
            device_free: self.device.free_count(),
            host_blocks: self.host.capacity(),
            host_free: self.host.free_count(),
            storage_blocks: self.config.storage_blocks,
            storage_used: self.storage_used,
            storage_tier_down: self.tier.is_down(),
            cached_blocks: self.tree.len(),
            live_requests: self.requests.len(),
            transfers_in_flight: self.in_flight.len(),
            counters: self.stats.clone(),
        }
    }
}
