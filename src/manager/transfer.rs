//! Copies between the tiers, and the tickets that wait on them.
//!
//! A [`Transfer`] is what leaves the manager: one direction, a list of (src, dst) block pairs and
//! the generation it was issued in. A copy to or from the storage tier (a STORE or a LOAD) names
//! its host block in each pair (as both src and dst) and the block's hash, parent hash and depth
//! in [`StorageBlock`]s beside the pairs. Inside, an [`InFlight`] remembers whom each pair serves (a
//! node, by id) and which tickets wait on it, until `complete_transfer` applies or rolls it back.
//!
//! A pair stays attached to its node while the node is live and names this copy as its one copy
//! in flight; a node removed meanwhile (a dropped subtree, a reset) is detached, and the blocks the
//! copy still touches move to the copy's reserved lists so that nobody reuses them before the
//! completion arrives.
//!
//! The manager's side: an operation fills at most one open copy per direction
//! (`open_transfer`, opened on first use, with a spare record when one is kept), each pair naming
//! its node; at the operation's end `close_transfers` moves them to the in-flight table and the
//! outbox, dependencies first, and `take_transfers` hands them out, a swap-in held back while a
//! swap-out it depends on still reads its blocks. Tickets count the copies they wait on.

use std::fmt;

pub use kvshm_ipc::record::{BlockPair, CommandError};
use serde::Serialize;

use super::{CacheManager, RequestId};
use crate::tree::{NodeId, NodeState, SwapOut};

/// Copy records kept for reuse at most: more than the copies of a busy step.
const MAX_SPARES: usize = 1024;

/// Names one copy; increasing, never 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct TransferId(pub u64);

/// The direction of a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferKind {
    /// Device blocks (src) to host blocks (dst): a swap-out or a backup.
    DeviceToHost,
    /// Host blocks (src) to device blocks (dst): a swap-in.
    HostToDevice,
    /// Host blocks written to the storage tier (a worker STORE): a write-back or write-through.
    HostToStorage,
    /// Storage blocks read into host blocks (a worker LOAD); a swap-in follows in the ticket.
    StorageToHost,
}

impl TransferKind {
    /// Whether the copy moves blocks to or from the storage tier.
    pub fn is_storage(self) -> bool {
        matches!(self, TransferKind::HostToStorage | TransferKind::StorageToHost)
    }
}

/// What the storage tier names a block by: its hash, and where it hangs (parent hash, 0 for a
/// prompt's first block; depth, its position in the prompt from 0), which a restarted service
/// needs to rebuild its tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StorageBlock {
    pub hash: crate::hash::BlockHash,
    pub parent: crate::hash::BlockHash,
    pub depth: u32,
}

/// A copy for the workers to carry out on every rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transfer {
    pub id: TransferId,
    pub kind: TransferKind,
    pub pairs: Vec<BlockPair>,
    /// One per pair for a storage copy, empty otherwise.
    pub blocks: Vec<StorageBlock>,
    pub generation: u64,
}

/// Why a copy failed, as a worker (or the service, for a dead worker) reported it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransferFailure {
    pub rank: u32,
    pub error: CommandError,
    pub detail: u64,
}

impl fmt::Display for TransferFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "copy failed on rank {}: {:?} (detail {})", self.rank, self.error, self.detail)
    }
}

impl std::error::Error for TransferFailure {}

/// Names what an allocation must wait for before the engine touches its blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct TicketId(pub u64);

/// Whether the blocks of an allocation are ready.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TicketStatus {
    /// Every copy it waited on has landed (or it waited on none).
    Ready,
    /// Every copy it waited on has completed, but the storage tier missed some of its hits: the
    /// first `cached_blocks` positions of the request's block table hold cached KV, and the
    /// engine computes the rest into the blocks the table gives *now* (they are the request's
    /// own, committed as usual). From `cached_blocks` on the table may have changed since
    /// `allocate`: a request that shared a LOAD with another one gets blocks of its own there.
    /// Read [`CacheManager::block_table`](super::CacheManager::block_table) again.
    Shortened { cached_blocks: u32 },
    /// Some copies are still in flight.
    Pending,
    /// A device copy that it waited on failed (a copy error, or a worker that died during a
    /// swap-in), or, rarely, a storage miss shortened a request that shared the lost blocks with
    /// another one and no device block could be had for it (`CommandError::StorageMiss`,
    /// counted in `shortening_failed`): the request must be aborted. A storage miss otherwise
    /// never fails a ticket (it shortens the hit), and a prefetch's ticket never fails.
    Failed(TransferFailure),
}

/// The manager's record of one ticket.
#[derive(Clone, Debug)]
pub(crate) struct Ticket {
    /// The request it serves; `None` for a prefetch.
    pub request: Option<RequestId>,
    /// Copies in flight that it waits on.
    pub pending: u32,
    pub failure: Option<TransferFailure>,
    /// Set when a LOAD's miss shortened the request's hit: the positions still cached.
    pub cached_blocks: Option<u32>,
}

