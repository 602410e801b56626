//! The fixed-layout records of a client's channel: its calls ([`TierRequest`]), the owner's
//! answers ([`TierAnswer`]), and the keys a batch carries ([`WireKey`], in the key page).
//!
//! A batch: the client writes the keys of its calls into its key page from entry 0, pushes one
//! request per call (each naming its keys as `first_key..first_key + keys`) and a
//! [`TierOp::EndBatch`], and rings the owner's doorbell; the owner answers every call that has an
//! answer, writes the chunks and indices they name into the answer page from entry 0, and
//! answers the [`TierOp::EndBatch`] last. The pages are the batch's until that last answer.
//!
//! Nothing in a record is trusted: [`TierRequest::op`] and [`TierRequest::key_range`] check what
//! the owner acts on, [`WireKey::bytes`] a key's length; a failed check is a [`RecordError`].

use bytemuck::{Pod, Zeroable};

/// The longest key a channel carries (the offload manager's `MAX_KEY_BYTES`).
pub const WIRE_KEY_BYTES: usize = 64;

/// What a call asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TierOp {
    /// Pin the leading loadable keys; answered with their count and chunks.
    AcquirePrefix,
    /// Chunks for the keys the tier lacks; answered with the indices to store and their chunks.
    PrepareStore,
    /// End the client's loads of the keys; no answer.
    ReleaseLoads,
    /// The client's stores of the keys completed (`flags` 1) or failed (0); no answer.
    CompleteStore,
    /// The request ended; no answer.
    FinishRequest,
    /// The client leaves: the owner releases it and empties its slot; no answer.
    Detach,
    /// The batch ends: answered last, after every other answer of the batch.
    EndBatch,
    /// Top the client's lease of chunks up to `lease` chunks; answered with the chunks added.
    Lease,
    /// The client stores the keys in its leased chunks numbered `lease` on, one each; no answer.
    StoreLeased,
}

impl TierOp {
    pub const fn code(self) -> u32 {
        match self {
            TierOp::AcquirePrefix => 1,
            TierOp::PrepareStore => 2,
            TierOp::ReleaseLoads => 3,
            TierOp::CompleteStore => 4,
            TierOp::FinishRequest => 5,
            TierOp::Detach => 6,
            TierOp::EndBatch => 7,
            TierOp::Lease => 8,
            TierOp::StoreLeased => 9,
        }
    }

    pub fn from_code(code: u32) -> Result<TierOp, RecordError> {
        Ok(match code {
            1 => TierOp::AcquirePrefix,
            2 => TierOp::PrepareStore,
            3 => TierOp::ReleaseLoads,
            4 => TierOp::CompleteStore,
            5 => TierOp::FinishRequest,
            6 => TierOp::Detach,
            7 => TierOp::EndBatch,
            8 => TierOp::Lease,
            9 => TierOp::StoreLeased,
            code => return Err(RecordError::UnknownOp { code }),
        })
    }

    /// Whether the owner answers it.
    pub fn is_answered(self) -> bool {
        matches!(
            self,
            TierOp::AcquirePrefix | TierOp::PrepareStore | TierOp::Lease | TierOp::EndBatch
        )
    }
}

/// Why a record, or what it names, cannot be acted on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("unknown operation {code}")]
    UnknownOp { code: u32 },
    #[error("keys {first}..{first}+{count} lie outside the key page of {page} keys")]
    KeysOutOfPage { first: u32, count: u32, page: u32 },
    #[error("a key of {len} bytes; at most {WIRE_KEY_BYTES}")]
    KeyTooLong { len: u32 },
    #[error("answer entries {first}..{first}+{count} lie outside the answer page of {page}")]
    EntriesOutOfPage { first: u32, count: u32, page: u32 },
}

/// One call of a client (client to owner), 64 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct TierRequest {
    /// The client's count of its calls: its answer carries it back.
    pub call: u64,
    /// The client's id of the engine request the call is for.
    pub request: u64,
    pub op: u32,
    pub first_key: u32,
    pub keys: u32,
    /// `CompleteStore`: 1 when the stores succeeded, 2 when their engine abandoned them (a reset
    /// with the copies in flight), 0 when they failed (layout version 5 on).
    pub flags: u32,
    /// `Lease`: the chunks the client wants leased in all; `StoreLeased`: the sequence number of
    /// the leased chunk its first key goes into.
    pub lease: u64,
    pub reserved: [u64; 3],
}

const _: () = assert!(size_of::<TierRequest>() == 64);

