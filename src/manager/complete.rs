//! `complete_transfer` (DESIGN §4.3): applying a copy that every rank finished, or rolling it back.
//!
//! 1. The blocks the copy kept reserved (for detached pairs) go back to their pools.
//! 2. A copy of an older generation changes nothing else: its nodes were dropped by the reset.
//! 3. Each attached pair moves its node on:
//!    - device-to-host landed: a backup (or cancelled eviction) leaves the node on device with a
//!      host backup; an eviction frees the device block (unless claimed) and the node is `Host`;
//!    - device-to-host failed: the host block is freed; the node stays on device, or, if its
//!      device block was claimed, it has no copy left and leaves the tree with its subtree;
//!    - host-to-device landed: the node is `Device` with its host copy as a backup;
//!    - host-to-device failed: the device block is freed and the node is `Host` again, and so is
//!      every device copy below it: those are swap-ins held back behind this one (see
//!      `allocate`), so they are cancelled before any worker saw them.
//!    - a STORE or LOAD: see [`super::storage`]; one the tier failed for marks it down
//!      ([`super::tier_health`]).
//! 4. Every ticket waiting on it counts it done; a failed swap-in fails them and their requests.
//!    A LOAD never fails a ticket: its misses shorten the hits of the requests waiting on it
//!    ([`super::load_outcome`]).

use super::load_outcome::{BlockOutcome, LoadOutcome};
use super::transfer::{BlockPair, InFlight};
use super::{CacheManager, CompleteError, TicketId, TransferFailure, TransferId, TransferKind};
use crate::tree::{NodeId, NodeState, SwapOut};

impl CacheManager {
    /// Applies the outcome of copy `id` (module flow). Call it once per copy, when every rank has
    /// reported: `Ok` when all succeeded, the first failure otherwise. For a storage copy (STORE or
    /// LOAD) a failure is an error of the whole command: a miss for every block, none of them
    /// known to be gone (see [`CacheManager::complete_storage_transfer`] for per-block results). An
    /// unknown id (never made, or completed already) or one not handed out yet
    /// ([`CacheManager::take_transfers`]) is an error that changes nothing.
    pub fn complete_transfer(
        &mut self,
        id: TransferId,
        outcome: Result<(), TransferFailure>,
    ) -> Result<(), CompleteError> {
        self.check_completable(id)?;
        let flight = self.in_flight.remove(&id).expect("checked just above");
        if flight.kind.is_storage() {
            let outcome = match outcome {
                Ok(()) => LoadOutcome::AllLanded,
                Err(failure) => LoadOutcome::Unavailable(failure),
            };
            self.complete_storage(id, flight, outcome);
            return Ok(());
        }
        let Err(failure) = outcome else {
            let Some(flight) = self.release_completed(flight, true) else { return Ok(()) };
            // The usual completions, of an allocation's evictions or of its hits' swap-ins: one
            // pass over the nodes.
            match flight.kind {
                TransferKind::DeviceToHost => self.swap_outs_landed(id, &flight.nodes),
                TransferKind::HostToDevice => {
                    self.swap_ins_landed(id, &flight.pairs, &flight.nodes);
                }
                TransferKind::HostToStorage | TransferKind::StorageToHost => {
                    unreachable!("storage copies complete in complete_storage")
                }
            }
            self.resolve_tickets(&flight.tickets, None);
            self.recycle_flight(flight);
            return Ok(());
        };
        self.roll_back(id, flight, failure);
        Ok(())
    }

    /// Rolls back device copy `id` (`flight`, out of the in-flight table already), which
    /// failed with `failure` (module flow, steps 3 and 4): each attached pair is undone.
    #[cold]
    fn roll_back(&mut self, id: TransferId, flight: Box<InFlight>, failure: TransferFailure) {
        let Some(flight) = self.release_completed(flight, false) else { return };
        for (pair, &node) in flight.pairs.iter().zip(&flight.nodes) {
            if self.tree.attached_to(node, id.0).is_none() {
                continue;
            }
            match flight.kind {
                TransferKind::DeviceToHost => self.swap_out_failed(node, pair.dst),
                TransferKind::HostToDevice => self.swap_in_failed(node, id),
                TransferKind::HostToStorage | TransferKind::StorageToHost => {
                    unreachable!("storage copies complete in complete_storage_transfer")
                }
            }
        }
        // A failed swap-out leaves its nodes where they were (or drops them): only a failed
        // swap-in fails its tickets.
        let failure = (flight.kind == TransferKind::HostToDevice).then_some(failure);
        self.resolve_tickets(&flight.tickets, failure);
        self.recycle_flight(flight);
    }

