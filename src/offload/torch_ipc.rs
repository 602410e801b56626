//! Reading the CUDA IPC handle PyTorch exports for a tensor's storage, so that a kvshm worker
//! process can open the engine's KV tensors.
//!
//! `storage._share_cuda_()` returns, at index 1, the handle bytes of the allocation block that
//! holds the storage, and at index 3 the storage's byte offset inside that block. The bytes are
//! either a bare 64-byte `cudaIpcMemHandle_t` (older PyTorch) or versioned:
//! 1. byte 0: the format version (1 or 2);
//! 2. byte 1: the kind: `c` for memory from `cudaMalloc` (the 64-byte handle follows), `e` for
//!    an expandable segment (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`), whose memory
//!    is exported through a file descriptor or fabric handle that `cuIpcOpenMemHandle` cannot
//!    open: refused with [`TorchHandleError::ExpandableSegment`].

use kvshm_ipc::device_handles::CUDA_IPC_HANDLE_BYTES;

/// The newest handle format version this reader knows.
pub const NEWEST_VERSION: u8 = 2;

/// Why a tensor's handle cannot be opened by a worker.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TorchHandleError {
    #[error(
        "the tensor lives in a PyTorch expandable segment, which another process cannot open \
         with cudaIpcOpenMemHandle; run the engine with PYTORCH_CUDA_ALLOC_CONF=\
         expandable_segments:False (or without expandable_segments) to use kvshm workers"
    )]
    ExpandableSegment,
    #[error(
        "CUDA IPC handle format version {version} is newer than the {NEWEST_VERSION} kvshm reads"
    )]
    UnknownVersion { version: u8 },
    #[error("CUDA IPC handle kind {kind:#04x} is neither 'c' (cudaMalloc) nor 'e' (expandable)")]
    UnknownKind { kind: u8 },
    #[error("CUDA IPC handle of {len} bytes: expected 64, or a version, a kind and 64 bytes")]
    BadLength { len: usize },
}

/// The 64-byte `cudaIpcMemHandle_t` in PyTorch's handle bytes (module flow).
pub fn parse_cuda_handle(bytes: &[u8]) -> Result<[u8; CUDA_IPC_HANDLE_BYTES], TorchHandleError> {
    if bytes.len() == CUDA_IPC_HANDLE_BYTES {
        return Ok(bytes.try_into().expect("64 bytes"));
    }
    let [version, kind, rest @ ..] = bytes else {
        return Err(TorchHandleError::BadLength { len: bytes.len() });
    };
    if *version == 0 || *version > NEWEST_VERSION {
        return Err(TorchHandleError::UnknownVersion { version: *version });
    }
    match kind {
        b'c' => rest.try_into().map_err(|_| TorchHandleError::BadLength { len: bytes.len() }),
        b'e' => Err(TorchHandleError::ExpandableSegment),
        &kind => Err(TorchHandleError::UnknownKind { kind }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle() -> [u8; 64] {
        std::array::from_fn(|index| index as u8 ^ 0xa5)
    }

    #[test]
    fn a_cuda_malloc_handle_is_read_from_the_versioned_bytes() {
        let mut bytes = vec![2, b'c'];
        bytes.extend(handle());
        assert_eq!(parse_cuda_handle(&bytes), Ok(handle()));
        bytes[0] = 1;
        assert_eq!(parse_cuda_handle(&bytes), Ok(handle()));
    }

    #[test]
    fn a_bare_64_byte_handle_of_older_pytorch_is_taken_as_is() {
        assert_eq!(parse_cuda_handle(&handle()), Ok(handle()));
    }

    #[test]
    fn an_expandable_segment_is_refused_with_a_way_out() {
        // What PyTorch writes for an expandable segment: version, 'e', then its own header and
        // a POSIX fd or fabric handle.
        let mut bytes = vec![2, b'e'];
        bytes.extend([0u8; 24]);
        let error = parse_cuda_handle(&bytes).unwrap_err();
        assert_eq!(error, TorchHandleError::ExpandableSegment);
        assert!(error.to_string().contains("expandable_segments:False"));
    }

    #[test]
    fn other_bytes_are_typed_errors() {
        assert_eq!(parse_cuda_handle(&[]), Err(TorchHandleError::BadLength { len: 0 }));
        assert_eq!(parse_cuda_handle(&[2]), Err(TorchHandleError::BadLength { len: 1 }));
        assert_eq!(
            parse_cuda_handle(&[2, b'c', 1, 2]),
            Err(TorchHandleError::BadLength { len: 4 })
        );
        let mut future = vec![3, b'c'];
        future.extend(handle());
        assert_eq!(
            parse_cuda_handle(&future),
            Err(TorchHandleError::UnknownVersion { version: 3 })
        );
        assert_eq!(
            parse_cuda_handle(&[2, b'x']),
            Err(TorchHandleError::UnknownKind { kind: b'x' })
        );
    }
}
