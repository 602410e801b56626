//! `VllmManagerCore`: vLLM's `OffloadingManager` methods implemented directly over
//! [`kvshm::offload::OffloadManager`], so that each of vLLM's calls is one crossing into Rust
//! with no Python frame in between.
//!
//! `kvshm.vllm.KvshmOffloadingManager` subclasses it together with vLLM's `OffloadingManager`
//! ABC. This class knows no vLLM import: the Python side hands it vLLM's types (the lookup
//! results, `PrepareStoreOutput`, the load/store spec class, `OffloadingEvent`, `Medium.CPU`,
//! `RequestOffloadingContext`) when it is made, and it only calls them.

use std::collections::HashMap;

use kvshm::offload::{
    EvictionOrder, KeyLayout, LookupResult, OffloadConfig, OffloadKey,
    OffloadManager as RustManager, PreparedStore,
};
use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::buffers::U32Array;
use crate::errors::{ConfigError, IntoPyResult};
use crate::offload::{key_of, keys_into};

/// vLLM's classes and values the core returns, handed over by the Python side.
struct VllmTypes {
    /// `LookupResult.MISS`, `.HIT`, `.HIT_PENDING`.
    lookup: [Py<PyAny>; 3],
    prepare_store_output: Py<PyAny>,
    load_store_spec: Py<PyAny>,
    event: Py<PyAny>,
    medium: Py<PyAny>,
    request_context: Py<PyAny>,
}

/// `VllmTypes` as Python hands it over: `((MISS, HIT, HIT_PENDING), PrepareStoreOutput, spec
/// class, OffloadingEvent, Medium.CPU, RequestOffloadingContext)`.
type VllmTypeTuple =
    ((Py<PyAny>, Py<PyAny>, Py<PyAny>), Py<PyAny>, Py<PyAny>, Py<PyAny>, Py<PyAny>, Py<PyAny>);

/// The Rust half of `kvshm.vllm.KvshmOffloadingManager`.
#[pyclass(subclass, module = "kvshm")]
pub struct VllmManagerCore {
    inner: RustManager,
    types: VllmTypes,
    keys: Vec<OffloadKey>,
    prepared: PreparedStore,
    chunks: Vec<u32>,
}

fn request_id<'py>(context: &Bound<'py, PyAny>) -> PyResult<Bound<'py, pyo3::types::PyString>> {
    Ok(context.getattr(intern!(context.py(), "req_id"))?.cast_into::<pyo3::types::PyString>()?)
}

#[pymethods]
impl VllmManagerCore {
    /// `vllm_types`: `(lookup results (MISS, HIT, HIT_PENDING), PrepareStoreOutput, the spec
    /// class (built from a U32Array of chunks), OffloadingEvent, Medium.CPU,
    /// RequestOffloadingContext)`.
    #[new]
    #[pyo3(signature = (chunks, *, vllm_types, eviction="leaf_first", events=false, tag_bytes=4))]
    fn new(
        chunks: u32,
        vllm_types: VllmTypeTuple,
        eviction: &str,
        events: bool,
        tag_bytes: usize,
    ) -> PyResult<Self> {
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
        let ((miss, hit, pending), output, spec, event, medium, context) = vllm_types;
        Ok(VllmManagerCore {
            inner: RustManager::new(config).py_err()?,
            types: VllmTypes {
                lookup: [miss, hit, pending],
                prepare_store_output: output,
                load_store_spec: spec,
                event,
                medium,
                request_context: context,
            },
            keys: Vec::new(),
            prepared: PreparedStore::default(),
            chunks: Vec::new(),
        })
    }

    fn lookup(
        &mut self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let key = key_of(key)?;
        let request = request_id(req_context)?;
        let result = self.inner.lookup(request.to_str()?, &key);
        let index = match result {
            LookupResult::Miss => 0,
            LookupResult::Hit => 1,
            LookupResult::HitPending => 2,
        };
        Ok(self.types.lookup[index].clone_ref(py))
    }

    fn on_new_request(
        &mut self,
        py: Python<'_>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        self.inner.on_new_request(request_id(req_context)?.to_str()?);
        self.types.request_context.call0(py)
    }

    fn prepare_load(
        &mut self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        keys_into(keys, &mut self.keys)?;
        let request = request_id(req_context)?;
        self.inner.prepare_load(request.to_str()?, &self.keys, &mut self.chunks).py_err()?;
        let chunks = Py::new(py, U32Array::new(self.chunks.as_slice()))?;
        self.types.load_store_spec.call1(py, (chunks,))
    }

    fn touch(&mut self, keys: &Bound<'_, PyAny>, req_context: &Bound<'_, PyAny>) -> PyResult<()> {
        let _ = req_context;
        keys_into(keys, &mut self.keys)?;
        self.inner.touch(&self.keys);
        Ok(())
    }

    fn complete_load(
        &mut self,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let _ = req_context;
        keys_into(keys, &mut self.keys)?;
        self.inner.complete_load(&self.keys).py_err()
    }

