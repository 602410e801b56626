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
//! In memory: a map from block hash to slot, the free slots, and an LRU list of used slots
//! threaded through the slot array (ids, not pointers). When no slot is free, a put takes the
//! least recently used one (counted in `BackendStats::evictions`). A batch is touched in reverse
//! order, so a prefix stored or read together keeps its first blocks more recent than its last:
//! the slab drops leaves before their parents.
//!
//! One put batch ([`DiskBackend::put`]):
//!
//! 1. blocks already stored count as stored; the others get a slot (free, else the LRU one's);
//! 2. slots that held a record get their index record zeroed first;
//! 3. the blocks' bytes are written, consecutive slots in one vectored call (up to 8 blocks),
//!    straight from the caller's memory when it is aligned for O_DIRECT (the host tier is), else
//!    through an aligned bounce buffer; a batch of 1 MiB or more spreads these calls over up to
//!    four threads, each computing the checksums of the blocks it wrote;
//! 4. the index records (hash, parent, depth, sequence, checksum) are written;
//! 5. the map and the LRU list learn the new blocks.
//!
//! A failed step fails its blocks only; a full file system (`ENOSPC`, `EDQUOT`, or `EFBIG` from a
//! file size limit) is [`Failure::NoSpace`]. One get batch: look the slots up, read them
//! (consecutive ones in one call, into the destinations when aligned; large batches on up to four
//! threads), verify each block against its record's checksum on the thread that read it; a
//! mismatch drops the record and is [`GetMiss::Corrupt`].
//!
//! Crash rules: see [`super::disk_index`]. A process killed at any point leaves every slot empty,
//! with its old block or with its new block; the test hook [`CrashHook`] kills the process at
//! each step so that tests can check it.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::backend::{
    check_len, BackendStats, BlockLayout, ContainsOutcome, Failure, GetBlock, GetMiss, GetOutcome,
    PutBlock, PutOutcome, StorageBackend,
};
use super::block_bytes::BlockBytesMut;
use super::direct_io::{failure_of, is_no_space, preallocate, DataFile, IoMode, IO_ALIGN};
use super::disk_index::{
    check_header, index_path, slab_path, IndexError, IndexFile, IndexHeader, Opened, RecordState,
    SlotRecord,
};
use super::format::payload_checksum;
use super::slab_io::{
    consecutive_runs, crash_now, io_threads, run_groups, work_items, Planned, ReadItem, SlabIo,
};
use crate::hash::BlockHash;

/// What a disk back-end is opened with.
#[derive(Clone, Debug)]
pub struct DiskOptions {
    /// The directory the user named; the namespace is a directory inside it.
    pub dir: PathBuf,
    /// A validated storage namespace ([`super::spec::StorageNamespace`]).
    pub namespace: String,
    pub rank: u32,
    pub layout: BlockLayout,
    /// Slots of the slab (blocks this rank can hold).
    pub capacity_blocks: u64,
    /// Try O_DIRECT (the default); `false` forces buffered I/O.
    pub prefer_direct: bool,
    /// Test hook: kill the process at a point of a write (see [`CrashHook`]).
    pub crash: Option<CrashHook>,
}

/// Test hook: raise SIGKILL in the middle of the `write`-th block written since the back-end
/// was opened (counting from 1), at `point`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CrashHook {
    pub write: u64,
    pub point: CrashPoint,
}

/// Where [`CrashHook`] kills the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashPoint {
    /// After the old record of the block's slot was zeroed (step 2).
    AfterInvalidate,
    /// After half of the block's bytes were written (step 3).
    MidPayload,
    /// After the block's bytes were written, before its record (between steps 3 and 4).
    BeforeRecord,
}

impl std::str::FromStr for CrashHook {
    type Err = String;

    /// `POINT@N`, POINT one of `after-invalidate`, `mid-payload`, `before-record`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let error = || {
            format!(
                "crash hook {text:?} is not POINT@N (after-invalidate, mid-payload, before-record)"
            )
        };
        let (point, write) = text.split_once('@').ok_or_else(error)?;
        let point = match point {
            "after-invalidate" => CrashPoint::AfterInvalidate,
            "mid-payload" => CrashPoint::MidPayload,
            "before-record" => CrashPoint::BeforeRecord,
            _ => return Err(error()),
        };
        let write = write.parse().map_err(|_| error())?;
        Ok(CrashHook { write, point })
    }
}

