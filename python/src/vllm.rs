//! `VllmManagerCore`: vLLM's `OffloadingManager` methods implemented directly over the
//! `OffloadManager` binding ([`crate::offload`], which it extends), so that each of vLLM's calls
//! is one crossing into Rust with no Python frame in between.
//!
//! `kvshm.vllm.KvshmOffloadingManager` subclasses it together with vLLM's `OffloadingManager`
//! ABC. This class knows no vLLM import: the Python side hands it vLLM's types (the lookup
//! results, `PrepareStoreOutput`, the load/store spec class, `OffloadingEvent`, `Medium.CPU`,
//! `RequestOffloadingContext`) when it is made, and it only calls them.

use std::collections::HashMap;

use kvshm::offload::{OffloadKey, TableEpoch};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use kvshm::service::{Counter, Segment};

use crate::buffers::U32Array;
use crate::errors::{ConfigError, IntoPyResult, SegmentError};
use crate::offload::{key_of, keys_into, lookup_code, OffloadManager};
use crate::service::segment_name;

/// vLLM's classes and values the core returns, handed over by the Python side.
pub(crate) struct VllmTypes {
    /// `LookupResult.MISS`, `.HIT`, `.HIT_PENDING`, `.RETRY`, indexed by [`lookup_code`] (and
    /// `RETRY`).
    pub lookup: [Py<PyAny>; 4],
    pub prepare_store_output: Py<PyAny>,
    pub load_store_spec: Py<PyAny>,
    pub event: Py<PyAny>,
    pub medium: Py<PyAny>,
    pub request_context: Py<PyAny>,
}

impl VllmTypes {
    pub fn new(types: VllmTypeTuple) -> VllmTypes {
        let ((miss, hit, pending, retry), output, spec, event, medium, context) = types;
        VllmTypes {
            lookup: [miss, hit, pending, retry],
            prepare_store_output: output,
            load_store_spec: spec,
            event,
            medium,
            request_context: context,
        }
    }

    /// vLLM's `PrepareStoreOutput(keys_to_store, store_spec, evicted_keys)`.
    pub fn store_output(
        &self,
        py: Python<'_>,
        to_store: Bound<'_, PyList>,
        spec: Py<PyAny>,
        evicted: Bound<'_, PyList>,
    ) -> PyResult<Py<PyAny>> {
        let arguments = PyDict::new(py);
        arguments.set_item(intern!(py, "keys_to_store"), to_store)?;
        arguments.set_item(intern!(py, "store_spec"), spec)?;
        arguments.set_item(intern!(py, "evicted_keys"), evicted)?;
        self.prepare_store_output.call(py, (), Some(&arguments))
    }
}

/// `VllmTypes` as Python hands it over: `((MISS, HIT, HIT_PENDING, RETRY), PrepareStoreOutput,
/// spec class, OffloadingEvent, Medium.CPU, RequestOffloadingContext)`.
pub(crate) type VllmTypeTuple = (
    (Py<PyAny>, Py<PyAny>, Py<PyAny>, Py<PyAny>),
    Py<PyAny>,
    Py<PyAny>,
    Py<PyAny>,
    Py<PyAny>,
    Py<PyAny>,
);

/// The Rust half of `kvshm.vllm.KvshmOffloadingManager`: an [`OffloadManager`] whose contract
/// methods take vLLM's arguments and return vLLM's types (the inspection methods are the base
/// class's).
#[pyclass(extends = OffloadManager, subclass, module = "kvshm")]
pub struct VllmManagerCore {
    types: VllmTypes,
    /// The workers' host tier segments the manager's figures are published to (`kvctl stat`).
    published: Vec<Segment>,
    /// Device blocks and tokens of one key.
    key_blocks: u64,
    key_tokens: u64,
    /// The epoch of the stores the manager chooses, which each store's spec carries: raised by
    /// every reset and kept in each persistent tier's key table ([`TableEpoch`]), so that a
    /// warm restart takes back no key stored before the last reset.
    epoch: u32,
    /// The key tables of the published segments' tiers (none for tiers that are not
    /// persistent).
    tables: Vec<TableEpoch>,
}

impl VllmManagerCore {
    /// Stores the manager's figures in each published segment's counters: keys held, free host
    /// blocks, lookups and their hits and misses (in blocks), tokens loaded, evictions.
    fn publish(&self, base: &OffloadManager) {
        if self.published.is_empty() {
            return;
        }
        let stats = base.inner.stats();
        let blocks = self.key_blocks;
        let values = [
            (Counter::CachedNodes, u64::from(stats.chunks_used)),
            (Counter::HostBlocksFree, u64::from(stats.chunks - stats.chunks_used) * blocks),
            (Counter::Lookups, stats.lookups),
            (Counter::HostHitBlocks, stats.lookup_hits * blocks),
            (Counter::MissBlocks, (stats.lookups - stats.lookup_hits) * blocks),
            (Counter::HitTokens, stats.keys_loaded * self.key_tokens),
            (Counter::Evictions, stats.evictions),
        ];
        for segment in &self.published {
            let counters = segment.counters();
            for (counter, value) in values {
                counters.set(counter, value);
            }
        }
    }
}

