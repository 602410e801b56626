//! Where the bytes of region `r` of block `b` live in each tier.
//!
//! - Device tier, region-major ([`DeviceLayout`]): region `r` of block `b` is at
//!   `base[r] + b * stride`. Every region has its own base; all share one stride (`>= region_bytes`).
//!   On the host backend the device arena is one shared-memory area holding the R regions back to
//!   back ([`DeviceLayout::packed`]: `base[r] = r * device_blocks * region_bytes`,
//!   `stride = region_bytes`), and bases are offsets into that area. On CUDA each region is its own
//!   device buffer opened from an IPC handle, and bases are device addresses.
//! - Host tier, block-major ([`HostLayout`]): block `b`'s R regions are contiguous at
//!   `b * R * region_bytes`, so region `r` of block `b` is at `(b * R + r) * region_bytes`.
//!
//! Both layouts answer `region_offset(block, region)` with `None` for an id out of range; the
//! constructors check once that the offset of every in-range (block, region), plus `region_bytes`,
//! is representable and inside the memory it describes.

use super::geometry::Geometry;

/// The host tier's block-major layout. Offsets are relative to the start of the host tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostLayout {
    regions: u32,
    region_bytes: u64,
    blocks: u32,
}

impl HostLayout {
    pub fn new(geometry: &Geometry) -> HostLayout {
        HostLayout {
            regions: geometry.regions(),
            region_bytes: geometry.region_bytes(),
            blocks: geometry.host_blocks(),
        }
    }

    /// Byte offset of region `region` of host block `block`, or `None` when either is out of range.
    pub fn region_offset(&self, block: u32, region: u32) -> Option<u64> {
        if block >= self.blocks || region >= self.regions {
            return None;
        }
        let index =
            u64::from(block).checked_mul(u64::from(self.regions))?.checked_add(region.into())?;
        index.checked_mul(self.region_bytes)
    }

    /// Distance between the same region of two consecutive host blocks (`R * region_bytes`).
    pub fn block_pitch(&self) -> u64 {
        // Cannot overflow: the geometry checked the size of a block.
        u64::from(self.regions) * self.region_bytes
    }

    /// Bytes the layout spans.
    pub fn len(&self) -> u64 {
        // Cannot overflow: the geometry checked the size of the host tier.
        self.block_pitch() * u64::from(self.blocks)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One region of the device tier as the memory owner describes it: its base address (or offset)
/// and how many bytes from there belong to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRegion {
    pub base: u64,
    pub len: u64,
}

/// A device-tier description that would place a block outside its region or on top of another.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeviceLayoutError {
    #[error("{found} device regions given, the geometry has {expected}")]
    RegionCount { found: usize, expected: u32 },
    #[error("block stride {stride} is smaller than a region ({region_bytes} bytes)")]
    StrideTooSmall { stride: u64, region_bytes: u64 },
    #[error("device region {region} holds {len} bytes, its blocks need {needed}")]
    RegionTooSmall { region: u32, len: u64, needed: u64 },
    #[error("device region {region} ends beyond the address space")]
    AddressOverflow { region: u32 },
    #[error("device regions {first} and {second} share bytes")]
    RegionsOverlap { first: u32, second: u32 },
}

/// The device tier's region-major layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceLayout {
    bases: Vec<u64>,
    stride: u64,
    region_bytes: u64,
    blocks: u32,
    end: u64,
}

impl DeviceLayout {
    /// The host backend's arena: the R regions back to back, each `device_blocks * region_bytes`
    /// long, so that region `r` starts at `r * device_blocks * region_bytes`; offsets are relative to
    /// the arena and the arena must hold [`Geometry::packed_device_arena_bytes`].
    pub fn packed(geometry: &Geometry) -> DeviceLayout {
        // Cannot overflow: the geometry checked the size of the packed arena.
        let region_span = geometry.region_bytes() * u64::from(geometry.device_blocks());
        DeviceLayout {
            bases: (0..geometry.regions()).map(|r| u64::from(r) * region_span).collect(),
            stride: geometry.region_bytes(),
            region_bytes: geometry.region_bytes(),
            blocks: geometry.device_blocks(),
            end: geometry.packed_device_arena_bytes(),
        }
    }

