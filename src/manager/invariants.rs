//! `check_invariants()`: the six invariants of DESIGN §6, checked by scanning everything.
//!
//! Tests call it after every operation; it costs O(tree + pools + requests + copies).

use std::collections::HashMap;

use kvshm_ipc::record::BlockPair;

use super::{CacheManager, InvariantViolation, TransferId, TransferKind};
use crate::tree::{NodeId, NodeState, StoreOut, SwapOut};

fn broken(number: u8, detail: impl Into<String>) -> InvariantViolation {
    InvariantViolation { number, detail: detail.into() }
}

/// Counts the owners of every block of one tier.
struct Owners {
    tier: &'static str,
    counts: Vec<u8>,
}

impl Owners {
    fn new(tier: &'static str, capacity: u32) -> Owners {
        Owners { tier, counts: vec![0; capacity as usize] }
    }

    fn own(
        &mut self,
        block: u32,
        owner: impl FnOnce() -> String,
    ) -> Result<(), InvariantViolation> {
        let tier = self.tier;
        let Some(count) = self.counts.get_mut(block as usize) else {
            return Err(broken(2, format!("{tier} block {block} of {} is out of range", owner())));
        };
        *count += 1;
        if *count > 1 {
            return Err(broken(2, format!("{tier} block {block} has a second owner: {}", owner())));
        }
        Ok(())
    }
}

