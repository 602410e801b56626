//! A LOAD's outcome, block by block: a storage miss is a miss for that block, never a failure of
//! the request (DESIGN §9).
//!
//! The tier answers for each block of a LOAD: landed, missing (the object is absent, corrupt or
//! torn on some rank: the block is gone), unreachable (a rank could not reach the tier for it: it
//! may still be there), or unavailable (the tier failed for it otherwise: it may still be there).
//! An error of the whole command (tier down, a worker error) is an unavailable block for every
//! block of it. Only a gone block is dropped: a missing one, or an unavailable one in a LOAD where
//! the tier answered for other blocks and no block was unreachable (a per-block fault, such as one
//! bad slot: retrying it would only fail again; see `tier_health`, step 1). A LOAD carries one
//! chain of one request's path, block 0 first, so its blocks before the first miss are exactly the
//! part of the hit that still holds.
//!
//! Core types: [`BlockOutcome`] (what the service reports per block), `LoadOutcome` (per
//! copy).
//!
//! 1. The blocks before the first miss land as usual: their swap-in goes on, and layer-wise
//!    readiness is that of the swap-in.
//! 2. From the first miss on, the nodes are lost for this LOAD, and so are the nodes of every LOAD
//!    ordered after it whose blocks hang below a lost one (cancelled, unissued).
//! 3. Every request waiting on those LOADs is shortened where its path first reaches a lost node:
//!    the nodes from there on leave its path (unheld), and their device blocks (the swap-ins'
//!    destinations) become its own blocks, exactly as if its match had ended there; its ticket
//!    says `Shortened { cached_blocks }`. A request sharing a lost node with another one gets a
//!    fresh device block for it (the node's own goes to the first); when none can be had its
//!    ticket fails (counted in `shortening_failed`).
//! 4. The lost nodes are `Storage` again, their pairs leave the swap-ins (a swap-in left with none
//!    is cancelled), and their host blocks go back.
//! 5. A gone block (reported missing, or a per-block fault) is dropped with its subtree as soon
//!    as no request holds it (now, usually: step 3 released the waiting requests). A node still
//!    held (a request matched it and has not allocated) waits in `unloadable` for the next
//!    `poll`; meanwhile it is no hit (matches stop before it) and its holder's allocation cuts
//!    its hits there (`cut_hits_at_lost`) instead of loading it. A holder that computes it and
//!    commits it makes it a device copy no longer counted on storage (`uncount_lost_copies`,
//!    from `commit`).

use super::match_prefix::ends_hits;
use super::transfer::InFlight;
use super::{CacheManager, TicketId, TransferFailure, TransferId, TransferKind};
use crate::tree::NodeId;

/// What the storage tier said about one block of a STORE or LOAD, over every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockOutcome {
    /// Done on every rank: loaded (LOAD) or written (STORE).
    Landed,
    /// Missing or damaged on some rank (a LOAD), or not written (a STORE): the tier does not
    /// have it.
    Missing,
    /// The tier failed for it on some rank (an I/O error) and no rank found it missing: it may
    /// still be there, or this one block may be bad (see [`LoadOutcome::gone`]).
    Unavailable,
    /// A rank could not reach the tier for it (a connection refused or dropped, no answer in
    /// time), whatever the others found: the tier is failing, and the block may still be
    /// there.
    Unreachable,
}

/// What the storage tier said about the blocks of one STORE or LOAD.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LoadOutcome<'a> {
    /// Every block landed.
    AllLanded,
    /// Per block, in the copy's pair order.
    Blocks(&'a [BlockOutcome]),
    /// The whole command failed (a worker error, a dead worker, a whole command its owner
    /// reports failed for the tier): every block missed, none is known to be gone.
    Unavailable(TransferFailure),
}

impl LoadOutcome<'_> {
    pub(super) fn of(&self, index: usize) -> BlockOutcome {
        match self {
            LoadOutcome::AllLanded => BlockOutcome::Landed,
            LoadOutcome::Blocks(blocks) => {
                blocks.get(index).copied().unwrap_or(BlockOutcome::Unavailable)
            }
            LoadOutcome::Unavailable(_) => BlockOutcome::Unavailable,
        }
    }

    pub(super) fn landed(&self, index: usize) -> bool {
        self.of(index) == BlockOutcome::Landed
    }

    /// Whether the tier no longer has block `index` as far as the cache is concerned (module
    /// flow, step 5): reported missing, or unavailable while the tier answered for other blocks
    /// of the command (a per-block fault). An unavailable block of a command the tier failed
    /// ([`super::tier_health::tier_failed`]) may still be there, and so may an unreachable one.
    pub(super) fn gone(&self, index: usize) -> bool {
        let LoadOutcome::Blocks(blocks) = self else { return false };
        match blocks.get(index) {
            Some(BlockOutcome::Missing) => true,
            Some(BlockOutcome::Unavailable) => !super::tier_health::tier_failed(blocks),
            Some(BlockOutcome::Landed | BlockOutcome::Unreachable) | None => false,
        }
    }
}

