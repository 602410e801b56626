//! [`KeyTable`]: which engine key each chunk of a persistent host tier holds, kept in the tier's
//! own shared memory, so that a manager started after its engine stopped or died finds the
//! tier's blocks again (a warm restart); [`read_tier_keys`] reads them from another process.
//!
//! The table lies in blocks past the tier's chunks, in the same arena, so data and table live
//! and die together: `[header: 64 bytes][slot 0][slot 1]...`, one [`SLOT_BYTES`] slot per chunk.
//! The header is `magic u64 | version u32 | slot bytes u32 | chunks u32 | 0 u32 | fingerprint
//! u64 | next seq u64 | epoch u32 | 0...`, a slot `state u32 | key_len u32 | seq u64 |
//! parent_chunk u32 | epoch u32 | parent_seq u64 | key [u8; 64]`, little-endian; `seq` orders
//! the stores (older first) and `(parent_chunk, parent_seq)` names the slot of the key the
//! engine chained it under.
//!
//! The protocol, on the process that copies ([`super::HostTier`]):
//! 1. before a store writes a chunk, its slot's state is cleared;
//! 2. after the copy succeeded, the slot is written, its state last.
//!
//! A process killed anywhere in between leaves a chunk whose slot is empty (a miss after the
//! restart) or whose slot names the key whose bytes the chunk holds whole, never a key over
//! other bytes. The header digests the tier's shape and the page's format
//! ([`EngineLayout::page_format`]); a table of another shape or format is cleared.
//!
//! A reset of the engine's manager (new weights under the same model name, say) makes every key
//! stored before it stale. The manager, in its own process, raises the header's epoch
//! ([`TableEpoch`]); each store carries the epoch its manager was in when it chose the
//! store, and its slot records it. Only slots of the header's epoch are read back, so a store
//! chosen before the reset stays stale even when its copy lands after it. The worker's process
//! never writes the epoch of a table it keeps.

use std::sync::atomic::{fence, Ordering};

use kvshm_ipc::arena::{Arena, ArenaError, ArenaKind};
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::segment::Segment;

use super::host_tier::HostTierError;
use super::key::{OffloadKey, MAX_KEY_BYTES};
use super::transfer::EngineLayout;

/// "KVSHMKEY", little-endian.
pub const TABLE_MAGIC: u64 = u64::from_le_bytes(*b"KVSHMKEY");
pub const TABLE_VERSION: u32 = 1;
pub const HEADER_BYTES: usize = 64;
pub const SLOT_BYTES: usize = 32 + MAX_KEY_BYTES;
const VALID: u32 = 1;
/// Byte offsets in the header of the next seq (written now and then by the copying process) and
/// of the epoch (written by the manager's).
const NEXT_SEQ_AT: usize = 32;
const EPOCH_AT: usize = 40;
/// `parent_chunk` of a key stored without a parent.
pub const NO_PARENT: u32 = u32::MAX;

/// One chunk's key, as read from a table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableEntry {
    pub chunk: u32,
    pub key: OffloadKey,
    pub seq: u64,
    /// The manager's epoch when it chose the store (module documentation).
    pub epoch: u32,
    /// The parent's chunk and the seq its slot had when this key was written.
    pub parent: Option<(u32, u64)>,
}

/// The table of one persistent host tier (module doc).
#[derive(Debug)]
pub struct KeyTable {
    /// Byte offset of the header in the arena's data.
    offset: usize,
    chunks: u32,
    fingerprint: u64,
    next_seq: u64,
}

impl KeyTable {
    /// Bytes of the table of `chunks` chunks.
    pub fn bytes(chunks: u32) -> u64 {
        HEADER_BYTES as u64 + u64::from(chunks) * SLOT_BYTES as u64
    }

    /// Host blocks of `block_bytes` the table of `chunks` chunks takes.
    pub fn blocks(chunks: u32, block_bytes: u64) -> u64 {
        KeyTable::bytes(chunks).div_ceil(block_bytes.max(1))
    }

    /// The byte offset of the table in a host arena whose chunks are `layout`'s.
    pub fn offset(layout: &EngineLayout) -> u64 {
        u64::from(layout.chunks) * u64::from(layout.blocks_per_chunk) * layout.host_block_bytes()
    }

