//! The CUDA copy engine: DMA between device regions opened from the engine's CUDA IPC handles and
//! the host tier registered as pinned memory.
//!
//! Core types: [`CudaEngineConfig`] (plain data: IPC handle bytes, offsets, lengths, the host tier
//! mapping), [`CudaCopyEngine`], [`CudaInitError`].
//!
//! Set-up ([`CudaCopyEngine::new`]):
//!
//! 1. load the driver without panicking ([`super::driver::load_driver`]), `cuInit`, retain the
//!    device's primary context and make it current;
//! 2. open each distinct IPC handle once (`cuIpcOpenMemHandle`, lazy peer access), check with
//!    `cuMemGetAddressRange` that `offset + len` of every region stays inside the exported
//!    allocation, and build the region-major [`DeviceLayout`] from `base + offset`;
//! 3. register the host tier (page-aligned base) with `cuMemHostRegister(PORTABLE | DEVICEMAP)`,
//!    so that copies to and from it are real asynchronous DMA and the copy kernel can reach it;
//! 4. create one non-blocking stream and one timing-free event per layer; for
//!    [`CopyMethod::Kernel`], load the copy kernel ([`CopyKernel`]).
//!
//! One plan ([`CopyEngine::execute`]):
//!
//! 1. for each layer, enqueue its pieces on the stream, then record the layer's event. How
//!    depends on the [`CopyMethod`]: one driver call per piece ([`CopyMethod::Calls`]: a
//!    contiguous piece is one `cuMemcpy{DtoH,HtoD}Async`, a strided one one `cuMemcpy2DAsync`,
//!    or one copy per row when a pitch exceeds the device's maximum), or the layers' pieces
//!    flattened into rows and moved by kvshm's copy kernel ([`CopyMethod::Kernel`],
//!    [`super::kernel`]: one launch per group of layers, the groups alternating between two
//!    streams);
//! 2. wait for the events in order, reporting the layer's bytes and `Layers(layer + 1)` as each
//!    completes, so the worker heartbeats and the scheduler sees layer `L` land while later
//!    layers are still in flight;
//! 3. on any error, or when a report asks to stop, synchronise the stream before returning: a
//!    failed command must leave no copy running, because the scheduler frees its blocks when the
//!    failure arrives.
//!
//! Everything acquired is released in [`Drop`] in reverse order, also after a failed set-up.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::ops::ControlFlow;
use std::ptr;

use cudarc::driver::sys;

use super::calls;
use super::driver::{check, load_driver, DriverCallError, DriverLoadError};
use super::kernel::{max_rows, CopyKernel, GroupCut, PlanRows, KERNEL_ROW_BYTES};
pub use crate::worker::copy_method::CopyMethod;
use crate::worker::engine::{check_extent, report, CopyEngine, CopyFailure, CopyProgress};
use crate::worker::geometry::Geometry;
use crate::worker::host_engine::MappedArea;
use crate::worker::layout::{DeviceLayout, DeviceLayoutError, DeviceRegion, HostLayout};
use crate::worker::plan::{CopyPlan, StridedCopy};

/// Bytes of a CUDA IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = 64;

/// One device region as the engine publishes it: the IPC handle of the allocation holding it and
/// where in that allocation the region lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcRegion {
    /// `cuIpcGetMemHandle` bytes of the allocation.
    pub handle: [u8; IPC_HANDLE_BYTES],
    /// Byte offset of the region's block 0 from the allocation's base.
    pub offset: u64,
    /// Bytes of the region from `offset`.
    pub len: u64,
}

/// What the CUDA engine of one rank needs, as plain data.
#[derive(Clone, Debug)]
pub struct CudaEngineConfig {
    /// Device ordinal as this process numbers devices (after `CUDA_VISIBLE_DEVICES`).
    pub device_ordinal: u32,
    /// Region `r` of the device tier, one per geometry region.
    pub regions: Vec<IpcRegion>,
    /// Distance between the same region of two consecutive device blocks.
    pub region_stride: u64,
    /// The host tier mapping; its base must be page-aligned.
    pub host_tier: MappedArea,
    pub copy_method: CopyMethod,
}

