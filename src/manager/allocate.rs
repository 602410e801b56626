//! `allocate` (DESIGN §4.5): device blocks for a request's hits and new tokens, all or nothing.
//!
//! 1. Count what is needed ([`super::capacity`]): a block per host or storage hit not yet swapped
//!    in, and blocks for the new and lookahead tokens beyond what the block table covers; a host
//!    block per storage hit. Hits end before a block the storage tier reported missing that a
//!    request still holds (DESIGN §9): from there on the positions get fresh blocks like new
//!    ones, and the ticket ends `Shortened` (the cut is applied once the allocation fits).
//! 2. Count what can be had without changing anything: free blocks, claimable blocks and the
//!    cascade of device candidates; free host blocks and host candidates. Short: fail, nothing
//!    changed.
//! 3. Take the host blocks of the loads, then the device blocks (free, claimed, evicted; see
//!    [`super::evict`]).
//! 4. Fill the block table's hit positions: device hits as they are; hits whose swap-in is in
//!    flight share it; host hits get a block and one batched host-to-device copy; storage hits
//!    get a host block, one batched LOAD into it, and a device block in that same swap-in. The
//!    swap-in is held back until the swap-outs reading its claimed blocks, the shared swap-ins
//!    above it and the LOAD have completed (see [`super::storage`]).
//! 5. Append the new blocks; the ticket also waits on swap-outs still reading claimed ones.
//! 6. Without a host tier every hit is on device and no copy runs: steps 1 to 5 reduce to
//!    counting the new blocks, appending the hits' device blocks to the block table, and taking
//!    the new ones straight into it (free, then evicted: `allocate_device_only`).
//! 7. With a host tier, when nothing was lost and every hit is on device with no copy in flight
//!    (the usual allocation), step 4 reduces to the hits' device blocks and step 5 to one pass
//!    over the new ones, the ticket recorded once with the swap-outs it waits on
//!    (`allocate_hits_on_device`); the general steps stay out of line (`allocate_with_copies`).

use super::capacity::Demand;
use super::request::{Request, RequestSlot};
use super::{AllocateError, CacheManager, RequestId, TicketId, TransferId};
use crate::tree::{NodeId, NodeState, SwapOut};

/// A successful allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation<'a> {
    /// Wait on this before reading swapped-in blocks or writing new ones.
    pub ticket: TicketId,
    /// The request's whole block table: hits, then its own blocks.
    pub block_table: &'a [u32],
    /// How many blocks at the end of the table this allocation added.
    pub new_blocks: usize,
}

/// Buffers `allocate` fills and empties on every call, kept by the manager so that an allocation
/// allocates no memory once they have grown.
#[derive(Debug, Default)]
pub(super) struct AllocateScratch {
    /// The request's hits without a block table entry yet.
    hits: Vec<NodeId>,
    /// Device blocks obtained, each with the swap-out still reading it if claimed from one.
    blocks: Vec<(u32, Option<TransferId>)>,
    /// Block table entries of the hits.
    table: Vec<u32>,
    /// Copies the swap-in must wait for.
    after: Vec<TransferId>,
    /// Host blocks for the loads, each with the STORE still reading it if claimed from one.
    host_blocks: Vec<(u32, Option<TransferId>)>,
    /// Other requests' loads of blocks above this request's storage hits.
    loads_before: Vec<TransferId>,
    /// The swap-outs of the runs of fresh blocks claimed from them.
    claims: Vec<TransferId>,
}

