//! [`ServiceConfig`]: one engine's whole set-up in one place, the cache manager's
//! ([`CacheConfig`]) and the shape of the ranks, rings and commands, from which the service
//! derives its transport's ([`TransportConfig`]) and the segment header kvctl reads.

use std::time::Duration;

use super::{
    Backend, SegmentConfig, TierBackoff, TransportConfig, DEFAULT_COMMAND_DEADLINE,
    DEFAULT_COMMAND_RING_SLOTS, DEFAULT_COMPLETION_RING_SLOTS, DEFAULT_MAX_COMMAND_BYTES,
    DEFAULT_TIER_BACKOFF,
};
use crate::manager::CacheConfig;

/// The shape of every rank's blocks, the cache above them and the service's rings.
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    pub cache: CacheConfig,
    pub tp_size: u32,
    pub layers: u32,
    /// Regions per block per rank (a multiple of `layers`).
    pub regions: u32,
    pub region_bytes: u64,
    pub backend: Backend,
    pub command_ring_slots: u32,
    pub completion_ring_slots: u32,
    /// Ask workers for per-layer progress of every copy.
    pub layerwise: bool,
    /// The most bytes one command asks one rank to copy (see [`TransportConfig`]).
    pub max_command_bytes: u64,
    /// How long a rank that owes answers may give none before its worker is fenced and its
    /// commands fail, as if it had crashed (see [`TransportConfig`]).
    pub command_deadline: Duration,
    /// How long to wait before probing a storage tier that is down, and how that wait grows
    /// (`tier_probe` module).
    pub storage_backoff: TierBackoff,
}

impl ServiceConfig {
    /// A host-backend service with rings sized for typical batches.
    pub fn new(
        cache: CacheConfig,
        tp_size: u32,
        layers: u32,
        regions: u32,
        region_bytes: u64,
    ) -> Self {
        ServiceConfig {
            cache,
            tp_size,
            layers,
            regions,
            region_bytes,
            backend: Backend::HostArena,
            command_ring_slots: DEFAULT_COMMAND_RING_SLOTS,
            completion_ring_slots: DEFAULT_COMPLETION_RING_SLOTS,
            layerwise: true,
            max_command_bytes: DEFAULT_MAX_COMMAND_BYTES,
            command_deadline: DEFAULT_COMMAND_DEADLINE,
            storage_backoff: DEFAULT_TIER_BACKOFF,
        }
    }

    /// The segment header's configuration.
    pub fn segment_config(&self) -> SegmentConfig {
        let (write_policy, write_threshold) = self.cache.write_policy.to_wire();
        SegmentConfig {
            block_tokens: self.cache.block_tokens,
            tp_size: self.tp_size,
            device_blocks: self.cache.device_blocks,
            host_blocks: self.cache.host_blocks,
            regions: self.regions,
            layers: self.layers,
            region_bytes: self.region_bytes,
            write_policy,
            write_threshold,
            command_ring_slots: self.command_ring_slots,
            completion_ring_slots: self.completion_ring_slots,
            backend: self.backend.to_wire(),
            copies: SegmentConfig::COPIES_BY_WORKERS,
            ..SegmentConfig::default()
        }
    }

    /// The transport under the service.
    pub fn transport_config(&self) -> TransportConfig {
        TransportConfig {
            layerwise: self.layerwise,
            max_command_bytes: self.max_command_bytes,
            command_deadline: self.command_deadline,
            ..TransportConfig::new(self.segment_config())
        }
    }
}
