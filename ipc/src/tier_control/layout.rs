//! The bytes of a tier's control object: its header, and where its areas lie.
//!
//! ```text
//! offset   0  TierHeader: TierHeaderFields (magic, version, sizes, creator at 72, offsets),
//!             then the ready word (Release-published last by the creator)
//! offset 192  owner doorbell: every client rings it after a batch, the owner waits on it
//! offset 256  client slots: one WorkerSlot (64 bytes) per client
//! then        client stats: one ClientStats (64 bytes) per client, written by the owner
//! then        storage stats: one StorageStats (128 bytes), the storage tier below the tier's,
//!             written by the owner (zero for a tier without one)
//! then        the tier's identity, `identity_capacity` bytes (its length in the header)
//! then        one channel per client, `channel_stride` bytes each (`channel.rs`): its request
//!             ring, its answer ring, its answer doorbell, its key page, its answer page
//! ```
//!
//! The creator's identity sits at the offset a segment's does (72), so that `listing` and a
//! creator meeting the name judge both kinds of control object by the same word.

use bytemuck::{Pod, Zeroable};

use super::record::{TierAnswer, TierRequest, WireKey};
use crate::doorbell::Doorbell;
use crate::layout::HeaderFields;
use crate::liveness::ProcessIdentity;
use crate::shm::SharedArea;
use crate::sync::{AtomicU32, AtomicU64, Ordering};
use crate::worker_slot::WorkerSlot;

/// "KVSHTIER": a shared tier's control object of this layout.
pub const TIER_MAGIC: u64 = u64::from_le_bytes(*b"KVSHTIER");
/// Bumped whenever a field or an area moves, or the records change meaning.
pub const TIER_LAYOUT_VERSION: u32 = 5;
/// The most client slots a tier may have.
pub const MAX_TIER_CLIENTS: u32 = 256;
/// The largest identity a tier may keep.
pub const MAX_IDENTITY_BYTES: u32 = 4096;
/// The most records a channel's ring may hold.
pub const MAX_RING_SLOTS: u32 = 1024;
/// The most keys a batch may carry.
pub const MAX_PAGE_KEYS: u32 = 1 << 14;
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
    /// Records each ring of a channel holds (a power of two, at least 2): a batch has at most
    /// one fewer calls.
    pub ring_slots: u32,
    /// Keys one batch may carry (its key page), and entries of its answers (its answer page
    /// holds two per key).
    pub page_keys: u32,
}

impl TierConfig {
    /// `clients` slots, 64 calls and 4096 keys a batch, a 4 KiB identity.
    pub const fn with_clients(clients: u32) -> TierConfig {
        TierConfig {
            clients,
            identity_capacity: MAX_IDENTITY_BYTES,
            ring_slots: 64,
            page_keys: 4096,
        }
    }
}

/// Why a tier configuration is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TierConfigError {
    #[error("{clients} client slots; a tier has 1 to {MAX_TIER_CLIENTS}")]
    Clients { clients: u32 },
    #[error("an identity of {bytes} bytes; a tier keeps at most {MAX_IDENTITY_BYTES}")]
    IdentityTooLong { bytes: u32 },
    #[error("rings of {slots} records; a power of two from 2 to {MAX_RING_SLOTS}")]
    RingSlots { slots: u32 },
    #[error("{keys} keys a batch; 1 to {MAX_PAGE_KEYS}")]
    PageKeys { keys: u32 },
}

