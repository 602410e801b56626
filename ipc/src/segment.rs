//! A mapped control segment: creating, attaching, and reaching every area inside it.
//!
//! [`Segment`] owns one mapping of `/kvshm.NAME` (shared through an `Arc` with the ring handles and
//! rank claims it gives out, so none of them can outlive the mapping) and a validated copy of the
//! header fields. Every offset it uses comes from [`SegmentLayout::compute`] over a validated
//! configuration and was checked against the header, so accessors never leave the mapping.
//!
//! Creation ([`Segment::create`]):
//! 1. validate the configuration and compute the layout;
//! 2. create the control object with `O_EXCL`; if it exists, judge it: a live creator is
//!    [`CreateError::InUse`], a dead one makes it stale: unlink it and its data objects, retry;
//! 3. write the creator identity first, then create the data arenas, the header fields, the rings;
//! 4. store [`READY`] with Release.
//!
//! Attaching ([`Segment::attach`]) validates in this order: size, version, ready (Acquire), magic,
//! record sizes, total size, configuration, offsets, creator liveness; each failure is its own
//! [`AttachError`] variant, and nothing read from the file is trusted before it is checked.
//!
//! [`list`] and [`unlink`] (from `listing`) find and remove segments by name.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

use crate::arena::{Arena, ArenaError, ArenaKind};
use crate::config::MAX_RANKS;
use crate::config::{Backend, ConfigError, SegmentConfig};
use crate::control::{Control, ControlArea, SNAPSHOT_WORDS};
use crate::counters::Counters;
use crate::device_handles::{
    DeviceHandleArea, DeviceHandleError, DeviceHandles, DeviceRegionHandle, HANDLE_WORDS,
};
use crate::doorbell::Doorbell;
use crate::layout::{
    Header, HeaderFields, RecordSizes, SegmentLayout, CLOSED, LAYOUT_VERSION, MAGIC, READY,
};
use crate::listing::{self, ExistingSegment};
use crate::liveness::{monotonic_ns, LivenessCache, ProcessIdentity};
use crate::name::SegmentName;
use crate::progress::{LayerProgress, ProgressEntry};
use crate::record::{CommandSlot, Completion};
use crate::ring::{self, Consumer, Producer, RingError};
use crate::shm::{SharedMemory, ShmError};
use crate::sync::{AtomicU64, Ordering};
use crate::worker_slot::{
    ClaimError, ClaimLost, RankStatus, ReclaimError, WorkerSlot, HEARTBEAT_TIMEOUT,
};

pub use crate::listing::{list, unlink, DataObject, ListingState, SegmentListing};

/// The generation a new segment starts in (0 never names a live generation).
pub const FIRST_GENERATION: u64 = 1;

// Handles are shared between threads (scheduler poll thread, worker heartbeat thread).
const _: fn() = || {
    fn shareable<T: Send + Sync>() {}
    shareable::<Segment>();
    shareable::<RankClaim>();
};