    /// A digest of what makes a chunk's bytes readable: the tier's shape and the page's format.
    fn fingerprint(layout: &EngineLayout) -> u64 {
        let mut words = vec![
            layout.page_bytes,
            u64::from(layout.tensors),
            u64::from(layout.chunks),
            u64::from(layout.blocks_per_chunk),
        ];
        for group in &layout.groups {
            words.push(u64::MAX);
            words.extend(group.iter().map(|&tensor| u64::from(tensor)));
        }
        let mut bytes: Vec<u8> = words.iter().flat_map(|word| word.to_le_bytes()).collect();
        // After the words, so that a tier of no named format keeps the digest it always had.
        bytes.extend_from_slice(layout.page_format.as_bytes());
        xxhash_rust::xxh3::xxh3_64(&bytes)
    }

    /// The table of `layout`'s tier in `arena`: the one found there if its header matches
    /// (`kept`: the arena outlived its last engine), else a cleared one. Returns it and whether
    /// the table found was kept.
    pub fn open(
        arena: &Arena,
        layout: &EngineLayout,
        kept: bool,
    ) -> Result<(KeyTable, bool), ArenaError> {
        let offset = KeyTable::offset(layout) as usize;
        KeyTable::open_at(arena, offset, layout.chunks, KeyTable::fingerprint(layout), kept)
    }

