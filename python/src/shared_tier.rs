//! `VllmSharedTierCore`: vLLM's `OffloadingManager` methods over a host tier several engines
//! share (DESIGN §12), as a client of the tier's owner ([`kvshm::offload::TierClient`]).
//!
//! `kvshm.vllm.KvshmSharedOffloadingManager` subclasses it together with vLLM's ABC. A key a
//! lookup finds is pinned for the request at once (another engine's store could evict it before
//! vLLM's `prepare_load` otherwise), so one call flows:
//! 1. `lookup(key)`: a key the request holds pinned is a hit with no call; any other is asked
//!    with the request's keys that follow it (from the `ReqContext`'s position table), in one
//!    `AcquirePrefix`: what it finds stays pinned for the request; the keys after it that the
//!    owner is bringing back from the tier's storage are `RETRY` (vLLM asks again at a later
//!    step), and the key that ended them is a miss, each with no call when vLLM looks it up next
//!    in the step (once: a later lookup asks again);
//! 2. `prepare_load(keys)`: their chunks, from the request's pins (the pins now the load's); the
//!    request's other pins are let go;
//! 3. `complete_load(keys)`: the load's pins are let go;
//! 4. `prepare_store` / `complete_store`: chunks from the client's lease, with no wait (the
//!    owner learns at the next batch which keys went where), or as the owner answers when the
//!    lease is short (nothing to store while it is gone, or in its store grace);
//! 5. `on_request_finished`: the request's pins left are let go, and it ends at the owner.
//!
//! Only a lookup that finds no pin, a `prepare_load` of keys not pinned and a `prepare_store`
//! the lease cannot serve wait on the owner. What needs no answer (pins let go, stores done and
//! named, requests ended) is queued in the client and goes with the next call that waits. vLLM
//! calls `on_schedule_end` once a scheduler step, before the step's stores: what has waited a
//! whole step there is sent on its own, without a wait, so a call waits at most two steps; and
//! `has_pending_work`, which vLLM calls when its engine would go idle, sends what is queued then,
//! and the engine idles.
//!
//! While the owner is gone every lookup misses and nothing is stored: vLLM computes what it would
//! have loaded, so outputs do not change. Pins belong to the connection they were taken on
//! (`Pin`): after the client attaches again (to a new owner, or in a new slot of a stalled one)
//! an old pin is no hit and is not released through the new connection.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use kvshm::offload::key::BuildPassThrough;
use kvshm::offload::{
    CallAnswer, ClientOptions, OffloadKey, SharedTierError, TierCall, TierClient, TierIdentity,
    DEFAULT_LEASE_CHUNKS,
};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::buffers::U32Array;
use crate::errors::{ConfigError, OffloadError};
use crate::offload::{key_of, keys_into, HIT, MISS, RETRY};
use crate::service::segment_name;
use crate::vllm::{request_id, VllmTypeTuple, VllmTypes};

/// The most keys one lookup asks the owner about: the looked-up key and those that follow.
const LOOKAHEAD_KEYS: usize = 256;

type KeyMap<V> = HashMap<OffloadKey, V, BuildPassThrough>;

/// What this engine did through the tier, for vLLM's metrics.
#[derive(Clone, Copy, Debug, Default)]
struct ClientCounters {
    lookups: u64,
    lookup_hits: u64,
    keys_loaded: u64,
    keys_stored: u64,
    stores_refused: u64,
    stores_failed: u64,
}

/// Runs a wait on the owner past its first millisecond with the GIL let go
/// (`ClientOptions::run_sleep`): an owner slow to answer (starved of CPU, stopped) stalls the
/// thread that asked, for up to `answer_deadline_s`, and no other Python thread of the engine.
fn sleep_without_the_gil(sleep: &mut (dyn FnMut() + Send)) {
    Python::attach(|py| py.detach(sleep));
}

fn tier_error(error: SharedTierError) -> PyErr {
    match error {
        SharedTierError::Mismatch { .. } => ConfigError::new_err(error.to_string()),
        other => OffloadError::new_err(other.to_string()),
    }
}

