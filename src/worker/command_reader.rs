//! Turning the slots of a rank's command ring back into whole commands.
//!
//! Core types: [`CommandReader`] (a carry-over buffer of popped slots) and [`ReadError`] (the ring
//! cannot be read or is out of step with the producer).
//!
//! The producer publishes every command (its header slot and all its pair slots) with one Release
//! store, but the worker pops in batches of at most `max_batch` slots, so a batch may end in the
//! middle of a command. Reading one batch:
//!
//! 1. [`CommandReader::fill`] pops up to `max_batch` slots behind what is still buffered;
//! 2. [`CommandReader::next_command`] decodes the command at the front of the buffer
//!    (`record::decode_command`), appending its pairs to the caller's vector;
//! 3. if the buffer ends inside that command, the reader pops exactly the missing slots at once:
//!    they were published together with the header, so they must be in the ring. If they are not,
//!    the ring is out of step (a producer bug or corruption) and the reader reports
//!    [`ReadError::MissingPairSlots`] with the header, so that the worker can answer that command
//!    before it stops;
//! 4. a slot in header position without the command tag is [`ReadError::NotAHeader`]: nothing
//!    tells which command it belonged to, so nothing can be answered.
//!
//! After either error the reader's position in the ring means nothing; the worker must stop.

use kvshm_ipc::record::{
    command_slot_count, decode_command, BlockPair, CommandHeader, CommandSlot, DecodeError,
};
use kvshm_ipc::ring::{Consumer, RingError};

/// Why the command ring cannot be read any further.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    #[error("command ring: {0}")]
    Ring(#[from] RingError),
    #[error("command ring is out of step: a slot in header position has tag {found:#x}")]
    NotAHeader { found: u32 },
    #[error(
        "command ring is out of step: command {} announces {} pairs ({needed} slots with its \
         header) but only {available} slots were published",
        header.command_id, header.pair_count
    )]
    MissingPairSlots { header: CommandHeader, needed: usize, available: usize },
}

/// Decodes commands from a ring, keeping the slots of a command split across pops.
#[derive(Debug)]
pub struct CommandReader {
    /// Popped slots; `buffer[start..]` are not decoded yet.
    buffer: Vec<CommandSlot>,
    start: usize,
    max_batch: usize,
}

impl CommandReader {
    /// A reader popping at most `max_batch` slots per [`fill`](Self::fill) (at least one).
    pub fn new(max_batch: usize) -> CommandReader {
        let max_batch = max_batch.max(1);
        CommandReader { buffer: Vec::with_capacity(max_batch), start: 0, max_batch }
    }

    /// Slots popped but not yet decoded.
    pub fn buffered(&self) -> usize {
        self.buffer.len() - self.start
    }

    /// Pops up to `max_batch` more slots; returns whether any slot is buffered afterwards.
    ///
    /// # Errors
    ///
    /// [`ReadError::Ring`] when the ring's indices are corrupt.
    pub fn fill(&mut self, ring: &mut Consumer<CommandSlot>) -> Result<bool, ReadError> {
        self.compact();
        ring.pop_into(&mut self.buffer, self.max_batch)?;
        Ok(self.buffered() > 0)
    }

    /// Decodes the next buffered command, appending its pairs to `pairs` (which it clears first).
    /// Returns `None` when every buffered slot has been decoded.
    ///
    /// # Errors
    ///
    /// See the module documentation: the ring is corrupt or out of step with the producer.
    pub fn next_command(
        &mut self,
        ring: &mut Consumer<CommandSlot>,
        pairs: &mut Vec<BlockPair>,
    ) -> Result<Option<CommandHeader>, ReadError> {
        pairs.clear();
        if self.buffered() == 0 {
            return Ok(None);
        }
        match decode_command(&self.buffer[self.start..], pairs) {
            Ok((header, used)) => {
                self.start += used;
                Ok(Some(header))
            }
            Err(DecodeError::NotAHeader { found }) => Err(ReadError::NotAHeader { found }),
            Err(DecodeError::MissingPairSlots { .. }) => self.complete_split_command(ring, pairs),
        }
    }

    /// Step 3 of the module documentation: the buffer ends inside the command at its front.
    fn complete_split_command(
        &mut self,
        ring: &mut Consumer<CommandSlot>,
        pairs: &mut Vec<BlockPair>,
    ) -> Result<Option<CommandHeader>, ReadError> {
        self.compact();
        let header = self.buffer[0].header();
        let needed = command_slot_count(header.pair_count as usize);
        // Never more than the ring holds: a command longer than that cannot have been published
        // whole, and pop_into() returns at most what is published anyway.
        let missing = (needed - self.buffer.len()).min(ring.capacity());
        ring.pop_into(&mut self.buffer, missing)?;
        pairs.clear();
        match decode_command(&self.buffer, pairs) {
            Ok((header, used)) => {
                self.start = used;
                Ok(Some(header))
            }
            Err(DecodeError::NotAHeader { found }) => Err(ReadError::NotAHeader { found }),
            Err(DecodeError::MissingPairSlots { .. }) => {
                Err(ReadError::MissingPairSlots { header, needed, available: self.buffer.len() })
            }
        }
    }