impl CacheManager {
    /// Applies LOAD `load`'s outcome (module flow); `flight` is its record, out of the in-flight
    /// table already.
    pub(super) fn complete_load(
        &mut self,
        load: TransferId,
        flight: Box<InFlight>,
        outcome: LoadOutcome,
    ) {
        let attached =
            |cache: &CacheManager, node: NodeId| cache.tree.attached_to(node, load.0).is_some();
        // A block whose node left the tree meanwhile is the tier's to forget.
        for (index, &node) in flight.nodes.iter().enumerate() {
            if !attached(self, node) {
                self.forget_detached(flight.blocks[index].hash);
            }
        }
        // Step 1: the chain up to its first miss lands.
        let first_miss = (0..flight.nodes.len())
            .find(|&index| attached(self, flight.nodes[index]) && !outcome.landed(index));
        let landed_end = first_miss.unwrap_or(flight.nodes.len());
        for &node in &flight.nodes[..landed_end] {
            if attached(self, node) {
                let swap_in = self.swap_in_behind(load, flight.then, node);
                self.load_landed(node, swap_in);
            }
        }
        let Some(first_miss) = first_miss else {
            self.resolve_tickets(&flight.tickets, None);
            self.recycle_flight(flight);
            return;
        };
        // Step 2: what is lost, here and in the LOADs below.
        let mut lost: Vec<(NodeId, Option<TransferId>)> = flight.nodes[first_miss..]
            .iter()
            .filter(|&&node| attached(self, node))
            .map(|&node| (node, self.swap_in_behind(load, flight.then, node)))
            .collect();
        let cancelled = self.loads_below_lost(load, &mut lost);
        // Every block the tier reported missing: the shallowest takes the ones below it along once
        // unheld, but while a request holds it each one is lost on its own (a holder that
        // recomputes it must not count the tier's copy).
        let missing: Vec<NodeId> = (first_miss..flight.nodes.len())
            .filter(|&index| attached(self, flight.nodes[index]) && outcome.gone(index))
            .map(|index| flight.nodes[index])
            .collect();
        // Step 3: the waiting requests are shortened.
        let mut tickets = flight.tickets.clone();
        for (_, cancelled) in &cancelled {
            tickets.extend(cancelled.tickets.iter().copied());
        }
        tickets.sort_unstable();
        tickets.dedup();
        let failure = match outcome {
            LoadOutcome::Unavailable(failure) => failure,
            LoadOutcome::AllLanded | LoadOutcome::Blocks(_) => {
                TransferFailure { rank: 0, error: super::CommandError::StorageMiss, detail: 0 }
            }
        };
        for &ticket in &tickets {
            self.shorten(ticket, &lost, failure);
        }
        // Step 4: the lost nodes are storage-only again.
        let behind = |lost: &[(NodeId, Option<TransferId>)], node: NodeId| {
            lost.iter().find(|&&(gone, _)| gone == node).and_then(|&(_, swap_in)| swap_in)
        };
        for (index, &node) in flight.nodes.iter().enumerate().skip(first_miss) {
            if attached(self, node) {
                self.stats.load_failed_blocks += 1;
                match behind(&lost, node) {
                    Some(swap_in) => self.back_to_storage(node, swap_in, None, &flight.after),
                    None => self.prefetch_back_to_storage(node),
                }
                // A LOAD settled unissued (`tier_health`) may write a host block claimed from a
                // STORE still reading it; one that ran waited for that STORE.
                self.release_host_block(&flight.after, flight.pairs[index].src);
            }
        }
        for (id, cancelled) in cancelled {
            for (index, (pair, &node)) in cancelled.pairs.iter().zip(&cancelled.nodes).enumerate() {
                let attached = self.tree.attached_to(node, id.0).is_some();
                if !attached {
                    self.forget_detached(cancelled.blocks[index].hash);
                    continue;
                }
                self.stats.load_failed_blocks += 1;
                match behind(&lost, node) {
                    Some(swap_in) => self.back_to_storage(node, swap_in, None, &cancelled.after),
                    None => self.prefetch_back_to_storage(node),
                }
                // Its host block may have been claimed from a STORE still reading it.
                self.release_host_block(&cancelled.after, pair.src);
            }
            // Reserved host blocks came from abandoned loads, whose blocks may also have been
            // claimed from a STORE still reading them: freed only once it has read them.
            for &block in &cancelled.reserved_host {
                self.release_host_block(&cancelled.after, block);
            }
            for &block in &cancelled.reserved_device {
                self.free_device(block);
            }
            self.resolve_tickets(&cancelled.tickets, None);
            self.recycle_flight(cancelled);
        }
        // Step 5: a block the tier no longer has leaves, with its subtree, once unheld.
        if !missing.is_empty() {
            for node in missing {
                self.stats.load_missing_blocks += 1;
                self.unloadable.push((node, self.tree.node(node).hash()));
            }
            self.drop_unloadable();
        }
        self.resolve_tickets(&flight.tickets, None);
        self.recycle_flight(flight);
        // Fresh device blocks for sharing requests may have started swap-outs.
        self.close_transfers();
    }

