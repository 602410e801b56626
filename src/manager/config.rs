//! The cache manager's configuration and its write policies (DESIGN §4.3).

pub use crate::tree::{EvictionPolicy, ParseEvictionPolicyError};
pub use kvshm_ipc::config::{ParseWritePolicyError, WritePolicy};
use serde::{Serialize, Serializer};

/// The sizes and policies of one cache.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CacheConfig {
    /// Tokens per block.
    pub block_tokens: u32,
    /// Blocks of the device tier.
    pub device_blocks: u32,
    /// Blocks of the host tier; 0 disables it.
    pub host_blocks: u32,
    /// Serialised by name (`write_through_selective:2`), as the command line writes it.
    #[serde(serialize_with = "serialize_by_name")]
    pub write_policy: WritePolicy,
    /// `poll()` evicts ahead of demand to keep this many device blocks free (or on their way to
    /// free); 0 evicts only on demand.
    pub free_watermark: u32,
    /// The order in which evictable blocks go (serialised by name, as `--eviction` writes it).
    pub eviction: EvictionPolicy,
    /// Blocks of the storage tier below host (per rank: the slab's slots, or a budget for
    /// Redis); 0 disables it. It needs a host tier: blocks reach storage through host blocks.
    pub storage_blocks: u32,
    /// When host blocks are written to the storage tier (serialised by name).
    #[serde(serialize_with = "serialize_storage_policy")]
    pub storage_write_policy: StorageWritePolicy,
}

/// When blocks of the host tier are written to the storage tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum StorageWritePolicy {
    /// A host block is written when it leaves the host tier (its eviction), unless the tier holds
    /// it already: the default.
    #[default]
    WriteBack,
    /// Every block that settles in the host tier is also written at once (by `poll`), so that
    /// its later eviction from host costs no write.
    WriteThrough,
    /// As `WriteThrough`, for the blocks that settle in the host tier with at least `threshold`
    /// hits (as the host tier's selective policy); the others are written back when they leave.
    WriteThroughSelective { threshold: u32 },
}

impl StorageWritePolicy {
    /// Whether a block that settles in the host tier with `hits` hits is written at once.
    pub(crate) fn writes_through(self, hits: u32) -> bool {
        match self {
            StorageWritePolicy::WriteBack => false,
            StorageWritePolicy::WriteThrough => true,
            StorageWritePolicy::WriteThroughSelective { threshold } => hits >= threshold,
        }
    }
}

impl std::fmt::Display for StorageWritePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StorageWritePolicy::WriteBack => f.write_str("write_back"),
            StorageWritePolicy::WriteThrough => f.write_str("write_through"),
            StorageWritePolicy::WriteThroughSelective { threshold } => {
                write!(f, "write_through_selective:{threshold}")
            }
        }
    }
}

/// A storage write policy name that is not known.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown storage write policy {0:?} (known: write_back, write_through, \
     write_through_selective:T with T >= 1)"
)]
pub struct ParseStorageWritePolicyError(pub String);

impl std::str::FromStr for StorageWritePolicy {
    type Err = ParseStorageWritePolicyError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        let unknown = || ParseStorageWritePolicyError(name.to_owned());
        match name {
            "write_back" => Ok(StorageWritePolicy::WriteBack),
            "write_through" => Ok(StorageWritePolicy::WriteThrough),
            _ => {
                let threshold =
                    name.strip_prefix("write_through_selective:").ok_or_else(unknown)?;
                match threshold.parse::<u32>() {
                    Ok(threshold) if threshold >= 1 => {
                        Ok(StorageWritePolicy::WriteThroughSelective { threshold })
                    }
                    _ => Err(unknown()),
                }
            }
        }
    }
}

fn serialize_storage_policy<S: Serializer>(
    policy: &StorageWritePolicy,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.collect_str(policy)
}

impl CacheConfig {
    /// A device-only cache with write-back (used once a host tier is added) and no watermark.
    pub fn new(block_tokens: u32, device_blocks: u32) -> CacheConfig {
        CacheConfig {
            block_tokens,
            device_blocks,
            host_blocks: 0,
            write_policy: WritePolicy::WriteBack,
            free_watermark: 0,
            eviction: EvictionPolicy::default(),
            storage_blocks: 0,
            storage_write_policy: StorageWritePolicy::WriteBack,
        }
    }

