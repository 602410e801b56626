//! What the manager remembers about one live request.
//!
//! Core types: [`Request`] (one request's record) and [`Requests`] (the live ones, by id, each
//! in a slot that a [`RequestSlot`] names while it lives).
//!
//! A request holds a path of cached nodes from the root (matched, then committed) and owns the
//! blocks of its block table past that path, plus the blocks it computed twice ("private": a
//! commit found the block cached already). Positions of the block table inside the path are the
//! nodes' device blocks, except private ones.

use serde::Serialize;

use super::id_table::IdTable;
use super::{TicketId, TransferId};
use crate::tree::NodeId;

/// The engine's name for a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "request {}", self.0)
    }
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Request {
    /// Nodes held (ref_count += 1 each), block 0 first.
    pub path: Vec<NodeId>,
    /// The block table: device block of every position; shorter than `path` until the first
    /// allocation gives the host hits device blocks.
    pub table: Vec<u32>,
    /// Blocks kept privately at positions inside `path`.
    pub private: Vec<u32>,
    /// Tokens the block table covers (lookahead excluded).
    pub tokens: usize,
    /// Device blocks of the table claimed from a swap-out still reading them, by runs of
    /// positions claimed from one copy ([`Request::note_claim`]).
    pub claims: Vec<ClaimRun>,
    pub tickets: Vec<TicketId>,
    /// Tickets of this request still waiting.
    pub pending_tickets: u32,
    /// Set when a swap-in it waited on failed; only finish or abort are accepted afterwards.
    pub failed: bool,
    /// The eviction policy's tag for the request (from its match), told back at its end.
    pub policy_tag: u8,
}

/// Positions `start..end` of a request's block table whose blocks were claimed from swap-out
/// `transfer`, still reading them when claimed. A position keeps its block while the copy is in
/// flight: the request's ticket waits on it, so nothing is committed meanwhile, and the blocks
/// a storage miss replaces are hits below the path's end, never claimed ones (it notes runs of
/// its own for them). So the end of a request finds a table block's claim by its position
/// ([`Request::claim_at`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ClaimRun {
    pub transfer: TransferId,
    pub start: u32,
    pub end: u32,
}

impl Request {
    /// Notes that the block at table `position` was claimed from swap-out `transfer`: the last
    /// run grows when it is of that copy and ends there (an allocation's claims from its own
    /// swap-out make one run), else a run starts. Returns whether one started.
    #[inline]
    pub fn note_claim(&mut self, position: usize, transfer: TransferId) -> bool {
        let position = u32::try_from(position).expect("a table of < 2^32 blocks");
        match self.claims.last_mut() {
            Some(run) if run.transfer == transfer && run.end == position => {
                run.end += 1;
                false
            }
            _ => {
                self.claims.push(ClaimRun { transfer, start: position, end: position + 1 });
                true
            }
        }
    }

    /// The copy that the block at table `position` was claimed from, among the runs of
    /// `claims`.
    // The usual answer first: the end of a request asks once per block it owns, and its claims
    // are gone by then (their copies completed) but for an aborted allocation.
    #[inline]
    pub fn claim_at(&self, position: usize) -> Option<TransferId> {
        if self.claims.is_empty() {
            return None;
        }
        let position = u32::try_from(position).ok()?;
        self.claims
            .iter()
            .find(|run| (run.start..run.end).contains(&position))
            .map(|run| run.transfer)
    }

    /// The copy that private `block` (whose table position is not kept) was claimed from,
    /// among the blocks at the positions of the runs of `claims`: a read of each run.
    #[inline]
    pub fn claimed_from(&self, block: u32) -> Option<TransferId> {
        if self.claims.is_empty() {
            return None;
        }
        let table = &self.table;
        self.claims
            .iter()
            .find(|run| {
                table
                    .get(run.start as usize..run.end as usize)
                    .is_some_and(|run| run.contains(&block))
            })
            .map(|run| run.transfer)
    }

    /// Empties the record for the next request in its slot, its buffers kept (so that serving a
    /// request allocates nothing once the buffers have grown).
    fn clear(&mut self) {
        self.path.clear();
        self.table.clear();
        self.private.clear();
        self.claims.clear();
        self.tickets.clear();
        self.tokens = 0;
        self.pending_tickets = 0;
        self.failed = false;
        self.policy_tag = 0;
    }

    /// The blocks this request owns (to free when it ends), in table order.
    pub fn owned_blocks(&self) -> impl DoubleEndedIterator<Item = u32> + '_ {
        let start = self.path.len().min(self.table.len());
        self.private.iter().copied().chain(self.table[start..].iter().copied())
    }

    /// Whether it holds nodes or owns blocks.
    pub fn holds_anything(&self) -> bool {
        !self.path.is_empty() || !self.table.is_empty()
    }
}

/// Where a live request's record sits in [`Requests`] (see [`Requests::slot`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RequestSlot(u32);

/// The live requests. Records sit in slots and stay there: a request that ends frees its slot,
/// and the next request to start takes the slot and empties the record, keeping its buffers. A
/// small index finds a request's slot by id (one probe of an [`IdTable`]). No record moves.
///
/// The slot of the request that started last is kept beside the index (`latest`): an engine
/// allocates for a request right after matching it, and the allocation (and, served one at a
/// time, the commit) then finds the slot with one compare rather than a probe.
#[derive(Debug, Default)]
pub(crate) struct Requests {
    index: IdTable<RequestId, u32>,
    slots: Vec<(RequestId, Request)>,
    /// Slots of ended requests (their records not emptied yet).
    free: Vec<u32>,
    /// The request that started last and its slot, while it lives.
    latest: Option<(RequestId, u32)>,
}

