//! What the service tells kvctl, and what kvctl asks of it, through the segment.
//!
//! kvctl never touches the cache itself. It reads the live counters that [`Service::poll`]
//! publishes here, and it leaves requests in the segment's control area that `poll` carries out
//! on the scheduler thread:
//!
//! 1. a reset request (with or without force) runs [`Service::reset`] and answers with its status;
//! 2. a tree-snapshot request serialises the manager's tree down to the asked depth as JSON into
//!    the snapshot area.

use kvshm_ipc::control::ResetStatus;
use kvshm_ipc::counters::Counter;
use tracing::warn;

use super::Service;
use crate::manager::ResetError;

impl Service {
    /// Carries out the kvctl requests waiting in the control area.
    pub(super) fn serve_control_requests(&mut self) {
        if let Some(request) = self.transport.segment().control().pending_reset() {
            let status = match self.reset(request.force) {
                Ok(dropped) => {
                    if !dropped.is_empty() {
                        warn!(requests = dropped.len(), "a forced kvctl reset ended live requests");
                    }
                    self.requests_dropped_by_kvctl.extend(dropped);
                    ResetStatus::Done
                }
                Err(error @ ResetError::RequestsHoldBlocks { .. }) => {
                    warn!(%error, "kvctl reset refused");
                    ResetStatus::RefusedBusy
                }
            };
            self.transport.segment().control().complete_reset(request, status);
        }
        if let Some(request) = self.transport.segment().control().pending_snapshot() {
            let snapshot = self.manager.tree_snapshot(request.depth);
            let json = serde_json::to_vec(&snapshot).expect("a tree snapshot always serialises");
            if let Err(error) = self.transport.segment().control().publish_snapshot(request, &json)
            {
                warn!(%error, "tree snapshot not published");
            }
        }
    }

    /// Stores the transport's, the manager's and the service's figures in the segment's live
    /// counters.
    pub(super) fn publish_counters(&self) {
        self.transport.publish_counters();
        let counters = self.transport.segment().counters();
        let service = self.stats();
        let cache = self.manager.stats();
        let values = [
            (Counter::DeviceBlocksTotal, u64::from(cache.device_blocks)),
            (Counter::DeviceBlocksFree, cache.device_free as u64),
            (Counter::HostBlocksTotal, u64::from(cache.host_blocks)),
            (Counter::HostBlocksFree, cache.host_free as u64),
            (Counter::CachedNodes, cache.cached_blocks as u64),
            (Counter::DeviceHitBlocks, cache.counters.hits.device_blocks),
            (Counter::HostHitBlocks, cache.counters.hits.host_blocks),
            (Counter::StorageHitBlocks, cache.counters.hits.storage_blocks),
            (Counter::StorageBlocksTotal, u64::from(cache.storage_blocks)),
            (Counter::StorageBlocksUsed, u64::from(cache.storage_used)),
            (Counter::Prefetches, cache.counters.prefetches),
            (Counter::PrefetchLoadBlocks, cache.counters.prefetch_load_blocks),
            (Counter::PrefetchFoundBlocks, cache.counters.prefetch_found_blocks),
            (Counter::PrefetchFailedBlocks, cache.counters.prefetch_failed_blocks),
            (Counter::PrefetchQueryBlocks, cache.counters.prefetch_query_blocks),
            (Counter::ExpiredOrphans, cache.counters.expired_orphans),
            (Counter::LoadMissingBlocks, cache.counters.load_missing_blocks),
            (Counter::LostBlocksDropped, cache.counters.lost_blocks_dropped),
            (Counter::ShortenedTickets, cache.counters.shortened_tickets),
            (Counter::WriteThroughSkipped, cache.counters.write_through_skipped),
            (Counter::StorageForgetFailures, service.storage_forget_failures),
            (Counter::StorageTierDown, u64::from(self.manager.storage_tier_down())),
            (Counter::StorageTierDownSinceNs, self.tier_watch.down_since_ns()),
            (Counter::StorageTierOutages, cache.counters.storage_outages),
            (Counter::StorageTierProbes, service.storage_tier_probes),
            (Counter::StorageTierProbesFailed, service.storage_tier_probes_failed),
            (
                Counter::StorageDownSkippedBlocks,
                cache.counters.storage_down_dropped_blocks
                    + cache.counters.storage_down_skipped_stores,
            ),
            (Counter::StorageForgetsDropped, service.storage_forgets_dropped),
            (
                // Saturating: a rematch given more hashes than its match counts hits among
                // blocks that match never queried.
                Counter::MissBlocks,
                cache.counters.queried_blocks.saturating_sub(
                    cache.counters.hits.device_blocks
                        + cache.counters.hits.host_blocks
                        + cache.counters.hits.storage_blocks,
                ),
            ),
            (
                Counter::HitTokens,
                cache.counters.hits.device_tokens
                    + cache.counters.hits.host_tokens
                    + cache.counters.hits.storage_tokens,
            ),
            (Counter::Lookups, cache.counters.matches),
            (Counter::RequestsLive, cache.live_requests as u64),
            (
                Counter::Evictions,
                cache.counters.evictions.device_total() + cache.counters.evictions.host_dropped,
            ),
            (Counter::SwapsIn, cache.counters.swap_in_blocks),
            (Counter::SwapsOut, cache.counters.swap_out_blocks),
            (Counter::Backups, cache.counters.backup_blocks),
            (Counter::BytesCopied, service.bytes_copied),
            (Counter::CopyFailures, service.copy_failures),
            (Counter::Resets, service.resets),
            (
                Counter::DroppedNodes,
                cache.counters.evictions.device_dropped + cache.counters.evictions.host_dropped,
            ),
        ];
        for (counter, value) in values {
            counters.set(counter, value);
        }
    }
}
