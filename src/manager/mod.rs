//! The engine-facing cache manager (DESIGN §3, §4, §6): prefix matching, all-or-nothing
//! allocation with eviction under a write policy, commits, and the copies between the tiers.
//!
//! It owns the radix tree ([`crate::tree`]), the device and host pools ([`crate::pool`]), the live
//! requests, the copies in flight and their tickets. It runs on the engine's scheduler thread;
//! every operation costs O(blocks of the request), with O(1) per node touched (but an eviction
//! policy's placement of a node that joins a set late, see [`crate::tree::policy`]), and never
//! scans the tree (only `check_invariants`, `tree_snapshot` and `reset` do).
//!
//! The life of one request:
//! 1. [`CacheManager::match_prefix`] holds the longest cached prefix of its block hashes (device
//!    hits first, then host hits, then storage hits).
//! 2. [`CacheManager::allocate`] gives the host and storage hits and the new tokens device
//!    blocks, taking free blocks first, then claiming blocks being swapped out, then evicting
//!    under the write policy ([`evict`]); storage hits also get host blocks, loaded (LOAD) and
//!    then swapped in. It fails without changing anything when not enough can be had. It returns
//!    the block table and a ticket.
//! 3. The engine hands the copies of [`CacheManager::take_transfers`] to the workers and reports
//!    each with [`CacheManager::complete_transfer`]; the ticket becomes ready (or failed).
//! 4. [`CacheManager::commit`] caches the request's computed full blocks under its path.
//! 5. [`CacheManager::finish`] (or [`CacheManager::abort`]) releases what it holds.
//!
//! [`CacheManager::poll`] issues write-through backups and evicts ahead of demand.
//!
//! The storage tier below host ([`storage`]) holds blocks by hash, not in a pool: the manager
//! counts its used blocks against `storage_blocks` and the workers do the I/O (STORE and LOAD
//! copies).

mod allocate;
mod capacity;
mod commit;
mod complete;
mod config;
mod errors;
mod evict;
mod finish;
mod forget;
mod id_table;
pub(crate) mod ids;
mod invariants;
mod load_outcome;
mod match_prefix;
mod poll;
mod prefetch;
mod request;
mod stats;
mod storage;
mod tier_health;
mod transfer;

pub use allocate::Allocation;
pub use capacity::AllocationCheck;
pub use commit::Committed;
pub use config::{
    CacheConfig, ConfigError, EvictionPolicy, ParseEvictionPolicyError,
    ParseStorageWritePolicyError, ParseWritePolicyError, StorageWritePolicy, WritePolicy,
};
pub use errors::{
    AllocateError, CommitError, CompleteError, FinishError, InvariantViolation, MatchError,
    PromptError, ResetError, ResizeError, TicketError, UnknownRequest,
};
pub use load_outcome::BlockOutcome;
pub use match_prefix::{Lookup, PrefixMatch};
pub use prefetch::{PrefetchError, QueryError, StorageQuery, MAX_PREFETCH_TICKETS};
pub use request::RequestId;
pub use stats::{CacheCounters, CacheStats, Evictions, Hits};
pub use transfer::{
    BlockPair, CommandError, StorageBlock, TicketId, TicketStatus, Transfer, TransferFailure,
    TransferId, TransferKind, TransferStage, TransferView,
};

use crate::pool::BlockPool;
pub use crate::tree::FutureUses;
use crate::tree::{NodeId, Tree, TreeSnapshot};
use allocate::AllocateScratch;
use id_table::IdTable;
use ids::IdMap;
use request::{Request, Requests};
use transfer::{InFlight, Ticket};

const VALIDATED_CAPACITY: &str = "validate() refuses capacities a pool cannot hold";