    /// The table of `chunks` chunks at byte `offset` of `arena`'s data, for a tier whose shape
    /// digests to `fingerprint`: the one found there if its header matches (and `kept`), else a
    /// cleared one; and whether the table found was kept.
    pub fn open_at(
        arena: &Arena,
        offset: usize,
        chunks: u32,
        fingerprint: u64,
        kept: bool,
    ) -> Result<(KeyTable, bool), ArenaError> {
        let mut table = KeyTable { offset, chunks, fingerprint, next_seq: 1 };
        if kept {
            let mut header = [0u8; HEADER_BYTES];
            arena.read_data(table.offset, &mut header)?;
            let word = |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().expect("8"));
            let half = |at: usize| u32::from_le_bytes(header[at..at + 4].try_into().expect("4"));
            if word(0) == TABLE_MAGIC
                && half(8) == TABLE_VERSION
                && half(12) == SLOT_BYTES as u32
                && half(16) == chunks
                && word(24) == table.fingerprint
            {
                table.next_seq = word(NEXT_SEQ_AT).max(1);
                // The next seq is stored only now and then: continue past every slot's, of
                // every epoch.
                for entry in decode_slots(arena, table.offset, chunks)? {
                    table.next_seq = table.next_seq.max(entry.seq.saturating_add(1));
                }
                return Ok((table, true));
            }
        }
        let empty = vec![0u8; SLOT_BYTES * 1024];
        let mut slot = 0usize;
        while slot < chunks as usize {
            let count = (chunks as usize - slot).min(1024);
            arena.write_data(table.slot_offset(slot as u32), &empty[..count * SLOT_BYTES])?;
            slot += count;
        }
        table.write_header(arena)?;
        Ok((table, false))
    }

    fn slot_offset(&self, chunk: u32) -> usize {
        self.offset + HEADER_BYTES + chunk as usize * SLOT_BYTES
    }

    fn write_header(&self, arena: &Arena) -> Result<(), ArenaError> {
        let mut header = [0u8; HEADER_BYTES];
        header[0..8].copy_from_slice(&TABLE_MAGIC.to_le_bytes());
        header[8..12].copy_from_slice(&TABLE_VERSION.to_le_bytes());
        header[12..16].copy_from_slice(&(SLOT_BYTES as u32).to_le_bytes());
        header[16..20].copy_from_slice(&self.chunks.to_le_bytes());
        header[24..32].copy_from_slice(&self.fingerprint.to_le_bytes());
        header[NEXT_SEQ_AT..NEXT_SEQ_AT + 8].copy_from_slice(&self.next_seq.to_le_bytes());
        arena.write_data(self.offset, &header)
    }

    /// Step 1: `chunk` is about to be overwritten; its slot no longer names a key.
    pub fn clear(&self, arena: &Arena, chunk: u32) -> Result<(), ArenaError> {
        arena.write_data(self.slot_offset(chunk), &0u32.to_le_bytes())?;
        // The cleared state is stored before any byte of the chunk's copy.
        fence(Ordering::SeqCst);
        Ok(())
    }

    /// Step 2: `chunk` holds `key`'s bytes, chained under the key in `parent_chunk`
    /// ([`NO_PARENT`] for none), stored by a manager in `epoch`.
    pub fn write(
        &mut self,
        arena: &Arena,
        chunk: u32,
        key: &OffloadKey,
        parent_chunk: u32,
        epoch: u32,
    ) -> Result<(), ArenaError> {
        let parent_seq = match parent_chunk {
            NO_PARENT => 0,
            parent if parent < self.chunks => self.read_slot(arena, parent)?.map_or(0, |e| e.seq),
            _ => 0,
        };
        let seq = self.next_seq;
        self.next_seq = self.next_seq.saturating_add(1);
        let mut slot = [0u8; SLOT_BYTES];
        slot[4..8].copy_from_slice(&(key.as_bytes().len() as u32).to_le_bytes());
        slot[8..16].copy_from_slice(&seq.to_le_bytes());
        let parent_chunk = if parent_seq == 0 { NO_PARENT } else { parent_chunk };
        slot[16..20].copy_from_slice(&parent_chunk.to_le_bytes());
        slot[20..24].copy_from_slice(&epoch.to_le_bytes());
        slot[24..32].copy_from_slice(&parent_seq.to_le_bytes());
        slot[32..32 + key.as_bytes().len()].copy_from_slice(key.as_bytes());
        let at = self.slot_offset(chunk);
        // Fence: the chunk's bytes are stored before the slot says they are there.
        fence(Ordering::SeqCst);
        arena.write_data(at + 4, &slot[4..])?;
        fence(Ordering::SeqCst);
        arena.write_data(at, &VALID.to_le_bytes())?;
        if seq % 1024 == 0 {
            // The next seq alone: the header's epoch is the manager's to write.
            arena.write_data(self.offset + NEXT_SEQ_AT, &self.next_seq.to_le_bytes())?;
        }
        Ok(())
    }

    fn read_slot(&self, arena: &Arena, chunk: u32) -> Result<Option<TableEntry>, ArenaError> {
        let mut slot = [0u8; SLOT_BYTES];
        arena.read_data(self.slot_offset(chunk), &mut slot)?;
        Ok(decode(chunk, &slot))
    }

    /// Every chunk whose slot names a key.
    pub fn entries(&self, arena: &Arena) -> Result<Vec<TableEntry>, ArenaError> {
        read_entries(arena, self.offset, self.chunks)
    }
}

/// The entries of the table at byte `offset` of `arena`, a tier of `chunks` chunks, of the
/// header's epoch (module documentation); nothing if no table of that many chunks is there.
pub fn read_entries(
    arena: &Arena,
    offset: usize,
    chunks: u32,
) -> Result<Vec<TableEntry>, ArenaError> {
    let Some(epoch) = read_epoch(arena, offset, chunks)? else { return Ok(Vec::new()) };
    let mut entries = decode_slots(arena, offset, chunks)?;
    entries.retain(|entry| entry.epoch == epoch);
    Ok(entries)
}

/// Every slot of the table at byte `offset` of `arena` that names a key, whatever its epoch.
fn decode_slots(arena: &Arena, offset: usize, chunks: u32) -> Result<Vec<TableEntry>, ArenaError> {
    let mut bytes = vec![0u8; chunks as usize * SLOT_BYTES];
    arena.read_data(offset + HEADER_BYTES, &mut bytes)?;
    Ok((0u32..)
        .zip(bytes.chunks_exact(SLOT_BYTES))
        .filter_map(|(chunk, slot)| decode(chunk, slot))
        .collect())
}

