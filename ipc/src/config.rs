//! The configuration a segment is created with, as stored in its header.
//!
//! [`SegmentConfig`] is plain old data: the creator writes it once, and every attacher copies it out
//! and runs [`SegmentConfig::validate`] before trusting any size derived from it, because a header
//! is input from another process. Enumerations travel as u32 codes ([`WritePolicy`], [`Backend`])
//! and decode through fallible functions.
//!
//! Flow: 1. the engine fills a `SegmentConfig` (start from `Default`); 2. `Segment::create` calls
//! `validate()` and derives the layout from it; 3. attachers validate the copy they read.

use bytemuck::{Pod, Zeroable};
use thiserror::Error;

/// The largest tensor-parallel size a segment supports (worker slots and rank areas per segment).
pub const MAX_RANKS: u32 = 8;
/// The largest number of regions per block per rank (bounds the device-handle area).
pub const MAX_REGIONS: u32 = 4096;
/// The largest command ring, in slots.
pub const MAX_COMMAND_RING_SLOTS: u32 = 1 << 20;
/// The largest completion ring, in records (also the size of the layer-progress table).
pub const MAX_COMPLETION_RING_SLOTS: u32 = 1 << 16;
/// The smallest ring: a command needs a header slot and at least one pair slot.
pub const MIN_RING_SLOTS: u32 = 2;

/// How device blocks reach the host tier (DESIGN §4.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WritePolicy {
    /// Copy to host only when a device block is evicted.
    WriteBack,
    /// Back every committed block up to host.
    WriteThrough,
    /// Back a node up when its hit count reaches `threshold`.
    WriteThroughSelective { threshold: u32 },
}

impl WritePolicy {
    pub const WRITE_BACK: u32 = 0;
    pub const WRITE_THROUGH: u32 = 1;
    pub const WRITE_THROUGH_SELECTIVE: u32 = 2;

    /// The (code, threshold) pair stored in [`SegmentConfig`].
    pub fn to_wire(self) -> (u32, u32) {
        match self {
            WritePolicy::WriteBack => (Self::WRITE_BACK, 0),
            WritePolicy::WriteThrough => (Self::WRITE_THROUGH, 0),
            WritePolicy::WriteThroughSelective { threshold } => {
                (Self::WRITE_THROUGH_SELECTIVE, threshold)
            }
        }
    }

    pub fn from_wire(code: u32, threshold: u32) -> Result<WritePolicy, ConfigError> {
        match code {
            Self::WRITE_BACK => Ok(WritePolicy::WriteBack),
            Self::WRITE_THROUGH => Ok(WritePolicy::WriteThrough),
            Self::WRITE_THROUGH_SELECTIVE if threshold == 0 => Err(ConfigError::ZeroWriteThreshold),
            Self::WRITE_THROUGH_SELECTIVE => Ok(WritePolicy::WriteThroughSelective { threshold }),
            code => Err(ConfigError::UnknownWritePolicy { code }),
        }
    }

    /// The name used in configuration files and by kvctl.
    pub fn name(self) -> &'static str {
        match self {
            WritePolicy::WriteBack => "write_back",
            WritePolicy::WriteThrough => "write_through",
            WritePolicy::WriteThroughSelective { .. } => "write_through_selective",
        }
    }
}

impl std::fmt::Display for WritePolicy {
    /// `write_back`, `write_through` or `write_through_selective:T`, as [`FromStr`] reads them.
    ///
    /// [`FromStr`]: std::str::FromStr
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WritePolicy::WriteThroughSelective { threshold } => {
                write!(f, "{}:{threshold}", self.name())
            }
            other => f.write_str(other.name()),
        }
    }
}

/// A write policy written as anything but `write_back`, `write_through` or
/// `write_through_selective:T` with T >= 1.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("unknown write policy {text:?}: expected write_back, write_through or write_through_selective:T (T >= 1)")]
pub struct ParseWritePolicyError {
    pub text: String,
}

impl std::str::FromStr for WritePolicy {
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

/// Where the device tier lives and which copy engine workers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// The "device" is a shared-memory arena per rank (machines without a GPU, and every test).
    HostArena,
    /// The device tier is the engine's GPU memory, reached through CUDA IPC handles.
    Cuda,
}

impl Backend {
    pub const HOST_ARENA: u32 = 0;
    pub const CUDA: u32 = 1;

    pub fn to_wire(self) -> u32 {
        match self {
            Backend::HostArena => Self::HOST_ARENA,
            Backend::Cuda => Self::CUDA,
        }
    }

    pub fn from_wire(code: u32) -> Result<Backend, ConfigError> {
        match code {
            Self::HOST_ARENA => Ok(Backend::HostArena),
            Self::CUDA => Ok(Backend::Cuda),
            code => Err(ConfigError::UnknownBackend { code }),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::HostArena => "host_arena",
            Backend::Cuda => "cuda",
        }
    }
}

