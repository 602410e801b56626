//! The host backend's copy engine: memcpy between the rank's device arena and its host tier, two
//! shared-memory mappings that someone else owns.
//!
//! Core types: [`MappedArea`] (a raw base pointer + length whose validity the creator vouches for)
//! and [`HostCopyEngine`].
//!
//! 1. [`HostCopyEngine::new`] lays the device arena out packed ([`DeviceLayout::packed`]) and the host
//!    tier block-major, and checks once that both layouts fit their areas and that the areas do not
//!    overlap.
//! 2. [`CopyEngine::execute`] walks the plan layer by layer; for every [`StridedCopy`] it checks the
//!    piece's whole extent against both areas (checked arithmetic), then copies it: one copy when
//!    the rows are contiguous on both sides, else one per row, with non-temporal stores
//!    ([`super::stream_copy`]); a store fence ends every layer before its progress is reported.
//! 3. Whatever the size of a piece, the engine reports [`CopyProgress::Bytes`] after every
//!    [`COPY_CHUNK_BYTES`] it copies (a long row is cut into chunks, short rows are grouped), so
//!    that the worker heartbeats from inside the copy (a 128 MiB layer is 512 reports).
//!
//! # Concurrent access
//!
//! Other processes map the same memory: the engine (scheduler process and GPU workers stand-ins)
//! writes other device blocks while this worker copies, and the scheduler reads counters next to it.
//! The engine never forms a Rust reference to the shared bytes, only raw-pointer copies of plain
//! bytes, which have no invalid values. The protocol keeps the copied bytes themselves quiet: the
//! scheduler never lets two commands or a request touch a block that an in-flight copy reads or
//! writes, so no one else writes a source or touches a destination while it is copied. Freedom
//! from data races on the block bytes is therefore a trusted-peer premise (the scheduler and the
//! engine keep the protocol); the copies stay at memcpy speed instead of paying for atomic words.

use std::ops::ControlFlow;
use std::ptr::NonNull;
use std::time::Duration;

use super::engine::{
    check_extent, report, CopyEngine, CopyFailure, CopyProgress, COPY_CHUNK_BYTES,
};
use super::geometry::Geometry;
use super::layout::{DeviceLayout, HostLayout};
use super::plan::{CopyPlan, Direction, StridedCopy};
use super::stream_copy::{copy_rows_streaming, store_fence};

/// A mapped memory area owned by someone else: a base pointer and a length.
#[derive(Clone, Copy, Debug)]
pub struct MappedArea {
    base: NonNull<u8>,
    len: usize,
}

impl MappedArea {
    /// Describes `len` bytes at `base`; `None` when `base` is null.
    ///
    /// # Safety
    ///
    /// For as long as this value or anything built from it (an engine) is used:
    /// 1. `base..base + len` is mapped, readable and writable, in this process;
    /// 2. nothing unmaps it (the owner keeps its mapping alive longer than the engine);
    /// 3. other threads or processes access its bytes only under the block-ownership protocol
    ///    described in the module documentation.
    pub unsafe fn new(base: *mut u8, len: usize) -> Option<MappedArea> {
        NonNull::new(base).map(|base| MappedArea { base, len })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn overlaps(&self, other: &MappedArea) -> bool {
        let (a, b) = (self.as_ptr() as usize, other.as_ptr() as usize);
        a < b.saturating_add(other.len) && b < a.saturating_add(self.len)
    }
}

/// Why a host engine cannot be built over the given areas.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HostEngineError {
    #[error("the {tier} area holds {len} bytes, its layout needs {needed}")]
    AreaTooSmall { tier: &'static str, len: usize, needed: u64 },
    #[error("the device arena and the host tier overlap")]
    AreasOverlap,
}

/// memcpy copy engine over a packed device arena and a block-major host tier.
#[derive(Debug)]
pub struct HostCopyEngine {
    geometry: Geometry,
    device_layout: DeviceLayout,
    host_layout: HostLayout,
    device: MappedArea,
    host: MappedArea,
    /// Test hook: copy at most this many bytes per second.
    rate_limit: Option<u64>,
}

impl HostCopyEngine {
    /// Builds the engine; fails when an area is too small for its layout or the areas overlap.
    pub fn new(
        geometry: Geometry,
        device: MappedArea,
        host: MappedArea,
    ) -> Result<HostCopyEngine, HostEngineError> {
        let device_layout = DeviceLayout::packed(&geometry);
        let host_layout = HostLayout::new(&geometry);
        for (tier, area, needed) in
            [("device", &device, device_layout.end()), ("host", &host, host_layout.len())]
        {
            if (area.len as u64) < needed {
                return Err(HostEngineError::AreaTooSmall { tier, len: area.len, needed });
            }
        }
        if device.overlaps(&host) {
            return Err(HostEngineError::AreasOverlap);
        }
        Ok(HostCopyEngine { geometry, device_layout, host_layout, device, host, rate_limit: None })
    }