/// Why the CUDA engine cannot start.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CudaInitError {
    #[error(transparent)]
    Load(#[from] DriverLoadError),
    #[error(transparent)]
    Driver(#[from] DriverCallError),
    #[error("device region {region}: offset {offset} + length {len} leaves its {available}-byte allocation")]
    RegionOutsideAllocation { region: u32, offset: u64, len: u64, available: u64 },
    #[error(transparent)]
    Layout(#[from] DeviceLayoutError),
    #[error("the host tier base {base:#x} is not page-aligned")]
    HostTierUnaligned { base: usize },
    #[error("the host tier holds {len} bytes, its layout needs {needed}")]
    HostTierTooSmall { len: usize, needed: u64 },
}

/// Driver objects owned by an engine, released in reverse order of acquisition on drop.
struct Resources {
    device: sys::CUdevice,
    context: Option<sys::CUcontext>,
    opened: Vec<sys::CUdeviceptr>,
    registered_host: Option<*mut c_void>,
    stream: Option<sys::CUstream>,
    /// One per layer.
    events: Vec<sys::CUevent>,
    kernel: Option<CopyKernel>,
}

impl Drop for Resources {
    fn drop(&mut self) {
        let Some(context) = self.context else { return };
        // SAFETY: every handle below was created by this struct's owner in `context`, is
        // released exactly once (the vectors and options are drained), and after the stream has
        // been synchronised no copy uses the memory being unregistered or closed.
        unsafe {
            warn_on_error(check("cuCtxSetCurrent", sys::cuCtxSetCurrent(context)));
            if let Some(stream) = self.stream {
                warn_on_error(check("cuStreamSynchronize", sys::cuStreamSynchronize(stream)));
            }
            if let Some(kernel) = self.kernel.take() {
                kernel.release().into_iter().for_each(warn_on_error);
            }
            for event in self.events.drain(..) {
                warn_on_error(check("cuEventDestroy", sys::cuEventDestroy_v2(event)));
            }
            if let Some(stream) = self.stream.take() {
                warn_on_error(check("cuStreamDestroy", sys::cuStreamDestroy_v2(stream)));
            }
            if let Some(host) = self.registered_host.take() {
                warn_on_error(check("cuMemHostUnregister", sys::cuMemHostUnregister(host)));
            }
            for pointer in self.opened.drain(..) {
                warn_on_error(check("cuIpcCloseMemHandle", sys::cuIpcCloseMemHandle(pointer)));
            }
            warn_on_error(check(
                "cuDevicePrimaryCtxRelease",
                sys::cuDevicePrimaryCtxRelease_v2(self.device),
            ));
        }
    }
}

pub(super) fn warn_on_error(result: Result<(), DriverCallError>) {
    if let Err(error) = result {
        tracing::warn!(%error, "releasing a CUDA resource failed");
    }
}

/// Copy engine over CUDA device regions and a pinned host tier. Not `Send`: it is driven by the
/// worker's single thread, which is where its context is made current.
pub struct CudaCopyEngine {
    geometry: Geometry,
    device_layout: DeviceLayout,
    host_layout: HostLayout,
    host: MappedArea,
    /// The host tier's base as the device addresses it (the copy kernel's view).
    host_on_device: u64,
    max_pitch: u64,
    method: CopyMethod,
    /// The rows of the plan being executed (kernel method), kept for their capacity.
    rows: PlanRows,
    resources: Resources,
}

impl CudaCopyEngine {
    /// Opens the device regions and registers the host tier (see the module documentation).
    ///
    /// Returns [`CudaInitError::Load`] with [`DriverLoadError::DriverMissing`] on a machine
    /// without a CUDA driver, never a panic.
    pub fn new(
        geometry: Geometry,
        config: &CudaEngineConfig,
    ) -> Result<CudaCopyEngine, CudaInitError> {
        load_driver()?;
        let host_layout = HostLayout::new(&geometry);
        let host = config.host_tier;
        if (host.len() as u64) < host_layout.len() {
            return Err(CudaInitError::HostTierTooSmall {
                len: host.len(),
                needed: host_layout.len(),
            });
        }
        if host.as_ptr() as usize % page_size() != 0 {
            return Err(CudaInitError::HostTierUnaligned { base: host.as_ptr() as usize });
        }
        let ordinal = c_int::try_from(config.device_ordinal)
            .map_err(|_| DriverCallError { call: "cuDeviceGet", code: INVALID_DEVICE })?;

        let mut device: sys::CUdevice = 0;
        // SAFETY: the driver is loaded with every entry point used here (`load_driver`); each call
        // writes only to the out-parameter it is given, a live local.
        unsafe {
            check("cuInit", sys::cuInit(0))?;
            check("cuDeviceGet", sys::cuDeviceGet(&mut device, ordinal))?;
        }
        let mut resources = Resources {
            device,
            context: None,
            opened: Vec::new(),
            registered_host: None,
            stream: None,
            events: Vec::new(),
            kernel: None,
        };
        let mut context: sys::CUcontext = ptr::null_mut();
        let mut max_pitch: c_int = 0;
        // SAFETY: as above; the retained context is recorded at once so that `Resources::drop`
        // releases it on every later failure.
        unsafe {
            check("cuDevicePrimaryCtxRetain", sys::cuDevicePrimaryCtxRetain(&mut context, device))?;
            resources.context = Some(context);
            check("cuCtxSetCurrent", sys::cuCtxSetCurrent(context))?;
            check(
                "cuDeviceGetAttribute",
                sys::cuDeviceGetAttribute(
                    &mut max_pitch,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PITCH,
                    device,
                ),
            )?;
        }

        let regions = open_regions(&config.regions, &mut resources)?;
        let device_layout = DeviceLayout::from_regions(&geometry, &regions, config.region_stride)?;

        let mut host_on_device: sys::CUdeviceptr = 0;
        if !host.is_empty() {
            // SAFETY: `host` is mapped and stays mapped for the engine's life (`MappedArea::new`'s
            // contract); its base is page-aligned (checked above). Recorded at once for `drop`;
            // the device address is only an out-parameter.
            unsafe {
                check(
                    "cuMemHostRegister",
                    sys::cuMemHostRegister_v2(
                        host.as_ptr().cast(),
                        host.len(),
                        sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
                    ),
                )?;
                resources.registered_host = Some(host.as_ptr().cast());
                check(
                    "cuMemHostGetDevicePointer",
                    sys::cuMemHostGetDevicePointer_v2(&mut host_on_device, host.as_ptr().cast(), 0),
                )?;
            }
        }
        if config.copy_method == CopyMethod::Kernel {
            // SAFETY: the context is current (made so above).
            resources.kernel = Some(unsafe { CopyKernel::load(device) }?);
        }

        // SAFETY: the context is current; out-parameters are live locals; every created object
        // is recorded at once for `drop`.
        unsafe {
            let mut stream: sys::CUstream = ptr::null_mut();
            check(
                "cuStreamCreate",
                sys::cuStreamCreate(
                    &mut stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint,
                ),
            )?;
            resources.stream = Some(stream);
            for _ in 0..geometry.layers() {
                let mut event: sys::CUevent = ptr::null_mut();
                check(
                    "cuEventCreate",
                    sys::cuEventCreate(
                        &mut event,
                        sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint,
                    ),
                )?;
                resources.events.push(event);
            }
        }

        Ok(CudaCopyEngine {
            geometry,
            device_layout,
            host_layout,
            host,
            host_on_device,
            max_pitch: u64::try_from(max_pitch).unwrap_or(0),
            method: config.copy_method,
            rows: PlanRows::default(),
            resources,
        })
    }

    pub fn copy_method(&self) -> CopyMethod {
        self.method
    }

    fn stream(&self) -> sys::CUstream {
        self.resources.stream.expect("an engine without a stream is a programming error")
    }

    /// Enqueues every layer's pieces and records the layer's event behind them.
    fn enqueue(&mut self, plan: &CopyPlan) -> Result<(), CopyFailure> {
        match self.method {
            CopyMethod::Calls => self.enqueue_calls(plan),
            CopyMethod::Kernel => self.enqueue_rows(plan),
        }
    }

    fn record_layer(&self, layer: usize) -> Result<(), CopyFailure> {
        // SAFETY: the event and the stream belong to this engine's current context.
        unsafe {
            check("cuEventRecord", sys::cuEventRecord(self.resources.events[layer], self.stream()))
        }
        .map_err(driver_failure)
    }

    /// [`CopyMethod::Calls`]: one driver call per piece.
    fn enqueue_calls(&self, plan: &CopyPlan) -> Result<(), CopyFailure> {
        for layer in 0..self.geometry.layers() {
            plan.for_each_piece_of_layer(
                layer,
                &self.geometry,
                &self.device_layout,
                &self.host_layout,
                |piece| {
                    check_extents(&piece, &self.device_layout, &self.host)?;
                    // SAFETY: the context is current (execute); the piece's extent was checked
                    // on both sides just above; the host tier is registered and, like the
                    // opened regions, stays so until the engine drops, after its stream drained;
                    // no one else touches these blocks until the command completes (the
                    // block-ownership protocol; trusted peers).
                    unsafe {
                        calls::enqueue_piece(
                            plan.direction(),
                            &piece,
                            &self.host,
                            self.max_pitch,
                            self.stream(),
                        )
                    }
                    .map_err(driver_failure)
                },
            )?;
            self.record_layer(layer as usize)?;
        }
        Ok(())
    }

    /// [`CopyMethod::Kernel`]: the plan's pieces as rows, each launch group launched as soon as
    /// its rows are built ([`super::kernel`]'s module flow).
    fn enqueue_rows(&mut self, plan: &CopyPlan) -> Result<(), CopyFailure> {
        let mut rows = std::mem::take(&mut self.rows);
        let result = self.build_and_launch(plan, &mut rows);
        self.rows = rows;
        result
    }

    fn build_and_launch(
        &mut self,
        plan: &CopyPlan,
        rows: &mut PlanRows,
    ) -> Result<(), CopyFailure> {
        let layers = self.geometry.layers() as usize;
        let stream = self.stream();
        let bound = max_rows(plan.blocks(), self.geometry.regions(), self.geometry.region_bytes());
        let kernel = self.resources.kernel.as_mut().expect("the kernel method loads its kernel");
        // SAFETY: the context is current (execute) and both of the kernel's streams are idle:
        // every plan waits for all its layer events, or drains, before the next begins.
        unsafe { kernel.reserve(bound) }.map_err(driver_failure)?;
        rows.clear();
        let mut cut = GroupCut::default();
        let mut group_start = 0;
        for layer in 0..layers {
            plan.for_each_piece_of_layer(
                layer as u32,
                &self.geometry,
                &self.device_layout,
                &self.host_layout,
                |piece| {
                    check_extents(&piece, &self.device_layout, &self.host)?;
                    rows.push_piece(
                        plan.direction(),
                        &piece,
                        self.host_on_device,
                        KERNEL_ROW_BYTES,
                    );
                    Ok::<(), CopyFailure>(())
                },
            )?;
            rows.end_layer();
            if !cut.end_layer(rows.layer_bytes(layer), layer + 1 == layers) {
                continue;
            }
            let kernel = self.resources.kernel.as_mut().expect("loaded");
            // SAFETY: the context is current; `reserve` made room for every row of the plan
            // (`max_rows` bounds them); every row lies inside the opened device regions or the
            // registered, device-mapped host tier (each piece's extent was checked above), which
            // stay so until the engine drops; no two rows overlap (distinct destination blocks
            // and regions, two tiers); no other process touches these blocks until the command
            // completes (the block-ownership protocol; trusted peers).
            unsafe {
                kernel.launch_group(rows, group_start..layer + 1, stream, &self.resources.events)
            }
            .map_err(driver_failure)?;
            group_start = layer + 1;
        }
        Ok(())
    }

    /// Waits for the layers' events in order, reporting each (its bytes, then the layer).
    ///
    /// One wait lasts as long as one layer of the command takes to land: the scheduler keeps a
    /// command's bytes bounded (`ServiceConfig::max_command_bytes`), so even a single-layer command
    /// lands well inside the heartbeat timeout, and the reports keep the worker heartbeating.
    fn wait_layers(
        &self,
        plan: &CopyPlan,
        progress: &mut dyn FnMut(CopyProgress) -> ControlFlow<()>,
    ) -> Result<(), CopyFailure> {
        let layer_bytes = plan.blocks().saturating_mul(self.geometry.block_bytes())
            / u64::from(self.geometry.layers());
        for (layer, &event) in (1u32..).zip(&self.resources.events) {
            // SAFETY: the event belongs to this engine's current context and has been recorded.
            unsafe { check("cuEventSynchronize", sys::cuEventSynchronize(event)) }
                .map_err(driver_failure)?;
            report(progress, CopyProgress::Bytes(layer_bytes))?;
            report(progress, CopyProgress::Layers(layer))?;
        }
        Ok(())
    }

    /// Blocks until nothing enqueued by this engine is still running; used on failure paths.
    fn drain(&self) {
        // SAFETY: the stream belongs to this engine's current context.
        warn_on_error(unsafe {
            check("cuStreamSynchronize", sys::cuStreamSynchronize(self.stream()))
        });
        if let Some(kernel) = &self.resources.kernel {
            warn_on_error(kernel.synchronize());
        }
    }
}

impl CopyEngine for CudaCopyEngine {
    fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    fn execute(
        &mut self,
        plan: &CopyPlan,
        progress: &mut dyn FnMut(CopyProgress) -> ControlFlow<()>,
    ) -> Result<(), CopyFailure> {
        let context =
            self.resources.context.expect("an engine without a context is a programming error");
        // SAFETY: the context is retained by this engine.
        unsafe { check("cuCtxSetCurrent", sys::cuCtxSetCurrent(context)) }
            .map_err(driver_failure)?;
        let result = self.enqueue(plan).and_then(|()| self.wait_layers(plan, progress));
        if result.is_err() {
            self.drain();
        }
        result
    }
}

/// Opens each distinct IPC handle once and returns the regions' device extents.
fn open_regions(
    regions: &[IpcRegion],
    resources: &mut Resources,
) -> Result<Vec<DeviceRegion>, CudaInitError> {
    // handle bytes -> (opened base, bytes available from it)
    let mut opened: HashMap<[u8; IPC_HANDLE_BYTES], (u64, u64)> = HashMap::new();
    let mut extents = Vec::with_capacity(regions.len());
    for (index, region) in (0u32..).zip(regions) {
        let (base, available) = match opened.get(&region.handle) {
            Some(&known) => known,
            None => {
                let handle =
                    sys::CUipcMemHandle { reserved: region.handle.map(|byte| byte as c_char) };
                let mut pointer: sys::CUdeviceptr = 0;
                let mut allocation_base: sys::CUdeviceptr = 0;
                let mut allocation_size: usize = 0;
                // SAFETY: the context is current; out-parameters are live locals; the opened
                // pointer is recorded at once so that `Resources::drop` closes it.
                unsafe {
                    check(
                        "cuIpcOpenMemHandle",
                        sys::cuIpcOpenMemHandle_v2(
                            &mut pointer,
                            handle,
                            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint,
                        ),
                    )?;
                    resources.opened.push(pointer);
                    check(
                        "cuMemGetAddressRange",
                        sys::cuMemGetAddressRange_v2(
                            &mut allocation_base,
                            &mut allocation_size,
                            pointer,
                        ),
                    )?;
                }
                let end = allocation_base.saturating_add(allocation_size as u64);
                let known = (pointer, end.saturating_sub(pointer));
                opened.insert(region.handle, known);
                known
            }
        };
        let fits = region.offset.checked_add(region.len).is_some_and(|end| end <= available);
        if !fits {
            return Err(CudaInitError::RegionOutsideAllocation {
                region: index,
                offset: region.offset,
                len: region.len,
                available,
            });
        }
        extents.push(DeviceRegion { base: base + region.offset, len: region.len });
    }
    Ok(extents)
}

/// Fails unless both sides of `piece` lie inside their tier.
fn check_extents(
    piece: &StridedCopy,
    device: &DeviceLayout,
    host: &MappedArea,
) -> Result<(), CopyFailure> {
    check_extent(piece.device_end(), device.end(), "device")?;
    check_extent(piece.host_end(), host.len() as u64, "host")
}

fn driver_failure(error: DriverCallError) -> CopyFailure {
    CopyFailure::Driver { call: error.call, code: error.code }
}

/// `CUDA_ERROR_INVALID_DEVICE`, for an ordinal that does not even fit the driver's int.
const INVALID_DEVICE: u32 = 101;

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::geometry::GeometryParams;

    #[test]
    fn without_a_usable_driver_the_engine_reports_a_typed_error_instead_of_panicking() {
        let geometry = Geometry::new(GeometryParams {
            layers: 1,
            regions: 2,
            region_bytes: 4096,
            device_blocks: 4,
            host_blocks: 4,
        })
        .unwrap();
        let mut host = vec![0u8; 2 * 4096 * 4 + 4096];
        let offset = host.as_ptr().align_offset(page_size());
        // SAFETY: the vector outlives the engine attempt and nothing else touches it.
        let host_tier =
            unsafe { MappedArea::new(host.as_mut_ptr().add(offset), 2 * 4096 * 4) }.unwrap();
        let bogus = IpcRegion { handle: [0x5a; IPC_HANDLE_BYTES], offset: 0, len: 4 * 4096 };
        let config = CudaEngineConfig {
            device_ordinal: 0,
            regions: vec![bogus, IpcRegion { offset: 4 * 4096, ..bogus }],
            region_stride: 4096,
            host_tier,
            copy_method: CopyMethod::Kernel,
        };
        // SAFETY: only asks whether a driver library opens.
        let driver_present = unsafe { sys::is_culib_present() };
        let result = CudaCopyEngine::new(geometry, &config);
        if driver_present {
            // A real driver refuses a garbage IPC handle (or has no device) with a driver error.
            assert!(matches!(result, Err(CudaInitError::Driver(_))), "{:?}", result.err());
        } else {
            assert_eq!(result.err(), Some(CudaInitError::Load(DriverLoadError::DriverMissing)));
        }
    }
}