    /// Applies the outcome of storage copy `id` (a STORE or a LOAD), block by block:
    /// `Ok(Some(blocks))` with one [`BlockOutcome`] per pair, in the order of the copy's pairs,
    /// `Ok(None)` when every block landed, `Err` when the whole command failed (a worker error,
    /// a dead worker, a whole command its owner reports failed for the tier: every block
    /// unavailable, none known to be gone).
    /// A STORE keeps the blocks that landed; a LOAD's misses shorten the hits of the requests
    /// waiting on it, never fail them (see [`super::load_outcome`]). An id
    /// [`CacheManager::complete_transfer`] refuses, or a copy that is not a storage copy, is an
    /// error that changes nothing; so is a wrong number of outcomes.
    pub fn complete_storage_transfer(
        &mut self,
        id: TransferId,
        outcome: Result<Option<&[BlockOutcome]>, TransferFailure>,
    ) -> Result<(), CompleteError> {
        self.check_completable(id)?;
        let flight = self.in_flight.get(&id).expect("checked just above");
        if !flight.kind.is_storage() {
            return Err(CompleteError::NotStorage(id));
        }
        if let Ok(Some(landed)) = outcome {
            if landed.len() != flight.pairs.len() {
                return Err(CompleteError::BlockCount {
                    transfer: id,
                    expected: flight.pairs.len(),
                    got: landed.len(),
                });
            }
        }
        let flight = self.in_flight.remove(&id).expect("found just above");
        let outcome = match outcome {
            Ok(None) => LoadOutcome::AllLanded,
            Ok(Some(blocks)) => LoadOutcome::Blocks(blocks),
            Err(failure) => LoadOutcome::Unavailable(failure),
        };
        self.complete_storage(id, flight, outcome);
        Ok(())
    }

    /// Whether copy `id` can have completed: it is in flight and was handed out. A copy still
    /// in the outbox names blocks no worker wrote, and swap-ins held back behind it.
    fn check_completable(&self, id: TransferId) -> Result<(), CompleteError> {
        match self.in_flight.get(&id) {
            None => Err(CompleteError::UnknownTransfer(id)),
            Some(flight) if !flight.issued => Err(CompleteError::NotIssued(id)),
            Some(_) => Ok(()),
        }
    }

    /// Applies storage copy `id`'s outcome; `flight` is out of the in-flight table already.
    pub(super) fn complete_storage(
        &mut self,
        id: TransferId,
        flight: Box<InFlight>,
        outcome: LoadOutcome,
    ) {
        // A block the tier missed is a miss, counted per block; only a whole command that failed
        // is a failed copy.
        let command_done = !matches!(outcome, LoadOutcome::Unavailable(_));
        let Some(flight) = self.release_completed(flight, command_done) else { return };
        // Marked down before this copy is applied (a shortening's evictions must not write
        // back), the copies not yet handed out settled after (`tier_health`).
        let outage = super::tier_health::outcome_trips_breaker(&outcome) && self.mark_tier_down();
        if flight.kind == TransferKind::StorageToHost {
            self.complete_load(id, flight, outcome);
        } else {
            self.complete_store(id, flight, outcome);
        }
        if outage {
            self.settle_unissued_storage_copies();
        }
    }

    /// Applies STORE `id`'s outcome; `flight` is out of the in-flight table already.
    fn complete_store(&mut self, id: TransferId, flight: Box<InFlight>, outcome: LoadOutcome) {
        for (index, &node) in flight.nodes.iter().enumerate() {
            let attached = self.tree.attached_to(node, id.0).is_some();
            if attached {
                self.store_completed(node, outcome.landed(index));
            } else {
                // Its node left the tree meanwhile: the tier must not keep what it wrote.
                self.forget_detached(flight.blocks[index].hash);
            }
        }
        self.resolve_tickets(&flight.tickets, None);
        self.recycle_flight(flight);
    }

    /// Gives back the blocks completed copy `flight` kept reserved (module flow, steps 1 and 2).
    /// `None` when it was of an older generation: nothing else changes.
    fn release_completed(
        &mut self,
        flight: Box<InFlight>,
        succeeded: bool,
    ) -> Option<Box<InFlight>> {
        for &block in &flight.reserved_device {
            self.free_device(block);
        }
        for &block in &flight.reserved_host {
            self.free_host(block);
        }
        if flight.generation != self.generation {
            self.stats.stale_completions += 1;
            self.recycle_flight(flight);
            return None;
        }
        if !succeeded {
            self.stats.failed_transfers += 1;
        }
        Some(flight)
    }

