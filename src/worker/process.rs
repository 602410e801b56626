//! The worker process around the serving loop: attach to a segment by name, claim a rank, build
//! the rank's copy engine, install the stop signals, serve, and let go of the rank.
//!
//! Core types: [`WorkerOptions`] (what `kvshm worker` was asked), [`BackendChoice`], [`StartError`]
//! (why the worker could not start serving) and [`WorkerError`].
//!
//! [`run_worker`]:
//!
//! 1. install SIGTERM and SIGINT handlers that set a flag the loop polls ([`stop_requested`]);
//! 2. attach ([`Segment::attach`]) and claim the rank ([`Segment::claim_rank`]), retrying until
//!    `attach_timeout` while the segment does not exist or is not ready yet, or while the rank is
//!    held by a dead worker the scheduler has not reclaimed yet; a rank held by a live worker, a
//!    stale or broken segment, or a rank out of range fail at once;
//! 3. build the engine of the segment's backend: host backend: open the rank's device arena and
//!    host tier ([`super::tiers`]), map their pages in ([`prefault`], heartbeating) so that no copy runs over cold
//!    mappings, and lay a [`HostCopyEngine`] over them; CUDA backend (feature `cuda`): wait,
//!    heartbeating, until the engine published the rank's device handles, then open them with the
//!    host tier registered for DMA (a helper thread heartbeats while the driver sets up);
//! 4. with `--storage`, open the rank's storage back-end and start its storage thread
//!    ([`super::storage_open`], [`super::storage_lane`]); mark the claim serving ([`RankClaim::mark_serving`]: until now
//!    the scheduler kept the rank Starting and sent it nothing, so no copy waits behind the set-up
//!    and no command deadline runs during it); serve ([`Server::serve`]) until stopped, until the
//!    scheduler is gone, or until the rank is lost;
//! 5. drop the engine, then the claim (a clean exit leaves the rank EMPTY and claimable again;
//!    after a broken command ring, ring descriptions no worker can take, a stop with answers
//!    unpushed or a panic the claim is left to die with the process, so that the scheduler resets
//!    the rings before another worker can claim the rank).

use std::ptr::NonNull;
use std::time::{Duration, Instant};

use kvshm_ipc::arena::{Arena, ArenaError, ArenaKind};
use kvshm_ipc::config::{Backend, ConfigError};
use kvshm_ipc::huge_pages;
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::segment::{AttachError, RankClaim, Segment};
use kvshm_ipc::sync::{AtomicBool, Ordering};
use kvshm_ipc::worker_slot::{ClaimError, ClaimLost};
use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};

use super::engine::CopyEngine;
use super::geometry::{Geometry, GeometryError, GeometryParams};
use super::host_engine::{HostCopyEngine, HostEngineError, MappedArea};
use super::prefault::{self, Populated};
use super::run::{ServeError, ServeExit, ServeOptions, Server, ServerSetupError};
use super::storage_lane::{HostBlocks, LaneContext, StorageLane};
use super::storage_open::{open_backend, StorageStartError};
use super::tiers::{open_arena, open_host_tier};
use crate::offload::shared::TierArenaError;
use crate::storage::spec::StorageOptions;

/// How long a waiting worker sleeps between attempts (attach, claim, device handles).
const RETRY_INTERVAL: Duration = Duration::from_millis(10);

/// Which copy engine the worker runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    /// memcpy between the rank's shared-memory device arena and its host tier.
    Host,
    /// The CUDA driver, over the device buffers the engine published (feature `cuda`).
    Cuda,
}

impl BackendChoice {
    fn of_segment(backend: Backend) -> BackendChoice {
        match backend {
            Backend::HostArena => BackendChoice::Host,
            Backend::Cuda => BackendChoice::Cuda,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            BackendChoice::Host => "host",
            BackendChoice::Cuda => "cuda",
        }
    }
}