    /// A layout over separately allocated regions (CUDA): `regions[r]` is region `r`, block `b` of
    /// it at `regions[r].base + b * stride`.
    ///
    /// Checks that there is one region per geometry region, `stride >= region_bytes`, every block
    /// fits inside its region without the address overflowing, and that no two regions share a
    /// byte (regions may interleave, as K and V of a `[blocks, 2, ...]` buffer do, as long as their
    /// blocks do not overlap).
    pub fn from_regions(
        geometry: &Geometry,
        regions: &[DeviceRegion],
        stride: u64,
    ) -> Result<DeviceLayout, DeviceLayoutError> {
        if regions.len() != geometry.regions() as usize {
            return Err(DeviceLayoutError::RegionCount {
                found: regions.len(),
                expected: geometry.regions(),
            });
        }
        let region_bytes = geometry.region_bytes();
        if stride < region_bytes {
            return Err(DeviceLayoutError::StrideTooSmall { stride, region_bytes });
        }
        let blocks = geometry.device_blocks();
        let needed = match blocks.checked_sub(1) {
            None => 0,
            Some(last) => u64::from(last)
                .checked_mul(stride)
                .and_then(|offset| offset.checked_add(region_bytes))
                .ok_or(DeviceLayoutError::AddressOverflow { region: 0 })?,
        };
        let mut end = 0;
        for (index, region) in (0u32..).zip(regions) {
            if region.len < needed {
                return Err(DeviceLayoutError::RegionTooSmall {
                    region: index,
                    len: region.len,
                    needed,
                });
            }
            region
                .base
                .checked_add(region.len)
                .ok_or(DeviceLayoutError::AddressOverflow { region: index })?;
            // Cannot overflow: needed <= len and base + len did not.
            end = end.max(region.base + needed);
        }
        if needed > 0 {
            check_disjoint(regions, stride, region_bytes, needed)?;
        }
        Ok(DeviceLayout {
            bases: regions.iter().map(|region| region.base).collect(),
            stride,
            region_bytes,
            blocks,
            end,
        })
    }

    /// Address (or arena offset) of region `region` of device block `block`, or `None` when either
    /// is out of range.
    pub fn region_offset(&self, block: u32, region: u32) -> Option<u64> {
        if block >= self.blocks {
            return None;
        }
        let base = *self.bases.get(region as usize)?;
        u64::from(block).checked_mul(self.stride)?.checked_add(base)
    }

    /// Address (or arena offset) of block 0 of region `region`.
    pub fn region_base(&self, region: u32) -> Option<u64> {
        self.bases.get(region as usize).copied()
    }

    /// Distance between the same region of two consecutive device blocks.
    pub fn stride(&self) -> u64 {
        self.stride
    }

    pub fn region_bytes(&self) -> u64 {
        self.region_bytes
    }

    /// One past the highest byte any block of any region occupies.
    pub fn end(&self) -> u64 {
        self.end
    }
}

