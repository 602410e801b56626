//! One rank's areas of a segment, and the worker's claim on a rank.
//!
//! A worker attaches, [`Segment::claim_rank`]s its rank (a CAS from EMPTY to ATTACHED with its
//! identity), heartbeats through the [`RankClaim`] and takes the consumer end of the command ring
//! and the producer end of the completion ring. The scheduler takes the other ends, judges the
//! worker with [`Segment::rank_status`] and, once it is gone, resets the rings with
//! [`Segment::reclaim_rank`] so that the next worker starts from empty rings.

use std::sync::Arc;

use super::{Mapped, Segment, SegmentError};
use crate::device_handles::{
    DeviceHandleArea, DeviceHandleError, DeviceHandles, DeviceRegionHandle, HANDLE_WORDS,
};
use crate::doorbell::Doorbell;
use crate::liveness::{monotonic_ns, ProcessIdentity};
use crate::process_handle::ObjectId;
use crate::progress::{LayerProgress, ProgressEntry};
use crate::record::{CommandSlot, Completion};
use crate::ring::{self, Consumer, Producer, RingError};
use crate::shm::SharedMemory;
use crate::sync::AtomicU64;
use crate::worker_slot::{
    ClaimError, ClaimLost, HeartbeatLimits, OwnerWord, RankStatus, ReclaimError, SlotVerdict,
    WorkerSlot,
};
use crate::worker_watch::{SystemProbe, WatchTiming, WorkerWatch};

