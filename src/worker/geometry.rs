//! The shape of one rank's KV blocks: how many regions a block has, how big each is, how the regions
//! group into layers, and how many blocks each tier holds.
//!
//! A block of one rank is `regions` regions of `region_bytes` each (typically K and V of every
//! layer). The regions group into `layers` equal, contiguous groups:
//!
//! - `regions_per_layer = regions / layers` (`g`), and layer `L` owns regions `[L * g, (L + 1) * g)`.
//!   With K and V per layer (`g = 2`), layer `L`'s K is region `2L` and its V region `2L + 1`.
//!
//! [`Geometry::new`] checks once that every byte count derived from the geometry fits in `u64` and
//! `usize`, so that the offset arithmetic of [`super::layout`] never overflows for in-range ids.

use std::ops::Range;

/// The numbers a geometry is built from (named, so that call sites cannot swap them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GeometryParams {
    /// Number of layers; divides `regions`.
    pub layers: u32,
    /// Regions per block (all layers together).
    pub regions: u32,
    /// Bytes of one region of one block.
    pub region_bytes: u64,
    /// Blocks of the device tier of this rank.
    pub device_blocks: u32,
    /// Blocks of the host tier of this rank (0: no host tier).
    pub host_blocks: u32,
}

/// A geometry that cannot describe real memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GeometryError {
    #[error("a block needs at least one layer")]
    NoLayers,
    #[error("{regions} regions do not split into {layers} equal layers")]
    RegionsNotDivisibleByLayers { regions: u32, layers: u32 },
    #[error("a region needs at least one byte")]
    EmptyRegion,
    #[error("the {tier} tier of {blocks} blocks of {block_bytes} bytes does not fit in memory")]
    TierTooLarge { tier: &'static str, blocks: u32, block_bytes: u64 },
}

/// The validated shape of one rank's blocks. See the module documentation for the layer convention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    params: GeometryParams,
}

impl Geometry {
    /// Checks the parameters: at least one layer, regions split evenly into layers, non-empty
    /// regions, and both tiers' byte sizes representable as `u64` and `usize`.
    pub fn new(params: GeometryParams) -> Result<Geometry, GeometryError> {
        if params.layers == 0 {
            return Err(GeometryError::NoLayers);
        }
        if params.regions == 0 || params.regions % params.layers != 0 {
            return Err(GeometryError::RegionsNotDivisibleByLayers {
                regions: params.regions,
                layers: params.layers,
            });
        }
        if params.region_bytes == 0 {
            return Err(GeometryError::EmptyRegion);
        }
        let too_large = |tier, blocks| GeometryError::TierTooLarge {
            tier,
            blocks,
            block_bytes: params.region_bytes.saturating_mul(u64::from(params.regions)),
        };
        let block_bytes = params
            .region_bytes
            .checked_mul(u64::from(params.regions))
            .ok_or(too_large("device", params.device_blocks))?;
        for (tier, blocks) in [("device", params.device_blocks), ("host", params.host_blocks)] {
            let bytes =
                block_bytes.checked_mul(u64::from(blocks)).ok_or(too_large(tier, blocks))?;
            usize::try_from(bytes).map_err(|_| too_large(tier, blocks))?;
        }
        Ok(Geometry { params })
    }

    pub fn params(&self) -> GeometryParams {
        self.params
    }

    pub fn layers(&self) -> u32 {
        self.params.layers
    }

    /// Regions per block, all layers together (`R`).
    pub fn regions(&self) -> u32 {
        self.params.regions
    }

    /// Regions of one layer (`g = R / layers`).
    pub fn regions_per_layer(&self) -> u32 {
        self.params.regions / self.params.layers
    }

    /// The regions layer `layer` owns: `[layer * g, (layer + 1) * g)`.
    ///
    /// # Panics
    ///
    /// If `layer >= layers()`: asking for a layer the geometry does not have is a programming error.
    pub fn layer_regions(&self, layer: u32) -> Range<u32> {
        assert!(layer < self.layers(), "layer {layer} of {} is a programming error", self.layers());
        let g = self.regions_per_layer();
        layer * g..(layer + 1) * g
    }

    pub fn region_bytes(&self) -> u64 {
        self.params.region_bytes
    }

    /// Bytes of one whole block (`R * region_bytes`): the size of one host block.
    pub fn block_bytes(&self) -> u64 {
        // Cannot overflow: checked in `new`.
        self.params.region_bytes * u64::from(self.params.regions)
    }

    pub fn device_blocks(&self) -> u32 {
        self.params.device_blocks
    }

    pub fn host_blocks(&self) -> u32 {
        self.params.host_blocks
    }

    /// Bytes of the whole host tier (`host_blocks * R * region_bytes`).
    pub fn host_tier_bytes(&self) -> u64 {
        // Cannot overflow: checked in `new`.
        self.block_bytes() * u64::from(self.params.host_blocks)
    }

    /// Bytes of a device arena that holds the R regions back to back (the host backend's layout).
    pub fn packed_device_arena_bytes(&self) -> u64 {
        // Cannot overflow: checked in `new`.
        self.block_bytes() * u64::from(self.params.device_blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> GeometryParams {
        GeometryParams {
            layers: 4,
            regions: 8,
            region_bytes: 4096,
            device_blocks: 10,
            host_blocks: 20,
        }
    }

    #[test]
    fn layer_l_owns_a_contiguous_group_of_regions() {
        let geometry = Geometry::new(params()).unwrap();
        assert_eq!(geometry.regions_per_layer(), 2);
        assert_eq!(geometry.layer_regions(0), 0..2);
        assert_eq!(geometry.layer_regions(3), 6..8);
        assert_eq!(geometry.block_bytes(), 8 * 4096);
        assert_eq!(geometry.host_tier_bytes(), 20 * 8 * 4096);
        assert_eq!(geometry.packed_device_arena_bytes(), 10 * 8 * 4096);
    }

    #[test]
    fn geometry_rejects_shapes_that_describe_no_memory() {
        let bad = |edit: fn(&mut GeometryParams)| {
            let mut p = params();
            edit(&mut p);
            Geometry::new(p).unwrap_err()
        };
        assert_eq!(bad(|p| p.layers = 0), GeometryError::NoLayers);
        assert_eq!(
            bad(|p| p.regions = 6),
            GeometryError::RegionsNotDivisibleByLayers { regions: 6, layers: 4 }
        );
        assert_eq!(
            bad(|p| p.regions = 0),
            GeometryError::RegionsNotDivisibleByLayers { regions: 0, layers: 4 }
        );
        assert_eq!(bad(|p| p.region_bytes = 0), GeometryError::EmptyRegion);
        assert!(matches!(
            bad(|p| {
                p.region_bytes = u64::MAX / 4;
                p.host_blocks = 1;
            }),
            GeometryError::TierTooLarge { .. }
        ));
        assert!(matches!(
            bad(|p| {
                p.region_bytes = u64::MAX / 64;
                p.device_blocks = 1;
            }),
            GeometryError::TierTooLarge { tier: "host", .. }
        ));
    }

    #[test]
    fn a_rank_without_host_tier_is_a_valid_geometry() {
        let geometry = Geometry::new(GeometryParams { host_blocks: 0, ..params() }).unwrap();
        assert_eq!(geometry.host_tier_bytes(), 0);
    }
}