impl CacheManager {
    /// Checks the invariants of DESIGN §6; the error names the broken invariant and what is wrong.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        // 1. Pools.
        self.device.check().map_err(|detail| broken(1, format!("device pool: {detail}")))?;
        self.host.check().map_err(|detail| broken(1, format!("host pool: {detail}")))?;
        // 3 and 5. Tree structure, prefix closure, candidate sets.
        self.tree.check().map_err(|(number, detail)| broken(number, detail))?;
        self.check_ownership()?;
        self.check_ref_counts()?;
        self.check_copies()?;
        self.check_copy_order()?;
        self.check_claims()?;
        self.check_storage()
    }

    /// Part of invariant 6: a copy in flight that writes a block another copy in flight still
    /// reads waits for that copy, directly or through the copies it waits for, so that it is
    /// never handed out before the block was read: a host block a STORE reads (written by a
    /// swap-out's destination, a LOAD's), a device block a swap-out reads (claimed from it, and
    /// written by a swap-in).
    fn check_copy_order(&self) -> Result<(), InvariantViolation> {
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        enum Block {
            Device(u32),
            Host(u32),
        }
        let mut read_by: HashMap<Block, Vec<TransferId>> = HashMap::new();
        for (&id, flight) in &self.in_flight {
            let read = |pair: &BlockPair| match flight.kind {
                TransferKind::HostToStorage => Some(Block::Host(pair.src)),
                TransferKind::DeviceToHost => Some(Block::Device(pair.src)),
                TransferKind::HostToDevice | TransferKind::StorageToHost => None,
            };
            for block in flight.pairs.iter().filter_map(read) {
                read_by.entry(block).or_default().push(id);
            }
        }
        if read_by.is_empty() {
            return Ok(());
        }
        for (&id, flight) in &self.in_flight {
            let written = |pair: &BlockPair| match flight.kind {
                TransferKind::DeviceToHost => Some(Block::Host(pair.dst)),
                TransferKind::StorageToHost => Some(Block::Host(pair.src)),
                TransferKind::HostToDevice => Some(Block::Device(pair.dst)),
                TransferKind::HostToStorage => None,
            };
            for block in flight.pairs.iter().filter_map(written) {
                for &reader in read_by.get(&block).into_iter().flatten() {
                    if reader != id && !self.waits_for(id, reader) {
                        return Err(broken(
                            6,
                            format!(
                                "copy {} ({:?}) writes {block:?}, which copy {} still reads, \
                                 without waiting for it",
                                id.0, flight.kind, reader.0
                            ),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Part of invariant 6: the blocks a request claimed from a swap-out still in flight are
    /// that copy's sources, and one of the request's tickets waits for it, so that the engine
    /// writes none of them before the copy has read it.
    fn check_claims(&self) -> Result<(), InvariantViolation> {
        for (request_id, request) in &self.requests {
            for run in &request.claims {
                let Some(flight) = self.in_flight.get(&run.transfer) else { continue };
                let sources = || flight.pairs.iter().map(|pair| pair.src);
                let positions = run.start as usize..run.end as usize;
                let claimed = request.table.get(positions.clone()).unwrap_or_default();
                let read = flight.kind == TransferKind::DeviceToHost
                    && claimed.len() == positions.len()
                    && claimed.iter().all(|&block| sources().any(|source| source == block));
                if !read {
                    return Err(broken(
                        6,
                        format!(
                            "{request_id}'s blocks at {positions:?} are not read by copy {}, \
                             which it claimed them from",
                            run.transfer.0
                        ),
                    ));
                }
                if !request.tickets.iter().any(|ticket| flight.tickets.contains(ticket)) {
                    return Err(broken(
                        6,
                        format!(
                            "no ticket of {request_id} waits for copy {}, which still reads \
                             the blocks it claimed",
                            run.transfer.0
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Whether copy `copy` waits for `before`, directly or through copies in flight it waits for.
    fn waits_for(&self, copy: TransferId, before: TransferId) -> bool {
        let mut stack = vec![copy];
        let mut seen = Vec::new();
        while let Some(next) = stack.pop() {
            let Some(flight) = self.in_flight.get(&next) else { continue };
            for &after in &flight.after {
                if after == before {
                    return true;
                }
                if !seen.contains(&after) {
                    seen.push(after);
                    stack.push(after);
                }
            }
        }
        false
    }

    /// The storage tier's count: the blocks it holds (`stored` nodes) and those being written
    /// (`HostToStorage`), within its capacity; a LOAD has its swap-in behind it, unissued, serving
    /// the same node with the same host block.
    fn check_storage(&self) -> Result<(), InvariantViolation> {
        let mut used = 0u32;
        // The blocks the tree counts on the tier, when orphans are to be checked against them.
        let mut counted = std::collections::HashSet::new();
        for id in self.tree.ids() {
            let node = self.tree.node(id);
            let state = node.state();
            if node.stored() || matches!(state, NodeState::HostToStorage(_)) {
                used += 1;
                if !self.orphans.is_empty() {
                    counted.insert(node.hash());
                }
            }
            if state == NodeState::StorageToHost {
                let load = TransferId(node.transfer().expect("checked by invariant 6"));
                let then = self.in_flight.get(&load).and_then(|flight| flight.then);
                if node.device().is_none() {
                    // A prefetch LOAD: no swap-in behind it, the node lands on host.
                    if then.is_some() || node.host().is_none() {
                        return Err(broken(
                            6,
                            format!("{id:?}, loading with no device block, is not a prefetch"),
                        ));
                    }
                    continue;
                }
                let swap_in = self
                    .swap_in_behind(load, then, id)
                    .and_then(|swap_in| self.in_flight.get(&swap_in));
                let serves = swap_in.is_some_and(|flight| {
                    !flight.issued
                        && flight.after.contains(&load)
                        && flight.nodes.iter().zip(&flight.pairs).any(|(&served, pair)| {
                            served == id
                                && Some(pair.src) == node.host()
                                && Some(pair.dst) == node.device()
                        })
                });
                if !serves {
                    return Err(broken(
                        6,
                        format!("load {} of {id:?} has no swap-in behind it", load.0),
                    ));
                }
            }
        }
        if used != self.storage_used {
            return Err(broken(
                2,
                format!(
                    "the storage tier counts {} blocks but {used} nodes are on it",
                    self.storage_used
                ),
            ));
        }
        if used > self.config.storage_blocks {
            return Err(broken(
                2,
                format!("{used} blocks on a storage tier of {}", self.config.storage_blocks),
            ));
        }
        // Orphans wait outside the tree: one the tree counts would be forgotten as it expires.
        let orphans = self.orphans.values().flatten();
        if orphans.clone().count() != self.orphan_count {
            return Err(broken(2, format!("{} orphans counted", self.orphan_count)));
        }
        if let Some((hash, _)) = orphans.into_iter().find(|(hash, _)| counted.contains(hash)) {
            return Err(broken(2, format!("orphan {hash:?} is counted on the tier by the tree")));
        }
        Ok(())
    }

    /// Invariant 2: every used block has exactly one owner, no free block has one, and no free
    /// block is touched by a copy in flight.
    fn check_ownership(&self) -> Result<(), InvariantViolation> {
        let mut device = Owners::new("device", self.device.capacity());
        let mut host = Owners::new("host", self.host.capacity());
        for id in self.tree.ids() {
            let node = self.tree.node(id);
            let owner = || format!("node {id:?} ({})", node.state().name());
            match node.state() {
                // Without a device block: a prefetch brings it to host (see `check_storage`).
                NodeState::StorageToHost => {
                    if let Some(block) = node.device() {
                        device.own(block, owner)?;
                    }
                }
                NodeState::Device | NodeState::SwapToHost(SwapOut::Backup | SwapOut::Evict) => {
                    let block = node
                        .device()
                        .ok_or_else(|| broken(2, format!("{} has no device block", owner())))?;
                    device.own(block, owner)?;
                }
                NodeState::Host
                | NodeState::SwapToHost(SwapOut::Claimed)
                | NodeState::Storage
                | NodeState::HostToStorage(_) => {
                    if node.device().is_some() {
                        return Err(broken(2, format!("{} has a device block", owner())));
                    }
                }
                NodeState::SwapToDevice => {}
            }
            match node.state() {
                NodeState::Device
                | NodeState::Host
                | NodeState::SwapToDevice
                | NodeState::HostToStorage(_)
                | NodeState::StorageToHost => {
                    if let Some(block) = node.host() {
                        host.own(block, owner)?;
                    }
                }
                NodeState::SwapToHost(_) | NodeState::Storage => {}
            }
        }
        for (request_id, request) in &self.requests {
            for block in request.owned_blocks() {
                device.own(block, || format!("{request_id}"))?;
            }
        }
        for (&transfer, flight) in &self.in_flight {
            let owner = || format!("copy {}", transfer.0);
            for (pair, &node) in flight.pairs.iter().zip(&flight.nodes) {
                if !self.attached(node, transfer) {
                    continue;
                }
                match flight.kind {
                    TransferKind::DeviceToHost => host.own(pair.dst, owner)?,
                    TransferKind::HostToDevice => device.own(pair.dst, owner)?,
                    // The node owns the host block of a LOAD or a backup STORE; an evicting
                    // STORE's host block belongs to whoever claimed it.
                    TransferKind::HostToStorage | TransferKind::StorageToHost => {}
                }
            }
            for &block in &flight.reserved_device {
                device.own(block, || format!("reservation of copy {}", transfer.0))?;
            }
            for &block in &flight.reserved_host {
                host.own(block, || format!("reservation of copy {}", transfer.0))?;
            }
        }
        for (owners, pool) in [(&device, &self.device), (&host, &self.host)] {
            for (block, &count) in owners.counts.iter().enumerate() {
                let used = pool.is_used(block as u32);
                if used && count == 0 {
                    return Err(broken(
                        2,
                        format!("{} block {block} is used but has no owner", owners.tier),
                    ));
                }
                if !used && count > 0 {
                    return Err(broken(
                        2,
                        format!("{} block {block} is free but owned", owners.tier),
                    ));
                }
            }
        }
        for (&transfer, flight) in &self.in_flight {
            for pair in &flight.pairs {
                let (device_block, host_block) = match flight.kind {
                    TransferKind::DeviceToHost => (Some(pair.src), pair.dst),
                    TransferKind::HostToDevice => (Some(pair.dst), pair.src),
                    TransferKind::HostToStorage | TransferKind::StorageToHost => (None, pair.src),
                };
                let device_free = device_block.is_some_and(|block| !self.device.is_used(block));
                if device_free || !self.host.is_used(host_block) {
                    return Err(broken(
                        2,
                        format!(
                            "copy {} ({:?}) touches a free block ({device_block:?} device, \
                             {host_block} host)",
                            transfer.0, flight.kind
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Invariant 4: a node's ref count is the number of live requests holding it; a request
    /// holds a chain from the root.
    fn check_ref_counts(&self) -> Result<(), InvariantViolation> {
        let mut holders: HashMap<NodeId, u32> = HashMap::new();
        for (request_id, request) in &self.requests {
            let mut parent = NodeId::ROOT;
            for &id in &request.path {
                if !self.tree.is_live(id) || self.tree.node(id).parent() != Some(parent) {
                    return Err(broken(
                        4,
                        format!("{request_id} holds {id:?}, which is not on its path"),
                    ));
                }
                *holders.entry(id).or_default() += 1;
                parent = id;
            }
            let pending = request
                .tickets
                .iter()
                .filter(|ticket| self.tickets.get(ticket).is_some_and(|ticket| ticket.pending > 0))
                .count();
            if pending != request.pending_tickets as usize {
                return Err(broken(
                    4,
                    format!(
                        "{request_id} counts {} pending tickets, has {pending}",
                        request.pending_tickets
                    ),
                ));
            }
        }
        for id in self.tree.ids() {
            let expected = holders.get(&id).copied().unwrap_or(0);
            let actual = self.tree.node(id).ref_count();
            if actual != expected {
                return Err(broken(
                    4,
                    format!("{id:?} has ref count {actual} but {expected} holders"),
                ));
            }
        }
        Ok(())
    }

    /// Invariant 6: every node in a transfer state has exactly one copy in flight for it, and
    /// every copy in flight serves nodes in the matching state. Also: every ticket counts the
    /// copies it waits on.
    fn check_copies(&self) -> Result<(), InvariantViolation> {
        for id in self.tree.ids() {
            let node = self.tree.node(id);
            let in_flight = node.state().in_flight();
            let Some(raw) = node.transfer() else {
                if in_flight {
                    return Err(broken(
                        6,
                        format!("{id:?} is {} with no copy", node.state().name()),
                    ));
                }
                continue;
            };
            let transfer = TransferId(raw);
            let Some(flight) = self.in_flight.get(&transfer).filter(|_| in_flight) else {
                return Err(broken(
                    6,
                    format!("{id:?} ({}) names copy {raw}, not in flight", node.state().name()),
                ));
            };
            let expected_kind = match node.state() {
                NodeState::SwapToDevice => TransferKind::HostToDevice,
                NodeState::HostToStorage(_) => TransferKind::HostToStorage,
                NodeState::StorageToHost => TransferKind::StorageToHost,
                _ => TransferKind::DeviceToHost,
            };
            if flight.kind != expected_kind || flight.generation != self.generation {
                return Err(broken(
                    6,
                    format!("{id:?} names copy {raw} of the wrong kind or generation"),
                ));
            }
            let mut pairs = flight.nodes.iter().zip(&flight.pairs).filter(|(&node, _)| node == id);
            let Some((_, pair)) = pairs.next() else {
                return Err(broken(6, format!("copy {raw} does not serve {id:?}, which names it")));
            };
            if pairs.next().is_some() {
                return Err(broken(6, format!("copy {raw} serves {id:?} twice")));
            }
            let matches = match node.state() {
                NodeState::SwapToDevice => {
                    Some(pair.src) == node.host() && Some(pair.dst) == node.device()
                }
                NodeState::SwapToHost(SwapOut::Claimed) => Some(pair.dst) == node.host(),
                NodeState::HostToStorage(StoreOut::Backup) | NodeState::StorageToHost => {
                    Some(pair.src) == node.host()
                }
                NodeState::HostToStorage(StoreOut::Evict) => true,
                _ => Some(pair.src) == node.device() && Some(pair.dst) == node.host(),
            };
            if !matches {
                return Err(broken(6, format!("copy {raw} moves other blocks than {id:?} holds")));
            }
        }
        let mut waits: HashMap<_, u32> = HashMap::new();
        for (&transfer, flight) in &self.in_flight {
            for &ticket in &flight.tickets {
                *waits.entry(ticket).or_default() += 1;
            }
            if flight.generation != self.generation {
                if let Some(&node) =
                    flight.nodes.iter().find(|&&node| self.attached(node, transfer))
                {
                    return Err(broken(
                        6,
                        format!("copy {} of an old generation serves {node:?}", transfer.0),
                    ));
                }
            }
        }
        for ticket in self.prefetch.query_tickets() {
            *waits.entry(ticket).or_default() += 1;
        }
        for (ticket_id, ticket) in &self.tickets {
            let expected = waits.get(ticket_id).copied().unwrap_or(0);
            if ticket.pending != expected {
                return Err(broken(
                    6,
                    format!(
                        "ticket {} counts {} copies but waits on {expected}",
                        ticket_id.0, ticket.pending
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Whether pair node `node` of copy `transfer` is still the node that copy serves.
    fn attached(&self, node: NodeId, transfer: TransferId) -> bool {
        self.tree.attached_to(node, transfer.0).is_some()
    }
}
