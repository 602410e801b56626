//! `reset` (DESIGN §4.5) and `resize_device`.
//!
//! A reset drops every cached block of every tier and bumps the generation:
//! 1. refuse, unless forced, while a request holds blocks; a forced reset ends every request;
//! 2. forget copies never handed out (no worker has seen them);
//! 3. every copy handed out keeps all its blocks reserved until its completion arrives (which is
//!    then ignored but for freeing them), since a worker may still be touching them;
//! 4. clear the tree and both pools, and take the reserved blocks back out of the pools.

use super::{CacheManager, RequestId, ResetError, ResizeError};
use crate::pool::{ResizeError as PoolResizeError, TooManyBlocks, MAX_POOL_BLOCKS};

use super::TransferKind;

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