    fn prepare_store(
        &mut self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        // The keys to store are the caller's own objects, picked out of a list of them.
        let offered = match keys.cast::<PyList>() {
            Ok(list) => list.clone(),
            Err(_) => PyList::new(py, keys.try_iter()?.collect::<PyResult<Vec<_>>>()?)?,
        };
        keys_into(offered.as_any(), &mut self.keys)?;
        let request = request_id(req_context)?;
        if !self.inner.prepare_store(request.to_str()?, &self.keys, &mut self.prepared) {
            return Ok(py.None());
        }
        let to_store = PyList::empty(py);
        for &index in &self.prepared.to_store {
            to_store.append(offered.get_item(index as usize)?)?;
        }
        let evicted = PyList::empty(py);
        for key in &self.prepared.evicted {
            evicted.append(PyBytes::new(py, key.as_bytes()))?;
        }
        let chunks = Py::new(py, U32Array::new(self.prepared.chunks.as_slice()))?;
        let spec = self.types.load_store_spec.call1(py, (chunks,))?;
        let arguments = PyDict::new(py);
        arguments.set_item(intern!(py, "keys_to_store"), to_store)?;
        arguments.set_item(intern!(py, "store_spec"), spec)?;
        arguments.set_item(intern!(py, "evicted_keys"), evicted)?;
        self.types.prepare_store_output.call(py, (), Some(&arguments))
    }

    #[pyo3(signature = (keys, req_context, success=true))]
    fn complete_store(
        &mut self,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
        success: bool,
    ) -> PyResult<()> {
        let _ = req_context;
        keys_into(keys, &mut self.keys)?;
        self.inner.complete_store(&self.keys, success);
        Ok(())
    }

    /// The request's keys become the most recent, in prefix order: their end-token positions
    /// come from the `ReqContext` (its position table when present, else its accessor).
    fn on_request_finished(&mut self, req_context: &Bound<'_, PyAny>) -> PyResult<()> {
        let request = request_id(req_context)?;
        let request = request.to_str()?;
        let positions = positions_of(req_context, self.inner.request_keys(request))?;
        self.inner.on_request_finished(request, positions.as_deref()).py_err()
    }

    fn take_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = PyList::empty(py);
        for event in self.inner.take_events() {
            let keys = PyList::empty(py);
            for key in &event.keys {
                keys.append(PyBytes::new(py, key.as_bytes()))?;
            }
            let arguments = PyDict::new(py);
            arguments.set_item(intern!(py, "keys"), keys)?;
            arguments.set_item(intern!(py, "medium"), self.types.medium.clone_ref(py))?;
            arguments.set_item(intern!(py, "removed"), event.removed)?;
            events.append(self.types.event.call(py, (), Some(&arguments))?)?;
        }
        Ok(events)
    }

    fn reset_cache(&mut self) {
        self.inner.reset();
    }

    // Inspection, as `OffloadManager` has it (tests, differential checks).

    fn request_keys<'py>(&self, py: Python<'py>, request: &str) -> Vec<Bound<'py, PyBytes>> {
        self.inner
            .request_keys(request)
            .iter()
            .map(|key| PyBytes::new(py, key.as_bytes()))
            .collect()
    }

    fn parent_of<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        Ok(self.inner.parent_of(&key_of(key)?).map(|parent| PyBytes::new(py, parent.as_bytes())))
    }

    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let dict = PyDict::new(py);
        for (key, ready) in self.inner.keys() {
            dict.set_item(PyBytes::new(py, key.as_bytes()), ready)?;
        }
        Ok(dict)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let json = serde_json::to_string(&self.inner.stats())
            .map_err(|error| PyValueError::new_err(error.to_string()))?;
        py.import("json")?.call_method1("loads", (json,))
    }

    fn check_invariants(&self) -> PyResult<()> {
        self.inner.check_invariants().map_err(crate::errors::KvshmError::new_err)
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }
}

/// The end-token position of each of `keys` from vLLM's `ReqContext`, or `None` if any is
/// unknown (then the order the keys were presented is used, as vLLM does).
fn positions_of(context: &Bound<'_, PyAny>, keys: &[OffloadKey]) -> PyResult<Option<Vec<u64>>> {
    if keys.is_empty() {
        return Ok(Some(Vec::new()));
    }
    let py = context.py();
    // The position table itself (one pass over it, no Python call per key) when it is there.
    if let Ok(table) = context.getattr(intern!(py, "_offload_key_positions")) {
        if let Ok(table) = table.cast::<PyDict>() {
            let mut known: HashMap<OffloadKey, u64, kvshm::offload::key::BuildPassThrough> =
                HashMap::default();
            for (key, position) in table.iter() {
                if let (Ok(key), Ok(position)) = (key_of(&key), position.extract::<u64>()) {
                    known.insert(key, position);
                }
            }
            return Ok(keys.iter().map(|key| known.get(key).copied()).collect());
        }
    }
    let accessor = context.getattr(intern!(py, "get_offload_key_position"))?;
    let mut positions = Vec::with_capacity(keys.len());
    for key in keys {
        let position = accessor.call1((PyBytes::new(py, key.as_bytes()),))?;
        if position.is_none() {
            return Ok(None);
        }
        positions.push(position.extract::<u64>()?);
    }
    Ok(Some(positions))
}
