//! The fixed-layout records that cross the process boundary.
//!
//! Everything here is `#[repr(C)]`, plain old data (bytemuck `Pod`) and holds block ids and
//! counters, never pointers. The sizes are pinned by const asserts, and the header of every segment
//! records them, so a reader built with another layout refuses to attach instead of misreading.
//!
//! A command travels through the command ring as a run of 64-byte [`CommandSlot`]s:
//!
//! 1. one slot holding a [`CommandHeader`] (op, id, generation, flags, pair count), then
//! 2. `ceil(pair_count / PAIRS_PER_SLOT)` slots each holding a [`PairChunk`] of (src, dst) block ids.
//!
//! The producer publishes the whole run with one Release store, so a consumer that sees the header
//! also sees every pair slot behind it. Block-pair lists of any length therefore travel without
//! pointers; a list longer than one ring can hold is split by the producer into several commands.
//! The worker answers every command with exactly one [`Completion`].
//!
//! Storage commands ([`Op::is_storage`]) use the same framing: their payload slots hold one
//! 64-byte [`crate::storage_record::StorageEntry`] each instead of eight pairs, and their header's
//! `pair_count` counts eight per entry, so that a reader finds where every command ends without
//! knowing its op (an unknown op is skipped and refused, never misread).

use bytemuck::{Pod, Zeroable};

/// One (source, destination) block id pair of a copy.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct BlockPair {
    pub src: u32,
    pub dst: u32,
}

impl BlockPair {
    pub const fn new(src: u32, dst: u32) -> Self {
        Self { src, dst }
    }
}

/// How many block pairs one ring slot carries.
pub const PAIRS_PER_SLOT: usize = 8;

/// What a command asks a worker to do.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// Copy device blocks (src) to host blocks (dst).
    CopyDeviceToHost = 1,
    /// Copy host blocks (src) to device blocks (dst).
    CopyHostToDevice = 2,
    /// Complete once every earlier command of this rank has completed.
    Flush = 3,
    /// Answer at once; used to measure round trips and to probe a rank.
    Ping = 4,
    /// Write host blocks to the storage tier (entries: [`crate::storage_record::StorageEntry`]).
    StorageStore = 5,
    /// Read storage blocks into host blocks; the completion says which entries hit.
    StorageLoad = 6,
    /// Ask which blocks the storage tier holds (metadata only: no block bytes move).
    StorageQuery = 7,
    /// Tell the storage tier that the scheduler no longer counts these blocks (fire-and-forget):
    /// a tier that owns its room (disk) frees them; a shared one (Redis) keeps them.
    StorageForget = 8,
}

impl Op {
    /// Decodes an op read from shared memory; an unknown value is the caller's error to report.
    pub fn from_wire(value: u32) -> Option<Op> {
        match value {
            1 => Some(Op::CopyDeviceToHost),
            2 => Some(Op::CopyHostToDevice),
            3 => Some(Op::Flush),
            4 => Some(Op::Ping),
            5 => Some(Op::StorageStore),
            6 => Some(Op::StorageLoad),
            7 => Some(Op::StorageQuery),
            8 => Some(Op::StorageForget),
            _ => None,
        }
    }

    pub fn is_copy(self) -> bool {
        matches!(self, Op::CopyDeviceToHost | Op::CopyHostToDevice)
    }

    /// Whether the command goes to the storage tier (its payload slots hold storage entries).
    pub fn is_storage(self) -> bool {
        matches!(self, Op::StorageStore | Op::StorageLoad | Op::StorageQuery | Op::StorageForget)
    }
}

/// Command flag: report per-layer progress in the segment while copying.
pub const FLAG_LAYERWISE: u32 = 1 << 0;
/// Every flag this layout version knows; a command with others set is malformed.
pub const KNOWN_FLAGS: u32 = FLAG_LAYERWISE;

/// Tag of a header slot, so that a consumer that lost its place fails loudly instead of misreading
/// pair slots as commands.
pub const COMMAND_TAG: u32 = 0x434D_4431; // "CMD1"

/// The first slot of a command.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct CommandHeader {
    /// Always [`COMMAND_TAG`].
    pub tag: u32,
    /// An [`Op`] as u32.
    pub op: u32,
    /// Increasing per rank; the completion echoes it.
    pub command_id: u64,
    /// The segment generation the command was issued in; a worker refuses other generations.
    pub generation: u64,
    /// `FLAG_*` bits.
    pub flags: u32,
    /// Number of block pairs in the slots that follow.
    pub pair_count: u32,
    _reserved: [u64; 4],
}

impl CommandHeader {
    pub fn new(op: Op, command_id: u64, generation: u64, pair_count: u32) -> Self {
        Self {
            tag: COMMAND_TAG,
            op: op as u32,
            command_id,
            generation,
            flags: 0,
            pair_count,
            _reserved: [0; 4],
        }
    }