pub(crate) fn request_id<'py>(
    context: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, pyo3::types::PyString>> {
    Ok(context.getattr(intern!(context.py(), "req_id"))?.cast_into::<pyo3::types::PyString>()?)
}

#[pymethods]
impl VllmManagerCore {
    /// `vllm_types`: `(lookup results (MISS, HIT, HIT_PENDING), PrepareStoreOutput, the spec
    /// class (built from a U32Array of chunks, and for stores the keys and a U32Array of their
    /// parents' chunks), OffloadingEvent, Medium.CPU, RequestOffloadingContext)`.
    #[new]
    #[pyo3(signature = (chunks, *, vllm_types, eviction="leaf_first", events=false, tag_bytes=4))]
    fn new(
        chunks: u32,
        vllm_types: VllmTypeTuple,
        eviction: &str,
        events: bool,
        tag_bytes: usize,
    ) -> PyResult<PyClassInitializer<Self>> {
        let base = OffloadManager::build(chunks, tag_bytes, eviction, events)?;
        let types = VllmTypes::new(vllm_types);
        let core = VllmManagerCore {
            types,
            published: Vec::new(),
            key_blocks: 1,
            key_tokens: 1,
            epoch: 0,
            tables: Vec::new(),
        };
        Ok(PyClassInitializer::from(base).add_subclass(core))
    }