    /// Counts a copy done for each ticket waiting on it, failing them with `failure`.
    pub(super) fn resolve_tickets(
        &mut self,
        tickets: &[TicketId],
        failure: Option<TransferFailure>,
    ) {
        for ticket_id in tickets {
            let Some(ticket) = self.tickets.get_mut(ticket_id) else { continue };
            ticket.pending -= 1;
            if failure.is_some() {
                ticket.failure = failure;
            } else if ticket.pending > 0 {
                // Still waiting, and nothing failed: its request has nothing to hear yet.
                continue;
            }
            if let Some(request) = ticket.request.and_then(|id| self.requests.get_mut(&id)) {
                request.failed |= failure.is_some();
                if ticket.pending == 0 {
                    request.pending_tickets -= 1;
                }
            }
        }
    }

    /// Swap-out `id`, serving `nodes` (one per pair), landed (module flow, step 3): each node
    /// still attached moves on by what its swap-out was for ([`SwapOut`]): a backup stays on
    /// device with its host copy; an eviction settles on host, its device block back to the
    /// pool unless an allocation claimed it already.
    fn swap_outs_landed(&mut self, id: TransferId, nodes: &[NodeId]) {
        for &node in nodes {
            let Some(record) = self.tree.attached_to(node, id.0) else { continue };
            let NodeState::SwapToHost(swap) = record.state() else {
                unreachable!("a node attached to a swap-out is swapping out")
            };
            let device = record.device();
            match swap {
                SwapOut::Backup => {
                    self.stats.backup_blocks += 1;
                    self.tree.update(node, |node| {
                        node.set_state(NodeState::Device);
                        node.set_transfer(None);
                    });
                }
                SwapOut::Evict | SwapOut::Claimed => {
                    self.stats.swap_out_blocks += 1;
                    if let Some(block) = device {
                        self.free_device(block);
                    }
                    self.settle_on_host(node);
                }
            }
        }
    }

    /// Swap-in `id`, serving `nodes` (one per pair of `pairs`), landed (module flow, step 3): each
    /// node still attached is `Device`, and a host copy that only passed through (a LOAD's) goes
    /// back to the pool.
    fn swap_ins_landed(&mut self, id: TransferId, pairs: &[BlockPair], nodes: &[NodeId]) {
        for (pair, &node) in pairs.iter().zip(nodes) {
            let Some(record) = self.tree.attached_to(node, id.0) else { continue };
            let passing = record.passing_through_host();
            self.tree.update(node, |node| {
                node.set_state(NodeState::Device);
                node.set_transfer(None);
                if passing {
                    node.set_host(None);
                    node.set_passing_through_host(false);
                }
            });
            if passing {
                self.free_host(pair.src);
            }
            self.stats.swap_in_blocks += 1;
        }
    }

    fn swap_out_failed(&mut self, id: NodeId, host_block: u32) {
        self.free_host(host_block);
        let claimed = self.tree.node(id).state() == NodeState::SwapToHost(SwapOut::Claimed);
        self.tree.update(id, |node| {
            node.set_host(None);
            node.set_state(if claimed { NodeState::Host } else { NodeState::Device });
            node.set_transfer(None);
        });
        if claimed {
            // No copy left: the node (unheld, since a match stops at a claimed node) leaves the
            // tree, and with it the host-only nodes below that no match could reach any more.
            self.drop_subtree(id);
        }
    }

    fn swap_in_failed(&mut self, id: NodeId, transfer: TransferId) {
        // Device copies below were swapped in behind this one; undo them first so that device
        // residency stays prefix-closed.
        let mut below: Vec<NodeId> = self
            .tree
            .children(id)
            .filter(|&child| self.tree.node(child).device().is_some())
            .collect();
        while let Some(child) = below.pop() {
            below.extend(
                self.tree
                    .children(child)
                    .filter(|&grandchild| self.tree.node(grandchild).device().is_some()),
            );
            self.demote_to_host(child, transfer);
        }
        let block = self.tree.node(id).device().expect("a swap-in has its destination");
        self.free_device(block);
        self.settle_on_host(id);
    }

