//! The records of storage commands: what travels behind a STORE, LOAD, QUERY or FORGET header, and how
//! the per-block results come back inside the 32-byte completion.
//!
//! Core types: [`StorageEntry`] (one block of a storage command, one 64-byte ring slot),
//! [`StorageResults`] (the per-entry result bits of a completion) and [`StorageEntryError`].
//!
//! One storage command through the rings:
//!
//! 1. the scheduler builds at most [`MAX_STORAGE_ENTRIES`] entries (block hash, parent hash,
//!    depth, host block) and [`encode_storage_command`] writes a header whose `pair_count` is
//!    `entries * PAIRS_PER_SLOT`, then one slot per entry, so the ring framing is that of a copy;
//! 2. the worker decodes the command like any other (`record::decode_command` yields
//!    `PAIRS_PER_SLOT` pairs per entry) and [`entries_from_pairs`] turns the pairs back into
//!    entries, refusing a count that is not a whole number of entries or too large;
//! 3. the worker's storage thread runs the command and answers with an OK completion
//!    ([`storage_answer`]) whose `detail` is a [`StorageResults`]: bit `i` of the low word says
//!    entry `i` hit (LOAD), was stored (STORE), is present (QUERY) or is forgotten (FORGET); bit
//!    `i` of the high word says that entry `i` missed because the storage tier failed (an I/O
//!    error, a timeout, unreachable), not because the block is absent, so the scheduler can tell
//!    "not there" from "could not tell". Its `error` word carries [`TIER_UNREACHABLE`] when the
//!    tier could not be reached for some entry (a connection refused or dropped, no answer in
//!    time): the failed bits then say the tier is failing, not that those blocks are bad.
//!
//! A missing or corrupt block is a miss in the bits, never a failed command: a storage command
//! fails only when it is malformed, stale, or reaches a worker without a storage tier.
//!
//! Why the results fit in the completion: a command carries at most 32 entries, so two 32-bit
//! maps fill the completion's 64-bit `detail`. No results area in the segment is needed, so
//! nothing there can be stale, scribbled or out of range; the scheduler splits longer lists into
//! several commands, as it already splits long copy lists.

use bytemuck::{Pod, Zeroable};

use crate::record::{BlockPair, CommandHeader, CommandSlot, Completion, PAIRS_PER_SLOT};

/// The most entries one storage command carries (the width of each result map).
pub const MAX_STORAGE_ENTRIES: usize = 32;

/// The host block field of a QUERY or FORGET entry, which names no host block.
pub const NO_HOST_BLOCK: u32 = u32::MAX;

/// One block of a storage command, as it lies in one ring slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct StorageEntry {
    /// The block's 128-bit chained hash, low word first.
    pub hash: [u64; 2],
    /// The hash of the block before it in its prefix (what block 0 chains to for the first
    /// block), low word first. Stored with the block so that a restarted scheduler can rebuild
    /// the prefix chain from the storage index.
    pub parent: [u64; 2],
    /// The host block read from (STORE) or written into (LOAD); [`NO_HOST_BLOCK`] for QUERY and
    /// FORGET.
    pub host_block: u32,
    /// The block's position in its prefix (0: the first block).
    pub depth: u32,
    /// Zero; a non-zero word makes the command malformed.
    pub reserved: [u64; 3],
}

const _: () = assert!(size_of::<StorageEntry>() == 64);
const _: () = assert!(size_of::<StorageEntry>() == PAIRS_PER_SLOT * size_of::<BlockPair>());
const _: () = assert!(MAX_STORAGE_ENTRIES <= 32);

impl StorageEntry {
    pub fn new(hash: u128, parent: u128, depth: u32, host_block: u32) -> StorageEntry {
        StorageEntry {
            hash: split(hash),
            parent: split(parent),
            host_block,
            depth,
            reserved: [0; 3],
        }
    }

    pub fn hash(&self) -> u128 {
        join(self.hash)
    }

    pub fn parent(&self) -> u128 {
        join(self.parent)
    }

    fn to_slot(self) -> CommandSlot {
        bytemuck::cast(self)
    }
}

fn split(value: u128) -> [u64; 2] {
    [value as u64, (value >> 64) as u64]
}

fn join(words: [u64; 2]) -> u128 {
    u128::from(words[0]) | (u128::from(words[1]) << 64)
}

