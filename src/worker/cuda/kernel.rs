//! kvshm's copy kernel: a layer's pieces flattened into rows and moved by one launch, instead of
//! one driver call per piece (a layer of scattered blocks is thousands of small pieces, and a
//! driver call costs microseconds: per call, 4 KiB pieces move at under 2 GB/s on an H100).
//!
//! Core types: [`CopyKernel`] (the loaded kernel and what its launches need), [`CopyRow`]
//! (source, destination, bytes), [`PlanRows`] (a plan's rows, layer by layer), [`RowStaging`]
//! (mapped pinned memory the kernel reads its rows from).
//!
//! 1. [`PlanRows::push_piece`] turns each [`StridedCopy`] into rows: one row when the piece is
//!    contiguous on both sides, else one per row of the piece; [`PlanRows::end_layer`] closes a
//!    layer, so that each layer is submitted, and its event recorded, on its own.
//! 2. The rows are cut at [`KERNEL_ROW_BYTES`]. Layers are gathered into launch groups of at
//!    least [`MIN_LAUNCH_BYTES`] ([`GroupCut`]); as soon as a group's rows are built, they are
//!    written to mapped pinned memory and the `kvshm_copy_rows` kernel (`copy_rows.ptx`) runs
//!    over them ([`CopyKernel::launch_group`]), so that the GPU copies one group while the
//!    worker builds the next. Groups alternate between the engine's stream
//!    and a second one, so that one group's tail overlaps the next one's start; each layer's
//!    event is recorded behind its group. The host tier is mapped into the device's address
//!    space, so the kernel's loads and stores reach it directly.

use std::ffi::{c_int, c_uint, c_void};
use std::ptr;

use cudarc::driver::sys;

use super::driver::{check, DriverCallError};
use super::engine::warn_on_error;
use crate::worker::plan::{Direction, StridedCopy};

/// One contiguous copy: `bytes` from device address `src` to device address `dst` (host memory
/// as the device sees it). The layout the kernel reads: three little-endian u64.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyRow {
    pub src: u64,
    pub dst: u64,
    pub bytes: u64,
}

/// The rows of one plan, layer by layer (module flow, step 1).
#[derive(Debug, Default)]
pub struct PlanRows {
    rows: Vec<CopyRow>,
    /// One past the last row of each closed layer.
    layer_ends: Vec<usize>,
}

impl PlanRows {
    pub fn clear(&mut self) {
        self.rows.clear();
        self.layer_ends.clear();
    }

    /// Appends the rows of `piece` to the open layer, none longer than `max_row_bytes` (a
    /// longer one is cut at multiples of it). Device offsets are device addresses; host offsets
    /// are relative to `host_base`, the host tier's address for the submitter.
    pub fn push_piece(
        &mut self,
        direction: Direction,
        piece: &StridedCopy,
        host_base: u64,
        max_row_bytes: u64,
    ) {
        let (rows, width) = if piece.is_contiguous() {
            (1, piece.bytes())
        } else {
            (u64::from(piece.rows), piece.width)
        };
        let cut = max_row_bytes.max(1);
        for row in 0..rows {
            let device = piece.device_offset + row * piece.device_pitch;
            let host = host_base + piece.host_offset + row * piece.host_pitch;
            let (src, dst) = match direction {
                Direction::DeviceToHost => (device, host),
                Direction::HostToDevice => (host, device),
            };
            let mut at = 0;
            while at < width {
                let bytes = cut.min(width - at);
                self.rows.push(CopyRow { src: src + at, dst: dst + at, bytes });
                at += bytes;
            }
        }
    }

    /// Bytes the rows of layer `layer` move.
    pub fn layer_bytes(&self, layer: usize) -> u64 {
        self.layer(layer).1.iter().map(|row| row.bytes).sum()
    }

    /// Closes the open layer (which may hold no rows).
    pub fn end_layer(&mut self) {
        self.layer_ends.push(self.rows.len());
    }

    pub fn all(&self) -> &[CopyRow] {
        &self.rows
    }

    /// Index of the first row of layer `layer` and its rows.
    pub fn layer(&self, layer: usize) -> (usize, &[CopyRow]) {
        let start = layer.checked_sub(1).map_or(0, |previous| self.layer_ends[previous]);
        (start, &self.rows[start..self.layer_ends[layer]])
    }
}

