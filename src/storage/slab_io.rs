//! The slab file's I/O for one batch of the disk back-end: which calls a batch makes, spread
//! over how many threads, and each call itself.
//!
//! Core types: [`SlabIo`] (the slab's descriptor and shape as the I/O threads share it) and
//! [`Planned`] (one block of a batch with its slot). Flow of one batch's I/O:
//!
//! 1. the batch's planned blocks, sorted by slot, are cut into work items: runs of consecutive
//!    slots of at most [`RUN_CHUNK`] blocks ([`work_items`]);
//! 2. a batch of at least [`OVERLAP_BYTES`] spreads its items over up to [`IO_THREADS`] scoped
//!    threads ([`io_threads`], [`run_groups`]); a smaller one runs them on the calling thread;
//! 3. each item is one vectored call when its buffers can go in place (O_DIRECT wants aligned
//!    buffers of whole slots), else one call per block through the thread's bounce buffer; a
//!    failed call is retried block by block, so that the blocks that fit are known.

use std::ops::Range;

use super::backend::{Failure, PutBlock};
use super::block_bytes::{BlockBytes, BlockBytesMut};
use super::direct_io::{
    failure_of, is_aligned, read_exact_at, write_all_at, AlignedBuf, IoMode, IO_ALIGN,
};
use super::disk::{CrashHook, CrashPoint};

/// One read call of a batch: its plan indices and their destinations, in plan order.
pub(super) type ReadItem<'a> = (Range<usize>, Vec<BlockBytesMut<'a>>);

/// The most I/O threads one batch uses.
const IO_THREADS: usize = 4;
/// Batches of at least this many bytes spread their I/O over threads (each checksumming or
/// verifying its own blocks); smaller ones do not pay for the threads.
const OVERLAP_BYTES: u64 = 1 << 20;
/// The most blocks one I/O call moves (longer runs are split, so that threads share the work
/// and verification starts early).
const RUN_CHUNK: usize = 8;

/// How many threads a batch of `blocks` blocks of `block_bytes` in `items` work items uses.
pub(super) fn io_threads(blocks: usize, block_bytes: u64, items: usize) -> usize {
    if items > 1 && blocks as u64 * block_bytes >= OVERLAP_BYTES {
        items.min(IO_THREADS)
    } else {
        1
    }
}

/// Runs `work` on each group, on its own scoped thread when there are several; the results in
/// group order.
pub(super) fn run_groups<G: Send, R: Send>(groups: Vec<G>, work: impl Fn(G) -> R + Sync) -> Vec<R> {
    if groups.len() == 1 {
        return groups.into_iter().map(&work).collect();
    }
    std::thread::scope(|scope| {
        let work = &work;
        let handles: Vec<_> =
            groups.into_iter().map(|group| scope.spawn(move || work(group))).collect();
        handles.into_iter().map(|h| h.join().expect("slab I/O does not panic")).collect()
    })
}

/// The slab file as the I/O threads of one batch use it (positional I/O on one descriptor is
/// safe from several threads; each thread has its own bounce buffer).
#[derive(Clone, Copy)]
pub(super) struct SlabIo<'a> {
    pub(super) file: &'a std::fs::File,
    pub(super) mode: IoMode,
    pub(super) slot_bytes: u64,
    pub(super) block_bytes: u64,
    pub(super) crash: Option<CrashHook>,
}

