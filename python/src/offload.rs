//! The pieces of the vLLM backend (`kvshm.vllm`): `OffloadManager` ([`kvshm::offload::OffloadManager`],
//! the scheduler side; keys cross as `bytes`, chunk ids go out as `U32Array`) and `HostTier`
//! ([`kvshm::offload::HostTier`], one worker's host tier and copies).

use std::sync::{Mutex, MutexGuard};

use kvshm::offload::transfer::{Direction, EngineLayout, TensorMemory};
use kvshm::offload::{
    EvictionOrder, HostTier as RustHostTier, HostTierError, KeyLayout, LookupResult, OffloadConfig,
    OffloadKey, OffloadManager as RustManager, PreparedStore, TierEngine,
};
use kvshm::service::{Backend, DeviceRegionHandle, CUDA_IPC_HANDLE_BYTES};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::buffers::{read_i64s, U32Array};
use crate::errors::{
    ConfigError, DeviceHandleError, IntoPyResult, OffloadError, SegmentError, ToPyErr,
};
use crate::service::segment_name;

/// `lookup` results, as the ints the Python layer maps to vLLM's `LookupResult`.
pub const MISS: u8 = 0;
pub const HIT: u8 = 1;
pub const HIT_PENDING: u8 = 2;

pub fn key_of(object: &Bound<'_, PyAny>) -> PyResult<OffloadKey> {
    let bytes =
        object.cast::<PyBytes>().map_err(|_| PyTypeError::new_err("offload keys are bytes"))?;
    OffloadKey::new(bytes.as_bytes()).py_err()
}

/// Keys from any iterable of `bytes` (list, tuple, set), appended to `out`.
pub fn keys_into(keys: &Bound<'_, PyAny>, out: &mut Vec<OffloadKey>) -> PyResult<()> {
    out.clear();
    if let Ok(list) = keys.cast::<PyList>() {
        out.reserve(list.len());
        for item in list.iter() {
            out.push(key_of(&item)?);
        }
        return Ok(());
    }
    if let Ok(tuple) = keys.cast::<PyTuple>() {
        for item in tuple.iter() {
            out.push(key_of(&item)?);
        }
        return Ok(());
    }
    for item in keys.try_iter()? {
        out.push(key_of(&item?)?);
    }
    Ok(())
}

/// The host tier's keys, chunks and eviction order.
#[pyclass(module = "kvshm")]
pub struct OffloadManager {
    inner: RustManager,
    keys: Vec<OffloadKey>,
    prepared: PreparedStore,
    chunks: Vec<u32>,
}

#[pymethods]
impl OffloadManager {
    /// `chunks` of the host tier; keys end in a `tag_bytes` chain tag (vLLM: 4, the group);
    /// `eviction` is `"leaf_first"` (the default) or `"lru"` (flat, as vLLM's own policy).
    #[new]
    #[pyo3(signature = (chunks, *, tag_bytes=0, eviction="leaf_first", events=false))]
    fn new(chunks: u32, tag_bytes: usize, eviction: &str, events: bool) -> PyResult<Self> {
        let order = match eviction {
            "leaf_first" => EvictionOrder::LeafFirst,
            "lru" => EvictionOrder::Flat,
            other => {
                return Err(ConfigError::new_err(format!(
                    "eviction {other:?} is neither leaf_first nor lru"
                )))
            }
        };
        let config = OffloadConfig { chunks, layout: KeyLayout { tag_bytes }, order, events };
        Ok(OffloadManager {
            inner: RustManager::new(config).py_err()?,
            keys: Vec::new(),
            prepared: PreparedStore::default(),
            chunks: Vec::new(),
        })
    }

    /// 0 (miss), 1 (hit: loadable) or 2 (hit pending: being stored).
    fn lookup(&mut self, key: &Bound<'_, PyAny>, request: &str) -> PyResult<u8> {
        let key = key_of(key)?;
        Ok(match self.inner.lookup(request, &key) {
            LookupResult::Miss => MISS,
            LookupResult::Hit => HIT,
            LookupResult::HitPending => HIT_PENDING,
        })
    }

    fn on_new_request(&mut self, request: &str) {
        self.inner.on_new_request(request);
    }

    /// Pins `keys` for a load; returns their chunks.
    fn prepare_load(&mut self, keys: &Bound<'_, PyAny>, request: &str) -> PyResult<U32Array> {
        keys_into(keys, &mut self.keys)?;
        self.inner.prepare_load(request, &self.keys, &mut self.chunks).py_err()?;
        Ok(U32Array::new(self.chunks.as_slice()))
    }

    fn complete_load(&mut self, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        keys_into(keys, &mut self.keys)?;
        self.inner.complete_load(&self.keys).py_err()
    }

    fn touch(&mut self, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        keys_into(keys, &mut self.keys)?;
        self.inner.touch(&self.keys);
        Ok(())
    }

