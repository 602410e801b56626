//! [`CompletionBell`]: sleeping until a worker answers, without the scheduler's ring ends.
//!
//! The scheduler's completion consumers belong to whoever reaps them (a service behind a lock,
//! in a Python binding). A second thread that waits for answers must not hold them, nor the lock,
//! while it sleeps: the thread that owns them would be shut out for the whole wait. The bell is
//! what such a waiter holds instead: the scheduler doorbell and a read-only view of every
//! completion ring's tail, in an owned handle that keeps the mapping alive.
//!
//! One wait:
//! 1. [`CompletionBell::tails`]: note every completion ring's tail;
//! 2. with the ring ends (under the lock): reap everything published, check the condition;
//! 3. without them: [`CompletionBell::wait_for_answers`] sleeps on the doorbell until a tail
//!    differs from the one noted in 1, or the policy's deadline.
//!
//! Nothing is lost between 2 and 3: a completion published after 1 moves its ring's tail past
//! the value noted, so step 3 returns at once or is woken (the doorbell's own argument, with
//! "a tail differs" as its condition); a completion published before 1 was reaped in 2.

use std::ptr::NonNull;
use std::sync::Arc;

use super::{Segment, SegmentError};
use crate::doorbell::{Doorbell, WaitOutcome, WaitPolicy};
use crate::record::Completion;
use crate::ring::RingView;
use crate::shm::SharedMemory;
use crate::sync::Ordering;

/// The scheduler doorbell and the completion rings' tails, for a thread that waits for answers
/// without holding the ring ends (module documentation).
pub struct CompletionBell {
    _memory: Arc<SharedMemory>,
    doorbell: NonNull<Doorbell>,
    rings: Vec<RingView<Completion>>,
}

impl std::fmt::Debug for CompletionBell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionBell").field("rings", &self.rings.len()).finish()
    }
}

// SAFETY: the doorbell and the ring headers lie in the mapping that `_memory` keeps alive, and
// the bell only ever loads their atomics (a Doorbell and a RingHeader are atomics only, byte for
// byte), which any thread may do; it reads no slot and writes nothing but the doorbell's own
// sleeper registration, itself atomic.
unsafe impl Send for CompletionBell {}
// SAFETY: as above; every method takes &self and performs atomic accesses only.
unsafe impl Sync for CompletionBell {}

impl CompletionBell {
    /// Every completion ring's tail now, one per rank (step 1 of the module flow).
    pub fn tails(&self, out: &mut Vec<u64>) {
        out.clear();
        out.extend(self.rings.iter().map(tail_of));
    }

    /// Sleeps until some completion ring's tail differs from `seen` (as [`tails`](Self::tails)
    /// wrote it), or the policy's deadline passes (step 3 of the module flow).
    pub fn wait_for_answers(&self, seen: &[u64], policy: WaitPolicy) -> WaitOutcome {
        self.doorbell().wait_until(
            || self.rings.iter().zip(seen).any(|(ring, &seen)| tail_of(ring) != seen),
            policy,
        )
    }

    fn doorbell(&self) -> &Doorbell {
        // SAFETY: the doorbell lies in the mapping `_memory` keeps alive, where
        // Segment::scheduler_doorbell() found it; it is atomics only, so the shared reference
        // stays sound while other processes write it.
        unsafe { self.doorbell.as_ref() }
    }
}

fn tail_of(ring: &RingView<Completion>) -> u64 {
    // Relaxed: a wake-up hint, compared and never used to read a slot; the reaper reads the
    // records after its own Acquire load of the tail. Ordered against the worker's ring by the
    // doorbell's fences (fence W in wait_until, fence R in ring).
    ring.header().tail.value.load(Ordering::Relaxed)
}

impl Segment {
    /// Scheduler: a [`CompletionBell`] over every rank's completion ring; fails as attaching a
    /// ring end would, if a ring's description was written over (but for its capacity: the bell
    /// reads tails only, so a capacity rewritten under a serving worker does not stop waits).
    pub fn completion_bell(&self) -> Result<CompletionBell, SegmentError> {
        let len = self.layout.offsets.completion_ring_len as usize;
        let rings = (0..self.fields.config.tp_size)
            .map(|rank| {
                let base = self.ring_bases(rank).1;
                // SAFETY: 1. the ring lies in the mapping, which the bell keeps alive; 2. the
                // view is used only to load the tail (never a slot, never an index store), so it
                // is no third end of the ring.
                unsafe { RingView::<Completion>::attach(base, len) }
                    .map_err(|source| SegmentError::Ring { ring: "completion", rank, source })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(CompletionBell {
            _memory: Arc::clone(&self.memory),
            doorbell: NonNull::from(self.scheduler_doorbell()),
            rings,
        })
    }
}
