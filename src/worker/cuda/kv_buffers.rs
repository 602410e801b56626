//! [`DeviceKvBuffers`]: one rank's KV cache on a GPU, allocated as an engine allocates it, for the
//! programs that play the engine there: `kvshm demo --backend cuda`, `kvshm bench copy --backend
//! cuda` and the GPU tests. A real engine owns its own buffers and only publishes their handles.
//!
//! Layout: one allocation, layer after layer; inside layer `l`, block after block; inside a
//! block, the layer's regions side by side (K then V: FlashInfer's `[blocks, 2, ...]` per layer).
//! Region `l * k + j` (`k` regions per layer) of block `b` lies at
//! `l * blocks * k * region_bytes + b * k * region_bytes + j * region_bytes`, so every region has
//! the block stride `k * region_bytes`, and a layer's regions of one block are adjacent: the
//! worker moves them as one piece.
//!
//! 1. [`DeviceKvBuffers::allocate`] retains the device's primary context, allocates and zeroes
//!    the buffer, and exports its IPC handle;
//! 2. [`DeviceKvBuffers::region_handles`] is what the engine publishes in the segment
//!    (`Segment::publish_device_handles`) for the rank's worker;
//! 3. [`DeviceKvBuffers::write_region`] and [`DeviceKvBuffers::read_region`] are the engine's
//!    "compute": synchronous copies of one region, made only while no worker copies that block
//!    (the block-ownership protocol: after the block's ticket is ready, before it is released).

use std::ffi::{c_int, c_void};
use std::ptr;

use cudarc::driver::sys;
use kvshm_ipc::device_handles::DeviceRegionHandle;

use super::driver::{check, load_driver, DriverCallError, DriverLoadError};
use super::engine::IPC_HANDLE_BYTES;
use crate::worker::geometry::Geometry;
use crate::worker::plan::Direction;

