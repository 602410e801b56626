//! [`Connection`]: a [`super::TierClient`]'s live connection to its tier's owner: the control
//! object it attached to, its claimed slot, the slot's channel, and a handle on the owner's
//! process.
//!
//! 1. [`Connection::open`]: the control object by name, the tier's identity compared with the
//!    client's, a pidfd on the owner, a slot claimed, the channel's client end;
//! 2. the client writes a batch's keys and calls into the channel (`client.rs`);
//! 3. [`Connection::await_end`] waits for the answer to the batch's end, the answers before it
//!    gathered: for [`CALLER_WAIT`] as the caller runs, then inside the caller's `run_sleep`
//!    (the Python binding lets go of the GIL there); or the batch is left unanswered
//!    ([`Connection::leave_unanswered`]: its calls need none), and the next batch waits for that
//!    end first ([`Connection::await_unanswered`], since a batch's pages are its own until
//!    then), or [`Connection::is_unanswered`] looks for it without waiting;
//! 4. [`Connection::read_answer`] checks each call's answer as the owner checks calls, and reads
//!    its entries (the chunks found, or the keys to store and their chunks).

use std::time::{Duration, Instant};

use kvshm_ipc::doorbell::WaitPolicy;
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::process_handle::ProcessHandle;
use kvshm_ipc::tier_control::{AnswerStatus, ClientChannel, ClientClaim, TierAnswer, TierControl};

use super::batch::{call_keys, call_op};
use super::client::{CallAnswer, TierCall};
use super::{SharedTierError, TierIdentity};

/// How long one wait on the answers lasts before the owner's process is checked.
const ANSWER_SLICE: Duration = Duration::from_millis(10);

/// How long a wait for answers runs as its caller runs before it goes on inside `run_sleep`:
/// the usual answer comes within the spin, and waking a sleeping owner takes tens of
/// microseconds, while a Python thread that lets go of the GIL may wait a switch interval (5 ms)
/// to get it back. Only a wait this long lets go.
const CALLER_WAIT: Duration = Duration::from_millis(1);

/// Why a connection could not be made.
pub(super) enum AttachFailure {
    /// The tier's blocks differ from the client's: the one refusal that is an error.
    Tier(SharedTierError),
    /// No owner serves the name, or it could not be attached to now.
    Other(String),
}

/// A live connection to the owner (module flow).
pub(super) struct Connection {
    pub(super) channel: ClientChannel,
    owner: ProcessHandle,
    /// The end of a batch left unanswered, and when the owner counts as gone without it.
    unanswered: Option<(u64, Instant)>,
    /// Runs a wait's sleep (`ClientOptions::run_sleep`).
    run_sleep: fn(&mut (dyn FnMut() + Send)),
    _claim: ClientClaim,
    /// Last: its mapping outlives the channel's pointers into it.
    _control: TierControl,
}

impl Connection {
    /// Module flow, step 1: attaches to tier `name` for blocks of `identity`; its waits sleep
    /// inside `run_sleep`.
    pub(super) fn open(
        name: &SegmentName,
        identity: &TierIdentity,
        run_sleep: fn(&mut (dyn FnMut() + Send)),
    ) -> Result<Connection, AttachFailure> {
        let other = |error: &dyn std::fmt::Display| AttachFailure::Other(error.to_string());
        let control = TierControl::attach(name).map_err(|error| other(&error))?;
        let tier = TierIdentity::decode(&control.identity())
            .ok_or_else(|| other(&"the tier's identity is not one this build reads"))?;
        tier.check_attach(identity).map_err(AttachFailure::Tier)?;
        let owner = ProcessHandle::open(control.owner()).map_err(|error| other(&error))?;
        let claim = control.claim_client_slot().map_err(|error| other(&error))?;
        // SAFETY: the one client end of this claim: the connection keeps the claim and its
        // channel together, and a new connection claims a slot of its own.
        let channel = unsafe { control.client_channel(&claim) }.map_err(|error| other(&error))?;
        Ok(Connection {
            channel,
            owner,
            unanswered: None,
            run_sleep,
            _claim: claim,
            _control: control,
        })
    }

    /// Module flow, step 3: waits for the answer to call `end_call` (a batch's end), moving it
    /// and the answers before it into `answers`: for [`CALLER_WAIT`] as the caller runs, then
    /// inside `run_sleep`. The owner's process is checked (a system call) after each slice that
    /// passed without the answer: an answer within the spin costs no more.
    pub(super) fn await_end(
        &mut self,
        end_call: u64,
        deadline: Instant,
        answers: &mut Vec<TierAnswer>,
    ) -> Result<(), String> {
        answers.clear();
        let caller_until = deadline.min(Instant::now() + CALLER_WAIT);
        if self.wait_for_end(end_call, caller_until, answers)? {
            return Ok(());
        }
        let mut ended = None;
        let run_sleep = self.run_sleep;
        if caller_until < deadline {
            run_sleep(&mut || ended = Some(self.wait_for_end(end_call, deadline, answers)));
            debug_assert!(ended.is_some(), "`run_sleep` must run the wait it is given");
        }
        if ended.unwrap_or(Ok(false))? {
            Ok(())
        } else {
            Err("no answer by the deadline".to_owned())
        }
    }