/// The `pair_count` of a storage command header with `entries` entries.
pub fn storage_pair_count(entries: usize) -> u32 {
    u32::try_from(entries * PAIRS_PER_SLOT)
        .expect("a storage command of more than u32::MAX / 8 entries is a programming error")
}

/// Appends the slots of one storage command: its header, then one slot per entry.
///
/// # Panics
///
/// If the header's pair count is not `storage_pair_count(entries.len())`, if the op is not a
/// storage op, or if there are more than [`MAX_STORAGE_ENTRIES`] entries: programming errors of
/// the producer.
pub fn encode_storage_command(
    header: &CommandHeader,
    entries: &[StorageEntry],
    out: &mut Vec<CommandSlot>,
) {
    assert!(
        entries.len() <= MAX_STORAGE_ENTRIES,
        "a storage command of {} entries is a programming error",
        entries.len()
    );
    assert!(
        crate::record::Op::from_wire(header.op).is_some_and(|op| op.is_storage()),
        "encoding op {} as a storage command is a programming error",
        header.op
    );
    assert_eq!(
        header.pair_count,
        storage_pair_count(entries.len()),
        "a storage header whose pair count disagrees with its entries is a programming error"
    );
    out.reserve(1 + entries.len());
    out.push(CommandSlot::from_header(header));
    out.extend(entries.iter().map(|entry| entry.to_slot()));
}

/// Why the pairs decoded behind a storage header are not a list of entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StorageEntryError {
    #[error("{pairs} pairs are not a whole number of storage entries")]
    PartialEntry { pairs: usize },
    #[error("{entries} storage entries exceed the {MAX_STORAGE_ENTRIES} one command carries")]
    TooManyEntries { entries: usize },
}

/// Turns the pairs a storage command was decoded into back into its entries (appended to `out`).
/// The pairs come from another process: the count is checked, the contents are the caller's to
/// validate.
pub fn entries_from_pairs(
    pairs: &[BlockPair],
    out: &mut Vec<StorageEntry>,
) -> Result<(), StorageEntryError> {
    if pairs.len() % PAIRS_PER_SLOT != 0 {
        return Err(StorageEntryError::PartialEntry { pairs: pairs.len() });
    }
    let entries = pairs.len() / PAIRS_PER_SLOT;
    if entries > MAX_STORAGE_ENTRIES {
        return Err(StorageEntryError::TooManyEntries { entries });
    }
    out.extend(pairs.chunks_exact(PAIRS_PER_SLOT).map(|chunk| {
        let words: [BlockPair; PAIRS_PER_SLOT] =
            chunk.try_into().expect("chunks_exact yields PAIRS_PER_SLOT pairs");
        bytemuck::cast::<_, StorageEntry>(words)
    }));
    Ok(())
}

/// The flag, in the `error` word of a storage command's OK answer, that says the tier could not
/// be reached for some entry (module flow, step 3). A build that does not know it reads the
/// failed bits alone, as before it.
pub const TIER_UNREACHABLE: u32 = 1;

/// The OK answer to storage command `command_id` of `generation`: `results` in `detail`, and
/// [`TIER_UNREACHABLE`] when `unreachable`.
pub fn storage_answer(
    command_id: u64,
    generation: u64,
    results: StorageResults,
    unreachable: bool,
) -> Completion {
    let mut completion = Completion::ok(command_id, generation);
    completion.detail = results.to_detail();
    if unreachable {
        completion.error = TIER_UNREACHABLE;
    }
    completion
}

/// Whether `completion`, a storage command's answer, says the tier could not be reached.
pub fn tier_unreachable(completion: &Completion) -> bool {
    completion.is_ok() && completion.error & TIER_UNREACHABLE != 0
}

/// The per-entry results of a storage command, carried in its completion's `detail`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct StorageResults {
    /// Bit `i`: entry `i` hit (LOAD), was stored (STORE), is present (QUERY) or was forgotten
    /// (FORGET).
    pub done: u32,
    /// Bit `i`: entry `i` missed because the storage tier failed, not because it is absent.
    pub failed: u32,
}

impl StorageResults {
    pub fn to_detail(self) -> u64 {
        u64::from(self.done) | (u64::from(self.failed) << 32)
    }

    pub fn from_detail(detail: u64) -> StorageResults {
        StorageResults { done: detail as u32, failed: (detail >> 32) as u32 }
    }

    /// Whether entry `index` hit, was stored or is present.
    pub fn is_done(&self, index: usize) -> bool {
        index < MAX_STORAGE_ENTRIES && self.done & (1 << index) != 0
    }

