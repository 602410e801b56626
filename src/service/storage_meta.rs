//! The storage commands that move no block bytes: QUERY (which blocks does every rank's tier hold,
//! for a prefetch) and FORGET (the scheduler dropped these blocks), DESIGN §9.
//!
//! Core type: [`MetaCommands`], the service's record of those in flight. Their ids live in their
//! own range ([`META_BIT`]), beside the manager's transfer ids and direct copies, so that the
//! command tracker joins their per-rank completions like any other.
//!
//! 1. Before the copies of a step are issued, the service takes the manager's forgotten blocks
//!    and sends them as FORGET commands to every rank (at most `max_storage_entries` per
//!    command, fire-and-forget: a failure is only counted), so that a FORGET precedes, in each
//!    rank's ring, the STOREs the same step issues;
//! 2. then it takes the manager's QUERYs and sends each to every rank in the same way, keeping
//!    per command where its entries start;
//! 3. each QUERY completion's result bits are ANDed into the query's per-block presence (a
//!    block the tier could not tell about counts as absent);
//! 4. when every command of a QUERY completed on every rank, the manager gets the leading run
//!    of blocks present everywhere (or the failure, when a command failed or a rank died).

use std::collections::HashMap;

use kvshm_ipc::record::{CommandError, CommandHeader, Completion, Op};
use kvshm_ipc::storage_record::{storage_pair_count, StorageEntry, StorageResults, NO_HOST_BLOCK};
use tracing::warn;

use super::Service;
use crate::hash::BlockHash;
use crate::manager::{StorageQuery, TransferFailure};

/// The bit that marks the tracker id of a QUERY or FORGET (direct copies use bit 63).
const META_BIT: u64 = 1 << 62;

/// Whether tracker id `id` is a QUERY's or a FORGET's.
pub(super) fn is_meta(id: u64) -> bool {
    id & META_BIT != 0 && !super::direct::is_direct(id)
}

/// What one QUERY or FORGET in flight is.
#[derive(Debug)]
enum Meta {
    Forget,
    Query {
        /// The manager's query id.
        query: u64,
        /// Per block: present on every rank that answered so far.
        present: Vec<bool>,
    },
}

/// The QUERYs and FORGETs in flight (module flow).
#[derive(Debug, Default)]
pub(super) struct MetaCommands {
    next: u64,
    by_id: HashMap<u64, Meta>,
    /// Per (rank index, command id) of a QUERY command: its tracker id, first entry and entries.
    query_commands: HashMap<(usize, u64), (u64, usize, usize)>,
    /// Scratch for the manager's forgotten blocks and queries.
    forgotten: Vec<BlockHash>,
    queries: Vec<StorageQuery>,
}

impl MetaCommands {
    fn new_id(&mut self, meta: Meta) -> u64 {
        let id = META_BIT | self.next;
        self.next += 1;
        self.by_id.insert(id, meta);
        id
    }

    /// Step 3: folds a QUERY command's result bits into its query's presence.
    pub(super) fn note_completion(&mut self, index: usize, completion: &Completion) {
        if self.query_commands.is_empty() {
            return;
        }
        let Some((id, first, entries)) =
            self.query_commands.remove(&(index, completion.command_id))
        else {
            return;
        };
        let Some(Meta::Query { present, .. }) = self.by_id.get_mut(&id) else { return };
        if !completion.is_ok() {
            return;
        }
        let results = StorageResults::from_detail(completion.detail).masked(entries);
        for (offset, slot) in present[first..first + entries].iter_mut().enumerate() {
            *slot &= results.is_done(offset);
        }
    }

    /// A rank was lost: its QUERY commands will not answer (the tracker fails them).
    pub(super) fn forget_rank(&mut self, index: usize) {
        self.query_commands.retain(|&(rank, _), _| rank != index);
    }
}