/// The Rust half of `kvshm.vllm.KvshmSharedOffloadingManager` (module flow). One thread calls
/// it at a time, as vLLM's scheduler does: a call waiting on the owner lets go of the GIL, and a
/// call from another thread meanwhile raises `RuntimeError` (already borrowed).
#[pyclass(subclass, module = "kvshm")]
pub struct VllmSharedTierCore {
    types: VllmTypes,
    /// In a mutex only to make the class shareable (Python may hand it to any thread): every
    /// call holds `&mut self`, so it is never locked, only reached through `get_mut`.
    client: Mutex<TierClient>,
    /// Per request, the keys its lookups pinned that no load took yet.
    pinned: HashMap<String, KeyMap<Pin>>,
    /// Per request, the keys being loaded, with the connection epoch of their pins.
    loading: HashMap<String, KeyMap<u64>>,
    /// Per request, what its last `AcquirePrefix` said of the keys after those it pinned.
    foretold: HashMap<String, Foretold>,
    counters: ClientCounters,
    answers: Vec<CallAnswer>,
    /// At the last `on_schedule_end`: whether calls were queued, and the batches sent by then.
    last_step_end: (bool, u64),
}

/// What an `AcquirePrefix` said of the keys after those it pinned, in the order vLLM looks them
/// up next: `keys[..retry]` are being brought back from the tier's storage (`RETRY`), and the
/// key after them, if any, ended what the tier has (`MISS`). Each is answered once, in order,
/// with no call; a lookup of any other key forgets them.
#[derive(Debug)]
struct Foretold {
    keys: Vec<OffloadKey>,
    retry: usize,
    next: usize,
}

/// A key pinned for a request: its chunk, and the connection it was pinned on
/// (`TierClient::connection_epoch`). A pin of an earlier connection is no hit (the owner may
/// have forgotten the key) and is not this connection's to release; its chunk stays safe to
/// load from in the step that asked for it, as the old slot keeps its pins while this process
/// lives, and a new owner stores nothing during its grace.
#[derive(Clone, Copy, Debug)]
struct Pin {
    chunk: u32,
    epoch: u64,
}

/// `keys` (any iterable of `bytes`) as engine keys.
fn keys_of(keys: &Bound<'_, PyAny>) -> PyResult<Vec<OffloadKey>> {
    let mut out = Vec::new();
    keys_into(keys, &mut out)?;
    Ok(out)
}

impl VllmSharedTierCore {
    fn client(&mut self) -> &mut TierClient {
        self.client.get_mut().unwrap_or_else(PoisonError::into_inner)
    }

