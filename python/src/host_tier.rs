//! `HostTier`: one vLLM worker rank's shared-memory host tier and its copies
//! ([`kvshm::offload::HostTier`]), with the engine's tensors described from Python buffers, and
//! `parse_cuda_handle` for the CUDA path.

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use kvshm::offload::tensor_memory::TensorMemory;
use kvshm::offload::transfer::{Direction, EngineLayout};
use kvshm::offload::{HostTier as RustHostTier, HostTierError, StoredKey, TierEngine, TierOptions};
use kvshm::service::{Backend, DeviceRegionHandle, CUDA_IPC_HANDLE_BYTES};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::buffers::{read_i64s, read_u32s};
use crate::errors::{ConfigError, DeviceHandleError, OffloadError, SegmentError, ToPyErr};
use crate::offload::keys_into;
use crate::service::segment_name;
use crate::waiting::{self, wait_unlocked};

/// One rank's shared-memory host tier, and the copies between it and the engine's KV tensors.
/// Usable from any thread, as `Service` is.
#[pyclass(frozen, module = "kvshm")]
pub struct HostTier {
    /// Dropped before `tensors`: the tier copies into the tensors' memory while it lives.
    inner: Mutex<Option<RustHostTier>>,
    /// The engine's tensors (in-process copies), held so that their memory stays valid; let go
    /// of only after the tier is gone.
    tensors: Mutex<Vec<PyUntypedBuffer>>,
}

impl HostTier {
    fn lock(&self, py: Python<'_>) -> MutexGuard<'_, Option<RustHostTier>> {
        waiting::lock(py, &self.inner)
    }
}

fn open_tier(guard: &mut Option<RustHostTier>) -> PyResult<&mut RustHostTier> {
    guard.as_mut().ok_or_else(|| SegmentError::new_err("the host tier is closed"))
}

fn tier_error(error: HostTierError) -> PyErr {
    let message = error.to_string();
    match error {
        HostTierError::Plan(_) | HostTierError::Copy(_) | HostTierError::DuplicateJob { .. } => {
            OffloadError::new_err(message)
        }
        HostTierError::PartialGroup { .. } | HostTierError::KeyCount { .. } => {
            ConfigError::new_err(message)
        }
        HostTierError::Attach(_) => SegmentError::new_err(message),
        HostTierError::NoWorkers | HostTierError::DeviceHandles(_) => {
            DeviceHandleError::new_err(message)
        }
        HostTierError::Transport(error) => error.to_py(),
        HostTierError::Arena(_) | HostTierError::SharedArena(_) => SegmentError::new_err(message),
        HostTierError::SharedTierPersistent => ConfigError::new_err(message),
    }
}

#[pymethods]
impl HostTier {
    /// Creates the host tier segment `name`. With `tensors` (one writable, C-contiguous buffer
    /// per KV tensor, `page_bytes` per block) copies run in process; without, a `kvshm worker
    /// --backend cuda` process copies after `publish_device_handles`.
    #[new]
    /// `block_tokens` and `layers` (the engine's tokens per block and model layers) go into the
    /// segment header for tools. A `persistent` tier keeps its chunks and their keys when it
    /// closes or its process dies, for the next tier of its name, shape and `page_format` (the
    /// engine's name for how a page lays its bytes out) (`restored`). With
    /// `shared_tier`, the chunks are rank `shared_rank`'s arena of that shared tier (made by its
    /// owner, `python -m kvshm tier-owner`), copied in process or by a worker started with
    /// `--shared-tier SHARED_TIER --shared-tier-rank SHARED_RANK`.
    #[pyo3(signature = (
        name, *, page_bytes, device_blocks, chunks, blocks_per_chunk, groups, tensors=None,
        tensor_count=None, block_tokens=1, layers=1, persistent=false, shared_tier=None,
        shared_rank=0, page_format=String::new()
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: &str,
        page_bytes: u64,
        device_blocks: u32,
        chunks: u32,
        blocks_per_chunk: u32,
        groups: Vec<Vec<u32>>,
        tensors: Option<Vec<Bound<'_, PyAny>>>,
        tensor_count: Option<u32>,
        block_tokens: u32,
        layers: u32,
        persistent: bool,
        shared_tier: Option<&str>,
        shared_rank: u32,
        page_format: String,
    ) -> PyResult<HostTier> {
        let name = segment_name(name)?;
        let shared_tier = shared_tier.map(segment_name).transpose()?;
        let buffers = tensors
            .unwrap_or_default()
            .iter()
            .map(PyUntypedBuffer::get)
            .collect::<PyResult<Vec<_>>>()?;
        let count = match tensor_count {
            Some(count) if buffers.is_empty() => count,
            Some(_) => return Err(PyValueError::new_err("give tensors or tensor_count, not both")),
            None => buffers.len() as u32,
        };
        let layout = EngineLayout {
            page_bytes,
            tensors: count,
            device_blocks,
            chunks,
            blocks_per_chunk,
            groups,
            page_format,
        };
        let engine = if buffers.is_empty() {
            TierEngine::Workers(Backend::Cuda)
        } else {
            let described = buffers
                .iter()
                .enumerate()
                .map(|(index, buffer)| describe_tensor(index, buffer, page_bytes))
                .collect::<PyResult<Vec<_>>>()?;
            // SAFETY: every buffer is held in `self.tensors` for as long as the tier lives (`close`
            // drops the tier first), so its memory stays valid; `describe_tensor` checked that
            // each is writable and that its rows (`rows` of `page_bytes` contiguous bytes, `stride`
            // apart) lie inside it; the engine does not write a transfer's blocks while it runs
            // (vLLM fences them).
            let memory = unsafe { TensorMemory::new(&layout, &described) }
                .map_err(|error| tier_error(error.into()))?;
            TierEngine::InProcess(memory)
        };
        let options = TierOptions { block_tokens, layers, persistent };
        let tier = py
            .detach(|| match shared_tier {
                Some(tier) => RustHostTier::create_on_shared_tier(
                    &name,
                    layout,
                    engine,
                    options,
                    &tier,
                    shared_rank,
                ),
                None => RustHostTier::create_with(&name, layout, engine, options),
            })
            .map_err(tier_error)?;
        Ok(HostTier { inner: Mutex::new(Some(tier)), tensors: Mutex::new(buffers) })
    }

