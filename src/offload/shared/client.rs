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

use kvshm_ipc::doorbell::WaitPolicy;
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::process_handle::ProcessHandle;
use kvshm_ipc::tier_control::{
    AnswerStatus, ClientChannel, ClientClaim, TierAnswer, TierControl, TierOp, TierRequest, WireKey,
};

use super::batch::{call_keys, merge_answers, split_calls, CallQueue};
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
    /// [`super::SharedTierIndex::complete_store`]; no answer.
    CompleteStore { keys: &'a [OffloadKey], success: bool },
    /// [`super::SharedTierIndex::finish_request`]; no answer.
    FinishRequest { request: &'a str },
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
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            answer_deadline: Duration::from_secs(1),
            reattach_interval: Duration::from_secs(1),
        }
    }
}

/// A live connection to the owner.
struct Connection {
    channel: ClientChannel,
    owner: ProcessHandle,
    _claim: ClientClaim,
    /// Last: its mapping outlives the channel's pointers into it.
    _control: TierControl,
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
    queue: CallQueue,
    /// Batches sent and waited for.
    batches: u64,
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
            last_error: None,
            request_ids: HashMap::new(),
            next_request_id: 0,
            next_call: first_call_id(),
            queue: CallQueue::default(),
            batches: 0,
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

    /// How many batches the client sent and waited for: its waits on the owner.
    pub fn batches_sent(&self) -> u64 {
        self.batches
    }

    /// Queues [`TierCall::ReleaseLoads`] of `keys` for the next batch (module documentation).
    pub fn queue_release_loads(&mut self, keys: &[OffloadKey]) {
        self.queue.release_loads(keys);
    }

    /// Queues [`TierCall::CompleteStore`] of `keys` for the next batch.
    pub fn queue_complete_store(&mut self, keys: &[OffloadKey], success: bool) {
        self.queue.complete_store(keys, success);
    }

    /// Queues [`TierCall::FinishRequest`] of `request` for the next batch.
    pub fn queue_finish_request(&mut self, request: &str) {
        self.queue.finish_request(request);
    }

    /// Whether calls wait for a batch: the engine should [`TierClient::flush`] before it idles.
    pub fn has_queued(&self) -> bool {
        !self.queue.is_empty()
    }

