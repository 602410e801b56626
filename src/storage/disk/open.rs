//! Opening a rank's slab and index ([`DiskBackend::open`]): the flow is in
//! [`crate::storage::disk_index`]; a fresh pair is created slab first, header last, an existing one
//! is checked against the layout and resized to the capacity asked for, and the records read
//! back become the slots in memory, oldest at the LRU tail.

use std::collections::HashMap;
use std::path::Path;

use super::slots::{OnDisk, Slot, NONE};
use super::{DiskBackend, DiskError, DiskOptions};
use crate::storage::backend::BackendStats;
use crate::storage::direct_io::{is_no_space, preallocate, DataFile, IO_ALIGN};
use crate::storage::disk_index::{
    check_header, index_bytes, index_path, slab_path, IndexFile, IndexHeader, Opened, RecordState,
    SlotRecord,
};

impl DiskBackend {
    /// Opens (or creates) the slab and index of `options.rank` (flow in
    /// [`crate::storage::disk_index`]).
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
        // A full file system, as it shows in preallocating `path` to `bytes`.
        let no_space_in = |path: &Path, bytes: u64| {
            let path = path.to_owned();
            move |source: std::io::Error| {
                if is_no_space(&source) {
                    DiskError::NoSpace { path: path.clone(), bytes, blocks: capacity, source }
                } else {
                    DiskError::Io { path: path.clone(), source }
                }
            }
        };
        let no_space = no_space_in(&slab, slab_bytes);
        let index_no_space = no_space_in(&index_file, index_bytes(capacity));
        let header = match opened {
            Opened::Existing(header) => {
                check_header(&header, &index_file, options.rank, &options.layout)?;
                header
            }
            Opened::Fresh => {
                // The slab first, the header last: a creation cut short reads as fresh again.
                let data = DataFile::open(&slab, true, false).map_err(io(&slab))?;
                data.file().set_len(0).map_err(io(&slab))?;
                let header = IndexHeader::new(options.rank, &options.layout, slot_bytes, capacity);
                let created = preallocate(data.file(), slab_bytes)
                    .map_err(&no_space)
                    .and_then(|()| index.initialise(&header).map_err(&index_no_space));
                if let Err(error) = created {
                    // Neither file is of use: nothing is left behind.
                    let _ = std::fs::remove_file(&slab);
                    let _ = std::fs::remove_file(&index_file);
                    return Err(error);
                }
                header
            }
        };
        let header = if header.capacity != capacity {
            if capacity > header.capacity {
                let data = DataFile::open(&slab, true, false).map_err(io(&slab))?;
                preallocate(data.file(), slab_bytes).map_err(&no_space)?;
            }
            let header = index.resize(&header, capacity).map_err(&index_no_space)?;
            let data = DataFile::open(&slab, true, false).map_err(io(&slab))?;
            data.file().set_len(slab_bytes).map_err(io(&slab))?;
            header
        } else {
            index.preallocate(capacity).map_err(&index_no_space)?;
            header
        };
        let data = DataFile::open(&slab, true, options.prefer_direct).map_err(io(&slab))?;
        let length = data.file().metadata().map_err(io(&slab))?.len();
        if length < slab_bytes {
            // A slab cut short (created by hand, or truncated): take the room again.
            preallocate(data.file(), slab_bytes).map_err(&no_space)?;
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
            failed: Vec::new(),
            successful_writes: 0,
            failures_in_a_row: 0,
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
        self.slots = vec![Slot::FREE; capacity];
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
            self.next_sequence = self.next_sequence.max(sequence.saturating_add(1));
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
}