    /// A commit of `request` made device copies of nodes from path position `start` on: those
    /// the tier reported missing (waiting in `unloadable`, held when their LOAD missed) are no
    /// longer counted on storage, and the tier is told to forget its damaged copy; without this
    /// a later eviction would trust the lost copy and skip the write-back.
    pub(super) fn uncount_lost_copies(&mut self, request: super::RequestId, start: usize) {
        let end = self.requests[&request].path.len();
        for index in start..end {
            let id = self.requests[&request].path[index];
            // An id whose node left the tree may have been reused: the hash tells.
            let hash = self.tree.node(id).hash();
            let Some(position) =
                self.unloadable.iter().position(|&(lost, was)| lost == id && was == hash)
            else {
                continue;
            };
            let (_, hash) = self.unloadable.swap_remove(position);
            if self.tree.node(id).stored() {
                self.tree.update(id, |node| node.set_stored(false));
                self.storage_used -= 1;
                self.forget_now(hash);
            }
        }
    }

    /// The unissued LOADs ordered after `load` whose chain hangs below a node of `lost`, taken out
    /// of the in-flight table, and after them those below theirs; their attached nodes join
    /// `lost` (module flow, step 2).
    fn loads_below_lost(
        &mut self,
        load: TransferId,
        lost: &mut Vec<(NodeId, Option<TransferId>)>,
    ) -> Vec<(TransferId, Box<InFlight>)> {
        let mut cancelled = Vec::new();
        let mut before = vec![load];
        while let Some(load) = before.pop() {
            let dependents: Vec<TransferId> = self
                .in_flight
                .iter()
                .filter(|(_, flight)| {
                    flight.kind == TransferKind::StorageToHost && flight.after.contains(&load)
                })
                .map(|(&id, _)| id)
                .collect();
            for dependent in dependents {
                let flight = self.in_flight.get(&dependent).expect("listed just above");
                let then = flight.then;
                let nodes: Vec<NodeId> = flight
                    .nodes
                    .iter()
                    .copied()
                    .filter(|&node| self.tree.attached_to(node, dependent.0).is_some())
                    .collect();
                // A LOAD carries one chain: it hangs where its first block does.
                let Some(&top) = nodes.first() else { continue };
                let parent = self.tree.node(top).parent().expect("a loaded node has a parent");
                if !lost.iter().any(|&(node, _)| node == parent) {
                    continue;
                }
                let flight = self.in_flight.remove(&dependent).expect("listed just above");
                assert!(!flight.issued, "a load ordered after one in flight was issued");
                for node in nodes {
                    lost.push((node, self.swap_in_behind(dependent, then, node)));
                }
                cancelled.push((dependent, flight));
                before.push(dependent);
            }
        }
        cancelled
    }