impl TierConfig {
    pub fn validate(&self) -> Result<(), TierConfigError> {
        if self.clients == 0 || self.clients > MAX_TIER_CLIENTS {
            return Err(TierConfigError::Clients { clients: self.clients });
        }
        if self.identity_capacity > MAX_IDENTITY_BYTES {
            return Err(TierConfigError::IdentityTooLong { bytes: self.identity_capacity });
        }
        if !self.ring_slots.is_power_of_two() || !(2..=MAX_RING_SLOTS).contains(&self.ring_slots) {
            return Err(TierConfigError::RingSlots { slots: self.ring_slots });
        }
        if !(1..=MAX_PAGE_KEYS).contains(&self.page_keys) {
            return Err(TierConfigError::PageKeys { keys: self.page_keys });
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
    pub client_stats: u64,
    pub storage_stats: u64,
    pub identity: u64,
    /// The first client's channel; client `i`'s is `channel_stride * i` further.
    pub channels: u64,
    pub channel_stride: u64,
}

/// What the owner last published of one client, for `kvctl tier` and tests: the owner alone
/// writes it (after each batch it serves, and zeroes when it lets the client go), anyone reads
/// it. Each word is its own atomic: a reader may see one batch's chunks beside the next one's
/// pins, which a listing may show.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct ClientStats {
    /// Chunks charged to the client (the blocks it stored that are still in the tier).
    pub chunks: AtomicU32,
    /// Loads in progress (its pins).
    pub pins: AtomicU32,
    /// Stores prepared and not completed.
    pub storing: AtomicU32,
    _reserved: AtomicU32,
    /// Calls served.
    pub calls: AtomicU64,
    _tail: [AtomicU64; 5],
}

const _: () = assert!(size_of::<ClientStats>() == 64);

// SAFETY: atomics only (each its own UnsafeCell), every bit pattern a valid integer, no padding
// (asserted 64 bytes of 4 u32 and 6 u64).
unsafe impl SharedArea for ClientStats {}

/// One client's [`ClientStats`], copied out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientFigures {
    pub chunks: u32,
    pub pins: u32,
    pub storing: u32,
    pub calls: u64,
}

impl ClientStats {
    /// Owner: publishes `figures`. Relaxed: each word is a figure on its own, nothing is read
    /// behind them.
    pub fn publish(&self, figures: ClientFigures) {
        self.chunks.store(figures.chunks, Ordering::Relaxed);
        self.pins.store(figures.pins, Ordering::Relaxed);
        self.storing.store(figures.storing, Ordering::Relaxed);
        self.calls.store(figures.calls, Ordering::Relaxed);
    }

    /// The figures last published (Relaxed, as written).
    pub fn read(&self) -> ClientFigures {
        ClientFigures {
            chunks: self.chunks.load(Ordering::Relaxed),
            pins: self.pins.load(Ordering::Relaxed),
            storing: self.storing.load(Ordering::Relaxed),
            calls: self.calls.load(Ordering::Relaxed),
        }
    }
}

/// Words of figures in [`StorageStats`].
pub const STORAGE_FIGURES: usize = 15;

/// What the owner last published of the storage tier below its tier (what it holds, has in
/// flight and has done), for `kvctl tier`: [`STORAGE_FIGURES`] words whose meaning is the
/// owner's (`kvshm::offload::TierStorageStats`). The owner alone writes it (after each turn of
/// its loop), anyone reads it; `configured` stays 0 for a tier without one. Each word is its own
/// atomic, as in [`ClientStats`].
#[repr(C, align(64))]
#[derive(Debug)]
pub struct StorageStats {
    configured: AtomicU64,
    figures: [AtomicU64; STORAGE_FIGURES],
}

const _: () = assert!(size_of::<StorageStats>() == 128);

// SAFETY: atomics only (each its own UnsafeCell), every bit pattern a valid integer, no padding
// (asserted 128 bytes of 16 u64).
unsafe impl SharedArea for StorageStats {}

impl StorageStats {
    /// Owner: publishes `figures` (Relaxed, as [`ClientStats::publish`]).
    pub fn publish(&self, figures: &[u64; STORAGE_FIGURES]) {
        for (word, &figure) in self.figures.iter().zip(figures) {
            word.store(figure, Ordering::Relaxed);
        }
        self.configured.store(1, Ordering::Relaxed);
    }