    /// Takes a node swapped in below a failed swap-in back to `Host`. `failed` is the copy being
    /// rolled back right now (already out of the in-flight table); any other swap-in of a node
    /// below it is held back behind it, so it is cancelled: its pair is removed, and a copy left
    /// with no pairs is forgotten.
    fn demote_to_host(&mut self, id: NodeId, failed: TransferId) {
        let node = self.tree.node(id);
        let block = node.device().expect("demoting a node without a device block");
        match node.state() {
            NodeState::SwapToDevice if node.transfer() == Some(failed.0) => self.free_device(block),
            NodeState::SwapToDevice => {
                let transfer =
                    TransferId(node.transfer().expect("a node in flight names its copy"));
                self.cancel_swap_in(id, transfer, block);
            }
            NodeState::StorageToHost => {
                self.abandon_load(id);
                return;
            }
            state => unreachable!(
                "a device copy in state {state:?} below a swap-in is a programming error"
            ),
        }
        self.settle_on_host(id);
    }

    /// Node `id` no longer has a device copy and no copy in flight: it is a host node now. The
    /// caller has given its device block to whoever owns it next.
    fn settle_on_host(&mut self, id: NodeId) {
        self.tree.update(id, |node| {
            node.set_device(None);
            node.set_state(NodeState::Host);
            node.set_transfer(None);
            node.set_passing_through_host(false);
        });
        self.settled_on_host(id);
    }

    /// Removes the pair of node `id` from swap-in `transfer`, which no worker has seen yet, and
    /// gives its destination `block` back, or to the swap-out still reading it if it was claimed
    /// from one.
    fn cancel_swap_in(&mut self, id: NodeId, transfer: TransferId, block: u32) {
        let flight =
            self.in_flight.get_mut(&transfer).expect("the copy of a node in flight is known");
        assert!(!flight.issued, "a swap-in below a failed one was issued: a programming error");
        let index = flight
            .nodes
            .iter()
            .position(|&node| node == id)
            .expect("a copy serves the node naming it");
        flight.nodes.swap_remove(index);
        flight.pairs.swap_remove(index);
        let (after, empty) = (flight.after.clone(), flight.pairs.is_empty());
        if empty {
            self.forget_empty_swap_in(transfer, &[]);
        }
        self.release_swap_in_destination(&after, block);
    }

    /// Forgets `swap_in`, left with no pairs before any worker saw it: its tickets count it done,
    /// and the blocks it kept reserved (of nodes dropped meanwhile) go back. A device block goes
    /// to the swap-out still reading it, if claimed from one; a host block, written by the LOAD
    /// in front of the swap-in, to that LOAD if it is still in flight, else (it completed, or was
    /// cancelled before it ran and waited on `load_after`) to the STORE still reading it, if
    /// claimed from one, or to the pool.
    pub(super) fn forget_empty_swap_in(&mut self, swap_in: TransferId, load_after: &[TransferId]) {
        let flight = self.in_flight.remove(&swap_in).expect("forgetting a swap-in in flight");
        self.resolve_tickets(&flight.tickets, None);
        for &block in &flight.reserved_device {
            self.release_swap_in_destination(&flight.after, block);
        }
        if !flight.reserved_host.is_empty() {
            let load = self
                .in_flight
                .iter()
                .find(|(_, load)| load.then == Some(swap_in))
                .map(|(&id, _)| id);
            match load {
                Some(load) => {
                    let load = self.in_flight.get_mut(&load).expect("found just above");
                    load.reserved_host.extend_from_slice(&flight.reserved_host);
                }
                None => {
                    for &block in &flight.reserved_host {
                        self.release_host_block(load_after, block);
                    }
                }
            }
        }
        self.recycle_flight(flight);
    }

    /// Gives back `block`, the destination of a cancelled swap-in that waited on the copies
    /// `after`: to the swap-out still reading it if it was claimed from one, else to the pool.
    pub(super) fn release_swap_in_destination(&mut self, after: &[TransferId], block: u32) {
        match self.swap_out_reading(after, block) {
            Some(reader) => self
                .in_flight
                .get_mut(&reader)
                .expect("found just above")
                .reserved_device
                .push(block),
            None => self.free_device(block),
        }
    }

    /// The swap-out among `after` still reading device `block`, if any.
    pub(super) fn swap_out_reading(&self, after: &[TransferId], block: u32) -> Option<TransferId> {
        after.iter().copied().find(|before| {
            self.in_flight.get(before).is_some_and(|flight| {
                flight.kind == TransferKind::DeviceToHost
                    && flight.pairs.iter().any(|pair| pair.src == block)
            })
        })
    }
}
