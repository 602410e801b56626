//! One call of a client carried out on the index (`TierServer::carry_out`, step 4 of a turn):
//! its record and keys checked ([`RecordError`]), the index's operation, the answer and its
//! entries in the client's answer page.

use std::fmt::Write as _;
use std::time::Instant;

use kvshm_ipc::tier_control::{
    AnswerStatus, OwnerChannel, RecordError, TierAnswer, TierOp, TierRequest, WireKey,
};

use super::TierServer;
use crate::offload::key::OffloadKey;
use crate::offload::shared::{SharedTierError, StoreEnd};

impl TierServer {
    /// One call: `None` for calls without an answer.
    pub(super) fn carry_out(&mut self, slot: usize, request: &TierRequest) -> Option<TierAnswer> {
        let served = self.served[slot].as_mut().expect("a served slot");
        let op = match request.op() {
            Ok(op) => op,
            Err(error) => {
                tracing::warn!(slot, %error, "a bad record");
                self.stats.calls_failed += 1;
                return None;
            }
        };
        let failed = TierAnswer::new(request.call, op, AnswerStatus::Failed);
        if op == TierOp::EndBatch {
            served.next_entry = 0;
            self.stats.batches += 1;
            self.last_batch = Instant::now();
            return Some(TierAnswer::new(request.call, op, AnswerStatus::Done));
        }
        if op == TierOp::Detach {
            served.detached = true;
            return None;
        }
        if let Err(error) = read_keys(&served.channel, request, &mut self.wire_keys, &mut self.keys)
        {
            tracing::warn!(slot, %error, "a bad record");
            if op.is_answered() {
                return Some(failed);
            }
            self.stats.calls_failed += 1;
            return None;
        }
        let client = served.client;
        // Entries the answer page has room for after this batch's answers so far.
        let answer_room = served.channel.answer_entries().saturating_sub(served.next_entry);
        self.request_name.clear();
        write!(self.request_name, "{}", request.request).expect("writing to a String cannot fail");
        let stores_allowed = self.stores_refused_until.is_none_or(|until| Instant::now() >= until);
        let index = self.owner.index();
        let name = self.request_name.as_str();
        let outcome: Result<Option<TierAnswer>, SharedTierError> = match op {
            TierOp::AcquirePrefix => {
                index.acquire_prefix(client, name, &self.keys, &mut self.chunks).map(|hits| {
                    self.entries.clear();
                    self.entries.extend_from_slice(&self.chunks);
                    let promoting = self.storage.as_mut().map_or(0, |storage| {
                        storage.promote(index, client, &self.keys, hits, stores_allowed)
                    });
                    let answer = TierAnswer::new(request.call, op, AnswerStatus::Done);
                    Some(answer.with_promoting(promoting))
                })
            }
            TierOp::PrepareStore if !stores_allowed => {
                Ok(Some(TierAnswer::new(request.call, op, AnswerStatus::Refused)))
            }
            TierOp::PrepareStore => {
                index.prepare_store(client, name, &self.keys, &mut self.prepared).map(|stored| {
                    self.entries.clear();
                    if !stored {
                        return Some(TierAnswer::new(request.call, op, AnswerStatus::Refused));
                    }
                    self.entries.extend_from_slice(&self.prepared.to_store);
                    self.entries.extend_from_slice(&self.prepared.chunks);
                    Some(TierAnswer::new(request.call, op, AnswerStatus::Done))
                })
            }
            TierOp::Lease => {
                // No more than the answer page has room for; none while stores are refused (the
                // chunks free now may be written still).
                let target = usize::try_from(request.lease).unwrap_or(usize::MAX);
                let target = if stores_allowed { target.min(answer_room as usize) } else { 0 };
                index.lease(client, target, &mut self.chunks).map(|()| {
                    self.entries.clear();
                    self.entries.extend_from_slice(&self.chunks);
                    Some(TierAnswer::new(request.call, op, AnswerStatus::Done))
                })
            }
            TierOp::StoreLeased => {
                index.store_leased(client, name, &self.keys, request.lease).map(|()| None)
            }
            TierOp::ReleaseLoads => index.release_loads(client, &self.keys).map(|()| None),
            TierOp::CompleteStore => match StoreEnd::from_flags(request.flags) {
                StoreEnd::Abandoned => index.abandon_stores(client, &self.keys).map(|_| None),
                end => {
                    let success = end == StoreEnd::Stored;
                    index.complete_store(client, &self.keys, success).map(|()| {
                        if let (Some(storage), true) = (self.storage.as_mut(), success) {
                            storage.stored(index, &self.keys);
                        }
                        None
                    })
                }
            },
            TierOp::FinishRequest => index.finish_request(client, name).map(|()| None),
            TierOp::EndBatch | TierOp::Detach => unreachable!("handled above"),
        };
        let answer = match outcome {
            Ok(answer) => answer?,
            Err(error) => {
                tracing::warn!(slot, %error, "the index refused a call");
                if op.is_answered() {
                    return Some(failed);
                }
                self.stats.calls_failed += 1;
                return None;
            }
        };
        if answer.status() != AnswerStatus::Done {
            return Some(answer);
        }
        // The entries: chunks (AcquirePrefix), or indices then chunks (PrepareStore).
        let served = self.served[slot].as_mut().expect("a served slot");
        let count =
            if op == TierOp::PrepareStore { self.entries.len() / 2 } else { self.entries.len() };
        let first = served.next_entry;
        match served.channel.write_entries(first, &self.entries) {
            Ok(()) => {
                served.next_entry += self.entries.len() as u32;
                Some(answer.with_entries(count as u32, first))
            }
            Err(error) => {
                // Its batch asked for more than its answer page holds: undo, and refuse.
                tracing::warn!(slot, %error, "a batch too large for its answer page");
                let index = self.owner.index();
                match op {
                    TierOp::AcquirePrefix => {
                        let pinned = &self.keys[..self.entries.len()];
                        let _ = index.release_loads(client, pinned);
                    }
                    // Capped to the page's room above; and a lease the client never hears of
                    // must not stay the owner's (the two lists would differ).
                    TierOp::Lease => index.return_lease(client, &self.entries),
                    _ => {
                        let stored: Vec<OffloadKey> = self
                            .prepared
                            .to_store
                            .iter()
                            .map(|&at| self.keys[at as usize])
                            .collect();
                        let _ = index.complete_store(client, &stored, false);
                    }
                }
                Some(failed)
            }
        }
    }
}

/// The keys `request` names, checked: in the page, and each no longer than a key may be.
fn read_keys(
    channel: &OwnerChannel,
    request: &TierRequest,
    wire: &mut Vec<WireKey>,
    keys: &mut Vec<OffloadKey>,
) -> Result<(), RecordError> {
    channel.read_keys(request, wire)?;
    keys.clear();
    for key in wire.iter() {
        let bytes = key.bytes()?;
        keys.push(OffloadKey::new(bytes).map_err(|_| RecordError::KeyTooLong { len: key.len })?);
    }
    Ok(())
}