    pub fn with_flags(mut self, flags: u32) -> Self {
        self.flags = flags;
        self
    }

    /// Number of pair slots that follow this header.
    pub fn pair_slots(&self) -> usize {
        (self.pair_count as usize).div_ceil(PAIRS_PER_SLOT)
    }
}

/// A slot after a header: up to [`PAIRS_PER_SLOT`] pairs; unused entries are zero.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct PairChunk {
    pub pairs: [BlockPair; PAIRS_PER_SLOT],
}

/// One 64-byte element of a command ring: a header or a pair chunk, by position.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct CommandSlot {
    pub words: [u64; 8],
}

impl CommandSlot {
    pub fn from_header(header: &CommandHeader) -> Self {
        bytemuck::cast(*header)
    }

    pub fn from_pairs(chunk: &PairChunk) -> Self {
        bytemuck::cast(*chunk)
    }

    pub fn header(&self) -> CommandHeader {
        bytemuck::cast(*self)
    }

    pub fn pairs(&self) -> PairChunk {
        bytemuck::cast(*self)
    }
}

/// Completion status: the command succeeded on this rank.
pub const STATUS_OK: u32 = 0;
/// Completion status: the command failed; `error` says why and `detail` carries a value.
pub const STATUS_FAILED: u32 = 1;

/// Why a command failed. Stored as u32 in [`Completion::error`]. Codes are added as the
/// protocol grows (a build meets codes it does not know: [`CommandError::from_wire`] says `None`),
/// so matches outside this crate need a wildcard arm.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CommandError {
    /// The op value is not one this layout knows (`detail`: the value).
    UnknownOp = 1,
    /// The command was issued in another generation (`detail`: its generation).
    StaleGeneration = 2,
    /// A source block id is out of range (`detail`: the id).
    SourceOutOfRange = 3,
    /// A destination block id is out of range (`detail`: the id).
    DestinationOutOfRange = 4,
    /// The header tag, flags or pair count do not make sense (`detail`: the offending value).
    Malformed = 5,
    /// The copy engine reported an error (`detail`: the backend's code).
    CopyFailed = 6,
    /// The worker of this rank died with the command in flight (synthesised by the scheduler).
    WorkerDied = 7,
    /// A storage command reached a worker that runs without a storage tier (`detail`: the op).
    NoStorage = 8,
    /// Some block of a storage command missed on this rank: absent, corrupt, or the tier failed
    /// (synthesised by the scheduler from the completion's result bits, which are the `detail`).
    StorageMiss = 9,
    /// The worker answered a later command of the same lane (copies, or storage commands) first,
    /// and answers each lane in ring order: this command's answer was lost, a command or
    /// completion written over in its ring (synthesised by the scheduler).
    AnswerLost = 10,
    /// The command waited in the scheduler's backlog for the command deadline while the rank's
    /// worker was still setting up, and was never sent (synthesised by the scheduler).
    WorkerNotServing = 11,
}

impl CommandError {
    pub fn from_wire(value: u32) -> Option<CommandError> {
        Some(match value {
            1 => CommandError::UnknownOp,
            2 => CommandError::StaleGeneration,
            3 => CommandError::SourceOutOfRange,
            4 => CommandError::DestinationOutOfRange,
            5 => CommandError::Malformed,
            6 => CommandError::CopyFailed,
            7 => CommandError::WorkerDied,
            8 => CommandError::NoStorage,
            9 => CommandError::StorageMiss,
            10 => CommandError::AnswerLost,
            11 => CommandError::WorkerNotServing,
            _ => return None,
        })
    }
}

/// A worker's answer to one command.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct Completion {
    pub command_id: u64,
    pub generation: u64,
    /// `STATUS_OK` or `STATUS_FAILED`.
    pub status: u32,
    /// A [`CommandError`] as u32 when failed; in a storage command's OK answer, its flags
    /// ([`crate::storage_record::TIER_UNREACHABLE`]); else 0.
    pub error: u32,
    pub detail: u64,
}

impl Completion {
    pub fn ok(command_id: u64, generation: u64) -> Self {
        Self { command_id, generation, status: STATUS_OK, error: 0, detail: 0 }
    }

    pub fn failed(command_id: u64, generation: u64, error: CommandError, detail: u64) -> Self {
        Self { command_id, generation, status: STATUS_FAILED, error: error as u32, detail }
    }

    pub fn is_ok(&self) -> bool {
        self.status == STATUS_OK
    }
}

/// Number of ring slots a command with `pair_count` pairs occupies (its header included).
pub fn command_slot_count(pair_count: usize) -> usize {
    1 + pair_count.div_ceil(PAIRS_PER_SLOT)
}