/// Why a segment could not be created.
#[derive(Debug, Error)]
pub enum CreateError {
    #[error("invalid segment configuration: {0}")]
    InvalidConfig(#[from] ConfigError),
    #[error("segment is in use: its creator pid {pid} is alive")]
    InUse { pid: u32 },
    #[error("segment object {object} is being created by another process right now")]
    BeingCreated { object: String },
    #[error("not enough space in /dev/shm for {requested} bytes of {object}")]
    NoSpace { object: String, requested: u64 },
    #[error(transparent)]
    Shm(ShmError),
    #[error(transparent)]
    Arena(ArenaError),
}

impl From<ShmError> for CreateError {
    fn from(error: ShmError) -> Self {
        match error {
            ShmError::NoSpace { object, requested } => CreateError::NoSpace { object, requested },
            error => CreateError::Shm(error),
        }
    }
}

impl From<ArenaError> for CreateError {
    fn from(error: ArenaError) -> Self {
        match error {
            ArenaError::Shm(error) => error.into(),
            error => CreateError::Arena(error),
        }
    }
}

/// What is wrong with the contents of a segment whose header otherwise matches.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CorruptReason {
    #[error("the stored configuration is invalid: {0}")]
    Config(ConfigError),
    #[error("area offset {area} is {found}, the configuration puts it at {expected}")]
    Offset { area: &'static str, found: u64, expected: u64 },
    #[error("total size is {found}, the configuration needs {expected}")]
    TotalSize { found: u64, expected: u64 },
}

/// Why a segment could not be attached. Each names one problem of what was found.
#[derive(Debug, Error)]
pub enum AttachError {
    #[error("segment object {object} does not exist")]
    NotFound { object: String },
    #[error("segment is owned by uid {owner}, we run as uid {expected}")]
    ForeignOwner { owner: u32, expected: u32 },
    #[error("segment is {len} bytes, expected at least {expected}")]
    Truncated { len: u64, expected: u64 },
    #[error("segment does not start with the kvshm magic")]
    BadMagic,
    #[error("segment has layout version {found}, this build reads version {expected}")]
    VersionMismatch { found: u32, expected: u32 },
    #[error("segment stores {record} as {found} bytes, this build uses {expected}")]
    RecordSizeMismatch { record: &'static str, found: u32, expected: u32 },
    #[error(
        "segment is not ready: its creator pid {pid} is still initialising it, or has closed it"
    )]
    NotReady { pid: u32 },
    #[error("segment is stale: its creator pid {pid} is dead")]
    CreatorDead { pid: u32 },
    #[error("segment is corrupt: {0}")]
    Corrupt(CorruptReason),
    #[error(transparent)]
    Shm(ShmError),
}

impl From<ShmError> for AttachError {
    fn from(error: ShmError) -> Self {
        match error {
            ShmError::NotFound { object } => AttachError::NotFound { object },
            ShmError::ForeignOwner { owner, expected } => {
                AttachError::ForeignOwner { owner, expected }
            }
            ShmError::Empty { .. } => {
                AttachError::Truncated { len: 0, expected: size_of::<Header>() as u64 }
            }
            error => AttachError::Shm(error),
        }
    }
}

/// Why a per-rank area cannot be reached.
#[derive(Debug, Error)]
pub enum SegmentError {
    #[error("rank {rank} is outside 0..{tp_size}")]
    RankOutOfRange { rank: u32, tp_size: u32 },
    #[error("{ring} ring of rank {rank}: {source}")]
    Ring {
        ring: &'static str,
        rank: u32,
        #[source]
        source: RingError,
    },
}

/// A value that points into a segment's mapping and keeps the mapping alive (ring ends).
pub struct Mapped<T> {
    value: T,
    _memory: Arc<SharedMemory>,
}

impl<T> Deref for Mapped<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T> DerefMut for Mapped<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.value
    }
}

/// A mapped, validated control segment.
pub struct Segment {
    memory: Arc<SharedMemory>,
    name: SegmentName,
    fields: HeaderFields,
    layout: SegmentLayout,
    /// Objects this handle created, unlinked on drop when `unlink_on_drop`.
    created: Vec<String>,
    unlink_on_drop: bool,
    /// Process-local: spares the /proc reads of frequent liveness checks.
    creator_liveness: LivenessCache,
    worker_liveness: [LivenessCache; MAX_RANKS as usize],
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("name", &self.name)
            .field("creator", &self.fields.creator)
            .field("config", &self.fields.config)
            .field("total_size", &self.layout.total_size)
            .finish()
    }
}

/// How many times create() retries after removing a stale segment before giving up.
const CREATE_ATTEMPTS: usize = 3;

