//! Copy plans: a command's block pairs coalesced into runs, and the runs cut into strided pieces
//! layer by layer for a copy engine.
//!
//! Core types: [`CopyPlan`] (direction + [`BlockRun`]s) and [`StridedCopy`] (one rectangular copy).
//!
//! 1. [`CopyPlan::coalesce`] sorts the pairs by destination, rejects a destination written twice,
//!    and merges pairs whose source and destination both continue the previous pair into one
//!    [`BlockRun`] `(device_first, host_first, blocks)`. Sorting is allowed because the copies of
//!    one command are independent (distinct destinations, source and destination in different
//!    tiers), and it finds runs whatever order the scheduler listed the pairs in.
//! 2. [`CopyPlan::for_each_piece_of_layer`] turns the runs into pieces for one layer, so that an
//!    engine can report progress after each layer.
//!
//! # How a run becomes pieces
//!
//! A run of `n` consecutive device blocks and `n` consecutive host blocks touches, for each region
//! `r`, `n` device rows at `base[r] + b * stride` (one contiguous span when `stride ==
//! region_bytes`) and `n` host rows at `(b * R + r) * region_bytes`, that is with pitch
//! `R * region_bytes`: the host side is strided because host blocks are block-major. The two sides
//! agree row by row only per region, so the natural unit is one 2-D piece per (region, run):
//! `n` rows of `region_bytes`, device pitch `stride`, host pitch `R * region_bytes`.
//!
//! - The alternative, one piece per (block, region), issues the same bytes as `n` times as many
//!   descriptors. On CUDA a 2-D piece is one `cuMemcpy2DAsync` whose rows the DMA engine walks, so
//!   per-call overhead is paid once per (region, run) instead of once per block; on the host
//!   backend a 2-D piece is `n` memcpys of `region_bytes`, the same work either way.
//! - Regions of one layer are adjacent inside a host block. When their device bases are adjacent
//!   too (K and V interleaved per block, a `[blocks, 2, ...]` buffer), they merge into one piece of
//!   width `k * region_bytes`, as long as that stays within the device stride.
//! - A piece whose rows follow each other on both sides (one row, or both pitches equal to the
//!   width: one region per block on a packed arena) is one contiguous copy
//!   ([`StridedCopy::is_contiguous`]).

use kvshm_ipc::record::BlockPair;

use super::geometry::Geometry;
use super::layout::{DeviceLayout, HostLayout};

/// Which way a copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Device blocks (sources) to host blocks (destinations).
    DeviceToHost,
    /// Host blocks (sources) to device blocks (destinations).
    HostToDevice,
}

impl Direction {
    /// Splits a wire pair into (device block, host block).
    pub fn device_and_host(self, pair: BlockPair) -> (u32, u32) {
        match self {
            Direction::DeviceToHost => (pair.src, pair.dst),
            Direction::HostToDevice => (pair.dst, pair.src),
        }
    }
}

/// `blocks` consecutive device blocks from `device_first` paired with as many consecutive host
/// blocks from `host_first`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockRun {
    pub device_first: u32,
    pub host_first: u32,
    pub blocks: u32,
}

/// A command's pairs written twice to the same destination block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("destination block {block} is written by two pairs")]
pub struct DuplicateDestination {
    pub block: u32,
}

/// A piece whose first or last row lies outside a tier's layout: the plan was made for another
/// geometry than the engine's. Engines report it instead of copying.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("block {block} region {region} is outside the {tier} layout")]
pub struct OutOfLayout {
    pub tier: &'static str,
    pub block: u32,
    pub region: u32,
}

/// The coalesced copies of one validated copy command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyPlan {
    direction: Direction,
    runs: Vec<BlockRun>,
}

