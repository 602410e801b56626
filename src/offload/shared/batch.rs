//! How a [`super::TierClient`]'s calls become batches: [`CallQueue`] holds the calls that need
//! no answer until the next batch, [`split_calls`] cuts a call too large for one batch into
//! parts, and [`merge_answers`] makes the parts' answers one again.
//!
//! A batch is one wait on the owner. Calls with no answer (a load's pins let go, a store done,
//! a request ended) are queued and go at the head of the next batch the engine must wait for
//! anyway, or at [`super::TierClient::flush`] (vLLM: once a scheduler step), so that an engine
//! waits on the owner only for the calls it needs an answer to. Queued calls keep their order,
//! and stay before any call made after them.

use kvshm_ipc::tier_control::TierOp;

use super::client::{CallAnswer, TierCall};
use crate::offload::key::OffloadKey;

/// How a client's stores ended ([`TierCall::CompleteStore`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreEnd {
    /// The copies succeeded: the keys are loadable.
    Stored,
    /// The copies failed: the keys are dropped, their chunks free.
    Failed,
    /// The engine will not say (it reset its cache with the copies in flight): the keys are
    /// dropped, and their chunks, which it may still write, stay its own until it leaves.
    Abandoned,
}

impl StoreEnd {
    /// The `flags` of a `CompleteStore` request.
    pub fn flags(self) -> u32 {
        match self {
            StoreEnd::Failed => 0,
            StoreEnd::Stored => 1,
            StoreEnd::Abandoned => 2,
        }
    }

    /// The end a `CompleteStore` request's `flags` name: anything unknown is taken as abandoned,
    /// the end that frees no chunk a copy may still write.
    pub fn from_flags(flags: u32) -> StoreEnd {
        match flags {
            0 => StoreEnd::Failed,
            1 => StoreEnd::Stored,
            _ => StoreEnd::Abandoned,
        }
    }
}

/// A call with no answer, owned while it waits for a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
enum QueuedCall {
    ReleaseLoads(Vec<OffloadKey>),
    CompleteStore { keys: Vec<OffloadKey>, end: StoreEnd },
    FinishRequest(String),
    StoreLeased { request: String, keys: Vec<OffloadKey>, first: u64 },
}

/// The calls with no answer that wait for the next batch, in the order they were made
/// (module documentation). A call of the same kind as the last one queued joins it: the order
/// of the calls stays as made.
#[derive(Debug, Default)]
pub(super) struct CallQueue {
    calls: Vec<QueuedCall>,
}

impl CallQueue {
    pub(super) fn release_loads(&mut self, keys: &[OffloadKey]) {
        if keys.is_empty() {
            return;
        }
        match self.calls.last_mut() {
            Some(QueuedCall::ReleaseLoads(queued)) => queued.extend_from_slice(keys),
            _ => self.calls.push(QueuedCall::ReleaseLoads(keys.to_vec())),
        }
    }

    pub(super) fn complete_store(&mut self, keys: &[OffloadKey], end: StoreEnd) {
        if keys.is_empty() {
            return;
        }
        match self.calls.last_mut() {
            Some(QueuedCall::CompleteStore { keys: queued, end: was }) if *was == end => {
                queued.extend_from_slice(keys);
            }
            _ => self.calls.push(QueuedCall::CompleteStore { keys: keys.to_vec(), end }),
        }
    }

    pub(super) fn finish_request(&mut self, request: &str) {
        self.calls.push(QueuedCall::FinishRequest(request.to_owned()));
    }

    pub(super) fn store_leased(&mut self, request: &str, keys: &[OffloadKey], first: u64) {
        let (request, keys) = (request.to_owned(), keys.to_vec());
        self.calls.push(QueuedCall::StoreLeased { request, keys, first });
    }