    /// Whether entry `index` missed because the storage tier failed.
    pub fn is_failed(&self, index: usize) -> bool {
        index < MAX_STORAGE_ENTRIES && self.failed & (1 << index) != 0
    }

    /// Records entry `index`'s outcome.
    ///
    /// # Panics
    ///
    /// If `index >= MAX_STORAGE_ENTRIES`: no command carries that many entries.
    pub fn set(&mut self, index: usize, done: bool, failed: bool) {
        assert!(index < MAX_STORAGE_ENTRIES, "storage entry {index} is a programming error");
        self.done |= u32::from(done) << index;
        self.failed |= u32::from(failed) << index;
    }

    /// Drops the bits of entries at `entries` and beyond (a worker that sets them is confused).
    pub fn masked(self, entries: usize) -> StorageResults {
        let mask = if entries >= 32 { u32::MAX } else { (1u32 << entries) - 1 };
        StorageResults { done: self.done & mask, failed: self.failed & mask & !self.done }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{decode_command, Op};

    #[test]
    fn a_storage_command_decodes_like_any_command_and_gives_its_entries_back() {
        let entries: Vec<StorageEntry> = (0..5u32)
            .map(|i| StorageEntry::new(u128::MAX - u128::from(i), 7 << 70, i, 100 + i))
            .collect();
        let header = CommandHeader::new(Op::StorageStore, 9, 2, storage_pair_count(5));
        let mut slots = Vec::new();
        encode_storage_command(&header, &entries, &mut slots);
        assert_eq!(slots.len(), 6);
        let mut pairs = Vec::new();
        let (back, used) = decode_command(&slots, &mut pairs).unwrap();
        assert_eq!((back, used), (header, 6));
        let mut decoded = Vec::new();
        entries_from_pairs(&pairs, &mut decoded).unwrap();
        assert_eq!(decoded, entries);
        assert_eq!(decoded[1].hash(), u128::MAX - 1);
        assert_eq!(decoded[1].parent(), 7 << 70);
    }

    #[test]
    fn pairs_that_are_not_whole_entries_or_too_many_are_refused() {
        let mut out = Vec::new();
        assert_eq!(
            entries_from_pairs(&[BlockPair::default(); 9], &mut out),
            Err(StorageEntryError::PartialEntry { pairs: 9 })
        );
        let many = vec![BlockPair::default(); (MAX_STORAGE_ENTRIES + 1) * PAIRS_PER_SLOT];
        assert_eq!(
            entries_from_pairs(&many, &mut out),
            Err(StorageEntryError::TooManyEntries { entries: MAX_STORAGE_ENTRIES + 1 })
        );
        assert!(out.is_empty());
    }

    #[test]
    fn results_round_trip_through_the_detail_word() {
        let mut results = StorageResults::default();
        results.set(0, true, false);
        results.set(31, false, true);
        results.set(5, false, false);
        let back = StorageResults::from_detail(results.to_detail());
        assert_eq!(back, results);
        assert!(back.is_done(0) && !back.is_failed(0));
        assert!(!back.is_done(31) && back.is_failed(31));
        assert!(!back.is_done(5) && !back.is_failed(5));
        assert!(!back.is_done(40));
    }

    #[test]
    fn an_answer_carries_its_results_and_whether_the_tier_was_unreachable() {
        let mut results = StorageResults::default();
        results.set(0, true, false);
        results.set(1, false, true);
        for unreachable in [false, true] {
            let answer = storage_answer(7, 3, results, unreachable);
            assert!(answer.is_ok(), "an OK completion either way");
            assert_eq!((answer.command_id, answer.generation), (7, 3));
            assert_eq!(StorageResults::from_detail(answer.detail), results);
            assert_eq!(tier_unreachable(&answer), unreachable);
        }
        // A failed command's error word is its error code, not flags.
        let failed = Completion::failed(7, 3, crate::record::CommandError::UnknownOp, 0);
        assert!(!tier_unreachable(&failed));
    }

    #[test]
    fn masking_drops_bits_beyond_the_entries_and_failures_of_done_entries() {
        let results = StorageResults { done: 0b1011, failed: 0b1101_0110 };
        assert_eq!(results.masked(3), StorageResults { done: 0b011, failed: 0b100 });
        assert_eq!(results.masked(32).done, 0b1011);
    }
}