impl CopyPlan {
    /// Sorts `pairs` by destination, fails on a destination that appears twice, and merges pairs
    /// that continue the previous one on both sides into runs. O(n log n) for n pairs.
    pub fn coalesce(
        direction: Direction,
        pairs: &mut [BlockPair],
    ) -> Result<CopyPlan, DuplicateDestination> {
        pairs.sort_unstable_by_key(|pair| pair.dst);
        if let Some(twice) = pairs.windows(2).find(|w| w[0].dst == w[1].dst) {
            return Err(DuplicateDestination { block: twice[0].dst });
        }
        let mut runs: Vec<BlockRun> = Vec::new();
        for &pair in pairs.iter() {
            let (device, host) = direction.device_and_host(pair);
            if let Some(run) = runs.last_mut() {
                let next = u64::from(run.blocks);
                if u64::from(run.device_first) + next == u64::from(device)
                    && u64::from(run.host_first) + next == u64::from(host)
                {
                    run.blocks += 1;
                    continue;
                }
            }
            runs.push(BlockRun { device_first: device, host_first: host, blocks: 1 });
        }
        Ok(CopyPlan { direction, runs })
    }

    pub fn direction(&self) -> Direction {
        self.direction
    }

    pub fn runs(&self) -> &[BlockRun] {
        &self.runs
    }

    /// Blocks copied in all.
    pub fn blocks(&self) -> u64 {
        self.runs.iter().map(|run| u64::from(run.blocks)).sum()
    }

    /// Calls `copy` with every piece of layer `layer`: for each group of the layer's regions that
    /// are adjacent on the device, one piece per run (see the module documentation).
    ///
    /// The first and last row of every piece are looked up in both layouts, so a piece never
    /// leaves them; a plan made for another geometry gives [`OutOfLayout`].
    ///
    /// # Panics
    ///
    /// If `layer >= geometry.layers()`: iterating a layer that does not exist is a programming error.
    pub fn for_each_piece_of_layer<E: From<OutOfLayout>>(
        &self,
        layer: u32,
        geometry: &Geometry,
        device: &DeviceLayout,
        host: &HostLayout,
        mut copy: impl FnMut(StridedCopy) -> Result<(), E>,
    ) -> Result<(), E> {
        let regions = geometry.layer_regions(layer);
        let region_bytes = geometry.region_bytes();
        let mut first_region = regions.start;
        while first_region < regions.end {
            let group = adjacent_device_regions(device, first_region, regions.end, region_bytes);
            let last_region = first_region + group - 1;
            for run in &self.runs {
                let last_device = run.device_first + (run.blocks - 1);
                let last_host = run.host_first + (run.blocks - 1);
                let device_offset = lookup_device(device, run.device_first, first_region)?;
                lookup_device(device, last_device, last_region)?;
                let host_offset = lookup_host(host, run.host_first, first_region)?;
                lookup_host(host, last_host, last_region)?;
                copy(StridedCopy {
                    device_offset,
                    device_pitch: device.stride(),
                    host_offset,
                    host_pitch: host.block_pitch(),
                    width: u64::from(group) * region_bytes,
                    rows: run.blocks,
                })?;
            }
            first_region += group;
        }
        Ok(())
    }
}

/// How many regions from `first` (before `end`) follow each other on the device
/// (`base[r + 1] == base[r] + region_bytes`) without their union outgrowing the device stride.
fn adjacent_device_regions(device: &DeviceLayout, first: u32, end: u32, region_bytes: u64) -> u32 {
    let Some(base) = device.region_base(first) else { return 1 };
    let mut count = 1;
    while first + count < end {
        let width = u64::from(count + 1) * region_bytes;
        let expected = base.checked_add(u64::from(count) * region_bytes);
        if width > device.stride() || device.region_base(first + count) != expected {
            break;
        }
        count += 1;
    }
    count
}

fn lookup_device(device: &DeviceLayout, block: u32, region: u32) -> Result<u64, OutOfLayout> {
    device.region_offset(block, region).ok_or(OutOfLayout { tier: "device", block, region })
}

fn lookup_host(host: &HostLayout, block: u32, region: u32) -> Result<u64, OutOfLayout> {
    host.region_offset(block, region).ok_or(OutOfLayout { tier: "host", block, region })
}

/// One rectangular copy: `rows` rows of `width` bytes, row `i` at `device_offset + i *
/// device_pitch` on the device and `host_offset + i * host_pitch` on the host. Offsets are what the
/// layouts hold: arena offsets or device addresses on the device side, host-tier offsets on the
/// host side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StridedCopy {
    pub device_offset: u64,
    pub device_pitch: u64,
    pub host_offset: u64,
    pub host_pitch: u64,
    pub width: u64,
    pub rows: u32,
}

