//! Prefetch (DESIGN §9): storage loads started before a request is scheduled, and the discovery of
//! blocks another service wrote to a shared tier.
//!
//! Core types: [`PrefetchError`], [`StorageQuery`] (what the service asks every rank's tier), and
//! the manager's `Prefetches` (prefetch tickets and queries in flight).
//!
//! One prefetch of a prompt's block hashes (chained from block 0, as `match_prefix` takes them):
//! 1. the tree is walked over the hashes as far as nodes exist (through nodes in flight too);
//! 2. the storage-only nodes on that path get host blocks the usual way (the path is held
//!    meanwhile, so no eviction takes a node of it; nothing a request holds is evicted), as many
//!    as can be had, shallowest first, stopping at the first that cannot, and one LOAD with no
//!    swap-in behind it brings them up; when it lands they are host-resident and keep their
//!    storage copy (`stored`: leaving host again costs no write);
//! 3. when the tree ends before the hashes do and the tier is shared (other services write to
//!    it: [`CacheManager::set_storage_shared`]), a QUERY of the hashes past its end (at most as
//!    many as the tier holds) goes to every rank ([`CacheManager::take_storage_queries`]); its
//!    answer ([`CacheManager::complete_storage_query`]) is the leading run present on every
//!    rank, which is adopted as storage-only nodes (the adoption rules: within the tier's
//!    capacity, under a parent that may have storage-only children; a full tier makes room by
//!    dropping its least recently used storage candidates, one per block adopted, never a block
//!    held or in flight) and loaded as in step 2, in the same ticket;
//! 4. the ticket is ready once the QUERY and the LOADs completed. It belongs to no request:
//!    it is forgotten once [`CacheManager::prefetch_status`] has read it done, or once
//!    [`MAX_PREFETCH_TICKETS`] newer prefetch tickets exist. A prefetch is advisory: its ticket
//!    never fails. A QUERY the tier failed finds nothing; a prefetch LOAD that misses ends its
//!    ticket ready all the same (`prefetch_failed_blocks` counts the blocks), and the requests
//!    that shared it are shortened, as for any LOAD (see [`super::load_outcome`]); its nodes from
//!    the first miss on are storage-only again (a block the tier reported missing is dropped with
//!    its subtree).
//!
//! An allocation that meets a node a prefetch is loading shares the LOAD: it gives the node a
//! device block and a swap-in ordered after the LOAD (see `allocate`), and the LOAD then lands
//! as any other does (the node goes on to the device).

use std::collections::VecDeque;

use super::ids::IdMap;
use super::transfer::InFlight;
use super::transfer::{StorageBlock, Ticket};
use super::TransferKind;
use super::{CacheManager, TicketError, TicketId, TicketStatus, TransferFailure, TransferId};
use crate::hash::BlockHash;
use crate::tree::policy::Access;
use crate::tree::{NodeId, NodeState, StoreOut};
use kvshm_ipc::record::BlockPair;

/// Prefetch tickets kept at most: the oldest is forgotten when a newer one would exceed it.
pub const MAX_PREFETCH_TICKETS: usize = 4096;

/// Why a prefetch was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PrefetchError {
    #[error("prefetch needs a storage tier (storage_blocks is 0)")]
    NoStorageTier,
}

/// Why a QUERY's answer was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueryError {
    #[error("storage query {0} is not in flight")]
    UnknownQuery(u64),
    #[error("storage query {id} asked about {asked} blocks, not {answered}")]
    TooManyAnswers { id: u64, asked: usize, answered: usize },
}

/// A QUERY for the service to send to every rank: which of `hashes` the tier holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StorageQuery {
    pub id: u64,
    pub hashes: Vec<BlockHash>,
    pub generation: u64,
}

/// A QUERY in flight.
#[derive(Clone, Debug)]
struct PendingQuery {
    ticket: TicketId,
    /// The prompt's hashes, from block 0: the path to the query's parent, then the queried ones.
    hashes: Vec<BlockHash>,
    /// The index in `hashes` of the first queried block.
    first: usize,
    /// How many of the queried blocks may be adopted: fewer once one of them was forgotten
    /// after the QUERY was made (the FORGET may reach the tier after the QUERY).
    limit: usize,
    generation: u64,
}