    pub(super) fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// The queued calls, in order, followed by `calls`: one batch.
    pub(super) fn batch_with<'a>(&'a self, calls: &[TierCall<'a>]) -> Vec<TierCall<'a>> {
        let queued = self.calls.iter().map(|call| match call {
            QueuedCall::ReleaseLoads(keys) => TierCall::ReleaseLoads { keys },
            QueuedCall::CompleteStore { keys, end } => TierCall::CompleteStore { keys, end: *end },
            QueuedCall::FinishRequest(request) => TierCall::FinishRequest { request },
            QueuedCall::StoreLeased { request, keys, first } => {
                TierCall::StoreLeased { request, keys, first: *first }
            }
        });
        queued.chain(calls.iter().copied()).collect()
    }

    /// How many calls are queued.
    pub(super) fn len(&self) -> usize {
        self.calls.len()
    }

    pub(super) fn clear(&mut self) {
        self.calls.clear();
    }
}

/// One part of a call as sent: the call it came from, and where its keys start in that call's.
#[derive(Clone, Copy, Debug)]
pub(super) struct CallPart<'a> {
    pub(super) call: TierCall<'a>,
    of: usize,
    first_key: u32,
}

/// `calls` with each cut into parts of at most `page_keys` keys (module documentation): an
/// `AcquirePrefix` to its first part, any other into as many as it needs.
pub(super) fn split_calls<'a>(calls: &[TierCall<'a>], page_keys: usize) -> Vec<CallPart<'a>> {
    let page_keys = page_keys.max(1);
    let mut parts = Vec::with_capacity(calls.len());
    for (of, call) in calls.iter().enumerate() {
        let keys = call_keys(call);
        if keys.len() <= page_keys {
            parts.push(CallPart { call: *call, of, first_key: 0 });
            continue;
        }
        for (index, piece) in keys.chunks(page_keys).enumerate() {
            let call = match *call {
                TierCall::AcquirePrefix { request, .. } if index == 0 => {
                    TierCall::AcquirePrefix { request, keys: piece }
                }
                TierCall::AcquirePrefix { .. } => break,
                TierCall::PrepareStore { request, .. } => {
                    TierCall::PrepareStore { request, keys: piece }
                }
                TierCall::ReleaseLoads { .. } => TierCall::ReleaseLoads { keys: piece },
                TierCall::CompleteStore { end, .. } => TierCall::CompleteStore { keys: piece, end },
                TierCall::StoreLeased { request, first, .. } => {
                    let first = first + (index * page_keys) as u64;
                    TierCall::StoreLeased { request, keys: piece, first }
                }
                TierCall::FinishRequest { .. } | TierCall::Lease { .. } => {
                    unreachable!("carries no keys")
                }
            };
            let first_key = (index * page_keys) as u32;
            parts.push(CallPart { call, of, first_key });
        }
    }
    parts
}

