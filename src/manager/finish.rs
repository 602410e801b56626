//! Ending requests: one (`finish`, `abort`; DESIGN §4.5), or every one with everything cached
//! (`reset`), and resizing the device tier (`resize_device`).
//!
//! The end of one request:
//! 1. Forget its tickets.
//! 2. Give its own blocks back in reverse order (the tail first), except a block claimed from a
//!    swap-out that is still reading it: that copy keeps it until it completes.
//! 3. Release its nodes in reverse order, touching them now: at ref count 0 they become
//!    evictable, the tail first (deeper first on the equal access time). The eviction policy
//!    hears which request ends before, and after a finish that its path's end ended a turn.
//!
//! A reset drops every cached block of every tier and bumps the generation:
//! 1. refuse, unless forced, while a request holds blocks; a forced reset ends every request;
//! 2. forget copies never handed out (no worker has seen them);
//! 3. every copy handed out keeps all its blocks reserved until its completion arrives (which is
//!    then ignored but for freeing them), since a worker may still be touching them;
//! 4. clear the tree and both pools, and take the reserved blocks back out of the pools.

use super::id_table::IdTable;
use super::request::Request;
use super::transfer::InFlight;
use super::{
    CacheManager, FinishError, RequestId, ResetError, ResizeError, TransferId, TransferKind,
};
use crate::pool::{BlockPool, ResizeError as PoolResizeError, TooManyBlocks, MAX_POOL_BLOCKS};

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

impl CacheManager {
    /// Drops every cached block and bumps the generation (module flow). Returns the requests a
    /// forced reset ended (those that held blocks), in id order: the engine drops them too.
    pub fn reset(&mut self, force: bool) -> Result<Vec<RequestId>, ResetError> {
        let mut dropped: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, request)| request.holds_anything())
            .map(|(&id, _)| id)
            .collect();
        if !dropped.is_empty() && !force {
            return Err(ResetError::RequestsHoldBlocks { requests: dropped.len() });
        }
        dropped.sort_unstable();
        self.forget_everything();
        for id in self.outbox.drain(..) {
            if self.in_flight.get(&id).is_some_and(|flight| !flight.issued) {
                self.in_flight.remove(&id);
            }
        }
        for flight in self.in_flight.values_mut() {
            let (device, host): (Vec<u32>, Vec<u32>) = match flight.kind {
                TransferKind::DeviceToHost => {
                    flight.pairs.iter().map(|pair| (pair.src, pair.dst)).unzip()
                }
                TransferKind::HostToDevice => {
                    flight.pairs.iter().map(|pair| (pair.dst, pair.src)).unzip()
                }
                // A STORE reads its host blocks, a LOAD writes them. No surviving copy shares
                // one: a copy into a block a STORE reads, and the swap-in behind a LOAD, are
                // held back until it completes, so they are unissued and dropped above.
                TransferKind::HostToStorage | TransferKind::StorageToHost => {
                    (Vec::new(), flight.pairs.iter().map(|pair| pair.src).collect())
                }
            };
            flight.reserved_device = device;
            flight.reserved_host = host;
            flight.tickets.clear();
            flight.after.clear();
        }
        self.requests.retain(|_, request| !request.holds_anything());
        let requests = &self.requests;
        // Prefetch tickets go too: the copies they waited on are forgotten.
        self.tickets
            .retain(|_, ticket| ticket.request.is_some_and(|id| requests.contains_key(&id)));
        self.prefetch.clear();
        self.tree.clear();
        self.pending_backups.clear();
        self.pending_stores.clear();
        self.unloadable.clear();
        self.orphans.clear();
        self.orphan_count = 0;
        self.storage_used = 0;
        self.device.clear();
        self.host.clear();
        // In block order, so that the pools come out the same whatever the map's order.
        let mut device: Vec<u32> = self
            .in_flight
            .values()
            .flat_map(|flight| flight.reserved_device.iter().copied())
            .collect();
        let mut host: Vec<u32> = self
            .in_flight
            .values()
            .flat_map(|flight| flight.reserved_host.iter().copied())
            .collect();
        device.sort_unstable();
        host.sort_unstable();
        for block in device {
            self.device.take(block).expect("a block reserved by two copies is a programming error");
        }
        for block in host {
            self.host.take(block).expect("a block reserved by two copies is a programming error");
        }
        self.generation += 1;
        self.stats.resets += 1;
        Ok(dropped)
    }

    /// Grows the device tier, or shrinks it when every block at or above `blocks` is free.
    pub fn resize_device(&mut self, blocks: u32) -> Result<(), ResizeError> {
        if blocks < self.config.free_watermark {
            return Err(ResizeError::BelowWatermark {
                blocks,
                watermark: self.config.free_watermark,
            });
        }
        self.device.resize(blocks).map_err(|error| match error {
            PoolResizeError::TooManyBlocks(TooManyBlocks { capacity }) => {
                ResizeError::TooManyBlocks { blocks: capacity, max: MAX_POOL_BLOCKS }
            }
            PoolResizeError::BlocksInUse { capacity, first_in_use } => {
                ResizeError::BlocksInUse { blocks: capacity, first_in_use }
            }
        })?;
        self.config.device_blocks = blocks;
        self.tree.configure_policy(blocks, self.config.host_blocks);
        Ok(())
    }
}