/// What the worker was asked to do.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    pub name: SegmentName,
    pub rank: u32,
    /// The backend to run; `None`: the one the segment was created for.
    pub backend: Option<BackendChoice>,
    /// CUDA device ordinal; `None`: the rank.
    pub device: Option<u32>,
    /// How long to keep trying to attach and claim (step 2 of [`run_worker`]).
    pub attach_timeout: Duration,
    /// How long a CUDA worker waits for the engine to publish its device handles.
    pub handles_timeout: Duration,
    /// How the CUDA engine moves a layer's pieces.
    pub cuda_copy: super::CopyMethod,
    pub serve: ServeOptions,
    /// The storage tier below host, if any (`--storage`).
    pub storage: Option<StorageOptions>,
    /// The shared tier whose arenas hold the host tier (`--shared-tier`), for a segment whose
    /// host tier is one, and the tier's rank whose arena this worker's rank copies into.
    pub shared_tier: Option<(SegmentName, u32)>,
}

/// Why the worker could not start serving.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot attach to segment {name}: {reason}")]
    Attach { name: SegmentName, reason: AttachError },
    #[error("cannot attach to segment {name}: {reason} (gave up after {waited:.1?})")]
    AttachTimedOut { name: SegmentName, waited: Duration, reason: AttachError },
    #[error("cannot claim rank {rank} of segment {name}: {reason}")]
    Claim { name: SegmentName, rank: u32, reason: ClaimError },
    #[error("cannot claim rank {rank} of segment {name}: {reason} (gave up after {waited:.1?})")]
    ClaimTimedOut { name: SegmentName, rank: u32, waited: Duration, reason: ClaimError },
    #[error("segment {name} has an invalid configuration: {reason}")]
    Config { name: SegmentName, reason: ConfigError },
    #[error("segment {name} uses the {segment} backend, the worker was asked for {requested}")]
    BackendMismatch { name: SegmentName, segment: &'static str, requested: &'static str },
    #[error("the cuda backend is not available: kvshm was built without the cuda feature")]
    CudaNotBuilt,
    #[error("segment geometry: {0}")]
    Geometry(#[from] GeometryError),
    #[error("cannot open the {tier} arena of rank {rank}: {reason}")]
    Arena { tier: &'static str, rank: u32, reason: ArenaError },
    #[error(
        "segment {name}'s host tier is a shared tier's: start the worker with --shared-tier NAME \
         --shared-tier-rank R (the engine's tensor-parallel rank)"
    )]
    SharedTierNotGiven { name: SegmentName },
    #[error(
        "rank {rank}'s arena of shared tier {tier} is not segment {name}'s host tier: its engine \
         (pid {engine}) does not map it (another tier, or another rank: check --shared-tier and \
         --shared-tier-rank)"
    )]
    SharedTierNotTheEngines { name: SegmentName, tier: SegmentName, rank: u32, engine: u32 },
    #[error("segment {name}'s host tier is its own: --shared-tier {tier} does not apply")]
    SharedTierNotUsed { name: SegmentName, tier: SegmentName },
    #[error("the shared tier's arena of rank {rank}: {reason}")]
    SharedTier { rank: u32, reason: TierArenaError },
    #[error("host copy engine: {0}")]
    HostEngine(#[from] HostEngineError),
    #[error("the engine has not published the device handles of rank {rank} after {waited:?}")]
    NoDeviceHandles { rank: u32, waited: Duration },
    #[error("device handles of rank {rank}: {detail}")]
    DeviceHandles { rank: u32, detail: String },
    #[error("cuda copy engine: {0}")]
    CudaEngine(String),
    #[error("the scheduler (pid {pid}) exited while the worker was starting")]
    SchedulerGone { pid: u32 },
    #[error("stopped by a signal while starting")]
    Stopped,
    #[error("the scheduler reclaimed the rank while the worker was starting: {0}")]
    ClaimLost(#[from] ClaimLost),
    #[error(transparent)]
    Setup(#[from] ServerSetupError),
    #[error("cannot install the stop signal handlers: {0}")]
    Signals(nix::Error),
    #[error(transparent)]
    Storage(#[from] StorageStartError),
    #[error("cannot start the storage thread: {0}")]
    StorageThread(std::io::Error),
}

/// Why a worker ended other than cleanly.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Start(#[from] StartError),
    #[error(transparent)]
    Serve(#[from] ServeError),
}

/// Runs a worker until it is stopped or its scheduler is gone (module documentation). A stop
/// signal or the scheduler's death while the worker is still starting is a clean ending too.
pub fn run_worker(options: &WorkerOptions) -> Result<ServeExit, WorkerError> {
    install_stop_handlers().map_err(StartError::Signals)?;
    match start_and_serve(options) {
        Err(WorkerError::Start(StartError::Stopped)) => Ok(ServeExit::StopRequested),
        Err(WorkerError::Start(StartError::SchedulerGone { pid })) => {
            Ok(ServeExit::SchedulerGone { pid })
        }
        ending => ending,
    }
}

/// Steps 2 to 5 of [`run_worker`].
fn start_and_serve(options: &WorkerOptions) -> Result<ServeExit, WorkerError> {
    let (segment, claim) = attach_and_claim(options)?;
    let mut engine = RankEngine::build(&segment, &claim, options)?;
    let storage = match &options.storage {
        None => None,
        Some(storage) => {
            let backend =
                open_backend(&segment, &claim, storage, options.attach_timeout, &stop_requested)
                    .map_err(StartError::from)?;
            Some(backend)
        }
    };
    tracing::info!(
        segment = %options.name,
        rank = options.rank,
        backend = engine.backend.name(),
        storage = storage.as_ref().map(|backend| backend.kind()),
        "worker serving"
    );
    let geometry = *engine.engine.geometry();
    let host_area = engine.host_area;
    let stop = stop_requested;
    // The storage thread lives in this scope: it ends (answering what it was given) before the
    // engine and the claim go.
    let ending = std::thread::scope(|scope| -> Result<Result<ServeExit, ServeError>, StartError> {
        let mut server =
            Server::new(&segment, &claim, engine.engine.as_mut(), &stop, options.serve)?;
        if let Some(backend) = storage {
            let host =
                HostBlocks::new(host_area, &geometry).ok_or(StorageStartError::NoHostTier)?;
            let context = LaneContext {
                segment: &segment,
                claim: &claim,
                host,
                sink: server.completion_sink(),
                stop_requested: &stop,
            };
            let lane = StorageLane::spawn(scope, backend, context, geometry)
                .map_err(StartError::StorageThread)?;
            server.set_storage(lane);
        }
        // Set up: from now on the scheduler sends this rank copies (step 4).
        claim.mark_serving()?;
        Ok(server.serve())
    });
    let ending = match ending {
        Err(error @ StartError::Setup(_)) => {
            // The rank's ring descriptions were written over. As below, the slot stays ATTACHED
            // to this soon-dead process, so the scheduler resets the rings (a release would hand
            // them to the next worker as they are, and it would fail the same way).
            drop(engine);
            std::mem::forget(claim);
            return Err(error.into());
        }
        ending => ending?,
    };
    // Step 5: the server (and its storage thread), then the engine (its copies drained), then
    // the claim go, in this order.
    drop(engine);
    match ending {
        Err(
            error @ (ServeError::CommandRing(_)
            | ServeError::StoppedUnanswered { .. }
            | ServeError::StorageThreadPanicked),
        ) => {
            // Keep the slot ATTACHED to this soon-dead process instead of releasing it: the
            // scheduler then judges the rank dead and resets its rings before any worker can
            // claim it, whereas a release would hand the out-of-step rings (or commands popped
            // and never answered) to the next worker.
            std::mem::forget(claim);
            Err(error.into())
        }
        ending => {
            drop(claim);
            Ok(ending?)
        }
    }
}

static STOP_REQUESTED: AtomicBool = AtomicBool::new(false);

/// True once SIGTERM or SIGINT arrived (after [`install_stop_handlers`]).
pub fn stop_requested() -> bool {
    STOP_REQUESTED.load(Ordering::Relaxed)
}

extern "C" fn on_stop_signal(_signal: libc::c_int) {
    // Only an atomic store: async-signal-safe. Relaxed: the flag carries no other data.
    STOP_REQUESTED.store(true, Ordering::Relaxed);
}

pub(crate) fn install_stop_handlers() -> Result<(), nix::Error> {
    // No SA_RESTART: a signal cuts an idle sleep short, the loop then sees the flag.
    let action =
        SigAction::new(SigHandler::Handler(on_stop_signal), SaFlags::empty(), SigSet::empty());
    for signal in [Signal::SIGTERM, Signal::SIGINT] {
        // SAFETY: the handler only stores to a static atomic, which is async-signal-safe, and
        // replaces no handler another part of the process relies on.
        unsafe { sigaction(signal, &action) }?;
    }
    Ok(())
}

/// Step 2 of [`run_worker`].
fn attach_and_claim(options: &WorkerOptions) -> Result<(Segment, RankClaim), StartError> {
    let mut waiter = Waiter::new(&options.name, options.attach_timeout);
    let name = &options.name;
    let segment = loop {
        match Segment::attach(name) {
            Ok(segment) => break segment,
            Err(error @ (AttachError::NotFound { .. } | AttachError::NotReady { .. })) => {
                if let Some(waited) = waiter.wait(&error)? {
                    return Err(StartError::AttachTimedOut {
                        name: name.clone(),
                        waited,
                        reason: error,
                    });
                }
            }
            Err(reason) => return Err(StartError::Attach { name: name.clone(), reason }),
        }
    };
    let rank = options.rank;
    let claim = loop {
        match segment.claim_rank(rank) {
            Ok(claim) => break claim,
            Err(error @ ClaimError::NotReclaimed { .. }) => {
                if !segment.creator_alive() {
                    return Err(StartError::SchedulerGone { pid: segment.creator().pid });
                }
                if let Some(waited) = waiter.wait(&error)? {
                    return Err(StartError::ClaimTimedOut {
                        name: name.clone(),
                        rank,
                        waited,
                        reason: error,
                    });
                }
            }
            Err(reason) => return Err(StartError::Claim { name: name.clone(), rank, reason }),
        }
    };
    Ok((segment, claim))
}

/// Paces the retries of [`attach_and_claim`] until its deadline.
struct Waiter<'a> {
    name: &'a SegmentName,
    started: Instant,
    timeout: Duration,
    logged: bool,
}

impl<'a> Waiter<'a> {
    fn new(name: &'a SegmentName, timeout: Duration) -> Self {
        Waiter { name, started: Instant::now(), timeout, logged: false }
    }

    /// Sleeps before the next attempt; `Some(waited)` once the time is up.
    fn wait(&mut self, reason: &dyn std::fmt::Display) -> Result<Option<Duration>, StartError> {
        let waited = self.started.elapsed();
        if waited >= self.timeout {
            return Ok(Some(waited));
        }
        if stop_requested() {
            return Err(StartError::Stopped);
        }
        if !self.logged {
            tracing::info!(segment = %self.name, "waiting to attach: {reason}");
            self.logged = true;
        }
        std::thread::sleep(RETRY_INTERVAL.min(self.timeout - waited));
        Ok(None)
    }
}

/// A rank's copy engine and the mappings it copies between; the engine drops first.
struct RankEngine {
    engine: Box<dyn CopyEngine>,
    backend: BackendChoice,
    /// The host tier (for the storage thread); empty without one.
    host_area: MappedArea,
    _arenas: Vec<Arena>,
}

impl RankEngine {
    /// Step 3 of [`run_worker`].
    fn build(
        segment: &Segment,
        claim: &RankClaim,
        options: &WorkerOptions,
    ) -> Result<RankEngine, StartError> {
        let name = &options.name;
        let config = segment.config();
        let segment_backend =
            config.backend().map_err(|reason| StartError::Config { name: name.clone(), reason })?;
        let segment_backend = BackendChoice::of_segment(segment_backend);
        let backend = options.backend.unwrap_or(segment_backend);
        if backend != segment_backend {
            return Err(StartError::BackendMismatch {
                name: name.clone(),
                segment: segment_backend.name(),
                requested: backend.name(),
            });
        }
        let geometry = Geometry::new(GeometryParams {
            layers: config.layers,
            regions: config.regions,
            region_bytes: config.region_bytes,
            device_blocks: config.device_blocks,
            host_blocks: config.host_blocks,
        })?;
        let rank = options.rank;
        let host_tier = open_host_tier(segment, &geometry, options)?;
        match backend {
            BackendChoice::Host => {
                let device = open_arena(segment, ArenaKind::Device, rank)?;
                // SAFETY: 1. the arena maps data_len() bytes at data_ptr(); 2. the arena is kept
                // in `_arenas`, which drops after the engine; 3. no data race on the block bytes:
                // the scheduler hands each block to one copy at a time and the engine keeps off
                // blocks being copied (block-ownership protocol of host_engine; trusted peers).
                let device_area = unsafe { MappedArea::new(device.data_ptr(), device.data_len()) }
                    .expect("a mapped arena has a non-null base");
                let host_area = tier_area(host_tier.as_ref());
                for (tier, area) in [("device", device_area), ("host", host_area)] {
                    prefault_tier(tier, area, claim)?;
                }
                let engine = HostCopyEngine::new(geometry, device_area, host_area)?
                    .with_rate_limit(options.serve.copy_rate_limit);
                let arenas = [Some(device), host_tier].into_iter().flatten().collect();
                Ok(RankEngine { engine: Box::new(engine), backend, host_area, _arenas: arenas })
            }
            BackendChoice::Cuda => {
                let engine = cuda_engine(segment, claim, options, geometry, host_tier.as_ref())?;
                let host_area = tier_area(host_tier.as_ref());
                Ok(RankEngine {
                    engine,
                    backend,
                    host_area,
                    _arenas: host_tier.into_iter().collect(),
                })
            }
        }
    }
}

/// Maps `area`'s pages in before the first copy ([`prefault`]); a kernel that refuses only costs
/// speed, and says so in the log.
fn prefault_tier(tier: &'static str, area: MappedArea, claim: &RankClaim) -> Result<(), ClaimLost> {
    let started = Instant::now();
    match prefault::populate(area, || claim.heartbeat())? {
        Populated::All => tracing::info!(
            tier,
            bytes = area.len(),
            huge_page_bytes = huge_pages::mapped_huge_bytes(area.as_ptr()).unwrap_or(0),
            took = ?started.elapsed(),
            "tier mapped in before the first copy: huge_page_bytes of it in huge pages, the rest \
             in 4 KiB pages"
        ),
        Populated::Partly { bytes, errno } => tracing::warn!(
            tier,
            bytes,
            of = area.len(),
            error = %std::io::Error::from_raw_os_error(errno),
            "the kernel would not map the tier in ahead of time; the first copies will be slower"
        ),
    }
    Ok(())
}

/// The host tier as a [`MappedArea`]; an empty, never dereferenced area without a host tier.
fn tier_area(host_tier: Option<&Arena>) -> MappedArea {
    match host_tier {
        // SAFETY: as for the device arena in RankEngine::build: the arena maps data_len() bytes
        // at data_ptr() and outlives the engine in `_arenas`.
        Some(arena) => unsafe { MappedArea::new(arena.data_ptr(), arena.data_len()) }
            .expect("a mapped arena has a non-null base"),
        None => {
            // A page-aligned, zero-length area: no byte of it is ever accessed (validation refuses
            // every host id when the tier has no blocks), and the CUDA engine wants alignment.
            let base = NonNull::<u8>::dangling().as_ptr().wrapping_add(page_size() - 1);
            // SAFETY: zero bytes at `base` are trivially mapped; nothing is ever read or written.
            unsafe { MappedArea::new(base, 0) }.expect("the page-size address is not null")
        }
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096).max(1)
}

#[cfg(not(feature = "cuda"))]
fn cuda_engine(
    _segment: &Segment,
    _claim: &RankClaim,
    _options: &WorkerOptions,
    _geometry: Geometry,
    _host_tier: Option<&Arena>,
) -> Result<Box<dyn CopyEngine>, StartError> {
    Err(StartError::CudaNotBuilt)
}

#[cfg(feature = "cuda")]
fn cuda_engine(
    segment: &Segment,
    claim: &RankClaim,
    options: &WorkerOptions,
    geometry: Geometry,
    host_tier: Option<&Arena>,
) -> Result<Box<dyn CopyEngine>, StartError> {
    use super::cuda::{CudaCopyEngine, CudaEngineConfig, IpcRegion};

    let rank = options.rank;
    let handles = wait_for_device_handles(segment, claim, rank, options.handles_timeout)?;
    let stride = handles.first().map_or(0, |handle| handle.block_stride);
    if let Some(other) = handles.iter().find(|handle| handle.block_stride != stride) {
        return Err(StartError::DeviceHandles {
            rank,
            detail: format!(
                "regions have different block strides ({stride} and {})",
                other.block_stride
            ),
        });
    }
    let config = CudaEngineConfig {
        device_ordinal: options.device.unwrap_or(rank),
        regions: handles
            .iter()
            .map(|handle| IpcRegion {
                handle: handle.ipc_handle,
                offset: handle.offset,
                len: handle.len,
            })
            .collect(),
        region_stride: stride,
        host_tier: tier_area(host_tier),
        copy_method: options.cuda_copy,
    };
    // Opening the handles and registering a large host tier can take longer than the heartbeat
    // timeout.
    let engine = while_heartbeating(claim, || CudaCopyEngine::new(geometry, &config))?
        .map_err(|error| StartError::CudaEngine(error.to_string()))?;
    Ok(Box::new(engine))
}

/// Runs `work` while a helper thread heartbeats `claim` every [`HEARTBEAT_INTERVAL`], so that a
/// long, blocking set-up step does not get the worker declared dead.
#[cfg(feature = "cuda")]
fn while_heartbeating<T>(claim: &RankClaim, work: impl FnOnce() -> T) -> Result<T, ClaimLost> {
    use kvshm_ipc::worker_slot::HEARTBEAT_INTERVAL;

    let done = AtomicBool::new(false);
    let result = std::thread::scope(|scope| {
        let beater = scope.spawn(|| {
            // Relaxed: the flag only ends the loop; join() orders everything else.
            while !done.load(Ordering::Relaxed) {
                claim.heartbeat()?;
                std::thread::sleep(HEARTBEAT_INTERVAL);
            }
            Ok(())
        });
        let result = work();
        done.store(true, Ordering::Relaxed);
        let beaten = beater.join().expect("the heartbeat thread does not panic");
        beaten.map(|()| result)
    });
    claim.heartbeat()?;
    result
}

/// Polls the rank's device-handle table until the engine published it, heartbeating meanwhile.
#[cfg(feature = "cuda")]
fn wait_for_device_handles(
    segment: &Segment,
    claim: &RankClaim,
    rank: u32,
    timeout: Duration,
) -> Result<Vec<kvshm_ipc::device_handles::DeviceRegionHandle>, StartError> {
    use kvshm_ipc::device_handles::DeviceHandleError;

    let started = Instant::now();
    let mut logged = false;
    loop {
        match segment.device_handles(rank) {
            Ok(Some(handles)) => return Ok(handles),
            Ok(None) | Err(DeviceHandleError::Busy) => {}
            Err(error) => {
                return Err(StartError::DeviceHandles { rank, detail: error.to_string() })
            }
        }
        if started.elapsed() >= timeout {
            return Err(StartError::NoDeviceHandles { rank, waited: started.elapsed() });
        }
        if !logged {
            tracing::info!(rank, "waiting for the engine to publish its device handles");
            logged = true;
        }
        claim.heartbeat()?;
        if !segment.creator_alive() {
            return Err(StartError::SchedulerGone { pid: segment.creator().pid });
        }
        if stop_requested() {
            return Err(StartError::Stopped);
        }
        std::thread::sleep(RETRY_INTERVAL);
    }
}