    /// A storage tier of `storage_blocks` blocks (0: none). A manager driven without the service
    /// must then also drain what it queues for the tier, after each operation, as the service
    /// does: the blocks to forget ([`super::CacheManager::take_forgotten_blocks`]) and the QUERYs
    /// of prefetches ([`super::CacheManager::take_storage_queries`], each answered with
    /// [`super::CacheManager::complete_storage_query`]); both queues grow until taken, and a
    /// prefetch ticket waits for its QUERY's answer.
    pub fn with_storage_blocks(mut self, storage_blocks: u32) -> CacheConfig {
        self.storage_blocks = storage_blocks;
        self
    }

    pub fn with_storage_write_policy(mut self, policy: StorageWritePolicy) -> CacheConfig {
        self.storage_write_policy = policy;
        self
    }

    pub fn with_host_blocks(mut self, host_blocks: u32) -> CacheConfig {
        self.host_blocks = host_blocks;
        self
    }

    pub fn with_write_policy(mut self, write_policy: WritePolicy) -> CacheConfig {
        self.write_policy = write_policy;
        self
    }

    pub fn with_free_watermark(mut self, free_watermark: u32) -> CacheConfig {
        self.free_watermark = free_watermark;
        self
    }

    pub fn with_eviction(mut self, eviction: EvictionPolicy) -> CacheConfig {
        self.eviction = eviction;
        self
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.block_tokens == 0 {
            return Err(ConfigError::ZeroBlockTokens);
        }
        if self.storage_blocks > 0 && self.host_blocks == 0 {
            return Err(ConfigError::StorageWithoutHost { storage_blocks: self.storage_blocks });
        }
        for (tier, blocks) in [("device", self.device_blocks), ("host", self.host_blocks)] {
            if blocks == MAX_BLOCKS {
                return Err(ConfigError::TooManyBlocks { tier, blocks, max: MAX_BLOCKS - 1 });
            }
        }
        if let WritePolicy::WriteThroughSelective { threshold } = self.write_policy {
            if threshold == 0 {
                return Err(ConfigError::ZeroThreshold);
            }
            if threshold > MAX_HIT_THRESHOLD {
                return Err(ConfigError::ThresholdTooHigh { threshold, max: MAX_HIT_THRESHOLD });
            }
        }
        if let StorageWritePolicy::WriteThroughSelective { threshold } = self.storage_write_policy {
            if threshold == 0 {
                return Err(ConfigError::ZeroThreshold);
            }
            if threshold > MAX_HIT_THRESHOLD {
                return Err(ConfigError::ThresholdTooHigh { threshold, max: MAX_HIT_THRESHOLD });
            }
        }
        if self.free_watermark > self.device_blocks {
            return Err(ConfigError::WatermarkAboveCapacity {
                watermark: self.free_watermark,
                device_blocks: self.device_blocks,
            });
        }
        Ok(())
    }
}

fn serialize_by_name<S: Serializer>(
    policy: &WritePolicy,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.collect_str(policy)
}

/// Block ids are u32 with one value kept as a marker.
const MAX_BLOCKS: u32 = u32::MAX;

/// Nodes count hits in 16 bits (saturating), so a higher threshold could never be reached.
const MAX_HIT_THRESHOLD: u32 = u16::MAX as u32;

