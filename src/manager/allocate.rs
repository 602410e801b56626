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
//!
//! Every configuration takes these steps: without a host tier every hit is on device and no
//! copy runs, so steps 3 and 4 reduce to the hits' device blocks and the new ones.

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
        let hits_end = self.hits_end(record);
        let demand = self.demand(request, record, hits_end, new_tokens, lookahead)?;
        // The path position of the first hit without a table entry (a storage block's depth).
        let first_hit = record.table.len();
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
    /// swap-in.
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
