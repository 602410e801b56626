//! Command validation: the only door between bytes another process wrote and the copy engine.
//!
//! Core types: [`ValidCommand`] (what the worker may execute) and [`InvalidCommand`] (why not,
//! convertible to the wire's [`CommandError`] + detail for the error completion).
//!
//! [`validate`] is a pure function of the decoded command, the rank's [`Geometry`] and the current
//! generation. It checks, in this order (the first failure is the answer):
//!
//! 1. the header tag (`Malformed`, detail: the tag);
//! 2. the op (`UnknownOp`, detail: the value);
//! 3. the flags (`Malformed`, detail: the unknown bits);
//! 4. the generation (`StaleGeneration`, detail: the command's generation), but for FORGET,
//!    which runs whatever its generation (the blocks a scheduler dropped before a reset must
//!    still leave a disk slab);
//! 5. the pair count against the pairs carried, and no pairs on FLUSH or PING (`Malformed`,
//!    detail: the announced count);
//! 6. every source id, then every destination id, against its tier (`SourceOutOfRange` /
//!    `DestinationOutOfRange`, detail: the first offending id in wire order);
//! 7. no destination written twice (`Malformed`, detail: the block), while coalescing the pairs
//!    into a [`CopyPlan`].
//!
//! Storage commands (STORE, LOAD, QUERY, FORGET) pass checks 1 to 5 (their payload counted in pairs, 8 per
//! entry) and then [`super::storage_command::validate_storage`]'s.

use kvshm_ipc::record::{
    BlockPair, CommandError, CommandHeader, Op, COMMAND_TAG, FLAG_LAYERWISE, KNOWN_FLAGS,
};

use super::geometry::Geometry;
use super::plan::{CopyPlan, Direction};
use super::storage_command::{validate_storage, InvalidStorageCommand, StorageCommand, StorageOp};

/// A command that passed validation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ValidCommand {
    /// A copy whose every block id is in range and whose destinations are distinct.
    Copy {
        plan: CopyPlan,
        /// Report per-layer progress while copying.
        layerwise: bool,
    },
    /// Complete after every earlier command of this rank.
    Flush,
    /// Complete at once.
    Ping,
    /// A storage command whose host blocks are in range (run by the storage thread).
    Storage(StorageCommand),
}

/// Why a command is refused. [`InvalidCommand::to_wire`] gives the completion's error and detail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InvalidCommand {
    #[error("header tag {tag:#x} is not a command tag")]
    BadTag { tag: u32 },
    #[error("unknown op {op}")]
    UnknownOp { op: u32 },
    #[error("unknown flags {unknown:#x}")]
    UnknownFlags { unknown: u32 },
    #[error("command of generation {found} arrived in generation {current}")]
    StaleGeneration { found: u64, current: u64 },
    #[error("header announces {announced} pairs but {carried} were carried")]
    PairCountMismatch { announced: u32, carried: usize },
    #[error("{op:?} takes no block pairs but carries {announced}")]
    PairsOnNonCopy { op: Op, announced: u32 },
    #[error("source block {block} is out of range ({blocks} blocks)")]
    SourceOutOfRange { block: u32, blocks: u32 },
    #[error("destination block {block} is out of range ({blocks} blocks)")]
    DestinationOutOfRange { block: u32, blocks: u32 },
    #[error("destination block {block} is written by two pairs")]
    DuplicateDestination { block: u32 },
    #[error(transparent)]
    Storage(#[from] InvalidStorageCommand),
}

impl InvalidCommand {
    /// The completion's error code and detail value for this refusal.
    pub fn to_wire(&self) -> (CommandError, u64) {
        match *self {
            InvalidCommand::BadTag { tag } => (CommandError::Malformed, tag.into()),
            InvalidCommand::UnknownOp { op } => (CommandError::UnknownOp, op.into()),
            InvalidCommand::UnknownFlags { unknown } => (CommandError::Malformed, unknown.into()),
            InvalidCommand::StaleGeneration { found, .. } => (CommandError::StaleGeneration, found),
            InvalidCommand::PairCountMismatch { announced, .. }
            | InvalidCommand::PairsOnNonCopy { announced, .. } => {
                (CommandError::Malformed, announced.into())
            }
            InvalidCommand::SourceOutOfRange { block, .. } => {
                (CommandError::SourceOutOfRange, block.into())
            }
            InvalidCommand::DestinationOutOfRange { block, .. } => {
                (CommandError::DestinationOutOfRange, block.into())
            }
            InvalidCommand::DuplicateDestination { block } => {
                (CommandError::Malformed, block.into())
            }
            InvalidCommand::Storage(refusal) => refusal.to_wire(),
        }
    }
}