impl Segment {
    /// Creates segment `name` with `config` (see the module documentation for the steps). The
    /// returned handle unlinks the segment and its data objects on drop unless
    /// [`keep_on_drop`](Self::keep_on_drop) is called.
    pub fn create(name: &SegmentName, config: &SegmentConfig) -> Result<Segment, CreateError> {
        let layout = SegmentLayout::compute(config)?;
        let object = name.control_object();
        let creator = ProcessIdentity::current();
        let memory = create_control_object(name, &object, layout.total_size)?;
        // SAFETY: the mapping is layout.total_size bytes (more than a Header), page-aligned, and
        // nobody can read it as ready yet.
        unsafe {
            header_fields_ptr(&memory)
                .cast::<u8>()
                .add(CREATOR_OFFSET)
                .cast::<ProcessIdentity>()
                .write_volatile(creator)
        };

        let mut created = vec![object.clone()];
        if let Err(error) = create_arenas(name, config, &mut created) {
            for object in created.iter().rev() {
                let _ = crate::shm::unlink(object);
            }
            return Err(error);
        }

        let fields = HeaderFields {
            magic: MAGIC,
            layout_version: LAYOUT_VERSION,
            reserved0: 0,
            record_sizes: RecordSizes::CURRENT,
            total_size: layout.total_size as u64,
            creator,
            config: *config,
            offsets: layout.offsets,
        };
        // SAFETY: as above; HeaderFields is the first member of Header at offset 0.
        unsafe { header_fields_ptr(&memory).write_volatile(fields) };
        let segment = Segment {
            memory: Arc::new(memory),
            name: name.clone(),
            fields,
            layout,
            created,
            unlink_on_drop: true,
            creator_liveness: LivenessCache::default(),
            worker_liveness: Default::default(),
        };
        segment.initialise_areas();
        // SYNC: pairs with the Acquire load of ready in validate_header(): an attacher that sees
        // READY sees every header field and initialised area above.
        segment.header().ready.store(READY, Ordering::Release);
        Ok(segment)
    }

    /// Attaches to an existing segment `name`, validating everything it reads.
    pub fn attach(name: &SegmentName) -> Result<Segment, AttachError> {
        let memory = SharedMemory::open(&name.control_object())?;
        let creator = read_creator(&memory);
        match validate_header(&memory) {
            Ok((fields, layout)) => {
                if !fields.creator.is_alive() {
                    return Err(AttachError::CreatorDead { pid: fields.creator.pid });
                }
                Ok(Segment {
                    memory: Arc::new(memory),
                    name: name.clone(),
                    fields,
                    layout,
                    created: Vec::new(),
                    unlink_on_drop: false,
                    creator_liveness: LivenessCache::default(),
                    worker_liveness: Default::default(),
                })
            }
            Err(AttachError::NotReady { .. }) => match creator {
                Some(creator) if !creator.is_alive() => {
                    Err(AttachError::CreatorDead { pid: creator.pid })
                }
                creator => Err(AttachError::NotReady { pid: creator.map_or(0, |c| c.pid) }),
            },
            Err(error) => Err(error),
        }
    }

    /// Keeps the segment and its data objects after this handle drops (e.g. `kvshm serve` that
    /// hands over to a successor). Only meaningful on the creator's handle.
    pub fn keep_on_drop(&mut self) {
        self.unlink_on_drop = false;
    }

    /// True for the handle returned by [`create`](Self::create).
    pub fn is_creator(&self) -> bool {
        !self.created.is_empty()
    }

    pub fn name(&self) -> &SegmentName {
        &self.name
    }

    pub fn config(&self) -> &SegmentConfig {
        &self.fields.config
    }

    pub fn layout(&self) -> &SegmentLayout {
        &self.layout
    }

    /// Bytes of the control object.
    pub fn size(&self) -> usize {
        self.layout.total_size
    }

    /// The process that created the segment (the scheduler).
    pub fn creator(&self) -> ProcessIdentity {
        self.fields.creator
    }

    /// Whether the creator still runs and has not closed the segment; a worker that sees `false`
    /// exits. Cheap enough for every loop iteration: `/proc` is read at most every
    /// [`LIVENESS_RECHECK`](crate::liveness::LIVENESS_RECHECK).
    pub fn creator_alive(&self) -> bool {
        !self.is_closed() && self.creator_liveness.is_alive(self.fields.creator)
    }

    /// Whether the creator shut the segment down (its handle dropped), even if its process lives on.
    pub fn is_closed(&self) -> bool {
        // SYNC: pairs with the Release store of CLOSED in Drop: nothing is read after it, the flag
        // alone is the message.
        self.header().ready.load(Ordering::Acquire) == CLOSED
    }

    /// The current generation; commands of other generations are refused by workers.
    pub fn generation(&self) -> u64 {
        // SYNC: pairs with the AcqRel fetch_add in bump_generation().
        self.header().generation.load(Ordering::Acquire)
    }