    /// Waits in slices until the answer to `end_call` is among `answers` (`true`), `until`
    /// passed (`false`) or the owner's process exited (`Err`).
    fn wait_for_end(
        &mut self,
        end_call: u64,
        until: Instant,
        answers: &mut Vec<TierAnswer>,
    ) -> Result<bool, String> {
        loop {
            let slice_end = until.min(Instant::now() + ANSWER_SLICE);
            self.channel
                .wait_answers(answers, WaitPolicy::default(), slice_end)
                .map_err(|error| error.to_string())?;
            if answers.last().is_some_and(|answer| answer.call == end_call) {
                return Ok(true);
            }
            if !self.owner.is_alive() {
                return Err("the owner's process exited".to_owned());
            }
            if Instant::now() >= until {
                return Ok(false);
            }
        }
    }

    /// Module flow, step 3: the batch ending with call `end_call` is not waited for now.
    pub(super) fn leave_unanswered(&mut self, end_call: u64, deadline: Instant) {
        self.unanswered = Some((end_call, deadline));
    }

    /// Waits for the end of the batch left unanswered, if there is one that the owner has not
    /// answered yet; returns whether it waited.
    pub(super) fn await_unanswered(
        &mut self,
        answers: &mut Vec<TierAnswer>,
    ) -> Result<bool, String> {
        if !self.is_unanswered(answers)? {
            return Ok(false);
        }
        let (end_call, deadline) = self.unanswered.take().expect("unanswered: looked above");
        self.await_end(end_call, deadline, answers)?;
        Ok(true)
    }

    /// Whether the owner's process still runs (a system call).
    pub(super) fn owner_alive(&self) -> bool {
        self.owner.is_alive()
    }

    /// Whether a batch left unanswered is still unanswered, looking without waiting. `Err`
    /// when the owner is gone: its process exited, or the batch's deadline passed.
    pub(super) fn is_unanswered(&mut self, answers: &mut Vec<TierAnswer>) -> Result<bool, String> {
        let Some((end_call, deadline)) = self.unanswered else { return Ok(false) };
        answers.clear();
        let now = Instant::now();
        let look = WaitPolicy::new(Duration::ZERO, Duration::ZERO).until(now);
        self.channel.wait_answers(answers, look, now).map_err(|error| error.to_string())?;
        if answers.iter().any(|answer| answer.call == end_call) {
            self.unanswered = None;
            return Ok(false);
        }
        if now >= deadline || !self.owner.is_alive() {
            return Err("no answer by the deadline, or the owner's process exited".to_owned());
        }
        Ok(true)
    }

    /// Module flow, step 4: what the owner's `answered` (`None`: no answer of its own, a store
    /// refused) says to `call`, sent as call `call_id`. An answer that cannot be this call's is
    /// the owner's fault, and the client leaves it rather than hand its engine chunks for keys
    /// it did not ask about.
    pub(super) fn read_answer(
        &self,
        call: &TierCall<'_>,
        call_id: u64,
        answered: Option<TierAnswer>,
    ) -> Result<CallAnswer, String> {
        if let Some(answer) = &answered {
            check_answer(call, answer)?;
        }
        let done = answered.filter(|answer| answer.status() == AnswerStatus::Done);
        let read = |first: u32, count: u32, out: &mut Vec<u32>| {
            self.channel.read_entries(first, count, out).map_err(|error| error.to_string())
        };
        Ok(match call {
            TierCall::AcquirePrefix { .. } => {
                let mut chunks = Vec::new();
                if let Some(answer) = done {
                    read(answer.first_entry, answer.count, &mut chunks)?;
                }
                CallAnswer::Prefix { chunks, promoting: done.map_or(0, |answer| answer.promoting) }
            }
            TierCall::PrepareStore { .. } => {
                let (mut to_store, mut chunks) = (Vec::new(), Vec::new());
                if let Some(answer) = done {
                    read(answer.first_entry, answer.count, &mut to_store)?;
                    let chunks_at = answer.first_entry.saturating_add(answer.count);
                    read(chunks_at, answer.count, &mut chunks)?;
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
                CallAnswer::Store { to_store, chunks, refused: done.is_none() }
            }
            TierCall::Lease { .. } => {
                let mut chunks = Vec::new();
                if let Some(answer) = done {
                    read(answer.first_entry, answer.count, &mut chunks)?;
                }
                CallAnswer::Leased { chunks }
            }
            _ => CallAnswer::Sent,
        })
    }
}

/// Whether `answer` can be the owner's answer to `call`: the same operation, and no more keys
/// counted (pinned and being promoted) than the call carried, or chunks than a lease asked for.
fn check_answer(call: &TierCall<'_>, answer: &TierAnswer) -> Result<(), String> {
    let op = call_op(call);
    let keys = match *call {
        TierCall::Lease { target } => target as usize,
        _ => call_keys(call).len(),
    };
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
    use kvshm_ipc::tier_control::TierOp;

    use super::*;
    use crate::offload::key::OffloadKey;

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
        // A lease adds no more chunks than were asked for.
        let lease = TierCall::Lease { target: 4 };
        assert!(check_answer(&lease, &answer(TierOp::Lease, 4)).is_ok());
        assert!(check_answer(&lease, &answer(TierOp::Lease, 5)).is_err());
    }
}