/// The manager's prefetch tickets and queries.
#[derive(Debug, Default)]
pub(super) struct Prefetches {
    /// Live prefetch tickets, oldest first.
    tickets: VecDeque<TicketId>,
    queries: IdMap<u64, PendingQuery>,
    /// Per queried block: the queries in flight that asked about it (so that a forgotten block
    /// finds them in O(1)).
    asked: IdMap<BlockHash, Vec<u64>>,
    /// Queries not yet handed out, oldest first.
    outbox: Vec<u64>,
    next_query: u64,
    /// The tier is written by this cache alone (a disk slab): asking it about blocks past the
    /// tree would find nothing, so no QUERY is made ([`CacheManager::set_storage_shared`]).
    private_tier: bool,
}

impl Prefetches {
    /// Forgets every ticket and query (a reset).
    pub(super) fn clear(&mut self) {
        self.tickets.clear();
        self.queries.clear();
        self.asked.clear();
        self.outbox.clear();
    }

    /// Records QUERY `id`, indexing the blocks it asks about.
    fn insert(&mut self, id: u64, query: PendingQuery) {
        for &hash in &query.hashes[query.first..] {
            self.asked.entry(hash).or_default().push(id);
        }
        self.queries.insert(id, query);
    }

    /// Takes QUERY `id` out, with its index entries.
    fn remove(&mut self, id: u64) -> Option<PendingQuery> {
        let query = self.queries.remove(&id)?;
        for hash in &query.hashes[query.first..] {
            if let Some(ids) = self.asked.get_mut(hash) {
                ids.retain(|&asked| asked != id);
                if ids.is_empty() {
                    self.asked.remove(hash);
                }
            }
        }
        Some(query)
    }

    /// Block `hash` was forgotten: no query in flight adopts it or anything after it.
    pub(super) fn forgotten(&mut self, hash: BlockHash) {
        if self.asked.is_empty() {
            return;
        }
        let Some(ids) = self.asked.get(&hash) else { return };
        for id in ids {
            let query = self.queries.get_mut(id).expect("an indexed query is in flight");
            let queried = &query.hashes[query.first..];
            if let Some(position) = queried.iter().position(|&queried| queried == hash) {
                query.limit = query.limit.min(position);
            }
        }
    }

    /// The ticket of each QUERY in flight (each counts one in its ticket's `pending`).
    pub(super) fn query_tickets(&self) -> impl Iterator<Item = TicketId> + '_ {
        self.queries.values().map(|query| query.ticket)
    }
}

impl CacheManager {
    /// Starts storage loads for `hashes`' storage-only blocks, and asks the tier about the blocks
    /// past the tree's end (module flow). Returns the ticket, or `None` when there is nothing to
    /// do (no storage-only block on the path and nothing past it to ask about, or no host block
    /// to be had), or while the storage tier is down ([`CacheManager::storage_tier_down`]).
    ///
    /// A QUERY waits in the manager until [`CacheManager::take_storage_queries`] hands it out
    /// (the service does after every operation; a caller driving the manager alone must too,
    /// and answer it, or the ticket stays pending).
    ///
    /// # Errors
    /// [`PrefetchError::NoStorageTier`] without a storage tier. Nothing changes on error.
    pub fn prefetch(&mut self, hashes: &[BlockHash]) -> Result<Option<TicketId>, PrefetchError> {
        if !self.storage_enabled() {
            return Err(PrefetchError::NoStorageTier);
        }
        if self.tier.is_down() {
            // Nothing is loaded from or asked of a tier that is down (`tier_health`).
            self.stats.storage_down_skipped_prefetches += 1;
            return Ok(None);
        }
        let mut ticket = None;
        let path = self.load_path(hashes, &mut ticket);
        let past = &hashes[path..];
        if !past.is_empty() && !self.prefetch.private_tier && self.may_adopt_after(hashes, path) {
            let ticket = *ticket.get_or_insert_with(|| self.new_prefetch_ticket());
            // A full tier is asked too: what it finds is about to be used, so it is worth more
            // than the least recently used storage-only blocks it pushes out (step 3).
            let asked = past.len().min(self.config.storage_blocks as usize);
            let id = self.prefetch.next_query;
            self.prefetch.next_query += 1;
            self.prefetch.insert(
                id,
                PendingQuery {
                    ticket,
                    hashes: hashes[..path + asked].to_vec(),
                    first: path,
                    limit: asked,
                    generation: self.generation,
                },
            );
            self.prefetch.outbox.push(id);
            self.tickets.get_mut(&ticket).expect("a prefetch ticket just made").pending += 1;
            self.stats.prefetch_query_blocks += asked as u64;
        }
        if ticket.is_some() {
            self.stats.prefetches += 1;
        }
        Ok(ticket)
    }