    /// Scheduler: starts a new generation (on reset) and returns it.
    pub fn bump_generation(&self) -> u64 {
        // Wrapping: the word lies in shared memory, and a scribbled maximum must not panic here.
        // SYNC: pairs with the Acquire load in generation().
        self.header().generation.fetch_add(1, Ordering::AcqRel).wrapping_add(1)
    }

    pub fn counters(&self) -> &Counters {
        // SAFETY: the counters area lies inside the mapping at a 64-aligned offset (layout checked).
        unsafe { self.area::<Counters>(self.layout.offsets.counters as usize) }
    }

    /// The kvctl request area (reset, tree snapshot).
    pub fn control(&self) -> Control<'_> {
        // SAFETY: the control area and the SNAPSHOT_WORDS words of the snapshot area lie inside
        // the mapping at 64-aligned offsets (layout checked); atomics tolerate concurrent writers.
        unsafe {
            let area = self.area::<ControlArea>(self.layout.offsets.control as usize);
            let words = std::slice::from_raw_parts(
                self.ptr(self.layout.offsets.snapshot as usize).cast::<AtomicU64>(),
                SNAPSHOT_WORDS,
            );
            Control::new(area, words)
        }
    }

    /// The worker slot of `rank`.
    pub fn worker_slot(&self, rank: u32) -> Result<&WorkerSlot, SegmentError> {
        self.check_rank(rank)?;
        let offset =
            self.layout.offsets.worker_slots as usize + rank as usize * size_of::<WorkerSlot>();
        // SAFETY: rank < tp_size, and the layout holds tp_size slots at a 64-aligned offset.
        Ok(unsafe { self.area::<WorkerSlot>(offset) })
    }

    /// Worker: claims `rank` for the calling process.
    pub fn claim_rank(&self, rank: u32) -> Result<RankClaim, ClaimError> {
        let slot = self.worker_slot(rank).map_err(|_| ClaimError::RankOutOfRange {
            rank,
            tp_size: self.fields.config.tp_size,
        })?;
        let owner_word = slot.claim(ProcessIdentity::current())?;
        Ok(RankClaim {
            _memory: Arc::clone(&self.memory),
            slot: slot as *const WorkerSlot,
            owner_word,
            rank,
        })
    }

    /// Scheduler: whether `rank` has a live worker: its process exists (checked in `/proc` at most
    /// every [`LIVENESS_RECHECK`](crate::liveness::LIVENESS_RECHECK)) and its heartbeat is younger than [`HEARTBEAT_TIMEOUT`]. Cheap
    /// enough to call on every poll.
    pub fn rank_status(&self, rank: u32) -> Result<RankStatus, SegmentError> {
        self.rank_status_with_timeout(rank, HEARTBEAT_TIMEOUT)
    }

    /// As [`rank_status`](Self::rank_status) with another heartbeat timeout.
    pub fn rank_status_with_timeout(
        &self,
        rank: u32,
        timeout: Duration,
    ) -> Result<RankStatus, SegmentError> {
        let slot = self.worker_slot(rank)?;
        let cache = &self.worker_liveness[rank as usize];
        Ok(slot.status_with(monotonic_ns(), timeout, |worker| cache.is_alive(worker)))
    }

    /// Scheduler: makes a rank whose worker is dead or departed claimable again.
    ///
    /// Marks the slot DEAD (no worker can claim it meanwhile), resets the indices of both rings
    /// and the progress table, and stores EMPTY. Call it before failing the rank's in-flight
    /// commands (a refusal means the worker lives and may still run them), and re-attach the
    /// scheduler's own ring ends afterwards: ones taken before cache indices that no longer hold.
    /// A worker judged dead only by its heartbeat may still run: the caller kills it first (the
    /// service does), or it learns that it lost the rank from [`RankClaim::heartbeat`] and must
    /// stop touching the rings.
    pub fn reclaim_rank(&self, rank: u32) -> Result<(), ReclaimError> {
        let slot = self.worker_slot(rank).map_err(|_| ReclaimError::RankOutOfRange {
            rank,
            tp_size: self.fields.config.tp_size,
        })?;
        slot.begin_reclaim(monotonic_ns(), HEARTBEAT_TIMEOUT)?;
        let (command, completion) = self.ring_bases(rank);
        // SAFETY: 1. both ring areas lie in the mapping and were initialised by the creator;
        // 2. the slot is DEAD, so no new worker can claim the rank until finish_reclaim(). The
        // old worker is gone unless it was judged by its heartbeat alone (see above). If it
        // still touches the rings, nothing becomes unsound: the reset is atomic stores of the
        // indices, every access is masked into bounds, and what it writes are Pod records and
        // indices that the other side checks (a stale record is a stray completion, a bad index
        // a RingError::Corrupt).
        unsafe {
            ring::reset_indices(command);
            ring::reset_indices(completion);
        }
        self.layer_progress(rank).expect("rank was checked above").clear();
        slot.finish_reclaim();
        Ok(())
    }

    /// Scheduler: the producer end of `rank`'s command ring.
    pub fn command_producer(
        &self,
        rank: u32,
    ) -> Result<Mapped<Producer<CommandSlot>>, SegmentError> {
        self.check_rank(rank)?;
        let (base, len) = (self.ring_bases(rank).0, self.layout.offsets.command_ring_len as usize);
        // SAFETY: the ring lies in the mapping, which the returned Mapped keeps alive.
        let producer = unsafe { Producer::attach(base, len) };
        self.mapped(producer.map_err(|source| SegmentError::Ring {
            ring: "command",
            rank,
            source,
        })?)
    }

    /// Worker: the consumer end of `rank`'s command ring.
    pub fn command_consumer(
        &self,
        rank: u32,
    ) -> Result<Mapped<Consumer<CommandSlot>>, SegmentError> {
        self.check_rank(rank)?;
        let (base, len) = (self.ring_bases(rank).0, self.layout.offsets.command_ring_len as usize);
        // SAFETY: the ring lies in the mapping, which the returned Mapped keeps alive.
        let consumer = unsafe { Consumer::attach(base, len) };
        self.mapped(consumer.map_err(|source| SegmentError::Ring {
            ring: "command",
            rank,
            source,
        })?)
    }

    /// Worker: the producer end of `rank`'s completion ring.
    pub fn completion_producer(
        &self,
        rank: u32,
    ) -> Result<Mapped<Producer<Completion>>, SegmentError> {
        self.check_rank(rank)?;
        let (base, len) =
            (self.ring_bases(rank).1, self.layout.offsets.completion_ring_len as usize);
        // SAFETY: the ring lies in the mapping, which the returned Mapped keeps alive.
        let producer = unsafe { Producer::attach(base, len) };
        self.mapped(producer.map_err(|source| SegmentError::Ring {
            ring: "completion",
            rank,
            source,
        })?)
    }

    /// Scheduler: the consumer end of `rank`'s completion ring.
    pub fn completion_consumer(
        &self,
        rank: u32,
    ) -> Result<Mapped<Consumer<Completion>>, SegmentError> {
        self.check_rank(rank)?;
        let (base, len) =
            (self.ring_bases(rank).1, self.layout.offsets.completion_ring_len as usize);
        // SAFETY: the ring lies in the mapping, which the returned Mapped keeps alive.
        let consumer = unsafe { Consumer::attach(base, len) };
        self.mapped(consumer.map_err(|source| SegmentError::Ring {
            ring: "completion",
            rank,
            source,
        })?)
    }

    /// The doorbell `rank`'s worker sleeps on; the scheduler rings it after pushing commands.
    pub fn command_doorbell(&self, rank: u32) -> Result<&Doorbell, SegmentError> {
        self.check_rank(rank)?;
        let offset =
            self.layout.rank_area(rank as usize) + self.layout.offsets.command_doorbell as usize;
        // SAFETY: inside the rank's area at a 64-aligned offset; a zeroed Doorbell is valid.
        Ok(unsafe { self.area::<Doorbell>(offset) })
    }

    /// The doorbell the scheduler sleeps on; any worker rings it after pushing completions.
    pub fn scheduler_doorbell(&self) -> &Doorbell {
        // SAFETY: inside the mapping at a 64-aligned offset; a zeroed Doorbell is valid.
        unsafe { self.area::<Doorbell>(self.layout.offsets.scheduler_doorbell as usize) }
    }

    /// `rank`'s layer-progress table (one entry per completion-ring slot).
    pub fn layer_progress(&self, rank: u32) -> Result<LayerProgress<'_>, SegmentError> {
        self.check_rank(rank)?;
        let offset = self.layout.rank_area(rank as usize) + self.layout.offsets.progress as usize;
        // SAFETY: the table of completion_ring_slots entries lies inside the rank's area.
        let entries = unsafe {
            std::slice::from_raw_parts(
                self.ptr(offset).cast::<ProgressEntry>(),
                self.layout.completion_ring_slots,
            )
        };
        Ok(LayerProgress::new(entries))
    }

    /// Engine: publishes the CUDA device handles of `rank` (one per region).
    pub fn publish_device_handles(
        &self,
        rank: u32,
        handles: &[DeviceRegionHandle],
    ) -> Result<(), DeviceHandleError> {
        self.device_handle_table(rank)?.publish(handles)
    }

    /// Worker: the CUDA device handles of `rank`, or `None` until the engine published them.
    pub fn device_handles(
        &self,
        rank: u32,
    ) -> Result<Option<Vec<DeviceRegionHandle>>, DeviceHandleError> {
        self.device_handle_table(rank)?.read()
    }

    /// Opens the `kind` arena of `rank` (host backend device tier, or the host tier).
    pub fn open_arena(&self, kind: ArenaKind, rank: u32) -> Result<Arena, ArenaError> {
        Arena::open(&self.name, kind, rank)
    }

    fn device_handle_table(&self, rank: u32) -> Result<DeviceHandles<'_>, DeviceHandleError> {
        self.check_rank(rank).map_err(|_| DeviceHandleError::RankOutOfRange {
            rank,
            tp_size: self.fields.config.tp_size,
        })?;
        let offset =
            self.layout.rank_area(rank as usize) + self.layout.offsets.device_handles as usize;
        // SAFETY: the area header and regions x HANDLE_WORDS words follow each other inside the
        // rank's area at a 64-aligned offset.
        unsafe {
            let area = self.area::<DeviceHandleArea>(offset);
            let words = std::slice::from_raw_parts(
                self.ptr(offset + size_of::<DeviceHandleArea>()).cast::<AtomicU64>(),
                self.layout.regions * HANDLE_WORDS,
            );
            Ok(DeviceHandles { area, words })
        }
    }

    fn check_rank(&self, rank: u32) -> Result<(), SegmentError> {
        if rank < self.fields.config.tp_size {
            Ok(())
        } else {
            Err(SegmentError::RankOutOfRange { rank, tp_size: self.fields.config.tp_size })
        }
    }

    fn mapped<T>(&self, value: T) -> Result<Mapped<T>, SegmentError> {
        Ok(Mapped { value, _memory: Arc::clone(&self.memory) })
    }

    fn ring_bases(&self, rank: u32) -> (*mut u8, *mut u8) {
        let area = self.layout.rank_area(rank as usize);
        (
            self.ptr(area + self.layout.offsets.command_ring as usize),
            self.ptr(area + self.layout.offsets.completion_ring as usize),
        )
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping is longer than a Header and page-aligned; after creation only the
        // atomics of the header change.
        unsafe { &*self.memory.as_ptr().cast::<Header>() }
    }

    /// # Panics
    /// If `offset` lies beyond the mapping: offsets come from the validated layout, so that is a
    /// programming error.
    fn ptr(&self, offset: usize) -> *mut u8 {
        assert!(
            offset <= self.memory.len(),
            "an offset outside the segment is a programming error"
        );
        // SAFETY: offset is within the mapping (checked above).
        unsafe { self.memory.as_ptr().add(offset) }
    }

    /// # Safety
    /// `offset` must be the start of a `T` inside the mapping, aligned for `T`, whose every bit
    /// pattern is valid and which is only mutated through atomics.
    unsafe fn area<T>(&self, offset: usize) -> &T {
        assert!(
            offset + size_of::<T>() <= self.memory.len(),
            "an area outside the segment is a programming error"
        );
        // SAFETY: in bounds (checked above); alignment and validity are the caller's premise.
        unsafe { &*self.ptr(offset).cast::<T>() }
    }

    fn initialise_areas(&self) {
        self.header().generation.store(FIRST_GENERATION, Ordering::Relaxed);
        self.counters().clear();
        for rank in 0..self.fields.config.tp_size {
            self.worker_slot(rank).expect("rank < tp_size").clear();
            let (command, completion) = self.ring_bases(rank);
            // SAFETY: 1. each ring area is memory_size(capacity) bytes inside the mapping
            // (layout); 2. capacities are powers of two (config validated); 3. nobody else sees
            // the segment before ready.
            unsafe {
                ring::init::<CommandSlot>(command, self.fields.config.command_ring_slots as usize);
                ring::init::<Completion>(
                    completion,
                    self.fields.config.completion_ring_slots as usize,
                );
            }
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if !self.unlink_on_drop {
            return;
        }
        if self.memory.is_intact() {
            // SYNC: pairs with the Acquire load in is_closed(): attached workers see the
            // scheduler go without waiting to find its process dead.
            self.header().ready.store(CLOSED, Ordering::Release);
            for rank in 0..self.fields.config.tp_size {
                if let Ok(doorbell) = self.command_doorbell(rank) {
                    doorbell.ring();
                }
            }
        }
        for object in self.created.iter().rev() {
            // Only unlink what is still ours: someone may have cleaned up and recreated the name.
            if listing::object_creator(object) == Some(self.fields.creator) {
                let _ = crate::shm::unlink(object);
            }
        }
    }
}