    #[getter]
    fn name(&self, py: Python<'_>) -> PyResult<String> {
        Ok(open_tier(&mut self.lock(py))?.name().as_str().to_owned())
    }

    /// Whether a worker serves the tier (always true for in-process copies).
    #[getter]
    fn worker_up(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(open_tier(&mut self.lock(py))?.worker_up())
    }

    /// Jobs handed to the worker and not ended yet.
    #[getter]
    fn pending(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(open_tier(&mut self.lock(py))?.pending())
    }

    /// Publishes `(handle, offset, length, block_stride)` of every tensor for the worker.
    fn publish_device_handles(
        &self,
        py: Python<'_>,
        handles: Vec<(Vec<u8>, u64, u64, u64)>,
    ) -> PyResult<()> {
        let handles = handles
            .into_iter()
            .map(|(handle, offset, len, stride)| {
                let handle: [u8; CUDA_IPC_HANDLE_BYTES] = handle.try_into().map_err(|_| {
                    DeviceHandleError::new_err("a CUDA IPC memory handle is 64 bytes")
                })?;
                Ok(DeviceRegionHandle::new(handle, offset, len, stride))
            })
            .collect::<PyResult<Vec<_>>>()?;
        open_tier(&mut self.lock(py))?.publish_device_handles(&handles).map_err(tier_error)
    }