/// The epoch in the header of the table at byte `offset` of `arena`; `None` if no table of
/// `chunks` chunks is there.
fn read_epoch(arena: &Arena, offset: usize, chunks: u32) -> Result<Option<u32>, ArenaError> {
    let mut header = [0u8; HEADER_BYTES];
    arena.read_data(offset, &mut header)?;
    let magic = u64::from_le_bytes(header[0..8].try_into().expect("8 bytes"));
    let table_chunks = u32::from_le_bytes(header[16..20].try_into().expect("4 bytes"));
    if magic != TABLE_MAGIC || table_chunks != chunks {
        return Ok(None);
    }
    Ok(Some(u32::from_le_bytes(header[EPOCH_AT..EPOCH_AT + 4].try_into().expect("4 bytes"))))
}

fn decode(chunk: u32, slot: &[u8]) -> Option<TableEntry> {
    let half = |at: usize| u32::from_le_bytes(slot[at..at + 4].try_into().expect("4 bytes"));
    let word = |at: usize| u64::from_le_bytes(slot[at..at + 8].try_into().expect("8 bytes"));
    if half(0) != VALID {
        return None;
    }
    let len = half(4) as usize;
    let key = OffloadKey::new(slot.get(32..32 + len)?).ok()?;
    let parent = match (half(16), word(24)) {
        (NO_PARENT, _) | (_, 0) => None,
        (parent, seq) => Some((parent, seq)),
    };
    Some(TableEntry { chunk, key, seq: word(8), epoch: half(20), parent })
}

/// The keys a persistent tier `name` of `chunks` chunks of `blocks_per_chunk` blocks holds, read
/// from its key table (for the engine's manager, in another process, after the tier was made):
/// empty when the segment has no such table.
pub fn read_tier_keys(
    name: &SegmentName,
    chunks: u32,
    blocks_per_chunk: u32,
) -> Result<Vec<TableEntry>, HostTierError> {
    let segment = Segment::attach(name)?;
    let Some((host, offset)) = find_table(&segment, chunks, blocks_per_chunk)? else {
        return Ok(Vec::new());
    };
    Ok(read_entries(&host, offset, chunks)?)
}

/// The epoch of a persistent tier's key table, opened by the engine's manager in its own
/// process: it reads the epoch at start and raises it at each reset (module documentation).
#[derive(Debug)]
pub struct TableEpoch {
    host: Arena,
    offset: usize,
}

impl TableEpoch {
    /// The table in `segment`'s host tier of `chunks` chunks of `blocks_per_chunk` blocks, and
    /// its epoch now; `None` when the tier has no such table (it is not persistent).
    pub fn open(
        segment: &Segment,
        chunks: u32,
        blocks_per_chunk: u32,
    ) -> Result<Option<(TableEpoch, u32)>, HostTierError> {
        let Some((host, offset)) = find_table(segment, chunks, blocks_per_chunk)? else {
            return Ok(None);
        };
        let Some(epoch) = read_epoch(&host, offset, chunks)? else { return Ok(None) };
        Ok(Some((TableEpoch { host, offset }, epoch)))
    }

    /// From now on only the slots of stores chosen in `epoch` are read back. It cannot fail:
    /// [`TableEpoch::open`] found the header inside the arena, which keeps its size.
    pub fn set(&self, epoch: u32) {
        let written = self.host.write_data(self.offset + EPOCH_AT, &epoch.to_le_bytes());
        debug_assert!(written.is_ok(), "the header was inside the arena when opened: {written:?}");
    }
}

/// The host arena of `segment` and the byte offset of its key table, for a tier of `chunks`
/// chunks of `blocks_per_chunk` blocks; `None` when the arena has no room for such a table past
/// its chunks.
fn find_table(
    segment: &Segment,
    chunks: u32,
    blocks_per_chunk: u32,
) -> Result<Option<(Arena, usize)>, HostTierError> {
    let host = segment.open_arena(ArenaKind::Host, 0)?;
    let offset = u64::from(chunks) * u64::from(blocks_per_chunk) * host.block_bytes();
    let table_end = offset + KeyTable::bytes(chunks);
    if table_end > host.data_len() as u64 {
        return Ok(None);
    }
    Ok(Some((host, offset as usize)))
}