/// A worker's hold on a rank; drop it on clean exit (the slot becomes EMPTY).
///
/// Call [`heartbeat`](Self::heartbeat) every [`HEARTBEAT_INTERVAL`](crate::worker_slot::HEARTBEAT_INTERVAL),
/// also between the chunks of a long copy: a heartbeat older than [`HEARTBEAT_TIMEOUT`] makes the
/// scheduler declare the worker dead. Before dropping the claim, complete every command popped
/// from the ring: the scheduler may hand the rest of the ring to the next worker.
pub struct RankClaim {
    _memory: Arc<SharedMemory>,
    slot: *const WorkerSlot,
    owner_word: u64,
    rank: u32,
}

// SAFETY: the slot pointer targets the mapping kept alive by `_memory` and is only used through the
// slot's atomics, which any thread may access.
unsafe impl Send for RankClaim {}
// SAFETY: as above; every method takes &self and uses atomics only.
unsafe impl Sync for RankClaim {}

impl RankClaim {
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Refreshes the heartbeat; `ClaimLost` means the scheduler declared this worker dead and
    /// reclaimed the rank, so the worker must stop using its rings.
    pub fn heartbeat(&self) -> Result<(), ClaimLost> {
        self.slot().heartbeat(self.owner_word)
    }

    fn slot(&self) -> &WorkerSlot {
        // SAFETY: the slot lies in the mapping that self._memory keeps alive.
        unsafe { &*self.slot }
    }
}