impl StridedCopy {
    /// The rows follow each other on both sides: the piece is one copy of `width * rows` bytes.
    pub fn is_contiguous(&self) -> bool {
        self.rows <= 1 || (self.device_pitch == self.width && self.host_pitch == self.width)
    }

    /// Bytes the piece moves.
    pub fn bytes(&self) -> u64 {
        self.width.saturating_mul(u64::from(self.rows))
    }

    /// One past the last device byte the piece touches, `None` on overflow.
    pub fn device_end(&self) -> Option<u64> {
        span_end(self.device_offset, self.device_pitch, self.width, self.rows)
    }

    /// One past the last host byte the piece touches, `None` on overflow.
    pub fn host_end(&self) -> Option<u64> {
        span_end(self.host_offset, self.host_pitch, self.width, self.rows)
    }
}

fn span_end(offset: u64, pitch: u64, width: u64, rows: u32) -> Option<u64> {
    let Some(last_row) = rows.checked_sub(1) else { return Some(offset) };
    u64::from(last_row).checked_mul(pitch)?.checked_add(width)?.checked_add(offset)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::geometry::GeometryParams;
    use crate::worker::layout::DeviceRegion;

    fn pairs(list: &[(u32, u32)]) -> Vec<BlockPair> {
        list.iter().map(|&(src, dst)| BlockPair::new(src, dst)).collect()
    }

    fn runs(direction: Direction, list: &[(u32, u32)]) -> Vec<BlockRun> {
        CopyPlan::coalesce(direction, &mut pairs(list)).unwrap().runs
    }

    fn run(device_first: u32, host_first: u32, blocks: u32) -> BlockRun {
        BlockRun { device_first, host_first, blocks }
    }

    #[test]
    fn consecutive_pairs_coalesce_into_one_run() {
        assert_eq!(
            runs(Direction::DeviceToHost, &[(3, 10), (4, 11), (5, 12)]),
            vec![run(3, 10, 3)]
        );
        assert_eq!(
            runs(Direction::HostToDevice, &[(10, 3), (11, 4), (12, 5)]),
            vec![run(3, 10, 3)]
        );
    }

    #[test]
    fn scattered_pairs_stay_separate_runs_sorted_by_destination() {
        assert_eq!(
            runs(Direction::DeviceToHost, &[(7, 1), (2, 9), (5, 4)]),
            vec![run(7, 1, 1), run(5, 4, 1), run(2, 9, 1)]
        );
    }

    #[test]
    fn only_one_side_consecutive_does_not_coalesce() {
        assert_eq!(
            runs(Direction::DeviceToHost, &[(0, 10), (1, 12), (3, 13)]),
            vec![run(0, 10, 1), run(1, 12, 1), run(3, 13, 1)]
        );
    }

    #[test]
    fn reversed_pairs_coalesce_after_sorting() {
        assert_eq!(
            runs(Direction::DeviceToHost, &[(5, 9), (4, 8), (3, 7), (2, 6)]),
            vec![run(2, 6, 4)]
        );
    }

    #[test]
    fn a_reused_source_splits_runs_where_they_overlap() {
        // Source 1 feeds destinations 11 and 12: two runs that overlap on the source side.
        assert_eq!(
            runs(Direction::DeviceToHost, &[(0, 10), (1, 11), (1, 12), (2, 13)]),
            vec![run(0, 10, 2), run(1, 12, 2)]
        );
    }

    #[test]
    fn a_destination_written_twice_is_refused() {
        let mut list = pairs(&[(0, 10), (1, 11), (2, 10)]);
        assert_eq!(
            CopyPlan::coalesce(Direction::DeviceToHost, &mut list),
            Err(DuplicateDestination { block: 10 })
        );
    }

    #[test]
    fn runs_at_the_top_of_the_id_space_do_not_overflow() {
        assert_eq!(
            runs(Direction::DeviceToHost, &[(u32::MAX - 1, u32::MAX - 1), (u32::MAX, u32::MAX)]),
            vec![run(u32::MAX - 1, u32::MAX - 1, 2)]
        );
        assert_eq!(runs(Direction::DeviceToHost, &[]), vec![]);
    }

    fn geometry(layers: u32, regions: u32) -> Geometry {
        Geometry::new(GeometryParams {
            layers,
            regions,
            region_bytes: 100,
            device_blocks: 8,
            host_blocks: 8,
        })
        .unwrap()
    }

    fn pieces_of(
        plan: &CopyPlan,
        geometry: &Geometry,
        device: &DeviceLayout,
        layer: u32,
    ) -> Vec<StridedCopy> {
        let mut out = Vec::new();
        plan.for_each_piece_of_layer::<OutOfLayout>(
            layer,
            geometry,
            device,
            &HostLayout::new(geometry),
            |piece| {
                out.push(piece);
                Ok(())
            },
        )
        .unwrap();
        out
    }

    #[test]
    fn a_run_becomes_one_strided_piece_per_region_of_the_layer() {
        let geometry = geometry(2, 4);
        let device = DeviceLayout::packed(&geometry);
        let plan =
            CopyPlan::coalesce(Direction::DeviceToHost, &mut pairs(&[(2, 5), (3, 6)])).unwrap();
        let layer1 = pieces_of(&plan, &geometry, &device, 1);
        let piece = |region: u64| StridedCopy {
            device_offset: region * 800 + 2 * 100,
            device_pitch: 100,
            host_offset: (5 * 4 + region) * 100,
            host_pitch: 400,
            width: 100,
            rows: 2,
        };
        assert_eq!(layer1, vec![piece(2), piece(3)]);
        assert!(!layer1[0].is_contiguous());
        assert_eq!(layer1[0].device_end(), Some(2 * 800 + 400));
        assert_eq!(layer1[0].host_end(), Some(2000 + 200 + 400 + 100));
    }

    #[test]
    fn one_region_per_block_on_a_packed_arena_is_one_contiguous_piece() {
        let geometry = geometry(1, 1);
        let device = DeviceLayout::packed(&geometry);
        let plan =
            CopyPlan::coalesce(Direction::HostToDevice, &mut pairs(&[(4, 0), (5, 1), (6, 2)]))
                .unwrap();
        let pieces = pieces_of(&plan, &geometry, &device, 0);
        assert_eq!(pieces.len(), 1);
        assert!(pieces[0].is_contiguous());
        assert_eq!(pieces[0].bytes(), 300);
        assert_eq!((pieces[0].device_offset, pieces[0].host_offset), (0, 400));
    }

    #[test]
    fn interleaved_k_and_v_of_a_layer_merge_into_one_wider_piece() {
        // Per layer one [blocks, 2, 100] buffer: K at +0, V at +100, stride 200.
        let geometry = geometry(2, 4);
        let regions: Vec<DeviceRegion> = (0..4u64)
            .map(|r| DeviceRegion { base: (r / 2) * 10_000 + (r % 2) * 100, len: 8 * 200 })
            .collect();
        let device = DeviceLayout::from_regions(&geometry, &regions, 200).unwrap();
        let plan = CopyPlan::coalesce(Direction::DeviceToHost, &mut pairs(&[(1, 3)])).unwrap();
        let pieces = pieces_of(&plan, &geometry, &device, 1);
        assert_eq!(
            pieces,
            vec![StridedCopy {
                device_offset: 10_000 + 200,
                device_pitch: 200,
                host_offset: 3 * 400 + 200,
                host_pitch: 400,
                width: 200,
                rows: 1,
            }]
        );
    }

    #[test]
    fn a_plan_for_a_larger_geometry_is_out_of_layout() {
        let geometry = geometry(2, 4);
        let device = DeviceLayout::packed(&geometry);
        let plan =
            CopyPlan::coalesce(Direction::DeviceToHost, &mut pairs(&[(7, 7), (8, 8)])).unwrap();
        let result = plan.for_each_piece_of_layer::<OutOfLayout>(
            0,
            &geometry,
            &device,
            &HostLayout::new(&geometry),
            |_| Ok(()),
        );
        assert_eq!(result, Err(OutOfLayout { tier: "device", block: 8, region: 0 }));
    }
}