/// Fails when two regions' blocks share a byte. Regions whose used extents do not intersect are
/// disjoint; regions whose extents do intersect are still disjoint when their bases differ by a
/// distance whose remainder modulo `stride` keeps `region_bytes` clear on both sides (interleaved
/// regions). O(R²) once at start-up, R being a few hundred at most.
fn check_disjoint(
    regions: &[DeviceRegion],
    stride: u64,
    region_bytes: u64,
    needed: u64,
) -> Result<(), DeviceLayoutError> {
    for (first, a) in (0u32..).zip(regions) {
        for (second, b) in (0u32..).zip(regions).skip(first as usize + 1) {
            let (low, high) = if a.base <= b.base { (a, b) } else { (b, a) };
            let distance = high.base - low.base;
            if distance >= needed {
                continue;
            }
            let phase = distance % stride;
            if phase < region_bytes || stride - phase < region_bytes {
                return Err(DeviceLayoutError::RegionsOverlap { first, second });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::geometry::GeometryParams;

    fn geometry(device_blocks: u32, host_blocks: u32) -> Geometry {
        Geometry::new(GeometryParams {
            layers: 2,
            regions: 4,
            region_bytes: 100,
            device_blocks,
            host_blocks,
        })
        .unwrap()
    }

    #[test]
    fn host_blocks_are_block_major() {
        let host = HostLayout::new(&geometry(3, 5));
        assert_eq!(host.region_offset(0, 0), Some(0));
        assert_eq!(host.region_offset(0, 3), Some(300));
        assert_eq!(host.region_offset(1, 0), Some(400));
        assert_eq!(host.region_offset(4, 3), Some(4 * 400 + 300));
        assert_eq!(host.block_pitch(), 400);
        assert_eq!(host.len(), 2000);
    }

    #[test]
    fn host_offsets_stop_at_the_last_block_and_region() {
        let host = HostLayout::new(&geometry(3, 5));
        assert!(host.region_offset(4, 3).is_some());
        assert_eq!(host.region_offset(5, 0), None);
        assert_eq!(host.region_offset(0, 4), None);
        assert_eq!(host.region_offset(u32::MAX, u32::MAX), None);
    }

    #[test]
    fn packed_device_arena_is_region_major() {
        let device = DeviceLayout::packed(&geometry(3, 5));
        assert_eq!(device.region_offset(0, 0), Some(0));
        assert_eq!(device.region_offset(1, 0), Some(100));
        assert_eq!(device.region_offset(2, 0), Some(200));
        assert_eq!(device.region_offset(0, 1), Some(300));
        assert_eq!(device.region_offset(2, 3), Some(3 * 300 + 200));
        assert_eq!(device.region_offset(3, 0), None);
        assert_eq!(device.region_offset(0, 4), None);
        assert_eq!(device.end(), 1200);
        assert_eq!(device.stride(), 100);
    }

    #[test]
    fn separate_regions_have_their_own_bases_and_a_common_stride() {
        let regions: Vec<DeviceRegion> = (0..4)
            .map(|r| DeviceRegion { base: 0x7000_0000 + r * 0x1_0000, len: 3 * 128 })
            .collect();
        let device = DeviceLayout::from_regions(&geometry(3, 5), &regions, 128).unwrap();
        assert_eq!(device.region_offset(2, 1), Some(0x7001_0000 + 256));
        assert_eq!(device.end(), 0x7003_0000 + 2 * 128 + 100);
    }

    #[test]
    fn interleaved_regions_are_accepted_when_their_blocks_do_not_overlap() {
        // K and V of one layer in a [blocks, 2, ...] buffer: stride covers both.
        let regions: Vec<DeviceRegion> = (0..4)
            .map(|r| DeviceRegion { base: (r / 2) * 10_000 + (r % 2) * 100, len: 3 * 200 })
            .collect();
        assert!(DeviceLayout::from_regions(&geometry(3, 5), &regions, 200).is_ok());
        let shifted: Vec<DeviceRegion> = (0..4)
            .map(|r| DeviceRegion { base: (r / 2) * 10_000 + (r % 2) * 150, len: 3 * 200 + 50 })
            .collect();
        assert_eq!(
            DeviceLayout::from_regions(&geometry(3, 5), &shifted, 200),
            Err(DeviceLayoutError::RegionsOverlap { first: 0, second: 1 })
        );
    }

    #[test]
    fn device_regions_that_cannot_hold_their_blocks_are_refused() {
        let geometry = geometry(3, 5);
        let region = DeviceRegion { base: 0, len: 300 };
        let spaced = |i: u64| DeviceRegion { base: i * 1000, ..region };
        let four: Vec<DeviceRegion> = (0..4).map(spaced).collect();
        assert_eq!(
            DeviceLayout::from_regions(&geometry, &four[..3], 100),
            Err(DeviceLayoutError::RegionCount { found: 3, expected: 4 })
        );
        assert_eq!(
            DeviceLayout::from_regions(&geometry, &four, 99),
            Err(DeviceLayoutError::StrideTooSmall { stride: 99, region_bytes: 100 })
        );
        assert_eq!(
            DeviceLayout::from_regions(&geometry, &four, 101),
            Err(DeviceLayoutError::RegionTooSmall { region: 0, len: 300, needed: 302 })
        );
        let mut at_the_top = four.clone();
        at_the_top[2].base = u64::MAX - 100;
        assert_eq!(
            DeviceLayout::from_regions(&geometry, &at_the_top, 100),
            Err(DeviceLayoutError::AddressOverflow { region: 2 })
        );
        let mut overlapping = four;
        overlapping[3].base = 1200;
        assert_eq!(
            DeviceLayout::from_regions(&geometry, &overlapping, 100),
            Err(DeviceLayoutError::RegionsOverlap { first: 1, second: 3 })
        );
    }
}
