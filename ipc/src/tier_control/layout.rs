//! The bytes of a tier's control object: its header, and where its areas lie.
//!
//! ```text
//! offset   0  TierHeader: TierHeaderFields (magic, version, sizes, creator at 72, offsets),
//!             then the ready word (Release-published last by the creator)
//! offset 128  owner doorbell: every client rings it after a call, the owner waits on it
//! offset 192  client slots: one WorkerSlot (64 bytes) per client
//! then        the tier's identity, `identity_capacity` bytes (its length in the header)
//! ```
//!
//! The creator's identity sits at the offset a segment's does (72), so that `listing` and a
//! creator meeting the name judge both kinds of control object by the same word.

use bytemuck::{Pod, Zeroable};

use crate::doorbell::Doorbell;
use crate::layout::HeaderFields;
use crate::liveness::ProcessIdentity;
use crate::sync::AtomicU32;
use crate::worker_slot::WorkerSlot;

/// "KVSHTIER": a shared tier's control object of this layout.
pub const TIER_MAGIC: u64 = u64::from_le_bytes(*b"KVSHTIER");
/// Bumped whenever a field or an area moves.
pub const TIER_LAYOUT_VERSION: u32 = 1;
/// The most client slots a tier may have.
pub const MAX_TIER_CLIENTS: u32 = 256;
/// The largest identity a tier may keep.
pub const MAX_IDENTITY_BYTES: u32 = 4096;
/// The ready word's value once the creator initialised everything.
pub const TIER_READY: u32 = 0x5449_4552;

/// What a tier's control object is created with, checked again by every attacher.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct TierConfig {
    /// Client slots.
    pub clients: u32,
    /// Bytes reserved for the tier's identity.
    pub identity_capacity: u32,
}

/// Why a tier configuration is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TierConfigError {
    #[error("{clients} client slots; a tier has 1 to {MAX_TIER_CLIENTS}")]
    Clients { clients: u32 },
    #[error("an identity of {bytes} bytes; a tier keeps at most {MAX_IDENTITY_BYTES}")]
    IdentityTooLong { bytes: u32 },
}

impl TierConfig {
    pub fn validate(&self) -> Result<(), TierConfigError> {
        if self.clients == 0 || self.clients > MAX_TIER_CLIENTS {
            return Err(TierConfigError::Clients { clients: self.clients });
        }
        if self.identity_capacity > MAX_IDENTITY_BYTES {
            return Err(TierConfigError::IdentityTooLong { bytes: self.identity_capacity });
        }
        Ok(())
    }
}

/// Where the areas lie, from the start of the object.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct TierOffsets {
    pub owner_bell: u64,
    pub client_slots: u64,
    pub identity: u64,
}

/// The header words that never change after creation; attachers copy them out and check them.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct TierHeaderFields {
    pub magic: u64,
    pub layout_version: u32,
    pub identity_len: u32,
    pub total_size: u64,
    pub config: TierConfig,
    pub reserved: [u64; 5],
    /// The owner process (written first at creation, at a segment's creator offset).
    pub creator: ProcessIdentity,
    pub offsets: TierOffsets,
}

const _: () = assert!(size_of::<TierHeaderFields>() == 112);
const _: () = assert!(
    std::mem::offset_of!(TierHeaderFields, creator) == std::mem::offset_of!(HeaderFields, creator)
);
const _: () = assert!(
    std::mem::offset_of!(TierHeaderFields, magic) == std::mem::offset_of!(HeaderFields, magic)
);

/// The header as it lies at offset 0.
#[repr(C, align(64))]
pub struct TierHeader {
    pub fields: TierHeaderFields,
    /// [`TIER_READY`] once initialised; stored last, with Release.
    pub ready: AtomicU32,
    _reserved: [u32; 3],
}

const _: () = assert!(size_of::<TierHeader>() == 128);
pub(crate) const READY_OFFSET: usize = std::mem::offset_of!(TierHeader, ready);

/// Where everything lies, derived from a configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierLayout {
    pub offsets: TierOffsets,
    /// Bytes of the whole object (a multiple of the page size).
    pub total_size: usize,
}

impl TierLayout {
    /// The layout of a valid `config`.
    pub fn compute(config: &TierConfig) -> Result<TierLayout, TierConfigError> {
        config.validate()?;
        let owner_bell = size_of::<TierHeader>();
        let client_slots = owner_bell + size_of::<Doorbell>();
        let identity = client_slots + config.clients as usize * size_of::<WorkerSlot>();
        let end = identity + config.identity_capacity as usize;
        Ok(TierLayout {
            offsets: TierOffsets {
                owner_bell: owner_bell as u64,
                client_slots: client_slots as u64,
                identity: identity as u64,
            },
            total_size: end.next_multiple_of(4096),
        })
    }

    /// The largest object any valid configuration makes.
    pub fn largest() -> usize {
        let config =
            TierConfig { clients: MAX_TIER_CLIENTS, identity_capacity: MAX_IDENTITY_BYTES };
        TierLayout::compute(&config).expect("the largest configuration is valid").total_size
    }
}
