//! Writing a batch of blocks ([`DiskBackend::put_batch`], the back-end's `put`):
//!
//! 1. blocks already stored count as stored; the others get a slot (free, else the LRU one's);
//! 2. slots that held a record get their index record zeroed first;
//! 3. the blocks' bytes are written, consecutive slots in one vectored call (up to 8 blocks),
//!    straight from the caller's memory when it is aligned for O_DIRECT (the host tier is), else
//!    through an aligned bounce buffer; a batch of 1 MiB or more spreads these calls over up to
//!    four threads, each computing the checksums of the blocks it wrote;
//! 4. the index records (hash, parent, depth, sequence, checksum) are written;
//! 5. the map and the LRU list learn the new blocks, in reverse batch order.
//!
//! A failed step fails its blocks only. The test hook ([`super::CrashHook`]) kills the process
//! after step 2, in the middle of step 3 or before step 4.
//!
//! [`StorageBackend::put`]: crate::storage::backend::StorageBackend::put

use std::collections::HashMap;
use std::ops::Range;

use super::slots::OnDisk;
use super::{CrashPoint, DiskBackend};
use crate::hash::BlockHash;
use crate::storage::backend::{check_len, Failure, PutBlock, PutOutcome};
use crate::storage::direct_io::failure_of;
use crate::storage::disk_index::SlotRecord;
use crate::storage::format::payload_checksum;
use crate::storage::slab_io::{consecutive_runs, io_threads, run_groups, work_items, Planned};

impl DiskBackend {
    /// One put batch, steps 1 to 5 of the module documentation
    /// ([`crate::storage::backend::StorageBackend::put`]).
    pub(super) fn put_batch(&mut self, blocks: &[PutBlock<'_>], outcomes: &mut Vec<PutOutcome>) {
        self.unsynced = true;
        outcomes.clear();
        outcomes.resize(blocks.len(), Ok(()));
        self.return_rested_slots();
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
            let Some(slot) = self.take_slot(plan.len()) else {
                outcomes[entry] = Err(Failure::NoSpace);
                continue;
            };
            self.slots[slot as usize].pinned = true;
            self.writes += 1;
            in_batch.insert(block.key.hash, entry);
            plan.push(Planned {
                entry,
                slot,
                write: self.writes,
                sequence: 0,
                checksum: 0,
                outcome: None,
            });
        }
        // Sequences go to the batch's blocks last first: a reopened slab orders its blocks by
        // sequence, oldest at the LRU tail, so that its leaves go before their parents there as
        // they do here (step 5 touches the batch in reverse order).
        for planned in plan.iter_mut().rev() {
            planned.sequence = self.next_sequence;
            self.next_sequence = self.next_sequence.saturating_add(1);
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
        let mut written = Vec::with_capacity(plan.len());
        for planned in &plan {
            self.slots[planned.slot as usize].pinned = false;
            match &planned.outcome {
                None => {
                    self.by_hash.insert(blocks[planned.entry].key.hash, planned.slot);
                }
                Some(failure) => outcomes[planned.entry] = Err(failure.clone()),
            }
            written.push((planned.slot, planned.outcome.is_none()));
        }
        self.note_writes(&written);
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
}