    /// Test hook: the engine copies at most `bytes_per_second` (it sleeps after each chunk, inside
    /// the copy), so that a test can make one layer of a copy take as long as it likes.
    pub fn with_rate_limit(mut self, bytes_per_second: Option<u64>) -> HostCopyEngine {
        self.rate_limit = bytes_per_second.filter(|&rate| rate > 0);
        self
    }

    /// Copies one piece after checking its full extent on both sides, in chunks of at most
    /// [`COPY_CHUNK_BYTES`] counted by `meter` (a long row is cut, short rows are grouped).
    fn copy_piece(
        &self,
        direction: Direction,
        piece: StridedCopy,
        meter: &mut ChunkMeter<'_>,
    ) -> Result<(), CopyFailure> {
        check_extent(piece.device_end(), self.device.len as u64, "device")?;
        check_extent(piece.host_end(), self.host.len as u64, "host")?;
        // Both extents are inside areas of at most usize::MAX bytes, so every offset, pitch and
        // width below fits in usize and every row lies inside its area.
        let width = piece.width as usize;
        let (rows, row_len) = if piece.is_contiguous() {
            (1, width * piece.rows as usize)
        } else {
            (piece.rows as usize, width)
        };
        for row in 0..rows {
            let device_row = piece.device_offset as usize + row * piece.device_pitch as usize;
            let host_row = piece.host_offset as usize + row * piece.host_pitch as usize;
            let mut done = 0;
            while done < row_len {
                let len = (row_len - done).min(meter.room());
                // SAFETY:
                // 1. `device_row + row_len <= device.len` and `host_row + row_len <= host.len`:
                //    row `row` ends at or before the piece's end, which `check_extent` compared
                //    with each area; `done + len <= row_len`.
                // 2. Both areas are mapped, readable and writable for the engine's lifetime
                //    (`MappedArea::new`'s contract).
                // 3. Source and destination lie in different areas, which `new` checked do not
                //    overlap.
                // 4. No data race: no one else accesses these bytes during the copy, by the
                //    block-ownership protocol (module documentation). That is a trusted-peer
                //    premise: the scheduler and the engine are other processes that keep it, and
                //    one that breaks it races this copy.
                unsafe {
                    let device = self.device.as_ptr().add(device_row + done);
                    let host = self.host.as_ptr().add(host_row + done);
                    match direction {
                        Direction::DeviceToHost => copy_rows_streaming(device, host, len),
                        Direction::HostToDevice => copy_rows_streaming(host, device, len),
                    }
                }
                done += len;
                meter.copied(len as u64)?;
            }
        }
        Ok(())
    }
}

/// Counts the bytes copied since the last [`CopyProgress::Bytes`] report and reports every
/// [`COPY_CHUNK_BYTES`]; the rate-limit test hook sleeps here, inside the copy.
struct ChunkMeter<'p> {
    progress: &'p mut dyn FnMut(CopyProgress) -> ControlFlow<()>,
    since_report: u64,
    rate_limit: Option<u64>,
}