    /// One batch to the owner, after what is queued (a miss and no store for each call while
    /// it is gone).
    fn call(&mut self, calls: &[TierCall<'_>]) -> PyResult<()> {
        let client = self.client.get_mut().unwrap_or_else(PoisonError::into_inner);
        client.call(calls, &mut self.answers).map_err(tier_error)
    }

    /// The client's connection epoch now.
    fn epoch(&mut self) -> u64 {
        self.client().connection_epoch()
    }

    /// Remembers what an `AcquirePrefix` of `keys` that pinned `found` of them said of the keys
    /// after those (`promoting` coming from storage, then the one that ended them), but for
    /// `keys[0]`, answered now.
    fn foretell(&mut self, request: &str, keys: &[OffloadKey], found: usize, promoting: usize) {
        let first = found.max(1);
        let end = (found + promoting + 1).min(keys.len());
        if first >= end {
            self.foretold.remove(request);
            return;
        }
        let retry = (found + promoting).saturating_sub(first);
        let foretold = Foretold { keys: keys[first..end].to_vec(), retry, next: 0 };
        self.foretold.insert(request.to_owned(), foretold);
    }

    /// The answer foretold for `request`'s lookup of `wanted`, if it is the key foretold next.
    fn foretold_answer(&mut self, request: &str, wanted: &OffloadKey) -> Option<u8> {
        let foretold = self.foretold.get_mut(request)?;
        if foretold.keys.get(foretold.next) != Some(wanted) {
            self.foretold.remove(request);
            return None;
        }
        let code = if foretold.next < foretold.retry { RETRY } else { MISS };
        foretold.next += 1;
        if foretold.next == foretold.keys.len() {
            self.foretold.remove(request);
        }
        Some(code)
    }

    /// Queues the release of the pins of `pins` taken on the current connection; those of an
    /// earlier one are its slot's, released by the owner when this process exits.
    fn release_current(&mut self, pins: impl IntoIterator<Item = (OffloadKey, u64)>) {
        let epoch = self.epoch();
        let keys: Vec<OffloadKey> =
            pins.into_iter().filter(|&(_, pinned)| pinned == epoch).map(|(key, _)| key).collect();
        self.client().queue_release_loads(&keys);
    }
}

#[pymethods]
impl VllmSharedTierCore {
    /// A client of tier `tier` for blocks of the identity given; `vllm_types` as
    /// `VllmManagerCore` takes them; `lease_chunks` it asks to hold ahead of its stores (0: it
    /// asks the owner for each store). It attaches now if the owner is there, and else at a
    /// later call (at most once a second).
    #[new]
    #[pyo3(signature = (
        tier, *, model, kv_dtype, block_tokens, block_bytes, blocks_per_chunk, layout,
        vllm_types, answer_deadline_s=1.0, lease_chunks=DEFAULT_LEASE_CHUNKS
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        tier: &str,
        model: String,
        kv_dtype: String,
        block_tokens: u32,
        block_bytes: u64,
        blocks_per_chunk: u32,
        layout: String,
        vllm_types: VllmTypeTuple,
        answer_deadline_s: f64,
        lease_chunks: u32,
    ) -> PyResult<Self> {
        let identity =
            TierIdentity { model, kv_dtype, block_tokens, block_bytes, blocks_per_chunk, layout };
        let options = ClientOptions {
            answer_deadline: Duration::try_from_secs_f64(answer_deadline_s)
                .map_err(|error| ConfigError::new_err(format!("answer_deadline_s: {error}")))?,
            run_sleep: sleep_without_the_gil,
            lease_chunks,
            ..ClientOptions::default()
        };
        let client = TierClient::new(segment_name(tier)?, identity, options).map_err(tier_error)?;
        Ok(VllmSharedTierCore {
            types: VllmTypes::new(vllm_types),
            client: Mutex::new(client),
            pinned: HashMap::new(),
            loading: HashMap::new(),
            foretold: HashMap::new(),
            counters: ClientCounters::default(),
            answers: Vec::new(),
            last_step_end: (false, 0),
        })
    }

    /// Whether the tier's owner serves this engine now.
    #[getter]
    fn connected(&mut self) -> bool {
        self.client().is_connected()
    }

    /// Why the engine is not connected, if it is not.
    #[getter]
    fn last_error(&mut self) -> Option<String> {
        let client = self.client.get_mut().unwrap_or_else(PoisonError::into_inner);
        client.last_error().map(str::to_owned)
    }

    /// Module flow, step 1.
    fn lookup(
        mut slf: PyRefMut<'_, Self>,
        key: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let wanted = key_of(key)?;
        let request = request_id(req_context)?;
        let request = request.to_str()?;
        slf.counters.lookups += 1;
        let epoch = slf.epoch();
        let held = slf
            .pinned
            .get(request)
            .and_then(|pins| pins.get(&wanted))
            .is_some_and(|pin| pin.epoch == epoch);
        if !held {
            if let Some(code) = slf.foretold_answer(request, &wanted) {
                return Ok(slf.types.lookup[usize::from(code)].clone_ref(py));
            }
        }
        let code = if held {
            HIT
        } else {
            let keys = following_keys(req_context, wanted)?;
            slf.call(&[TierCall::AcquirePrefix { request, keys: &keys }])?;
            let (chunks, promoting) = match slf.answers.first() {
                Some(CallAnswer::Prefix { chunks, promoting }) => {
                    (chunks.clone(), *promoting as usize)
                }
                _ => (Vec::new(), 0),
            };
            slf.foretell(request, &keys, chunks.len(), promoting);
            // Hits come from the connection that serves after the call (one made during it
            // included): a dropped one answered misses.
            let epoch = slf.epoch();
            let pins = slf.pinned.entry(request.to_owned()).or_default();
            // A key the request held on this connection keeps one pin: the second goes back.
            let twice: Vec<(OffloadKey, u64)> = keys
                .iter()
                .zip(&chunks)
                .filter_map(|(key, &chunk)| {
                    let earlier = pins.insert(*key, Pin { chunk, epoch })?;
                    (earlier.epoch == epoch).then_some((*key, epoch))
                })
                .collect();
            slf.release_current(twice);
            match (chunks.is_empty(), promoting) {
                (false, _) => HIT,
                (true, 0) => MISS,
                (true, _) => RETRY,
            }
        };
        if code == HIT {
            slf.counters.lookup_hits += 1;
        }
        Ok(slf.types.lookup[usize::from(code)].clone_ref(py))
    }

