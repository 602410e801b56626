//! `Service`: the scheduler API for engines that let kvshm own both tiers.
//!
//! Each method converts its arguments, calls the same method of [`kvshm::service::Service`] and
//! converts the result ([`crate::results`]); waits run with the GIL released.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvshm::manager::{
    CacheConfig, MatchError, RequestId, StorageWritePolicy, TicketId, TicketStatus, WritePolicy,
};
use kvshm::service::{
    Backend, BlockAccessError, SegmentName, Service as RustService, ServiceConfig, ServiceError,
    TicketReady, TierBackoff, WaitError, WorkerMissing,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::buffers::{read_hashes, U32Array};
use crate::errors::{ConfigError, IntoPyResult, SegmentError, ToPyErr, TransferFailedError};
use crate::results::{Allocation, AllocationCheck, PrefixMatch, ShortenedHit};
use crate::waiting::{self, wait_unlocked};

/// A timeout in seconds as a `Duration` (negative, NaN or absurd values are refused).
pub fn seconds(value: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value)
        .map_err(|_| PyValueError::new_err(format!("{what} of {value} s is not a duration")))
}

fn parse_policy(text: &str) -> PyResult<WritePolicy> {
    text.parse::<WritePolicy>().map_err(|error| ConfigError::new_err(error.to_string()))
}

fn parse_backend(text: &str) -> PyResult<Backend> {
    match text {
        "host" => Ok(Backend::HostArena),
        "cuda" => Ok(Backend::Cuda),
        other => Err(ConfigError::new_err(format!("backend {other:?} is neither host nor cuda"))),
    }
}

pub fn segment_name(name: &str) -> PyResult<SegmentName> {
    SegmentName::new(name).map_err(|error| ConfigError::new_err(error.to_string()))
}

/// The cache manager of one engine, its segment and its worker processes. Usable from any
/// thread: calls run one at a time, and a wait lets other threads' calls run between its polls
/// (see `waiting`).
#[pyclass(frozen, module = "kvshm")]
pub struct Service {
    inner: Mutex<Option<RustService>>,
}

impl Service {
    fn lock(&self, py: Python<'_>) -> MutexGuard<'_, Option<RustService>> {
        waiting::lock(py, &self.inner)
    }

    /// One region of `rank`'s memory as bytes, read by `read` (a device or a host region).
    fn read_region<'py>(
        &self,
        py: Python<'py>,
        rank: u32,
        read: impl FnOnce(&kvshm::service::RankMemory, &mut [u8]) -> Result<(), BlockAccessError>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let mut guard = self.lock(py);
        let service = open(&mut guard)?;
        let mut bytes = vec![0; service.geometry().region_bytes() as usize];
        read(memory(service, rank)?, &mut bytes)
            .map_err(|error| PyValueError::new_err(error.to_string()))?;
        Ok(PyBytes::new(py, &bytes))
    }
}

/// The service behind a guard, or `SegmentError` once closed.
fn open(guard: &mut Option<RustService>) -> PyResult<&mut RustService> {
    guard.as_mut().ok_or_else(|| SegmentError::new_err("the service is closed"))
}

