//! `OffloadManager` ([`kvshm::offload::OffloadManager`]): the scheduler side of the vLLM backend
//! (`kvshm.vllm`); keys cross as `bytes`, chunk ids go out as `U32Array`.
//!
//! This is the one binding of the Rust manager. Its contract methods take the request as a
//! string; `VllmManagerCore` ([`crate::vllm`]) extends it and overrides them with vLLM's
//! signatures (a `ReqContext`, vLLM's result types), keeping the inspection methods here.

use kvshm::offload::{
    EvictionOrder, KeyLayout, LookupResult, OffloadConfig, OffloadKey,
    OffloadManager as RustManager, PreparedStore,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::buffers::U32Array;
use crate::errors::{ConfigError, IntoPyResult};

/// `lookup` results, as the ints the Python layer maps to vLLM's `LookupResult`.
pub const MISS: u8 = 0;
pub const HIT: u8 = 1;
pub const HIT_PENDING: u8 = 2;
/// Not known yet: ask again later (a shared tier bringing the key back from its storage).
pub const RETRY: u8 = 3;

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

/// The lookup result as [`MISS`], [`HIT`] or [`HIT_PENDING`].
pub fn lookup_code(result: LookupResult) -> u8 {
    match result {
        LookupResult::Miss => MISS,
        LookupResult::Hit => HIT,
        LookupResult::HitPending => HIT_PENDING,
    }
}

/// The host tier's keys, chunks and eviction order.
#[pyclass(subclass, module = "kvshm")]
pub struct OffloadManager {
    pub inner: RustManager,
    /// Scratch reused between calls, so that a call allocates nothing it does not return.
    pub keys: Vec<OffloadKey>,
    pub prepared: PreparedStore,
    pub chunks: Vec<u32>,
}

impl OffloadManager {
    /// A manager of `chunks` chunks; `eviction` is `"leaf_first"` or `"lru"`.
    pub fn build(
        chunks: u32,
        tag_bytes: usize,
        eviction: &str,
        events: bool,
    ) -> PyResult<OffloadManager> {
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
}

#[pymethods]
impl OffloadManager {
    /// `chunks` of the host tier; keys end in a `tag_bytes` chain tag (vLLM: 4, the group);
    /// `eviction` is `"leaf_first"` (the default) or `"lru"` (flat, as vLLM's own policy).
    #[new]
    #[pyo3(signature = (chunks, *, tag_bytes=0, eviction="leaf_first", events=false))]
    fn new(chunks: u32, tag_bytes: usize, eviction: &str, events: bool) -> PyResult<Self> {
        OffloadManager::build(chunks, tag_bytes, eviction, events)
    }

    /// 0 (miss), 1 (hit: loadable) or 2 (hit pending: being stored).
    fn lookup(&mut self, key: &Bound<'_, PyAny>, request: &str) -> PyResult<u8> {
        Ok(lookup_code(self.inner.lookup(request, &key_of(key)?)))
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

    /// Takes `key` back into `chunk` as stored and loadable, under `parent` if cached (keys a
    /// persistent host tier kept across a restart, oldest first).
    #[pyo3(signature = (key, chunk, parent=None))]
    fn restore(
        &mut self,
        key: &Bound<'_, PyAny>,
        chunk: u32,
        parent: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let parent = parent.map(key_of).transpose()?;
        self.inner.restore(key_of(key)?, chunk, parent.as_ref()).py_err()
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