/// The prefix cache and block pools of one engine.
#[derive(Debug)]
pub struct CacheManager {
    config: CacheConfig,
    tree: Tree,
    device: BlockPool,
    host: BlockPool,
    requests: Requests,
    tickets: IdTable<TicketId, Ticket>,
    in_flight: IdTable<TransferId, Box<InFlight>>,
    /// Copies created but not yet handed out by `take_transfers`, oldest first.
    outbox: Vec<TransferId>,
    /// The copies the current operation is filling (at most one per direction); moved to
    /// `in_flight` when the operation ends.
    open_device_to_host: Option<(TransferId, Box<InFlight>)>,
    open_host_to_device: Option<(TransferId, Box<InFlight>)>,
    open_host_to_storage: Option<(TransferId, Box<InFlight>)>,
    open_storage_to_host: Option<(TransferId, Box<InFlight>)>,
    /// Blocks the storage tier holds or is being written (nodes `stored` or `HostToStorage`).
    storage_used: u32,
    /// Nodes settled on host that write-through wants stored (lazily checked, as backups).
    pending_stores: Vec<NodeId>,
    /// Storage-only nodes whose LOAD failed, with their hash (an id may be reused): `poll` drops
    /// them once unheld.
    unloadable: Vec<(NodeId, crate::hash::BlockHash)>,
    /// Blocks the storage tier holds whose parent is not cached, by parent hash: (hash, depth).
    /// They join the tree under their parent when it joins (`adopt_orphans_under`).
    orphans: std::collections::HashMap<crate::hash::BlockHash, Vec<(crate::hash::BlockHash, u32)>>,
    /// The blocks in `orphans`.
    orphan_count: usize,
    /// `committed_blocks` past which the blocks in `orphans` are given up (forgotten).
    orphans_expire_at: u64,
    /// Hashes of blocks the tree dropped that the storage tier may hold, for the service to
    /// send in FORGET commands ([`CacheManager::take_forgotten_blocks`]).
    forgotten: Vec<crate::hash::BlockHash>,
    /// Whether the storage tier is down ([`tier_health`]).
    tier: tier_health::TierHealth,
    /// Blocks dropped while their STORE or LOAD was in flight: forgotten when it completes.
    forget_after_copy: std::collections::HashSet<crate::hash::BlockHash>,
    /// Prefetch tickets and storage queries in flight.
    prefetch: prefetch::Prefetches,
    /// Scratch of `prefetch`: the path walked, and the LOADs in flight on it.
    scratch_prefetch_path: Vec<NodeId>,
    scratch_prefetch_loads: Vec<TransferId>,
    /// Nodes waiting for a write-through backup (lazily checked: an entry whose node lost its
    /// `backup_queued` flag is skipped).
    pending_backups: Vec<NodeId>,
    /// Scratch of the allocation dry run: device children counted as gone, per node, and the
    /// nodes that became candidates by it.
    scratch_reclaim: (IdMap<NodeId, u32>, Vec<NodeId>),
    /// Scratch buffers of `allocate`, kept so that an allocation allocates no memory; boxed, so
    /// that `allocate` takes them out for the call by moving a pointer (`None` only meanwhile).
    scratch: Option<Box<AllocateScratch>>,
    /// Emptied records of completed copies, reused with their buffers.
    // Boxed on purpose: a spare moves into an open slot and on to `in_flight` as a pointer.
    #[allow(clippy::vec_box)]
    spare_flights: Vec<Box<InFlight>>,
    generation: u64,
    next_transfer: u64,
    next_ticket: u64,
    stats: stats::CacheCounters,
}

impl CacheManager {
    /// A cache manager for `config`. An offline eviction policy (one that needs the future) is
    /// refused: see [`CacheManager::with_future`].
    pub fn new(config: CacheConfig) -> Result<CacheManager, ConfigError> {
        if config.eviction.is_offline() {
            return Err(ConfigError::OfflinePolicy(config.eviction));
        }
        CacheManager::build(config)
    }

    /// A cache manager whose offline eviction policy (`optimal`) orders by `future`: the uses
    /// of every block in the requests to come, which only a replay of a known trace has. The
    /// requests must then be matched in the order `future` numbers them, each once.
    pub fn with_future(
        config: CacheConfig,
        future: FutureUses,
    ) -> Result<CacheManager, ConfigError> {
        let mut cache = CacheManager::build(config)?;
        if !cache.tree.foresee(future) {
            return Err(ConfigError::OnlinePolicy(cache.config.eviction));
        }
        Ok(cache)
    }

