//! `poll`: the work that does not belong to one request.
//!
//! 1. Issue the pending write-through backups as one device-to-host copy, taking host blocks
//!    from the pool or from host candidates; when none can be had the rest are dropped from the
//!    queue (an eviction will copy them in an emergency instead). Without a storage tier the
//!    tree does the usual ones in runs ([`Tree::backup_run`]), the others one by one.
//! 2. Evict ahead of demand until `free_watermark` device blocks are free or on their way.
//! 3. Issue the pending write-through STOREs of blocks settled on host (storage tier), and drop
//!    the storage-only blocks whose LOAD failed once no request holds them, and give up stored
//!    blocks whose parent never came back (`forget`).
//!
//! Completions are applied as they arrive through `complete_transfer`.
//!
//! [`Tree::backup_run`]: crate::tree::Tree::backup_run

use super::transfer::{BlockPair, InFlight};
use super::{CacheManager, TransferKind};
use crate::pool::BlockPool;
use crate::tree::policy::EvictSet;
use crate::tree::{BackupEnd, BackupRun, BackupSink, NodeId, NodeState, SwapOut};

impl CacheManager {
    /// Issues pending backups and watermark evictions as new copies (module flow).
    // Inline: the usual poll finds nothing to do, a few tests; the work is out of line.
    #[inline]
    pub fn poll(&mut self) {
        if !self.pending_backups.is_empty() {
            self.issue_backups();
        }
        let watermark = self.config.free_watermark as usize;
        if watermark > 0 {
            self.evict_toward(watermark);
        }
        if !self.pending_stores.is_empty() {
            self.issue_stores();
        }
        if !self.unloadable.is_empty() {
            self.drop_unloadable();
        }
        if !self.orphans.is_empty() {
            self.expire_orphans();
        }
        self.close_transfers();
    }

    /// Nodes queued for a backup and not yet issued.
    pub fn pending_backups(&self) -> usize {
        self.pending_backups
            .iter()
            .filter(|&&id| self.tree.is_live(id) && self.tree.node(id).backup_queued())
            .count()
    }

    #[inline(never)]
    fn issue_backups(&mut self) {
        let mut queue = std::mem::take(&mut self.pending_backups);
        // Without a storage tier the tree starts the usual backups in runs; with one, every
        // node goes by the per-node path (its host evictions may write back to storage).
        if self.host_enabled() && !self.storage_enabled() && !self.general_forms_only() {
            self.issue_backups_in_runs(&queue);
        } else {
            self.issue_backups_one_by_one(&queue, false);
        }
        // Issuing queues nothing new: the emptied queue keeps its buffer.
        queue.clear();
        queue.append(&mut self.pending_backups);
        self.pending_backups = queue;
    }

    /// [`CacheManager::issue_backups`] of `queue` by the tree's runs ([`Tree::backup_run`]),
    /// each node a run leaves by the per-node path ([`CacheManager::issue_backup`]).
    ///
    /// [`Tree::backup_run`]: crate::tree::Tree::backup_run
    fn issue_backups_in_runs(&mut self, queue: &[NodeId]) {
        let mut run = BackupRun::default();
        loop {
            let CacheManager { tree, host, open_device_to_host, .. } = self;
            let left = queue.len() - run.next;
            let swap_out = open_device_to_host.as_mut().map(|(id, flight)| {
                let InFlight { pairs, nodes, .. } = &mut **flight;
                pairs.reserve(left);
                nodes.reserve(left);
                (id.0, pairs, nodes)
            });
            let copy = swap_out.as_ref().map(|(id, ..)| *id);
            let mut sink = PollBackups { host, swap_out };
            match tree.backup_run(&mut run, queue, copy, &mut sink) {
                BackupEnd::Done => break,
                BackupEnd::NeedsCopy
                    if self.host.free_count() > 0 || self.tree.host_candidate_count() > 0 =>
                {
                    self.open_transfer(TransferKind::DeviceToHost);
                }
                BackupEnd::NeedsCopy | BackupEnd::General => {
                    // The per-node path takes the first host candidate: the parent left
                    // unfiled is one again first.
                    if let Some(parent) = run.exposed_host.take() {
                        if self.tree.is_live(parent) {
                            self.tree.file_exposed(parent, EvictSet::Host);
                        }
                    }
                    let mut out_of_host = false;
                    self.issue_backup(queue[run.next], &mut out_of_host);
                    run.next += 1;
                    if out_of_host {
                        self.issue_backups_one_by_one(&queue[run.next..], true);
                        break;
                    }
                }
            }
        }
        if let Some(parent) = run.exposed_host.filter(|&parent| self.tree.is_live(parent)) {
            self.tree.file_exposed(parent, EvictSet::Host);
        }
        self.stats.backups_issued += run.started;
        self.stats.evictions.host_dropped += run.host_dropped;
    }

    /// [`CacheManager::issue_backups`] of `queue` node by node; `out_of_host`: whether no host
    /// block can be had already.
    fn issue_backups_one_by_one(&mut self, queue: &[NodeId], mut out_of_host: bool) {
        for &id in queue {
            self.issue_backup(id, &mut out_of_host);
        }
    }

    /// Issues the backup of queued node `id` if it still wants one and a host block can be had
    /// (`out_of_host` says when none can, and is set when none could).
    // Inline: the loop of the per-node path stays one function, as before the runs.
    #[inline(always)]
    fn issue_backup(&mut self, id: NodeId, out_of_host: &mut bool) {
        if !self.tree.is_live(id) || !self.tree.node(id).backup_queued() {
            return;
        }
        self.tree.update(id, |node| node.set_backup_queued(false));
        let node = self.tree.node(id);
        if *out_of_host || node.state() != NodeState::Device || node.host().is_some() {
            return;
        }
        match self.obtain_host_block() {
            Some((block, store)) => {
                let transfer = self.start_swap_out(id, block, SwapOut::Backup);
                self.order_after_store(transfer, store);
                self.stats.backups_issued += 1;
            }
            None => *out_of_host = true,
        }
    }
}

/// The manager's side of a backup run ([`Tree::backup_run`]): the host pool, and, once the
/// swap-out is open, its id, pairs and nodes (with room reserved for every node left).
///
/// [`Tree::backup_run`]: crate::tree::Tree::backup_run
struct PollBackups<'a> {
    host: &'a mut BlockPool,
    swap_out: Option<(u64, &'a mut Vec<BlockPair>, &'a mut Vec<NodeId>)>,
}

impl BackupSink for PollBackups<'_> {
    fn free_host_blocks(&self) -> usize {
        self.host.free_count()
    }

    fn take_free_host_block(&mut self) -> u32 {
        self.host.allocate_one().expect("taking a free block that is there")
    }

    #[inline(always)] // once per backup, in the run's loop
    fn backed_up(&mut self, id: NodeId, device: u32, host: u32) {
        let (_, pairs, nodes) =
            self.swap_out.as_mut().expect("a run backs up only with its swap-out open");
        pairs.push(BlockPair::new(device, host));
        nodes.push(id);
    }
}
