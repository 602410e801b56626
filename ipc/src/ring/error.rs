//! What can go wrong with a ring: a header or index that does not make sense, or no room to push.

use thiserror::Error;

/// The ring's memory or one of its indices does not describe a valid ring.
///
/// Everything a ring reads from shared memory is checked; a peer that scribbles over the ring
/// produces one of these, never a panic or an access outside the ring's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum RingError {
    #[error("ring memory at {address:#x} is not aligned to {required} bytes")]
    Misaligned { address: usize, required: usize },
    #[error("ring memory is {len} bytes but {needed} are needed")]
    Truncated { len: usize, needed: usize },
    #[error(
        "ring header magic is {found:#x}, expected {expected:#x} (not initialised or not a ring)"
    )]
    BadMagic { found: u64, expected: u64 },
    #[error("ring element size is {found} bytes, expected {expected}")]
    ElementSizeMismatch { found: u64, expected: u64 },
    #[error("ring capacity {capacity} is not a power of two between 1 and {max}")]
    BadCapacity { capacity: u64, max: u64 },
    #[error("ring capacity {found} is not the {expected} its creator gave it")]
    CapacityMismatch { found: u64, expected: u64 },
    #[error("ring indices are corrupt: head {head}, tail {tail}, capacity {capacity}")]
    Corrupt { head: u64, tail: u64, capacity: u64 },
}

impl RingError {
    /// `Ok` when a ring end's `found` capacity is the `expected` one its creator configured:
    /// attaching checks only that a description is one a ring may have, and a peer may have
    /// rewritten it in place (a capacity of 1 would carry one record at a time).
    pub(crate) fn check_capacity(found: usize, expected: u64) -> Result<(), RingError> {
        let found = found as u64;
        if found == expected {
            Ok(())
        } else {
            Err(RingError::CapacityMismatch { found, expected })
        }
    }
}

/// The ring has fewer free slots than the records to push; nothing was pushed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[error("ring has no room for the records")]
pub struct RingFull;