/// Why a configuration cannot describe a segment.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConfigError {
    #[error("block_tokens must be at least 1")]
    ZeroBlockTokens,
    #[error("tp_size {tp_size} is outside 1..={max}")]
    TpSizeOutOfRange { tp_size: u32, max: u32 },
    #[error("device_blocks must be at least 1")]
    ZeroDeviceBlocks,
    #[error("regions {regions} is outside 1..={max}")]
    RegionsOutOfRange { regions: u32, max: u32 },
    #[error("layers must be at least 1")]
    ZeroLayers,
    #[error("regions {regions} is not a multiple of layers {layers}")]
    RegionsNotMultipleOfLayers { regions: u32, layers: u32 },
    #[error("region_bytes must be at least 1")]
    ZeroRegionBytes,
    #[error("unknown write policy code {code}")]
    UnknownWritePolicy { code: u32 },
    #[error("write_through_selective needs a write threshold of at least 1")]
    ZeroWriteThreshold,
    #[error("{ring} ring of {slots} slots must be a power of two in {min}..={max}")]
    BadRingSize { ring: &'static str, slots: u32, min: u32, max: u32 },
    #[error("unknown backend code {code}")]
    UnknownBackend { code: u32 },
    #[error("unknown copy engine code {code} (0: workers, 1: the engine's process)")]
    UnknownCopies { code: u32 },
    #[error("unknown segment kind code {code} (0: a kvshm scheduler's, 1: an engine's host tier)")]
    UnknownKind { code: u32 },
    #[error("unknown host tier code {code} (0: the segment's own arenas, 1: a shared tier's)")]
    UnknownHostTier { code: u32 },
    #[error("a host tier on a shared tier's arenas is one rank's (tp_size 1) and has host blocks")]
    SharedHostTierShape,
    #[error("a {tier} arena of {blocks} blocks x {regions} regions x {region_bytes} bytes does not fit in memory")]
    ArenaTooLarge { tier: &'static str, blocks: u32, regions: u32, region_bytes: u64 },
}

/// The configuration of a segment, stored verbatim in its header.
///
/// Block layout per rank: a block is `regions` regions of `region_bytes` each. `regions` is a
/// multiple of `layers` (e.g. K and V of every layer: `regions == 2 * layers`), and layer-wise
/// progress counts layers.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct SegmentConfig {
    /// Tokens per KV block.
    pub block_tokens: u32,
    /// Tensor-parallel size: ranks, workers, rank areas (1..=[`MAX_RANKS`]).
    pub tp_size: u32,
    /// Blocks of the device tier (per rank; every rank has the same block ids).
    pub device_blocks: u32,
    /// Blocks of the host tier (per rank); 0 disables the host tier.
    pub host_blocks: u32,
    /// Regions per block per rank.
    pub regions: u32,
    /// Model layers; `regions % layers == 0`.
    pub layers: u32,
    /// Bytes of one region of one block.
    pub region_bytes: u64,
    /// A [`WritePolicy`] code.
    pub write_policy: u32,
    /// The threshold of `write_through_selective`, else 0.
    pub write_threshold: u32,
    /// Slots of each rank's command ring (power of two).
    pub command_ring_slots: u32,
    /// Records of each rank's completion ring (power of two).
    pub completion_ring_slots: u32,
    /// A [`Backend`] code.
    pub backend: u32,
    /// Who copies blocks: [`SegmentConfig::COPIES_BY_WORKERS`] (kvshm workers, per `backend`) or
    /// [`SegmentConfig::COPIES_IN_ENGINE`] (the engine's own process, in process: no worker
    /// attaches; vLLM's offloading worker with CPU tensors).
    pub copies: u32,
    /// Whose decisions the segment serves: [`SegmentConfig::KIND_SCHEDULER`] (a kvshm scheduler
    /// keeps the prefix cache and decides evictions and write-backs by `write_policy`) or
    /// [`SegmentConfig::KIND_ENGINE_HOST_TIER`] (an engine keeps its own device cache and decides
    /// what to store; `write_policy` is unused). Tools describe the two apart.
    pub kind: u32,
    /// Whose arenas hold the host tier: [`SegmentConfig::HOST_TIER_OWN`] (the segment's own,
    /// `/kvshm.NAME.host.RANK`) or [`SegmentConfig::HOST_TIER_SHARED`] (a shared tier's, which
    /// the segment does not make: each copier is told the tier's name, a worker by
    /// `--shared-tier`). Zero in segments made before the field: their own.
    pub host_tier: u32,
}

const _: () = assert!(size_of::<SegmentConfig>() == 64);