impl Ticket {
    pub fn status(&self) -> TicketStatus {
        match (self.failure, self.pending, self.cached_blocks) {
            (Some(failure), _, _) => TicketStatus::Failed(failure),
            (None, 0, None) => TicketStatus::Ready,
            (None, 0, Some(cached_blocks)) => TicketStatus::Shortened { cached_blocks },
            (None, _, _) => TicketStatus::Pending,
        }
    }
}

/// The manager's record of one copy in flight. Boxed wherever the manager keeps it (open,
/// in flight, spare), so that opening, closing, completing and recycling a copy moves a pointer
/// rather than the record.
#[derive(Clone, Debug)]
pub(crate) struct InFlight {
    pub kind: TransferKind,
    pub generation: u64,
    pub pairs: Vec<BlockPair>,
    /// The storage names of the pairs' blocks (storage copies only).
    pub blocks: Vec<StorageBlock>,
    /// The node each pair serves (attached while that node names this copy).
    pub nodes: Vec<NodeId>,
    pub tickets: Vec<TicketId>,
    /// Device blocks this copy keeps from reuse until it completes (of detached pairs, and
    /// sources claimed by requests that ended first).
    pub reserved_device: Vec<u32>,
    /// Host blocks this copy keeps from reuse until it completes.
    pub reserved_host: Vec<u32>,
    /// Copies that must complete before this one is handed out: a swap-in into device blocks
    /// claimed from swap-outs still reading them.
    pub after: Vec<TransferId>,
    /// Whether it has been handed out by `take_transfers`.
    pub issued: bool,
    /// For a LOAD: the swap-in that copies its blocks on to the device once it lands.
    pub then: Option<TransferId>,
}

/// A copy handed out by [`super::CacheManager::take_transfers_with`], borrowed for the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransferView<'a> {
    pub id: TransferId,
    pub kind: TransferKind,
    pub pairs: &'a [BlockPair],
    /// One per pair for a storage copy, empty otherwise.
    pub blocks: &'a [StorageBlock],
    pub generation: u64,
}

impl TransferView<'_> {
    pub fn to_transfer(&self) -> Transfer {
        Transfer {
            id: self.id,
            kind: self.kind,
            pairs: self.pairs.to_vec(),
            blocks: self.blocks.to_vec(),
            generation: self.generation,
        }
    }
}

impl InFlight {
    /// This record emptied for another copy, its buffers kept.
    pub fn recycled(mut self: Box<Self>, kind: TransferKind, generation: u64) -> Box<InFlight> {
        // Every field named, so that a new one is not forgotten here.
        let InFlight {
            kind: old_kind,
            generation: old_generation,
            pairs,
            blocks,
            nodes,
            tickets,
            reserved_device,
            reserved_host,
            after,
            issued,
            then,
        } = &mut *self;
        pairs.clear();
        blocks.clear();
        nodes.clear();
        tickets.clear();
        reserved_device.clear();
        reserved_host.clear();
        after.clear();
        (*old_kind, *old_generation, *issued, *then) = (kind, generation, false, None);
        self
    }

    pub fn new(kind: TransferKind, generation: u64) -> InFlight {
        InFlight {
            kind,
            generation,
            pairs: Vec::new(),
            blocks: Vec::new(),
            nodes: Vec::new(),
            tickets: Vec::new(),
            reserved_device: Vec::new(),
            reserved_host: Vec::new(),
            after: Vec::new(),
            issued: false,
            then: None,
        }
    }

    /// Adds `ticket` to the waiters unless it is there already; returns whether it was added.
    pub fn add_ticket(&mut self, ticket: TicketId) -> bool {
        if self.tickets.contains(&ticket) {
            return false;
        }
        self.tickets.push(ticket);
        true
    }
}

/// Where a copy stands in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferStage {
    /// Created, not yet handed out by `take_transfers` (held back behind other copies, or not
    /// taken yet): no worker has seen it, no byte has moved.
    Queued,
    /// Handed out; the workers may be copying it.
    Issued,
    /// Not in flight: it completed (or was rolled back, or never existed).
    Done,
}

impl CacheManager {
    /// Where copy `id` stands.
    pub fn transfer_stage(&self, id: TransferId) -> TransferStage {
        match self.in_flight.get(&id) {
            Some(flight) if flight.issued => TransferStage::Issued,
            Some(_) => TransferStage::Queued,
            None => TransferStage::Done,
        }
    }
}

/// The copies an operation fills, handing them out, and the tickets that wait on them.
impl CacheManager {
    /// Hands out the copies created since the last call, oldest first.
    pub fn take_transfers(&mut self) -> Vec<Transfer> {
        let mut transfers = Vec::with_capacity(self.outbox.len());
        self.take_transfers_into(&mut transfers);
        transfers
    }