    /// `None` when the keys cannot be stored; else `(indices of the keys to store, their
    /// chunks, evicted keys)`.
    #[allow(clippy::type_complexity)]
    fn prepare_store<'py>(
        &mut self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        request: &str,
    ) -> PyResult<Option<(Vec<u32>, U32Array, Vec<Bound<'py, PyBytes>>)>> {
        keys_into(keys, &mut self.keys)?;
        if !self.inner.prepare_store(request, &self.keys, &mut self.prepared) {
            return Ok(None);
        }
        let evicted =
            self.prepared.evicted.iter().map(|key| PyBytes::new(py, key.as_bytes())).collect();
        Ok(Some((
            self.prepared.to_store.clone(),
            U32Array::new(self.prepared.chunks.as_slice()),
            evicted,
        )))
    }

    #[pyo3(signature = (keys, success=true))]
    fn complete_store(&mut self, keys: &Bound<'_, PyAny>, success: bool) -> PyResult<()> {
        keys_into(keys, &mut self.keys)?;
        self.inner.complete_store(&self.keys, success);
        Ok(())
    }

    /// Ends a request; `positions` (one per key of `request_keys`) give its prefix order.
    #[pyo3(signature = (request, positions=None))]
    fn on_request_finished(&mut self, request: &str, positions: Option<Vec<u64>>) -> PyResult<()> {
        self.inner.on_request_finished(request, positions.as_deref()).py_err()
    }

    /// The keys a live request presented, in the order `positions` refer to.
    fn request_keys<'py>(&self, py: Python<'py>, request: &str) -> Vec<Bound<'py, PyBytes>> {
        self.inner
            .request_keys(request)
            .iter()
            .map(|key| PyBytes::new(py, key.as_bytes()))
            .collect()
    }

    /// `[(removed, [keys])]` since the last call.
    fn take_events<'py>(&mut self, py: Python<'py>) -> Vec<(bool, Vec<Bound<'py, PyBytes>>)> {
        self.inner
            .take_events()
            .into_iter()
            .map(|event| {
                let keys = event.keys.iter().map(|key| PyBytes::new(py, key.as_bytes())).collect();
                (event.removed, keys)
            })
            .collect()
    }

    fn reset(&mut self) {
        self.inner.reset();
    }

    /// The chunk of `key`, or `None`.
    fn chunk_of(&self, key: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        Ok(self.inner.chunk_of(&key_of(key)?))
    }

    /// The key `key` was linked under when stored, or `None`.
    fn parent_of<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        Ok(self.inner.parent_of(&key_of(key)?).map(|parent| PyBytes::new(py, parent.as_bytes())))
    }

    /// `{key: loadable}` of every cached key.
    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let dict = pyo3::types::PyDict::new(py);
        for (key, ready) in self.inner.keys() {
            dict.set_item(PyBytes::new(py, key.as_bytes()), ready)?;
        }
        Ok(dict)
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let json = serde_json::to_string(&self.inner.stats())
            .map_err(|error| PyValueError::new_err(error.to_string()))?;
        py.import("json")?.call_method1("loads", (json,))
    }

    fn check_invariants(&self) -> PyResult<()> {
        self.inner.check_invariants().map_err(crate::errors::KvshmError::new_err)
    }
}

/// One rank's shared-memory host tier, and the copies between it and the engine's KV tensors.
#[pyclass(module = "kvshm")]
pub struct HostTier {
    /// Dropped before `tensors`: the tier copies into the tensors' memory while it lives.
    inner: Mutex<Option<RustHostTier>>,
    /// The engine's tensors (in-process copies), held so that their memory stays valid.
    tensors: Vec<PyUntypedBuffer>,
}

impl HostTier {
    fn lock(&self) -> MutexGuard<'_, Option<RustHostTier>> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
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
        HostTierError::PartialGroup { .. } => ConfigError::new_err(message),
        HostTierError::NoWorkers | HostTierError::DeviceHandles(_) => {
            DeviceHandleError::new_err(message)
        }
        HostTierError::Service(error) => error.to_py(),
        HostTierError::Arena(_) => SegmentError::new_err(message),
    }
}