    /// Whether other services may write to the storage tier (a shared Redis; the default), so
    /// that a prefetch asks it about the blocks past the tree (module flow, step 3); a tier only
    /// this cache writes (a disk slab) is not asked: it could only find blocks the cache already
    /// adopted. The service sets it from what its workers' back-ends report.
    pub fn set_storage_shared(&mut self, shared: bool) {
        self.prefetch.private_tier = !shared;
    }

    /// Where prefetch ticket `ticket` stands, like [`CacheManager::ticket_status`]; a ticket read
    /// as done (ready or failed) is forgotten (module flow, step 4).
    pub fn prefetch_status(&mut self, ticket: TicketId) -> Result<TicketStatus, TicketError> {
        let status = self.ticket_status(ticket)?;
        let prefetch = self.tickets.get(&ticket).is_some_and(|record| record.request.is_none());
        if prefetch && status != TicketStatus::Pending {
            self.tickets.remove(&ticket);
            self.prefetch.tickets.retain(|&kept| kept != ticket);
        }
        Ok(status)
    }

    /// Hands out the QUERYs created since the last call (module flow, step 3), oldest first.
    pub fn take_storage_queries(&mut self, out: &mut Vec<StorageQuery>) {
        for id in self.prefetch.outbox.drain(..) {
            let Some(query) = self.prefetch.queries.get(&id) else { continue };
            out.push(StorageQuery {
                id,
                hashes: query.hashes[query.first..].to_vec(),
                generation: query.generation,
            });
        }
    }

    /// Applies the answer to QUERY `id`: `Ok(n)` when its first `n` blocks are present on every
    /// rank, an error when the tier could not tell (nothing is adopted, and the ticket waits on
    /// nothing more: a prefetch's ticket never fails). The present blocks are
    /// adopted and loaded within the query's ticket (module flow, step 3), unless the tier is
    /// down by then.
    pub fn complete_storage_query(
        &mut self,
        id: u64,
        outcome: Result<usize, TransferFailure>,
    ) -> Result<(), QueryError> {
        let query = self.prefetch.queries.get(&id).ok_or(QueryError::UnknownQuery(id))?;
        let asked = query.hashes.len() - query.first;
        if let Ok(present) = outcome {
            if present > asked {
                return Err(QueryError::TooManyAnswers { id, asked, answered: present });
            }
        }
        let query = self.prefetch.remove(id).expect("found just above");
        // A ticket pushed out by newer ones: the loads still run, under a ticket of their own.
        let mut ticket = Some(query.ticket).filter(|ticket| self.tickets.contains_key(ticket));
        // Defensive: a reset clears the queries, so an answer of an older generation is refused
        // above as unknown; were one kept, it would adopt nothing. An answer arriving while the
        // tier is down adopts and loads nothing (`tier_health`). A QUERY the tier failed finds
        // nothing: a prefetch is advisory, and its ticket ends as one that found nothing does
        // (the worker counted the tier's error).
        let current = query.generation == self.generation && !self.tier.is_down();
        if let (Ok(present), true) = (outcome, current) {
            let present = present.min(query.limit);
            let known = &query.hashes[..query.first + present];
            let adopted = self.adopt_queried(known, query.first);
            self.stats.prefetch_found_blocks += adopted as u64;
            self.load_path(known, &mut ticket);
        }
        // The query itself is done: the ticket now waits on the loads alone.
        self.resolve_tickets(&[query.ticket], None);
        Ok(())
    }

    /// Whether the blocks past the first `path` of `hashes` could be adopted under the last
    /// node of that path: it exists (or is the root) and may have storage-only children.
    fn may_adopt_after(&self, hashes: &[BlockHash], path: usize) -> bool {
        match self.node_at(hashes, path) {
            Some(NodeId::ROOT) => true,
            Some(parent) => {
                self.tree.node(parent).state() != NodeState::HostToStorage(StoreOut::Evict)
            }
            None => false,
        }
    }

    /// The node that the first `len` of `hashes` lead to (the root for none), if the tree has
    /// the whole chain.
    fn node_at(&self, hashes: &[BlockHash], len: usize) -> Option<NodeId> {
        let mut node = NodeId::ROOT;
        for &hash in &hashes[..len] {
            node = self.tree.child(node, hash)?;
        }
        Some(node)
    }

