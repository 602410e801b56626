//! [`TierClient`]: an engine instance's side of a shared tier whose index another process owns
//! (DESIGN §12.3-12.4). It attaches by the tier's name, asks in batches, and keeps answering
//! while the owner is gone.
//!
//! One batch ([`TierClient::call`]):
//! 1. if not connected, try to attach (at most every `reattach_interval`): the control object,
//!    the tier's identity compared with the client's ([`SharedTierError::Mismatch`] is the one
//!    refusal that is an error), a slot claimed, the channel's client end, a pidfd on the owner;
//! 2. write every call's keys into the key page, push one record per call and the batch's end,
//!    ring the owner;
//! 3. wait for the batch's end, in slices, checking the owner's process after each slice that
//!    passed without it, until `answer_deadline`; read each answer's entries;
//! 4. when the owner is gone (its process exited, or no answer by the deadline), drop the
//!    connection and answer the batch itself: no key is a hit, nothing is to be stored.
//!
//! Request names become ids the owner sees (a u64 per live request, given back at
//! [`TierCall::FinishRequest`]).
//!
//! Calls with no answer can be queued ([`TierClient::queue_release_loads`] and its siblings):
//! they go at the head of the next batch, or at [`TierClient::flush`] (`batch.rs`). A call of
//! more keys than a batch carries is cut into parts ([`split_calls`]): a store's parts are
//! answered together, an `AcquirePrefix` is cut to its first part (the engine asks for the rest
//! of its prefix with a later call).
//!
//! A client that gives up on an owner that still runs (no answer by the deadline: the owner
//! hung, or starved of CPU for that long) leaves its slot as it is: the pins and pending stores
//! it holds there stay until its process exits, because its engine's copies into and out of
//! those chunks may still be running, and no chunk may go to another store meanwhile. It claims
//! a new slot when it attaches again; [`TierClient::connection_epoch`] tells its user that the
//! pins of the old connection are not the new one's to release.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvshm_ipc::name::SegmentName;
use kvshm_ipc::tier_control::{TierAnswer, TierOp, TierRequest, WireKey};

use super::batch::{call_keys, call_op, merge_answers, split_calls, CallQueue, StoreEnd};
use super::client_lease::{LeaseBook, StoreEpochs, DEFAULT_LEASE_CHUNKS};
use super::connection::{AttachFailure, Connection};
use super::{SharedTierError, TierIdentity};
use crate::offload::key::OffloadKey;

/// One call of a batch.
#[derive(Clone, Copy, Debug)]
pub enum TierCall<'a> {
    /// [`super::SharedTierIndex::acquire_prefix`].
    AcquirePrefix { request: &'a str, keys: &'a [OffloadKey] },
    /// [`super::SharedTierIndex::prepare_store`].
    PrepareStore { request: &'a str, keys: &'a [OffloadKey] },
    /// [`super::SharedTierIndex::release_loads`]; no answer.
    ReleaseLoads { keys: &'a [OffloadKey] },
    /// [`super::SharedTierIndex::complete_store`], or for [`StoreEnd::Abandoned`]
    /// [`super::SharedTierIndex::abandon_stores`]; no answer.
    CompleteStore { keys: &'a [OffloadKey], end: StoreEnd },
    /// [`super::SharedTierIndex::finish_request`]; no answer.
    FinishRequest { request: &'a str },
    /// [`super::SharedTierIndex::lease`] up to `target` chunks (the client adds it to a batch
    /// it waits for: `client_lease.rs`).
    Lease { target: u32 },
    /// [`super::SharedTierIndex::store_leased`] of `keys` in the leased chunks numbered `first`
    /// on; no answer (queued by [`TierClient::prepare_store`]).
    StoreLeased { request: &'a str, keys: &'a [OffloadKey], first: u64 },
}

/// The answer to one call, in the batch's order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallAnswer {
    /// The leading keys pinned for this client, with their chunks (empty: a miss), and how many
    /// keys after them the owner is bringing back from its storage tier (ask again for those).
    Prefix { chunks: Vec<u32>, promoting: u32 },
    /// Indices into the keys given of those to store, and their chunks (empty: nothing to
    /// store). `refused`: no chunk was given for want of one (the owner refused: the tier full,
    /// a quota, its store grace; or failed the call, or is gone), as opposed to every key being
    /// in the tier already.
    Store { to_store: Vec<u32>, chunks: Vec<u32>, refused: bool },
    /// The chunks added to the client's lease, in sequence (none while the owner is gone).
    Leased { chunks: Vec<u32> },
    /// A call without an answer was sent (or skipped while the owner is gone).
    Sent,
}

/// How long a client waits, and how often it tries to attach again.
#[derive(Clone, Copy, Debug)]
pub struct ClientOptions {
    /// The longest a batch waits for its answers before the owner counts as gone.
    pub answer_deadline: Duration,
    /// The shortest time between two attempts to attach.
    pub reattach_interval: Duration,
    /// Runs the part of a wait for answers past its first millisecond: the default runs it as
    /// it is; the Python binding lets go of the GIL around it, so that an owner slow to answer
    /// stalls only the thread that asked, not every Python thread of its engine. It must run
    /// the wait it is given, once (a client whose wait did not run gives its owner up).
    pub run_sleep: fn(&mut (dyn FnMut() + Send)),
    /// The chunks it asks to hold ahead of its stores (`client_lease.rs`); 0 asks for none.
    pub lease_chunks: u32,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            answer_deadline: Duration::from_secs(1),
            reattach_interval: Duration::from_secs(1),
            run_sleep: |sleep| sleep(),
            lease_chunks: DEFAULT_LEASE_CHUNKS,
        }
    }
}

