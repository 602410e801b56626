//! A shared host tier's control object, `/kvshm.NAME` of a tier (DESIGN §12.3-12.4): the tier's
//! identity, its owner, and one slot per client, claimed as workers claim ranks.
//!
//! [`TierControl`] owns one mapping of the object and a checked copy of its header. The owner
//! process creates it ([`TierControl::create`]: `O_EXCL`, a dead owner's object taken over with
//! its host arenas kept, the header written with the creator first and the ready word last); a
//! client attaches by the tier's name ([`TierControl::attach`]), and everything it reads is
//! checked before it is used ([`TierAttachError`]).
//!
//! A client's slot is a [`WorkerSlot`]: the rule for claiming one, and for judging and
//! reclaiming it, is the workers' rule (`worker_slot`), not a copy of it.
//! 1. the client claims the first slot it can ([`TierControl::claim_client_slot`]: a CAS of the
//!    slot's owner word from EMPTY to ATTACHED with its pid);
//! 2. the owner sees the ATTACHED word at its next sweep and watches the client's process (the
//!    owner's loop in the main crate opens a pidfd on it);
//! 3. when the client has gone (its process died, or it sent its detach), the owner releases
//!    what it held and reclaims the slot ([`TierControl::reclaim_client`]: ATTACHED to DEAD, the
//!    client's channel reset, DEAD to EMPTY), and only then can another client claim it.
//!
//! A client never gives its slot back itself (dropping a [`ClientClaim`] changes nothing): the
//! owner must release the client's pins before the slot is claimed again, so only the owner
//! empties a slot. Clients are judged by their process alone, never by a heartbeat: an engine
//! may sit idle for hours without calling the tier.
//!
//! Each slot has its channel (`channel.rs`, records in `record.rs`): the client's end comes
//! with its claim ([`TierControl::client_channel`]), the owner's with its verdict
//! ([`TierControl::owner_channel`]); a reclaim resets it before the slot is claimed again.
//!
//! Files: `layout.rs` the header and the areas' offsets; `record.rs` the records and keys;
//! `channel.rs` the two ends of a channel.

mod channel;
mod layout;
mod record;
#[cfg(test)]
mod tests;

use std::ptr::addr_of_mut;
use std::sync::Arc;
use std::time::Duration;

pub use channel::{ClientChannel, OwnerChannel};
pub use layout::{
    ChannelLayout, ClientFigures, ClientStats, StorageStats, TierConfig, TierConfigError,
    TierHeader, TierHeaderFields, TierLayout, TierOffsets, MAX_IDENTITY_BYTES, MAX_PAGE_KEYS,
    MAX_RING_SLOTS, MAX_TIER_CLIENTS, STORAGE_FIGURES, TIER_LAYOUT_VERSION, TIER_MAGIC, TIER_READY,
};
pub use record::{
    AnswerStatus, RecordError, TierAnswer, TierOp, TierRequest, WireKey, WIRE_KEY_BYTES,
};

use channel::ChannelParts;

use crate::doorbell::Doorbell;
use crate::inspect::ObjectIdentity;
use crate::liveness::{monotonic_ns, ProcessIdentity};
use crate::name::SegmentName;
use crate::ring::{self, Consumer, Producer, RingError};
use crate::segment::CreateError;
use crate::shm::{SharedArea, SharedMemory, ShmError};
use crate::sync::{AtomicU32, Ordering};
use crate::worker_slot::{
    ClaimError, HeartbeatLimits, OwnerWord, ReclaimError, SlotVerdict, WorkerSlot,
};