impl Segment {
    /// The worker slot of `rank`.
    pub fn worker_slot(&self, rank: u32) -> Result<&WorkerSlot, SegmentError> {
        self.check_rank(rank)?;
        let offset =
            self.layout.offsets.worker_slots as usize + rank as usize * size_of::<WorkerSlot>();
        // SAFETY: rank < tp_size, and the layout puts tp_size slots at this offset.
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
    /// every [`LIVENESS_RECHECK`](crate::liveness::LIVENESS_RECHECK)) and its heartbeat is within
    /// [`HeartbeatLimits::DEFAULT`]. Cheap enough to call on every poll.
    pub fn rank_status(&self, rank: u32) -> Result<RankStatus, SegmentError> {
        self.rank_status_with_limits(rank, HeartbeatLimits::DEFAULT)
    }

    /// As [`rank_status`](Self::rank_status) with other heartbeat limits.
    pub fn rank_status_with_limits(
        &self,
        rank: u32,
        limits: HeartbeatLimits,
    ) -> Result<RankStatus, SegmentError> {
        Ok(self.rank_verdict_with_limits(rank, limits)?.status)
    }

    /// As [`rank_status`](Self::rank_status), with the owner word judged (to reclaim from).
    pub fn rank_verdict(&self, rank: u32) -> Result<SlotVerdict, SegmentError> {
        self.rank_verdict_with_limits(rank, HeartbeatLimits::DEFAULT)
    }

    fn rank_verdict_with_limits(
        &self,
        rank: u32,
        limits: HeartbeatLimits,
    ) -> Result<SlotVerdict, SegmentError> {
        let slot = self.worker_slot(rank)?;
        let cache = &self.worker_liveness[rank as usize];
        Ok(slot.verdict(monotonic_ns(), limits, |worker| cache.is_alive(worker)))
    }

    /// Scheduler: makes `rank` claimable again, taking its slot from exactly the owner word
    /// `judged`; fails with [`ReclaimError::Changed`] if the slot holds another word now.
    ///
    /// Marks the slot DEAD (no worker can claim it meanwhile), resets both rings (indices and
    /// description, `ring::reset`), the progress table and the worker doorbell's sleeper count,
    /// and makes the slot EMPTY.
    ///
    /// The premise is the caller's: no worker can touch the rank's rings any more (the one that
    /// held `judged` is gone, as a [`crate::worker_watch::WorkerWatch`] verdict
    /// establishes, or `judged` names no worker). Call it before failing the rank's in-flight
    /// commands, and re-attach the scheduler's own ring ends afterwards: ones taken before cache
    /// indices that no longer hold.
    pub fn reclaim_rank(&self, rank: u32, judged: OwnerWord) -> Result<(), ReclaimError> {
        let slot = self.worker_slot(rank).map_err(|_| ReclaimError::RankOutOfRange {
            rank,
            tp_size: self.fields.config.tp_size,
        })?;
        let reclaim = slot.begin_reclaim(judged)?;
        let (command, completion) = self.ring_bases(rank);
        let config = &self.fields.config;
        // SAFETY: 1. both ring areas lie in the mapping and were initialised by the creator;
        // 2. no worker touches the rings (the premise above, and the slot is DEAD, so no new
        // worker can claim the rank until the reclaim finishes); 3. the reset is atomic stores
        // of the header, description included, so even a process breaking that premise races
        // nothing in this one: what it could do is write records and indices that the ring ends
        // validate.
        unsafe {
            ring::reset::<CommandSlot>(command, config.command_ring_slots as usize);
            ring::reset::<Completion>(completion, config.completion_ring_slots as usize);
        }
        self.layer_progress(rank).expect("rank was checked above").clear();
        // A worker killed while asleep on its doorbell never deregistered; none can be registered
        // now (the premise above), so the count restarts from zero.
        self.command_doorbell(rank).expect("rank was checked above").forget_sleepers();
        reclaim.finish()
    }

    /// Scheduler: the producer end of `rank`'s command ring.
    pub fn command_producer(
        &self,
        rank: u32,
    ) -> Result<Mapped<Producer<CommandSlot>>, SegmentError> {
        self.check_rank(rank)?;
        let (base, len) = (self.ring_bases(rank).0, self.layout.offsets.command_ring_len as usize);
        // SAFETY: 1. the ring lies in the mapping, which the returned Mapped keeps alive; 2. the
        // other end belongs to the peer process, and a second end of the same side is the
        // trusted peer's breach (one scheduler, one worker per rank, by protocol).
        let producer = unsafe { Producer::attach(base, len) };
        let producer = holding(producer, Producer::capacity, self.fields.config.command_ring_slots);
        self.mapped(producer.map_err(|source| SegmentError::Ring {
            ring: "command",
            rank,
            source,
        })?)
    }

    /// Scheduler: a watch over one rank's worker ([`WorkerWatch`]), which recognises workers by
    /// this segment's control object in their mappings.
    pub fn worker_watch(&self) -> Result<WorkerWatch, SegmentError> {
        let object = self.memory.identity().map_err(SegmentError::Shm)?;
        let object = ObjectId { dev: object.device, ino: object.inode };
        Ok(WorkerWatch::new(SystemProbe::new(object), WatchTiming::default()))
    }

    /// Worker: the consumer end of `rank`'s command ring.
    pub fn command_consumer(
        &self,
        rank: u32,
    ) -> Result<Mapped<Consumer<CommandSlot>>, SegmentError> {
        self.check_rank(rank)?;
        let (base, len) = (self.ring_bases(rank).0, self.layout.offsets.command_ring_len as usize);
        // SAFETY: 1. the ring lies in the mapping, which the returned Mapped keeps alive; 2. the
        // other end belongs to the peer process, and a second end of the same side is the
        // trusted peer's breach (one scheduler, one worker per rank, by protocol).
        let consumer = unsafe { Consumer::attach(base, len) };
        let consumer = holding(consumer, Consumer::capacity, self.fields.config.command_ring_slots);
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
        // SAFETY: 1. the ring lies in the mapping, which the returned Mapped keeps alive; 2. the
        // other end belongs to the peer process, and a second end of the same side is the
        // trusted peer's breach (one scheduler, one worker per rank, by protocol).
        let producer = unsafe { Producer::attach(base, len) };
        let slots = self.fields.config.completion_ring_slots;
        let producer = holding(producer, Producer::capacity, slots);
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
        // SAFETY: 1. the ring lies in the mapping, which the returned Mapped keeps alive; 2. the
        // other end belongs to the peer process, and a second end of the same side is the
        // trusted peer's breach (one scheduler, one worker per rank, by protocol).
        let consumer = unsafe { Consumer::attach(base, len) };
        let slots = self.fields.config.completion_ring_slots;
        let consumer = holding(consumer, Consumer::capacity, slots);
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
        // SAFETY: the layout puts the rank's command doorbell at this offset.
        Ok(unsafe { self.area::<Doorbell>(offset) })
    }

    /// The doorbell the scheduler sleeps on; any worker rings it after pushing completions.
    pub fn scheduler_doorbell(&self) -> &Doorbell {
        // SAFETY: the layout puts the scheduler doorbell at this offset.
        unsafe { self.area::<Doorbell>(self.layout.offsets.scheduler_doorbell as usize) }
    }

    /// `rank`'s layer-progress table (one entry per completion-ring slot).
    pub fn layer_progress(&self, rank: u32) -> Result<LayerProgress<'_>, SegmentError> {
        self.check_rank(rank)?;
        let offset = self.layout.rank_area(rank as usize) + self.layout.offsets.progress as usize;
        // SAFETY: the layout puts completion_ring_slots entries at this offset.
        let entries =
            unsafe { self.areas::<ProgressEntry>(offset, self.layout.completion_ring_slots) };
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

    fn device_handle_table(&self, rank: u32) -> Result<DeviceHandles<'_>, DeviceHandleError> {
        self.check_rank(rank).map_err(|_| DeviceHandleError::RankOutOfRange {
            rank,
            tp_size: self.fields.config.tp_size,
        })?;
        let offset =
            self.layout.rank_area(rank as usize) + self.layout.offsets.device_handles as usize;
        // SAFETY: the layout puts the area header at this offset and regions x HANDLE_WORDS
        // words right after it.
        unsafe {
            let area = self.area::<DeviceHandleArea>(offset);
            let words = self.areas::<AtomicU64>(
                offset + size_of::<DeviceHandleArea>(),
                self.layout.regions * HANDLE_WORDS,
            );
            Ok(DeviceHandles { area, words })
        }
    }