    fn on_new_request(
        slf: PyRefMut<'_, Self>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let _ = req_context;
        slf.types.request_context.call0(slf.py())
    }

    /// Module flow, step 2. A key the request does not hold is pinned now; one that is gone
    /// from the tier is an error (vLLM loads only what its lookups found).
    fn prepare_load(
        mut slf: PyRefMut<'_, Self>,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let request = request_id(req_context)?;
        let request = request.to_str()?;
        let wanted = keys_of(keys)?;
        let mut pins = slf.pinned.remove(request).unwrap_or_default();
        let mut taken: Vec<Option<Pin>> = wanted.iter().map(|key| pins.remove(key)).collect();
        let missing: Vec<OffloadKey> =
            wanted.iter().zip(&taken).filter(|(_, pin)| pin.is_none()).map(|(k, _)| *k).collect();
        slf.release_current(pins.into_iter().map(|(key, pin)| (key, pin.epoch)));
        if !missing.is_empty() {
            // As many calls as it takes: one call pins at most a batch's keys.
            let mut found: Vec<Pin> = Vec::with_capacity(missing.len());
            while found.len() < missing.len() {
                let keys = &missing[found.len()..];
                slf.call(&[TierCall::AcquirePrefix { request, keys }])?;
                let chunks = match slf.answers.first() {
                    Some(CallAnswer::Prefix { chunks, .. }) => chunks.clone(),
                    _ => Vec::new(),
                };
                if chunks.is_empty() {
                    break;
                }
                // Each pin is its call's connection's (`Pin`).
                let epoch = slf.epoch();
                found.extend(chunks.into_iter().map(|chunk| Pin { chunk, epoch }));
            }
            let mut found = found.into_iter();
            for pin in taken.iter_mut().filter(|pin| pin.is_none()) {
                *pin = found.next();
            }
            if taken.iter().any(Option::is_none) {
                let held = wanted.iter().zip(&taken);
                let held = held.filter_map(|(key, pin)| pin.map(|pin| (*key, pin.epoch)));
                let held: Vec<(OffloadKey, u64)> = held.collect();
                slf.release_current(held);
                let gone = taken.iter().filter(|pin| pin.is_none()).count();
                return Err(OffloadError::new_err(format!(
                    "{gone} of the {} keys to load are gone from the shared tier",
                    wanted.len()
                )));
            }
        }
        let loads = slf.loading.entry(request.to_owned()).or_default();
        for (key, pin) in wanted.iter().zip(&taken) {
            loads.insert(*key, pin.expect("every key has a pin here").epoch);
        }
        let chunks: Vec<u32> = taken.into_iter().flatten().map(|pin| pin.chunk).collect();
        let chunks = Py::new(py, U32Array::new(chunks.as_slice()))?;
        slf.types.load_store_spec.call1(py, (chunks,))
    }

    /// The tier's recency is the owner's: a request's keys become the most recent when it
    /// finishes, so a touch of this engine's own cache changes nothing there.
    fn touch(&self, keys: &Bound<'_, PyAny>, req_context: &Bound<'_, PyAny>) {
        let _ = (keys, req_context);
    }