    /// Copies device blocks into host chunks (vLLM `submit_store`). A persistent tier records
    /// `keys` (one per chunk) and `parents` (each key's parent chunk, 2**32-1 for none) in its
    /// key table once the copy succeeded, with `epoch`, its manager's when it chose the store (a
    /// reset of the manager since makes them stale).
    #[pyo3(signature = (
        job, device, group_sizes, block_indices, chunks, keys=None, parents=None, epoch=0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn submit_store(
        &self,
        py: Python<'_>,
        job: u64,
        device: &Bound<'_, PyAny>,
        group_sizes: &Bound<'_, PyAny>,
        block_indices: &Bound<'_, PyAny>,
        chunks: &Bound<'_, PyAny>,
        keys: Option<&Bound<'_, PyAny>>,
        parents: Option<&Bound<'_, PyAny>>,
        epoch: u32,
    ) -> PyResult<()> {
        let stored = match (keys, parents) {
            (None, None) => Vec::new(),
            (Some(keys), Some(parents)) => {
                let mut read = Vec::new();
                keys_into(keys, &mut read)?;
                let parents = read_u32s(parents)?;
                if parents.len() != read.len() {
                    return Err(ConfigError::new_err(format!(
                        "{} parents for {} keys",
                        parents.len(),
                        read.len()
                    )));
                }
                read.into_iter()
                    .zip(parents)
                    .map(|(key, parent_chunk)| StoredKey { key, parent_chunk, epoch })
                    .collect()
            }
            _ => return Err(ConfigError::new_err("give keys and parents together")),
        };
        let spec = [device, group_sizes, block_indices, chunks];
        self.submit_keyed(py, job, Direction::Store, spec, &stored)
    }

    /// Whether this persistent tier took over the chunks and keys an earlier one left.
    #[getter]
    fn restored(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(open_tier(&mut self.lock(py))?.restored())
    }

    /// Copies host chunks into device blocks (vLLM `submit_load`).
    fn submit_load(
        &self,
        py: Python<'_>,
        job: u64,
        device: &Bound<'_, PyAny>,
        group_sizes: &Bound<'_, PyAny>,
        block_indices: &Bound<'_, PyAny>,
        chunks: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.submit(py, job, Direction::Load, [device, group_sizes, block_indices, chunks])
    }

    /// `[(job, success, bytes, seconds)]` of the jobs that ended.
    fn take_finished(&self, py: Python<'_>) -> PyResult<Vec<(u64, bool, u64, f64)>> {
        let mut out = Vec::new();
        open_tier(&mut self.lock(py))?.take_finished(&mut out);
        Ok(out.into_iter().map(|done| (done.job, done.success, done.bytes, done.seconds)).collect())
    }

    /// Waits until none of `jobs` is pending (GIL released between polls); returns whether none
    /// is.
    #[pyo3(signature = (jobs, timeout=60.0))]
    fn wait(&self, py: Python<'_>, jobs: Vec<u64>, timeout: f64) -> PyResult<bool> {
        let timeout: Duration = crate::service::seconds(timeout, "timeout")?;
        let done = wait_unlocked(py, &self.inner, open_tier, timeout, |tier| {
            Ok(tier.poll_jobs(&jobs).then_some(()))
        })?;
        Ok(done.is_some())
    }

    /// The bytes of host block `block`, or `None` out of range.
    fn host_block<'py>(
        &self,
        py: Python<'py>,
        block: u32,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let bytes = open_tier(&mut self.lock(py))?.host_block(block);
        Ok(bytes.map(|bytes| PyBytes::new(py, &bytes)))
    }

    /// Removes the segment (its worker then exits) and lets go of the tensors. Idempotent.
    fn close(&self, py: Python<'_>) {
        *self.lock(py) = None;
        waiting::lock(py, &self.tensors).clear();
    }
}

