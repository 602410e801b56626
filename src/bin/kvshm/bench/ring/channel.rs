//! The shared-memory object both benchmark processes map: two doorbells and two rings.
//!
//! ```text
//! offset   0  doorbell rung after publishing commands
//! offset  64  doorbell rung after publishing completions
//! offset 128  command ring: CommandSlot x COMMAND_CAPACITY (driver -> peer)
//! then        completion ring: Completion x COMPLETION_CAPACITY (peer -> driver)
//! ```
//!
//! The command headers carry the benchmark phase in their `generation` field, so that the peer
//! knows how to wait for the next command and what to answer. A round-trip answer carries the
//! CPU the peer answered from in `error` and the peer's futex sleeps so far in `detail`.

use anyhow::Context;
use kvshm_ipc::doorbell::Doorbell;
use kvshm_ipc::record::{CommandSlot, Completion};
use kvshm_ipc::ring::{self, Consumer, Producer};
use kvshm_ipc::shm::SharedMemory;

pub const COMMAND_CAPACITY: usize = 1024;
pub const COMPLETION_CAPACITY: usize = 1024;

/// Phases, carried in `CommandHeader::generation`.
pub const PHASE_BUSY: u64 = 1;
/// Both sides spin for kvshm's default spin budget, then sleep.
pub const PHASE_FUTEX: u64 = 2;
/// Both sides sleep on the futex at once.
pub const PHASE_SLEEP: u64 = 6;
/// A record of the one-way stream; the peer answers none of them.
pub const PHASE_STREAM: u64 = 3;
/// Ends the stream: the peer answers with the number of stream records it saw in `detail`.
pub const PHASE_STREAM_END: u64 = 4;
/// The ring phases are over: the peer moves on to the pipe round trips.
pub const PHASE_EXIT: u64 = 5;

const COMMANDS_BELL: usize = 0;
const COMPLETIONS_BELL: usize = 64;
const COMMANDS: usize = 128;

fn completions_offset() -> usize {
    COMMANDS + ring::memory_size::<CommandSlot>(COMMAND_CAPACITY)
}

/// Bytes of the shared object.
pub fn object_len() -> usize {
    completions_offset() + ring::memory_size::<Completion>(COMPLETION_CAPACITY)
}

/// One process's mapping of the object.
pub struct Channel {
    memory: SharedMemory,
}

impl Channel {
    /// Creates the object and initialises both rings (the doorbells are zeroed memory, i.e. idle).
    pub fn create(object: &str) -> anyhow::Result<Self> {
        let memory = SharedMemory::create(object, object_len())
            .with_context(|| format!("creating shared-memory object {object}"))?;
        let channel = Self { memory };
        // SAFETY: 1. the ring offsets are multiples of 64 from a page-aligned mapping and each ring
        // fits before the next part (object_len()); 2. nobody has attached yet.
        unsafe {
            ring::init::<CommandSlot>(channel.at(COMMANDS), COMMAND_CAPACITY);
            ring::init::<Completion>(channel.at(completions_offset()), COMPLETION_CAPACITY);
        }
        Ok(channel)
    }

    /// Maps an object the driver created.
    pub fn open(object: &str) -> anyhow::Result<Self> {
        let memory = SharedMemory::open(object)
            .with_context(|| format!("opening shared-memory object {object}"))?;
        anyhow::ensure!(
            memory.len() >= object_len(),
            "shared-memory object {object} is {} bytes, expected {}",
            memory.len(),
            object_len()
        );
        Ok(Self { memory })
    }

    fn at(&self, offset: usize) -> *mut u8 {
        debug_assert!(offset < object_len());
        // SAFETY: offset < object_len() <= the mapping's length (checked at create/open).
        unsafe { self.memory.as_ptr().add(offset) }
    }

    fn doorbell(&self, offset: usize) -> &Doorbell {
        // SAFETY: 1. the doorbell lies inside the mapping, 64-byte aligned; 2. a Doorbell is a
        // SharedArea: atomics only, byte for byte, and any bits are a valid doorbell, so the
        // reference stays sound while the peer process writes it; 3. the reference does not
        // outlive `self`, which keeps the mapping.
        unsafe { &*self.at(offset).cast::<Doorbell>() }
    }

    pub fn commands_bell(&self) -> &Doorbell {
        self.doorbell(COMMANDS_BELL)
    }

    pub fn completions_bell(&self) -> &Doorbell {
        self.doorbell(COMPLETIONS_BELL)
    }

    /// The producing side of the command ring; the driver holds the only one.
    pub fn command_producer(&self) -> anyhow::Result<Producer<CommandSlot>> {
        // SAFETY: the ring lies inside the mapping, which outlives the producer (the benchmark
        // drops its sides before the channel); one producer per ring by construction (the peer
        // process, our own benchmark child, keeps the ring protocol: a trusted peer).
        unsafe { Producer::attach(self.at(COMMANDS), completions_offset() - COMMANDS) }
            .context("attaching the command ring")
    }

    /// The consuming side of the command ring; the peer holds the only one.
    pub fn command_consumer(&self) -> anyhow::Result<Consumer<CommandSlot>> {
        // SAFETY: as in command_producer, for the one consumer.
        unsafe { Consumer::attach(self.at(COMMANDS), completions_offset() - COMMANDS) }
            .context("attaching the command ring")
    }

    /// The producing side of the completion ring; the peer holds the only one.
    pub fn completion_producer(&self) -> anyhow::Result<Producer<Completion>> {
        let len = object_len() - completions_offset();
        // SAFETY: as in command_producer, for the completion ring.
        unsafe { Producer::attach(self.at(completions_offset()), len) }
            .context("attaching the completion ring")
    }

    /// The consuming side of the completion ring; the driver holds the only one.
    pub fn completion_consumer(&self) -> anyhow::Result<Consumer<Completion>> {
        let len = object_len() - completions_offset();
        // SAFETY: as in command_producer, for the completion ring.
        unsafe { Consumer::attach(self.at(completions_offset()), len) }
            .context("attaching the completion ring")
    }
}