impl Drop for RankClaim {
    fn drop(&mut self) {
        self.slot().release(self.owner_word);
    }
}

/// Offset of the creator identity in the header (written first during creation).
const CREATOR_OFFSET: usize = std::mem::offset_of!(HeaderFields, creator);

fn header_fields_ptr(memory: &SharedMemory) -> *mut HeaderFields {
    memory.as_ptr().cast::<HeaderFields>()
}

/// The creator identity of a control object, if it is long enough and the identity was written.
pub(crate) fn read_creator(memory: &SharedMemory) -> Option<ProcessIdentity> {
    if memory.len() < CREATOR_OFFSET + size_of::<ProcessIdentity>() {
        return None;
    }
    // SAFETY: 1. in bounds (checked above); 2. the offset is 8-aligned in a page-aligned mapping;
    // 3. ProcessIdentity is Pod, so any bytes are a valid value.
    let creator =
        unsafe { memory.as_ptr().add(CREATOR_OFFSET).cast::<ProcessIdentity>().read_volatile() };
    (!creator.is_none()).then_some(creator)
}

/// Checks everything in a control object except the creator's liveness.
pub(crate) fn validate_header(
    memory: &SharedMemory,
) -> Result<(HeaderFields, SegmentLayout), AttachError> {
    let len = memory.len() as u64;
    let header_size = size_of::<Header>() as u64;
    if len < header_size {
        return Err(AttachError::Truncated { len, expected: header_size });
    }
    // SAFETY: the mapping holds a whole Header (checked above) and is page-aligned; the header's
    // atomics are only accessed atomically.
    let header = unsafe { &*memory.as_ptr().cast::<Header>() };
    // SAFETY: as above; HeaderFields is Pod, and a volatile copy tolerates concurrent writers.
    let early = unsafe { header_fields_ptr(memory).read_volatile() };
    if early.magic == MAGIC && early.layout_version != LAYOUT_VERSION {
        return Err(AttachError::VersionMismatch {
            found: early.layout_version,
            expected: LAYOUT_VERSION,
        });
    }
    // SYNC: pairs with the Release store of ready in Segment::create().
    if header.ready.load(Ordering::Acquire) != READY {
        return Err(AttachError::NotReady { pid: early.creator.pid });
    }
    // SAFETY: as above; read again after the Acquire so the copy is the published one.
    let fields = unsafe { header_fields_ptr(memory).read_volatile() };
    if fields.magic != MAGIC {
        return Err(AttachError::BadMagic);
    }
    if fields.layout_version != LAYOUT_VERSION {
        return Err(AttachError::VersionMismatch {
            found: fields.layout_version,
            expected: LAYOUT_VERSION,
        });
    }
    if let Some((record, found, expected)) =
        fields.record_sizes.first_mismatch(&RecordSizes::CURRENT)
    {
        return Err(AttachError::RecordSizeMismatch { record, found, expected });
    }
    if fields.total_size > len {
        return Err(AttachError::Truncated { len, expected: fields.total_size });
    }
    let layout = SegmentLayout::compute(&fields.config)
        .map_err(|error| AttachError::Corrupt(CorruptReason::Config(error)))?;
    if let Some((area, found, expected)) = layout.first_offset_mismatch(&fields.offsets) {
        return Err(AttachError::Corrupt(CorruptReason::Offset { area, found, expected }));
    }
    if fields.total_size != layout.total_size as u64 {
        return Err(AttachError::Corrupt(CorruptReason::TotalSize {
            found: fields.total_size,
            expected: layout.total_size as u64,
        }));
    }
    Ok((fields, layout))
}

