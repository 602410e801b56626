//! Validation of storage commands (STORE, LOAD, QUERY, FORGET): the part of [`super::validate`](mod@super::validate) that
//! knows storage entries.
//!
//! Core types: [`StorageCommand`] (what the storage thread may run), [`StorageOp`] and
//! [`InvalidStorageCommand`].
//!
//! [`validate_storage`] runs after the checks every command gets (tag, op, known flags,
//! generation, pair count against the pairs carried) and checks, in this order:
//!
//! 1. no flags: layer-wise progress means nothing to storage (`Malformed`, detail: the flags);
//! 2. the pairs are a whole number of entries, at most `MAX_STORAGE_ENTRIES`
//!    (`Malformed`, detail: the announced pair count);
//! 3. every entry's reserved words are zero (`Malformed`, detail: the entry's index);
//! 4. STORE: every host block is in range (`SourceOutOfRange`, detail: the id); LOAD: every host
//!    block is in range (`DestinationOutOfRange`) and none is written twice (`Malformed`,
//!    detail: the block); QUERY and FORGET: every host block is `NO_HOST_BLOCK` (`Malformed`,
//!    detail: the entry's index).
//!
//! A command that passes touches only host blocks of the rank's tier, each LOAD destination once.

use kvshm_ipc::record::{CommandError, CommandHeader, Op};
use kvshm_ipc::storage_record::{
    entries_from_pairs, StorageEntry, StorageEntryError, NO_HOST_BLOCK,
};

use super::geometry::Geometry;

/// What a storage command asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StorageOp {
    Store,
    Load,
    Query,
    Forget,
}

impl StorageOp {
    /// The storage op of `op`, if it is one.
    pub fn of(op: Op) -> Option<StorageOp> {
        match op {
            Op::StorageStore => Some(StorageOp::Store),
            Op::StorageLoad => Some(StorageOp::Load),
            Op::StorageQuery => Some(StorageOp::Query),
            Op::StorageForget => Some(StorageOp::Forget),
            _ => None,
        }
    }
}

/// A storage command that passed validation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StorageCommand {
    pub op: StorageOp,
    pub entries: Vec<StorageEntry>,
}

/// Why a storage command is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InvalidStorageCommand {
    #[error("storage commands take no flags, got {flags:#x}")]
    Flags { flags: u32 },
    #[error("{error} (announced {announced} pairs)")]
    Entries { error: StorageEntryError, announced: u32 },
    #[error("storage entry {entry} has non-zero reserved words")]
    Reserved { entry: usize },
    #[error("host block {block} is out of range ({blocks} blocks)")]
    HostBlockOutOfRange { op: StorageOp, block: u32, blocks: u32 },
    #[error("host block {block} is loaded into twice")]
    DuplicateLoad { block: u32 },
    #[error("query or forget entry {entry} names a host block")]
    HostBlockOnQuery { entry: usize },
}

impl InvalidStorageCommand {
    /// The completion's error code and detail value for this refusal.
    pub fn to_wire(&self) -> (CommandError, u64) {
        match *self {
            InvalidStorageCommand::Flags { flags } => (CommandError::Malformed, flags.into()),
            InvalidStorageCommand::Entries { announced, .. } => {
                (CommandError::Malformed, announced.into())
            }
            InvalidStorageCommand::Reserved { entry }
            | InvalidStorageCommand::HostBlockOnQuery { entry } => {
                (CommandError::Malformed, entry as u64)
            }
            InvalidStorageCommand::HostBlockOutOfRange { op: StorageOp::Store, block, .. } => {
                (CommandError::SourceOutOfRange, block.into())
            }
            InvalidStorageCommand::HostBlockOutOfRange { block, .. } => {
                (CommandError::DestinationOutOfRange, block.into())
            }
            InvalidStorageCommand::DuplicateLoad { block } => {
                (CommandError::Malformed, block.into())
            }
        }
    }
}