    /// Adopts `known[first..]` as storage-only nodes under the node `known[..first]` leads to,
    /// as far as the adoption rules allow (blocks already cached are passed through), making
    /// room on a full tier by dropping its least recently used storage candidates (never a
    /// block held or in flight, nor one of the chain being adopted: it is held meanwhile), at
    /// most one per block adopted. Returns how many of `known` joined (the orphans that join
    /// under them after are not counted: the QUERY did not find them).
    fn adopt_queried(&mut self, known: &[BlockHash], first: usize) -> usize {
        let Some(mut parent) = self.node_at(known, first) else { return 0 };
        let mut held = std::mem::take(&mut self.scratch_prefetch_path);
        held.clear();
        let mut adopted = Vec::new();
        for &hash in &known[first..] {
            if parent != NodeId::ROOT {
                self.tree.update(parent, |node| node.hold());
                held.push(parent);
            }
            if let Some(existing) = self.tree.child(parent, hash) {
                parent = existing;
                continue;
            }
            if !self.make_storage_room() {
                break;
            }
            let Some(id) = self.adopt_one(parent, hash) else { break };
            adopted.push(id);
            parent = id;
        }
        for &id in &held {
            self.tree.update(id, |node| node.release());
        }
        self.scratch_prefetch_path = held;
        // The chain's blocks first, then those waiting for them (a block dropped during an
        // outage comes back from another service's copy).
        for &id in &adopted {
            self.adopt_orphans_under(id);
        }
        adopted.len()
    }

    /// Steps 1 and 2 of the module flow: walks `hashes` as far as the tree has them and starts
    /// loading the storage-only nodes of that path that can get host blocks, within `ticket`
    /// (made when first needed). Returns the length of the path.
    fn load_path(&mut self, hashes: &[BlockHash], ticket: &mut Option<TicketId>) -> usize {
        let mut path = std::mem::take(&mut self.scratch_prefetch_path);
        path.clear();
        let mut parent = NodeId::ROOT;
        for &hash in hashes {
            let Some(id) = self.tree.child(parent, hash) else { break };
            path.push(id);
            parent = id;
        }
        // Held while host blocks are obtained: no eviction may take a node of the path (an
        // upper node above the loads, or a storage-only node about to be loaded).
        for &id in &path {
            self.tree.update(id, |node| node.hold());
        }
        let mut load = None;
        // LOADs in flight above: this one goes after them (and is cancelled if they fail, so
        // that nothing lands above a block that went back to storage).
        let mut loads_above = std::mem::take(&mut self.scratch_prefetch_loads);
        loads_above.clear();
        for (index, &id) in path.iter().enumerate() {
            let node = self.tree.node(id);
            let state = node.state();
            if state == NodeState::HostToStorage(StoreOut::Evict) {
                break;
            }
            if state == NodeState::StorageToHost {
                let above = TransferId(node.transfer().expect("a node in flight names its copy"));
                if !loads_above.contains(&above) {
                    loads_above.push(above);
                }
            }
            if state != NodeState::Storage {
                continue;
            }
            // A block the tier reported missing (still held): nothing below it can be loaded.
            if !self.unloadable.is_empty()
                && super::match_prefix::is_lost(&self.tree, &self.unloadable, id)
            {
                break;
            }
            let Some(host) = self.obtain_host_block() else { break };
            let parent = if index == 0 { BlockHash(0) } else { hashes[index - 1] };
            let block = StorageBlock { hash: hashes[index], parent, depth: index as u32 };
            load = Some(self.start_prefetch_load(id, host, block));
        }
        if let Some(load) = load {
            let flight = self.flight_mut(load).expect("the load is open");
            for &above in &loads_above {
                if above != load && !flight.after.contains(&above) {
                    flight.after.push(above);
                }
            }
        }
        self.scratch_prefetch_loads = loads_above;
        for &id in &path {
            self.tree.update(id, |node| {
                node.release();
                node.access(Access::Release);
            });
        }
        let length = path.len();
        self.scratch_prefetch_path = path;
        if let Some(load) = load {
            self.close_transfers();
            let ticket = *ticket.get_or_insert_with(|| self.new_prefetch_ticket());
            self.wait_on(ticket, load);
        }
        length
    }

