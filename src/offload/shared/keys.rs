//! [`TierKeys`]: which key each chunk of a shared tier holds, kept by the tier's owner in an
//! object of its own (`/kvshm.NAME.keys.0`, a [`KeyTable`]), so that an owner taking over the
//! arenas of one that died takes their keys back too (DESIGN §12.4).
//!
//! The index keeps it in the steps that change what a chunk holds ([`super::SharedTierIndex`]):
//! 1. a chunk handed to a store has its slot cleared before the client is answered;
//! 2. a store its client completed with success has its slot written: the client reports
//!    success once its copy is done;
//! 3. an owner that takes over the tier's arenas reads the table and restores each key it
//!    names, oldest first, under its parent.
//!
//! So a slot names a key only over bytes its chunk holds whole: a chunk that a client of the
//! dead owner may still be writing was cleared at step 1, and is free in the new index (the new
//! owner's store grace keeps it from another store meanwhile).

use kvshm_ipc::arena::{Arena, ArenaError, ArenaKind};
use kvshm_ipc::name::SegmentName;

use super::TierIdentity;
use crate::offload::key::OffloadKey;
use crate::offload::key_table::{KeyTable, TableEntry, NO_PARENT};

/// Bytes of a block of the table's object (its size is what counts).
const TABLE_BLOCK_BYTES: u64 = 4096;

/// A shared tier's key table (module documentation).
#[derive(Debug)]
pub struct TierKeys {
    arena: Arena,
    table: KeyTable,
}

impl TierKeys {
    /// The key table of tier `name`, `chunks` chunks of `identity`'s blocks: with `take_over`,
    /// the one a previous owner left if it is of this tier's shape, and the entries it holds;
    /// otherwise (or if there is none) a cleared one, and no entries.
    ///
    /// # Errors
    /// When the object cannot be read or made (a full `/dev/shm`).
    pub fn open(
        name: &SegmentName,
        identity: &TierIdentity,
        chunks: u32,
        take_over: bool,
    ) -> Result<(TierKeys, Vec<TableEntry>), ArenaError> {
        let blocks = KeyTable::blocks(chunks, TABLE_BLOCK_BYTES);
        let (arena, found) =
            match Arena::adopt(name, ArenaKind::Keys, 0, blocks, TABLE_BLOCK_BYTES)? {
                Some(arena) => (arena, true),
                None => {
                    (Arena::create(name, ArenaKind::Keys, 0, blocks, TABLE_BLOCK_BYTES)?, false)
                }
            };
        let mut words = identity.encode();
        words.extend_from_slice(&chunks.to_le_bytes());
        let fingerprint = xxhash_rust::xxh3::xxh3_64(&words);
        let (table, kept) = KeyTable::open_at(&arena, 0, chunks, fingerprint, take_over && found)?;
        let entries = if kept { table.entries(&arena)? } else { Vec::new() };
        Ok((TierKeys { arena, table }, entries))
    }

    /// Step 1: `chunk` is handed to a store.
    pub fn cleared(&self, chunk: u32) {
        if let Err(error) = self.table.clear(&self.arena, chunk) {
            tracing::error!(chunk, %error, "the key table refused a chunk of the tier");
        }
    }

    /// Step 2: `chunk` holds `key`'s bytes, chained under the key in `parent_chunk`.
    pub fn stored(&mut self, chunk: u32, key: &OffloadKey, parent_chunk: Option<u32>) {
        let parent = parent_chunk.unwrap_or(NO_PARENT);
        // Epoch 0 for good: an engine's reset leaves a shared tier, every engine's, as it is.
        if let Err(error) = self.table.write(&self.arena, chunk, key, parent, 0) {
            tracing::error!(chunk, %error, "the key table refused a chunk of the tier");
        }
    }

    /// Removes tier `name`'s key table (the tier ends).
    pub fn unlink(name: &SegmentName) {
        let _ = Arena::unlink(name, ArenaKind::Keys, 0);
    }
}
