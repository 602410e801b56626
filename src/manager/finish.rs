//! `finish` and `abort` (DESIGN §4.5): ending a request.
//!
//! 1. Forget its tickets.
//! 2. Give its own blocks back in reverse order (the tail first), except a block claimed from a
//!    swap-out that is still reading it: that copy keeps it until it completes.
//! 3. Release its nodes in reverse order, touching them now: at ref count 0 they become
//!    evictable, the tail first (deeper first on the equal access time). The eviction policy
//!    hears which request ends before, and after a finish that its path's end ended a turn.

use super::{CacheManager, FinishError, RequestId};

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
        // A claimed block goes to the copy still reading it, which frees it when it completes.
        let mut give_back = |block: u32, claimed_from: Option<super::TransferId>| match claimed_from
        {
            Some(transfer) => {
                let flight =
                    in_flight.get_mut(&transfer).expect("claims were filtered to copies in flight");
                flight.reserved_device.push(block);
            }
            None => device
                .free(block)
                .expect("freeing a device block not in use is a programming error"),
        };
        // The owned blocks in reverse order (`Request::owned_blocks`): the table's past the path,
        // each claim found by its position (one compare per run of claims, where looking the
        // block up in the runs' blocks would read the whole run per block), then the private ones.
        let owned_from = record.path.len().min(record.table.len());
        for position in (owned_from..record.table.len()).rev() {
            give_back(record.table[position], record.claim_at(position));
        }
        for &block in record.private.iter().rev() {
            give_back(block, record.claimed_from(block));
        }
        tree.request_ending(record.policy_tag);
        tree.release_path(&record.path);
        if let (true, Some(&last)) = (finished, record.path.last()) {
            tree.turn_ended(last);
        }
        Ok(())
    }
}