/// An engine instance's side of a shared tier (module flow).
pub struct TierClient {
    name: SegmentName,
    identity: TierIdentity,
    options: ClientOptions,
    connection: Option<Connection>,
    /// Bumped when a connection is made or dropped (`connection_epoch`).
    epoch: u64,
    last_attempt: Option<Instant>,
    /// Why the last attempt to attach failed, or why the connection was dropped.
    last_error: Option<String>,
    request_ids: HashMap<String, u64>,
    next_request_id: u64,
    next_call: u64,
    /// Calls with no answer waiting for the next batch; dropped with the connection they were
    /// made on.
    pub(super) queue: CallQueue,
    /// The chunks leased to it, and the keys it is storing (`client_lease.rs`).
    pub(super) lease: LeaseBook,
    /// The connection each store in flight was made on, per key (`client_lease.rs`).
    pub(super) store_epochs: StoreEpochs,
    /// Batches sent, and those of them waited for.
    batches: u64,
    waits: u64,
    // Scratch.
    wire_keys: Vec<WireKey>,
    records: Vec<TierRequest>,
    answers: Vec<TierAnswer>,
}

impl std::fmt::Debug for TierClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierClient")
            .field("name", &self.name)
            .field("connected", &self.connection.is_some())
            .finish()
    }
}

impl TierClient {
    /// A client of tier `name` for blocks of `identity`, attached now if the owner is there.
    ///
    /// # Errors
    /// [`SharedTierError::Mismatch`] when the tier's blocks differ from `identity`'s. An owner
    /// that is not there is no error: the client answers misses until it comes.
    pub fn new(
        name: SegmentName,
        identity: TierIdentity,
        options: ClientOptions,
    ) -> Result<TierClient, SharedTierError> {
        let mut client = TierClient {
            name,
            identity,
            options,
            connection: None,
            last_attempt: None,
            epoch: 0,
            store_epochs: StoreEpochs::default(),
            last_error: None,
            request_ids: HashMap::new(),
            next_request_id: 0,
            next_call: first_call_id(),
            queue: CallQueue::default(),
            lease: LeaseBook::new(options.lease_chunks),
            batches: 0,
            waits: 0,
            wire_keys: Vec::new(),
            records: Vec::new(),
            answers: Vec::new(),
        };
        client.try_attach()?;
        Ok(client)
    }

    /// Whether an owner serves this client now.
    pub fn is_connected(&self) -> bool {
        self.connection.is_some()
    }

    /// Which connection serves the client: changes whenever one is made or dropped. Pins
    /// taken under one epoch belong to that connection's slot; under another, they are not
    /// the client's to release (the owner releases them when the process exits, or never had
    /// them: a new owner).
    pub fn connection_epoch(&self) -> u64 {
        self.epoch
    }

    /// Why the client is not connected, if it is not.
    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    /// How many batches the client sent.
    pub fn batches_sent(&self) -> u64 {
        self.batches
    }

    /// How many times it waited for the owner: for a batch's answers, or for the end of a
    /// batch sent without waiting that the owner had not answered when the next was sent.
    pub fn batches_waited(&self) -> u64 {
        self.waits
    }