    /// Module flow, step 3.
    fn complete_load(
        mut slf: PyRefMut<'_, Self>,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let request = request_id(req_context)?;
        let request = request.to_str()?;
        let loaded = keys_of(keys)?;
        slf.counters.keys_loaded += loaded.len() as u64;
        let current = slf.epoch();
        let mut loads = slf.loading.remove(request).unwrap_or_default();
        let pins: Vec<(OffloadKey, u64)> =
            loaded.iter().map(|key| (*key, loads.remove(key).unwrap_or(current))).collect();
        if !loads.is_empty() {
            slf.loading.insert(request.to_owned(), loads);
        }
        slf.release_current(pins);
        Ok(())
    }

    /// Module flow, step 4. A store the tier refuses (its owner gone or in its grace, the tier
    /// full of pinned chunks) returns an empty output, not `None`: vLLM then moves past those
    /// blocks rather than offering them again, with a warning, at every step while the refusal
    /// lasts. The refusal is counted in `stores_refused`.
    fn prepare_store(
        mut slf: PyRefMut<'_, Self>,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let offered = match keys.cast::<PyList>() {
            Ok(list) => list.clone(),
            Err(_) => PyList::new(py, keys.try_iter()?.collect::<PyResult<Vec<_>>>()?)?,
        };
        let request = request_id(req_context)?;
        let asked = keys_of(offered.as_any())?;
        let answer = slf.client().prepare_store(request.to_str()?, &asked).map_err(tier_error)?;
        let (indices, chunks, refused) = match answer {
            CallAnswer::Store { to_store, chunks, refused } => (to_store, chunks, refused),
            _ => (Vec::new(), Vec::new(), true),
        };
        if refused && !offered.is_empty() {
            slf.counters.stores_refused += 1;
        }
        let to_store = PyList::empty(py);
        for index in indices {
            to_store.append(offered.get_item(index as usize)?)?;
        }
        let chunks = Py::new(py, U32Array::new(chunks.as_slice()))?;
        let spec = slf.types.load_store_spec.call1(py, (chunks,))?;
        slf.types.store_output(py, to_store, spec, PyList::empty(py))
    }

    #[pyo3(signature = (keys, req_context, success=true))]
    fn complete_store(
        mut slf: PyRefMut<'_, Self>,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
        success: bool,
    ) -> PyResult<()> {
        let _ = req_context;
        let stored = keys_of(keys)?;
        if success {
            slf.counters.keys_stored += stored.len() as u64;
        } else {
            slf.counters.stores_failed += stored.len() as u64;
        }
        slf.client().queue_complete_store(&stored, success);
        Ok(())
    }

    /// Module flow, step 5.
    fn on_request_finished(
        mut slf: PyRefMut<'_, Self>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let request = request_id(req_context)?;
        let request = request.to_str()?;
        slf.foretold.remove(request);
        let unused = slf.pinned.remove(request).unwrap_or_default();
        slf.release_current(unused.into_iter().map(|(key, pin)| (key, pin.epoch)));
        slf.client().queue_finish_request(request);
        Ok(())
    }

    /// Sends what has been queued since before the last call of it, if no batch has carried it
    /// since (module flow), without waiting for the owner: vLLM calls it once a scheduler step.
    fn on_schedule_end(&mut self, context: &Bound<'_, PyAny>) -> PyResult<()> {
        let _ = context;
        // What was foretold is this step's: vLLM looks a request's keys up within one step.
        self.foretold.clear();
        let (queued_then, batches_then) = self.last_step_end;
        if queued_then && self.client().batches_sent() == batches_then {
            self.client().send_queued().map_err(tier_error)?;
        }
        let client = self.client();
        self.last_step_end = (client.has_queued(), client.batches_sent());
        Ok(())
    }

    /// Sends what is queued, without waiting for the owner, and returns `False`: vLLM asks only
    /// when its engine would go idle otherwise (no request left), so no later step would carry
    /// the queue; once sent, the owner carries it out with no step of the engine's (another
    /// engine's lookup may come first: the owner orders each client's calls, not the clients).
    /// It never raises, as vLLM asks in its engine loop: a tier that cannot be used (the name
    /// attached again to an owner of other blocks) raises at the engine's next call instead.
    fn has_pending_work(&mut self) -> bool {
        let _unusable_tier_raises_at_the_next_call = self.client().send_queued();
        false
    }

    /// Sends what is queued now, and waits until the owner has carried out every call sent.
    fn flush(&mut self) -> PyResult<()> {
        self.client().flush().map_err(tier_error)
    }

    /// A shared tier reports no KV events: another engine's evictions are not this one's to
    /// announce.
    fn take_events<'py>(slf: PyRef<'py, Self>) -> Bound<'py, PyList> {
        PyList::empty(slf.py())
    }

    /// vLLM's reset of its prefix cache. The tier is every engine's, so it stays as it is. The
    /// pins of lookups that no load took yet are let go: vLLM forgets what it looked up, and no
    /// copy reads their chunks. vLLM also drops the completions of the jobs in flight, so no
    /// `complete_load` or `complete_store` comes for them. A load may still be copying into
    /// blocks a request goes on with, so its pins stay until this engine leaves the tier. Its
    /// stores are abandoned: their keys are dropped, so that any engine may store them again (a
    /// key left pending would be a miss and unstorable for every engine until this one left),
    /// and their chunks, which its copies may still write (vLLM's worker runs a store at its
    /// engine's next step, however late), stay this engine's until it leaves the tier.
    fn reset_cache(&mut self) {
        self.client().queue_abandon_stores();
        self.foretold.clear();
        let mut pins: Vec<(OffloadKey, u64)> = Vec::new();
        for (_, pinned) in self.pinned.drain() {
            pins.extend(pinned.into_iter().map(|(key, pin)| (key, pin.epoch)));
        }
        self.release_current(pins);
    }

    /// This engine's counters: lookups and their hits (keys), batches sent to the owner
    /// (`owner_calls`) and those waited for (`owner_waits`), keys loaded
    /// and stored, stores refused (no chunk given: the tier full, the owner gone or in its grace)
    /// and failed, and whether the owner serves it now.
    fn stats<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let counters = self.counters;
        let connected = self.connected();
        let (owner_calls, owner_waits) =
            (self.client().batches_sent(), self.client().batches_waited());
        let stats = PyDict::new(py);
        for (name, value) in [
            ("lookups", counters.lookups),
            ("lookup_hits", counters.lookup_hits),
            ("owner_calls", owner_calls),
            ("owner_waits", owner_waits),
            ("keys_loaded", counters.keys_loaded),
            ("keys_stored", counters.keys_stored),
            ("stores_refused", counters.stores_refused),
            ("stores_failed", counters.stores_failed),
            ("connected", u64::from(connected)),
        ] {
            stats.set_item(name, value)?;
        }
        Ok(stats)
    }
}

