//! [`Connection`]: a [`super::TierClient`]'s live connection to its tier's owner: the control
//! object it attached to, its claimed slot, the slot's channel, and a handle on the owner's
//! process.
//!
//! 1. [`Connection::open`]: the control object by name, the tier's identity compared with the
//!    client's, a pidfd on the owner, a slot claimed, the channel's client end;
//! 2. the client writes a batch's keys and calls into the channel (`client.rs`);
//! 3. [`Connection::await_end`] waits for the answer to the batch's end, the answers before it
//!    gathered; or the batch is left unanswered ([`Connection::leave_unanswered`]: its calls
//!    need none), and the next batch waits for that end first ([`Connection::await_unanswered`],
//!    since a batch's pages are its own until then), or [`Connection::is_unanswered`] looks
//!    for it without waiting.

use std::time::{Duration, Instant};

use kvshm_ipc::doorbell::WaitPolicy;
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::process_handle::ProcessHandle;
use kvshm_ipc::tier_control::{ClientChannel, ClientClaim, TierAnswer, TierControl};

use super::{SharedTierError, TierIdentity};

/// How long one wait on the answers lasts before the owner's process is checked.
const ANSWER_SLICE: Duration = Duration::from_millis(10);

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
    _claim: ClientClaim,
    /// Last: its mapping outlives the channel's pointers into it.
    _control: TierControl,
}

impl Connection {
    /// Module flow, step 1: attaches to tier `name` for blocks of `identity`.
    pub(super) fn open(
        name: &SegmentName,
        identity: &TierIdentity,
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
        Ok(Connection { channel, owner, unanswered: None, _claim: claim, _control: control })
    }

    /// Module flow, step 3: waits for the answer to call `end_call` (a batch's end), moving it
    /// and the answers before it into `answers`. The owner's process is checked (a system
    /// call) only once a slice has passed without it: an answer within the spin costs no more.
    pub(super) fn await_end(
        &mut self,
        end_call: u64,
        deadline: Instant,
        answers: &mut Vec<TierAnswer>,
    ) -> Result<(), String> {
        answers.clear();
        loop {
            let until = deadline.min(Instant::now() + ANSWER_SLICE);
            self.channel
                .wait_answers(answers, WaitPolicy::default(), until)
                .map_err(|error| error.to_string())?;
            if answers.last().is_some_and(|answer| answer.call == end_call) {
                return Ok(());
            }
            if !self.owner.is_alive() {
                return Err("the owner's process exited".to_owned());
            }
            if Instant::now() >= deadline {
                return Err("no answer by the deadline".to_owned());
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
}
