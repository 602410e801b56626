//! The exception hierarchy: every error of the Rust API becomes one of these, by meaning.
//!
//! ```text
//! KvshmError
//! ├── ConfigError            a configuration kvshm refuses (sizes, geometry, names, policies)
//! ├── SegmentError           creating, attaching to or mapping shared memory failed
//! ├── RequestError           an operation on a request that cannot be carried out
//! │   ├── UnknownRequestError    the request is not live
//! │   ├── DuplicateRequestError  the request is live already
//! │   ├── RequestFailedError     a swap-in it waited on failed: abort it
//! │   ├── OutOfBlocksError       not enough device blocks can be had (nothing changed)
//! │   └── CommitError            a commit that does not fit the request
//! ├── TicketError            an unknown ticket
//! ├── TransferFailedError    a copy the caller waited on failed on a rank
//! ├── KvshmTimeoutError      a wait ran out of time
//! ├── ResetRefusedError      requests still hold blocks; reset with force
//! ├── ResizeError            the device tier cannot take that size
//! ├── OffloadError           an offload-manager call on keys that do not allow it
//! ├── DeviceHandleError      a tensor that cannot be shared with the workers
//! └── WorkerError            a worker or kvctl run that failed
//! ```
//! Wrong Python types and out-of-range numbers are `TypeError` / `ValueError` as usual.

use kvshm::hash::ZeroBlockTokens;
use kvshm::manager::{
    AllocateError, CommitError as RustCommitError, ConfigError as CacheConfigError, FinishError,
    MatchError, PrefetchError, ResetError, TicketError as RustTicketError, UnknownRequest,
};
use kvshm::offload::OffloadError as RustOffloadError;
use kvshm::service::{
    DeviceResizeError, SegmentError as RustSegmentError, ServiceError, TransportError, WaitError,
};
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::PyErr;

pyo3::create_exception!(kvshm, KvshmError, PyException, "Base class of every kvshm error.");
pyo3::create_exception!(kvshm, ConfigError, KvshmError, "A configuration kvshm refuses.");
pyo3::create_exception!(kvshm, SegmentError, KvshmError, "Shared memory could not be set up.");
pyo3::create_exception!(kvshm, RequestError, KvshmError, "A request operation was refused.");
pyo3::create_exception!(kvshm, UnknownRequestError, RequestError, "The request is not live.");
pyo3::create_exception!(kvshm, DuplicateRequestError, RequestError, "The request is live already.");
pyo3::create_exception!(
    kvshm,
    RequestFailedError,
    RequestError,
    "A swap-in the request waited on failed; abort it."
);
pyo3::create_exception!(
    kvshm,
    OutOfBlocksError,
    RequestError,
    "Not enough device blocks can be had; nothing changed."
);
pyo3::create_exception!(
    kvshm,
    CommitError,
    RequestError,
    "A commit that does not fit the request."
);
pyo3::create_exception!(kvshm, TicketError, KvshmError, "The ticket is not known.");
pyo3::create_exception!(kvshm, TransferFailedError, KvshmError, "A copy failed on a rank.");
pyo3::create_exception!(kvshm, KvshmTimeoutError, KvshmError, "A wait ran out of time.");
pyo3::create_exception!(kvshm, ResetRefusedError, KvshmError, "Requests still hold blocks.");
pyo3::create_exception!(kvshm, ResizeError, KvshmError, "The device tier cannot take that size.");
pyo3::create_exception!(kvshm, OffloadError, KvshmError, "An offload-manager call was refused.");
pyo3::create_exception!(
    kvshm,
    DeviceHandleError,
    KvshmError,
    "A tensor that cannot be shared with the worker processes."
);
pyo3::create_exception!(kvshm, WorkerError, KvshmError, "A worker or kvctl run failed.");

/// Adds every exception class to the module.
pub fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = module.py();
    module.add("KvshmError", py.get_type::<KvshmError>())?;
    module.add("ConfigError", py.get_type::<ConfigError>())?;
    module.add("SegmentError", py.get_type::<SegmentError>())?;
    module.add("RequestError", py.get_type::<RequestError>())?;
    module.add("UnknownRequestError", py.get_type::<UnknownRequestError>())?;
    module.add("DuplicateRequestError", py.get_type::<DuplicateRequestError>())?;
    module.add("RequestFailedError", py.get_type::<RequestFailedError>())?;
    module.add("OutOfBlocksError", py.get_type::<OutOfBlocksError>())?;
    module.add("CommitError", py.get_type::<CommitError>())?;
    module.add("TicketError", py.get_type::<TicketError>())?;
    module.add("TransferFailedError", py.get_type::<TransferFailedError>())?;
    module.add("ResetRefusedError", py.get_type::<ResetRefusedError>())?;
    module.add("ResizeError", py.get_type::<ResizeError>())?;
    module.add("OffloadError", py.get_type::<OffloadError>())?;
    module.add("DeviceHandleError", py.get_type::<DeviceHandleError>())?;
    module.add("WorkerError", py.get_type::<WorkerError>())?;
    module.add("KvshmTimeoutError", py.get_type::<KvshmTimeoutError>())?;
    Ok(())
}

