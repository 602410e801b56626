//! [`CopyMethod::Calls`](super::engine::CopyMethod): one driver call per piece, the copy engines
//! doing the work and no GPU thread used. A contiguous piece is one `cuMemcpy{DtoH,HtoD}Async`,
//! a strided one one `cuMemcpy2DAsync` whose rows the DMA engine walks, or one copy per row when a
//! pitch exceeds the device's maximum.

use std::ffi::c_void;
use std::ptr;

use cudarc::driver::sys;

use super::driver::{check, DriverCallError};
use crate::worker::host_engine::MappedArea;
use crate::worker::plan::{Direction, StridedCopy};

/// Enqueues `piece` on `stream`.
///
/// # Safety
/// The context of `stream` is current; every row of the piece lies inside device memory opened
/// in it and inside `host`, which is registered with the driver; both stay valid until the copy
/// completes, and no one else touches the piece's bytes until then (no data race).
pub unsafe fn enqueue_piece(
    direction: Direction,
    piece: &StridedCopy,
    host: &MappedArea,
    max_pitch: u64,
    stream: sys::CUstream,
) -> Result<(), DriverCallError> {
    // The host extent is inside the host area (usize bytes), so host offsets and pitches fit in
    // usize; device values are device addresses, 64-bit like usize on supported targets.
    let host_at = |row: u64| -> *mut c_void {
        let offset = (piece.host_offset + row * piece.host_pitch) as usize;
        // SAFETY: row `row` starts inside the host area (the caller's premise).
        unsafe { host.as_ptr().add(offset).cast() }
    };
    let device_at = |row: u64| piece.device_offset + row * piece.device_pitch;
    let width = piece.width as usize;
    let strided_fits = piece.device_pitch <= max_pitch && piece.host_pitch <= max_pitch;
    // SAFETY: for every branch, every device and host row lies in memory the driver knows and
    // that stays valid, and nothing else touches it meanwhile (the caller's premise); the 2-D
    // descriptor is a live local read during the call.
    unsafe {
        if piece.is_contiguous() {
            let bytes = width * piece.rows as usize;
            match direction {
                Direction::DeviceToHost => check(
                    "cuMemcpyDtoHAsync",
                    sys::cuMemcpyDtoHAsync_v2(host_at(0), device_at(0), bytes, stream),
                ),
                Direction::HostToDevice => check(
                    "cuMemcpyHtoDAsync",
                    sys::cuMemcpyHtoDAsync_v2(device_at(0), host_at(0), bytes, stream),
                ),
            }
        } else if strided_fits {
            let copy = memcpy_2d(direction, piece, host_at(0), device_at(0));
            check("cuMemcpy2DAsync", sys::cuMemcpy2DAsync_v2(&copy, stream))
        } else {
            (0..u64::from(piece.rows)).try_for_each(|row| match direction {
                Direction::DeviceToHost => check(
                    "cuMemcpyDtoHAsync",
                    sys::cuMemcpyDtoHAsync_v2(host_at(row), device_at(row), width, stream),
                ),
                Direction::HostToDevice => check(
                    "cuMemcpyHtoDAsync",
                    sys::cuMemcpyHtoDAsync_v2(device_at(row), host_at(row), width, stream),
                ),
            })
        }
    }
}

/// The 2-D copy descriptor of a strided piece.
fn memcpy_2d(
    direction: Direction,
    piece: &StridedCopy,
    host: *mut c_void,
    device: sys::CUdeviceptr,
) -> sys::CUDA_MEMCPY2D {
    let host_side = (sys::CUmemorytype::CU_MEMORYTYPE_HOST, host, 0, piece.host_pitch as usize);
    let device_side = (
        sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        ptr::null_mut(),
        device,
        piece.device_pitch as usize,
    );
    let (src, dst) = match direction {
        Direction::DeviceToHost => (device_side, host_side),
        Direction::HostToDevice => (host_side, device_side),
    };
    sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: src.0,
        srcHost: src.1.cast_const(),
        srcDevice: src.2,
        srcArray: ptr::null_mut(),
        srcPitch: src.3,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: dst.0,
        dstHost: dst.1,
        dstDevice: dst.2,
        dstArray: ptr::null_mut(),
        dstPitch: dst.3,
        WidthInBytes: piece.width as usize,
        Height: piece.rows as usize,
    }
}