    /// Sends the queued calls, if any, as a batch of their own.
    ///
    /// # Errors
    /// As [`TierClient::call`].
    pub fn flush(&mut self) -> Result<(), SharedTierError> {
        if self.queue.is_empty() {
            return Ok(());
        }
        self.call(&[], &mut Vec::new())
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
        match self.attach() {
            Ok(connection) => {
                self.drop_queue();
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

    fn attach(&self) -> Result<Connection, AttachFailure> {
        let other = |error: &dyn std::fmt::Display| AttachFailure::Other(error.to_string());
        let control = TierControl::attach(&self.name).map_err(|error| other(&error))?;
        let tier = TierIdentity::decode(&control.identity())
            .ok_or_else(|| other(&"the tier's identity is not one this build reads"))?;
        tier.check_attach(&self.identity).map_err(AttachFailure::Tier)?;
        let owner = ProcessHandle::open(control.owner()).map_err(|error| other(&error))?;
        let claim = control.claim_client_slot().map_err(|error| other(&error))?;
        // SAFETY: the one client end of this claim: the connection keeps the claim and its
        // channel together, and a new connection claims a slot of its own.
        let channel = unsafe { control.client_channel(&claim) }.map_err(|error| other(&error))?;
        Ok(Connection { channel, owner, _claim: claim, _control: control })
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
        answers.clear();
        if self.connection.is_none()
            && self.last_attempt.is_none_or(|at| at.elapsed() >= self.options.reattach_interval)
        {
            self.try_attach()?;
        }
        let mut queue = std::mem::take(&mut self.queue);
        let batch = queue.batch_with(calls);
        self.send(&batch, answers);
        answers.drain(..queue.len());
        drop(batch);
        queue.clear();
        self.queue = queue;
        Ok(())
    }

    /// Module flow, steps 2 to 4, for a whole batch.
    fn send(&mut self, calls: &[TierCall<'_>], answers: &mut Vec<CallAnswer>) {
        if let Some(connection) = &self.connection {
            let parts = split_calls(calls, connection.channel.page_keys() as usize);
            let part_calls: Vec<TierCall<'_>> = parts.iter().map(|part| part.call).collect();
            let mut part_answers = Vec::with_capacity(part_calls.len());
            match self.exchange(&part_calls, &mut part_answers) {
                Ok(()) => {
                    merge_answers(&parts, part_answers, calls.len(), answers);
                    return;
                }
                Err(reason) => {
                    tracing::warn!(tier = %self.name, reason, "the tier's owner is gone");
                    self.last_error = Some(reason);
                    self.abandon_connection();
                }
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
                _ => CallAnswer::Sent,
            });
        }
    }

    /// Drops the connection, leaving its slot and what it holds to the owner (module
    /// documentation).
    fn abandon_connection(&mut self) {
        if self.connection.take().is_some() {
            self.epoch += 1;
        }
        self.drop_queue();
        self.last_attempt = Some(Instant::now());
    }

    /// Module flow, steps 2 and 3 (splitting `calls` into batches the channel can carry).
    fn exchange(
        &mut self,
        calls: &[TierCall<'_>],
        answers: &mut Vec<CallAnswer>,
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
            self.exchange_batch(&calls[start..end], answers)?;
            start = end;
        }
        Ok(())
    }

    fn exchange_batch(
        &mut self,
        calls: &[TierCall<'_>],
        answers: &mut Vec<CallAnswer>,
    ) -> Result<(), String> {
        self.wire_keys.clear();
        self.records.clear();
        let first_call = self.next_call;
        for call in calls {
            let (op, request) = match call {
                TierCall::AcquirePrefix { request, .. } => {
                    (TierOp::AcquirePrefix, self.request_id(request))
                }
                TierCall::PrepareStore { request, .. } => {
                    (TierOp::PrepareStore, self.request_id(request))
                }
                TierCall::ReleaseLoads { .. } => (TierOp::ReleaseLoads, 0),
                TierCall::CompleteStore { .. } => (TierOp::CompleteStore, 0),
                TierCall::FinishRequest { request } => {
                    (TierOp::FinishRequest, self.request_ids.remove(*request).unwrap_or(u64::MAX))
                }
            };
            let keys = call_keys(call);
            let first_key = self.wire_keys.len() as u32;
            for key in keys {
                self.wire_keys
                    .push(WireKey::new(key.as_bytes()).expect("an OffloadKey fits a WireKey"));
            }
            let mut record =
                TierRequest::new(self.next_call, op, request, first_key, keys.len() as u32);
            if let TierCall::CompleteStore { success: true, .. } = call {
                record = record.with_flags(1);
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
        // Step 3: wait for the batch's end. The owner's process is checked (a system call) only
        // once a slice has passed without it: an answer within the spin costs no more.
        self.answers.clear();
        let deadline = Instant::now() + self.options.answer_deadline;
        let slice = Duration::from_millis(10);
        loop {
            let until = deadline.min(Instant::now() + slice);
            channel
                .wait_answers(&mut self.answers, WaitPolicy::default(), until)
                .map_err(|error| error.to_string())?;
            if self.answers.last().is_some_and(|answer| answer.call == end_call) {
                break;
            }
            if !connection.owner.is_alive() {
                return Err("the owner's process exited".to_owned());
            }
            if Instant::now() >= deadline {
                return Err("no answer by the deadline".to_owned());
            }
        }
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
            // The owner's answers are checked as it checks calls: an answer that cannot be this
            // call's is the owner's fault, and the client leaves it (step 4) rather than hand
            // its engine chunks for keys it did not ask about.
            if let Some(answer) = answered {
                check_answer(call, &answer)?;
            }
            answers.push(match call {
                TierCall::AcquirePrefix { .. } => {
                    let (mut chunks, mut promoting) = (Vec::new(), 0);
                    if let Some(answer) =
                        answered.filter(|answer| answer.status() == AnswerStatus::Done)
                    {
                        channel
                            .read_entries(answer.first_entry, answer.count, &mut chunks)
                            .map_err(|error| error.to_string())?;
                        promoting = answer.promoting;
                    }
                    CallAnswer::Prefix { chunks, promoting }
                }
                TierCall::PrepareStore { .. } => {
                    let (mut to_store, mut chunks) = (Vec::new(), Vec::new());
                    let refused =
                        answered.is_none_or(|answer| answer.status() != AnswerStatus::Done);
                    if let Some(answer) =
                        answered.filter(|answer| answer.status() == AnswerStatus::Done)
                    {
                        channel
                            .read_entries(answer.first_entry, answer.count, &mut to_store)
                            .map_err(|error| error.to_string())?;
                        let chunks_at = answer.first_entry.saturating_add(answer.count);
                        channel
                            .read_entries(chunks_at, answer.count, &mut chunks)
                            .map_err(|error| error.to_string())?;
                        let keys = call_keys(call).len() as u32;
                        if to_store.iter().zip(to_store.iter().skip(1)).any(|(a, b)| a >= b)
                            || to_store.last().is_some_and(|&last| last >= keys)
                        {
                            return Err(format!(
                                "the owner's answer to call {call_id} names keys to store out of \
                                 order or past its {keys} keys"
                            ));
                        }
                    }
                    CallAnswer::Store { to_store, chunks, refused }
                }
                _ => CallAnswer::Sent,
            });
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

enum AttachFailure {
    Tier(SharedTierError),
    Other(String),
}

/// The first call id of a client: distinct between clients (the process and the time), so that
/// an answer meant for another client of the same slot can never pass for one of this client's.
fn first_call_id() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.subsec_nanos());
    u64::from(std::process::id()) << 32 | u64::from(nanos)
}

/// Whether `answer` can be the owner's answer to `call`: the same operation, and no more keys
/// counted (pinned and being promoted) than the call carried.
fn check_answer(call: &TierCall<'_>, answer: &TierAnswer) -> Result<(), String> {
    let op = match call {
        TierCall::AcquirePrefix { .. } => TierOp::AcquirePrefix,
        TierCall::PrepareStore { .. } => TierOp::PrepareStore,
        TierCall::ReleaseLoads { .. } => TierOp::ReleaseLoads,
        TierCall::CompleteStore { .. } => TierOp::CompleteStore,
        TierCall::FinishRequest { .. } => TierOp::FinishRequest,
    };
    let keys = call_keys(call).len();
    let counted = u64::from(answer.count) + u64::from(answer.promoting);
    if answer.op != op.code() || counted > keys as u64 {
        return Err(format!(
            "the owner answered call {} with op {} and {} keys; it was {op:?} of {keys} keys",
            answer.call, answer.op, answer.count
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer that cannot be the owner's answer to the call (another operation, more keys
    /// than were sent, pinned or coming) is refused, so that no chunk of it reaches the engine.
    #[test]
    fn an_answer_is_accepted_only_for_its_own_call() {
        let keys = [OffloadKey::new(b"a").unwrap(), OffloadKey::new(b"b").unwrap()];
        let acquire = TierCall::AcquirePrefix { request: "r", keys: &keys };
        let store = TierCall::PrepareStore { request: "r", keys: &keys };
        let answer = |op, count| TierAnswer::new(7, op, AnswerStatus::Done).with_entries(count, 0);
        assert!(check_answer(&acquire, &answer(TierOp::AcquirePrefix, 2)).is_ok());
        assert!(check_answer(&store, &answer(TierOp::PrepareStore, 1)).is_ok());
        assert!(check_answer(&acquire, &answer(TierOp::PrepareStore, 1)).is_err());
        assert!(check_answer(&acquire, &answer(TierOp::AcquirePrefix, 3)).is_err());
        assert!(check_answer(&store, &answer(TierOp::AcquirePrefix, 0)).is_err());
        // Keys said to be coming from storage count too: no more than the call carried.
        let coming =
            |count, promoting| answer(TierOp::AcquirePrefix, count).with_promoting(promoting);
        assert!(check_answer(&acquire, &coming(1, 1)).is_ok());
        assert!(check_answer(&acquire, &coming(1, 2)).is_err());
        assert!(check_answer(&acquire, &coming(0, u32::MAX)).is_err());
    }

    /// Two clients start their call ids apart, so an answer left in a slot by one is never
    /// taken for one of the other's.
    #[test]
    fn clients_number_their_calls_from_distinct_ids() {
        assert_ne!(first_call_id() >> 32, 0, "the process id is in the high bits");
        assert_eq!(first_call_id() >> 32, u64::from(std::process::id()));
    }
}