/// Converts a Rust error into the Python exception of the same meaning.
pub trait ToPyErr {
    fn to_py(self) -> PyErr;
}

impl ToPyErr for MatchError {
    fn to_py(self) -> PyErr {
        let message = self.to_string();
        match self {
            MatchError::DuplicateRequest(_) => DuplicateRequestError::new_err(message),
            MatchError::UnknownRequest(_) => UnknownRequestError::new_err(message),
            MatchError::AlreadyAllocated(_)
            | MatchError::PrefixMismatch { .. }
            | MatchError::Prompt(_) => RequestError::new_err(message),
        }
    }
}

impl ToPyErr for AllocateError {
    fn to_py(self) -> PyErr {
        let message = self.to_string();
        match self {
            AllocateError::UnknownRequest(_) => UnknownRequestError::new_err(message),
            AllocateError::RequestFailed(_) => RequestFailedError::new_err(message),
            AllocateError::OutOfBlocks { .. } | AllocateError::OutOfHostBlocks { .. } => {
                OutOfBlocksError::new_err(message)
            }
            AllocateError::TooManyTokens { .. } => pyo3::exceptions::PyValueError::new_err(message),
        }
    }
}

impl ToPyErr for RustCommitError {
    fn to_py(self) -> PyErr {
        let message = self.to_string();
        match self {
            RustCommitError::UnknownRequest(_) => UnknownRequestError::new_err(message),
            RustCommitError::RequestFailed(_) => RequestFailedError::new_err(message),
            _ => CommitError::new_err(message),
        }
    }
}

impl ToPyErr for FinishError {
    fn to_py(self) -> PyErr {
        UnknownRequestError::new_err(self.to_string())
    }
}

impl ToPyErr for UnknownRequest {
    fn to_py(self) -> PyErr {
        UnknownRequestError::new_err(self.to_string())
    }
}

impl ToPyErr for RustTicketError {
    fn to_py(self) -> PyErr {
        TicketError::new_err(self.to_string())
    }
}

impl ToPyErr for ResetError {
    fn to_py(self) -> PyErr {
        ResetRefusedError::new_err(self.to_string())
    }
}

impl ToPyErr for DeviceResizeError {
    fn to_py(self) -> PyErr {
        ResizeError::new_err(self.to_string())
    }
}

impl ToPyErr for CacheConfigError {
    fn to_py(self) -> PyErr {
        ConfigError::new_err(self.to_string())
    }
}

impl ToPyErr for PrefetchError {
    fn to_py(self) -> PyErr {
        ConfigError::new_err(self.to_string())
    }
}

impl ToPyErr for ZeroBlockTokens {
    fn to_py(self) -> PyErr {
        ConfigError::new_err(self.to_string())
    }
}

impl ToPyErr for ServiceError {
    fn to_py(self) -> PyErr {
        let message = self.to_string();
        match self {
            ServiceError::Cache(_) | ServiceError::StorageBackoff(_) => {
                ConfigError::new_err(message)
            }
            ServiceError::Transport(error) => error.to_py(),
            ServiceError::WorkerMissing(_) => KvshmTimeoutError::new_err(message),
        }
    }
}

impl ToPyErr for TransportError {
    fn to_py(self) -> PyErr {
        let message = self.to_string();
        match self {
            TransportError::Geometry(_) => ConfigError::new_err(message),
            _ => SegmentError::new_err(message),
        }
    }
}

impl ToPyErr for RustSegmentError {
    fn to_py(self) -> PyErr {
        SegmentError::new_err(self.to_string())
    }
}

impl ToPyErr for WaitError {
    fn to_py(self) -> PyErr {
        let message = self.to_string();
        match self {
            WaitError::Ticket(_) => TicketError::new_err(message),
            WaitError::TransferFailed(_) => TransferFailedError::new_err(message),
            WaitError::TimedOut { .. } => KvshmTimeoutError::new_err(message),
        }
    }
}

impl ToPyErr for RustOffloadError {
    fn to_py(self) -> PyErr {
        let message = self.to_string();
        match self {
            RustOffloadError::KeyTooLong(_) | RustOffloadError::PositionCount { .. } => {
                pyo3::exceptions::PyValueError::new_err(message)
            }
            RustOffloadError::TooManyChunks(_) | RustOffloadError::TagTooLong { .. } => {
                ConfigError::new_err(message)
            }
            _ => OffloadError::new_err(message),
        }
    }
}

impl ToPyErr for kvshm::offload::KeyTooLong {
    fn to_py(self) -> PyErr {
        pyo3::exceptions::PyValueError::new_err(self.to_string())
    }
}

/// `result.map_err(ToPyErr::to_py)`, shorter.
pub trait IntoPyResult<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T, E: ToPyErr> IntoPyResult<T> for Result<T, E> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(ToPyErr::to_py)
    }
}