    /// Queues [`TierCall::ReleaseLoads`] of `keys` for the next batch (module documentation).
    pub fn queue_release_loads(&mut self, keys: &[OffloadKey]) {
        self.queue.release_loads(keys);
    }

    /// Queues [`TierCall::FinishRequest`] of `request` for the next batch.
    pub fn queue_finish_request(&mut self, request: &str) {
        self.queue.finish_request(request);
    }

    /// Whether calls wait for a batch: the engine should [`TierClient::send_queued`] them
    /// before it idles.
    pub fn has_queued(&self) -> bool {
        !self.queue.is_empty()
    }

    /// Sends the queued calls, if any, as a batch of their own, and waits until the owner has
    /// carried out every call sent.
    ///
    /// # Errors
    /// As [`TierClient::call`].
    pub fn flush(&mut self) -> Result<(), SharedTierError> {
        if self.queue.is_empty() {
            let answers = &mut self.answers;
            match self.connection.as_mut().map(|live| live.await_unanswered(answers)) {
                Some(Ok(true)) => self.waits += 1,
                Some(Err(reason)) => self.give_up(reason),
                Some(Ok(false)) | None => {}
            }
            return Ok(());
        }
        self.call(&[], &mut Vec::new())
    }

    /// Sends the queued calls, if any, as a batch of their own without waiting for the owner:
    /// none needs an answer. The batch's pages stay its own until the owner answers its end,
    /// which the next batch waits for first (or [`TierClient::flush`]); so does this one for
    /// the batch before it. A queue of more calls than one batch carries (its ring's slots but
    /// one) waits for each batch but its last. An owner found exited (a system call) is given
    /// up at once, so that the engine can start another in the same step.
    ///
    /// # Errors
    /// As [`TierClient::call`].
    pub fn send_queued(&mut self) -> Result<(), SharedTierError> {
        if self.queue.is_empty() {
            return Ok(());
        }
        self.call_waiting(&[], &mut Vec::new(), false)
    }

    /// Drops the queued calls: they belong to a connection that is gone (a release sent
    /// through the next one could let go of that one's pins). Their requests end here.
    fn drop_queue(&mut self) {
        let request_ids = &mut self.request_ids;
        for call in self.queue.batch_with(&[]) {
            if let TierCall::FinishRequest { request } = call {
                request_ids.remove(request);
            }
        }
        self.queue.clear();
    }

    /// Module flow, step 1.
    fn try_attach(&mut self) -> Result<(), SharedTierError> {
        self.last_attempt = Some(Instant::now());
        match Connection::open(&self.name, &self.identity, self.options.run_sleep) {
            Ok(connection) => {
                self.drop_queue();
                self.lease.clear();
                self.connection = Some(connection);
                self.epoch += 1;
                self.last_error = None;
                Ok(())
            }
            Err(AttachFailure::Tier(error)) => Err(error),
            Err(AttachFailure::Other(error)) => {
                self.last_error = Some(error);
                Ok(())
            }
        }
    }

    fn request_id(&mut self, request: &str) -> u64 {
        if let Some(&id) = self.request_ids.get(request) {
            return id;
        }
        let id = self.next_request_id;
        self.next_request_id += 1;
        self.request_ids.insert(request.to_owned(), id);
        id
    }

