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
//!
//! Files: this one holds [`Segment`] itself (create, attach, whole-segment accessors, drop);
//! `ranks` the per-rank areas and the worker's [`RankClaim`]; `bell` the [`CompletionBell`] a
//! scheduler thread waits on without the ring ends; `create` reading, validating and creating
//! control objects; `errors` the error enums.

use std::ops::{Deref, DerefMut};
use std::ptr::addr_of;
use std::sync::Arc;

use crate::arena::{Arena, ArenaError, ArenaKind};
use crate::config::{SegmentConfig, MAX_RANKS};
use crate::control::{Control, ControlArea, SNAPSHOT_WORDS};
use crate::counters::Counters;
use crate::inspect::ObjectIdentity;
use crate::layout::{
    Header, HeaderFields, RecordSizes, SegmentLayout, CLOSED, LAYOUT_VERSION, MAGIC, READY,
};
use crate::liveness::{LivenessCache, ProcessIdentity};
use crate::name::SegmentName;
use crate::record::{CommandSlot, Completion};
use crate::ring;
use crate::shm::SharedArea;
use crate::shm::SharedMemory;
use crate::sync::{AtomicU32, AtomicU64, Ordering};
use create::{create_arenas, header_fields_ptr, header_ready, CREATOR_OFFSET};

pub use crate::listing::{list, unlink, DataObject, ListingState, SegmentListing};

/// The generation a new segment starts in (0 never names a live generation).
pub const FIRST_GENERATION: u64 = 1;

// Handles are shared between threads (scheduler poll thread, worker heartbeat thread).
const _: fn() = || {
    fn shareable<T: Send + Sync>() {}
    shareable::<Segment>();
    shareable::<RankClaim>();
    shareable::<CompletionBell>();
};

mod bell;
mod create;
mod errors;
mod ranks;