    /// Starts loading storage node `id` into `host_block` (with the STORE still reading it, if
    /// claimed from one) with no swap-in behind: it lands on host.
    fn start_prefetch_load(
        &mut self,
        id: NodeId,
        (host_block, store): (u32, Option<TransferId>),
        block: StorageBlock,
    ) -> TransferId {
        let (load, flight) = self.open_transfer(TransferKind::StorageToHost);
        flight.pairs.push(BlockPair::new(host_block, host_block));
        flight.blocks.push(block);
        flight.nodes.push(id);
        self.order_after_store(load, store);
        self.stats.load_blocks_issued += 1;
        self.stats.prefetch_load_blocks += 1;
        self.tree.update(id, |node| {
            node.set_host(Some(host_block));
            node.set_state(NodeState::StorageToHost);
            node.set_transfer(Some(load.0));
        });
        load
    }

    /// A ticket that belongs to no request, kept at most [`MAX_PREFETCH_TICKETS`] of its kind.
    fn new_prefetch_ticket(&mut self) -> TicketId {
        let id = TicketId(self.next_ticket);
        self.next_ticket += 1;
        self.tickets
            .insert(id, Ticket { request: None, pending: 0, failure: None, cached_blocks: None });
        self.prefetch.tickets.push_back(id);
        while self.prefetch.tickets.len() > MAX_PREFETCH_TICKETS {
            let oldest = self.prefetch.tickets.pop_front().expect("longer than its bound");
            self.tickets.remove(&oldest);
        }
        id
    }

    /// The swap-in that takes node `id`, being loaded by `load` (whose `then` is given: the
    /// LOAD may be out of the in-flight table already), on to the device: the LOAD's own for an
    /// allocation's LOAD, or, for a prefetch LOAD an allocation shared, the swap-in that
    /// allocation ordered after it. `None`: the node lands on host.
    pub(super) fn swap_in_behind(
        &self,
        load: TransferId,
        then: Option<TransferId>,
        id: NodeId,
    ) -> Option<TransferId> {
        if then.is_some() {
            return then;
        }
        self.tree.node(id).device()?;
        let open = self.open_host_to_device.as_ref().map(|(id, flight)| (*id, flight));
        open.into_iter()
            .chain(self.in_flight.iter().map(|(&id, flight)| (id, flight)))
            .find(|(_, flight)| {
                flight.kind == TransferKind::HostToDevice
                    && flight.after.contains(&load)
                    && flight.nodes.contains(&id)
            })
            .map(|(swap_in, _)| swap_in)
    }

    /// The in-flight record of `id`, open or closed, read-only.
    pub(super) fn flight(&self, id: TransferId) -> Option<&InFlight> {
        [
            &self.open_device_to_host,
            &self.open_host_to_device,
            &self.open_host_to_storage,
            &self.open_storage_to_host,
        ]
        .into_iter()
        .flatten()
        .find(|(open_id, _)| *open_id == id)
        .map(|(_, flight)| flight)
        .or_else(|| self.in_flight.get(&id))
        .map(|flight| &**flight)
    }

    /// Node `id`, which prefetch LOAD `load` brings up with no swap-in behind it, is met by an
    /// allocation: `device_block` and a swap-in ordered after the LOAD (added to `after`), in the
    /// ticket. Returns the swap-in.
    pub(super) fn follow_prefetch_load(
        &mut self,
        id: NodeId,
        ticket: TicketId,
        device_block: u32,
        after: &mut Vec<TransferId>,
    ) -> (TransferId, TransferId) {
        let node = self.tree.node(id);
        let load = TransferId(node.transfer().expect("a node in flight names its copy"));
        let host = node.host().expect("a load has its destination");
        let (swap_in, flight) = self.open_transfer(TransferKind::HostToDevice);
        flight.pairs.push(BlockPair::new(host, device_block));
        flight.nodes.push(id);
        self.tree.update(id, |node| node.set_device(Some(device_block)));
        self.wait_on(ticket, load);
        if !after.contains(&load) {
            after.push(load);
        }
        (load, swap_in)
    }

    /// Node `id`, loading with no swap-in behind it, is `Storage` again (its LOAD failed or was
    /// cancelled); its host block is the caller's to give back.
    pub(super) fn prefetch_back_to_storage(&mut self, id: NodeId) {
        self.stats.prefetch_failed_blocks += 1;
        self.tree.update(id, |node| {
            node.set_host(None);
            node.set_state(NodeState::Storage);
            node.set_transfer(None);
        });
    }
}