    /// Moves the undecoded slots to the front of the buffer.
    fn compact(&mut self) {
        self.buffer.drain(..self.start);
        self.start = 0;
    }
}

#[cfg(test)]
mod tests {
    use kvshm_ipc::record::{encode_command, Op, PAIRS_PER_SLOT};
    use kvshm_ipc::ring::{heap, Producer};

    use super::*;

    fn push_command(producer: &mut Producer<CommandSlot>, id: u64, pairs: usize) {
        let pairs: Vec<BlockPair> =
            (0..pairs as u32).map(|i| BlockPair::new(i, 1000 + i)).collect();
        let header = CommandHeader::new(Op::CopyDeviceToHost, id, 1, pairs.len() as u32);
        let mut slots = Vec::new();
        encode_command(&header, &pairs, &mut slots);
        producer.push_all(&slots).unwrap();
    }

    fn read_all(
        reader: &mut CommandReader,
        consumer: &mut Consumer<CommandSlot>,
    ) -> Result<Vec<(u64, usize)>, ReadError> {
        let mut seen = Vec::new();
        let mut pairs = Vec::new();
        while reader.fill(consumer)? {
            while let Some(header) = reader.next_command(consumer, &mut pairs)? {
                assert_eq!(pairs.len(), header.pair_count as usize);
                assert!(pairs.iter().enumerate().all(|(i, p)| p.dst == 1000 + i as u32));
                seen.push((header.command_id, pairs.len()));
            }
        }
        Ok(seen)
    }

    #[test]
    fn commands_split_across_pops_are_decoded_whole() {
        let (mut producer, mut consumer) = heap::<CommandSlot>(64);
        // 3 slots, 1 slot, 4 slots, 2 slots: batches of 2 split the first and third commands.
        for (id, pairs) in [(1, 2 * PAIRS_PER_SLOT), (2, 0), (3, 3 * PAIRS_PER_SLOT - 1), (4, 1)] {
            push_command(&mut producer, id, pairs);
        }
        let mut reader = CommandReader::new(2);
        let seen = read_all(&mut reader, &mut consumer).unwrap();
        assert_eq!(seen, vec![(1, 16), (2, 0), (3, 23), (4, 1)]);
        assert_eq!(reader.buffered(), 0);
    }

    #[test]
    fn a_header_whose_pair_slots_were_never_published_is_reported_with_the_header() {
        let (mut producer, mut consumer) = heap::<CommandSlot>(16);
        push_command(&mut producer, 1, 1);
        let liar = CommandHeader::new(Op::CopyHostToDevice, 2, 1, 3 * PAIRS_PER_SLOT as u32);
        producer.push_all(&[CommandSlot::from_header(&liar), CommandSlot::default()]).unwrap();
        let mut reader = CommandReader::new(8);
        let mut pairs = Vec::new();
        assert!(reader.fill(&mut consumer).unwrap());
        assert_eq!(reader.next_command(&mut consumer, &mut pairs).unwrap().unwrap().command_id, 1);
        assert_eq!(
            reader.next_command(&mut consumer, &mut pairs),
            Err(ReadError::MissingPairSlots { header: liar, needed: 4, available: 2 })
        );
    }

    #[test]
    fn a_pair_slot_in_header_position_is_out_of_step() {
        let (mut producer, mut consumer) = heap::<CommandSlot>(8);
        let mut stray = CommandSlot::default();
        stray.words[0] = 0x1234;
        producer.push(stray).unwrap();
        let mut reader = CommandReader::new(8);
        assert_eq!(
            read_all(&mut reader, &mut consumer),
            Err(ReadError::NotAHeader { found: 0x1234 })
        );
    }

    #[test]
    fn an_absurd_pair_count_is_out_of_step_without_popping_past_the_ring() {
        let (mut producer, mut consumer) = heap::<CommandSlot>(4);
        let header = CommandHeader::new(Op::CopyHostToDevice, 9, 1, u32::MAX);
        producer.push_all(&[CommandSlot::from_header(&header); 2]).unwrap();
        let mut reader = CommandReader::new(1);
        let mut pairs = Vec::new();
        assert!(reader.fill(&mut consumer).unwrap());
        let error = reader.next_command(&mut consumer, &mut pairs).unwrap_err();
        assert!(matches!(error, ReadError::MissingPairSlots { available: 2, .. }));
    }
}