pub use bell::CompletionBell;
pub(crate) use create::{create_control_object, read_creator, validate_header};
pub use errors::{AttachError, CorruptReason, CreateError, SegmentError};
pub use ranks::RankClaim;

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
    /// Objects this handle created, with the identity of the file it made (in our own memory,
    /// where no peer can scribble), unlinked on drop when `unlink_on_drop`.
    created: Vec<(String, ObjectIdentity)>,
    unlink_on_drop: bool,
    /// On drop, leave the host tier arenas in place (see `keep_host_tier_on_drop`).
    keep_host_on_drop: bool,
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
        Segment::create_with(name, config, false).map(|(segment, _)| segment)
    }

    /// [`create`](Self::create), taking over the host tier arenas a gone creator of `name` left
    /// (a stale segment's, or orphans after [`keep_host_tier_on_drop`](Self::keep_host_tier_on_drop))
    /// with their bytes, where they have this configuration's blocks; returns, per rank, whether
    /// its host tier was kept. What the bytes mean is for the caller to know.
    pub fn create_keeping_host_tier(
        name: &SegmentName,
        config: &SegmentConfig,
    ) -> Result<(Segment, Vec<bool>), CreateError> {
        Segment::create_with(name, config, true)
    }

    fn create_with(
        name: &SegmentName,
        config: &SegmentConfig,
        keep_host: bool,
    ) -> Result<(Segment, Vec<bool>), CreateError> {
        let layout = SegmentLayout::compute(config)?;
        let object = name.control_object();
        let creator = ProcessIdentity::current();
        let memory = create_control_object(name, &object, layout.total_size)?;
        let identity = memory.identity().inspect_err(|_| {
            let _ = crate::inspect::unlink_owned(&object);
        })?;
        // SAFETY: 1. the mapping is layout.total_size bytes (more than a Header) and page-aligned,
        // so the 8-aligned identity at CREATOR_OFFSET is in bounds; 2. a volatile store of a Pod:
        // the object was just created with O_EXCL, so the only other accesses can be other
        // processes' volatile copies (kvctl, a racing creator judging it), which read the bytes
        // before or after, never anything this process relies on.
        unsafe {
            header_fields_ptr(&memory)
                .cast::<u8>()
                .add(CREATOR_OFFSET)
                .cast::<ProcessIdentity>()
                .write_volatile(creator)
        };

        let mut created = vec![(object.clone(), identity)];
        let kept = match create_arenas(name, config, &mut created, keep_host) {
            Ok(kept) => kept,
            Err(error) => {
                for (object, identity) in created.iter().rev() {
                    let _ = crate::inspect::unlink_if_identical(object, *identity);
                }
                return Err(error);
            }
        };

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
        // SAFETY: as above; HeaderFields is the first member of Header, at offset 0. Readers trust
        // it only after the Release store of READY below.
        unsafe { header_fields_ptr(&memory).write_volatile(fields) };
        let segment = Segment {
            memory: Arc::new(memory),
            name: name.clone(),
            fields,
            layout,
            created,
            unlink_on_drop: true,
            keep_host_on_drop: false,
            creator_liveness: LivenessCache::default(),
            worker_liveness: Default::default(),
        };
        segment.initialise_areas();
        // SYNC: pairs with the Acquire load of ready in validate_header(): an attacher that sees
        // READY sees every header field and initialised area above.
        segment.ready_word().store(READY, Ordering::Release);
        Ok((segment, kept))
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
                    keep_host_on_drop: false,
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

    /// Removes the segment on drop but keeps its host tier arenas, for the next creator of the
    /// name to take over ([`create_keeping_host_tier`](Self::create_keeping_host_tier)); until
    /// then `kvctl ls` lists them as orphaned and `kvctl cleanup` removes them.
    pub fn keep_host_tier_on_drop(&mut self) {
        self.keep_host_on_drop = true;
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
        // Relaxed: the flag alone is the message; nothing is read behind it.
        self.ready_word().load(Ordering::Relaxed) == CLOSED
    }

    /// The current generation; commands of other generations are refused by workers.
    pub fn generation(&self) -> u64 {
        // Relaxed: a value read on its own; a command that carries a new generation reaches a
        // worker through the ring's Release/Acquire, which orders the bump before it.
        self.generation_word().load(Ordering::Relaxed)
    }

    /// Scheduler: starts a new generation (on reset) and returns it.
    pub fn bump_generation(&self) -> u64 {
        // Wrapping: the word lies in shared memory, and a scribbled maximum must not panic here.
        // Relaxed: publishes nothing but itself (see generation()).
        self.generation_word().fetch_add(1, Ordering::Relaxed).wrapping_add(1)
    }

    pub fn counters(&self) -> &Counters {
        // SAFETY: the layout puts the Counters at this offset.
        unsafe { self.area::<Counters>(self.layout.offsets.counters as usize) }
    }

    /// The kvctl request area (reset, tree snapshot).
    pub fn control(&self) -> Control<'_> {
        // SAFETY: the layout puts the ControlArea and the SNAPSHOT_WORDS words of the snapshot
        // area at these offsets.
        unsafe {
            let area = self.area::<ControlArea>(self.layout.offsets.control as usize);
            let words =
                self.areas::<AtomicU64>(self.layout.offsets.snapshot as usize, SNAPSHOT_WORDS);
            Control::new(area, words)
        }
    }

    /// Opens the `kind` arena of `rank` (host backend device tier, or the host tier).
    pub fn open_arena(&self, kind: ArenaKind, rank: u32) -> Result<Arena, ArenaError> {
        Arena::open(&self.name, kind, rank)
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

    /// The header's `ready` word.
    fn ready_word(&self) -> &AtomicU32 {
        header_ready(&self.memory)
    }

    /// The header's `generation` word.
    fn generation_word(&self) -> &AtomicU64 {
        let header = self.memory.as_ptr().cast::<Header>();
        // SAFETY: 1. the mapping is page-aligned and longer than a Header (validated at attach,
        // sized at creation); 2. the reference covers the generation atomic alone (a raw
        // projection, never a reference to the Header, whose plain fields another process may
        // write), so every access through it is atomic and any bits are a valid u64.
        unsafe { &*addr_of!((*header).generation) }
    }

    /// # Panics
    /// If `offset` lies beyond the mapping: offsets come from the validated layout, so that is a
    /// programming error.
    fn ptr(&self, offset: usize) -> *mut u8 {
        assert!(
            offset <= self.memory.len(),
            "an offset outside the segment is a programming error"
        );
        // SAFETY: offset is within the mapping, or one past its end (checked above); forming the
        // pointer accesses nothing.
        unsafe { self.memory.as_ptr().add(offset) }
    }

    /// The `T` at `offset` of the mapping.
    ///
    /// # Safety
    /// `offset` must be the start of a `T` in the layout (so aligned for `T`).
    ///
    /// # Panics
    /// If the area lies beyond the mapping: offsets come from the validated layout, so that is a
    /// programming error.
    unsafe fn area<T: SharedArea>(&self, offset: usize) -> &T {
        // SAFETY: one T at the caller's offset (this function's premise).
        unsafe { &self.areas::<T>(offset, 1)[0] }
    }

    /// The `count` consecutive `T`s at `offset` of the mapping.
    ///
    /// # Safety
    /// `offset` must be the start of `count` consecutive `T`s in the layout (so aligned for `T`).
    ///
    /// # Panics
    /// As [`area`](Self::area).
    unsafe fn areas<T: SharedArea>(&self, offset: usize, count: usize) -> &[T] {
        let end = count.checked_mul(size_of::<T>()).and_then(|len| offset.checked_add(len));
        assert!(
            end.is_some_and(|end| end <= self.memory.len()),
            "an area outside the segment is a programming error"
        );
        // SAFETY: 1. in bounds (checked above) of the mapping, which lives as long as `self`;
        // 2. aligned (the caller's premise); 3. T is a SharedArea: atomics only, every bit pattern
        // valid, so the shared reference stays sound while other processes write the bytes, and
        // all accesses through it are atomic (no data race).
        unsafe { std::slice::from_raw_parts(self.ptr(offset).cast::<T>(), count) }
    }

    fn initialise_areas(&self) {
        // Relaxed: published with everything else by the Release store of READY.
        self.generation_word().store(FIRST_GENERATION, Ordering::Relaxed);
        self.counters().clear();
        for rank in 0..self.fields.config.tp_size {
            self.worker_slot(rank).expect("rank < tp_size").clear();
            let (command, completion) = self.ring_bases(rank);
            // SAFETY: 1. each ring area is memory_size(capacity) bytes inside the mapping, 64-aligned
            // (layout); 2. capacities are powers of two (config validated); 3. no ring end is
            // attached: attachers refuse the segment before READY.
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
            // Relaxed: the flag alone is the message (attached workers see the scheduler go
            // without waiting to find its process dead); nothing is published behind it.
            self.ready_word().store(CLOSED, Ordering::Relaxed);
            for rank in 0..self.fields.config.tp_size {
                if let Ok(doorbell) = self.command_doorbell(rank) {
                    doorbell.ring();
                }
            }
        }
        let host_tiers: Vec<String> = if self.keep_host_on_drop {
            (0..self.fields.config.tp_size).map(|rank| self.name.host_tier_object(rank)).collect()
        } else {
            Vec::new()
        };
        for (object, identity) in self.created.iter().rev() {
            if host_tiers.contains(object) {
                continue;
            }
            // Only unlink the very files we made: someone may have cleaned up and recreated the
            // name. Judged by the identity we remember, not by the (writable) creator word.
            let _ = crate::inspect::unlink_if_identical(object, *identity);
        }
    }
}