/// Validates one decoded command (its header and the pairs carried behind it) against the rank's
/// geometry and the segment's current generation. See the module documentation for the checks.
pub fn validate(
    header: &CommandHeader,
    pairs: &[BlockPair],
    geometry: &Geometry,
    generation: u64,
) -> Result<ValidCommand, InvalidCommand> {
    if header.tag != COMMAND_TAG {
        return Err(InvalidCommand::BadTag { tag: header.tag });
    }
    let op = Op::from_wire(header.op).ok_or(InvalidCommand::UnknownOp { op: header.op })?;
    let unknown = header.flags & !KNOWN_FLAGS;
    if unknown != 0 {
        return Err(InvalidCommand::UnknownFlags { unknown });
    }
    // A FORGET is idempotent and frees only what the scheduler dropped: one queued before a
    // reset still runs (ring order puts it before any STORE of the same block made after).
    if header.generation != generation && op != Op::StorageForget {
        return Err(InvalidCommand::StaleGeneration {
            found: header.generation,
            current: generation,
        });
    }
    if header.pair_count as usize != pairs.len() {
        return Err(InvalidCommand::PairCountMismatch {
            announced: header.pair_count,
            carried: pairs.len(),
        });
    }
    let direction = match op {
        Op::CopyDeviceToHost => Direction::DeviceToHost,
        Op::CopyHostToDevice => Direction::HostToDevice,
        Op::Flush | Op::Ping if header.pair_count != 0 => {
            return Err(InvalidCommand::PairsOnNonCopy { op, announced: header.pair_count });
        }
        Op::StorageStore | Op::StorageLoad | Op::StorageQuery | Op::StorageForget => {
            let storage_op = StorageOp::of(op).expect("a storage op");
            return Ok(ValidCommand::Storage(validate_storage(
                storage_op, header, pairs, geometry,
            )?));
        }
        Op::Flush => return Ok(ValidCommand::Flush),
        Op::Ping => return Ok(ValidCommand::Ping),
    };
    let (src_blocks, dst_blocks) = match direction {
        Direction::DeviceToHost => (geometry.device_blocks(), geometry.host_blocks()),
        Direction::HostToDevice => (geometry.host_blocks(), geometry.device_blocks()),
    };
    if let Some(pair) = pairs.iter().find(|pair| pair.src >= src_blocks) {
        return Err(InvalidCommand::SourceOutOfRange { block: pair.src, blocks: src_blocks });
    }
    if let Some(pair) = pairs.iter().find(|pair| pair.dst >= dst_blocks) {
        return Err(InvalidCommand::DestinationOutOfRange { block: pair.dst, blocks: dst_blocks });
    }
    let mut sorted = pairs.to_vec();
    let plan = CopyPlan::coalesce(direction, &mut sorted)
        .map_err(|duplicate| InvalidCommand::DuplicateDestination { block: duplicate.block })?;
    Ok(ValidCommand::Copy { plan, layerwise: header.flags & FLAG_LAYERWISE != 0 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::geometry::GeometryParams;
    use crate::worker::plan::BlockRun;

    const GENERATION: u64 = 7;

    fn geometry() -> Geometry {
        Geometry::new(GeometryParams {
            layers: 2,
            regions: 4,
            region_bytes: 64,
            device_blocks: 10,
            host_blocks: 20,
        })
        .unwrap()
    }

    fn header(op: Op, pairs: usize) -> CommandHeader {
        CommandHeader::new(op, 1, GENERATION, pairs as u32)
    }

    fn check(header: CommandHeader, pairs: &[(u32, u32)]) -> Result<ValidCommand, InvalidCommand> {
        let pairs: Vec<BlockPair> = pairs.iter().map(|&(s, d)| BlockPair::new(s, d)).collect();
        validate(&header, &pairs, &geometry(), GENERATION)
    }

    fn copy(op: Op, pairs: &[(u32, u32)]) -> Result<ValidCommand, InvalidCommand> {
        check(header(op, pairs.len()), pairs)
    }

    #[test]
    fn the_last_valid_ids_of_both_tiers_are_accepted() {
        let d2h = copy(Op::CopyDeviceToHost, &[(9, 19)]).unwrap();
        assert_eq!(
            d2h,
            ValidCommand::Copy {
                plan: CopyPlan::coalesce(Direction::DeviceToHost, &mut [BlockPair::new(9, 19)])
                    .unwrap(),
                layerwise: false,
            }
        );
        assert!(copy(Op::CopyHostToDevice, &[(19, 9)]).is_ok());
    }

    #[test]
    fn the_first_invalid_source_id_is_refused_with_its_value() {
        let refused = copy(Op::CopyDeviceToHost, &[(0, 0), (10, 1)]).unwrap_err();
        assert_eq!(refused, InvalidCommand::SourceOutOfRange { block: 10, blocks: 10 });
        assert_eq!(refused.to_wire(), (CommandError::SourceOutOfRange, 10));
        assert_eq!(
            copy(Op::CopyHostToDevice, &[(20, 0)]),
            Err(InvalidCommand::SourceOutOfRange { block: 20, blocks: 20 })
        );
    }

    #[test]
    fn the_first_invalid_destination_id_is_refused_with_its_value() {
        let refused = copy(Op::CopyDeviceToHost, &[(0, 20)]).unwrap_err();
        assert_eq!(refused, InvalidCommand::DestinationOutOfRange { block: 20, blocks: 20 });
        assert_eq!(refused.to_wire(), (CommandError::DestinationOutOfRange, 20));
        assert_eq!(
            copy(Op::CopyHostToDevice, &[(0, 10)]),
            Err(InvalidCommand::DestinationOutOfRange { block: 10, blocks: 10 })
        );
        assert_eq!(
            copy(Op::CopyHostToDevice, &[(0, u32::MAX)]),
            Err(InvalidCommand::DestinationOutOfRange { block: u32::MAX, blocks: 10 })
        );
    }

    #[test]
    fn a_rank_without_host_tier_refuses_every_host_id() {
        let no_host =
            Geometry::new(GeometryParams { host_blocks: 0, ..geometry().params() }).unwrap();
        let header = header(Op::CopyDeviceToHost, 1);
        assert_eq!(
            validate(&header, &[BlockPair::new(0, 0)], &no_host, GENERATION),
            Err(InvalidCommand::DestinationOutOfRange { block: 0, blocks: 0 })
        );
    }

    #[test]
    fn an_unknown_op_is_refused_with_its_value() {
        let mut bad = header(Op::Ping, 0);
        bad.op = 99;
        let refused = check(bad, &[]).unwrap_err();
        assert_eq!(refused, InvalidCommand::UnknownOp { op: 99 });
        assert_eq!(refused.to_wire(), (CommandError::UnknownOp, 99));
    }

    #[test]
    fn another_generation_is_stale() {
        let old = CommandHeader::new(Op::CopyDeviceToHost, 1, GENERATION - 1, 1);
        let refused = check(old, &[(0, 0)]).unwrap_err();
        assert_eq!(refused, InvalidCommand::StaleGeneration { found: 6, current: 7 });
        assert_eq!(refused.to_wire(), (CommandError::StaleGeneration, 6));
        let ping = CommandHeader::new(Op::Ping, 1, GENERATION + 1, 0);
        assert!(matches!(check(ping, &[]), Err(InvalidCommand::StaleGeneration { .. })));
    }

    #[test]
    fn garbled_headers_are_malformed() {
        let mut tagless = header(Op::Ping, 0);
        tagless.tag = 0xdead;
        assert_eq!(check(tagless, &[]).unwrap_err().to_wire(), (CommandError::Malformed, 0xdead));

        let flagged = header(Op::Ping, 0).with_flags(FLAG_LAYERWISE | 0x80);
        let refused = check(flagged, &[]).unwrap_err();
        assert_eq!(refused, InvalidCommand::UnknownFlags { unknown: 0x80 });
        assert_eq!(refused.to_wire(), (CommandError::Malformed, 0x80));

        let short = header(Op::CopyDeviceToHost, 3);
        let refused = check(short, &[(0, 0)]).unwrap_err();
        assert_eq!(refused, InvalidCommand::PairCountMismatch { announced: 3, carried: 1 });
        assert_eq!(refused.to_wire(), (CommandError::Malformed, 3));

        let flush_with_pairs = header(Op::Flush, 1);
        assert_eq!(
            check(flush_with_pairs, &[(0, 0)]),
            Err(InvalidCommand::PairsOnNonCopy { op: Op::Flush, announced: 1 })
        );
    }

    #[test]
    fn a_destination_written_twice_is_malformed() {
        let refused = copy(Op::CopyHostToDevice, &[(1, 4), (2, 5), (3, 4)]).unwrap_err();
        assert_eq!(refused, InvalidCommand::DuplicateDestination { block: 4 });
        assert_eq!(refused.to_wire(), (CommandError::Malformed, 4));
    }

    #[test]
    fn a_source_read_twice_is_allowed() {
        assert!(copy(Op::CopyHostToDevice, &[(1, 4), (1, 5)]).is_ok());
    }

    #[test]
    fn flush_and_ping_pass_and_layerwise_copies_say_so() {
        assert_eq!(check(header(Op::Flush, 0), &[]), Ok(ValidCommand::Flush));
        assert_eq!(check(header(Op::Ping, 0), &[]), Ok(ValidCommand::Ping));
        let layerwise = header(Op::CopyHostToDevice, 2).with_flags(FLAG_LAYERWISE);
        let Ok(ValidCommand::Copy { plan, layerwise: true }) = check(layerwise, &[(3, 0), (4, 1)])
        else {
            panic!("a layer-wise copy should validate as one");
        };
        assert_eq!(plan.runs(), &[BlockRun { device_first: 0, host_first: 3, blocks: 2 }]);
    }
}
