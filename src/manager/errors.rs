//! The errors of the engine-facing operations, one small enum per operation.

use super::{RequestId, TicketId, TransferId};

/// A prompt described inconsistently: more block hashes than its tokens make blocks (counting a
/// trailing partial block). The prompt length is what the last-token rule is computed from, so a
/// wrong one is refused rather than guessed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{hashes} block hashes for a prompt of {prompt_tokens} tokens, which makes at most {blocks} \
     blocks of {block_tokens} tokens"
)]
pub struct PromptError {
    pub hashes: usize,
    pub prompt_tokens: usize,
    pub block_tokens: u32,
    /// `prompt_tokens` divided by `block_tokens`, rounded up.
    pub blocks: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MatchError {
    #[error("{0} is already live")]
    DuplicateRequest(RequestId),
    #[error("{0} is not live")]
    UnknownRequest(RequestId),
    #[error("{0} has allocated blocks; it ends with finish or abort")]
    AlreadyAllocated(RequestId),
    #[error("{request}: hash {block} differs from the prefix it holds")]
    PrefixMismatch { request: RequestId, block: usize },
    #[error(transparent)]
    Prompt(#[from] PromptError),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocateError {
    #[error("{0} is not live")]
    UnknownRequest(RequestId),
    #[error("{0} waited on a swap-in that failed; abort it")]
    RequestFailed(RequestId),
    #[error("{needed} device blocks needed but only {available} can be had")]
    OutOfBlocks { needed: usize, available: usize },
    #[error("{needed} host blocks needed to load storage hits but only {available} can be had")]
    OutOfHostBlocks { needed: usize, available: usize },
    #[error(
        "{request}: {new_tokens} new and {lookahead} lookahead tokens overflow its token count"
    )]
    TooManyTokens { request: RequestId, new_tokens: usize, lookahead: usize },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommitError {
    #[error("{0} is not live")]
    UnknownRequest(RequestId),
    #[error("{0} waited on a swap-in that failed; abort it")]
    RequestFailed(RequestId),
    #[error("{0} still waits on a ticket; commit after its copies land")]
    TicketPending(RequestId),
    #[error("{blocks} computed blocks but only {allocated} allocated")]
    NotAllocated { blocks: usize, allocated: usize },
    #[error("{blocks} computed blocks but only {given} hashes given")]
    MissingHashes { blocks: usize, given: usize },
    #[error("the hash of block {block} differs from the one the request holds")]
    PrefixMismatch { block: usize },
}

/// A question about a request that is not live.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0} is not live")]
pub struct UnknownRequest(pub RequestId);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FinishError {
    #[error("{0} is not live")]
    UnknownRequest(RequestId),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TicketError {
    #[error("ticket {} is not known (its request ended, or it never existed)", .0 .0)]
    UnknownTicket(TicketId),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompleteError {
    #[error("transfer {} is not in flight", .0 .0)]
    UnknownTransfer(TransferId),
    /// The copy is made but was never handed out ([`super::CacheManager::take_transfers`]): no worker
    /// can have run it.
    #[error("transfer {} was never handed out: it cannot have completed", .0 .0)]
    NotIssued(TransferId),
    #[error("transfer {} is not a storage copy: it has no per-block results", .0 .0)]
    NotStorage(TransferId),
    #[error("transfer {} has {expected} blocks, not {got}", .transfer.0)]
    BlockCount { transfer: TransferId, expected: usize, got: usize },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResetError {
    #[error("{requests} requests still hold blocks; finish them or reset with force")]
    RequestsHoldBlocks { requests: usize },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResizeError {
    #[error("cannot shrink the device tier to {blocks} blocks: block {first_in_use} is in use")]
    BlocksInUse { blocks: u32, first_in_use: u32 },
    #[error("{watermark} free blocks are kept by the watermark, more than {blocks}")]
    BelowWatermark { blocks: u32, watermark: u32 },
    #[error("{blocks} device blocks is more than the {max} a u32 block id can name")]
    TooManyBlocks { blocks: u32, max: u32 },
}

/// A broken invariant of DESIGN §6: always a bug in the manager.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invariant {number} broken: {detail}")]
pub struct InvariantViolation {
    /// The invariant's number in DESIGN §6.
    pub number: u8,
    pub detail: String,
}