/// Validates the storage-specific part of a command (module documentation).
pub fn validate_storage(
    op: StorageOp,
    header: &CommandHeader,
    pairs: &[kvshm_ipc::record::BlockPair],
    geometry: &Geometry,
) -> Result<StorageCommand, InvalidStorageCommand> {
    if header.flags != 0 {
        return Err(InvalidStorageCommand::Flags { flags: header.flags });
    }
    let mut entries = Vec::new();
    entries_from_pairs(pairs, &mut entries)
        .map_err(|error| InvalidStorageCommand::Entries { error, announced: header.pair_count })?;
    if let Some(entry) = entries.iter().position(|entry| entry.reserved != [0; 3]) {
        return Err(InvalidStorageCommand::Reserved { entry });
    }
    let blocks = geometry.host_blocks();
    match op {
        StorageOp::Query | StorageOp::Forget => {
            if let Some(entry) = entries.iter().position(|entry| entry.host_block != NO_HOST_BLOCK)
            {
                return Err(InvalidStorageCommand::HostBlockOnQuery { entry });
            }
        }
        StorageOp::Store | StorageOp::Load => {
            if let Some(entry) = entries.iter().find(|entry| entry.host_block >= blocks) {
                return Err(InvalidStorageCommand::HostBlockOutOfRange {
                    op,
                    block: entry.host_block,
                    blocks,
                });
            }
        }
    }
    if op == StorageOp::Load {
        let mut targets: Vec<u32> = entries.iter().map(|entry| entry.host_block).collect();
        targets.sort_unstable();
        if let Some(pair) = targets.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(InvalidStorageCommand::DuplicateLoad { block: pair[0] });
        }
    }
    Ok(StorageCommand { op, entries })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::geometry::GeometryParams;
    use crate::worker::validate::{validate, InvalidCommand, ValidCommand};
    use kvshm_ipc::record::{decode_command, FLAG_LAYERWISE};
    use kvshm_ipc::storage_record::{
        encode_storage_command, storage_pair_count, MAX_STORAGE_ENTRIES,
    };

    const GENERATION: u64 = 3;

    fn geometry() -> Geometry {
        Geometry::new(GeometryParams {
            layers: 1,
            regions: 2,
            region_bytes: 64,
            device_blocks: 4,
            host_blocks: 10,
        })
        .unwrap()
    }

    fn check(op: Op, entries: &[StorageEntry], flags: u32) -> Result<ValidCommand, InvalidCommand> {
        let header = CommandHeader::new(op, 1, GENERATION, storage_pair_count(entries.len()))
            .with_flags(flags);
        let mut slots = Vec::new();
        encode_storage_command(&header, entries, &mut slots);
        let mut pairs = Vec::new();
        let (header, _) = decode_command(&slots, &mut pairs).unwrap();
        validate(&header, &pairs, &geometry(), GENERATION)
    }

    fn wire(result: Result<ValidCommand, InvalidCommand>) -> (CommandError, u64) {
        result.unwrap_err().to_wire()
    }

    fn entry(host_block: u32) -> StorageEntry {
        StorageEntry::new(u128::from(host_block) + 1000, 1, 0, host_block)
    }

    #[test]
    fn valid_storage_commands_pass_with_their_entries() {
        let entries = [entry(0), entry(9)];
        assert_eq!(
            check(Op::StorageStore, &entries, 0),
            Ok(ValidCommand::Storage(StorageCommand {
                op: StorageOp::Store,
                entries: entries.to_vec()
            }))
        );
        assert!(check(Op::StorageLoad, &entries, 0).is_ok());
        let query = [StorageEntry::new(5, 4, 1, NO_HOST_BLOCK)];
        assert!(check(Op::StorageQuery, &query, 0).is_ok());
        assert!(check(Op::StorageLoad, &[], 0).is_ok());
    }

    #[test]
    fn out_of_range_host_blocks_are_refused_as_source_or_destination() {
        assert_eq!(
            wire(check(Op::StorageStore, &[entry(1), entry(10)], 0)),
            (CommandError::SourceOutOfRange, 10)
        );
        assert_eq!(
            wire(check(Op::StorageLoad, &[entry(u32::MAX - 1)], 0)),
            (CommandError::DestinationOutOfRange, u64::from(u32::MAX - 1))
        );
    }

    #[test]
    fn a_load_into_one_host_block_twice_is_malformed_but_a_store_from_one_is_not() {
        let twice = [StorageEntry::new(1, 0, 0, 4), StorageEntry::new(2, 0, 0, 4)];
        assert_eq!(wire(check(Op::StorageLoad, &twice, 0)), (CommandError::Malformed, 4));
        assert!(check(Op::StorageStore, &twice, 0).is_ok());
    }

    #[test]
    fn flags_reserved_words_and_queries_naming_blocks_are_malformed() {
        assert_eq!(
            wire(check(Op::StorageStore, &[entry(1)], FLAG_LAYERWISE)),
            (CommandError::Malformed, u64::from(FLAG_LAYERWISE))
        );
        let mut reserved = entry(2);
        reserved.reserved[1] = 9;
        assert_eq!(
            wire(check(Op::StorageStore, &[entry(1), reserved], 0)),
            (CommandError::Malformed, 1)
        );
        assert_eq!(wire(check(Op::StorageQuery, &[entry(3)], 0)), (CommandError::Malformed, 0));
        let forget = [StorageEntry::new(5, 0, 0, NO_HOST_BLOCK), entry(3)];
        assert_eq!(wire(check(Op::StorageForget, &forget, 0)), (CommandError::Malformed, 1));
        assert!(check(Op::StorageForget, &forget[..1], 0).is_ok());
    }

    #[test]
    fn a_forget_of_an_older_generation_is_still_run_and_other_storage_commands_are_stale() {
        let forget = [StorageEntry::new(5, 0, 0, NO_HOST_BLOCK)];
        let decode = |op: Op, entries: &[StorageEntry], generation: u64| {
            let header = CommandHeader::new(op, 1, generation, storage_pair_count(entries.len()));
            let mut slots = Vec::new();
            encode_storage_command(&header, entries, &mut slots);
            let mut pairs = Vec::new();
            let (header, _) = decode_command(&slots, &mut pairs).unwrap();
            validate(&header, &pairs, &geometry(), GENERATION)
        };
        // Queued before a reset, read after it: the blocks must still leave the tier.
        assert!(decode(Op::StorageForget, &forget, GENERATION - 1).is_ok());
        assert_eq!(
            wire(decode(Op::StorageQuery, &forget, GENERATION - 1)),
            (CommandError::StaleGeneration, GENERATION - 1)
        );
        assert_eq!(
            wire(decode(Op::StorageStore, &[entry(1)], GENERATION - 1)),
            (CommandError::StaleGeneration, GENERATION - 1)
        );
    }

    #[test]
    fn pair_counts_that_are_not_whole_entries_or_too_many_are_malformed() {
        let geometry = geometry();
        let header = CommandHeader::new(Op::StorageLoad, 1, GENERATION, 9);
        let pairs = vec![kvshm_ipc::record::BlockPair::default(); 9];
        assert_eq!(
            validate(&header, &pairs, &geometry, GENERATION).unwrap_err().to_wire(),
            (CommandError::Malformed, 9)
        );
        let count = storage_pair_count(MAX_STORAGE_ENTRIES + 1);
        let header = CommandHeader::new(Op::StorageLoad, 1, GENERATION, count);
        let pairs = vec![kvshm_ipc::record::BlockPair::default(); count as usize];
        assert_eq!(
            validate(&header, &pairs, &geometry, GENERATION).unwrap_err().to_wire(),
            (CommandError::Malformed, u64::from(count))
        );
    }
}