/// Why a disk back-end cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error(transparent)]
    Index(#[from] IndexError),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error(
        "no room for the storage slab {path} ({bytes} bytes for {blocks} blocks): {source}; \
         free space or ask for fewer storage blocks"
    )]
    NoSpace { path: PathBuf, bytes: u64, blocks: u64, source: std::io::Error },
    #[error("a storage tier of {blocks} blocks needs at least one block")]
    ZeroCapacity { blocks: u64 },
    #[error("a slab of {blocks} blocks of {slot_bytes} bytes is too large")]
    TooLarge { blocks: u64, slot_bytes: u64 },
}

/// "No slot" in the LRU links.
const NONE: u32 = u32::MAX;

/// What the index file says about a slot, as far as this process knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OnDisk {
    Empty,
    Valid,
    /// A write of its record failed: zero it before reusing the slot.
    Unknown,
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    record: SlotRecord,
    on_disk: OnDisk,
    /// In the map and the LRU list.
    used: bool,
    /// Taken by the batch being run (never evicted by it).
    pinned: bool,
    prev: u32,
    next: u32,
}

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
    /// Opens (or creates) the slab and index of `options.rank` (flow in [`super::disk_index`]).
    pub fn open(options: &DiskOptions) -> Result<DiskBackend, DiskError> {
        let capacity = options.capacity_blocks;
        if capacity == 0 {
            return Err(DiskError::ZeroCapacity { blocks: capacity });
        }
        let slot_bytes = options.layout.block_bytes.div_ceil(IO_ALIGN as u64) * IO_ALIGN as u64;
        let too_large = || DiskError::TooLarge { blocks: capacity, slot_bytes };
        let slab_bytes = slot_bytes.checked_mul(capacity).ok_or_else(too_large)?;
        if capacity >= u64::from(NONE) || slab_bytes > i64::MAX as u64 {
            return Err(too_large());
        }
        let dir = options.dir.join(&options.namespace);
        std::fs::create_dir_all(&dir)
            .map_err(|source| DiskError::Io { path: dir.clone(), source })?;
        let index_file = index_path(&dir, options.rank);
        let slab = slab_path(&dir, options.rank);
        let (index, opened) = IndexFile::open(&index_file)?;
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| DiskError::Io { path, source }
        };
        let no_space = |source: std::io::Error| {
            if is_no_space(&source) {
                DiskError::NoSpace {
                    path: slab.clone(),
                    bytes: slab_bytes,
                    blocks: capacity,
                    source,
                }
            } else {
                DiskError::Io { path: slab.clone(), source }
            }
        };
        let header = match opened {
            Opened::Existing(header) => {
                check_header(&header, &index_file, options.rank, &options.layout)?;
                header
            }
            Opened::Fresh => {
                // The slab first, the header last: a creation cut short reads as fresh again.
                let data = DataFile::open(&slab, true, false).map_err(io(&slab))?;
                data.file().set_len(0).map_err(io(&slab))?;
                if let Err(source) = preallocate(data.file(), slab_bytes) {
                    let _ = std::fs::remove_file(&slab);
                    let _ = std::fs::remove_file(&index_file);
                    return Err(no_space(source));
                }
                let header = IndexHeader::new(options.rank, &options.layout, slot_bytes, capacity);
                index.initialise(&header).map_err(io(&index_file))?;
                header
            }
        };
        let header = if header.capacity != capacity {
            if capacity > header.capacity {
                let data = DataFile::open(&slab, true, false).map_err(io(&slab))?;
                preallocate(data.file(), slab_bytes).map_err(no_space)?;
            }
            let header = index.resize(&header, capacity).map_err(io(&index_file))?;
            let data = DataFile::open(&slab, true, false).map_err(io(&slab))?;
            data.file().set_len(slab_bytes).map_err(io(&slab))?;
            header
        } else {
            header
        };
        let data = DataFile::open(&slab, true, options.prefer_direct).map_err(io(&slab))?;
        let length = data.file().metadata().map_err(io(&slab))?.len();
        if length < slab_bytes {
            // A slab cut short (created by hand, or truncated): take the room again.
            preallocate(data.file(), slab_bytes).map_err(no_space)?;
        }
        let records = index.read_records(header.capacity).map_err(io(&index_file))?;
        let mut backend = DiskBackend {
            layout: options.layout,
            rank: options.rank,
            index,
            data,
            slab,
            slot_bytes,
            slots: Vec::new(),
            by_hash: HashMap::new(),
            free: Vec::new(),
            head: NONE,
            tail: NONE,
            next_sequence: 1,
            writes: 0,
            crash: options.crash,
            stats: BackendStats { capacity_blocks: Some(capacity), ..BackendStats::default() },
            damaged_at_open: 0,
            // Opening may have zeroed damaged records.
            unsynced: true,
        };
        backend.load_records(&records);
        Ok(backend)
    }

    /// Builds the in-memory index from the records read at open: valid records are used slots in
    /// sequence order (oldest at the LRU tail); a hash found twice keeps its newest record;
    /// damaged records are zeroed.
    fn load_records(&mut self, records: &[SlotRecord]) {
        let capacity = records.len();
        self.slots = vec![
            Slot {
                record: SlotRecord::EMPTY,
                on_disk: OnDisk::Empty,
                used: false,
                pinned: false,
                prev: NONE,
                next: NONE,
            };
            capacity
        ];
        let mut valid: Vec<(u64, u32)> = Vec::new();
        let mut damaged = Vec::new();
        for (slot, record) in records.iter().enumerate() {
            let slot = slot as u32;
            match record.state(slot) {
                RecordState::Empty => {}
                RecordState::Valid => valid.push((record.sequence, slot)),
                RecordState::Damaged => damaged.push(slot),
            }
        }
        valid.sort_unstable();
        for (sequence, slot) in valid {
            let record = records[slot as usize];
            if let Some(older) = self.by_hash.insert(record.hash(), slot) {
                self.unlink(older);
                self.slots[older as usize].used = false;
                damaged.push(older);
            }
            let entry = &mut self.slots[slot as usize];
            entry.record = record;
            entry.on_disk = OnDisk::Valid;
            entry.used = true;
            self.push_front(slot);
            self.next_sequence = self.next_sequence.max(sequence + 1);
        }
        self.damaged_at_open = damaged.len() as u64;
        for slot in damaged {
            self.slots[slot as usize].on_disk = OnDisk::Unknown;
            self.slots[slot as usize].record = SlotRecord::EMPTY;
            let _ = self.zero_record(slot);
        }
        // Free slots, lowest first, so that a fresh slab fills front to back in long runs.
        self.free =
            (0..capacity as u32).rev().filter(|&slot| !self.slots[slot as usize].used).collect();
    }

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

    /// Checks the in-memory structures against each other.
    ///
    /// # Panics
    ///
    /// On any disagreement: a programming error.
    pub fn check_invariants(&self) {
        let mut seen = 0;
        let mut at = self.head;
        let mut prev = NONE;
        while at != NONE {
            let slot = &self.slots[at as usize];
            assert!(slot.used, "slot {at} is in the LRU list but not used");
            assert_eq!(slot.prev, prev, "slot {at} has a broken back link");
            assert_eq!(
                self.by_hash.get(&slot.record.hash()),
                Some(&at),
                "slot {at} is not in the map"
            );
            assert_eq!(slot.record.state(at), RecordState::Valid);
            assert_eq!(slot.on_disk, OnDisk::Valid);
            prev = at;
            at = slot.next;
            seen += 1;
        }
        assert_eq!(self.tail, prev, "the LRU tail is not the last slot of the list");
        assert_eq!(seen, self.by_hash.len(), "the LRU list and the map disagree");
        assert_eq!(seen + self.free.len(), self.slots.len(), "slots are lost or counted twice");
        for &slot in &self.free {
            assert!(!self.slots[slot as usize].used, "free slot {slot} is used");
        }
        assert!(self.slots.iter().all(|slot| !slot.pinned), "a slot stayed pinned");
    }

    fn unlink(&mut self, slot: u32) {
        let Slot { prev, next, .. } = self.slots[slot as usize];
        if prev == NONE {
            self.head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NONE {
            self.tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
        self.slots[slot as usize].prev = NONE;
        self.slots[slot as usize].next = NONE;
    }

    fn push_front(&mut self, slot: u32) {
        self.slots[slot as usize].prev = NONE;
        self.slots[slot as usize].next = self.head;
        if self.head != NONE {
            self.slots[self.head as usize].prev = slot;
        } else {
            self.tail = slot;
        }
        self.head = slot;
    }

    fn touch(&mut self, slot: u32) {
        self.unlink(slot);
        self.push_front(slot);
    }

    /// A slot for a new block: a free one, else the least recently used one not pinned by this
    /// batch (its block is forgotten here; its record is zeroed in step 2).
    fn take_slot(&mut self) -> Option<u32> {
        if let Some(slot) = self.free.pop() {
            return Some(slot);
        }
        let mut victim = self.tail;
        while victim != NONE && self.slots[victim as usize].pinned {
            victim = self.slots[victim as usize].prev;
        }
        if victim == NONE {
            return None;
        }
        self.forget(victim);
        self.stats.evictions += 1;
        self.free.pop()
    }

    /// Drops a used slot from the map and the LRU list into the free list; its index record
    /// is still on disk (`on_disk` says so) until it is zeroed.
    fn forget(&mut self, slot: u32) {
        let hash = self.slots[slot as usize].record.hash();
        self.by_hash.remove(&hash);
        self.unlink(slot);
        let entry = &mut self.slots[slot as usize];
        entry.used = false;
        entry.record = SlotRecord::EMPTY;
        self.free.push(slot);
    }

    fn zero_record(&mut self, slot: u32) -> Result<(), Failure> {
        self.unsynced = true;
        match self.index.write_records(slot, &[SlotRecord::EMPTY]) {
            Ok(()) => {
                self.slots[slot as usize].on_disk = OnDisk::Empty;
                Ok(())
            }
            Err(error) => {
                self.slots[slot as usize].on_disk = OnDisk::Unknown;
                Err(failure_of(&error))
            }
        }
    }

    fn crash_if(&self, write: u64, point: CrashPoint) {
        if self.crash == Some(CrashHook { write, point }) {
            crash_now();
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

    /// Reads every planned block (sorted by slot) into its destination and verifies it (steps
    /// of [`DiskBackend::get`]). Returns, per plan index, whether the bytes verified (`None` when
    /// the read failed: its failure is then in the plan).
    fn read_and_verify(
        &self,
        plan: &mut [Planned],
        blocks: &mut [GetBlock<'_>],
    ) -> Vec<Option<bool>> {
        let (io, rank) = (self.io(), self.rank);
        let hashes: Vec<BlockHash> = blocks.iter().map(|block| block.hash).collect();
        let mut by_entry: Vec<Option<BlockBytesMut<'_>>> =
            blocks.iter_mut().map(|block| Some(block.dest.reborrow())).collect();
        let items = work_items(plan, |_| true);
        let threads = io_threads(plan.len(), self.layout.block_bytes, items.len());
        // Each item's destinations, taken out in plan order (an entry is planned once).
        let mut groups: Vec<Vec<ReadItem<'_>>> = (0..threads).map(|_| Vec::new()).collect();
        for (n, run) in items.into_iter().enumerate() {
            let dests = plan[run.clone()]
                .iter()
                .map(|p| by_entry[p.entry].take().expect("each entry is planned once"))
                .collect();
            groups[n % threads].push((run, dests));
        }
        let plan_view: &[Planned] = plan;
        let work = |group: Vec<ReadItem<'_>>| {
            let mut bounce = None;
            let mut failed = Vec::new();
            let mut verdicts = Vec::new();
            for (run, mut dests) in group {
                let failed_here = io.read_run(plan_view, run.clone(), &mut dests, &mut bounce);
                for (index, dest) in run.zip(dests) {
                    if !failed_here.iter().any(|(f, _)| *f == index) {
                        let p = &plan_view[index];
                        let sum =
                            payload_checksum(hashes[p.entry], rank, p.sequence, dest.as_bytes());
                        verdicts.push((index, sum == p.checksum));
                    }
                }
                failed.extend(failed_here);
            }
            (failed, verdicts)
        };
        let results = run_groups(groups, work);
        let mut verified = vec![None; plan.len()];
        for (failed, verdicts) in results {
            for (index, failure) in failed {
                plan[index].outcome = Some(failure);
            }
            for (index, ok) in verdicts {
                verified[index] = Some(ok);
            }
        }
        verified
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
        self.unsynced = true;
        outcomes.clear();
        outcomes.resize(blocks.len(), Ok(()));
        // Step 1: hits and slots.
        let mut plan: Vec<Planned> = Vec::new();
        let mut in_batch: HashMap<BlockHash, usize> = HashMap::new();
        let mut followers: Vec<(usize, usize)> = Vec::new();
        let mut hits: Vec<u32> = Vec::new();
        for (entry, block) in blocks.iter().enumerate() {
            if let Err(failure) = check_len(block.bytes.len(), &self.layout) {
                outcomes[entry] = Err(failure);
                continue;
            }
            if let Some(&slot) = self.by_hash.get(&block.key.hash) {
                self.slots[slot as usize].pinned = true;
                hits.push(slot);
                continue;
            }
            if let Some(&leader) = in_batch.get(&block.key.hash) {
                followers.push((entry, leader));
                continue;
            }
            let Some(slot) = self.take_slot() else {
                outcomes[entry] = Err(Failure::NoSpace);
                continue;
            };
            self.slots[slot as usize].pinned = true;
            self.writes += 1;
            let sequence = self.next_sequence;
            self.next_sequence += 1;
            in_batch.insert(block.key.hash, entry);
            plan.push(Planned {
                entry,
                slot,
                write: self.writes,
                sequence,
                checksum: 0,
                outcome: None,
            });
        }
        plan.sort_by_key(|p| p.slot);

        // Step 2: zero the records of reused slots.
        let stale: Vec<usize> = (0..plan.len())
            .filter(|&i| self.slots[plan[i].slot as usize].on_disk != OnDisk::Empty)
            .collect();
        for index in stale {
            let slot = plan[index].slot;
            if let Err(failure) = self.zero_record(slot) {
                plan[index].outcome = Some(failure);
            }
        }
        for planned in &plan {
            self.crash_if(planned.write, CrashPoint::AfterInvalidate);
        }

        // Step 3: the bytes, spread over a few threads for large batches, each thread
        // checksumming the blocks it wrote.
        let (io, rank) = (self.io(), self.rank);
        let items = work_items(&plan, Planned::ok);
        let threads = io_threads(plan.len(), self.layout.block_bytes, items.len());
        let mut groups: Vec<Vec<Range<usize>>> = (0..threads).map(|_| Vec::new()).collect();
        for (n, run) in items.into_iter().enumerate() {
            groups[n % threads].push(run);
        }
        let plan_view: &[Planned] = &plan;
        let results = run_groups(groups, |group: Vec<Range<usize>>| {
            let mut bounce = None;
            let mut failed = Vec::new();
            let mut sums = Vec::new();
            for run in group {
                failed.extend(io.write_run(plan_view, blocks, run.clone(), &mut bounce));
                for index in run {
                    let (p, block) = (&plan_view[index], &blocks[plan_view[index].entry]);
                    sums.push((
                        index,
                        payload_checksum(block.key.hash, rank, p.sequence, block.bytes),
                    ));
                }
            }
            (failed, sums)
        });
        let mut checksums = vec![0; plan.len()];
        let mut failed_runs = Vec::new();
        for (failed, sums) in results {
            failed_runs.extend(failed);
            for (index, sum) in sums {
                checksums[index] = sum;
            }
        }
        for (planned, checksum) in plan.iter_mut().zip(checksums) {
            planned.checksum = checksum;
        }
        for (index, failure) in failed_runs {
            plan[index].outcome = Some(failure);
        }
        for planned in &plan {
            self.crash_if(planned.write, CrashPoint::BeforeRecord);
        }

        // Step 4: the records.
        for run in consecutive_runs(&plan, Planned::ok, usize::MAX) {
            let records: Vec<SlotRecord> = plan[run.clone()]
                .iter()
                .map(|p| {
                    let key = blocks[p.entry].key;
                    SlotRecord::valid(
                        p.slot, key.hash, key.parent, key.depth, p.sequence, p.checksum,
                    )
                })
                .collect();
            match self.index.write_records(plan[run.start].slot, &records) {
                Ok(()) => {
                    for (planned, record) in plan[run].iter().zip(records) {
                        let slot = &mut self.slots[planned.slot as usize];
                        slot.record = record;
                        slot.on_disk = OnDisk::Valid;
                    }
                }
                Err(error) => {
                    let failure = failure_of(&error);
                    for planned in &mut plan[run] {
                        self.slots[planned.slot as usize].on_disk = OnDisk::Unknown;
                        planned.outcome = Some(failure.clone());
                    }
                }
            }
        }

        // Step 5: the map, the outcomes, the LRU list (in reverse batch order).
        for planned in &plan {
            self.slots[planned.slot as usize].pinned = false;
            match &planned.outcome {
                None => {
                    self.by_hash.insert(blocks[planned.entry].key.hash, planned.slot);
                }
                Some(failure) => {
                    outcomes[planned.entry] = Err(failure.clone());
                    self.free.push(planned.slot);
                }
            }
        }
        for &slot in &hits {
            self.slots[slot as usize].pinned = false;
        }
        for &(entry, leader) in &followers {
            outcomes[entry] = outcomes[leader].clone();
        }
        for (entry, block) in blocks.iter().enumerate().rev() {
            if outcomes[entry].is_err() {
                continue;
            }
            let Some(&slot) = self.by_hash.get(&block.key.hash) else { continue };
            if self.slots[slot as usize].used {
                self.touch(slot);
            } else {
                self.slots[slot as usize].used = true;
                self.push_front(slot);
            }
        }
        self.stats.used_blocks = Some(self.by_hash.len() as u64);
    }

    fn get(&mut self, blocks: &mut [GetBlock<'_>], outcomes: &mut Vec<GetOutcome>) {
        outcomes.clear();
        outcomes.resize(blocks.len(), Ok(()));
        let mut plan: Vec<Planned> = Vec::new();
        for (entry, block) in blocks.iter().enumerate() {
            if let Err(failure) = check_len(block.dest.len(), &self.layout) {
                outcomes[entry] = Err(GetMiss::Failed(failure));
                continue;
            }
            match self.by_hash.get(&block.hash) {
                None => outcomes[entry] = Err(GetMiss::Absent),
                Some(&slot) => {
                    let record = self.slots[slot as usize].record;
                    plan.push(Planned {
                        entry,
                        slot,
                        write: 0,
                        sequence: record.sequence,
                        checksum: record.checksum,
                        outcome: None,
                    });
                }
            }
        }
        plan.sort_by_key(|p| (p.slot, p.entry));
        let verified = self.read_and_verify(&mut plan, blocks);
        let mut corrupt_slots = Vec::new();
        let mut hit_slots = Vec::new();
        for (planned, verified) in plan.iter().zip(verified) {
            outcomes[planned.entry] = match (&planned.outcome, verified) {
                (Some(failure), _) => Err(GetMiss::Failed(failure.clone())),
                (None, Some(true)) => {
                    hit_slots.push((planned.entry, planned.slot));
                    Ok(())
                }
                (None, _) => {
                    corrupt_slots.push(planned.slot);
                    Err(GetMiss::Corrupt)
                }
            };
        }
        corrupt_slots.sort_unstable();
        corrupt_slots.dedup();
        for slot in corrupt_slots {
            if self.slots[slot as usize].used {
                self.forget(slot);
                let _ = self.zero_record(slot);
            }
        }
        hit_slots.sort_unstable();
        for &(_, slot) in hit_slots.iter().rev() {
            if self.slots[slot as usize].used {
                self.touch(slot);
            }
        }
        self.stats.used_blocks = Some(self.by_hash.len() as u64);
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
