//! The cache manager's configuration and its write policies (SPEC section 6).

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

/// What happens to a block's host copy (host tier enabled).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case", tag = "policy")]
pub enum WritePolicy {
    /// A device eviction of a node without a host copy writes it to host.
    WriteBack,
    /// Every committed block is backed up to host on the next poll; evicting a backed-up node
    /// from device is metadata only.
    WriteThrough,
    /// A node is backed up once its hit count reaches `threshold`; evicting a node that reached
    /// it without a backup writes it to host, any other node is dropped.
    WriteThroughSelective { threshold: u32 },
}

impl WritePolicy {
    const WIRE_WRITE_BACK: u32 = 1;
    const WIRE_WRITE_THROUGH: u32 = 2;
    const WIRE_WRITE_THROUGH_SELECTIVE: u32 = 3;

    /// The policy as the segment header records it: `(code, threshold)`, threshold 0 unless
    /// selective.
    pub fn to_wire(self) -> (u32, u32) {
        match self {
            WritePolicy::WriteBack => (Self::WIRE_WRITE_BACK, 0),
            WritePolicy::WriteThrough => (Self::WIRE_WRITE_THROUGH, 0),
            WritePolicy::WriteThroughSelective { threshold } => {
                (Self::WIRE_WRITE_THROUGH_SELECTIVE, threshold)
            }
        }
    }

    /// Decodes a policy read from shared memory.
    pub fn from_wire(code: u32, threshold: u32) -> Result<WritePolicy, UnknownWritePolicy> {
        match code {
            Self::WIRE_WRITE_BACK => Ok(WritePolicy::WriteBack),
            Self::WIRE_WRITE_THROUGH => Ok(WritePolicy::WriteThrough),
            Self::WIRE_WRITE_THROUGH_SELECTIVE if threshold > 0 => {
                Ok(WritePolicy::WriteThroughSelective { threshold })
            }
            _ => Err(UnknownWritePolicy { code, threshold }),
        }
    }
}

impl fmt::Display for WritePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WritePolicy::WriteBack => f.write_str("write_back"),
            WritePolicy::WriteThrough => f.write_str("write_through"),
            WritePolicy::WriteThroughSelective { threshold } => {
                write!(f, "write_through_selective:{threshold}")
            }
        }
    }
}

/// A write-policy code (and threshold) that this version does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown write policy code {code} (threshold {threshold})")]
pub struct UnknownWritePolicy {
    pub code: u32,
    pub threshold: u32,
}

/// A write policy written as anything but `write_back`, `write_through` or
/// `write_through_selective:T` with T ≥ 1.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown write policy {text:?}: expected write_back, write_through or write_through_selective:T (T >= 1)")]
pub struct ParseWritePolicyError {
    pub text: String,
}

impl FromStr for WritePolicy {
    type Err = ParseWritePolicyError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let error = || ParseWritePolicyError { text: text.to_owned() };
        match text {
            "write_back" => Ok(WritePolicy::WriteBack),
            "write_through" => Ok(WritePolicy::WriteThrough),
            _ => {
                let threshold = text.strip_prefix("write_through_selective:").ok_or_else(error)?;
                match threshold.parse::<u32>() {
                    Ok(threshold) if threshold > 0 => {
                        Ok(WritePolicy::WriteThroughSelective { threshold })
                    }
                    _ => Err(error()),
                }
            }
        }
    }
}

/// The sizes and policies of one cache.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CacheConfig {
    /// Tokens per block.
    pub block_tokens: u32,
    /// Blocks of the device tier.
    pub device_blocks: u32,
    /// Blocks of the host tier; 0 disables it.
    pub host_blocks: u32,
    pub write_policy: WritePolicy,
    /// `poll()` evicts ahead of demand to keep this many device blocks free (or on their way to
    /// free); 0 evicts only on demand.
    pub free_watermark: u32,
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
        }
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

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.block_tokens == 0 {
            return Err(ConfigError::ZeroBlockTokens);
        }
        for (tier, blocks) in [("device", self.device_blocks), ("host", self.host_blocks)] {
            if blocks == MAX_BLOCKS {
                return Err(ConfigError::TooManyBlocks { tier, blocks, max: MAX_BLOCKS - 1 });
            }
        }
        if let WritePolicy::WriteThroughSelective { threshold: 0 } = self.write_policy {
            return Err(ConfigError::ZeroThreshold);
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

/// Block ids are u32 with one value kept as a marker.
const MAX_BLOCKS: u32 = u32::MAX;

/// A configuration the cache manager refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("block_tokens must be at least 1")]
    ZeroBlockTokens,
    #[error("{blocks} {tier} blocks is more than the {max} a u32 block id can name")]
    TooManyBlocks { tier: &'static str, blocks: u32, max: u32 },
    #[error("the write_through_selective threshold must be at least 1")]
    ZeroThreshold,
    #[error("free watermark {watermark} is above the {device_blocks} device blocks")]
    WatermarkAboveCapacity { watermark: u32, device_blocks: u32 },
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
        }
    }

    #[test]
    fn malformed_write_policies_are_refused() {
        for text in ["", "write_through_selective:0", "write_through_selective:x", "lru"] {
            assert!(text.parse::<WritePolicy>().is_err(), "{text}");
        }
        assert!(WritePolicy::from_wire(3, 0).is_err());
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
}