impl Default for SegmentConfig {
    /// A small host-backend configuration that validates; tests and examples start from it.
    fn default() -> Self {
        SegmentConfig {
            block_tokens: 16,
            tp_size: 1,
            device_blocks: 64,
            host_blocks: 128,
            regions: 2,
            layers: 1,
            region_bytes: 4096,
            write_policy: WritePolicy::WRITE_BACK,
            write_threshold: 0,
            command_ring_slots: 256,
            completion_ring_slots: 64,
            backend: Backend::HOST_ARENA,
            copies: SegmentConfig::COPIES_BY_WORKERS,
            kind: SegmentConfig::KIND_SCHEDULER,
            host_tier: SegmentConfig::HOST_TIER_OWN,
        }
    }
}

impl SegmentConfig {
    /// `copies`: kvshm worker processes copy.
    pub const COPIES_BY_WORKERS: u32 = 0;
    /// `copies`: the engine's process copies in process; no worker attaches.
    pub const COPIES_IN_ENGINE: u32 = 1;
    /// `kind`: a kvshm scheduler's segment (`Service`).
    pub const KIND_SCHEDULER: u32 = 0;
    /// `kind`: an engine's host tier (vLLM's offloading connector through `HostTier`).
    pub const KIND_ENGINE_HOST_TIER: u32 = 1;
    /// `host_tier`: the segment's own arenas.
    pub const HOST_TIER_OWN: u32 = 0;
    /// `host_tier`: a shared tier's arenas (DESIGN §12.2).
    pub const HOST_TIER_SHARED: u32 = 1;

    /// Whether the host tier's arenas are a shared tier's rather than the segment's.
    pub fn host_tier_is_shared(&self) -> bool {
        self.host_tier == Self::HOST_TIER_SHARED
    }

    /// Checks every field and every size derived from them.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.block_tokens == 0 {
            return Err(ConfigError::ZeroBlockTokens);
        }
        if !(1..=MAX_RANKS).contains(&self.tp_size) {
            return Err(ConfigError::TpSizeOutOfRange { tp_size: self.tp_size, max: MAX_RANKS });
        }
        if self.device_blocks == 0 {
            return Err(ConfigError::ZeroDeviceBlocks);
        }
        if !(1..=MAX_REGIONS).contains(&self.regions) {
            return Err(ConfigError::RegionsOutOfRange { regions: self.regions, max: MAX_REGIONS });
        }
        if self.layers == 0 {
            return Err(ConfigError::ZeroLayers);
        }
        if self.regions % self.layers != 0 {
            return Err(ConfigError::RegionsNotMultipleOfLayers {
                regions: self.regions,
                layers: self.layers,
            });
        }
        if self.region_bytes == 0 {
            return Err(ConfigError::ZeroRegionBytes);
        }
        WritePolicy::from_wire(self.write_policy, self.write_threshold)?;
        check_ring("command", self.command_ring_slots, MAX_COMMAND_RING_SLOTS)?;
        check_ring("completion", self.completion_ring_slots, MAX_COMPLETION_RING_SLOTS)?;
        Backend::from_wire(self.backend)?;
        if self.copies > Self::COPIES_IN_ENGINE {
            return Err(ConfigError::UnknownCopies { code: self.copies });
        }
        if self.kind > Self::KIND_ENGINE_HOST_TIER {
            return Err(ConfigError::UnknownKind { code: self.kind });
        }
        if self.host_tier > Self::HOST_TIER_SHARED {
            return Err(ConfigError::UnknownHostTier { code: self.host_tier });
        }
        if self.host_tier_is_shared() && (self.host_blocks == 0 || self.tp_size != 1) {
            return Err(ConfigError::SharedHostTierShape);
        }
        self.arena_bytes("device", self.device_blocks)?;
        self.arena_bytes("host", self.host_blocks)?;
        Ok(())
    }

    /// The decoded write policy.
    pub fn write_policy(&self) -> Result<WritePolicy, ConfigError> {
        WritePolicy::from_wire(self.write_policy, self.write_threshold)
    }

    /// The decoded backend.
    pub fn backend(&self) -> Result<Backend, ConfigError> {
        Backend::from_wire(self.backend)
    }

    /// Sets `write_policy` and `write_threshold` from a [`WritePolicy`].
    pub fn with_write_policy(mut self, policy: WritePolicy) -> Self {
        (self.write_policy, self.write_threshold) = policy.to_wire();
        self
    }

    /// The copy engine's name as tools show it: the backend's, or `in_process`.
    pub fn copy_engine_name(&self) -> Result<&'static str, ConfigError> {
        if self.copies == Self::COPIES_IN_ENGINE {
            return Ok("in_process");
        }
        Ok(self.backend()?.name())
    }

    /// Sets `backend` from a [`Backend`].
    pub fn with_backend(mut self, backend: Backend) -> Self {
        self.backend = backend.to_wire();
        self
    }

    /// Bytes of one block on one rank: `regions * region_bytes` (checked by `validate`).
    pub fn block_bytes(&self) -> u64 {
        u64::from(self.regions).saturating_mul(self.region_bytes)
    }

    /// Regions per layer (e.g. 2 for K and V).
    pub fn regions_per_layer(&self) -> u32 {
        self.regions / self.layers.max(1)
    }

    fn arena_bytes(&self, tier: &'static str, blocks: u32) -> Result<usize, ConfigError> {
        u64::from(blocks)
            .checked_mul(u64::from(self.regions))
            .and_then(|bytes| bytes.checked_mul(self.region_bytes))
            // Room for the arena header and page rounding.
            .and_then(|bytes| bytes.checked_add(1 << 20))
            .filter(|&bytes| bytes <= i64::MAX as u64)
            .and_then(|bytes| usize::try_from(bytes).ok())
            .ok_or(ConfigError::ArenaTooLarge {
                tier,
                blocks,
                regions: self.regions,
                region_bytes: self.region_bytes,
            })
    }
}