/// Pinned host memory, mapped into the device's address space, through which the rows of a plan
/// reach the kernel: the worker writes a launch group's rows, and the kernel's warps read each
/// row's 24 bytes across the bus, with no copy enqueued before the launch. Owned by the
/// [`CopyKernel`], which frees it.
#[derive(Debug)]
pub struct RowStaging {
    host: *mut CopyRow,
    /// The buffer's address on the device.
    device: sys::CUdeviceptr,
    capacity: usize,
}

impl RowStaging {
    /// Allocates room for `capacity` rows in the current context.
    pub fn allocate(capacity: usize) -> Result<RowStaging, DriverCallError> {
        let bytes = capacity * size_of::<CopyRow>();
        let mut host: *mut c_void = ptr::null_mut();
        // SAFETY: a context is current (the engine's); the out-parameter is a live local.
        unsafe {
            check(
                "cuMemHostAlloc",
                sys::cuMemHostAlloc(&mut host, bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP),
            )?;
        }
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `host` was allocated just above with DEVICEMAP; the out-parameter is a local.
        let mapped = unsafe {
            check(
                "cuMemHostGetDevicePointer",
                sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0),
            )
        };
        if let Err(error) = mapped {
            // SAFETY: `host` was allocated just above and is not used after this.
            unsafe { sys::cuMemFreeHost(host) };
            return Err(error);
        }
        Ok(RowStaging { host: host.cast(), device, capacity })
    }

    /// Frees the buffer.
    ///
    /// # Safety
    /// The context it was allocated in is current, and no enqueued work uses it any more.
    pub unsafe fn free(self) -> Result<(), DriverCallError> {
        // SAFETY: the caller's premise; freed once (`self` is consumed).
        unsafe { check("cuMemFreeHost", sys::cuMemFreeHost(self.host.cast())) }
    }

    /// Writes `rows`, rows `first..first + rows.len()` of a plan, into their places; returns
    /// the device address of the first.
    ///
    /// # Safety
    /// `first + rows.len() <= self.capacity`, and no enqueued work still reads these places
    /// (the engine drains its streams between plans, and a plan's groups use disjoint places).
    pub unsafe fn write(&self, rows: &[CopyRow], first: usize) -> u64 {
        debug_assert!(first + rows.len() <= self.capacity);
        // SAFETY: the places lie inside the buffer and no device work reads them now (caller's
        // premise), so this write races with nothing; a launch enqueued after it reads the rows
        // across the bus, and sees every host write made before the launch.
        unsafe { ptr::copy_nonoverlapping(rows.as_ptr(), self.host.add(first), rows.len()) };
        self.device + (first * size_of::<CopyRow>()) as u64
    }
}

/// The copy kernel loaded in an engine's context, and what its launches need. Not `Send`: it
/// lives in the engine, which is driven by one thread.
pub struct CopyKernel {
    module: sys::CUmodule,
    function: sys::CUfunction,
    /// How many of the kernel's blocks the device runs at once.
    resident_blocks: u32,
    /// The stream the odd launch groups go on (the even ones on the engine's).
    second_stream: sys::CUstream,
    staging: Option<RowStaging>,
    /// Groups launched since the plan began ([`reserve`](Self::reserve)).
    groups: usize,
}

impl CopyKernel {
    /// Loads the kernel, and creates its stream and event, in the current context of `device`;
    /// on failure, releases whatever it made.
    ///
    /// # Safety
    /// A context of `device` is current on this thread.
    pub unsafe fn load(device: sys::CUdevice) -> Result<CopyKernel, DriverCallError> {
        let mut kernel = CopyKernel {
            module: ptr::null_mut(),
            function: ptr::null_mut(),
            resident_blocks: 1,
            second_stream: ptr::null_mut(),
            staging: None,
            groups: 0,
        };
        // SAFETY: the caller's premise; every object is stored in `kernel` as soon as it exists,
        // so that `release` below frees exactly what was made.
        let loaded = unsafe { kernel.make(device) };
        match loaded {
            Ok(()) => Ok(kernel),
            Err(error) => {
                // SAFETY: nothing was enqueued with any of it.
                unsafe { kernel.release() }.into_iter().for_each(warn_on_error);
                Err(error)
            }
        }
    }

