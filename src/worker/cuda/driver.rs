//! Loading the CUDA driver without panicking, and turning driver return codes into typed errors.
//!
//! cudarc's `dynamic-loading` resolves `libcuda` and each entry point lazily, on the first call,
//! and panics when the library or a symbol is missing (`panic_no_lib_found`, "Missing symbol").
//! A worker started with `--backend cuda` on a machine without a driver must instead exit with an
//! error that says so. [`load_driver`] therefore:
//!
//! 1. asks cudarc whether any of its candidate library names opens (`is_culib_present`, which only
//!    tries `dlopen` and never panics); none: [`DriverLoadError::DriverMissing`];
//! 2. opens the library through cudarc's own loader (`culib`, which cannot panic now that a
//!    candidate is known to open) and looks up every entry point in [`ENTRY_POINTS`], the complete
//!    list of driver functions this engine calls; one missing: [`DriverLoadError::EntryPointMissing`]
//!    (a driver older than the CUDA 12.8 bindings).
//!
//! After it succeeds, no cudarc `sys` call of this module can reach a panicking path. This is
//! preferred to `catch_unwind`, which would print the panic message and leave a poisoned
//! `OnceLock` behind.

use cudarc::driver::sys;

/// Every driver entry point this module's users call (the copy engine, and the engine-side KV
/// buffers of the demo, the copy bench and the GPU tests), by the exact name cudarc resolves.
/// All of them are in every driver of CUDA 12.0 and later.
pub const ENTRY_POINTS: &[&str] = &[
    "cuInit",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuMemGetAddressRange_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuStreamCreate",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuStreamDestroy_v2",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpy2DAsync_v2",
    "cuDeviceGetCount",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostGetDevicePointer_v2",
    "cuIpcGetMemHandle",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemsetD8_v2",
    "cuEventElapsedTime",
];

/// Why the driver library cannot be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DriverLoadError {
    #[error("no CUDA driver library (libcuda) could be loaded; is the NVIDIA driver installed?")]
    DriverMissing,
    #[error("the CUDA driver library has no {entry_point}; the driver is too old")]
    EntryPointMissing { entry_point: &'static str },
}

/// Makes sure the driver library and every entry point the engine uses are present (see the
/// module documentation). Cheap after the first call.
pub fn load_driver() -> Result<(), DriverLoadError> {
    // SAFETY: `is_culib_present` only `dlopen`s cudarc's candidate names and closes them again;
    // running a driver library's initialisers is what loading it for any CUDA use does.
    if !unsafe { sys::is_culib_present() } {
        return Err(DriverLoadError::DriverMissing);
    }
    // SAFETY: a candidate opens (checked just above), so `culib` finds one instead of panicking;
    // it keeps the library loaded for the rest of the process, as every later `sys` call needs.
    let library = unsafe { sys::culib() };
    for &entry_point in ENTRY_POINTS {
        // SAFETY: the symbol is only looked up, never called through this pointer type, which has
        // the size of a symbol address as libloading requires.
        let found = unsafe { library.get::<*mut std::ffi::c_void>(entry_point.as_bytes()) };
        if found.is_err() {
            return Err(DriverLoadError::EntryPointMissing { entry_point });
        }
    }
    Ok(())
}

/// A driver call that returned an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{call} failed with CUDA error {code}")]
pub struct DriverCallError {
    pub call: &'static str,
    pub code: u32,
}

/// `Ok` for `CUDA_SUCCESS`, else the call's name and the error code.
pub fn check(call: &'static str, result: sys::CUresult) -> Result<(), DriverCallError> {
    if result == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DriverCallError { call, code: result as u32 })
    }
}
