//! The local-disk back-end: a preallocated slab file per rank, written with O_DIRECT where the
//! file system allows, and a persisted index, so that the cache survives a restart.
//!
//! Core types: [`DiskBackend`], [`DiskOptions`], [`DiskError`], and the test hook [`CrashHook`].
//!
//! Files, under `DIR/NAMESPACE/` (one pair per rank, locked by the worker that owns the rank):
//! - `rank-R.slab`: `capacity` slots of `slot_bytes` (`block_bytes` rounded up to 4 KiB), each
//!   holding one block's bytes, nothing else, so that a host block goes to disk without a copy;
//! - `rank-R.index`: the header (layout, capacity) and one record per slot ([`super::disk_index`]).
//!
//! In memory (`slots`): a map from block hash to slot, the free slots, and an LRU list of used
//! slots threaded through the slot array (ids, not pointers). When no slot is free, a put takes
//! the least recently used one (counted in `BackendStats::evictions`). A batch is touched in
//! reverse order, so a prefix stored or read together keeps its first blocks more recent than
//! its last: the slab drops leaves before their parents.
//!
//! - `options`: what the back-end is opened with, the crash hook, why opening fails;
//! - `open`: creating or reopening a rank's pair of files, and the slots read back;
//! - `slots`: the slots in memory and their LRU list;
//! - `put`: one put batch, in five steps (slots, stale records zeroed, bytes, records, LRU);
//! - `get`: one get batch (look up, read, verify, touch).
//!
//! A failed step fails its blocks only; a full file system (`ENOSPC`, `EDQUOT`, or `EFBIG` from a
//! file size limit) is [`Failure::NoSpace`]. A block that does not verify against its record's
//! checksum is dropped and is [`GetMiss::Corrupt`](super::backend::GetMiss::Corrupt).
//!
//! Crash rules: see [`super::disk_index`]. A process killed at any point leaves every slot empty,
//! with its old block or with its new block; the test hook [`CrashHook`] kills the process at
//! each step so that tests can check it.

mod get;
mod open;
mod options;
mod put;
mod slots;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::backend::{
    BackendStats, BlockLayout, ContainsOutcome, Failure, GetBlock, GetOutcome, PutBlock,
    PutOutcome, StorageBackend,
};
use super::direct_io::{failure_of, DataFile, IoMode};
use super::disk_index::IndexFile;
use super::slab_io::{crash_now, SlabIo};
use crate::hash::BlockHash;
pub use options::{CrashHook, CrashPoint, DiskError, DiskOptions};
use slots::Slot;

/// The local-disk back-end of one rank (module documentation).
pub struct DiskBackend {
    layout: BlockLayout,
    rank: u32,
    index: IndexFile,
    data: DataFile,
    slab: PathBuf,
    slot_bytes: u64,
    slots: Vec<Slot>,
    by_hash: HashMap<BlockHash, u32>,
    free: Vec<u32>,
    /// Slots set aside after a write of theirs failed, each with the count of
    /// `successful_writes` at which it goes back to the free list ([`DiskBackend::note_writes`]).
    failed: Vec<(u32, u64)>,
    /// Blocks written whole since opening.
    successful_writes: u64,
    /// Block writes of the batches that landed none since the last batch that landed one.
    failures_in_a_row: u64,
    /// Most recently used.
    head: u32,
    /// Least recently used: the next to go.
    tail: u32,
    next_sequence: u64,
    writes: u64,
    crash: Option<CrashHook>,
    stats: BackendStats,
    /// Damaged records found when opening.
    damaged_at_open: u64,
    /// Something may have been written since the last successful sync (so the drop syncs).
    unsynced: bool,
}

impl std::fmt::Debug for DiskBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskBackend")
            .field("slab", &self.slab)
            .field("mode", &self.data.mode())
            .field("capacity", &self.slots.len())
            .field("used", &self.by_hash.len())
            .finish()
    }
}

impl DiskBackend {
    /// The I/O mode the file system allowed.
    pub fn io_mode(&self) -> IoMode {
        self.data.mode()
    }

    pub fn slab_path(&self) -> &Path {
        &self.slab
    }

    pub fn index_path(&self) -> &Path {
        self.index.path()
    }

    /// Bytes between two slots in the slab.
    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    /// The slot that holds `hash`, if any (tests use it to damage a record on purpose).
    pub fn slot_of(&self, hash: BlockHash) -> Option<u32> {
        self.by_hash.get(&hash).copied()
    }

    /// Damaged index records found (and zeroed) when the back-end was opened.
    pub fn damaged_at_open(&self) -> u64 {
        self.damaged_at_open
    }

    /// Blocks held now.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    fn crash_if(&self, write: u64, point: CrashPoint) {
        if self.crash == Some(CrashHook { write, point }) {
            crash_now();
        }
        if point == CrashPoint::AfterInvalidate
            && self.crash == Some(CrashHook { write, point: CrashPoint::Panic })
        {
            panic!("test hook: the storage thread panics at write {write}");
        }
    }

    /// What the I/O threads of one batch share.
    fn io(&self) -> SlabIo<'_> {
        SlabIo {
            file: self.data.file(),
            mode: self.data.mode(),
            slot_bytes: self.slot_bytes,
            block_bytes: self.layout.block_bytes,
            crash: self.crash,
        }
    }
}

impl StorageBackend for DiskBackend {
    fn kind(&self) -> &'static str {
        "disk"
    }

    fn is_shared(&self) -> bool {
        false
    }

    fn layout(&self) -> BlockLayout {
        self.layout
    }

    fn put(&mut self, blocks: &[PutBlock<'_>], outcomes: &mut Vec<PutOutcome>) {
        self.put_batch(blocks, outcomes);
    }

    fn get(&mut self, blocks: &mut [GetBlock<'_>], outcomes: &mut Vec<GetOutcome>) {
        self.get_batch(blocks, outcomes);
    }

    fn contains(&mut self, hashes: &[BlockHash], outcomes: &mut Vec<ContainsOutcome>) {
        outcomes.clear();
        outcomes.extend(hashes.iter().map(|hash| Ok(self.by_hash.contains_key(hash))));
    }

    fn remove(&mut self, hashes: &[BlockHash], outcomes: &mut Vec<PutOutcome>) {
        self.unsynced = true;
        outcomes.clear();
        for hash in hashes {
            let outcome = match self.by_hash.get(hash) {
                None => Ok(()),
                Some(&slot) => {
                    self.forget(slot);
                    self.zero_record(slot)
                }
            };
            outcomes.push(outcome);
        }
        self.stats.used_blocks = Some(self.by_hash.len() as u64);
    }

    /// The slab owns its room: a block the scheduler dropped is removed (its slot freed, its
    /// index record zeroed like any other index change).
    fn forget(&mut self, hashes: &[BlockHash], outcomes: &mut Vec<PutOutcome>) {
        self.remove(hashes, outcomes);
    }

    fn sync(&mut self) -> Result<(), Failure> {
        self.data.file().sync_data().map_err(|e| failure_of(&e))?;
        self.index.sync().map_err(|e| failure_of(&e))?;
        self.unsynced = false;
        Ok(())
    }

    fn stats(&self) -> BackendStats {
        BackendStats { used_blocks: Some(self.by_hash.len() as u64), ..self.stats }
    }
}

impl Drop for DiskBackend {
    /// Syncs what was written since the last sync (a worker syncs at exit already: once is
    /// enough).
    fn drop(&mut self) {
        if !self.unsynced {
            return;
        }
        if let Err(failure) = self.sync() {
            tracing::warn!(slab = %self.slab.display(), %failure, "cannot sync the storage slab");
        }
    }
}