/// Appends the slots of one command (its header, then its pairs in chunks) to `out`.
///
/// The header's `pair_count` must equal `pairs.len()`.
///
/// # Panics
///
/// If the header's pair count disagrees with `pairs`: that is a programming error of the producer.
pub fn encode_command(header: &CommandHeader, pairs: &[BlockPair], out: &mut Vec<CommandSlot>) {
    assert_eq!(
        header.pair_count as usize,
        pairs.len(),
        "a header whose pair count disagrees with its pairs is a programming error"
    );
    out.reserve(command_slot_count(pairs.len()));
    out.push(CommandSlot::from_header(header));
    for chunk in pairs.chunks(PAIRS_PER_SLOT) {
        let mut slot = PairChunk::default();
        slot.pairs[..chunk.len()].copy_from_slice(chunk);
        out.push(CommandSlot::from_pairs(&slot));
    }
}

/// Why the slots read from a ring do not form a command.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("slot is not a command header (tag {found:#x})")]
    NotAHeader { found: u32 },
    #[error("command announces {pair_count} pairs but only {available_slots} pair slots follow")]
    MissingPairSlots { pair_count: u32, available_slots: usize },
}

/// Decodes the command that starts at `slots[0]`, appending its pairs to `pairs`.
///
/// Returns the header and the number of slots the command occupies. Everything is checked: the
/// slots come from another process and may be garbage.
pub fn decode_command(
    slots: &[CommandSlot],
    pairs: &mut Vec<BlockPair>,
) -> Result<(CommandHeader, usize), DecodeError> {
    let Some(first) = slots.first() else {
        return Err(DecodeError::NotAHeader { found: 0 });
    };
    let header = first.header();
    if header.tag != COMMAND_TAG {
        return Err(DecodeError::NotAHeader { found: header.tag });
    }
    let used = command_slot_count(header.pair_count as usize);
    if used > slots.len() {
        return Err(DecodeError::MissingPairSlots {
            pair_count: header.pair_count,
            available_slots: slots.len() - 1,
        });
    }
    let mut remaining = header.pair_count as usize;
    for slot in &slots[1..used] {
        let chunk = slot.pairs();
        let take = remaining.min(PAIRS_PER_SLOT);
        pairs.extend_from_slice(&chunk.pairs[..take]);
        remaining -= take;
    }
    Ok((header, used))
}

const _: () = assert!(size_of::<BlockPair>() == 8);
const _: () = assert!(size_of::<CommandHeader>() == 64);
const _: () = assert!(size_of::<PairChunk>() == 64);
const _: () = assert!(size_of::<CommandSlot>() == 64);
const _: () = assert!(size_of::<Completion>() == 32);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_survives_a_trip_through_a_slot() {
        let header = CommandHeader::new(Op::CopyHostToDevice, 7, 3, 17).with_flags(FLAG_LAYERWISE);
        let slot = CommandSlot::from_header(&header);
        assert_eq!(slot.header(), header);
        assert_eq!(header.pair_slots(), 3);
    }

    #[test]
    fn unknown_op_values_do_not_decode() {
        assert_eq!(Op::from_wire(2), Some(Op::CopyHostToDevice));
        assert_eq!(Op::from_wire(0), None);
        assert_eq!(Op::from_wire(99), None);
    }

    #[test]
    fn a_command_with_many_pairs_round_trips_through_slots() {
        let pairs: Vec<BlockPair> = (0..19).map(|i| BlockPair::new(i, 100 + i)).collect();
        let header = CommandHeader::new(Op::CopyDeviceToHost, 42, 1, pairs.len() as u32);
        let mut slots = Vec::new();
        encode_command(&header, &pairs, &mut slots);
        assert_eq!(slots.len(), command_slot_count(19));
        let mut decoded = Vec::new();
        let (back, used) = decode_command(&slots, &mut decoded).unwrap();
        assert_eq!((back, used), (header, 4));
        assert_eq!(decoded, pairs);
    }

    #[test]
    fn decoding_rejects_a_pair_slot_in_header_position_and_missing_pairs() {
        let pairs = [BlockPair::new(1, 2); 9];
        let header = CommandHeader::new(Op::CopyHostToDevice, 1, 0, 9);
        let mut slots = Vec::new();
        encode_command(&header, &pairs, &mut slots);
        let mut out = Vec::new();
        assert!(matches!(
            decode_command(&slots[1..], &mut out),
            Err(DecodeError::NotAHeader { .. })
        ));
        assert_eq!(
            decode_command(&slots[..2], &mut out),
            Err(DecodeError::MissingPairSlots { pair_count: 9, available_slots: 1 })
        );
        assert!(matches!(decode_command(&[], &mut out), Err(DecodeError::NotAHeader { found: 0 })));
    }
}