    /// Publishes the manager's figures to the host tier segments `segments` (the workers'
    /// ranks), after every finished request and on `publish_counters`: `kvctl stat` shows the
    /// hits with the copies. A key is `key_blocks` device blocks of `key_tokens` tokens in all;
    /// `key_blocks` is also a chunk's blocks in each tier, which locates the tier's key table.
    /// The manager takes up the newest epoch of those tables and writes it into all of them;
    /// from then on its stores' specs name their keys, for the tables (a manager that holds no
    /// table names none).
    fn publish_to(
        mut slf: PyRefMut<'_, Self>,
        segments: Vec<String>,
        key_blocks: u64,
        key_tokens: u64,
    ) -> PyResult<()> {
        let attached = segments
            .iter()
            .map(|name| {
                let name = segment_name(name)?;
                Segment::attach(&name).map_err(|error| {
                    SegmentError::new_err(format!("attaching to {name} to publish: {error}"))
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let chunks = slf.as_super().inner.config().chunks;
        let chunk_blocks = u32::try_from(key_blocks)
            .map_err(|_| ConfigError::new_err(format!("{key_blocks} blocks a key")))?;
        let (mut tables, mut epoch) = (Vec::new(), None);
        for (segment, name) in attached.iter().zip(&segments) {
            let opened = TableEpoch::open(segment, chunks, chunk_blocks).map_err(|error| {
                SegmentError::new_err(format!("the key table of {name}: {error}"))
            })?;
            if let Some((table, found)) = opened {
                epoch = epoch.max(Some(found));
                tables.push(table);
            }
        }
        let epoch = epoch.unwrap_or(0);
        for table in &tables {
            table.set(epoch);
        }
        slf.published = attached;
        slf.tables = tables;
        slf.epoch = epoch;
        slf.key_blocks = key_blocks;
        slf.key_tokens = key_tokens;
        let core: &VllmManagerCore = &slf;
        core.publish(slf.as_ref());
        Ok(())
    }

    /// Publishes the manager's figures now (see `publish_to`).
    fn publish_counters(slf: PyRef<'_, Self>) {
        slf.publish(slf.as_super());
    }

    fn lookup(
        mut slf: PyRefMut<'_, Self>,
        key: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let key = key_of(key)?;
        let request = request_id(req_context)?;
        let code = lookup_code(slf.as_super().inner.lookup(request.to_str()?, &key));
        Ok(slf.types.lookup[usize::from(code)].clone_ref(slf.py()))
    }

    fn on_new_request(
        mut slf: PyRefMut<'_, Self>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        slf.as_super().inner.on_new_request(request_id(req_context)?.to_str()?);
        slf.types.request_context.call0(slf.py())
    }

    fn prepare_load(
        mut slf: PyRefMut<'_, Self>,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let request = request_id(req_context)?;
        let chunks = {
            let base: &mut OffloadManager = &mut *slf.as_super();
            keys_into(keys, &mut base.keys)?;
            base.inner.prepare_load(request.to_str()?, &base.keys, &mut base.chunks).py_err()?;
            Py::new(py, U32Array::new(base.chunks.as_slice()))?
        };
        slf.types.load_store_spec.call1(py, (chunks,))
    }

    fn touch(
        mut slf: PyRefMut<'_, Self>,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let _ = req_context;
        let base: &mut OffloadManager = &mut *slf.as_super();
        keys_into(keys, &mut base.keys)?;
        base.inner.touch(&base.keys);
        Ok(())
    }

    fn complete_load(
        mut slf: PyRefMut<'_, Self>,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let _ = req_context;
        let base: &mut OffloadManager = &mut *slf.as_super();
        keys_into(keys, &mut base.keys)?;
        base.inner.complete_load(&base.keys).py_err()
    }

    fn prepare_store(
        mut slf: PyRefMut<'_, Self>,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        // The keys to store are the caller's own objects, picked out of a list of them.
        let offered = match keys.cast::<PyList>() {
            Ok(list) => list.clone(),
            Err(_) => PyList::new(py, keys.try_iter()?.collect::<PyResult<Vec<_>>>()?)?,
        };
        let request = request_id(req_context)?;
        // Keys for the tiers' key tables only when the manager holds those tables, and so sets
        // their epoch: a key recorded in an epoch the manager does not know of could come back
        // after a reset it made (and a tier without a table has no use for them).
        let recorded = !slf.tables.is_empty();
        let (to_store, chunks, parents, evicted) = {
            let base: &mut OffloadManager = &mut *slf.as_super();
            keys_into(offered.as_any(), &mut base.keys)?;
            if !base.inner.prepare_store(request.to_str()?, &base.keys, &mut base.prepared) {
                return Ok(py.None());
            }
            let to_store = PyList::empty(py);
            // Each stored key's parent chunk, for a persistent tier's key table.
            let mut parents = Vec::with_capacity(base.prepared.to_store.len());
            for &index in &base.prepared.to_store {
                to_store.append(offered.get_item(index as usize)?)?;
                if recorded {
                    let key = &base.keys[index as usize];
                    let parent = base.inner.parent_of(key).and_then(|p| base.inner.chunk_of(&p));
                    parents.push(parent.unwrap_or(u32::MAX));
                }
            }
            let evicted = PyList::empty(py);
            for key in &base.prepared.evicted {
                evicted.append(PyBytes::new(py, key.as_bytes()))?;
            }
            let chunks = Py::new(py, U32Array::new(base.prepared.chunks.as_slice()))?;
            (to_store, chunks, Py::new(py, U32Array::new(parents))?, evicted)
        };
        let spec = if recorded {
            let arguments = (chunks, to_store.clone(), parents, slf.epoch);
            slf.types.load_store_spec.call1(py, arguments)?
        } else {
            slf.types.load_store_spec.call1(py, (chunks,))?
        };
        slf.types.store_output(py, to_store, spec, evicted)
    }

    #[pyo3(signature = (keys, req_context, success=true))]
    fn complete_store(
        mut slf: PyRefMut<'_, Self>,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
        success: bool,
    ) -> PyResult<()> {
        let _ = req_context;
        let base: &mut OffloadManager = &mut *slf.as_super();
        keys_into(keys, &mut base.keys)?;
        base.inner.complete_store(&base.keys, success);
        Ok(())
    }

    /// The request's keys become the most recent, in prefix order: their end-token positions
    /// come from the `ReqContext` (its position table when present, else its accessor).
    fn on_request_finished(
        mut slf: PyRefMut<'_, Self>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let request = request_id(req_context)?;
        let request = request.to_str()?;
        {
            let base: &mut OffloadManager = &mut *slf.as_super();
            let positions = positions_of(req_context, base.inner.request_keys(request))?;
            base.inner.on_request_finished(request, positions.as_deref()).py_err()?;
        }
        slf.publish(slf.as_ref());
        Ok(())
    }

    fn take_events<'py>(mut slf: PyRefMut<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        let py = slf.py();
        let taken = slf.as_super().inner.take_events();
        let events = PyList::empty(py);
        for event in taken {
            let keys = PyList::empty(py);
            for key in &event.keys {
                keys.append(PyBytes::new(py, key.as_bytes()))?;
            }
            let arguments = PyDict::new(py);
            arguments.set_item(intern!(py, "keys"), keys)?;
            arguments.set_item(intern!(py, "medium"), slf.types.medium.clone_ref(py))?;
            arguments.set_item(intern!(py, "removed"), event.removed)?;
            events.append(slf.types.event.call(py, (), Some(&arguments))?)?;
        }
        Ok(events)
    }

    /// Forgets every key, and publishes the emptied figures for `kvctl stat` at once: an engine
    /// idle after a reset would show the old ones until its next finished request otherwise.
    /// The tiers' key tables go to a new epoch: the keys stored before, including stores in
    /// flight, are not taken back by a warm restart.
    fn reset_cache(mut slf: PyRefMut<'_, Self>) {
        slf.as_super().inner.reset();
        slf.epoch = slf.epoch.wrapping_add(1);
        for table in &slf.tables {
            table.set(slf.epoch);
        }
        slf.publish(slf.as_ref());
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