    /// Shortens the hit of `ticket`'s request where its path first reaches a node of `lost`
    /// (module flow, step 3). `failure` fails the ticket in the one case where the request
    /// cannot be given a device block of its own; a prefetch's ticket is left as it is.
    fn shorten(
        &mut self,
        ticket: TicketId,
        lost: &[(NodeId, Option<TransferId>)],
        failure: TransferFailure,
    ) {
        let Some(record) = self.tickets.get_mut(&ticket) else { return };
        let Some(request_id) = record.request else {
            // A prefetch's ticket belongs to no request and is advisory: a miss ends it ready
            // like a hit (the blocks that landed are on host; `prefetch_failed_blocks` counts the
            // others), never failed.
            return;
        };
        let Some(request) = self.requests.get(&request_id) else { return };
        let Some(cut) =
            request.path.iter().position(|&node| lost.iter().any(|&(gone, _)| gone == node))
        else {
            return;
        };
        let end = request.path.len().min(request.table.len());
        debug_assert!(
            request.private.is_empty() || end <= cut,
            "a request waiting on its first ticket has no private blocks inside its hits"
        );
        // Device blocks for the positions cut off: the node's own, or a fresh one when another
        // request took it first.
        let mut blocks: Vec<(u32, Option<TransferId>)> = Vec::with_capacity(end - cut);
        let mut fresh_needed = 0;
        for &node in &request.path[cut..end] {
            if self.tree.node(node).device().is_none() {
                fresh_needed += 1;
            }
        }
        if fresh_needed > 0 {
            let free = self.device.free_count();
            let available = free
                + if fresh_needed > free { self.reclaimable_up_to(fresh_needed - free) } else { 0 };
            if available < fresh_needed {
                self.stats.shortening_failed += 1;
                let ticket = self.tickets.get_mut(&ticket).expect("found above");
                ticket.failure = Some(failure);
                self.requests.get_mut(&request_id).expect("found above").failed = true;
                return;
            }
        }
        let mut fresh = Vec::with_capacity(fresh_needed);
        self.obtain_device_blocks(fresh_needed, &mut fresh);
        let mut fresh = fresh.into_iter();
        let path: Vec<NodeId> = self.requests[&request_id].path[cut..end].to_vec();
        for node in path {
            let block = match self.tree.node(node).device() {
                Some(block) => {
                    let (_, swap_in) = *lost
                        .iter()
                        .find(|&&(gone, _)| gone == node)
                        .expect("a node below a lost one is lost");
                    let reader = swap_in
                        .and_then(|swap_in| self.swap_out_reading_destination(swap_in, block));
                    self.tree.update(node, |node| node.set_device(None));
                    (block, reader)
                }
                None => fresh.next().expect("counted above"),
            };
            blocks.push(block);
        }
        let request = self.requests.get_mut(&request_id).expect("found above");
        for (position, &(block, _)) in (cut..end).zip(&blocks) {
            request.table[position] = block;
        }
        let released: Vec<NodeId> = request.path.drain(cut..).collect();
        for (position, &(_, reader)) in (cut..end).zip(&blocks) {
            if let Some(reader) = reader {
                let request = self.requests.get_mut(&request_id).expect("found above");
                request.note_claim(position, reader);
                self.wait_on(ticket, reader);
            }
        }
        for &node in released.iter().rev() {
            self.tree.release(node);
        }
        let ticket = self.tickets.get_mut(&ticket).expect("found above");
        let cached = u32::try_from(cut).expect("a path is shorter than 2^32 blocks");
        if ticket.cached_blocks.is_none() {
            self.stats.shortened_tickets += 1;
        }
        ticket.cached_blocks = Some(ticket.cached_blocks.map_or(cached, |was| was.min(cached)));
    }

    /// The path position of the first hit of `record` without a block table entry that is a
    /// block the tier reported missing, still held (it matched before the LOAD that found it
    /// missing), or a storage-only block while the tier is down (it matched before the tier went
    /// down, `tier_health`): the request's hits end there, as if its match had ended there
    /// (DESIGN §9).
    pub(super) fn first_lost_hit(&self, record: &super::request::Request) -> Option<usize> {
        let start = record.table.len();
        let tier_down = self.tier.is_down();
        let lost = |&id: &NodeId| ends_hits(&self.tree, &self.unloadable, tier_down, id);
        Some(start + record.path.get(start..)?.iter().position(lost)?)
    }

    /// An allocation of `request` whose hits end at `cut`, before a lost block
    /// ([`first_lost_hit`](Self::first_lost_hit)): the nodes from there on leave its path, and
    /// the allocation gives those positions fresh device blocks like new ones.
    pub(super) fn cut_hits_at_lost(&mut self, request: super::RequestId, cut: usize) {
        let record = self.requests.get_mut(&request).expect("an allocated request is live");
        let released: Vec<NodeId> = record.path.drain(cut..).collect();
        for &node in released.iter().rev() {
            self.tree.release(node);
        }
        // The lost block may be unheld now.
        self.drop_unloadable();
    }

    /// `ticket`, the allocation of a request whose hits were cut at `cut`
    /// ([`cut_hits_at_lost`](Self::cut_hits_at_lost)), ends `Shortened` once its copies land.
    pub(super) fn born_shortened(&mut self, ticket: TicketId, cut: usize) {
        let record = self.tickets.get_mut(&ticket).expect("a ticket just made");
        record.cached_blocks =
            Some(u32::try_from(cut).expect("a path is shorter than 2^32 blocks"));
        self.stats.shortened_tickets += 1;
    }

    /// The swap-out still reading `block`, a destination of `swap_in`, when the block was claimed
    /// from one: whoever writes the block next waits for it.
    fn swap_out_reading_destination(&self, swap_in: TransferId, block: u32) -> Option<TransferId> {
        let after = &self.in_flight.get(&swap_in)?.after;
        self.swap_out_reading(after, block)
    }
}