impl Requests {
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// The slot of live request `id`: the latest one's without a probe.
    #[inline]
    fn find(&self, id: &RequestId) -> Option<u32> {
        match self.latest {
            Some((latest, slot)) if latest == *id => Some(slot),
            _ => self.index.get(id).copied(),
        }
    }

    pub fn contains_key(&self, id: &RequestId) -> bool {
        self.find(id).is_some()
    }

    pub fn get(&self, id: &RequestId) -> Option<&Request> {
        self.find(id).map(|slot| &self.slots[slot as usize].1)
    }

    pub fn get_mut(&mut self, id: &RequestId) -> Option<&mut Request> {
        self.find(id).map(|slot| &mut self.slots[slot as usize].1)
    }

    /// The slot of live request `id`, for an operation that reads and changes its record at
    /// several points ([`Requests::at`], [`Requests::at_mut`]) with one lookup. The slot stays the
    /// request's until it ends.
    pub fn slot(&self, id: &RequestId) -> Option<RequestSlot> {
        self.find(id).map(RequestSlot)
    }

    /// The record in `slot`.
    pub fn at(&self, slot: RequestSlot) -> &Request {
        &self.slots[slot.0 as usize].1
    }

    /// The record in `slot`.
    pub fn at_mut(&mut self, slot: RequestSlot) -> &mut Request {
        &mut self.slots[slot.0 as usize].1
    }

    /// Makes `id` live with an empty record (its buffers kept from an ended request), or `None`
    /// if it is live already.
    #[inline]
    pub fn start(&mut self, id: RequestId) -> Option<&mut Request> {
        // The slot it would take: a freed one, else a new one at the end.
        let slot = match self.free.last() {
            Some(&slot) => slot,
            None => u32::try_from(self.slots.len()).expect("fewer than 2^32 live requests"),
        };
        if !self.index.insert_new(id, slot) {
            return None;
        }
        if self.free.pop().is_some() {
            self.slots[slot as usize].1.clear();
        } else {
            self.slots.push((id, Request::default()));
        }
        self.latest = Some((id, slot));
        let (slot_id, record) = &mut self.slots[slot as usize];
        *slot_id = id;
        Some(record)
    }

    /// Ends `id`: frees its slot, and returns its record, which stays in the slot to be read
    /// until the next request starts there.
    #[inline]
    pub fn remove(&mut self, id: &RequestId) -> Option<&mut Request> {
        let slot = self.index.remove(id)?;
        if self.latest.is_some_and(|(latest, _)| latest == *id) {
            self.latest = None;
        }
        self.free.push(slot);
        Some(&mut self.slots[slot as usize].1)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&RequestId, &Request)> + '_ {
        self.index.iter().map(|(id, &slot)| (id, &self.slots[slot as usize].1))
    }

    pub fn values(&self) -> impl Iterator<Item = &Request> + '_ {
        self.iter().map(|(_, record)| record)
    }

    /// Ends every request for which `keep` is false.
    pub fn retain(&mut self, mut keep: impl FnMut(&RequestId, &Request) -> bool) {
        let ended: Vec<RequestId> =
            self.iter().filter(|(id, record)| !keep(id, record)).map(|(&id, _)| id).collect();
        for id in ended {
            self.remove(&id);
        }
    }
}

impl<'a> IntoIterator for &'a Requests {
    type Item = (&'a RequestId, &'a Request);
    type IntoIter = Box<dyn Iterator<Item = (&'a RequestId, &'a Request)> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

impl std::ops::Index<&RequestId> for Requests {
    type Output = Request;

    fn index(&self, id: &RequestId) -> &Request {
        self.get(id).expect("indexing an unknown request is a programming error")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::xorshift;
    use std::collections::HashMap;

    /// Every way of finding a request (`get`, `get_mut`, `slot`, `contains_key`, indexing)
    /// agrees with a hash map after random starts, ends and lookups: the latest request's slot
    /// kept beside the index (`latest`) is its slot while it lives, and nobody's once it ends
    /// (its id then unknown, or another request's under the same id).
    #[test]
    fn lookups_through_the_latest_request_agree_with_a_hash_map() {
        for ids in [3u64, 20, 500] {
            let mut requests = Requests::default();
            let mut model: HashMap<RequestId, usize> = HashMap::new();
            let mut state = 0x5eed_0f1a_7e57 ^ ids;
            for step in 0..20_000usize {
                let id = RequestId(xorshift(&mut state) % ids);
                match xorshift(&mut state) % 5 {
                    0 | 1 => {
                        let started = requests.start(id).map(|record| record.tokens = step);
                        assert_eq!(started.is_some(), !model.contains_key(&id), "step {step}");
                        model.entry(id).or_insert(step);
                    }
                    2 => {
                        let ended = requests.remove(&id).map(|record| record.tokens);
                        assert_eq!(ended, model.remove(&id), "step {step}");
                    }
                    3 => {
                        if let Some(record) = requests.get_mut(&id) {
                            record.tokens += 1;
                        }
                        if let Some(tokens) = model.get_mut(&id) {
                            *tokens += 1;
                        }
                    }
                    _ => {}
                }
                // Every id, the latest included, is found as the map finds it.
                for probe in (0..ids.min(20)).map(RequestId).chain([id]) {
                    let expected = model.get(&probe).copied();
                    assert_eq!(requests.get(&probe).map(|r| r.tokens), expected, "step {step}");
                    let by_slot = requests.slot(&probe).map(|slot| requests.at(slot).tokens);
                    assert_eq!(by_slot, expected, "step {step}");
                    assert_eq!(requests.contains_key(&probe), expected.is_some(), "step {step}");
                }
                assert_eq!(requests.len(), model.len());
            }
        }
    }
}