    pub(super) fn ring_bases(&self, rank: u32) -> (*mut u8, *mut u8) {
        let area = self.layout.rank_area(rank as usize);
        (
            self.ptr(area + self.layout.offsets.command_ring as usize),
            self.ptr(area + self.layout.offsets.completion_ring as usize),
        )
    }
}

/// `end`, if its ring holds the configured `slots` records ([`RingError::check_capacity`]).
fn holding<E>(
    end: Result<E, RingError>,
    capacity: fn(&E) -> usize,
    slots: u32,
) -> Result<E, RingError> {
    let end = end?;
    RingError::check_capacity(capacity(&end), u64::from(slots))?;
    Ok(end)
}

/// A worker's hold on a rank; drop it on clean exit (the slot becomes EMPTY).
///
/// Call [`heartbeat`](Self::heartbeat) every [`HEARTBEAT_INTERVAL`](crate::worker_slot::HEARTBEAT_INTERVAL),
/// also between the chunks of a long copy: a heartbeat older than [`HEARTBEAT_TIMEOUT`](crate::worker_slot::HEARTBEAT_TIMEOUT) makes the
/// scheduler declare the worker dead. Before dropping the claim, complete every command popped
/// from the ring: the scheduler may hand the rest of the ring to the next worker. A worker that
/// cannot (its command ring broke, it stops with answers unpushed) forgets the claim instead
/// (`std::mem::forget`), and a claim dropped while its thread unwinds from a panic is not released
/// either: the slot then names a process that exits, and the scheduler reclaims the rank and resets
/// its rings before another worker can claim it.
pub struct RankClaim {
    _memory: Arc<SharedMemory>,
    slot: *const WorkerSlot,
    owner_word: OwnerWord,
    rank: u32,
}

// SAFETY: the slot pointer targets the mapping kept alive by `_memory` and is only used through the
// slot's atomics (a SharedArea), which any thread may access.
unsafe impl Send for RankClaim {}
// SAFETY: as above; every method takes &self and uses atomics only.
unsafe impl Sync for RankClaim {}

impl RankClaim {
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The owner word this claim wrote.
    pub fn owner_word(&self) -> OwnerWord {
        self.owner_word
    }

    /// Tells the scheduler that this worker finished setting up and serves the rank's rings from
    /// now on; until then the rank gets no commands. `ClaimLost` as for a heartbeat.
    pub fn mark_serving(&self) -> Result<(), ClaimLost> {
        self.slot().mark_serving(self.owner_word)
    }

    /// Refreshes the heartbeat; `ClaimLost` means the scheduler declared this worker dead and
    /// reclaimed the rank, so the worker must stop using its rings.
    pub fn heartbeat(&self) -> Result<(), ClaimLost> {
        self.slot().heartbeat(self.owner_word)
    }

    fn slot(&self) -> &WorkerSlot {
        // SAFETY: the slot lies in the mapping that self._memory keeps alive, where
        // Segment::worker_slot() found it; a WorkerSlot is a SharedArea (atomics only), so the
        // reference stays sound while other processes write it.
        unsafe { &*self.slot }
    }
}

impl Drop for RankClaim {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // A panic may have left popped commands unanswered: a release would hand out-of-step
            // rings to the next worker as if this were a clean exit.
            return;
        }
        // False when the scheduler took the rank first: then there is nothing to give back.
        let _ = self.slot().release(self.owner_word);
    }
}
