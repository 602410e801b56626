//! The I/O thread of a shared tier's storage tier (`super`): it owns one back-end per rank and
//! its own mappings of the tier's arenas, and carries out the jobs the owner's thread hands it,
//! answering each with one outcome per key.
//!
//! 1. the owner sends a [`Job`]: keys with their stored names and chunks, to write (`Put`: the
//!    chunks are pinned, no one writes them) or to read into (`Get`: the chunks are pending
//!    stores of the storage client, no one reads or writes them);
//! 2. the thread takes every job sent so far and serves reads first (an engine waits for them),
//!    writes when no read waits;
//! 3. a job runs on every rank's back-end, its rank's part of each chunk; a key is done when
//!    every rank's part was written (or read and verified);
//! 4. it answers [`Done`] with an [`Outcome`] per key, and ends when the owner's end of the
//!    channel closes and nothing is left, or at once when the owner stops it (between jobs).

use kvshm_ipc::sync::{AtomicBool, Ordering};
use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::{mpsc, Arc};

use kvshm_ipc::arena::Arena;

use crate::hash::BlockHash;
use crate::offload::key::OffloadKey;
use crate::storage::backend::{
    BlockKey, GetBlock, GetMiss, GetOutcome, PutBlock, PutOutcome, StorageBackend,
};
use crate::storage::block_bytes::{BlockBytes, BlockBytesMut};

/// Keys for the I/O thread: each with its stored name and its chunk.
pub(super) type Batch = Vec<(OffloadKey, BlockHash, u32)>;

pub(super) enum Job {
    Put(Batch),
    Get(Batch),
}

/// What became of one key of a job, over every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Outcome {
    /// Every rank's part was written, or read and verified.
    Made,
    /// A read found a rank's part absent or damaged: the back-end does not hold the block.
    Gone,
    /// The back-end failed (a timeout, a server away, an I/O error): the block may be stored.
    Failed,
}

impl Outcome {
    /// The outcome of a key over two ranks: the worst.
    fn and(self, other: Outcome) -> Outcome {
        match (self, other) {
            (Outcome::Failed, _) | (_, Outcome::Failed) => Outcome::Failed,
            (Outcome::Gone, _) | (_, Outcome::Gone) => Outcome::Gone,
            (Outcome::Made, Outcome::Made) => Outcome::Made,
        }
    }
}

/// A job done: its keys, each with its outcome.
pub(super) struct Done {
    pub put: bool,
    pub keys: Vec<(OffloadKey, Outcome)>,
}

/// The I/O thread's side: the arenas (its own mappings) and one back-end per rank.
pub(super) struct IoThread {
    pub arenas: Vec<Arena>,
    pub backends: Vec<Box<dyn StorageBackend>>,
    pub chunk_bytes: usize,
    /// Set by the owner that stops: the jobs not started are dropped, so that it waits for one
    /// job at most.
    pub stop: Arc<AtomicBool>,
}

impl IoThread {
    /// Serves jobs until the owner's end of the channel closes, or it stops: reads first (an
    /// engine waits for them), writes when no read waits.
    pub fn run(mut self, jobs: &mpsc::Receiver<Job>, done: &mpsc::Sender<Done>) {
        let (mut reads, mut writes) = (VecDeque::new(), VecDeque::new());
        loop {
            // A wait only when there is nothing to do; the owner gone and nothing left: the end.
            let mut next = if reads.is_empty() && writes.is_empty() {
                match jobs.recv() {
                    Ok(job) => Some(job),
                    Err(mpsc::RecvError) => return,
                }
            } else {
                jobs.try_recv().ok()
            };
            while let Some(job) = next {
                match job {
                    Job::Get(batch) => reads.push_back(batch),
                    Job::Put(batch) => writes.push_back(batch),
                }
                next = jobs.try_recv().ok();
            }
            // Relaxed: the flag orders nothing; the owner joins the thread after setting it.
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            let (put, batch) = match reads.pop_front() {
                Some(read) => (false, read),
                None => match writes.pop_front() {
                    Some(write) => (true, write),
                    None => continue,
                },
            };
            let outcomes = self.carry_out(put, &batch);
            let keys = batch.iter().zip(outcomes).map(|(&(key, _, _), made)| (key, made)).collect();
            if done.send(Done { put, keys }).is_err() {
                return;
            }
        }
    }