    /// # Safety
    /// As [`load`](Self::load).
    unsafe fn make(&mut self, device: sys::CUdevice) -> Result<(), DriverCallError> {
        let (mut multiprocessors, mut threads_per_multiprocessor): (c_int, c_int) = (0, 0);
        // SAFETY: the context is current (caller); the PTX text is NUL-terminated; every
        // out-parameter is a field or a live local.
        unsafe {
            check(
                "cuModuleLoadData",
                sys::cuModuleLoadData(&mut self.module, COPY_ROWS_PTX.as_ptr().cast()),
            )?;
            check(
                "cuModuleGetFunction",
                sys::cuModuleGetFunction(&mut self.function, self.module, COPY_ROWS_ENTRY.as_ptr()),
            )?;
            for (value, attribute) in [
                (
                    &mut multiprocessors,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                ),
                (
                    &mut threads_per_multiprocessor,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR,
                ),
            ] {
                check("cuDeviceGetAttribute", sys::cuDeviceGetAttribute(value, attribute, device))?;
            }
            check(
                "cuStreamCreate",
                sys::cuStreamCreate(
                    &mut self.second_stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint,
                ),
            )?;
        }
        let per_multiprocessor = (threads_per_multiprocessor.max(0) as u32 / KERNEL_THREADS).max(1);
        self.resident_blocks = (multiprocessors.max(1) as u32).saturating_mul(per_multiprocessor);
        Ok(())
    }

    /// Begins a plan of at most `rows` rows: room for them in the staging buffers.
    ///
    /// # Safety
    /// The context the kernel was loaded in is current, and nothing enqueued earlier still runs
    /// on either stream (the buffers may be replaced).
    pub unsafe fn reserve(&mut self, rows: usize) -> Result<(), DriverCallError> {
        self.groups = 0;
        let needed = rows.max(1);
        if self.staging.as_ref().is_none_or(|staging| staging.capacity < needed) {
            if let Some(old) = self.staging.take() {
                // SAFETY: both streams are idle (caller's premise).
                warn_on_error(unsafe { old.free() });
            }
            self.staging = Some(RowStaging::allocate(needed.next_power_of_two().max(1024))?);
        }
        Ok(())
    }

    /// Enqueues the copy of layers `layers` of `rows` (a launch group, closed by the caller as
    /// [`GroupCut`] says): their rows staged, one launch over them, then
    /// `layer_events[l]` recorded for each of the layers. Groups alternate between `stream`
    /// and the kernel's own stream, so that one group's tail overlaps the next one's start.
    ///
    /// # Safety
    /// The context the kernel was loaded in is current; `stream` belongs to it; `reserve` began
    /// this plan with room for all its rows; every row lies inside device memory or
    /// device-mapped host memory that stays valid until the events complete; no two rows of the
    /// plan overlap; and no one else touches their bytes until then (no data race: the
    /// caller's block-ownership protocol).
    pub unsafe fn launch_group(
        &mut self,
        rows: &PlanRows,
        layers: std::ops::Range<usize>,
        stream: sys::CUstream,
        layer_events: &[sys::CUevent],
    ) -> Result<(), DriverCallError> {
        let first = rows.layer(layers.start).0;
        let (last_start, last_rows) = rows.layer(layers.end - 1);
        let group = &rows.all()[first..last_start + last_rows.len()];
        let on = if self.groups % 2 == 0 { stream } else { self.second_stream };
        self.groups += 1;
        if !group.is_empty() {
            let staging = self.staging.as_ref().expect("reserve allocates the staging");
            // SAFETY: the group's places lie inside the reserved capacity and no earlier group
            // of the plan uses them (caller's premise).
            let mut rows_at = unsafe { staging.write(group, first) };
            let mut count = u32::try_from(group.len()).unwrap_or(u32::MAX);
            let mut params =
                [(&raw mut rows_at).cast::<c_void>(), (&raw mut count).cast::<c_void>()];
            let blocks = kernel_blocks(group.len(), self.resident_blocks);
            // SAFETY: the kernel takes (u64 rows, u32 count), which `params` points at; it reads
            // `count` rows at `rows_at`, written just above into mapped pinned memory; the rows'
            // bytes are valid, disjoint and left alone by everyone else (caller's premise), so
            // the two streams' launches never touch the same byte.
            unsafe {
                check(
                    "cuLaunchKernel",
                    sys::cuLaunchKernel(
                        self.function,
                        blocks,
                        1,
                        1,
                        KERNEL_THREADS,
                        1,
                        1,
                        0,
                        on,
                        params.as_mut_ptr(),
                        ptr::null_mut(),
                    ),
                )?;
            }
        }
        for layer in layers {
            // SAFETY: the event and the stream belong to the current context.
            unsafe { check("cuEventRecord", sys::cuEventRecord(layer_events[layer], on))? };
        }
        Ok(())
    }