#[pymethods]
impl HostTier {
    /// Creates the host tier segment `name`. With `tensors` (one writable, C-contiguous buffer
    /// per KV tensor, `page_bytes` per block) copies run in process; without, a `kvshm worker
    /// --backend cuda` process copies after `publish_device_handles`.
    #[new]
    #[pyo3(signature = (
        name, *, page_bytes, device_blocks, chunks, blocks_per_chunk, groups, tensors=None,
        tensor_count=None
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
    ) -> PyResult<HostTier> {
        let name = segment_name(name)?;
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
        };
        let engine = if buffers.is_empty() {
            TierEngine::Workers(Backend::Cuda)
        } else {
            let described = buffers
                .iter()
                .enumerate()
                .map(|(index, buffer)| describe_tensor(index, buffer, page_bytes))
                .collect::<PyResult<Vec<_>>>()?;
            // SAFETY: every buffer is held in `self.tensors` for as long as the tier lives (the
            // tier is dropped first), so its memory stays valid; `describe_tensor` checked that
            // each is writable and that its rows (`rows` of `page_bytes` contiguous bytes, `stride`
            // apart) lie inside it; the engine does not write a transfer's blocks while it runs
            // (vLLM fences them).
            let memory = unsafe { TensorMemory::new(&layout, &described) }
                .map_err(|error| tier_error(error.into()))?;
            TierEngine::InProcess(memory)
        };
        let tier = py.detach(|| RustHostTier::create(&name, layout, engine)).map_err(tier_error)?;
        Ok(HostTier { inner: Mutex::new(Some(tier)), tensors: buffers })
    }

    #[getter]
    fn name(&self) -> PyResult<String> {
        Ok(open_tier(&mut self.lock())?.name().as_str().to_owned())
    }

    /// Whether a worker serves the tier (always true for in-process copies).
    #[getter]
    fn worker_up(&self) -> PyResult<bool> {
        Ok(open_tier(&mut self.lock())?.worker_up())
    }

    /// Jobs handed to the worker and not ended yet.
    #[getter]
    fn pending(&self) -> PyResult<usize> {
        Ok(open_tier(&mut self.lock())?.pending())
    }

    /// Publishes `(handle, offset, length, block_stride)` of every tensor for the worker.
    fn publish_device_handles(&self, handles: Vec<(Vec<u8>, u64, u64, u64)>) -> PyResult<()> {
        let handles = handles
            .into_iter()
            .map(|(handle, offset, len, stride)| {
                let handle: [u8; CUDA_IPC_HANDLE_BYTES] = handle.try_into().map_err(|_| {
                    DeviceHandleError::new_err("a CUDA IPC memory handle is 64 bytes")
                })?;
                Ok(DeviceRegionHandle::new(handle, offset, len, stride))
            })
            .collect::<PyResult<Vec<_>>>()?;
        open_tier(&mut self.lock())?.publish_device_handles(&handles).map_err(tier_error)
    }

    /// Copies device blocks into host chunks (vLLM `submit_store`).
    fn submit_store(
        &self,
        job: u64,
        device: &Bound<'_, PyAny>,
        group_sizes: &Bound<'_, PyAny>,
        block_indices: &Bound<'_, PyAny>,
        chunks: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.submit(job, Direction::Store, device, group_sizes, block_indices, chunks)
    }

    /// Copies host chunks into device blocks (vLLM `submit_load`).
    fn submit_load(
        &self,
        job: u64,
        device: &Bound<'_, PyAny>,
        group_sizes: &Bound<'_, PyAny>,
        block_indices: &Bound<'_, PyAny>,
        chunks: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.submit(job, Direction::Load, device, group_sizes, block_indices, chunks)
    }

    /// `[(job, success, bytes, seconds)]` of the jobs that ended.
    fn take_finished(&self) -> PyResult<Vec<(u64, bool, u64, f64)>> {
        let mut out = Vec::new();
        open_tier(&mut self.lock())?.take_finished(&mut out);
        Ok(out.into_iter().map(|done| (done.job, done.success, done.bytes, done.seconds)).collect())
    }

    /// Waits until none of `jobs` is pending (GIL released); returns whether none is.
    #[pyo3(signature = (jobs, timeout=60.0))]
    fn wait(&self, py: Python<'_>, jobs: Vec<u64>, timeout: f64) -> PyResult<bool> {
        let timeout = crate::service::seconds(timeout, "timeout")?;
        let mut guard = self.lock();
        let tier = open_tier(&mut guard)?;
        Ok(py.detach(|| tier.wait(&jobs, timeout)))
    }

    /// The bytes of host block `block`, or `None` out of range.
    fn host_block<'py>(
        &self,
        py: Python<'py>,
        block: u32,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let bytes = open_tier(&mut self.lock())?.host_block(block);
        Ok(bytes.map(|bytes| PyBytes::new(py, &bytes)))
    }

    /// Removes the segment (its worker then exits) and lets go of the tensors. Idempotent.
    fn close(&mut self) {
        *self.lock() = None;
        self.tensors.clear();
    }
}

impl HostTier {
    fn submit(
        &self,
        job: u64,
        direction: Direction,
        device: &Bound<'_, PyAny>,
        group_sizes: &Bound<'_, PyAny>,
        block_indices: &Bound<'_, PyAny>,
        chunks: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (device, sizes) = (read_i64s(device)?, read_i64s(group_sizes)?);
        let (indices, chunks) = (read_i64s(block_indices)?, read_i64s(chunks)?);
        let mut guard = self.lock();
        let tier = open_tier(&mut guard)?;
        tier.submit(job, direction, &device, &sizes, &indices, &chunks).map_err(tier_error)
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

/// The 64-byte `cudaIpcMemHandle_t` in the handle bytes of `storage._share_cuda_()[1]`;
/// `DeviceHandleError` for an expandable segment or bytes of another shape.
#[pyfunction]
pub fn parse_cuda_handle<'py>(py: Python<'py>, handle: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    let parsed = kvshm::offload::torch_ipc::parse_cuda_handle(handle)
        .map_err(|error| DeviceHandleError::new_err(error.to_string()))?;
    Ok(PyBytes::new(py, &parsed))
}