    /// The figures last published, or `None` when no owner with a storage tier published.
    pub fn read(&self) -> Option<[u64; STORAGE_FIGURES]> {
        if self.configured.load(Ordering::Relaxed) == 0 {
            return None;
        }
        Some(std::array::from_fn(|at| self.figures[at].load(Ordering::Relaxed)))
    }
}

/// Where the parts of a channel lie, from the channel's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChannelLayout {
    pub request_ring: usize,
    pub request_ring_len: usize,
    pub answer_ring: usize,
    pub answer_ring_len: usize,
    pub answer_bell: usize,
    pub key_page: usize,
    pub answer_page: usize,
    /// Bytes of one channel, a multiple of 64.
    pub stride: usize,
}

impl ChannelLayout {
    /// The channel of a valid `config`.
    pub fn compute(config: &TierConfig) -> ChannelLayout {
        let slots = config.ring_slots as usize;
        let request_ring_len = crate::ring::memory_size::<TierRequest>(slots);
        let answer_ring_len = crate::ring::memory_size::<TierAnswer>(slots);
        let answer_ring = request_ring_len;
        let answer_bell = answer_ring + answer_ring_len;
        let key_page = answer_bell + size_of::<Doorbell>();
        let keys = config.page_keys as usize;
        let answer_page = key_page + (keys * size_of::<WireKey>()).next_multiple_of(64);
        let stride = answer_page + (keys * 2 * size_of::<u32>()).next_multiple_of(64);
        ChannelLayout {
            request_ring: 0,
            request_ring_len,
            answer_ring,
            answer_ring_len,
            answer_bell,
            key_page,
            answer_page,
            stride,
        }
    }
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
    pub reserved: [u64; 4],
    /// The owner process (written first at creation, at a segment's creator offset).
    pub creator: ProcessIdentity,
    pub offsets: TierOffsets,
}

const _: () = assert!(size_of::<TierHeaderFields>() == 144);
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

const _: () = assert!(size_of::<TierHeader>() == 192);
pub(crate) const READY_OFFSET: usize = std::mem::offset_of!(TierHeader, ready);

/// Where everything lies, derived from a configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierLayout {
    pub offsets: TierOffsets,
    pub channel: ChannelLayout,
    /// Bytes of the whole object (a multiple of the page size).
    pub total_size: usize,
}

impl TierLayout {
    /// The layout of a valid `config`.
    pub fn compute(config: &TierConfig) -> Result<TierLayout, TierConfigError> {
        config.validate()?;
        let owner_bell = size_of::<TierHeader>();
        let client_slots = owner_bell + size_of::<Doorbell>();
        let client_stats = client_slots + config.clients as usize * size_of::<WorkerSlot>();
        let storage_stats = client_stats + config.clients as usize * size_of::<ClientStats>();
        let identity = storage_stats + size_of::<StorageStats>();
        let channels = (identity + config.identity_capacity as usize).next_multiple_of(64);
        let channel = ChannelLayout::compute(config);
        let end = channels + config.clients as usize * channel.stride;
        Ok(TierLayout {
            offsets: TierOffsets {
                owner_bell: owner_bell as u64,
                client_slots: client_slots as u64,
                client_stats: client_stats as u64,
                storage_stats: storage_stats as u64,
                identity: identity as u64,
                channels: channels as u64,
                channel_stride: channel.stride as u64,
            },
            channel,
            total_size: end.next_multiple_of(4096),
        })
    }

    /// The largest object any valid configuration makes.
    pub fn largest() -> usize {
        let config = TierConfig {
            clients: MAX_TIER_CLIENTS,
            identity_capacity: MAX_IDENTITY_BYTES,
            ring_slots: MAX_RING_SLOTS,
            page_keys: MAX_PAGE_KEYS,
        };
        TierLayout::compute(&config).expect("the largest configuration is valid").total_size
    }
}
