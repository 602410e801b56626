//! Reading a batch of blocks ([`DiskBackend::get_batch`], the back-end's `get`):
//!
//! 1. look the slots up (an absent block is [`GetMiss::Absent`]);
//! 2. read them, consecutive slots in one call, into the destinations when they are aligned
//!    for O_DIRECT, else through a bounce buffer; large batches on up to four threads;
//! 3. verify each block against its record's checksum on the thread that read it: a mismatch
//!    drops the block (its record is zeroed) and is [`GetMiss::Corrupt`];
//! 4. touch the slots read, in reverse batch order.
//!
//! [`StorageBackend::get`]: crate::storage::backend::StorageBackend::get

use super::DiskBackend;
use crate::hash::BlockHash;
use crate::storage::backend::{check_len, GetBlock, GetMiss, GetOutcome};
use crate::storage::block_bytes::BlockBytesMut;
use crate::storage::format::payload_checksum;
use crate::storage::slab_io::{io_threads, run_groups, work_items, Planned, ReadItem};

impl DiskBackend {
    /// One get batch, as the module documentation describes
    /// ([`crate::storage::backend::StorageBackend::get`]).
    pub(super) fn get_batch(
        &mut self,
        blocks: &mut [GetBlock<'_>],
        outcomes: &mut Vec<GetOutcome>,
    ) {
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

    /// Reads every planned block (sorted by slot) into its destination and verifies it (steps 2
    /// and 3). Returns, per plan index, whether the bytes verified (`None` when
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