#[pymethods]
impl Service {
    /// Creates segment `name` (replacing a stale one) and the cache manager.
    #[new]
    #[pyo3(signature = (
        name, *, block_tokens, device_blocks, region_bytes, host_blocks=0, tp_size=1, layers=1,
        regions=None, write_policy="write_back", free_watermark=0, backend="host",
        layerwise=true, command_ring_slots=4096, completion_ring_slots=256, storage_blocks=0,
        storage_write_policy="write_back", storage_backoff=1.0, storage_backoff_max=30.0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: &str,
        block_tokens: u32,
        device_blocks: u32,
        region_bytes: u64,
        host_blocks: u32,
        tp_size: u32,
        layers: u32,
        regions: Option<u32>,
        write_policy: &str,
        free_watermark: u32,
        backend: &str,
        layerwise: bool,
        command_ring_slots: u32,
        completion_ring_slots: u32,
        storage_blocks: u32,
        storage_write_policy: &str,
        storage_backoff: f64,
        storage_backoff_max: f64,
    ) -> PyResult<Service> {
        let name = segment_name(name)?;
        let seconds = |value: f64, what: &str| {
            Duration::try_from_secs_f64(value).map_err(|_| {
                ConfigError::new_err(format!("{what} must be a number of seconds, got {value}"))
            })
        };
        let backoff = TierBackoff {
            first: seconds(storage_backoff, "storage_backoff")?,
            max: seconds(storage_backoff_max, "storage_backoff_max")?,
        };
        backoff.validate().map_err(|error| ConfigError::new_err(error.to_string()))?;
        let storage_write_policy = storage_write_policy
            .parse::<StorageWritePolicy>()
            .map_err(|error| ConfigError::new_err(error.to_string()))?;
        let cache = CacheConfig::new(block_tokens, device_blocks)
            .with_host_blocks(host_blocks)
            .with_write_policy(parse_policy(write_policy)?)
            .with_free_watermark(free_watermark)
            .with_storage_blocks(storage_blocks)
            .with_storage_write_policy(storage_write_policy);
        let regions = regions.unwrap_or(layers.saturating_mul(2));
        let mut config = ServiceConfig::new(cache, tp_size, layers, regions, region_bytes);
        config.backend = parse_backend(backend)?;
        config.layerwise = layerwise;
        config.command_ring_slots = command_ring_slots;
        config.completion_ring_slots = completion_ring_slots;
        config.storage_backoff = backoff;
        let service = py.detach(|| RustService::create(&name, config)).py_err()?;
        Ok(Service { inner: Mutex::new(Some(service)) })
    }

    /// The segment's name (workers attach with `python -m kvshm worker --name NAME --rank R`).
    #[getter]
    fn name(&self, py: Python<'_>) -> PyResult<String> {
        Ok(open(&mut self.lock(py))?.segment().name().as_str().to_owned())
    }

    #[getter]
    fn tp_size(&self, py: Python<'_>) -> PyResult<u32> {
        Ok(open(&mut self.lock(py))?.segment().config().tp_size)
    }

    #[getter]
    fn layers(&self, py: Python<'_>) -> PyResult<u32> {
        Ok(open(&mut self.lock(py))?.geometry().layers())
    }

    #[getter]
    fn regions(&self, py: Python<'_>) -> PyResult<u32> {
        Ok(open(&mut self.lock(py))?.geometry().regions())
    }

    #[getter]
    fn region_bytes(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(open(&mut self.lock(py))?.geometry().region_bytes())
    }

    #[getter]
    fn block_tokens(&self, py: Python<'_>) -> PyResult<u32> {
        Ok(open(&mut self.lock(py))?.cache().config().block_tokens)
    }

    /// Polls until every rank has a live worker (GIL released between polls).
    #[pyo3(signature = (timeout=10.0))]
    fn wait_for_workers(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let started = Instant::now();
        let timeout = seconds(timeout, "timeout")?;
        let mut missing = 0;
        let all_up = wait_unlocked(py, &self.inner, open, timeout, |service| {
            Ok(match service.poll_workers() {
                None => Some(()),
                Some(rank) => {
                    missing = rank;
                    None
                }
            })
        })?;
        all_up.ok_or_else(|| {
            ServiceError::from(WorkerMissing { rank: missing, waited: started.elapsed() }).to_py()
        })
    }

    /// Whether each rank has a worker: `"up"`, `"starting"` (a worker still setting up) or `"down"`.
    fn rank_states(&self, py: Python<'_>) -> PyResult<Vec<&'static str>> {
        Ok(open(&mut self.lock(py))?
            .rank_states()
            .into_iter()
            .map(|state| match state {
                kvshm::service::RankState::Up { .. } => "up",
                kvshm::service::RankState::Starting { .. } => "starting",
                kvshm::service::RankState::Down => "down",
            })
            .collect())
    }

    /// How many leading blocks hit on device, on host and on the storage tier; no side
    /// effects. With the prompt's
    /// length, what `match_prefix` would hold (the last-token rule); without it, how many of
    /// the leading blocks are cached.
    #[pyo3(signature = (hashes, prompt_tokens=None))]
    fn lookup(
        &self,
        py: Python<'_>,
        hashes: &Bound<'_, PyAny>,
        prompt_tokens: Option<usize>,
    ) -> PyResult<(usize, usize, usize)> {
        let hashes = read_hashes(hashes)?;
        let mut guard = self.lock(py);
        let cache = open(&mut guard)?.cache();
        let found = match prompt_tokens {
            Some(tokens) => {
                cache.lookup(&hashes, tokens).map_err(|error| MatchError::from(error).to_py())?
            }
            None => cache.cached_prefix(&hashes),
        };
        Ok((found.device_blocks, found.host_blocks, found.storage_blocks))
    }

    /// Holds the request's cached prefix. The last prompt token is always left to compute.
    fn match_prefix(
        &self,
        py: Python<'_>,
        request: u64,
        hashes: &Bound<'_, PyAny>,
        prompt_tokens: usize,
    ) -> PyResult<PrefixMatch> {
        let hashes = read_hashes(hashes)?;
        let found =
            open(&mut self.lock(py))?.match_prefix(RequestId(request), &hashes, prompt_tokens);
        found.map(PrefixMatch::from).py_err()
    }

    /// Extends a waiting request's held prefix with blocks cached since it was matched.
    fn rematch(
        &self,
        py: Python<'_>,
        request: u64,
        hashes: &Bound<'_, PyAny>,
        prompt_tokens: usize,
    ) -> PyResult<PrefixMatch> {
        let hashes = read_hashes(hashes)?;
        let found = open(&mut self.lock(py))?.rematch(RequestId(request), &hashes, prompt_tokens);
        found.map(PrefixMatch::from).py_err()
    }

    /// Gives back the holds of a request that has not allocated.
    fn release_match(&self, py: Python<'_>, request: u64) -> PyResult<()> {
        open(&mut self.lock(py))?.release_match(RequestId(request)).py_err()
    }

    /// Whether `allocate` with these arguments would succeed now; changes nothing.
    #[pyo3(signature = (request, new_tokens, lookahead=0))]
    fn can_allocate(
        &self,
        py: Python<'_>,
        request: u64,
        new_tokens: usize,
        lookahead: usize,
    ) -> PyResult<AllocationCheck> {
        let check = open(&mut self.lock(py))?
            .can_allocate(RequestId(request), new_tokens, lookahead)
            .py_err()?;
        Ok(AllocationCheck { needed: check.needed, available: check.available })
    }

    /// Device blocks for the host hits and `new_tokens` more tokens (plus `lookahead`).
    #[pyo3(signature = (request, new_tokens, lookahead=0))]
    fn allocate(
        &self,
        py: Python<'_>,
        request: u64,
        new_tokens: usize,
        lookahead: usize,
    ) -> PyResult<Allocation> {
        let mut guard = self.lock(py);
        let allocation =
            open(&mut guard)?.allocate(RequestId(request), new_tokens, lookahead).py_err()?;
        let table = U32Array::new(allocation.block_table);
        Ok(Allocation {
            ticket: allocation.ticket.0,
            block_table: Py::new(py, table)?,
            new_blocks: allocation.new_blocks,
        })
    }

    /// The block table of a live request.
    fn block_table(&self, py: Python<'_>, request: u64) -> PyResult<U32Array> {
        let mut guard = self.lock(py);
        let service = open(&mut guard)?;
        let table = service.cache().block_table(RequestId(request)).ok_or_else(|| {
            crate::errors::UnknownRequestError::new_err(format!("request {request} is not live"))
        })?;
        Ok(U32Array::new(table))
    }

    /// Caches the full blocks among the first `computed_tokens`; returns (inserted, duplicates).
    fn commit(
        &self,
        py: Python<'_>,
        request: u64,
        computed_tokens: usize,
        hashes: &Bound<'_, PyAny>,
    ) -> PyResult<(usize, usize)> {
        let hashes = read_hashes(hashes)?;
        let done = open(&mut self.lock(py))?
            .commit(RequestId(request), computed_tokens, &hashes)
            .py_err()?;
        Ok((done.inserted, done.duplicates))
    }

    fn finish(&self, py: Python<'_>, request: u64) -> PyResult<()> {
        open(&mut self.lock(py))?.finish(RequestId(request)).py_err()
    }

    fn abort(&self, py: Python<'_>, request: u64) -> PyResult<()> {
        open(&mut self.lock(py))?.abort(RequestId(request)).py_err()
    }

    /// Drops every cached block; returns the requests a forced reset ended.
    #[pyo3(signature = (force=false))]
    fn reset(&self, py: Python<'_>, force: bool) -> PyResult<Vec<u64>> {
        let dropped = open(&mut self.lock(py))?.reset(force).py_err()?;
        Ok(dropped.into_iter().map(|request| request.0).collect())
    }

    /// Requests a forced `kvctl reset` ended since the last call.
    fn take_requests_dropped_by_kvctl(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        let dropped = open(&mut self.lock(py))?.take_requests_dropped_by_kvctl();
        Ok(dropped.into_iter().map(|request| request.0).collect())
    }

    fn resize_device(&self, py: Python<'_>, blocks: u32) -> PyResult<()> {
        open(&mut self.lock(py))?.resize_device(blocks).py_err()
    }

    /// Leading blocks of the request's table every live request shares (cascade attention).
    fn common_prefix_blocks(&self, py: Python<'_>, request: u64) -> PyResult<usize> {
        open(&mut self.lock(py))?.cache().common_prefix_blocks(RequestId(request)).py_err()
    }

    /// Reaps completions, watches workers, issues copies, serves kvctl.
    fn poll(&self, py: Python<'_>) -> PyResult<()> {
        open(&mut self.lock(py))?.poll();
        Ok(())
    }

    /// Waits until the ticket's blocks are ready (GIL released between polls). Returns `None`
    /// when every hit is in its blocks, or a `ShortenedHit` when the storage tier missed some
    /// hits: the leading positions still cached and the block table to compute the rest into.
    #[pyo3(signature = (ticket, timeout=30.0))]
    fn wait(&self, py: Python<'_>, ticket: u64, timeout: f64) -> PyResult<Option<ShortenedHit>> {
        let started = Instant::now();
        let (ticket, timeout) = (TicketId(ticket), seconds(timeout, "timeout")?);
        let ready = wait_unlocked(py, &self.inner, open, timeout, |service| {
            service.poll_ticket(ticket).py_err()
        })?;
        match ready {
            Some(TicketReady::AllHits) => Ok(None),
            Some(TicketReady::Shortened { cached_blocks, block_table }) => Ok(Some(ShortenedHit {
                cached_blocks,
                block_table: Py::new(py, U32Array::new(block_table))?,
            })),
            None => Err(WaitError::TimedOut { ticket, waited: started.elapsed() }.to_py()),
        }
    }

    /// Polls until no copy is in flight; returns whether none is (GIL released between polls).
    #[pyo3(signature = (timeout=30.0))]
    fn wait_for_copies(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let timeout = seconds(timeout, "timeout")?;
        let done = wait_unlocked(py, &self.inner, open, timeout, |service| {
            Ok(service.poll_copies().then_some(()))
        })?;
        Ok(done.is_some())
    }

    /// Starts loading the prompt's blocks on the storage tier into host blocks before its request
    /// is scheduled, and asks a shared tier (Redis, not a disk slab) about the blocks past the
    /// cache's end (another service may have written them). Returns the ticket, or `None` with
    /// nothing to do. Raises `ConfigError` without a storage tier.
    fn prefetch(&self, py: Python<'_>, hashes: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
        let hashes = read_hashes(hashes)?;
        let ticket = open(&mut self.lock(py))?.prefetch(&hashes).py_err()?;
        Ok(ticket.map(|ticket| ticket.0))
    }

    /// A prefetch ticket's status after a poll: `"ready"` or `"pending"`. A storage miss ends it
    /// ready too (a prefetch is advisory; `stats()` counts the misses), so it never raises for
    /// one. A ticket read as done is forgotten (`TicketError` after).
    fn prefetch_status(&self, py: Python<'_>, ticket: u64) -> PyResult<&'static str> {
        match open(&mut self.lock(py))?.prefetch_status(TicketId(ticket)).py_err()? {
            // A prefetch belongs to no request: nothing is shortened.
            TicketStatus::Ready | TicketStatus::Shortened { .. } => Ok("ready"),
            TicketStatus::Pending => Ok("pending"),
            TicketStatus::Failed(failure) => Err(TransferFailedError::new_err(failure.to_string())),
        }
    }

    /// `"ready"`, `"shortened"` (ready, but the storage tier missed some hits: see
    /// `ticket_cached_blocks`) or `"pending"`; a failed ticket raises `TransferFailedError`.
    fn ticket_status(&self, py: Python<'_>, ticket: u64) -> PyResult<&'static str> {
        match open(&mut self.lock(py))?.ticket_status(TicketId(ticket)).py_err()? {
            TicketStatus::Ready => Ok("ready"),
            TicketStatus::Shortened { .. } => Ok("shortened"),
            TicketStatus::Pending => Ok("pending"),
            TicketStatus::Failed(failure) => Err(TransferFailedError::new_err(failure.to_string())),
        }
    }

    /// Leading block-table positions still cached when a storage miss shortened the ticket's
    /// hit, else `None`. Known once the ticket's storage loads completed, before any layer of
    /// the swap-ins behind them lands: a layer-wise engine reads it once `ticket_layers_ready`
    /// is above 0.
    fn ticket_cached_blocks(&self, py: Python<'_>, ticket: u64) -> PyResult<Option<u32>> {
        open(&mut self.lock(py))?.ticket_cached_blocks(TicketId(ticket)).py_err()
    }

    /// Leading layers of the ticket's blocks that have landed on every rank.
    fn ticket_layers_ready(&self, py: Python<'_>, ticket: u64) -> PyResult<u32> {
        open(&mut self.lock(py))?.ticket_layers_ready(TicketId(ticket)).py_err()
    }

    /// Whether the storage tier is down: a STORE or LOAD found it failing, and no work goes to it
    /// until a probe (after `storage_backoff` seconds, doubling up to `storage_backoff_max`)
    /// reaches it on every rank. `poll()` (and every wait) probes.
    #[getter]
    fn storage_tier_down(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(open(&mut self.lock(py))?.cache().storage_tier_down())
    }

    /// The manager's and the service's figures, as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let mut guard = self.lock(py);
        let service = open(&mut guard)?;
        let json = serde_json::json!({
            "cache": service.cache().stats(),
            "service": service.stats(),
        });
        py.import("json")?.call_method1("loads", (json.to_string(),))
    }

    /// Checks the invariants of DESIGN §6; raises `KvshmError` naming the broken one.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        open(&mut self.lock(py))?
            .cache()
            .check_invariants()
            .map_err(|violation| crate::errors::KvshmError::new_err(violation.to_string()))
    }

    /// Writes one region of a device block (host backend: the device arena in shared memory).
    fn write_device_region(
        &self,
        py: Python<'_>,
        rank: u32,
        block: u32,
        region: u32,
        data: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let bytes = pyo3::buffer::PyBuffer::<u8>::get(data)?.to_vec(data.py())?;
        let mut guard = self.lock(py);
        memory(open(&mut guard)?, rank)?
            .write_device_region(block, region, &bytes)
            .map_err(|error| PyValueError::new_err(error.to_string()))
    }

    /// One region of a device block, as bytes.
    fn read_device_region<'py>(
        &self,
        py: Python<'py>,
        rank: u32,
        block: u32,
        region: u32,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.read_region(py, rank, |memory, bytes| memory.read_device_region(block, region, bytes))
    }

    /// One region of a host block, as bytes.
    fn read_host_region<'py>(
        &self,
        py: Python<'py>,
        rank: u32,
        block: u32,
        region: u32,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.read_region(py, rank, |memory, bytes| memory.read_host_region(block, region, bytes))
    }

    /// Removes the segment and stops serving (workers then exit). Idempotent.
    fn close(&self, py: Python<'_>) {
        *self.lock(py) = None;
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _kind: &Bound<'_, PyAny>,
        _value: &Bound<'_, PyAny>,
        _traceback: &Bound<'_, PyAny>,
    ) {
        self.close(py);
    }
}

/// The engine's view of `rank`'s block bytes (host backend only).
fn memory(service: &RustService, rank: u32) -> PyResult<&kvshm::service::RankMemory> {
    service.memory(rank).ok_or_else(|| {
        PyValueError::new_err(format!(
            "rank {rank} has no shared-memory arenas (out of range, or the cuda backend)"
        ))
    })
}