impl HostTier {
    /// `spec`: the device blocks, group sizes, block indices and chunks, as vLLM gives them.
    fn submit(
        &self,
        py: Python<'_>,
        job: u64,
        direction: Direction,
        spec: [&Bound<'_, PyAny>; 4],
    ) -> PyResult<()> {
        self.submit_keyed(py, job, direction, spec, &[])
    }

    fn submit_keyed(
        &self,
        py: Python<'_>,
        job: u64,
        direction: Direction,
        spec: [&Bound<'_, PyAny>; 4],
        keys: &[StoredKey],
    ) -> PyResult<()> {
        let [device, sizes, indices, chunks] = spec.map(read_i64s);
        let (device, sizes, indices, chunks) = (device?, sizes?, indices?, chunks?);
        let mut guard = self.lock(py);
        let tier = open_tier(&mut guard)?;
        tier.submit_keyed(job, direction, &device, &sizes, &indices, &chunks, keys)
            .map_err(tier_error)
    }
}

/// `(address of block 0, blocks, bytes between blocks)` of a KV tensor given as a buffer: a
/// 2-D array whose rows are blocks (contiguous within a row, any row stride), or a contiguous
/// 1-D buffer of whole pages.
fn describe_tensor(
    index: usize,
    buffer: &PyUntypedBuffer,
    page_bytes: u64,
) -> PyResult<(usize, u64, u64)> {
    let refuse = |why: &str| PyValueError::new_err(format!("tensor {index}: {why}"));
    if buffer.readonly() {
        return Err(refuse("the buffer is read-only"));
    }
    if page_bytes == 0 {
        return Err(refuse("page_bytes must be at least 1"));
    }
    let item = buffer.item_size() as u64;
    match (buffer.shape(), buffer.strides()) {
        ([len], [stride]) if *stride == item as isize => {
            Ok((buffer.buf_ptr() as usize, *len as u64 * item / page_bytes, page_bytes))
        }
        ([rows, columns], [row_stride, column_stride])
            if *column_stride == item as isize && *row_stride > 0 =>
        {
            if (*columns as u64) * item < page_bytes {
                return Err(refuse("a row holds fewer bytes than a page"));
            }
            if (*row_stride as u64) < page_bytes {
                return Err(refuse("rows overlap: the row stride is smaller than a page"));
            }
            Ok((buffer.buf_ptr() as usize, *rows as u64, *row_stride as u64))
        }
        _ => Err(refuse("expected rows of contiguous bytes (a 2-D array, or a 1-D buffer)")),
    }
}

/// `[(chunk, key, seq, parent chunk or None)]` of the persistent host tier `name` (`chunks` of
/// `blocks_per_chunk` blocks), oldest store first: what an engine's manager takes back at start.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub fn read_tier_keys<'py>(
    py: Python<'py>,
    name: &str,
    chunks: u32,
    blocks_per_chunk: u32,
) -> PyResult<Vec<(u32, Bound<'py, PyBytes>, u64, Option<u32>)>> {
    let name = segment_name(name)?;
    let mut entries = py
        .detach(|| kvshm::offload::read_tier_keys(&name, chunks, blocks_per_chunk))
        .map_err(tier_error)?;
    entries.sort_by_key(|entry| entry.seq);
    let seqs: std::collections::HashMap<u32, u64> =
        entries.iter().map(|entry| (entry.chunk, entry.seq)).collect();
    Ok(entries
        .iter()
        .map(|entry| {
            // The parent's slot must still be the one the key was chained under.
            let parent = entry
                .parent
                .filter(|(chunk, seq)| seqs.get(chunk) == Some(seq))
                .map(|(chunk, _)| chunk);
            (entry.chunk, PyBytes::new(py, entry.key.as_bytes()), entry.seq, parent)
        })
        .collect())
}

/// The 64-byte `cudaIpcMemHandle_t` in the handle bytes of `storage._share_cuda_()[1]`;
/// `DeviceHandleError` for an expandable segment or bytes of another shape.
#[pyfunction]
pub fn parse_cuda_handle<'py>(py: Python<'py>, handle: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    let parsed = kvshm::offload::torch_ipc::parse_cuda_handle(handle)
        .map_err(|error| DeviceHandleError::new_err(error.to_string()))?;
    Ok(PyBytes::new(py, &parsed))
}