impl Service {
    /// Steps 1 and 2 of the module flow.
    pub(super) fn issue_storage_meta(&mut self) {
        if self.manager.config().storage_blocks == 0 {
            return;
        }
        let mut forgotten = std::mem::take(&mut self.meta.forgotten);
        self.manager.take_forgotten_blocks(&mut forgotten);
        if !forgotten.is_empty() {
            self.send_forgets(&forgotten);
            forgotten.clear();
        }
        self.meta.forgotten = forgotten;
        let mut queries = std::mem::take(&mut self.meta.queries);
        self.manager.take_storage_queries(&mut queries);
        for query in queries.drain(..) {
            self.send_query(query);
        }
        self.meta.queries = queries;
    }

    fn send_forgets(&mut self, hashes: &[BlockHash]) {
        if self.ranks.iter().any(|rank| rank.is_down()) {
            // A rank without a worker cannot be told; its slab keeps them (counted).
            self.stats.storage_forgets_dropped += hashes.len() as u64;
            return;
        }
        let id = self.meta.new_id(Meta::Forget);
        let entries: Vec<StorageEntry> =
            hashes.iter().map(|hash| StorageEntry::new(hash.0, 0, 0, NO_HOST_BLOCK)).collect();
        self.queue_meta_commands(id, Op::StorageForget, &entries, false);
        self.stats.storage_forgets_sent += hashes.len() as u64;
    }

    fn send_query(&mut self, query: StorageQuery) {
        if let Some(down) = self.ranks.iter().find(|rank| rank.is_down()) {
            let failure =
                TransferFailure { rank: down.rank(), error: CommandError::WorkerDied, detail: 0 };
            self.answer_query(query.id, Err(failure));
            return;
        }
        if query.hashes.is_empty() {
            self.answer_query(query.id, Ok(0));
            return;
        }
        let id = self
            .meta
            .new_id(Meta::Query { query: query.id, present: vec![true; query.hashes.len()] });
        let entries: Vec<StorageEntry> = query
            .hashes
            .iter()
            .map(|hash| StorageEntry::new(hash.0, 0, 0, NO_HOST_BLOCK))
            .collect();
        self.queue_meta_commands(id, Op::StorageQuery, &entries, true);
    }

    /// Queues `entries` as commands of `op` on every rank under tracker id `id`.
    fn queue_meta_commands(&mut self, id: u64, op: Op, entries: &[StorageEntry], query: bool) {
        let generation = self.segment.generation();
        let chunk_len = self.max_storage_entries;
        for (chunk_index, chunk) in entries.chunks(chunk_len).enumerate() {
            let header = CommandHeader::new(op, 0, generation, storage_pair_count(chunk.len()));
            for (index, rank) in self.ranks.iter_mut().enumerate() {
                let command_id = rank.queue_storage(header, chunk);
                self.tracker.begin(id, rank.rank() as usize, command_id);
                if query {
                    let first = chunk_index * chunk_len;
                    self.meta.query_commands.insert((index, command_id), (id, first, chunk.len()));
                }
                self.stats.commands_issued += 1;
            }
        }
    }

    /// Step 4: every command of QUERY or FORGET `id` completed on every rank.
    pub(super) fn settle_meta(&mut self, id: u64, outcome: Result<(), TransferFailure>) {
        match self.meta.by_id.remove(&id) {
            Some(Meta::Forget) => {
                if let Err(failure) = outcome {
                    self.stats.storage_forget_failures += 1;
                    warn!(%failure, "a FORGET failed; the tier keeps those blocks");
                }
            }
            Some(Meta::Query { query, present }) => {
                let outcome = outcome.map(|()| present.iter().take_while(|&&held| held).count());
                self.answer_query(query, outcome);
            }
            None => warn!(id, "a storage query or forget completed twice"),
        }
    }

    fn answer_query(&mut self, query: u64, outcome: Result<usize, TransferFailure>) {
        if let Err(error) = self.manager.complete_storage_query(query, outcome) {
            warn!(query, %error, "the cache manager refused a query's answer");
        }
    }
}