impl SlabIo<'_> {
    fn offset(&self, slot: u32) -> u64 {
        u64::from(slot) * self.slot_bytes
    }

    /// Whether a buffer of `len` bytes at `ptr` can be transferred without a bounce buffer.
    fn in_place(&self, ptr: *const u8, len: usize) -> bool {
        match self.mode {
            IoMode::Direct => is_aligned(ptr, len) && len as u64 == self.slot_bytes,
            IoMode::Buffered => true,
        }
    }

    /// Whether consecutive slots are contiguous block bytes in the file (no padding).
    fn contiguous(&self) -> bool {
        self.slot_bytes == self.block_bytes
    }

    fn bounce<'b>(&self, bounce: &'b mut Option<AlignedBuf>) -> &'b mut AlignedBuf {
        bounce.get_or_insert_with(|| AlignedBuf::zeroed(self.slot_bytes as usize))
    }

    /// Writes the bytes of the planned blocks `plan[run]` (consecutive slots): in one call when
    /// they can all go in place, else (or when that call fails: a disk filling up mid-run) one
    /// by one. Returns the plan indices that failed, with why.
    pub(super) fn write_run(
        &self,
        plan: &[Planned],
        blocks: &[PutBlock<'_>],
        run: Range<usize>,
        bounce: &mut Option<AlignedBuf>,
    ) -> Vec<(usize, Failure)> {
        let all_in_place = plan[run.clone()].iter().all(|p| {
            let bytes = blocks[p.entry].bytes;
            self.in_place(bytes.as_ptr(), bytes.len())
        });
        let crash_in_run = self.crash.is_some_and(|hook| {
            hook.point == CrashPoint::MidPayload
                && plan[run.clone()].iter().any(|p| p.write == hook.write)
        });
        if all_in_place && self.contiguous() && !crash_in_run {
            let bufs: Vec<BlockBytes<'_>> =
                plan[run.clone()].iter().map(|p| blocks[p.entry].bytes).collect();
            match write_all_at(self.file, &bufs, self.offset(plan[run.start].slot)) {
                Ok(()) => return Vec::new(),
                Err(error) if run.len() == 1 => return vec![(run.start, failure_of(&error))],
                Err(_) => {}
            }
        }
        let mut failed = Vec::new();
        for index in run {
            let planned = &plan[index];
            let bytes = blocks[planned.entry].bytes;
            let offset = self.offset(planned.slot);
            let result = if self.in_place(bytes.as_ptr(), bytes.len()) {
                self.write_maybe_crashing(planned.write, bytes, offset)
            } else {
                let slot_len = self.slot_bytes as usize;
                let buffer = self.bounce(bounce);
                bytes.copy_to(&mut buffer.as_mut_slice()[..bytes.len()]);
                let padded = BlockBytes::new(&buffer.as_slice()[..slot_len]);
                self.write_maybe_crashing(planned.write, padded, offset)
            };
            if let Err(failure) = result {
                failed.push((index, failure));
            }
        }
        failed
    }

    fn write_maybe_crashing(
        &self,
        write: u64,
        bytes: BlockBytes<'_>,
        offset: u64,
    ) -> Result<(), Failure> {
        if self.crash == Some(CrashHook { write, point: CrashPoint::MidPayload }) {
            let half = ((bytes.len() / 2).div_ceil(IO_ALIGN) * IO_ALIGN).min(bytes.len());
            write_all_at(self.file, &[bytes.take(half)], offset).map_err(|e| failure_of(&e))?;
            crash_now();
        }
        write_all_at(self.file, &[bytes], offset).map_err(|e| failure_of(&e))
    }

    /// Reads the blocks `plan[run]` (consecutive slots) into `dests` (one per block, in plan
    /// order): in one call when they can all go in place, else (or when that call fails) one by
    /// one. Returns the plan indices that failed, with why.
    pub(super) fn read_run(
        &self,
        plan: &[Planned],
        run: Range<usize>,
        dests: &mut [BlockBytesMut<'_>],
        bounce: &mut Option<AlignedBuf>,
    ) -> Vec<(usize, Failure)> {
        let all_in_place =
            dests.iter_mut().all(|dest| self.in_place(dest.as_mut_ptr(), dest.len()));
        if all_in_place && self.contiguous() && run.len() > 1 {
            let offset = self.offset(plan[run.start].slot);
            if read_exact_at(self.file, dests, offset).is_ok() {
                return Vec::new();
            }
        }
        let mut failed = Vec::new();
        for (index, dest) in run.zip(dests.iter_mut()) {
            let offset = self.offset(plan[index].slot);
            let result = if self.in_place(dest.as_mut_ptr(), dest.len()) {
                read_exact_at(self.file, &mut [dest.reborrow()], offset)
            } else {
                let slot_len = self.slot_bytes as usize;
                let buffer = self.bounce(bounce);
                let padded = BlockBytesMut::new(&mut buffer.as_mut_slice()[..slot_len]);
                let result = read_exact_at(self.file, &mut [padded], offset);
                if result.is_ok() {
                    dest.copy_from(&buffer.as_slice()[..dest.len()]);
                }
                result
            };
            if let Err(error) = result {
                failed.push((index, failure_of(&error)));
            }
        }
        failed
    }
}

/// One block of a batch with its slot.
#[derive(Clone, Debug)]
pub(super) struct Planned {
    pub(super) entry: usize,
    pub(super) slot: u32,
    /// The write's number since open (puts), for the crash hook.
    pub(super) write: u64,
    pub(super) sequence: u64,
    pub(super) checksum: u64,
    pub(super) outcome: Option<Failure>,
}

impl Planned {
    pub(super) fn ok(&self) -> bool {
        self.outcome.is_none()
    }
}

/// Ranges of `plan` (sorted by slot) whose slots follow each other, among the blocks `keep`
/// selects, at most `longest` blocks each.
pub(super) fn consecutive_runs(
    plan: &[Planned],
    keep: impl Fn(&Planned) -> bool,
    longest: usize,
) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    for (index, planned) in plan.iter().enumerate() {
        if !keep(planned) {
            continue;
        }
        match runs.last_mut() {
            Some(run)
                if run.end == index
                    && run.len() < longest
                    && plan[index - 1].slot.checked_add(1) == Some(planned.slot) =>
            {
                run.end = index + 1
            }
            _ => runs.push(index..index + 1),
        }
    }
    runs
}

/// The I/O calls of a batch: its runs of consecutive slots, cut into pieces of at most
/// [`RUN_CHUNK`] blocks.
pub(super) fn work_items(plan: &[Planned], keep: impl Fn(&Planned) -> bool) -> Vec<Range<usize>> {
    consecutive_runs(plan, keep, RUN_CHUNK)
}

pub(super) fn crash_now() -> ! {
    let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    // SIGKILL cannot be caught; should raise fail, abort rather than go on.
    std::process::abort();
}