    /// Blocks until nothing enqueued on the kernel's own stream still runs.
    pub fn synchronize(&self) -> Result<(), DriverCallError> {
        // SAFETY: the stream was created by `load` and lives until `release`.
        unsafe { check("cuStreamSynchronize", sys::cuStreamSynchronize(self.second_stream)) }
    }

    /// Waits for the kernel's stream, then frees everything `load` and `launch` made.
    ///
    /// # Safety
    /// The context the kernel was loaded in is current, and nothing enqueued on the engine's
    /// stream still uses the staging buffers.
    pub unsafe fn release(mut self) -> Vec<Result<(), DriverCallError>> {
        let mut results = Vec::new();
        // SAFETY: each object was made by `load` (or `launch`) in the current context, is
        // released once (`self` is consumed, staging taken), and after the stream is
        // synchronised no launch uses any of it.
        unsafe {
            if !self.second_stream.is_null() {
                results.push(self.synchronize());
                results.push(check("cuStreamDestroy", sys::cuStreamDestroy_v2(self.second_stream)));
            }
            if let Some(staging) = self.staging.take() {
                results.push(staging.free());
            }
            if !self.module.is_null() {
                results.push(check("cuModuleUnload", sys::cuModuleUnload(self.module)));
            }
        }
        results
    }
}

/// The kernel's block size: eight warps.
pub const KERNEL_THREADS: u32 = 256;

/// The longest row the kernel is given: a warp moves one row at a time, so a layer of a few
/// long rows (1 MiB blocks: 64 KiB per layer and block) would keep too few warps, and too few
/// bytes, in flight to fill the bus; cut at 4 KiB, a 1 MiB layer is 256 warps' work.
pub const KERNEL_ROW_BYTES: u64 = 4096;

/// The fewest bytes one kernel launch moves: consecutive layers are launched together until
/// their rows reach it (or the plan ends), so that a small command costs a few launches, not
/// one per layer, while a large one still reports each layer as it lands (1 MiB is about 20 µs
/// of a PCIe 5 link; a launch costs a few µs).
pub const MIN_LAUNCH_BYTES: u64 = 1 << 20;

/// Where launch groups end: a group closes once its layers' rows reach [`MIN_LAUNCH_BYTES`],
/// or at the plan's last layer.
#[derive(Clone, Copy, Debug, Default)]
pub struct GroupCut {
    bytes: u64,
}

impl GroupCut {
    /// Counts a layer of `bytes`; whether the group ends with it.
    pub fn end_layer(&mut self, bytes: u64, last: bool) -> bool {
        self.bytes += bytes;
        let ends = last || self.bytes >= MIN_LAUNCH_BYTES;
        if ends {
            self.bytes = 0;
        }
        ends
    }
}

/// The most rows a plan of `blocks` blocks of `regions` regions of `region_bytes` becomes: a
/// row per block and region, each cut at [`KERNEL_ROW_BYTES`] (merged pieces are cut into no
/// more rows than their parts).
pub fn max_rows(blocks: u64, regions: u32, region_bytes: u64) -> usize {
    let per_region = region_bytes.div_ceil(KERNEL_ROW_BYTES).max(1);
    usize::try_from(blocks.saturating_mul(u64::from(regions)).saturating_mul(per_region))
        .unwrap_or(usize::MAX)
}

/// Blocks for a launch over `rows` rows: a warp per row, at most `resident_blocks` blocks (what
/// the device holds at once; warps then take several rows each).
pub fn kernel_blocks(rows: usize, resident_blocks: u32) -> u32 {
    let warps_per_block = (KERNEL_THREADS / 32) as usize;
    let wanted = rows.div_ceil(warps_per_block).max(1);
    u32::try_from(wanted).unwrap_or(u32::MAX).min(resident_blocks.max(1))
}

/// The copy kernel's PTX, NUL-terminated for `cuModuleLoadData`.
pub const COPY_ROWS_PTX: &str = concat!(include_str!("copy_rows.ptx"), "\0");