/// A configuration the cache manager refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("block_tokens must be at least 1")]
    ZeroBlockTokens,
    #[error("{blocks} {tier} blocks is more than the {max} a u32 block id can name")]
    TooManyBlocks { tier: &'static str, blocks: u32, max: u32 },
    #[error("the write_through_selective threshold must be at least 1")]
    ZeroThreshold,
    #[error(
        "the write_through_selective threshold {threshold} is above the {max} hits a node counts"
    )]
    ThresholdTooHigh { threshold: u32, max: u32 },
    #[error("free watermark {watermark} is above the {device_blocks} device blocks")]
    WatermarkAboveCapacity { watermark: u32, device_blocks: u32 },
    #[error(
        "the {0} eviction policy needs the future of the trace: only `kvshm replay` can run it"
    )]
    OfflinePolicy(EvictionPolicy),
    #[error("the {0} eviction policy is online: it takes no future")]
    OnlinePolicy(EvictionPolicy),
    #[error(
        "a storage tier of {storage_blocks} blocks needs a host tier: blocks reach storage \
         through host blocks"
    )]
    StorageWithoutHost { storage_blocks: u32 },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_policies_round_trip_through_text_and_wire() {
        for policy in [
            WritePolicy::WriteBack,
            WritePolicy::WriteThrough,
            WritePolicy::WriteThroughSelective { threshold: 3 },
        ] {
            assert_eq!(policy.to_string().parse::<WritePolicy>(), Ok(policy));
            let (code, threshold) = policy.to_wire();
            assert_eq!(WritePolicy::from_wire(code, threshold), Ok(policy));
            let config = CacheConfig::new(16, 4).with_write_policy(policy);
            let json = serde_json::to_value(&config).unwrap();
            assert_eq!(json["write_policy"], policy.to_string());
        }
    }

    #[test]
    fn malformed_write_policies_are_refused() {
        for text in ["", "write_through_selective:0", "write_through_selective:x", "lru"] {
            assert!(text.parse::<WritePolicy>().is_err(), "{text}");
        }
        let (selective, _) = WritePolicy::WriteThroughSelective { threshold: 1 }.to_wire();
        assert!(WritePolicy::from_wire(selective, 0).is_err());
        assert!(WritePolicy::from_wire(9, 1).is_err());
    }

    #[test]
    fn a_watermark_above_the_device_tier_is_refused() {
        let config = CacheConfig::new(16, 4).with_free_watermark(5);
        assert_eq!(
            config.validate(),
            Err(ConfigError::WatermarkAboveCapacity { watermark: 5, device_blocks: 4 })
        );
        assert_eq!(CacheConfig::new(0, 4).validate(), Err(ConfigError::ZeroBlockTokens));
    }

    #[test]
    fn a_selective_threshold_no_hit_count_reaches_is_refused() {
        let policy = WritePolicy::WriteThroughSelective { threshold: 65_536 };
        assert_eq!(
            CacheConfig::new(16, 4).with_write_policy(policy).validate(),
            Err(ConfigError::ThresholdTooHigh { threshold: 65_536, max: 65_535 })
        );
        let policy = WritePolicy::WriteThroughSelective { threshold: 65_535 };
        assert_eq!(CacheConfig::new(16, 4).with_write_policy(policy).validate(), Ok(()));
    }

    #[test]
    fn a_storage_tier_needs_a_host_tier_and_its_policy_round_trips_by_name() {
        let config = CacheConfig::new(16, 4).with_storage_blocks(8);
        assert_eq!(config.validate(), Err(ConfigError::StorageWithoutHost { storage_blocks: 8 }));
        assert_eq!(config.with_host_blocks(2).validate(), Ok(()));
        for policy in [
            StorageWritePolicy::WriteBack,
            StorageWritePolicy::WriteThrough,
            StorageWritePolicy::WriteThroughSelective { threshold: 2 },
        ] {
            assert_eq!(policy.to_string().parse::<StorageWritePolicy>(), Ok(policy));
        }
        for bad in ["write_through_selective:0", "write_through_selective:", "sometimes"] {
            assert!(bad.parse::<StorageWritePolicy>().is_err(), "{bad}");
        }
        let selective = |threshold| {
            CacheConfig::new(16, 4)
                .with_host_blocks(2)
                .with_storage_blocks(8)
                .with_storage_write_policy(StorageWritePolicy::WriteThroughSelective { threshold })
                .validate()
        };
        assert_eq!(selective(3), Ok(()));
        assert_eq!(selective(0), Err(ConfigError::ZeroThreshold));
        assert_eq!(
            selective(70_000),
            Err(ConfigError::ThresholdTooHigh { threshold: 70_000, max: 65_535 })
        );
        let json = serde_json::to_value(CacheConfig::new(16, 4)).unwrap();
        assert_eq!(
            (json["storage_blocks"].as_u64(), json["storage_write_policy"].as_str()),
            (Some(0), Some("write_back"))
        );
    }

    #[test]
    fn the_eviction_policy_serialises_by_name() {
        let json = serde_json::to_value(CacheConfig::new(16, 4)).unwrap();
        assert_eq!(json["eviction"], "lru");
        let conv = CacheConfig::new(16, 4).with_eviction(EvictionPolicy::Conv);
        assert_eq!(serde_json::to_value(conv).unwrap()["eviction"], "conv");
    }

    #[test]
    fn only_the_offline_policy_takes_the_future_and_it_needs_it() {
        use crate::manager::{CacheManager, FutureUses};
        let optimal = CacheConfig::new(16, 4).with_eviction(EvictionPolicy::Optimal);
        let refused = CacheManager::new(optimal.clone()).unwrap_err();
        assert_eq!(refused, ConfigError::OfflinePolicy(EvictionPolicy::Optimal));
        assert!(refused.to_string().contains("kvshm replay"), "{refused}");
        assert!(CacheManager::with_future(optimal, FutureUses::default()).is_ok());
        for online in EvictionPolicy::online() {
            let config = CacheConfig::new(16, 4).with_eviction(online);
            assert!(CacheManager::new(config.clone()).is_ok());
            let refused = CacheManager::with_future(config, FutureUses::default()).unwrap_err();
            assert_eq!(refused, ConfigError::OnlinePolicy(online));
        }
    }
}