/// `key` and the keys of its request that follow it in its group, in position order (from the
/// `ReqContext`'s position table; just `key` without one), at most [`LOOKAHEAD_KEYS`].
fn following_keys(context: &Bound<'_, PyAny>, key: OffloadKey) -> PyResult<Vec<OffloadKey>> {
    let py = context.py();
    let Ok(table) = context.getattr(intern!(py, "_offload_key_positions")) else {
        return Ok(vec![key]);
    };
    let Ok(table) = table.cast::<PyDict>() else { return Ok(vec![key]) };
    let Some(start) = table
        .get_item(pyo3::types::PyBytes::new(py, key.as_bytes()))?
        .and_then(|position| position.extract::<u64>().ok())
    else {
        return Ok(vec![key]);
    };
    // A key's group is its last four bytes (vLLM's keys: block hash, then the group index).
    const GROUP_BYTES: usize = 4;
    let own_group = key.chain_tag(GROUP_BYTES);
    let mut after: Vec<(u64, OffloadKey)> = Vec::new();
    for (other, position) in table.iter() {
        // The position first: a key at or before `start` is not read at all.
        let Ok(position) = position.extract::<u64>() else { continue };
        if position <= start {
            continue;
        }
        let Ok(other) = key_of(&other) else { continue };
        if other.chain_tag(GROUP_BYTES) == own_group {
            after.push((position, other));
        }
    }
    after.sort_unstable_by_key(|&(position, _)| position);
    let mut keys = vec![key];
    keys.extend(after.into_iter().take(LOOKAHEAD_KEYS - 1).map(|(_, key)| key));
    Ok(keys)
}