/// The kernel's entry point name.
pub const COPY_ROWS_ENTRY: &std::ffi::CStr = c"kvshm_copy_rows";

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(rows: u32, device_pitch: u64, host_pitch: u64) -> StridedCopy {
        StridedCopy {
            device_offset: 1 << 40,
            device_pitch,
            host_offset: 4096,
            host_pitch,
            width: 256,
            rows,
        }
    }

    #[test]
    fn a_contiguous_piece_is_one_row_and_a_strided_one_a_row_per_block() {
        let mut rows = PlanRows::default();
        rows.push_piece(Direction::DeviceToHost, &piece(4, 256, 256), 1 << 20, u64::MAX);
        rows.end_layer();
        rows.push_piece(Direction::HostToDevice, &piece(3, 1024, 512), 1 << 20, u64::MAX);
        rows.end_layer();
        rows.end_layer();
        let (start, first) = rows.layer(0);
        assert_eq!(start, 0);
        assert_eq!(first, &[CopyRow { src: 1 << 40, dst: (1 << 20) + 4096, bytes: 1024 }]);
        let (start, second) = rows.layer(1);
        assert_eq!(start, 1);
        let expected: Vec<CopyRow> = (0..3)
            .map(|row| CopyRow {
                src: (1 << 20) + 4096 + row * 512,
                dst: (1 << 40) + row * 1024,
                bytes: 256,
            })
            .collect();
        assert_eq!(second, expected.as_slice());
        assert_eq!(rows.layer(2), (4, &[][..]), "an empty layer");
        assert_eq!(rows.all().len(), 4);
    }

    #[test]
    fn long_rows_are_cut_at_the_row_limit() {
        let mut rows = PlanRows::default();
        rows.push_piece(Direction::DeviceToHost, &piece(4, 256, 256), 0, 300);
        rows.end_layer();
        let cut: Vec<(u64, u64, u64)> = rows
            .layer(0)
            .1
            .iter()
            .map(|row| (row.src - (1 << 40), row.dst - 4096, row.bytes))
            .collect();
        assert_eq!(cut, [(0, 0, 300), (300, 300, 300), (600, 600, 300), (900, 900, 124)]);
    }

    #[test]
    fn small_layers_launch_together_until_a_launch_moves_enough() {
        let quarter = MIN_LAUNCH_BYTES / 4;
        let mut cut = GroupCut::default();
        // Layers of a quarter, a quarter, a half, a quarter, two of 2x the minimum, an empty.
        let ends: Vec<bool> = [1, 1, 2, 1, 8, 8, 0]
            .into_iter()
            .enumerate()
            .map(|(layer, quarters)| cut.end_layer(quarters * quarter, layer == 6))
            .collect();
        assert_eq!(ends, [false, false, true, false, true, true, true]);
    }

    #[test]
    fn a_plan_never_has_more_rows_than_its_bound() {
        let region = KERNEL_ROW_BYTES + 1;
        // One region of three blocks, strided: two rows per block.
        let mut rows = PlanRows::default();
        let strided = StridedCopy {
            device_offset: 0,
            device_pitch: 2 * region,
            host_offset: 0,
            host_pitch: 4 * region,
            width: region,
            rows: 3,
        };
        rows.push_piece(Direction::HostToDevice, &strided, 0, KERNEL_ROW_BYTES);
        assert_eq!(rows.all().len(), 6);
        assert_eq!(rows.all().len(), max_rows(3, 1, region));
        // Two regions of three blocks, merged into one contiguous piece: fewer rows.
        rows.clear();
        let merged = StridedCopy {
            width: 2 * region,
            device_pitch: 2 * region,
            host_pitch: 2 * region,
            ..strided
        };
        rows.push_piece(Direction::HostToDevice, &merged, 0, KERNEL_ROW_BYTES);
        assert_eq!(rows.all().len(), 7);
        assert!(rows.all().len() <= max_rows(3, 2, region));
        assert_eq!(rows.all().iter().map(|row| row.bytes).sum::<u64>(), 6 * region);
    }

    #[test]
    fn a_launch_has_a_warp_per_row_up_to_what_the_device_holds() {
        assert_eq!(kernel_blocks(0, 100), 1);
        assert_eq!(kernel_blocks(8, 100), 1);
        assert_eq!(kernel_blocks(9, 100), 2);
        assert_eq!(kernel_blocks(100_000, 1056), 1056);
    }

    #[test]
    fn the_kernel_text_is_nul_terminated_and_names_its_entry() {
        assert!(COPY_ROWS_PTX.ends_with('\0'));
        assert_eq!(COPY_ROWS_PTX.matches('\0').count(), 1);
        assert!(COPY_ROWS_PTX.contains(".entry kvshm_copy_rows("));
    }
}