impl ChunkMeter<'_> {
    /// The most bytes that may be copied before the next report (at least 1).
    fn room(&self) -> usize {
        (COPY_CHUNK_BYTES - self.since_report) as usize
    }

    fn copied(&mut self, bytes: u64) -> Result<(), CopyFailure> {
        self.since_report += bytes;
        if self.since_report >= COPY_CHUNK_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    /// Reports the bytes copied since the last report, if any.
    fn flush(&mut self) -> Result<(), CopyFailure> {
        let bytes = std::mem::take(&mut self.since_report);
        if bytes == 0 {
            return Ok(());
        }
        if let Some(rate) = self.rate_limit {
            std::thread::sleep(Duration::from_secs_f64(bytes as f64 / rate as f64));
        }
        report(self.progress, CopyProgress::Bytes(bytes))
    }
}

impl CopyEngine for HostCopyEngine {
    fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    fn execute(
        &mut self,
        plan: &CopyPlan,
        progress: &mut dyn FnMut(CopyProgress) -> ControlFlow<()>,
    ) -> Result<(), CopyFailure> {
        let mut meter = ChunkMeter { progress, since_report: 0, rate_limit: self.rate_limit };
        for layer in 0..self.geometry.layers() {
            let result: Result<(), CopyFailure> = plan.for_each_piece_of_layer(
                layer,
                &self.geometry,
                &self.device_layout,
                &self.host_layout,
                |piece| self.copy_piece(plan.direction(), piece, &mut meter),
            );
            // The layer's streaming stores must be visible before its progress is published, and
            // a failed or stopped plan's before the failure: a fence in every case.
            store_fence();
            result?;
            meter.flush()?;
            report(meter.progress, CopyProgress::Layers(layer + 1))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::geometry::GeometryParams;
    use crate::worker::plan::OutOfLayout;
    use kvshm_ipc::record::BlockPair;

    const REGION_BYTES: usize = 48;

    fn geometry() -> Geometry {
        Geometry::new(GeometryParams {
            layers: 3,
            regions: 6,
            region_bytes: REGION_BYTES as u64,
            device_blocks: 8,
            host_blocks: 12,
        })
        .unwrap()
    }

    /// The byte at `i` of region `region` of block `block` in a tier tagged `tier`.
    fn pattern(tier: u8, block: u32, region: u32, i: usize) -> u8 {
        (tier as usize * 131 + block as usize * 31 + region as usize * 7 + i) as u8 | 1
    }

    struct Tiers {
        device: Vec<u8>,
        host: Vec<u8>,
    }

    impl Tiers {
        /// Both tiers filled with their pattern, so that every (tier, block, region) is distinct.
        fn new(geometry: &Geometry) -> Tiers {
            let device_layout = DeviceLayout::packed(geometry);
            let host_layout = HostLayout::new(geometry);
            let mut device = vec![0; device_layout.end() as usize];
            let mut host = vec![0; host_layout.len() as usize];
            for region in 0..geometry.regions() {
                for block in 0..geometry.device_blocks() {
                    let at = device_layout.region_offset(block, region).unwrap() as usize;
                    for i in 0..REGION_BYTES {
                        device[at + i] = pattern(1, block, region, i);
                    }
                }
                for block in 0..geometry.host_blocks() {
                    let at = host_layout.region_offset(block, region).unwrap() as usize;
                    for i in 0..REGION_BYTES {
                        host[at + i] = pattern(2, block, region, i);
                    }
                }
            }
            Tiers { device, host }
        }

        fn engine(&mut self, geometry: Geometry) -> HostCopyEngine {
            // SAFETY: both vectors outlive the engine (it is dropped at the end of each test
            // before them) and nothing else touches them.
            let (device, host) = unsafe {
                (
                    MappedArea::new(self.device.as_mut_ptr(), self.device.len()).unwrap(),
                    MappedArea::new(self.host.as_mut_ptr(), self.host.len()).unwrap(),
                )
            };
            HostCopyEngine::new(geometry, device, host).unwrap()
        }

        fn device_region(&self, geometry: &Geometry, block: u32, region: u32) -> &[u8] {
            let at = DeviceLayout::packed(geometry).region_offset(block, region).unwrap() as usize;
            &self.device[at..at + REGION_BYTES]
        }

        fn host_region(&self, geometry: &Geometry, block: u32, region: u32) -> &[u8] {
            let at = HostLayout::new(geometry).region_offset(block, region).unwrap() as usize;
            &self.host[at..at + REGION_BYTES]
        }
    }

    fn expected(tier: u8, block: u32, region: u32) -> Vec<u8> {
        (0..REGION_BYTES).map(|i| pattern(tier, block, region, i)).collect()
    }

    fn plan(direction: Direction, pairs: &[(u32, u32)]) -> CopyPlan {
        let mut pairs: Vec<BlockPair> = pairs.iter().map(|&(s, d)| BlockPair::new(s, d)).collect();
        CopyPlan::coalesce(direction, &mut pairs).unwrap()
    }

    #[test]
    fn device_to_host_lands_every_region_of_every_pair_and_nothing_else() {
        let geometry = geometry();
        let mut tiers = Tiers::new(&geometry);
        let pairs = [(0, 11), (1, 3), (2, 4), (3, 5), (7, 0)];
        let mut layers_done = Vec::new();
        tiers
            .engine(geometry)
            .execute(&plan(Direction::DeviceToHost, &pairs), &mut |report| {
                if let CopyProgress::Layers(done) = report {
                    layers_done.push(done);
                }
                ControlFlow::Continue(())
            })
            .unwrap();
        assert_eq!(layers_done, vec![1, 2, 3]);
        for host_block in 0..geometry.host_blocks() {
            let source = pairs.iter().find(|pair| pair.1 == host_block).map(|pair| pair.0);
            for region in 0..geometry.regions() {
                let want = match source {
                    Some(device_block) => expected(1, device_block, region),
                    None => expected(2, host_block, region),
                };
                assert_eq!(tiers.host_region(&geometry, host_block, region), want);
            }
        }
        for block in 0..geometry.device_blocks() {
            for region in 0..geometry.regions() {
                assert_eq!(
                    tiers.device_region(&geometry, block, region),
                    expected(1, block, region)
                );
            }
        }
    }

    #[test]
    fn host_to_device_lands_every_region_of_every_pair_and_nothing_else() {
        let geometry = geometry();
        let mut tiers = Tiers::new(&geometry);
        let pairs = [(11, 7), (4, 0), (5, 1), (9, 4), (0, 5)];
        tiers
            .engine(geometry)
            .execute(&plan(Direction::HostToDevice, &pairs), &mut |_| ControlFlow::Continue(()))
            .unwrap();
        for device_block in 0..geometry.device_blocks() {
            let source = pairs.iter().find(|pair| pair.1 == device_block).map(|pair| pair.0);
            for region in 0..geometry.regions() {
                let want = match source {
                    Some(host_block) => expected(2, host_block, region),
                    None => expected(1, device_block, region),
                };
                assert_eq!(tiers.device_region(&geometry, device_block, region), want);
            }
        }
    }

    #[test]
    fn a_single_region_geometry_copies_a_run_in_one_piece() {
        let geometry =
            Geometry::new(GeometryParams { layers: 1, regions: 1, ..geometry().params() }).unwrap();
        let mut tiers = Tiers::new(&geometry);
        tiers
            .engine(geometry)
            .execute(&plan(Direction::DeviceToHost, &[(2, 6), (3, 7), (4, 8)]), &mut |_| {
                ControlFlow::Continue(())
            })
            .unwrap();
        for (device_block, host_block) in [(2, 6), (3, 7), (4, 8)] {
            assert_eq!(tiers.host_region(&geometry, host_block, 0), expected(1, device_block, 0));
        }
        assert_eq!(tiers.host_region(&geometry, 9, 0), expected(2, 9, 0));
    }

    #[test]
    fn rows_long_enough_to_stream_land_intact_in_both_directions() {
        let region = 4096 + 64;
        let geometry = Geometry::new(GeometryParams {
            layers: 2,
            regions: 2,
            region_bytes: region as u64,
            device_blocks: 5,
            host_blocks: 5,
        })
        .unwrap();
        let block = 2 * region;
        let mut device: Vec<u8> = (0..5 * block).map(|i| (i % 251) as u8).collect();
        let mut host = vec![0u8; 5 * block];
        // SAFETY: both vectors outlive the engine and nothing else touches them.
        let areas = unsafe {
            (
                MappedArea::new(device.as_mut_ptr(), device.len()).unwrap(),
                MappedArea::new(host.as_mut_ptr(), host.len()).unwrap(),
            )
        };
        let mut engine = HostCopyEngine::new(geometry, areas.0, areas.1).unwrap();
        engine
            .execute(&plan(Direction::DeviceToHost, &[(4, 0), (1, 3)]), &mut |_| {
                ControlFlow::Continue(())
            })
            .unwrap();
        engine
            .execute(&plan(Direction::HostToDevice, &[(3, 2)]), &mut |_| ControlFlow::Continue(()))
            .unwrap();
        drop(engine);
        // Device region r of block b starts at (r * 5 + b) * region; host block h at h * block.
        let device_row = |r: usize, b: usize| (r * 5 + b) * region;
        for r in 0..2 {
            let original = |b: usize| -> Vec<u8> {
                (device_row(r, b)..device_row(r, b) + region).map(|i| (i % 251) as u8).collect()
            };
            assert_eq!(host[r * region..(r + 1) * region], original(4)[..]);
            assert_eq!(host[3 * block + r * region..3 * block + (r + 1) * region], original(1)[..]);
            assert_eq!(device[device_row(r, 2)..device_row(r, 2) + region], original(1)[..]);
            assert_eq!(device[device_row(r, 3)..device_row(r, 3) + region], original(3)[..]);
        }
        assert!(host[block..3 * block].iter().all(|&b| b == 0));
    }

    #[test]
    fn a_plan_beyond_the_layout_fails_without_copying_out_of_bounds() {
        let geometry = geometry();
        let mut tiers = Tiers::new(&geometry);
        let failure = tiers
            .engine(geometry)
            .execute(&plan(Direction::HostToDevice, &[(0, 8)]), &mut |_| ControlFlow::Continue(()))
            .unwrap_err();
        assert_eq!(
            failure,
            CopyFailure::OutOfLayout(OutOfLayout { tier: "device", block: 8, region: 0 })
        );
        assert_eq!(failure.detail(), 8);
    }

    #[test]
    fn areas_too_small_or_overlapping_are_refused() {
        let geometry = geometry();
        let mut tiers = Tiers::new(&geometry);
        let device_len = tiers.device.len();
        // SAFETY: the areas describe live vectors; no engine is built over them.
        let (short_device, host, overlapping) = unsafe {
            (
                MappedArea::new(tiers.device.as_mut_ptr(), device_len - 1).unwrap(),
                MappedArea::new(tiers.host.as_mut_ptr(), tiers.host.len()).unwrap(),
                MappedArea::new(tiers.device.as_mut_ptr().add(8), tiers.host.len()).unwrap(),
            )
        };
        assert_eq!(
            HostCopyEngine::new(geometry, short_device, host).unwrap_err(),
            HostEngineError::AreaTooSmall {
                tier: "device",
                len: device_len - 1,
                needed: device_len as u64
            }
        );
        // SAFETY: as above.
        let device = unsafe { MappedArea::new(tiers.device.as_mut_ptr(), device_len).unwrap() };
        assert_eq!(
            HostCopyEngine::new(geometry, device, overlapping).unwrap_err(),
            HostEngineError::AreasOverlap
        );
        // SAFETY: a null base is refused before anything is described.
        assert!(unsafe { MappedArea::new(std::ptr::null_mut(), 1) }.is_none());
    }
}

#[cfg(test)]
mod chunk_tests {
    use super::*;
    use crate::worker::geometry::GeometryParams;
    use kvshm_ipc::record::BlockPair;

    /// One layer, one region of 1 MiB + 100 bytes: a run of 3 blocks is one contiguous piece of
    /// over 3 MiB on the packed arena.
    fn geometry() -> Geometry {
        Geometry::new(GeometryParams {
            layers: 1,
            regions: 1,
            region_bytes: 1024 * 1024 + 100,
            device_blocks: 4,
            host_blocks: 4,
        })
        .unwrap()
    }

    fn buffers(geometry: &Geometry) -> (Vec<u8>, Vec<u8>) {
        let device = (0..DeviceLayout::packed(geometry).end()).map(|i| (i % 251) as u8).collect();
        (device, vec![0u8; HostLayout::new(geometry).len() as usize])
    }

    fn engine(device: &mut [u8], host: &mut [u8]) -> HostCopyEngine {
        // SAFETY: both buffers outlive the engine (dropped at the end of each test, first) and
        // nothing else touches them.
        let (device, host) = unsafe {
            (
                MappedArea::new(device.as_mut_ptr(), device.len()).unwrap(),
                MappedArea::new(host.as_mut_ptr(), host.len()).unwrap(),
            )
        };
        HostCopyEngine::new(geometry(), device, host).unwrap()
    }

    fn plan() -> CopyPlan {
        let mut pairs: Vec<BlockPair> = (0..3).map(|b| BlockPair::new(b, b)).collect();
        CopyPlan::coalesce(Direction::DeviceToHost, &mut pairs).unwrap()
    }

    #[test]
    fn a_piece_larger_than_a_chunk_is_reported_chunk_by_chunk() {
        let geometry = geometry();
        let (mut device, mut host) = buffers(&geometry);
        let mut reports = Vec::new();
        engine(&mut device, &mut host)
            .execute(&plan(), &mut |report| {
                reports.push(report);
                ControlFlow::Continue(())
            })
            .unwrap();
        let piece = 3 * geometry.region_bytes();
        let chunks: Vec<u64> = reports
            .iter()
            .filter_map(|report| match *report {
                CopyProgress::Bytes(bytes) => Some(bytes),
                CopyProgress::Layers(_) => None,
            })
            .collect();
        assert!(chunks.iter().all(|&bytes| bytes <= COPY_CHUNK_BYTES), "{chunks:?}");
        assert_eq!(chunks.iter().sum::<u64>(), piece);
        assert_eq!(chunks.len() as u64, piece.div_ceil(COPY_CHUNK_BYTES));
        assert_eq!(reports.last(), Some(&CopyProgress::Layers(1)));
        assert_eq!(host[..piece as usize], device[..piece as usize]);
    }

    #[test]
    fn a_break_stops_the_copy_at_the_next_chunk() {
        let geometry = geometry();
        let (mut device, mut host) = buffers(&geometry);
        let mut reports = 0;
        let result = engine(&mut device, &mut host).execute(&plan(), &mut |_| {
            reports += 1;
            if reports == 2 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        });
        assert_eq!(result, Err(CopyFailure::Stopped));
        assert_eq!(reports, 2);
        let copied = 2 * COPY_CHUNK_BYTES as usize;
        assert_eq!(host[..copied], device[..copied]);
        assert!(host[copied..].iter().all(|&byte| byte == 0), "nothing copied after the break");
    }
}
