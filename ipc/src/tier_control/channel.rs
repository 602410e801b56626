//! A client's channel to the tier's owner: a ring of calls, a ring of answers, the client's
//! doorbell, its key page and its answer page (`record.rs` says what a batch puts where).
//!
//! [`ClientChannel`] is the client's end: [`ClientChannel::write_keys`], then
//! [`ClientChannel::send`] (the calls, one Release store of the ring's tail, and a ring of the
//! owner's doorbell), then [`ClientChannel::wait_answers`] and [`ClientChannel::read_entries`].
//! [`OwnerChannel`] is the owner's: [`OwnerChannel::take_requests`], [`OwnerChannel::read_keys`]
//! (bounds-checked against the page), [`OwnerChannel::write_entries`], [`OwnerChannel::answer`].
//!
//! The pages carry no synchronisation of their own: the key page is written before the calls
//! are pushed and read after they are popped (the request ring's Release and Acquire order it),
//! the answer page likewise through the answer ring. Both sides copy through `shared_bytes`, so
//! a peer that breaks the protocol makes the copy wrong, never racy, and everything the owner
//! reads is checked ([`RecordError`]).

use std::sync::Arc;
use std::time::Instant;

use super::record::{RecordError, TierAnswer, TierRequest, WireKey};
use crate::doorbell::{Doorbell, WaitOutcome, WaitPolicy};
use crate::ring::{Consumer, Producer, RingError, RingFull};
use crate::shared_bytes::{copy_from_shared, copy_to_shared};
use crate::shm::SharedMemory;

/// Where one channel's parts lie in the mapping, with the page sizes.
pub(super) struct ChannelParts {
    /// Keeps the mapping alive for the pointers below.
    pub(super) _memory: Arc<SharedMemory>,
    pub(super) answer_bell: *const Doorbell,
    pub(super) owner_bell: *const Doorbell,
    pub(super) key_page: *mut u8,
    pub(super) answer_page: *mut u8,
    pub(super) page_keys: u32,
}

impl ChannelParts {
    fn answer_bell(&self) -> &Doorbell {
        // SAFETY: a Doorbell the layout puts in the mapping `memory` keeps alive; atomics only.
        unsafe { &*self.answer_bell }
    }

    fn owner_bell(&self) -> &Doorbell {
        // SAFETY: as for answer_bell.
        unsafe { &*self.owner_bell }
    }

    fn answer_entries(&self) -> u32 {
        self.page_keys * 2
    }

    fn check_entries(&self, first: u32, count: u32) -> Result<usize, RecordError> {
        let page = self.answer_entries();
        let out = RecordError::EntriesOutOfPage { first, count, page };
        match first.checked_add(count) {
            Some(end) if end <= page => Ok(first as usize * size_of::<u32>()),
            _ => Err(out),
        }
    }
}

// SAFETY: the raw pointers point into the mapping `memory` keeps alive, and every access
// through them is atomic (doorbells) or goes through shared_bytes (pages).
unsafe impl Send for ChannelParts {}

/// The client's end of its channel (module flow).
pub struct ClientChannel {
    pub(super) requests: Producer<TierRequest>,
    pub(super) answers: Consumer<TierAnswer>,
    /// Last: dropped after the ring ends that point into its mapping.
    pub(super) parts: ChannelParts,
}

impl ClientChannel {
    /// Keys a batch may carry.
    pub fn page_keys(&self) -> u32 {
        self.parts.page_keys
    }

    /// Calls a batch may carry, its end included.
    pub fn batch_capacity(&self) -> usize {
        self.requests.capacity()
    }

    /// Writes `keys` into the key page from entry `first`.
    pub fn write_keys(&mut self, first: u32, keys: &[WireKey]) -> Result<(), RecordError> {
        let out = RecordError::KeysOutOfPage {
            first,
            count: keys.len() as u32,
            page: self.parts.page_keys,
        };
        let end = (first as usize).checked_add(keys.len()).ok_or(out)?;
        if end > self.parts.page_keys as usize {
            return Err(out);
        }
        // SAFETY: entries first..end lie in the key page (checked above), inside the mapping the
        // parts keep alive; `keys` is this process's memory.
        unsafe {
            copy_to_shared(
                bytemuck::cast_slice(keys),
                self.parts.key_page.add(first as usize * size_of::<WireKey>()),
            )
        };
        Ok(())
    }

