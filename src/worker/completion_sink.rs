//! The producer end of a rank's completion ring, shared by the worker's two threads (the copy
//! loop and the storage thread).
//!
//! Core type: [`CompletionSink`]. The ring is single-producer; a mutex makes the two threads one
//! producer: each push happens under the lock, the lock orders the pushes (and the producer's
//! local tail) between the threads, and the ring's own Release store of the tail publishes every
//! record to the scheduler as before.
//!
//! Flow: 1. a thread calls [`CompletionSink::push_available`] with its pending completions;
//! 2. under the lock, as many as the ring has room for are pushed with one Release; 3. the caller
//! rings the scheduler doorbell, and waits for room before pushing the rest (the scheduler's
//! credits make that rare).

use std::sync::{Arc, Mutex, PoisonError};

use kvshm_ipc::record::Completion;
use kvshm_ipc::ring::Producer;
use kvshm_ipc::segment::Mapped;

/// A completion producer that both worker threads may push through (module documentation).
#[derive(Clone)]
pub struct CompletionSink {
    producer: Arc<Mutex<Mapped<Producer<Completion>>>>,
}

impl CompletionSink {
    pub fn new(producer: Mapped<Producer<Completion>>) -> CompletionSink {
        CompletionSink { producer: Arc::new(Mutex::new(producer)) }
    }

    /// Pushes the longest prefix of `records` the ring has room for, in one batch; returns its
    /// length.
    pub fn push_available(&self, records: &[Completion]) -> usize {
        // A panic elsewhere while holding the lock leaves the producer consistent (push_all is
        // all-or-nothing), so a poisoned lock is still usable.
        let mut producer = self.producer.lock().unwrap_or_else(PoisonError::into_inner);
        let room = producer.free_slots().min(records.len());
        if room > 0 {
            producer
                .push_all(&records[..room])
                .expect("pushing no more records than free_slots() under the lock cannot fail");
        }
        room
    }
}