/// One answer per call of `calls` (`count` of them) from the answers to its parts: a store's
/// parts' keys to store (as indices into the whole call's keys) and chunks, in order.
pub(super) fn merge_answers(
    parts: &[CallPart<'_>],
    part_answers: Vec<CallAnswer>,
    count: usize,
    answers: &mut Vec<CallAnswer>,
) {
    answers.clear();
    answers.reserve(count);
    for (part, answer) in parts.iter().zip(part_answers) {
        if part.of == answers.len() {
            answers.push(answer);
            continue;
        }
        let merged = answers.last_mut().expect("a later part follows its call's first");
        if let (
            CallAnswer::Store { to_store, chunks, refused },
            CallAnswer::Store { to_store: more, chunks: more_chunks, refused: more_refused },
        ) = (merged, answer)
        {
            to_store.extend(more.into_iter().map(|index| index + part.first_key));
            chunks.extend(more_chunks);
            *refused |= more_refused;
        }
    }
    debug_assert_eq!(answers.len(), count);
}

/// The operation `call` is sent as.
pub(super) fn call_op(call: &TierCall<'_>) -> TierOp {
    match call {
        TierCall::AcquirePrefix { .. } => TierOp::AcquirePrefix,
        TierCall::PrepareStore { .. } => TierOp::PrepareStore,
        TierCall::ReleaseLoads { .. } => TierOp::ReleaseLoads,
        TierCall::CompleteStore { .. } => TierOp::CompleteStore,
        TierCall::FinishRequest { .. } => TierOp::FinishRequest,
        TierCall::Lease { .. } => TierOp::Lease,
        TierCall::StoreLeased { .. } => TierOp::StoreLeased,
    }
}

/// The keys `call` carries.
pub(super) fn call_keys<'a>(call: &TierCall<'a>) -> &'a [OffloadKey] {
    match *call {
        TierCall::AcquirePrefix { keys, .. }
        | TierCall::PrepareStore { keys, .. }
        | TierCall::ReleaseLoads { keys }
        | TierCall::CompleteStore { keys, .. }
        | TierCall::StoreLeased { keys, .. } => keys,
        TierCall::FinishRequest { .. } | TierCall::Lease { .. } => &[],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> OffloadKey {
        OffloadKey::new(&[n; 4]).unwrap()
    }

    /// Queued calls go first in their order; a call joins the last queued only when of the same
    /// kind (and success), so no call passes another.
    #[test]
    fn queued_calls_keep_their_order_ahead_of_the_batch() {
        let mut queue = CallQueue::default();
        queue.release_loads(&[key(1)]);
        queue.release_loads(&[key(2)]);
        queue.complete_store(&[key(3)], StoreEnd::Stored);
        queue.complete_store(&[key(4)], StoreEnd::Failed);
        queue.finish_request("r");
        queue.release_loads(&[key(5)]);
        queue.release_loads(&[]);
        queue.store_leased("r", &[key(6), key(7)], 3);
        assert_eq!(queue.len(), 6);
        let asked = [key(9)];
        let batch = queue.batch_with(&[TierCall::AcquirePrefix { request: "s", keys: &asked }]);
        let shape: Vec<String> = batch
            .iter()
            .map(|call| match call {
                TierCall::ReleaseLoads { keys } => format!("release {}", keys.len()),
                TierCall::CompleteStore { keys, end } => {
                    format!("stored {} {}", keys.len(), end == &StoreEnd::Stored)
                }
                TierCall::FinishRequest { request } => format!("finish {request}"),
                TierCall::AcquirePrefix { request, keys } => {
                    format!("acquire {request} {}", keys.len())
                }
                TierCall::PrepareStore { .. } => "store".to_owned(),
                TierCall::StoreLeased { request, keys, first } => {
                    format!("leased {request} {} from {first}", keys.len())
                }
                TierCall::Lease { target } => format!("lease {target}"),
            })
            .collect();
        assert_eq!(
            shape,
            [
                "release 2",
                "stored 1 true",
                "stored 1 false",
                "finish r",
                "release 1",
                "leased r 2 from 3",
                "acquire s 1"
            ]
        );
        queue.clear();
        assert!(queue.is_empty());
    }

    /// A call of more keys than a batch carries goes as parts: a store's answers come back as
    /// one, its indices into the whole call's keys, refused if a part was; a prefix is asked for
    /// its first part only.
    #[test]
    fn a_call_larger_than_a_batch_is_cut_into_parts_and_answered_as_one() {
        let keys: Vec<OffloadKey> = (0..5u8).map(|n| OffloadKey::new(&[n; 4]).unwrap()).collect();
        let leased =
            split_calls(&[TierCall::StoreLeased { request: "r", keys: &keys, first: 7 }], 2);
        let firsts: Vec<u64> = leased
            .iter()
            .map(|part| match part.call {
                TierCall::StoreLeased { first, .. } => first,
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(firsts, [7, 9, 11], "each part names its own first leased chunk");
        let calls = [
            TierCall::PrepareStore { request: "r", keys: &keys },
            TierCall::AcquirePrefix { request: "r", keys: &keys },
            TierCall::FinishRequest { request: "r" },
        ];
        let parts = split_calls(&calls, 2);
        let shape: Vec<(usize, u32, usize)> = parts
            .iter()
            .map(|part| (part.of, part.first_key, call_keys(&part.call).len()))
            .collect();
        assert_eq!(shape, [(0, 0, 2), (0, 2, 2), (0, 4, 1), (1, 0, 2), (2, 0, 0)]);
        let store = |to_store: Vec<u32>, chunks: Vec<u32>, refused: bool| CallAnswer::Store {
            to_store,
            chunks,
            refused,
        };
        let part_answers = vec![
            store(vec![1], vec![10], false),
            store(vec![0, 1], vec![12, 13], false),
            store(vec![], vec![], true),
            CallAnswer::Prefix { chunks: vec![7, 8], promoting: 0 },
            CallAnswer::Sent,
        ];
        let mut answers = Vec::new();
        merge_answers(&parts, part_answers, calls.len(), &mut answers);
        assert_eq!(
            answers,
            [
                store(vec![1, 2, 3], vec![10, 12, 13], true),
                CallAnswer::Prefix { chunks: vec![7, 8], promoting: 0 },
                CallAnswer::Sent
            ]
        );
    }
}