    /// Pushes `calls` (one Release store) and rings the owner.
    pub fn send(&mut self, calls: &[TierRequest]) -> Result<(), RingFull> {
        self.requests.push_all(calls)?;
        self.parts.owner_bell().ring();
        Ok(())
    }

    /// Waits until an answer is there or `deadline` passes, then moves every answer there into
    /// `out`; returns how many.
    pub fn wait_answers(
        &mut self,
        out: &mut Vec<TierAnswer>,
        policy: WaitPolicy,
        deadline: Instant,
    ) -> Result<usize, RingError> {
        let answers = &mut self.answers;
        let mut fault = None;
        let outcome = self.parts.answer_bell().wait_until(
            || match answers.is_empty() {
                Ok(empty) => !empty,
                Err(error) => {
                    fault = Some(error);
                    true
                }
            },
            policy.until(deadline),
        );
        if let Some(error) = fault {
            return Err(error);
        }
        if outcome == WaitOutcome::TimedOut {
            return Ok(0);
        }
        self.answers.pop_into(out, usize::MAX)
    }

    /// Copies `count` entries of the answer page from `first` into `out`.
    pub fn read_entries(
        &self,
        first: u32,
        count: u32,
        out: &mut Vec<u32>,
    ) -> Result<(), RecordError> {
        let at = self.parts.check_entries(first, count)?;
        let mut bytes = vec![0u8; count as usize * size_of::<u32>()];
        // SAFETY: the entries lie in the answer page (checked above), inside the mapping.
        unsafe { copy_from_shared(self.parts.answer_page.add(at), &mut bytes) };
        out.extend(
            bytes.chunks_exact(4).map(|word| u32::from_ne_bytes(word.try_into().expect("4 bytes"))),
        );
        Ok(())
    }
}

/// The owner's end of a client's channel (module flow).
pub struct OwnerChannel {
    pub(super) requests: Consumer<TierRequest>,
    pub(super) answers: Producer<TierAnswer>,
    /// Last: dropped after the ring ends that point into its mapping.
    pub(super) parts: ChannelParts,
}

impl OwnerChannel {
    pub fn page_keys(&self) -> u32 {
        self.parts.page_keys
    }

    /// Whether no call waits (a broken ring counts as a call, so that the owner acts on it).
    pub fn is_idle(&mut self) -> bool {
        matches!(self.requests.is_empty(), Ok(true))
    }

    /// Moves the calls there into `out`; returns how many. A ring whose indices make no sense is
    /// the client's fault, and the client's end.
    pub fn take_requests(&mut self, out: &mut Vec<TierRequest>) -> Result<usize, RingError> {
        self.requests.pop_into(out, usize::MAX)
    }

    /// Copies the keys `request` names out of the key page (checked against it).
    pub fn read_keys(
        &self,
        request: &TierRequest,
        out: &mut Vec<WireKey>,
    ) -> Result<(), RecordError> {
        let range = request.key_range(self.parts.page_keys)?;
        out.clear();
        out.resize(range.len(), WireKey::new(&[]).expect("an empty key fits"));
        // SAFETY: the range lies in the key page (checked above), inside the mapping; `out` is
        // this process's memory, and WireKey is Pod, so any bytes copied are a value.
        unsafe {
            copy_from_shared(
                self.parts.key_page.add(range.start * size_of::<WireKey>()),
                bytemuck::cast_slice_mut(out.as_mut_slice()),
            )
        };
        Ok(())
    }

    /// Writes `entries` into the answer page from `first`.
    pub fn write_entries(&mut self, first: u32, entries: &[u32]) -> Result<(), RecordError> {
        let at = self.parts.check_entries(first, entries.len() as u32)?;
        // SAFETY: the entries lie in the answer page (checked above), inside the mapping.
        unsafe { copy_to_shared(bytemuck::cast_slice(entries), self.parts.answer_page.add(at)) };
        Ok(())
    }

    /// Entries the answer page holds.
    pub fn answer_entries(&self) -> u32 {
        self.parts.answer_entries()
    }

    /// Pushes `answers` (one Release store) and rings the client.
    pub fn answer(&mut self, answers: &[TierAnswer]) -> Result<(), RingFull> {
        self.answers.push_all(answers)?;
        self.parts.answer_bell().ring();
        Ok(())
    }
}