    /// Sends the queued calls and `calls` as one batch and writes one answer per call of
    /// `calls` to `answers` (module flow).
    ///
    /// # Errors
    /// [`SharedTierError::Mismatch`] when the client attached again to a tier of other blocks.
    pub fn call(
        &mut self,
        calls: &[TierCall<'_>],
        answers: &mut Vec<CallAnswer>,
    ) -> Result<(), SharedTierError> {
        self.call_waiting(calls, answers, true)
    }

    /// [`TierClient::call`]; without `wait`, a batch whose calls need no answer is not waited
    /// for ([`TierClient::send_queued`]).
    fn call_waiting(
        &mut self,
        calls: &[TierCall<'_>],
        answers: &mut Vec<CallAnswer>,
        wait: bool,
    ) -> Result<(), SharedTierError> {
        answers.clear();
        if self.connection.is_none()
            && self.last_attempt.is_none_or(|at| at.elapsed() >= self.options.reattach_interval)
        {
            self.try_attach()?;
        }
        // A batch waited for tops the lease up, if it is short (`client_lease.rs`).
        let top_up = self.connection.as_ref().and(self.lease.top_up()).filter(|_| wait);
        let epoch = self.epoch;
        let mut queue = std::mem::take(&mut self.queue);
        let mut batch = queue.batch_with(calls);
        batch.extend(top_up);
        self.send(&batch, answers, wait);
        answers.drain(..queue.len());
        if top_up.is_some() {
            // Granted on the connection the batch went to, if that still serves.
            if let (Some(CallAnswer::Leased { chunks }), true) =
                (answers.pop(), self.epoch == epoch)
            {
                self.lease.granted(&chunks);
            }
        }
        // The keys the owner gave chunks for are this connection's stores until they end.
        if self.epoch == epoch {
            for (call, answer) in calls.iter().zip(answers.iter()) {
                if let (TierCall::PrepareStore { keys, .. }, CallAnswer::Store { to_store, .. }) =
                    (call, answer)
                {
                    self.lease.storing(to_store.iter().map(|&at| keys[at as usize]));
                }
            }
        }
        drop(batch);
        queue.clear();
        self.queue = queue;
        Ok(())
    }

    /// Module flow, steps 2 to 4, for a whole batch.
    fn send(&mut self, calls: &[TierCall<'_>], answers: &mut Vec<CallAnswer>, wait: bool) {
        if let Some(connection) = &self.connection {
            let parts = split_calls(calls, connection.channel.page_keys() as usize);
            let part_calls: Vec<TierCall<'_>> = parts.iter().map(|part| part.call).collect();
            let mut part_answers = Vec::with_capacity(part_calls.len());
            match self.exchange(&part_calls, &mut part_answers, wait) {
                Ok(()) => {
                    merge_answers(&parts, part_answers, calls.len(), answers);
                    return;
                }
                Err(reason) => self.give_up(reason),
            }
        }
        // Module flow, step 4: misses, and no stores.
        answers.clear();
        for call in calls {
            answers.push(match call {
                TierCall::AcquirePrefix { .. } => {
                    CallAnswer::Prefix { chunks: Vec::new(), promoting: 0 }
                }
                TierCall::PrepareStore { .. } => {
                    CallAnswer::Store { to_store: Vec::new(), chunks: Vec::new(), refused: true }
                }
                TierCall::FinishRequest { request } => {
                    self.request_ids.remove(*request);
                    CallAnswer::Sent
                }
                TierCall::Lease { .. } => CallAnswer::Leased { chunks: Vec::new() },
                _ => CallAnswer::Sent,
            });
        }
    }

    /// Gives the owner up if its process exited (a system call): before the client answers a
    /// store from its lease, whose chunks a new owner would give to other stores once its store
    /// grace is over.
    pub(super) fn give_up_if_owner_exited(&mut self) {
        if self.connection.as_ref().is_some_and(|live| !live.owner_alive()) {
            self.give_up("the owner's process exited".to_owned());
        }
    }

    /// Module flow, step 4: the owner is gone, for `reason`.
    fn give_up(&mut self, reason: String) {
        tracing::warn!(tier = %self.name, reason, "the tier's owner is gone");
        self.last_error = Some(reason);
        self.abandon_connection();
    }

    /// Drops the connection, leaving its slot and what it holds to the owner (module
    /// documentation).
    fn abandon_connection(&mut self) {
        if self.connection.take().is_some() {
            self.epoch += 1;
        }
        self.drop_queue();
        self.lease.clear();
        self.last_attempt = Some(Instant::now());
    }

    /// Module flow, steps 2 and 3 (splitting `calls` into batches the channel can carry).
    fn exchange(
        &mut self,
        calls: &[TierCall<'_>],
        answers: &mut Vec<CallAnswer>,
        wait: bool,
    ) -> Result<(), String> {
        let connection = self.connection.as_ref().expect("connected");
        let batch_calls = connection.channel.batch_capacity() - 1;
        let page_keys = connection.channel.page_keys() as usize;
        let mut start = 0;
        while start < calls.len() {
            // As many calls as fit in the ring and the key page (one call alone may not).
            let mut end = start;
            let mut keys = 0;
            while end < calls.len() && end - start < batch_calls {
                let more = call_keys(&calls[end]).len();
                if keys + more > page_keys {
                    // `split_calls` made every call fit a batch alone.
                    debug_assert!(
                        end > start,
                        "a call of {more} keys; a batch carries {page_keys}"
                    );
                    break;
                }
                keys += more;
                end += 1;
            }
            self.exchange_batch(&calls[start..end], answers, wait)?;
            start = end;
        }
        Ok(())
    }

    /// One batch: sent after the one before it is answered (the pages are one batch's at a
    /// time), and waited for unless none of its calls needs an answer and `wait` is false.
    fn exchange_batch(
        &mut self,
        calls: &[TierCall<'_>],
        answers: &mut Vec<CallAnswer>,
        wait: bool,
    ) -> Result<(), String> {
        let connection = self.connection.as_mut().expect("connected");
        if connection.await_unanswered(&mut self.answers)? {
            self.waits += 1;
        }
        self.wire_keys.clear();
        self.records.clear();
        let first_call = self.next_call;
        for call in calls {
            let (op, request, lease) = match *call {
                TierCall::AcquirePrefix { request, .. } => {
                    (TierOp::AcquirePrefix, self.request_id(request), 0)
                }
                TierCall::PrepareStore { request, .. } => {
                    (TierOp::PrepareStore, self.request_id(request), 0)
                }
                TierCall::ReleaseLoads { .. } => (TierOp::ReleaseLoads, 0, 0),
                TierCall::CompleteStore { .. } => (TierOp::CompleteStore, 0, 0),
                TierCall::FinishRequest { request } => {
                    let id = self.request_ids.remove(request).unwrap_or(u64::MAX);
                    (TierOp::FinishRequest, id, 0)
                }
                TierCall::Lease { target } => (TierOp::Lease, 0, u64::from(target)),
                TierCall::StoreLeased { request, first, .. } => {
                    (TierOp::StoreLeased, self.request_id(request), first)
                }
            };
            let keys = call_keys(call);
            let first_key = self.wire_keys.len() as u32;
            for key in keys {
                self.wire_keys
                    .push(WireKey::new(key.as_bytes()).expect("an OffloadKey fits a WireKey"));
            }
            let mut record =
                TierRequest::new(self.next_call, op, request, first_key, keys.len() as u32)
                    .with_lease(lease);
            if let TierCall::CompleteStore { end, .. } = call {
                record = record.with_flags(end.flags());
            }
            self.records.push(record);
            self.next_call += 1;
        }
        let end_call = self.next_call;
        self.records.push(TierRequest::new(end_call, TierOp::EndBatch, 0, 0, 0));
        self.next_call += 1;
        self.batches += 1;

        let connection = self.connection.as_mut().expect("connected");
        let channel = &mut connection.channel;
        channel.write_keys(0, &self.wire_keys).map_err(|error| error.to_string())?;
        channel.send(&self.records).map_err(|error| error.to_string())?;
        let deadline = Instant::now() + self.options.answer_deadline;
        if !wait && !calls.iter().any(|call| call_op(call).is_answered()) {
            if !connection.owner_alive() {
                return Err("the owner's process exited".to_owned());
            }
            connection.leave_unanswered(end_call, deadline);
            answers.extend(calls.iter().map(|_| CallAnswer::Sent));
            return Ok(());
        }
        self.waits += 1;
        connection.await_end(end_call, deadline, &mut self.answers)?;
        let mut by_call = self.answers.iter().filter(|answer| answer.call < end_call);
        let mut next_answer = by_call.next();
        for (offset, call) in calls.iter().enumerate() {
            let call_id = first_call + offset as u64;
            let answered = match next_answer {
                Some(answer) if answer.call == call_id => {
                    next_answer = by_call.next();
                    Some(*answer)
                }
                _ => None,
            };
            answers.push(connection.read_answer(call, call_id, answered)?);
        }
        Ok(())
    }
}

impl Drop for TierClient {
    fn drop(&mut self) {
        // What is queued first (a wait of at most the answer deadline), then tell the owner this
        // client leaves; it releases the client and empties the slot.
        let _ = self.flush();
        if let Some(connection) = self.connection.as_mut() {
            let detach = TierRequest::new(self.next_call, TierOp::Detach, 0, 0, 0);
            let _ = connection.channel.send(&[detach]);
        }
    }
}

/// The first call id of a client: distinct between clients (the process and the time), so that
/// an answer meant for another client of the same slot can never pass for one of this client's.
fn first_call_id() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.subsec_nanos());
    u64::from(std::process::id()) << 32 | u64::from(nanos)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two clients start their call ids apart, so an answer left in a slot by one is never
    /// taken for one of the other's.
    #[test]
    fn clients_number_their_calls_from_distinct_ids() {
        assert_ne!(first_call_id() >> 32, 0, "the process id is in the high bits");
        assert_eq!(first_call_id() >> 32, u64::from(std::process::id()));
    }
}