/// Why a buffer could not be made or used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KvBufferError {
    #[error(transparent)]
    Load(#[from] DriverLoadError),
    #[error(transparent)]
    Driver(#[from] DriverCallError),
    #[error("block {block} region {region} is outside the buffer's geometry")]
    OutOfRange { block: u32, region: u32 },
    #[error("a region holds {expected} bytes, the buffer given {found}")]
    WrongLength { expected: u64, found: usize },
    #[error("the buffer of {bytes} bytes does not fit this machine's address space")]
    TooLarge { bytes: u64 },
}

/// One rank's KV cache in device memory (module documentation).
pub struct DeviceKvBuffers {
    device: sys::CUdevice,
    context: sys::CUcontext,
    base: sys::CUdeviceptr,
    bytes: usize,
    handle: [u8; IPC_HANDLE_BYTES],
    regions_per_layer: u64,
    region_bytes: u64,
    blocks: u32,
    regions: u32,
}

impl DeviceKvBuffers {
    /// Allocates the device tier of `geometry` on device `ordinal` (module flow, step 1).
    pub fn allocate(ordinal: u32, geometry: &Geometry) -> Result<DeviceKvBuffers, KvBufferError> {
        load_driver()?;
        let regions_per_layer = u64::from(geometry.regions_per_layer());
        let region_bytes = geometry.region_bytes();
        let total = u64::from(geometry.regions())
            .checked_mul(region_bytes)
            .and_then(|per_block| per_block.checked_mul(u64::from(geometry.device_blocks())))
            .filter(|&total| total > 0)
            .ok_or(KvBufferError::TooLarge { bytes: u64::MAX })?;
        let bytes = usize::try_from(total).map_err(|_| KvBufferError::TooLarge { bytes: total })?;
        let ordinal = c_int::try_from(ordinal)
            .map_err(|_| DriverCallError { call: "cuDeviceGet", code: INVALID_DEVICE })?;
        let mut device: sys::CUdevice = 0;
        let mut context: sys::CUcontext = ptr::null_mut();
        // SAFETY: the driver is loaded with every entry point used here; each call writes only
        // its out-parameter, a live local.
        unsafe {
            check("cuInit", sys::cuInit(0))?;
            check("cuDeviceGet", sys::cuDeviceGet(&mut device, ordinal))?;
            check("cuDevicePrimaryCtxRetain", sys::cuDevicePrimaryCtxRetain(&mut context, device))?;
        }
        let mut buffers = DeviceKvBuffers {
            device,
            context,
            base: 0,
            bytes,
            handle: [0; IPC_HANDLE_BYTES],
            regions_per_layer,
            region_bytes,
            blocks: geometry.device_blocks(),
            regions: geometry.regions(),
        };
        let mut handle = sys::CUipcMemHandle { reserved: [0; IPC_HANDLE_BYTES] };
        // SAFETY: the context was retained above and is made current; the allocation is recorded
        // in `buffers` at once, so that `drop` frees it (and releases the context) on any later
        // failure; out-parameters are live locals.
        unsafe {
            check("cuCtxSetCurrent", sys::cuCtxSetCurrent(context))?;
            check("cuMemAlloc", sys::cuMemAlloc_v2(&mut buffers.base, bytes))?;
            check("cuMemsetD8", sys::cuMemsetD8_v2(buffers.base, 0, bytes))?;
            check("cuIpcGetMemHandle", sys::cuIpcGetMemHandle(&mut handle, buffers.base))?;
        }
        buffers.handle = handle.reserved.map(|byte| byte as u8);
        Ok(buffers)
    }

    /// The device address of the allocation and its bytes.
    pub fn device_extent(&self) -> (u64, usize) {
        (self.base, self.bytes)
    }

    /// Distance between the same region of two consecutive blocks.
    pub fn block_stride(&self) -> u64 {
        self.regions_per_layer * self.region_bytes
    }

    /// The handle of every region, in region order, for `Segment::publish_device_handles`.
    pub fn region_handles(&self) -> Vec<DeviceRegionHandle> {
        let span =
            u64::from(self.blocks.saturating_sub(1)) * self.block_stride() + self.region_bytes;
        (0..self.regions)
            .map(|region| {
                DeviceRegionHandle::new(
                    self.handle,
                    self.region_offset(0, region),
                    span,
                    self.block_stride(),
                )
            })
            .collect()
    }

    fn region_offset(&self, block: u32, region: u32) -> u64 {
        let layer = u64::from(region) / self.regions_per_layer;
        let within = u64::from(region) % self.regions_per_layer;
        let layer_bytes = u64::from(self.blocks) * self.block_stride();
        layer * layer_bytes + u64::from(block) * self.block_stride() + within * self.region_bytes
    }

    fn region_address(&self, block: u32, region: u32, len: usize) -> Result<u64, KvBufferError> {
        if block >= self.blocks || region >= self.regions {
            return Err(KvBufferError::OutOfRange { block, region });
        }
        if len as u64 != self.region_bytes {
            return Err(KvBufferError::WrongLength { expected: self.region_bytes, found: len });
        }
        Ok(self.base + self.region_offset(block, region))
    }

    /// Writes `bytes` into region `region` of block `block`; returns once they are on the device.
    pub fn write_region(&self, block: u32, region: u32, bytes: &[u8]) -> Result<(), KvBufferError> {
        let address = self.region_address(block, region, bytes.len())?;
        // SAFETY: the context is this buffer's; the region lies inside the allocation (checked
        // above) and `bytes` is a live slice of its length. No data race: the caller writes a
        // block only while no worker copies it (module documentation; trusted peers), and the
        // copy is synchronous.
        unsafe {
            check("cuCtxSetCurrent", sys::cuCtxSetCurrent(self.context))?;
            check(
                "cuMemcpyHtoD",
                sys::cuMemcpyHtoD_v2(address, bytes.as_ptr().cast(), bytes.len()),
            )?;
        }
        Ok(())
    }

    /// Reads region `region` of block `block` into `out`.
    pub fn read_region(
        &self,
        block: u32,
        region: u32,
        out: &mut [u8],
    ) -> Result<(), KvBufferError> {
        let address = self.region_address(block, region, out.len())?;
        // SAFETY: as in `write_region`, with `out` a live, writable slice of the region's length.
        unsafe {
            check("cuCtxSetCurrent", sys::cuCtxSetCurrent(self.context))?;
            check(
                "cuMemcpyDtoH",
                sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), address, out.len()),
            )?;
        }
        Ok(())
    }

    /// GB/s of one contiguous `cuMemcpyAsync` of `bytes` bytes (at most the buffer) between this
    /// buffer and pinned host memory, in `direction`, timed with events, best of `repeats` after
    /// a warm-up: what the copy engines do with no per-block work at all.
    pub fn contiguous_copy_gbps(
        &self,
        direction: Direction,
        bytes: usize,
        repeats: u32,
    ) -> Result<f64, KvBufferError> {
        let bytes = bytes.min(self.bytes);
        let mut host: *mut c_void = ptr::null_mut();
        // SAFETY: the context is this buffer's; out-parameter is a live local; the pinned
        // memory is freed below on every path.
        unsafe {
            check("cuCtxSetCurrent", sys::cuCtxSetCurrent(self.context))?;
            check("cuMemHostAlloc", sys::cuMemHostAlloc(&mut host, bytes, 0))?;
        }
        let timed = self.time_copies(direction, host, bytes, repeats);
        // SAFETY: allocated above; every copy using it was synchronised in `time_copies` (or
        // failed before being enqueued: the stream is synchronised there on every path).
        let freed = unsafe { check("cuMemFreeHost", sys::cuMemFreeHost(host)) };
        let seconds = timed?;
        freed?;
        Ok(bytes as f64 / seconds / 1e9)
    }

    fn time_copies(
        &self,
        direction: Direction,
        host: *mut c_void,
        bytes: usize,
        repeats: u32,
    ) -> Result<f64, KvBufferError> {
        let mut stream: sys::CUstream = ptr::null_mut();
        let mut events: [sys::CUevent; 2] = [ptr::null_mut(); 2];
        // SAFETY: the context is current (caller); out-parameters are live locals; the stream and
        // events are destroyed below after a synchronise, whatever happened in between.
        unsafe {
            check("cuStreamCreate", sys::cuStreamCreate(&mut stream, 0))?;
            for event in &mut events {
                check("cuEventCreate", sys::cuEventCreate(event, 0))?;
            }
        }
        let mut best = f64::INFINITY;
        let mut run = || -> Result<(), KvBufferError> {
            for _ in 0..=repeats {
                let mut milliseconds = 0f32;
                // SAFETY: `host` holds `bytes` pinned bytes and the device buffer at least
                // `bytes` (`bytes <= self.bytes`); both are this process's alone while timed.
                unsafe {
                    check("cuEventRecord", sys::cuEventRecord(events[0], stream))?;
                    match direction {
                        Direction::DeviceToHost => check(
                            "cuMemcpyDtoHAsync",
                            sys::cuMemcpyDtoHAsync_v2(host, self.base, bytes, stream),
                        )?,
                        Direction::HostToDevice => check(
                            "cuMemcpyHtoDAsync",
                            sys::cuMemcpyHtoDAsync_v2(self.base, host, bytes, stream),
                        )?,
                    }
                    check("cuEventRecord", sys::cuEventRecord(events[1], stream))?;
                    check("cuEventSynchronize", sys::cuEventSynchronize(events[1]))?;
                    check(
                        "cuEventElapsedTime",
                        sys::cuEventElapsedTime(&mut milliseconds, events[0], events[1]),
                    )?;
                }
                best = best.min(f64::from(milliseconds) / 1e3);
            }
            Ok(())
        };
        let result = run();
        // SAFETY: created above in this context; synchronised before they are destroyed.
        unsafe {
            sys::cuStreamSynchronize(stream);
            for event in events.into_iter().filter(|event| !event.is_null()) {
                sys::cuEventDestroy_v2(event);
            }
            sys::cuStreamDestroy_v2(stream);
        }
        result.map(|()| best)
    }
}

impl Drop for DeviceKvBuffers {
    fn drop(&mut self) {
        // SAFETY: the allocation (if any) and the context reference were made by `allocate`;
        // each is released once. Workers that opened the handle keep their own mapping until
        // they close it; freeing here only ends this process's use.
        unsafe {
            sys::cuCtxSetCurrent(self.context);
            if self.base != 0 {
                sys::cuMemFree_v2(self.base);
            }
            sys::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}

/// The number of CUDA devices this process sees (0 without a driver).
pub fn device_count() -> u32 {
    if load_driver().is_err() {
        return 0;
    }
    let mut count: c_int = 0;
    // SAFETY: the driver is loaded; the out-parameter is a live local.
    let found = unsafe {
        check("cuInit", sys::cuInit(0))
            .and_then(|()| check("cuDeviceGetCount", sys::cuDeviceGetCount(&mut count)))
    };
    if found.is_err() {
        return 0;
    }
    u32::try_from(count).unwrap_or(0)
}

/// `CUDA_ERROR_INVALID_DEVICE`, for an ordinal that does not fit the driver's int.
const INVALID_DEVICE: u32 = 101;