/// Why a tier's control object could not be created. Nothing is left behind.
#[derive(Debug, thiserror::Error)]
pub enum TierCreateError {
    #[error("invalid tier configuration: {0}")]
    Config(#[from] TierConfigError),
    #[error("the tier's identity is {len} bytes, more than the {capacity} reserved")]
    IdentityTooLong { len: usize, capacity: u32 },
    #[error(transparent)]
    Create(#[from] CreateError),
}

/// Why a client could not attach to a tier's control object (checked in this order).
#[derive(Debug, thiserror::Error)]
pub enum TierAttachError {
    #[error(transparent)]
    Shm(#[from] ShmError),
    #[error("the tier's control object is {len} bytes, {expected} expected")]
    Truncated { len: u64, expected: u64 },
    #[error("not a shared tier's control object (magic {found:#018x})")]
    BadMagic { found: u64 },
    #[error("tier layout version {found}, this build reads {expected}")]
    VersionMismatch { found: u32, expected: u32 },
    #[error("the tier's owner (pid {}) has not finished creating it", creator.pid)]
    NotReady { creator: ProcessIdentity },
    #[error("the tier's configuration is invalid: {0}")]
    Config(#[from] TierConfigError),
    #[error("the tier's header is corrupt: {what}")]
    Corrupt { what: &'static str },
    #[error("the tier's owner (pid {pid}) is dead")]
    OwnerDead { pid: u32 },
}

/// Why a client could not claim a slot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientClaimError {
    #[error("all {clients} client slots of the tier are taken")]
    NoFreeSlot { clients: u32 },
}

/// A tier's control object, mapped and checked (module flow).
pub struct TierControl {
    memory: Arc<SharedMemory>,
    name: SegmentName,
    fields: TierHeaderFields,
    layout: TierLayout,
    /// The object this handle created (the owner's), unlinked on drop if it is still that file.
    created: Option<ObjectIdentity>,
}

impl std::fmt::Debug for TierControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierControl")
            .field("name", &self.name)
            .field("creator", &self.fields.creator)
            .field("config", &self.fields.config)
            .finish()
    }
}

// Handles are shared between the owner's threads.
const _: fn() = || {
    fn shareable<T: Send + Sync>() {}
    shareable::<TierControl>();
    shareable::<ClientClaim>();
};

impl TierControl {
    /// Owner: creates the control object of tier `name` with `config`, keeping `identity` (the
    /// tier's, encoded by the caller) for clients to compare theirs with. An object of the name
    /// whose owner is dead is replaced, its host arenas kept for this owner to take over; one
    /// whose owner lives is [`CreateError::InUse`].
    pub fn create(
        name: &SegmentName,
        config: &TierConfig,
        identity: &[u8],
    ) -> Result<TierControl, TierCreateError> {
        let control = TierControl::create_closed(name, config, identity)?;
        control.open_to_clients();
        Ok(control)
    }

    /// [`TierControl::create`], but clients refuse the object ([`TierAttachError::NotReady`])
    /// until [`TierControl::open_to_clients`]: an owner with more to set up (its key table, a
    /// storage tier) makes the name its own first, and no client attaches to an owner that may
    /// still fail. Another creator finds the name in use all the same.
    pub fn create_closed(
        name: &SegmentName,
        config: &TierConfig,
        identity: &[u8],
    ) -> Result<TierControl, TierCreateError> {
        let layout = TierLayout::compute(config)?;
        if identity.len() > config.identity_capacity as usize {
            return Err(TierCreateError::IdentityTooLong {
                len: identity.len(),
                capacity: config.identity_capacity,
            });
        }
        let object = name.control_object();
        let memory = crate::segment::create_control_object(name, &object, layout.total_size)?;
        let made = memory.identity().inspect_err(|_| {
            let _ = crate::inspect::unlink_owned(&object);
        });
        let made = made.map_err(CreateError::from)?;
        let creator = ProcessIdentity::current();
        let fields = TierHeaderFields {
            magic: TIER_MAGIC,
            layout_version: TIER_LAYOUT_VERSION,
            identity_len: identity.len() as u32,
            total_size: layout.total_size as u64,
            config: *config,
            reserved: [0; 4],
            creator,
            offsets: layout.offsets,
        };
        let header = memory.as_ptr().cast::<TierHeaderFields>();
        // SAFETY: 1. the mapping is page-aligned and larger than a TierHeader, so both writes are
        // in bounds and aligned; 2. volatile stores of Pods into an object this process just
        // created with O_EXCL: other processes only copy these bytes out (listing, a creator
        // judging the name), and trust them only after the Release store of the ready word.
        unsafe {
            addr_of_mut!((*header).creator).write_volatile(creator);
            header.write_volatile(fields);
        }
        // SAFETY: the identity area holds `identity_capacity >= identity.len()` bytes inside the
        // mapping (layout), and `identity` is this process's own memory, not in the mapping.
        unsafe {
            crate::shared_bytes::copy_to_shared(
                identity,
                memory.as_ptr().add(layout.offsets.identity as usize),
            )
        };
        let control = TierControl {
            memory: Arc::new(memory),
            name: name.clone(),
            fields,
            layout,
            created: Some(made),
        };
        // Slots and doorbells are zeroed memory (a fresh object): empty and idle.
        for index in 0..config.clients {
            let (requests, answers) = control.ring_bases(index);
            let slots = config.ring_slots as usize;
            // SAFETY: 1. each ring area is memory_size(slots) bytes inside the mapping, 64-aligned
            // (layout); 2. slots is a power of two (config validated); 3. no end is attached:
            // attachers refuse the object before it is ready.
            unsafe {
                ring::init::<TierRequest>(requests, slots);
                ring::init::<TierAnswer>(answers, slots);
            }
        }
        Ok(control)
    }

    /// The pid of tier `name`'s owner while it sets up, closed to clients (`create_closed`);
    /// `None` when the object is open, absent or unreadable, or its creator is dead.
    pub fn setting_up(name: &SegmentName) -> Option<u32> {
        let memory = SharedMemory::open(&name.control_object()).ok()?;
        match validate(&memory) {
            Err(TierAttachError::NotReady { creator }) if creator.is_alive() => Some(creator.pid),
            _ => None,
        }
    }

    /// Owner: lets clients attach to the object [`TierControl::create_closed`] made.
    pub fn open_to_clients(&self) {
        // SYNC: pairs with the Acquire load of ready in validate(): an attacher that sees it
        // ready sees the header, the identity and the rings written by create_closed().
        self.ready_word().store(TIER_READY, Ordering::Release);
    }

    /// Client: attaches to tier `name`, checking everything it reads.
    pub fn attach(name: &SegmentName) -> Result<TierControl, TierAttachError> {
        let memory = SharedMemory::open(&name.control_object())?;
        let (fields, layout) = validate(&memory)?;
        if !fields.creator.is_alive() {
            return Err(TierAttachError::OwnerDead { pid: fields.creator.pid });
        }
        Ok(TierControl {
            memory: Arc::new(memory),
            name: name.clone(),
            fields,
            layout,
            created: None,
        })
    }

    pub fn name(&self) -> &SegmentName {
        &self.name
    }

    pub fn config(&self) -> TierConfig {
        self.fields.config
    }

    /// The owner process.
    pub fn owner(&self) -> ProcessIdentity {
        self.fields.creator
    }

    /// The tier's identity as its owner encoded it.
    pub fn identity(&self) -> Vec<u8> {
        let mut bytes = vec![0; self.fields.identity_len as usize];
        // SAFETY: identity_len <= identity_capacity (validated), and the layout puts that many
        // bytes inside the mapping, which lives as long as `self`.
        unsafe {
            crate::shared_bytes::copy_from_shared(
                self.ptr(self.layout.offsets.identity),
                &mut bytes,
            )
        };
        bytes
    }

    /// The doorbell every client rings after a call and the owner waits on.
    pub fn owner_bell(&self) -> &Doorbell {
        // SAFETY: the layout puts one 64-aligned Doorbell at this offset.
        unsafe { self.area::<Doorbell>(self.layout.offsets.owner_bell) }
    }

    /// The slot of client `index`, if there is one.
    pub fn client_slot(&self, index: u32) -> Option<&WorkerSlot> {
        if index >= self.fields.config.clients {
            return None;
        }
        let offset =
            self.layout.offsets.client_slots + u64::from(index) * size_of::<WorkerSlot>() as u64;
        // SAFETY: index < clients, and the layout puts `clients` 64-aligned slots there.
        Some(unsafe { self.area::<WorkerSlot>(offset) })
    }

    /// What the owner last published of the client of slot `index`, if there is one.
    pub fn client_stats(&self, index: u32) -> Option<&ClientStats> {
        if index >= self.fields.config.clients {
            return None;
        }
        let offset =
            self.layout.offsets.client_stats + u64::from(index) * size_of::<ClientStats>() as u64;
        // SAFETY: index < clients, and the layout puts `clients` 64-aligned stats there.
        Some(unsafe { self.area::<ClientStats>(offset) })
    }

    /// What the owner last published of the storage tier below the tier.
    pub fn storage_stats(&self) -> &StorageStats {
        // SAFETY: the layout puts one 64-aligned StorageStats there.
        unsafe { self.area::<StorageStats>(self.layout.offsets.storage_stats) }
    }

    /// Client, module flow step 1: claims the first slot free for the calling process.
    pub fn claim_client_slot(&self) -> Result<ClientClaim, ClientClaimError> {
        self.claim_client_slot_as(ProcessIdentity::current())
    }

    /// [`claim_client_slot`](Self::claim_client_slot) on behalf of `process`.
    pub fn claim_client_slot_as(
        &self,
        process: ProcessIdentity,
    ) -> Result<ClientClaim, ClientClaimError> {
        for index in 0..self.fields.config.clients {
            let slot = self.client_slot(index).expect("index < clients");
            match slot.claim(process) {
                Ok(owner_word) => {
                    return Ok(ClientClaim {
                        _memory: Arc::clone(&self.memory),
                        slot: slot as *const WorkerSlot,
                        owner_word,
                        index,
                    })
                }
                // Taken, or a dead client's the owner has not reclaimed yet: try the next.
                Err(ClaimError::Occupied { .. } | ClaimError::NotReclaimed { .. }) => {}
                Err(ClaimError::RankOutOfRange { .. }) => unreachable!("a slot index in range"),
            }
        }
        Err(ClientClaimError::NoFreeSlot { clients: self.fields.config.clients })
    }

    /// Client: its end of the channel of the slot it claimed.
    ///
    /// # Safety
    /// No other client end of this slot exists in this process (across processes the claim's
    /// CAS gives the slot to one client): two producers on one ring would race.
    ///
    /// # Panics
    /// If the claim names a slot this object does not have (a claim of another tier).
    pub unsafe fn client_channel(&self, claim: &ClientClaim) -> Result<ClientChannel, RingError> {
        let index = claim.index();
        assert!(index < self.fields.config.clients, "a claim of another tier's slot");
        let (request_base, answer_base) = self.ring_bases(index);
        let channel = self.layout.channel;
        // SAFETY: 1. both rings lie in the mapping (the slot is one of this object's), which the
        // channel's parts keep alive; 2. the other ends are the owner's, and this is the one
        // client end of the slot (the caller's promise within this process, the claim's CAS
        // across processes).
        let requests = unsafe { Producer::attach(request_base, channel.request_ring_len)? };
        // SAFETY: as above.
        let answers = unsafe { Consumer::attach(answer_base, channel.answer_ring_len)? };
        self.check_ring_slots(requests.capacity(), answers.capacity())?;
        Ok(ClientChannel { requests, answers, parts: self.channel_parts(index) })
    }

    /// Owner: its end of the channel of slot `index` (for a client it has judged attached).
    ///
    /// # Safety
    /// No other owner end of slot `index` exists (one owner process, by `O_EXCL` on the
    /// object; within it, the caller's promise): two consumers on one ring would race.
    ///
    /// # Panics
    /// If `index` is not a slot: the owner iterates over its own configuration's slots.
    pub unsafe fn owner_channel(&self, index: u32) -> Result<OwnerChannel, RingError> {
        assert!(index < self.fields.config.clients, "a slot index out of range");
        let (request_base, answer_base) = self.ring_bases(index);
        let channel = self.layout.channel;
        // SAFETY: as in client_channel, the owner's one end of the slot (the caller's promise).
        let requests = unsafe { Consumer::attach(request_base, channel.request_ring_len)? };
        // SAFETY: as above.
        let answers = unsafe { Producer::attach(answer_base, channel.answer_ring_len)? };
        self.check_ring_slots(requests.capacity(), answers.capacity())?;
        Ok(OwnerChannel { requests, answers, parts: self.channel_parts(index) })
    }

    /// Refuses rings whose capacity is not the configured `ring_slots`
    /// ([`RingError::check_capacity`]).
    fn check_ring_slots(&self, requests: usize, answers: usize) -> Result<(), RingError> {
        let slots = u64::from(self.fields.config.ring_slots);
        RingError::check_capacity(requests, slots)?;
        RingError::check_capacity(answers, slots)
    }

    fn channel_start(&self, index: u32) -> u64 {
        self.layout.offsets.channels + u64::from(index) * self.layout.offsets.channel_stride
    }

    fn ring_bases(&self, index: u32) -> (*mut u8, *mut u8) {
        let start = self.channel_start(index);
        let channel = self.layout.channel;
        (
            self.ptr(start + channel.request_ring as u64),
            self.ptr(start + channel.answer_ring as u64),
        )
    }

    fn answer_bell(&self, index: u32) -> &Doorbell {
        let at = self.channel_start(index) + self.layout.channel.answer_bell as u64;
        // SAFETY: the layout puts one 64-aligned Doorbell there.
        unsafe { self.area::<Doorbell>(at) }
    }

    fn channel_parts(&self, index: u32) -> ChannelParts {
        let start = self.channel_start(index);
        let channel = self.layout.channel;
        ChannelParts {
            _memory: Arc::clone(&self.memory),
            answer_bell: self.answer_bell(index) as *const Doorbell,
            owner_bell: self.owner_bell() as *const Doorbell,
            key_page: self.ptr(start + channel.key_page as u64),
            answer_page: self.ptr(start + channel.answer_page as u64),
            page_keys: self.fields.config.page_keys,
        }
    }

    /// Owner, module flow step 2: the client of slot `index` as its owner word says, judged by
    /// `is_alive` (the owner asks its pidfd) and never by a heartbeat.
    pub fn client_verdict(
        &self,
        index: u32,
        is_alive: impl FnOnce(ProcessIdentity) -> bool,
    ) -> Option<SlotVerdict> {
        let no_heartbeat = HeartbeatLimits::uniform(Duration::MAX);
        Some(self.client_slot(index)?.verdict(monotonic_ns(), no_heartbeat, is_alive))
    }

    /// Owner, module flow step 3: takes slot `index` from exactly the word `judged` (a client
    /// that has gone, its pins released; the owner has dropped its end of the channel), resets
    /// the channel while no client can claim the slot, and empties it.
    pub fn reclaim_client(&self, index: u32, judged: OwnerWord) -> Result<(), ReclaimError> {
        let clients = self.fields.config.clients;
        let slot = self
            .client_slot(index)
            .ok_or(ReclaimError::RankOutOfRange { rank: index, tp_size: clients })?;
        let reclaim = slot.begin_reclaim(judged)?;
        let (requests, answers) = self.ring_bases(index);
        let slots = self.fields.config.ring_slots as usize;
        // SAFETY: 1. both rings lie in the mapping and were initialised at creation with `slots`
        // records; 2. no end uses them: the client has gone (the premise above) and the slot is
        // DEAD, so none can claim it until the reclaim finishes; 3. the reset is atomic stores of
        // the header (a client may have scribbled over its description too), so a process
        // breaking that premise races nothing here.
        unsafe {
            ring::reset::<TierRequest>(requests, slots);
            ring::reset::<TierAnswer>(answers, slots);
        }
        // A client killed asleep on its doorbell never deregistered; none can be registered now.
        self.answer_bell(index).forget_sleepers();
        reclaim.finish()
    }

    fn ready_word(&self) -> &AtomicU32 {
        ready_word(&self.memory)
    }

    fn ptr(&self, offset: u64) -> *mut u8 {
        assert!(offset <= self.memory.len() as u64, "an offset past the control object");
        // SAFETY: `offset` is at most the mapping's length (checked above), so the pointer is
        // in the mapping or one past its end.
        unsafe { self.memory.as_ptr().add(offset as usize) }
    }

    /// The `T` at `offset`.
    ///
    /// # Safety
    /// `offset` is where the layout puts a `T` (so in bounds and aligned for it).
    unsafe fn area<T: SharedArea>(&self, offset: u64) -> &T {
        assert!(
            offset as usize + size_of::<T>() <= self.memory.len(),
            "an area outside the tier's object is a programming error"
        );
        // SAFETY: in bounds (asserted) and aligned (the caller's premise) in a mapping that lives
        // as long as `self`; T is a SharedArea: atomics only, every bit pattern valid, so the
        // shared reference stays sound while other processes write it.
        unsafe { &*self.ptr(offset).cast::<T>() }
    }
}

impl Drop for TierControl {
    fn drop(&mut self) {
        let Some(made) = self.created else { return };
        if self.memory.is_intact() {
            // Relaxed: the word alone is the message (clients see the owner go without waiting
            // to find its process dead); nothing is published behind it.
            self.ready_word().store(0, Ordering::Relaxed);
        }
        // Only the very file this owner made: someone may have cleaned up and recreated the name.
        let _ = crate::inspect::unlink_if_identical(&self.name.control_object(), made);
    }
}

/// A client's claim on its slot (module flow). Dropping it leaves the slot to the owner.
pub struct ClientClaim {
    _memory: Arc<SharedMemory>,
    slot: *const WorkerSlot,
    owner_word: OwnerWord,
    index: u32,
}

// SAFETY: the slot pointer points into the mapping `_memory` keeps alive; the slot is atomics
// only, so using it from any thread is race-free.
unsafe impl Send for ClientClaim {}
// SAFETY: as above; every method takes &self and uses atomics only.
unsafe impl Sync for ClientClaim {}

impl ClientClaim {
    /// The slot's index: the client's channel is this one.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The owner word this claim wrote.
    pub fn owner_word(&self) -> OwnerWord {
        self.owner_word
    }

    /// Whether the slot is still this claim's (the owner has not reclaimed it).
    pub fn is_held(&self) -> bool {
        // SAFETY: see the Send impl: into the mapping `_memory` keeps alive; atomics only.
        unsafe { &*self.slot }.owner() == self.owner_word
    }
}

fn ready_word(memory: &SharedMemory) -> &AtomicU32 {
    assert!(memory.len() >= size_of::<TierHeader>(), "a mapping shorter than a tier header");
    // SAFETY: 1. in bounds (asserted) and 4-aligned in a page-aligned mapping that lives as long
    // as `memory`; 2. a reference to the ready atomic alone (never to the header, whose plain
    // fields another process may write), so every access through it is atomic.
    unsafe { &*memory.as_ptr().add(layout::READY_OFFSET).cast::<AtomicU32>() }
}

/// Whether `memory` starts with a tier's magic (of any version): how listing tells a tier's
/// control object from an engine's segment.
pub(crate) fn has_tier_magic(memory: &SharedMemory) -> bool {
    if memory.len() < size_of::<u64>() {
        return false;
    }
    // SAFETY: in bounds (checked) and aligned at the mapping's start; a volatile copy of a Pod.
    let magic = unsafe { memory.as_ptr().cast::<u64>().read_volatile() };
    magic == TIER_MAGIC
}

/// Checks everything in a tier's control object except its owner's liveness.
pub(crate) fn validate(
    memory: &SharedMemory,
) -> Result<(TierHeaderFields, TierLayout), TierAttachError> {
    let len = memory.len() as u64;
    let header_size = size_of::<TierHeader>() as u64;
    if len < header_size {
        return Err(TierAttachError::Truncated { len, expected: header_size });
    }
    let header = memory.as_ptr().cast::<TierHeaderFields>();
    // SAFETY: a whole header lies in the page-aligned mapping (checked above); a volatile copy of
    // a Pod reads the bytes once as they are, and nothing is trusted before it is checked.
    let early = unsafe { header.read_volatile() };
    if early.magic != TIER_MAGIC {
        return Err(TierAttachError::BadMagic { found: early.magic });
    }
    if early.layout_version != TIER_LAYOUT_VERSION {
        return Err(TierAttachError::VersionMismatch {
            found: early.layout_version,
            expected: TIER_LAYOUT_VERSION,
        });
    }
    // SYNC: pairs with the Release store of ready in TierControl::open_to_clients().
    if ready_word(memory).load(Ordering::Acquire) != TIER_READY {
        return Err(TierAttachError::NotReady { creator: early.creator });
    }
    // SAFETY: as for `early`; read again after the Acquire so that the copy is the published one.
    let fields = unsafe { header.read_volatile() };
    if fields.magic != TIER_MAGIC || fields.layout_version != TIER_LAYOUT_VERSION {
        return Err(TierAttachError::Corrupt { what: "magic or version changed" });
    }
    let layout = TierLayout::compute(&fields.config)?;
    if fields.offsets != layout.offsets {
        return Err(TierAttachError::Corrupt { what: "area offsets" });
    }
    if fields.total_size != layout.total_size as u64 {
        return Err(TierAttachError::Corrupt { what: "total size" });
    }
    if fields.total_size > len {
        return Err(TierAttachError::Truncated { len, expected: fields.total_size });
    }
    if fields.identity_len > fields.config.identity_capacity {
        return Err(TierAttachError::Corrupt { what: "identity length" });
    }
    Ok((fields, layout))
}