fn check_ring(ring: &'static str, slots: u32, max: u32) -> Result<(), ConfigError> {
    if slots.is_power_of_two() && (MIN_RING_SLOTS..=max).contains(&slots) {
        Ok(())
    } else {
        Err(ConfigError::BadRingSize { ring, slots, min: MIN_RING_SLOTS, max })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_configuration_is_valid() {
        assert_eq!(SegmentConfig::default().validate(), Ok(()));
    }

    #[test]
    fn each_bad_field_is_named() {
        let base = SegmentConfig::default();
        let cases = [
            (
                SegmentConfig { tp_size: 0, ..base },
                ConfigError::TpSizeOutOfRange { tp_size: 0, max: 8 },
            ),
            (
                SegmentConfig { tp_size: 9, ..base },
                ConfigError::TpSizeOutOfRange { tp_size: 9, max: 8 },
            ),
            (SegmentConfig { block_tokens: 0, ..base }, ConfigError::ZeroBlockTokens),
            (SegmentConfig { device_blocks: 0, ..base }, ConfigError::ZeroDeviceBlocks),
            (
                SegmentConfig { regions: 3, layers: 2, ..base },
                ConfigError::RegionsNotMultipleOfLayers { regions: 3, layers: 2 },
            ),
            (SegmentConfig { layers: 0, ..base }, ConfigError::ZeroLayers),
            (SegmentConfig { region_bytes: 0, ..base }, ConfigError::ZeroRegionBytes),
            (
                SegmentConfig { write_policy: 7, ..base },
                ConfigError::UnknownWritePolicy { code: 7 },
            ),
            (
                SegmentConfig { write_policy: 2, write_threshold: 0, ..base },
                ConfigError::ZeroWriteThreshold,
            ),
            (
                SegmentConfig { command_ring_slots: 100, ..base },
                ConfigError::BadRingSize { ring: "command", slots: 100, min: 2, max: 1 << 20 },
            ),
            (
                SegmentConfig { completion_ring_slots: 1, ..base },
                ConfigError::BadRingSize { ring: "completion", slots: 1, min: 2, max: 1 << 16 },
            ),
            (SegmentConfig { backend: 5, ..base }, ConfigError::UnknownBackend { code: 5 }),
            (SegmentConfig { copies: 2, ..base }, ConfigError::UnknownCopies { code: 2 }),
            (SegmentConfig { kind: 2, ..base }, ConfigError::UnknownKind { code: 2 }),
            (SegmentConfig { host_tier: 2, ..base }, ConfigError::UnknownHostTier { code: 2 }),
            (
                SegmentConfig { host_tier: 1, host_blocks: 0, ..base },
                ConfigError::SharedHostTierShape,
            ),
            (SegmentConfig { host_tier: 1, tp_size: 2, ..base }, ConfigError::SharedHostTierShape),
        ];
        for (config, expected) in cases {
            assert_eq!(config.validate(), Err(expected));
        }
    }

    #[test]
    fn arenas_whose_size_overflows_are_refused() {
        let config = SegmentConfig {
            device_blocks: u32::MAX,
            regions: MAX_REGIONS,
            region_bytes: u64::MAX / 2,
            ..SegmentConfig::default()
        };
        assert!(matches!(
            config.validate(),
            Err(ConfigError::ArenaTooLarge { tier: "device", .. })
        ));
    }

    #[test]
    fn write_policies_round_trip_through_their_codes() {
        for policy in [
            WritePolicy::WriteBack,
            WritePolicy::WriteThrough,
            WritePolicy::WriteThroughSelective { threshold: 3 },
        ] {
            let config = SegmentConfig::default().with_write_policy(policy);
            assert_eq!(config.write_policy(), Ok(policy));
        }
    }
}