impl CacheManager {
    /// Gives a request device blocks for its host hits and for `new_tokens` more tokens plus
    /// `lookahead` reserved ones (speculative decoding), evicting as the write policy says.
    pub fn allocate(
        &mut self,
        request: RequestId,
        new_tokens: usize,
        lookahead: usize,
    ) -> Result<Allocation<'_>, AllocateError> {
        // One lookup: the record is read and changed through its slot.
        let slot = self.requests.slot(&request).ok_or(AllocateError::UnknownRequest(request))?;
        let record = self.requests.at(slot);
        if record.failed {
            return Err(AllocateError::RequestFailed(request));
        }
        if !self.host_enabled() {
            return self.allocate_device_only(slot, request, new_tokens, lookahead);
        }
        let hits_end = self.hits_end(record);
        let demand = self.demand(request, record, hits_end, new_tokens, lookahead)?;
        // The path position of the first hit without a table entry (a storage block's depth).
        let first_hit = record.table.len();
        let lost_cut = (hits_end < record.path.len()).then_some(hits_end);
        // The usual allocation (module flow, step 7): nothing lost, no swap-in (so no load
        // either), every hit on device with no copy to wait for.
        let hits_on_device = !self.general_forms_only()
            && lost_cut.is_none()
            && demand.swap_ins == 0
            && record.path.get(first_hit..).unwrap_or_default().iter().all(|&id| {
                matches!(
                    self.tree.node(id).state(),
                    NodeState::Device | NodeState::SwapToHost(SwapOut::Backup)
                )
            });
        if hits_on_device {
            return self.allocate_hits_on_device(slot, request, demand.fresh, new_tokens);
        }
        self.allocate_with_copies(slot, request, demand, (first_hit, hits_end), new_tokens)
    }

    /// [`CacheManager::allocate`] with a host tier (module flow, steps 1 to 5): `demand` for the
    /// request in `slot`, whose hits without a table entry are the path's positions `first_hit`
    /// to `hits_end`. Out of line: the usual allocation takes
    /// [`CacheManager::allocate_hits_on_device`], and the code of swap-ins, loads and lost
    /// hits stays out of its way (instruction cache).
    #[inline(never)]
    fn allocate_with_copies(
        &mut self,
        slot: RequestSlot,
        request: RequestId,
        demand: Demand,
        (first_hit, hits_end): (usize, usize),
        new_tokens: usize,
    ) -> Result<Allocation<'_>, AllocateError> {
        let (swap_ins, fresh, needed) = (demand.swap_ins, demand.fresh, demand.blocks());
        let lost_cut = (hits_end < self.requests.at(slot).path.len()).then_some(hits_end);
        self.ensure_device_blocks(needed)?;
        if demand.loads > 0 {
            let available = self.obtainable_host_blocks(demand.loads);
            if available < demand.loads {
                self.stats.failed_allocations += 1;
                return Err(AllocateError::OutOfHostBlocks { needed: demand.loads, available });
            }
        }
        // Boxed, so that taking the buffers out of the manager for the call moves one pointer.
        let mut scratch = self.scratch.take().unwrap_or_default();
        scratch.hits.clear();
        let path = &self.requests.at(slot).path;
        scratch.hits.extend_from_slice(path.get(first_hit..hits_end).unwrap_or_default());

        if let Some(cut) = lost_cut {
            self.cut_hits_at_lost(request, cut);
        }
        scratch.host_blocks.clear();
        for _ in 0..demand.loads {
            let block = self.obtain_host_block().expect("the host blocks were counted above");
            scratch.host_blocks.push(block);
        }
        scratch.blocks.clear();
        self.obtain_device_blocks(needed, &mut scratch.blocks);
        let ticket = self.new_ticket(request);
        if let Some(cut) = lost_cut {
            self.born_shortened(ticket, cut);
        }
        let mut blocks = scratch.blocks.iter();
        let mut host_blocks = scratch.host_blocks.iter();
        let mut swap_in = None;
        scratch.loads_before.clear();
        scratch.table.clear();
        scratch.after.clear();
        for (index, &id) in scratch.hits.iter().enumerate() {
            let node = self.tree.node(id);
            match node.state() {
                NodeState::Device | NodeState::SwapToHost(SwapOut::Backup) => {
                    scratch.table.push(node.device().expect("a device hit has a device block"));
                }
                NodeState::SwapToDevice => {
                    let transfer =
                        TransferId(node.transfer().expect("a node in flight names its copy"));
                    scratch.table.push(node.device().expect("a swap-in has its destination"));
                    self.wait_on(ticket, transfer);
                    // Swap-ins below wait for this one, so that if it fails they are still
                    // unissued and can be cancelled.
                    if !scratch.after.contains(&transfer) {
                        scratch.after.push(transfer);
                    }
                }
                NodeState::Host => {
                    let &(block, claimed_from) =
                        blocks.next().expect("a block was taken per swap-in");
                    swap_in = Some(self.start_swap_in(id, block));
                    scratch.after.extend(claimed_from);
                    scratch.table.push(block);
                }
                NodeState::Storage => {
                    let &(block, claimed_from) =
                        blocks.next().expect("a block was taken per swap-in");
                    let &host = host_blocks.next().expect("a host block was taken per load");
                    scratch.after.extend(claimed_from);
                    let depth = u32::try_from(first_hit + index).expect("a path of < 2^32 blocks");
                    swap_in = Some(self.load_storage_hit(
                        (id, depth),
                        ticket,
                        host,
                        block,
                        &mut scratch.after,
                    ));
                    scratch.table.push(block);
                }
                NodeState::StorageToHost if node.device().is_none() => {
                    // A prefetch brings it to host: this request's swap-in follows its LOAD.
                    let &(block, claimed_from) =
                        blocks.next().expect("a block was taken per swap-in");
                    scratch.after.extend(claimed_from);
                    let (load, follow) =
                        self.follow_prefetch_load(id, ticket, block, &mut scratch.after);
                    swap_in = Some(follow);
                    scratch.loads_before.push(load);
                    scratch.table.push(block);
                }
                NodeState::StorageToHost => {
                    let (device, load) = self.share_load(id, ticket, &mut scratch.after);
                    // This request's own loads, below, go after it.
                    scratch.loads_before.push(load);
                    scratch.table.push(device);
                }
                state @ (NodeState::SwapToHost(SwapOut::Evict | SwapOut::Claimed)
                | NodeState::HostToStorage(_)) => {
                    unreachable!("a held node in state {state:?} is a programming error")
                }
            }
        }
        if let Some((_, load)) = self.open_storage_to_host.as_mut() {
            for &before in &scratch.loads_before {
                if !load.after.contains(&before) {
                    load.after.push(before);
                }
            }
        }
        if let Some(transfer) = swap_in {
            self.stats.swap_in_blocks_issued += swap_ins as u64;
            let flight = &mut self.open_host_to_device.as_mut().expect("the swap-in is open").1;
            flight.after.clear();
            flight.after.extend_from_slice(&scratch.after);
            self.wait_on(ticket, transfer);
        }
        // The rest are the fresh blocks: all go to the block table after the hits, the ones
        // claimed from swap-outs noted by runs of one copy, each waited on.
        let fresh_blocks = blocks.as_slice();
        debug_assert_eq!(fresh_blocks.len(), fresh);
        let record = self.requests.at_mut(slot);
        record.table.extend_from_slice(&scratch.table);
        scratch.claims.clear();
        for &(block, claimed_from) in fresh_blocks {
            let position = record.table.len();
            record.table.push(block);
            if let Some(transfer) = claimed_from {
                if record.note_claim(position, transfer) {
                    scratch.claims.push(transfer);
                }
            }
        }
        record.tokens += new_tokens;
        record.tickets.push(ticket);
        for &transfer in &scratch.claims {
            self.wait_on(ticket, transfer);
        }
        self.close_transfers();
        self.scratch = Some(scratch);
        let record = self.requests.at(slot);
        Ok(Allocation { ticket, block_table: &record.table, new_blocks: fresh })
    }

    /// [`CacheManager::allocate`] with a host tier when every hit is on device with no copy to
    /// wait for (module flow, step 7): `fresh` blocks for the request in `slot` and its
    /// `new_tokens`. The hits' table entries are their device blocks; the fresh blocks follow,
    /// the claimed ones noted with the swap-out still reading them, and the ticket waits once
    /// per run of claims from one copy (usually one run: the allocation's own swap-out). The
    /// ticket is recorded once, with what it waits on, rather than looked up per wait.
    fn allocate_hits_on_device(
        &mut self,
        slot: RequestSlot,
        request: RequestId,
        fresh: usize,
        new_tokens: usize,
    ) -> Result<Allocation<'_>, AllocateError> {
        self.ensure_device_blocks(fresh)?;
        // Boxed, so that taking the buffers out of the manager for the call moves one pointer.
        let mut scratch = self.scratch.take().unwrap_or_default();
        scratch.blocks.clear();
        self.obtain_device_blocks(fresh, &mut scratch.blocks);
        debug_assert_eq!(scratch.blocks.len(), fresh);
        let ticket = self.take_ticket_id();
        let CacheManager { requests, tree, open_device_to_host, in_flight, .. } = self;
        let record = requests.at_mut(slot);
        let hits = record.path.get(record.table.len()..).unwrap_or_default();
        record.table.reserve(hits.len() + fresh);
        for &id in hits {
            record.table.push(tree.node(id).device().expect("a device hit has a device block"));
        }
        let mut pending = 0;
        for &(block, claimed_from) in &scratch.blocks {
            let position = record.table.len();
            record.table.push(block);
            let Some(transfer) = claimed_from else { continue };
            if record.note_claim(position, transfer) {
                // A claim is from a swap-out: this allocation's own (open), or an earlier one.
                let flight = match open_device_to_host {
                    Some((open, flight)) if *open == transfer => flight,
                    _ => in_flight.get_mut(&transfer).expect("a claimed block's copy is in flight"),
                };
                pending += u32::from(flight.add_ticket(ticket));
            }
        }
        record.tokens += new_tokens;
        record.tickets.push(ticket);
        record.pending_tickets += u32::from(pending > 0);
        self.record_ticket(ticket, request, pending);
        self.scratch = Some(scratch);
        self.close_transfers();
        let record = self.requests.at(slot);
        Ok(Allocation { ticket, block_table: &record.table, new_blocks: fresh })
    }

    /// [`CacheManager::allocate`] without a host tier (module flow, step 6): blocks for the
    /// request in `slot`, its `new_tokens` and `lookahead`.
    fn allocate_device_only(
        &mut self,
        slot: RequestSlot,
        request: RequestId,
        new_tokens: usize,
        lookahead: usize,
    ) -> Result<Allocation<'_>, AllocateError> {
        // Every hit is on device (no tier below to lose one to): the path covers them all.
        let record = self.requests.at(slot);
        debug_assert_eq!(self.hits_end(record), record.path.len(), "hits on device only");
        let covered = record.table.len().max(record.path.len());
        let fresh = self.fresh_blocks(request, record, covered, new_tokens, lookahead)?;
        self.ensure_device_blocks(fresh)?;
        let CacheManager { requests, tree, .. } = self;
        let Request { path, table, .. } = requests.at_mut(slot);
        // Every cached node is on device: a hit's table entry is its node's device block. The
        // fresh blocks go straight into the table after them (taken out of the record for the
        // evictions, which do not touch held nodes).
        let hits = path.get(table.len()..).unwrap_or_default();
        table.reserve(hits.len() + fresh);
        for &id in hits {
            table.push(
                tree.node(id).device().expect("without a host tier a cached node is on device"),
            );
        }
        let mut table = std::mem::take(table);
        self.obtain_device_blocks_without_host(fresh, &mut table);
        let ticket = self.new_ticket(request);
        let record = self.requests.at_mut(slot);
        record.table = table;
        record.tokens += new_tokens;
        record.tickets.push(ticket);
        let record = self.requests.at(slot);
        Ok(Allocation { ticket, block_table: &record.table, new_blocks: fresh })
    }

    /// Fails the allocation (counted) unless `needed` device blocks can be had, free or by
    /// eviction (module flow, step 2).
    #[inline]
    fn ensure_device_blocks(&mut self, needed: usize) -> Result<(), AllocateError> {
        let free = self.device.free_count();
        if needed > free {
            let available = free + self.reclaimable_up_to(needed - free);
            if available < needed {
                self.stats.failed_allocations += 1;
                return Err(AllocateError::OutOfBlocks { needed, available });
            }
        }
        Ok(())
    }

    /// Storage hit `id` at `depth` in the prompt (module flow, step 4): a LOAD into `host` (a host
    /// block, with the STORE still reading it if claimed from one), then a swap-in into `device`
    /// behind it; the ticket and the request's swap-in (`after`) wait for the LOAD. Returns the
    /// swap-in. Out of line: a cache without a storage tier never comes here.
    #[inline(never)]
    fn load_storage_hit(
        &mut self,
        (id, depth): (NodeId, u32),
        ticket: TicketId,
        host: (u32, Option<TransferId>),
        device: u32,
        after: &mut Vec<TransferId>,
    ) -> TransferId {
        let (load, swap_in) = self.start_load(id, host, device, depth);
        if !after.contains(&load) {
            after.push(load);
            self.wait_on(ticket, load);
        }
        swap_in
    }

    /// A hit on node `id`, which another request's LOAD is bringing up: the ticket waits on that
    /// LOAD and on the swap-in behind it, and so does the request's own swap-in (`after`).
    /// Returns the node's device block and the LOAD.
    #[inline(never)]
    fn share_load(
        &mut self,
        id: NodeId,
        ticket: TicketId,
        after: &mut Vec<TransferId>,
    ) -> (u32, TransferId) {
        let node = self.tree.node(id);
        let load = TransferId(node.transfer().expect("a node in flight names its copy"));
        let device = node.device().expect("a load has its swap-in's destination");
        let then = self.flight(load).and_then(|flight| flight.then);
        let then = self
            .swap_in_behind(load, then, id)
            .expect("a node with a device block being loaded has a swap-in behind it");
        self.wait_on(ticket, load);
        self.wait_on(ticket, then);
        if !after.contains(&then) {
            after.push(then);
        }
        (device, load)
    }
}