    /// Like [`CacheManager::take_transfers`], appending to `out`.
    pub fn take_transfers_into(&mut self, out: &mut Vec<Transfer>) {
        self.take_transfers_with(|transfer| out.push(transfer.to_transfer()));
    }

    /// Hands out the copies created since the last call, oldest first, each lent to `issue`
    /// for the call: nothing is copied or allocated. A swap-in into blocks that a swap-out still
    /// reads stays behind until that swap-out completes.
    pub fn take_transfers_with(&mut self, mut issue: impl FnMut(TransferView<'_>)) {
        // The usual call, after an operation that started no copy.
        if self.outbox.is_empty() {
            return;
        }
        let in_flight = &mut self.in_flight;
        self.outbox.retain(|id| {
            // A copy cancelled or settled before it was taken is gone from `in_flight`: drop it.
            let Some(flight) = in_flight.get(id) else { return false };
            if flight.after.iter().any(|before| in_flight.contains_key(before)) {
                return true;
            }
            let flight = in_flight.get_mut(id).expect("found just above");
            flight.issued = true;
            issue(TransferView {
                id: *id,
                kind: flight.kind,
                pairs: &flight.pairs,
                blocks: &flight.blocks,
                generation: flight.generation,
            });
            false
        });
    }

    /// The copy of `kind` that the current operation fills, opened on first use.
    #[inline] // once per block of a swap-out or swap-in: a call would cost more than the lookup
    pub(super) fn open_transfer(&mut self, kind: TransferKind) -> (TransferId, &mut InFlight) {
        if self.open_slot(kind).is_none() {
            self.open_new_transfer(kind);
        }
        let (id, flight) = self.open_slot(kind).as_mut().expect("opened just above");
        (*id, flight)
    }

    /// Opens the copy of `kind` for the current operation, with a spare record if one is kept.
    pub(super) fn open_new_transfer(&mut self, kind: TransferKind) {
        let id = TransferId(self.next_transfer);
        self.next_transfer += 1;
        let flight = match self.spare_flights.pop() {
            Some(spare) => spare.recycled(kind, self.generation),
            None => Box::new(InFlight::new(kind, self.generation)),
        };
        *self.open_slot(kind) = Some((id, flight));
    }

    #[inline]
    pub(super) fn open_slot(
        &mut self,
        kind: TransferKind,
    ) -> &mut Option<(TransferId, Box<InFlight>)> {
        match kind {
            TransferKind::DeviceToHost => &mut self.open_device_to_host,
            TransferKind::HostToDevice => &mut self.open_host_to_device,
            TransferKind::HostToStorage => &mut self.open_host_to_storage,
            TransferKind::StorageToHost => &mut self.open_storage_to_host,
        }
    }

    /// Moves the copies the current operation filled to the in-flight table and the outbox.
    #[inline]
    pub(super) fn close_transfers(&mut self) {
        // The usual operation opened none.
        if self.open_host_to_storage.is_some()
            || self.open_device_to_host.is_some()
            || self.open_storage_to_host.is_some()
            || self.open_host_to_device.is_some()
        {
            self.close_open_transfers();
        }
    }

    /// [`CacheManager::close_transfers`] once some copy was opened.
    pub(super) fn close_open_transfers(&mut self) {
        // In the order copies depend on each other (a swap-out or load into a host block waits
        // for the store reading it; a swap-in for the load); checked before taking, so that the
        // common case (no copy) moves no record around.
        for kind in [
            TransferKind::HostToStorage,
            TransferKind::DeviceToHost,
            TransferKind::StorageToHost,
            TransferKind::HostToDevice,
        ] {
            if let Some((id, flight)) = self.open_slot(kind).take() {
                let fresh = self.in_flight.insert_new(id, flight);
                debug_assert!(fresh, "copy ids are never reused");
                self.outbox.push(id);
            }
        }
    }

    /// The in-flight record of `id`, open or closed.
    pub(super) fn flight_mut(&mut self, id: TransferId) -> Option<&mut InFlight> {
        for (open_id, flight) in [
            &mut self.open_device_to_host,
            &mut self.open_host_to_device,
            &mut self.open_host_to_storage,
            &mut self.open_storage_to_host,
        ]
        .into_iter()
        .flatten()
        {
            if *open_id == id {
                return Some(flight);
            }
        }
        self.in_flight.get_mut(&id).map(|flight| &mut **flight)
    }

    /// A new ticket of `request`, waiting on nothing yet (see [`CacheManager::wait_on`]).
    pub(super) fn new_ticket(&mut self, request: RequestId) -> TicketId {
        let id = self.take_ticket_id();
        self.record_ticket(id, request, 0);
        id
    }

    /// The next ticket id (ids are never reused), for a ticket recorded once what it waits on
    /// is known ([`CacheManager::record_ticket`]).
    pub(super) fn take_ticket_id(&mut self) -> TicketId {
        let id = TicketId(self.next_ticket);
        self.next_ticket += 1;
        id
    }

    /// Records ticket `id` of `request`, waiting on `pending` copies (which name it already).
    pub(super) fn record_ticket(&mut self, id: TicketId, request: RequestId, pending: u32) {
        let ticket = Ticket { request: Some(request), pending, failure: None, cached_blocks: None };
        let fresh = self.tickets.insert_new(id, ticket);
        debug_assert!(fresh, "ticket ids are never reused");
    }

    /// Makes `ticket` wait on copy `transfer` (once).
    pub(super) fn wait_on(&mut self, ticket: TicketId, transfer: TransferId) {
        let added = self
            .flight_mut(transfer)
            .expect("waiting on a copy that is not in flight is a programming error")
            .add_ticket(ticket);
        if added {
            let record = self.tickets.get_mut(&ticket).expect("a ticket just made is known");
            if record.pending == 0 {
                if let Some(request) = record.request.and_then(|id| self.requests.get_mut(&id)) {
                    request.pending_tickets += 1;
                }
            }
            record.pending += 1;
        }
    }

    /// Keeps the buffers of a copy that completed, for the next one.
    pub(super) fn recycle_flight(&mut self, flight: Box<InFlight>) {
        if self.spare_flights.len() < MAX_SPARES {
            self.spare_flights.push(flight);
        }
    }

    /// Gives a device block to a host-resident node that the allocating request holds (a hit),
    /// and starts its swap-in (within the current operation's host-to-device copy).
    pub(super) fn start_swap_in(&mut self, id: NodeId, block: u32) -> TransferId {
        let host = self.tree.node(id).host().expect("a host node has a host block");
        let (transfer, flight) = self.open_transfer(TransferKind::HostToDevice);
        flight.pairs.push(kvshm_ipc::record::BlockPair::new(host, block));
        flight.nodes.push(id);
        self.tree.update(id, |node| {
            node.set_device(Some(block));
            node.set_state(NodeState::SwapToDevice);
            node.set_transfer(Some(transfer.0));
        });
        transfer
    }

    /// Starts copying a device node to `host_block` (within the current operation's
    /// device-to-host copy), as a backup, an eviction whose block stays claimable, or one whose
    /// block the caller claims at once (it leaves the node now).
    pub(super) fn start_swap_out(
        &mut self,
        id: NodeId,
        host_block: u32,
        swap: SwapOut,
    ) -> TransferId {
        let transfer = self.open_swap_out(id, host_block);
        self.tree.update(id, |node| {
            if swap == SwapOut::Claimed {
                node.set_device(None);
            }
            node.set_host(Some(host_block));
            node.set_state(NodeState::SwapToHost(swap));
            node.set_transfer(Some(transfer.0));
        });
        transfer
    }

    /// Adds the pair of node `id` (its device block to `host_block`) to the current operation's
    /// device-to-host copy.
    #[inline]
    pub(super) fn open_swap_out(&mut self, id: NodeId, host_block: u32) -> TransferId {
        let device = self.tree.node(id).device().expect("a device node has a device block");
        let (transfer, flight) = self.open_transfer(TransferKind::DeviceToHost);
        flight.pairs.push(kvshm_ipc::record::BlockPair::new(device, host_block));
        flight.nodes.push(id);
        transfer
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::BlockHash;

    /// A record recycled for another copy keeps nothing of the copy it served: every field is
    /// as a new record's (stale `after` or `then` ids would hold back or cancel the wrong copies;
    /// stale reserved blocks would be freed twice), only its buffers' capacity stays.
    #[test]
    fn a_recycled_record_is_a_new_record_with_its_buffers_kept() {
        let mut used = Box::new(InFlight::new(TransferKind::StorageToHost, 3));
        used.pairs.push(BlockPair::new(1, 1));
        used.blocks.push(StorageBlock { hash: BlockHash(7), parent: BlockHash(6), depth: 2 });
        used.nodes.push(NodeId(5));
        used.tickets.push(TicketId(9));
        used.reserved_device.push(4);
        used.reserved_host.push(8);
        used.after.push(TransferId(2));
        used.issued = true;
        used.then = Some(TransferId(11));
        let capacity = used.pairs.capacity();
        let recycled = used.recycled(TransferKind::DeviceToHost, 4);
        assert_eq!(
            format!("{:?}", *recycled),
            format!("{:?}", InFlight::new(TransferKind::DeviceToHost, 4))
        );
        assert_eq!(recycled.pairs.capacity(), capacity, "the buffers are kept");
    }
}