/// Step 2 of creation: make the control object, taking over a stale one.
fn create_control_object(
    name: &SegmentName,
    object: &str,
    len: usize,
) -> Result<SharedMemory, CreateError> {
    for _ in 0..CREATE_ATTEMPTS {
        match SharedMemory::create(object, len) {
            Ok(memory) => return Ok(memory),
            Err(ShmError::AlreadyExists { .. }) => match listing::judge_existing(object)? {
                ExistingSegment::Live { pid } => return Err(CreateError::InUse { pid }),
                ExistingSegment::BeingCreated => {
                    return Err(CreateError::BeingCreated { object: object.to_owned() })
                }
                ExistingSegment::Stale => {
                    tracing::info!(segment = %name, "removing stale segment before creating it anew");
                    listing::unlink(name)?;
                }
                ExistingSegment::Gone => {}
            },
            Err(error) => return Err(error.into()),
        }
    }
    Err(CreateError::BeingCreated { object: object.to_owned() })
}

/// Step 3 of creation: the data arenas, after removing orphans of the name (we hold the control
/// object, so any data object of the name left over belongs to a dead creator).
fn create_arenas(
    name: &SegmentName,
    config: &SegmentConfig,
    created: &mut Vec<String>,
) -> Result<(), CreateError> {
    listing::unlink_data_objects(name)?;
    let block_bytes = config.block_bytes();
    for rank in 0..config.tp_size {
        if config.backend()? == Backend::HostArena {
            Arena::create(name, ArenaKind::Device, rank, config.device_blocks.into(), block_bytes)?;
            created.push(name.device_arena_object(rank));
        }
        if config.host_blocks > 0 {
            Arena::create(name, ArenaKind::Host, rank, config.host_blocks.into(), block_bytes)?;
            created.push(name.host_tier_object(rank));
        }
    }
    Ok(())
}
