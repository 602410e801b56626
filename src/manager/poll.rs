//! `poll`: the work that does not belong to one request.
//!
//! 1. Issue the pending write-through backups as one device-to-host copy, taking host blocks
//!    from the pool or from host candidates; when none can be had the rest are dropped from the
//!    queue (an eviction will copy them in an emergency instead).
//! 2. Evict ahead of demand until `free_watermark` device blocks are free or on their way.
//! 3. Issue the pending write-through STOREs of blocks settled on host (storage tier), and drop
//!    the storage-only blocks whose LOAD failed once no request holds them, and give up stored
//!    blocks whose parent never came back (`forget`).
//!
//! Completions are applied as they arrive through `complete_transfer`.

use super::CacheManager;
use crate::tree::{NodeId, NodeState, SwapOut};

impl CacheManager {
    /// Issues pending backups and watermark evictions as new copies (module flow).
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

    fn issue_backups(&mut self) {
        let mut queue = std::mem::take(&mut self.pending_backups);
        let mut out_of_host = false;
        for &id in &queue {
            self.issue_backup(id, &mut out_of_host);
        }
        // Issuing queues nothing new: the emptied queue keeps its buffer.
        queue.clear();
        queue.append(&mut self.pending_backups);
        self.pending_backups = queue;
    }

    /// Issues the backup of queued node `id` if it still wants one and a host block can be had
    /// (`out_of_host` says when none can, and is set when none could).
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
