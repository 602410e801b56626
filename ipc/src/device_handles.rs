//! CUDA device handles of one rank: how a worker finds the engine's KV buffers on the GPU.
//!
//! On the CUDA backend the engine exports, for every region of its rank's KV cache, a 64-byte CUDA
//! IPC memory handle with the offset of the region's base inside that allocation, the bytes it
//! spans and the stride between blocks. The table lies in the control segment per rank
//! ([`DeviceHandleArea`] plus `regions` [`DeviceRegionHandle`]s) under a seqlock, so a worker never
//! reads half of a republished table.
//!
//! Flow: 1. the engine calls `Segment::publish_device_handles(rank, &handles)` (count must equal
//! `regions`); 2. the worker polls `Segment::device_handles(rank)` until it returns `Some`, then
//! opens each handle with `cuIpcOpenMemHandle`. An engine process that dies in the middle of a
//! publish leaves the table unreadable (`Busy`) until the next publish, which takes the lock over
//! from the dead publisher.

use bytemuck::{Pod, Zeroable};
use thiserror::Error;

use crate::seqlock::{self, SeqLockBusy};
use crate::sync::{AtomicU64, Ordering};

/// Bytes of a CUDA IPC memory handle (`CUipcMemHandle`).
pub const CUDA_IPC_HANDLE_BYTES: usize = 64;

/// One region's device memory, as exported by the engine.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct DeviceRegionHandle {
    /// The `CUipcMemHandle` of the allocation holding the region.
    pub ipc_handle: [u8; CUDA_IPC_HANDLE_BYTES],
    /// Offset of block 0 of the region from the allocation's base.
    pub offset: u64,
    /// Bytes of the region (all blocks), from `offset`.
    pub len: u64,
    /// Bytes from one block to the next inside the region.
    pub block_stride: u64,
    pub reserved: [u64; 5],
}

const _: () = assert!(size_of::<DeviceRegionHandle>() == 128);
/// u64 words per handle in the segment.
pub(crate) const HANDLE_WORDS: usize = size_of::<DeviceRegionHandle>() / 8;

impl DeviceRegionHandle {
    pub fn new(
        ipc_handle: [u8; CUDA_IPC_HANDLE_BYTES],
        offset: u64,
        len: u64,
        block_stride: u64,
    ) -> Self {
        DeviceRegionHandle { ipc_handle, offset, len, block_stride, reserved: [0; 5] }
    }
}

/// The per-rank header of the handle table as it lies in the segment. Zeroed: nothing published.
/// Every field is an atomic: the engine, workers and kvctl map it at once.
#[repr(C, align(64))]
pub struct DeviceHandleArea {
    version: AtomicU64,
    /// Under the seqlock: number of handles published (0: none), publisher pid.
    header: [AtomicU64; 2],
    /// The seqlock's writer word: the process publishing now (0: none).
    writer: AtomicU64,
    _reserved: [AtomicU64; 4],
}

const _: () = assert!(size_of::<DeviceHandleArea>() == 8 * size_of::<AtomicU64>());

// SAFETY: eight AtomicU64 fields filling 64 bytes (asserted above); any bits are a valid area (a
// count beyond the regions is reported as Corrupt).
unsafe impl crate::shm::SharedArea for DeviceHandleArea {}

/// Why handles could not be published or read.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DeviceHandleError {
    #[error("rank {rank} is outside 0..{tp_size}")]
    RankOutOfRange { rank: u32, tp_size: u32 },
    #[error("{found} device handles given, the segment has {expected} regions")]
    WrongCount { found: usize, expected: usize },
    #[error("another process is publishing device handles for this rank; retry")]
    Busy,
    #[error("process {pid} is publishing device handles for this rank")]
    PublisherBusy { pid: u32 },
    #[error("the published handle count {found} exceeds the {expected} regions (corrupt segment)")]
    Corrupt { found: u64, expected: usize },
}

/// A view of one rank's handle table.
pub(crate) struct DeviceHandles<'a> {
    pub(crate) area: &'a DeviceHandleArea,
    pub(crate) words: &'a [AtomicU64],
}

impl DeviceHandles<'_> {
    fn regions(&self) -> usize {
        self.words.len() / HANDLE_WORDS
    }

    pub(crate) fn publish(&self, handles: &[DeviceRegionHandle]) -> Result<(), DeviceHandleError> {
        if handles.len() != self.regions() {
            return Err(DeviceHandleError::WrongCount {
                found: handles.len(),
                expected: self.regions(),
            });
        }
        let header = [handles.len() as u64, u64::from(std::process::id())];
        seqlock::write(
            &self.area.version,
            &self.area.writer,
            &self.area.header,
            &header,
            self.words,
            bytemuck::cast_slice(handles),
        )
        .map_err(|SeqLockBusy| {
            // Relaxed: only names the holder in the error.
            match seqlock::live_writer(self.area.writer.load(Ordering::Relaxed)) {
                Some(pid) => DeviceHandleError::PublisherBusy { pid },
                None => DeviceHandleError::Busy,
            }
        })
    }

    pub(crate) fn read(&self) -> Result<Option<Vec<DeviceRegionHandle>>, DeviceHandleError> {
        let bytes_per_handle = size_of::<DeviceRegionHandle>();
        let (header, bytes) =
            seqlock::read(&self.area.version, &self.area.header, self.words, |header| {
                (header[0] as usize).saturating_mul(bytes_per_handle)
            })
            .map_err(|SeqLockBusy| DeviceHandleError::Busy)?;
        match header[0] {
            0 => Ok(None),
            count if count as usize != self.regions() => {
                Err(DeviceHandleError::Corrupt { found: count, expected: self.regions() })
            }
            _ => Ok(Some(
                bytes.chunks_exact(bytes_per_handle).map(bytemuck::pod_read_unaligned).collect(),
            )),
        }
    }
}
