//! `finish` and `abort` (DESIGN §4.5): ending a request.
//!
//! 1. Forget its tickets.
//! 2. Give its own blocks back in reverse order (the tail first), except a block claimed from a
//!    swap-out that is still reading it: that copy keeps it until it completes.
//! 3. Release its nodes in reverse order, touching them now: at ref count 0 they become
//!    evictable, the tail first (deeper first on the equal access time). The eviction policy
//!    hears which request ends before, and after a finish that its path's end ended a turn.

use super::id_table::IdTable;
use super::request::Request;
use super::transfer::InFlight;
use super::{CacheManager, FinishError, RequestId, TransferId};
use crate::pool::BlockPool;

impl CacheManager {
    /// Ends a request that ran to completion.
    pub fn finish(&mut self, request: RequestId) -> Result<(), FinishError> {
        self.end(request, true)?;
        self.stats.finished_requests += 1;
        Ok(())
    }

    /// Ends a request early (cancelled, preempted, or its ticket failed).
    pub fn abort(&mut self, request: RequestId) -> Result<(), FinishError> {
        self.end(request, false)?;
        self.stats.aborted_requests += 1;
        Ok(())
    }

    fn end(&mut self, request: RequestId, finished: bool) -> Result<(), FinishError> {
        // The record stays in its slot (see `Requests`): the fields it is read beside are
        // borrowed apart.
        let CacheManager { requests, tickets, in_flight, device, tree, .. } = self;
        let record = requests.remove(&request).ok_or(FinishError::UnknownRequest(request))?;
        for ticket in &record.tickets {
            tickets.remove(ticket);
        }
        if !record.claims.is_empty() {
            // Usually every copy claimed from has completed: one lookup per run of claims.
            record.claims.retain(|run| in_flight.contains_key(&run.transfer));
        }
        if record.claims.is_empty() {
            // The usual end: no copy still reads a block of the request's.
            for block in record.owned_blocks().rev() {
                device
                    .free(block)
                    .expect("freeing a device block not in use is a programming error");
            }
        } else {
            give_back_with_claims(record, in_flight, device);
        }
        tree.request_ending(record.policy_tag);
        tree.release_path(&record.path);
        if let (true, Some(&last)) = (finished, record.path.last()) {
            tree.turn_ended(last);
        }
        Ok(())
    }
}

/// Gives back the blocks `record` owns in reverse order ([`Request::owned_blocks`]), each block
/// claimed from a copy in flight (`in_flight`) to that copy, which frees it when it completes;
/// the others to `device`. A table block's claim is found by its position (one compare per run
/// of claims; reading every run's blocks for each block would make the end of an allocation
/// with N claims in flight N^2/2 compares). Only an aborted allocation whose copies are still in
/// flight comes here.
#[cold]
fn give_back_with_claims(
    record: &Request,
    in_flight: &mut IdTable<TransferId, Box<InFlight>>,
    device: &mut BlockPool,
) {
    let mut give_back = |block: u32, claimed_from: Option<TransferId>| match claimed_from {
        Some(transfer) => {
            let flight =
                in_flight.get_mut(&transfer).expect("claims were filtered to copies in flight");
            flight.reserved_device.push(block);
        }
        None => {
            device.free(block).expect("freeing a device block not in use is a programming error")
        }
    };
    let owned_from = record.path.len().min(record.table.len());
    for position in (owned_from..record.table.len()).rev() {
        give_back(record.table[position], record.claim_at(position));
    }
    for &block in record.private.iter().rev() {
        give_back(block, record.claimed_from(block));
    }
}