    fn build(config: CacheConfig) -> Result<CacheManager, ConfigError> {
        config.validate()?;
        // An index for every block of the device and host tiers up front (storage-only nodes
        // beyond them grow it as they come).
        let blocks = config.device_blocks as usize + config.host_blocks as usize;
        let mut tree = Tree::with_capacity(config.eviction, blocks);
        tree.configure_policy(config.device_blocks, config.host_blocks);
        Ok(CacheManager {
            tree,
            device: BlockPool::new(config.device_blocks).expect(VALIDATED_CAPACITY),
            host: BlockPool::new(config.host_blocks).expect(VALIDATED_CAPACITY),
            config,
            requests: Requests::default(),
            tickets: IdTable::default(),
            in_flight: IdTable::default(),
            outbox: Vec::new(),
            open_device_to_host: None,
            open_host_to_device: None,
            open_host_to_storage: None,
            open_storage_to_host: None,
            storage_used: 0,
            pending_stores: Vec::new(),
            unloadable: Vec::new(),
            orphans: std::collections::HashMap::new(),
            orphan_count: 0,
            orphans_expire_at: 0,
            forgotten: Vec::new(),
            tier: tier_health::TierHealth::default(),
            forget_after_copy: std::collections::HashSet::new(),
            prefetch: prefetch::Prefetches::default(),
            scratch_prefetch_path: Vec::new(),
            scratch_prefetch_loads: Vec::new(),
            pending_backups: Vec::new(),
            scratch_reclaim: Default::default(),
            scratch: Some(Box::default()),
            spare_flights: Vec::new(),
            generation: 0,
            next_transfer: 1,
            next_ticket: 1,
            stats: stats::CacheCounters::default(),
        })
    }

    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    /// Bumped by every reset; copies carry the generation they were issued in.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The radix tree, read-only (for inspection and tests).
    pub fn tree(&self) -> &Tree {
        &self.tree
    }

    /// The flat picture of the tree down to `max_depth`, for `kvctl tree`.
    pub fn tree_snapshot(&self, max_depth: u32) -> TreeSnapshot {
        self.tree.snapshot(max_depth)
    }

    pub fn free_device_blocks(&self) -> usize {
        self.device.free_count()
    }

    pub fn free_host_blocks(&self) -> usize {
        self.host.free_count()
    }

    /// The block table of a live request: hits first, then its own blocks.
    pub fn block_table(&self, request: RequestId) -> Option<&[u32]> {
        self.requests.get(&request).map(|request| request.table.as_slice())
    }

    /// Live requests.
    pub fn request_count(&self) -> usize {
        self.requests.len()
    }

    /// Copies issued and not yet completed (including those not yet taken).
    pub fn transfers_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Where the ticket of an allocation stands.
    pub fn ticket_status(&self, ticket: TicketId) -> Result<TicketStatus, TicketError> {
        self.tickets.get(&ticket).map(Ticket::status).ok_or(TicketError::UnknownTicket(ticket))
    }

    /// The request `ticket` serves (`None` for a prefetch's ticket).
    pub fn ticket_request(&self, ticket: TicketId) -> Option<RequestId> {
        self.tickets.get(&ticket).and_then(|ticket| ticket.request)
    }

    /// The positions of `ticket`'s block table still cached when a storage miss shortened its
    /// request's hit (`None` otherwise; see [`TicketStatus::Shortened`]). Set as soon as the
    /// LOADs it waits on complete, before the swap-ins behind them are issued.
    pub fn ticket_cached_blocks(&self, ticket: TicketId) -> Result<Option<u32>, TicketError> {
        self.tickets
            .get(&ticket)
            .map(|ticket| ticket.cached_blocks)
            .ok_or(TicketError::UnknownTicket(ticket))
    }

    /// The copies in flight that `ticket` still waits on (for per-layer progress, which lives with
    /// the copies). Linear in the copies in flight, which are few.
    pub fn ticket_transfers(&self, ticket: TicketId) -> impl Iterator<Item = TransferId> + '_ {
        self.in_flight
            .iter()
            .filter(move |(_, flight)| flight.tickets.contains(&ticket))
            .map(|(&id, _)| id)
    }

    /// Bytes of heap memory held by the tree, the pools, requests and copies (an estimate by
    /// capacity; see `Tree::heap_bytes`).
    pub fn heap_bytes(&self) -> usize {
        let requests: usize = self
            .requests
            .values()
            .map(|request| {
                (request.path.capacity() + request.table.capacity() + request.private.capacity())
                    * 4
                    + size_of::<Request>()
            })
            .sum();
        self.tree.heap_bytes() + self.device.heap_bytes() + self.host.heap_bytes() + requests
    }

    fn host_enabled(&self) -> bool {
        self.host.capacity() > 0
    }

    fn free_device(&mut self, block: u32) {
        self.device.free(block).expect("freeing a device block not in use is a programming error");
    }

    fn free_host(&mut self, block: u32) {
        self.host.free(block).expect("freeing a host block not in use is a programming error");
    }
}