impl TierRequest {
    /// A call of `op` for `request`, over keys `first_key..first_key + keys` of the key page.
    pub fn new(call: u64, op: TierOp, request: u64, first_key: u32, keys: u32) -> TierRequest {
        let reserved = [0; 3];
        TierRequest { call, request, op: op.code(), first_key, keys, flags: 0, lease: 0, reserved }
    }

    pub fn with_flags(mut self, flags: u32) -> TierRequest {
        self.flags = flags;
        self
    }

    pub fn with_lease(mut self, lease: u64) -> TierRequest {
        self.lease = lease;
        self
    }

    pub fn op(&self) -> Result<TierOp, RecordError> {
        TierOp::from_code(self.op)
    }

    /// The keys it names, checked against a page of `page` keys.
    pub fn key_range(&self, page: u32) -> Result<std::ops::Range<usize>, RecordError> {
        let out = RecordError::KeysOutOfPage { first: self.first_key, count: self.keys, page };
        let end = self.first_key.checked_add(self.keys).ok_or(out)?;
        if end > page {
            return Err(out);
        }
        Ok(self.first_key as usize..end as usize)
    }
}

/// How a call went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AnswerStatus {
    Done,
    /// `PrepareStore` could not evict enough: nothing to store.
    Refused,
    /// The record was bad ([`RecordError`]) or the index refused it: nothing changed.
    Failed,
}

impl AnswerStatus {
    pub const fn code(self) -> u32 {
        match self {
            AnswerStatus::Done => 0,
            AnswerStatus::Refused => 1,
            AnswerStatus::Failed => 2,
        }
    }

    /// Unknown codes read as `Failed`: an answer nobody understands is no answer to act on.
    pub fn from_code(code: u32) -> AnswerStatus {
        match code {
            0 => AnswerStatus::Done,
            1 => AnswerStatus::Refused,
            _ => AnswerStatus::Failed,
        }
    }
}

/// One answer of the owner (owner to client), 64 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct TierAnswer {
    /// The call answered.
    pub call: u64,
    pub op: u32,
    pub status: u32,
    /// `AcquirePrefix`: keys pinned; `PrepareStore`: keys to store; `Lease`: chunks added.
    pub count: u32,
    /// The first of its entries in the answer page: `count` chunks (`AcquirePrefix`, `Lease`),
    /// or `count` key indices then `count` chunks (`PrepareStore`).
    pub first_entry: u32,
    /// `AcquirePrefix`: how many keys after the `count` pinned ones the owner is bringing back
    /// from its storage tier (loadable once that is done: ask again). Zero from an owner without
    /// one (and from owners that predate it, which wrote zero here).
    pub promoting: u32,
    pub reserved0: u32,
    pub reserved: [u64; 4],
}

const _: () = assert!(size_of::<TierAnswer>() == 64);

impl TierAnswer {
    pub fn new(call: u64, op: TierOp, status: AnswerStatus) -> TierAnswer {
        TierAnswer {
            call,
            op: op.code(),
            status: status.code(),
            count: 0,
            first_entry: 0,
            promoting: 0,
            reserved0: 0,
            reserved: [0; 4],
        }
    }

    pub fn with_entries(mut self, count: u32, first_entry: u32) -> TierAnswer {
        self.count = count;
        self.first_entry = first_entry;
        self
    }

    pub fn with_promoting(mut self, promoting: u32) -> TierAnswer {
        self.promoting = promoting;
        self
    }

    pub fn status(&self) -> AnswerStatus {
        AnswerStatus::from_code(self.status)
    }
}

/// One key in a key page, 72 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct WireKey {
    pub len: u32,
    pub reserved: u32,
    pub bytes: [u8; WIRE_KEY_BYTES],
}

const _: () = assert!(size_of::<WireKey>() == 72);

impl WireKey {
    /// `None` when `bytes` is longer than [`WIRE_KEY_BYTES`].
    pub fn new(bytes: &[u8]) -> Option<WireKey> {
        let mut key = WireKey { len: bytes.len() as u32, reserved: 0, bytes: [0; WIRE_KEY_BYTES] };
        key.bytes.get_mut(..bytes.len())?.copy_from_slice(bytes);
        Some(key)
    }

    /// The key's bytes, its length checked.
    pub fn bytes(&self) -> Result<&[u8], RecordError> {
        self.bytes.get(..self.len as usize).ok_or(RecordError::KeyTooLong { len: self.len })
    }
}
