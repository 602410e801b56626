//! The owner word of a worker slot: who holds the rank, in one 64-bit word.
//!
//! [`OwnerWord`] packs a state, a pid and a version: bits 0..32 the pid, bits 32..36 the state,
//! bits 36..64 the version. Every transition of a slot (claim, release, begin and finish of a
//! reclaim) writes the current word's successor, whose version is one more, so a word does not
//! come back for 2^28 transitions: a CAS from a word judged earlier fails if anything at all
//! happened to the slot since, even if the same pid holds it again.

use std::fmt;

const STATE_SHIFT: u32 = 32;
const STATE_MASK: u64 = 0xF;
const VERSION_SHIFT: u32 = 36;
const VERSION_MASK: u64 = (1 << (64 - VERSION_SHIFT)) - 1;

const STATE_EMPTY: u32 = 0;
const STATE_ATTACHED: u32 = 1;
const STATE_DEAD: u32 = 2;

/// The state part of an owner word.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WorkerState {
    /// Nobody holds the rank; a worker may claim it.
    Empty,
    /// A worker claimed the rank (the pid says which).
    Attached,
    /// The scheduler is reclaiming the rank (only the scheduler writes this state). The pid is
    /// the worker whose word the reclaim took, 0 if the slot was empty.
    Dead,
    /// A code this layout does not know (memory written over).
    Unknown(u32),
}

impl WorkerState {
    fn from_wire(code: u32) -> WorkerState {
        match code {
            STATE_EMPTY => WorkerState::Empty,
            STATE_ATTACHED => WorkerState::Attached,
            STATE_DEAD => WorkerState::Dead,
            other => WorkerState::Unknown(other),
        }
    }

    /// The code of a known state (`Unknown` keeps its own, cut to the field's four bits).
    fn to_wire(self) -> u32 {
        match self {
            WorkerState::Empty => STATE_EMPTY,
            WorkerState::Attached => STATE_ATTACHED,
            WorkerState::Dead => STATE_DEAD,
            WorkerState::Unknown(code) => code & STATE_MASK as u32,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WorkerState::Empty => "empty",
            WorkerState::Attached => "attached",
            WorkerState::Dead => "dead",
            WorkerState::Unknown(_) => "unknown",
        }
    }
}

/// A worker slot's owner word: state, pid and version (module documentation).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct OwnerWord(u64);

impl OwnerWord {
    /// The word of a zeroed slot: empty, version 0.
    pub const ZERO: OwnerWord = OwnerWord(0);

    /// A word with these parts (the version is cut to its 28 bits).
    pub fn new(state: WorkerState, pid: u32, version: u32) -> OwnerWord {
        OwnerWord(
            (u64::from(version) & VERSION_MASK) << VERSION_SHIFT
                | u64::from(state.to_wire()) << STATE_SHIFT
                | u64::from(pid),
        )
    }

    /// The word as it lies in memory.
    pub const fn from_raw(raw: u64) -> OwnerWord {
        OwnerWord(raw)
    }

    pub const fn to_raw(self) -> u64 {
        self.0
    }

    pub fn state(self) -> WorkerState {
        WorkerState::from_wire(((self.0 >> STATE_SHIFT) & STATE_MASK) as u32)
    }

    pub fn pid(self) -> u32 {
        self.0 as u32
    }

    pub fn version(self) -> u32 {
        ((self.0 >> VERSION_SHIFT) & VERSION_MASK) as u32
    }

    /// The word that replaces this one in a transition to `state` held by `pid`.
    pub(crate) fn successor(self, state: WorkerState, pid: u32) -> OwnerWord {
        OwnerWord::new(state, pid, self.version().wrapping_add(1))
    }
}

impl fmt::Debug for OwnerWord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnerWord")
            .field("state", &self.state())
            .field("pid", &self.pid())
            .field("version", &self.version())
            .finish()
    }
}

impl fmt::Display for OwnerWord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} pid {} (version {})", self.state().name(), self.pid(), self.version())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parts_of_a_word_read_back() {
        let word = OwnerWord::new(WorkerState::Attached, 4_194_303, 12_345);
        assert_eq!(word.state(), WorkerState::Attached);
        assert_eq!(word.pid(), 4_194_303);
        assert_eq!(word.version(), 12_345);
        assert_eq!(OwnerWord::from_raw(word.to_raw()), word);
        assert_eq!(OwnerWord::ZERO.state(), WorkerState::Empty);
    }

    #[test]
    fn a_successor_never_equals_its_predecessor_even_when_the_version_wraps() {
        let last = OwnerWord::new(WorkerState::Attached, 7, u32::MAX);
        let next = last.successor(WorkerState::Attached, 7);
        assert_ne!(next, last);
        assert_eq!(next.version(), 0);
        assert_eq!(next.pid(), 7);
    }

    #[test]
    fn state_codes_this_layout_does_not_know_are_unknown() {
        let raw = 9u64 << STATE_SHIFT | 42;
        assert_eq!(OwnerWord::from_raw(raw).state(), WorkerState::Unknown(9));
        assert_eq!(OwnerWord::from_raw(u64::MAX).state(), WorkerState::Unknown(15));
    }
}