    /// One job on every rank: per key, what became of it (`put`: written, else read).
    fn carry_out(&mut self, put: bool, batch: &Batch) -> Vec<Outcome> {
        let (mut puts, mut gets) = (Vec::new(), Vec::new());
        let mut outcomes = vec![Outcome::Made; batch.len()];
        for rank in 0..self.backends.len() {
            // A stopping owner waits for one rank's part of a job at most. Relaxed, as in `run`:
            // the flag orders no data, the owner's join does.
            if self.stop.load(Ordering::Relaxed) {
                return vec![Outcome::Failed; batch.len()];
            }
            if put {
                self.put(rank, batch, &mut puts);
                for (outcome, put) in outcomes.iter_mut().zip(&puts) {
                    *outcome =
                        outcome.and(if put.is_ok() { Outcome::Made } else { Outcome::Failed });
                }
            } else {
                self.get(rank, batch, &mut gets);
                for (outcome, get) in outcomes.iter_mut().zip(&gets) {
                    *outcome = outcome.and(match get {
                        Ok(()) => Outcome::Made,
                        Err(GetMiss::Absent | GetMiss::Corrupt) => Outcome::Gone,
                        Err(GetMiss::Failed(_)) => Outcome::Failed,
                    });
                }
            }
        }
        outcomes
    }

    /// Where `chunk` of `rank`'s arena starts, or `None` when it lies outside the arena (the
    /// index is sized from the arenas, so only a programming error gets here).
    fn chunk_start(&self, rank: usize, chunk: u32) -> Option<NonNull<u8>> {
        let arena = &self.arenas[rank];
        let offset = (chunk as usize).checked_mul(self.chunk_bytes)?;
        if offset.checked_add(self.chunk_bytes)? > arena.data_len() {
            return None;
        }
        // SAFETY: offset + chunk_bytes <= data_len (checked above): the pointer stays inside the
        // mapping `arena` keeps alive; forming it reads nothing.
        NonNull::new(unsafe { arena.data_ptr().add(offset) })
    }

    /// The start of each key's chunk on `rank`, in batch order, and the positions of the keys
    /// whose chunk lies outside the arena (none, short of a programming error).
    fn chunk_starts(
        &self,
        rank: usize,
        batch: &Batch,
    ) -> (Vec<(BlockHash, NonNull<u8>)>, Vec<usize>) {
        let mut starts = Vec::with_capacity(batch.len());
        let mut outside = Vec::new();
        for (at, &(_, hash, chunk)) in batch.iter().enumerate() {
            match self.chunk_start(rank, chunk) {
                Some(start) => starts.push((hash, start)),
                None => outside.push(at),
            }
        }
        (starts, outside)
    }

    fn put(&mut self, rank: usize, batch: &Batch, outcomes: &mut Vec<PutOutcome>) {
        let (starts, outside) = self.chunk_starts(rank, batch);
        let blocks: Vec<PutBlock<'_>> = starts
            .into_iter()
            .map(|(hash, start)| {
                // SAFETY: the chunk lies in this thread's mapping of the arena, alive for the call
                // (`chunk_start`). No process writes it while the put reads it: the owner pinned
                // its key for the storage client before handing the job over, and a pinned key's
                // chunk is never handed to a store (the index's rule); clients only write chunks
                // handed to their stores.
                let bytes = unsafe { BlockBytes::from_raw(start, self.chunk_bytes) };
                PutBlock { key: BlockKey::new(hash, BlockHash(0), 0), bytes }
            })
            .collect();
        self.backends[rank].put(&blocks, outcomes);
        spread(outcomes, &outside, Err(crate::storage::Failure::Io("outside the arena".into())));
    }

    fn get(&mut self, rank: usize, batch: &Batch, outcomes: &mut Vec<GetOutcome>) {
        let (starts, outside) = self.chunk_starts(rank, batch);
        let mut blocks: Vec<GetBlock<'_>> = starts
            .into_iter()
            .map(|(hash, start)| {
                // SAFETY: the chunk lies in this thread's mapping of the arena, alive for the call
                // (`chunk_start`). Nothing else reads or writes it meanwhile: its key is a pending
                // store of the storage client, so no lookup answers a hit for it and no other
                // store gets its chunk (the index's rule); each chunk is named once in a batch,
                // since the index hands a chunk to one key.
                let dest = unsafe { BlockBytesMut::from_raw(start, self.chunk_bytes) };
                GetBlock { hash, dest }
            })
            .collect();
        self.backends[rank].get(&mut blocks, outcomes);
        spread(
            outcomes,
            &outside,
            Err(GetMiss::Failed(crate::storage::Failure::Io("outside the arena".into()))),
        );
    }
}

/// Puts `filler` into `outcomes` at each index of `outside` (ascending), so that outcome `i`
/// is the batch's key `i` again.
fn spread<T: Clone>(outcomes: &mut Vec<T>, outside: &[usize], filler: T) {
    for &at in outside {
        outcomes.insert(at, filler.clone());
    }
}
