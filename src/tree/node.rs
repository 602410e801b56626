//! One cached block: the packed node record of the tree's arena, its state, and the mutable view
//! that [`super::Tree::update`] hands out.
//!
//! A record is 60 bytes, ids and block numbers as `u32`: the memory of a cached block is this
//! record, its entry in the child index and its eviction policy's per-node data. Fields a record
//! does not need are derived instead: the depth (walking up, for snapshots only), the number of
//! children (the child list), and the recency of the node (kept by the eviction policy). The
//! storage tier needs no field of its own: a block there is named by its hash, so a node records
//! only that the tier holds it (a flag bit) and the state of a copy to or from it.

use serde::Serialize;

use super::policy::{Access, Membership};
use crate::hash::BlockHash;

/// An index into the node arena. Ids of removed nodes are reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct NodeId(pub u32);

impl NodeId {
    /// The root: the empty prefix. It holds no block and is never evicted.
    pub const ROOT: NodeId = NodeId(0);
    /// "No node" in links and lists.
    pub(crate) const NONE: NodeId = NodeId(u32::MAX);

    pub(crate) fn index(self) -> usize {
        self.0 as usize
    }

    pub(crate) fn some(self) -> Option<NodeId> {
        (self != NodeId::NONE).then_some(self)
    }
}

/// Marker of "no block" in a node's block fields.
pub(crate) const NO_BLOCK: u32 = u32::MAX;

/// A memory tier holding copies of blocks in numbered blocks. Per-tier fields of a node are arrays
/// indexed by tier. The storage tier below host is keyed by block hash, so it has no entry here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tier {
    Device = 0,
    Host = 1,
}

const TIERS: usize = 2;

/// What becomes of a node when its device-to-host copy lands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SwapOut {
    /// The host copy becomes a backup and the node stays on device: a write-through backup, or an
    /// eviction cancelled because the node was hit meanwhile.
    Backup,
    /// An eviction: the device block returns to the pool and the node becomes `Host`. Until then
    /// an allocation short of blocks may claim the device block early.
    Evict,
    /// An eviction whose device block an allocation has already claimed: the node has no device
    /// block and becomes `Host` when the copy lands.
    Claimed,
}

/// What becomes of a node when its host-to-storage write (a STORE) lands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StoreOut {
    /// A write-through copy: the host block stays the node's, valid and read by the STORE; the
    /// node is `Host` again, with its storage copy, when the STORE lands.
    Backup,
    /// A write-back eviction whose host block an allocation has already claimed: the node has no
    /// block and becomes `Storage` when the STORE lands (or leaves the tree if it fails).
    Evict,
}

/// The state of a node (DESIGN §4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    Device,
    Host,
    SwapToHost(SwapOut),
    SwapToDevice,
    /// On the storage tier only: no device or host block.
    Storage,
    /// A STORE of the node's host block to the storage tier is in flight.
    HostToStorage(StoreOut),
    /// A LOAD from the storage tier into the node's host block is in flight; a swap-in into its
    /// device block follows it in the same ticket, or, for a prefetch no allocation met yet, none
    /// (no device block: the node lands on host).
    StorageToHost,
}

impl NodeState {
    /// Whether a copy for this node is in flight.
    pub fn in_flight(self) -> bool {
        matches!(
            self,
            NodeState::SwapToHost(_)
                | NodeState::SwapToDevice
                | NodeState::HostToStorage(_)
                | NodeState::StorageToHost
        )
    }

    /// Whether the node is on the storage tier alone: no block above it, no copy upward.
    pub fn storage_only(self) -> bool {
        matches!(self, NodeState::Storage | NodeState::HostToStorage(StoreOut::Evict))
    }

    pub fn name(self) -> &'static str {
        match self {
            NodeState::Device => "device",
            NodeState::Host => "host",
            NodeState::SwapToHost(SwapOut::Backup) => "swap_to_host(backup)",
            NodeState::SwapToHost(SwapOut::Evict) => "swap_to_host(evict)",
            NodeState::SwapToHost(SwapOut::Claimed) => "swap_to_host(claimed)",
            NodeState::SwapToDevice => "swap_to_device",
            NodeState::Storage => "storage",
            NodeState::HostToStorage(StoreOut::Backup) => "host_to_storage(backup)",
            NodeState::HostToStorage(StoreOut::Evict) => "host_to_storage(evict)",
            NodeState::StorageToHost => "storage_to_host",
        }
    }

    pub(super) const fn code(self) -> u8 {
        match self {
            NodeState::Device => 0,
            NodeState::Host => 1,
            NodeState::SwapToHost(SwapOut::Backup) => 2,
            NodeState::SwapToHost(SwapOut::Evict) => 3,
            NodeState::SwapToHost(SwapOut::Claimed) => 4,
            NodeState::SwapToDevice => 5,
            NodeState::HostToStorage(StoreOut::Backup) => 6,
            NodeState::StorageToHost => 7,
            // The storage-only states come last: `Node::is_upper` is one comparison.
            NodeState::Storage => FIRST_STORAGE_ONLY_CODE,
            NodeState::HostToStorage(StoreOut::Evict) => FIRST_STORAGE_ONLY_CODE + 1,
        }
    }

    fn from_code(code: u8) -> NodeState {
        match code {
            0 => NodeState::Device,
            1 => NodeState::Host,
            2 => NodeState::SwapToHost(SwapOut::Backup),
            3 => NodeState::SwapToHost(SwapOut::Evict),
            4 => NodeState::SwapToHost(SwapOut::Claimed),
            5 => NodeState::SwapToDevice,
            6 => NodeState::HostToStorage(StoreOut::Backup),
            7 => NodeState::StorageToHost,
            8 => NodeState::Storage,
            9 => NodeState::HostToStorage(StoreOut::Evict),
            _ => unreachable!("state code {code} is never stored: a programming error"),
        }
    }
}

/// How many state codes there are ([`NodeState::code`]).
pub(super) const STATE_CODES: usize = 10;

/// The code of the first storage-only state ([`NodeState::storage_only`]); every state code from
/// it on is storage-only, every one below it is not.
const FIRST_STORAGE_ONLY_CODE: u8 = 8;

/// `flags`: the evictable sets the node is filed in (the low bits, a [`Membership`]), and these.
const BACKUP_QUEUED: u8 = 0x80;
/// The storage tier holds the block (a STORE landed and nothing dropped it since).
const STORED: u8 = 0x40;
/// The node's host copy came from a LOAD and only passes through on its way to the device: the
/// swap-in behind the LOAD frees it when it lands.
const PASSING_THROUGH_HOST: u8 = 0x20;

/// A child count at this value means "at least this many": the tree recounts the children when
/// it would fall (see [`super::Tree`]'s counts). Counts are 16 bits so that the record keeps its
/// 60 bytes with two of them.
pub(super) const COUNT_SATURATED: u16 = u16::MAX;

/// One cached block.
#[derive(Clone, Debug)]
pub struct Node {
    /// The block hash as four little-endian words: a `u128` would align the record to 16 bytes.
    hash: [u32; 4],
    pub(super) parent: NodeId,
    pub(super) first_child: NodeId,
    /// Siblings under the same parent; for a removed slot, `next_sibling` links the free slots.
    pub(super) next_sibling: NodeId,
    pub(super) prev_sibling: NodeId,
    /// The block of each tier, [`NO_BLOCK`] when none.
    blocks: [u32; TIERS],
    /// The id of the one copy in flight for this node (0 when none), as two words.
    transfer: [u32; 2],
    ref_count: u32,
    /// Children with a device block (saturating, see [`COUNT_SATURATED`]).
    pub(super) device_children: u16,
    /// Children that are not storage-only (saturating, see [`COUNT_SATURATED`]): a node with
    /// none may leave the host tier, its children staying reachable on storage.
    pub(super) upper_children: u16,
    /// Saturates at `u16::MAX` (write-through-selective thresholds are capped below it).
    hit_count: u16,
    state: u8,
    pub(super) flags: u8,
}

const _: () = assert!(size_of::<Node>() == 60);

impl Node {
    pub(super) fn hold_one(&mut self) {
        self.ref_count += 1;
    }

    pub(super) fn count_hit(&mut self) {
        self.hit_count = self.hit_count.saturating_add(1);
    }

    /// # Panics
    /// If the node is not held: releasing more than was held is a programming error.
    pub(super) fn release_one(&mut self) {
        self.ref_count =
            self.ref_count.checked_sub(1).expect("releasing an unheld node is a programming error");
    }

    /// Marks a removed slot: no parent (so not live), in no set, `next_free` next in the list of
    /// free slots. The other fields are left as they were; [`Node::new`] rewrites them all.
    pub(super) fn mark_removed(&mut self, next_free: NodeId) {
        self.parent = NodeId::NONE;
        self.first_child = NodeId::NONE;
        self.next_sibling = next_free;
        self.flags = 0;
    }

    pub(super) fn new(hash: BlockHash, parent: NodeId) -> Node {
        Node {
            hash: split(hash),
            parent,
            first_child: NodeId::NONE,
            next_sibling: NodeId::NONE,
            prev_sibling: NodeId::NONE,
            blocks: [NO_BLOCK; TIERS],
            transfer: [0; 2],
            ref_count: 0,
            device_children: 0,
            upper_children: 0,
            hit_count: 1,
            state: NodeState::Device.code(),
            flags: 0,
        }
    }

    pub fn hash(&self) -> BlockHash {
        let [a, b, c, d] = self.hash.map(u128::from);
        BlockHash(a | b << 32 | c << 64 | d << 96)
    }

    /// The block hash as the node stores it (four little-endian words).
    pub(super) fn hash_words(&self) -> &[u32; 4] {
        &self.hash
    }

    /// Whether the node is keyed by `hash` (without rebuilding the `u128`).
    pub(super) fn has_hash(&self, hash: &[u32; 4]) -> bool {
        self.hash == *hash
    }

    /// Whether the node is in `state` (one byte compare).
    #[inline]
    pub(super) fn is(&self, state: NodeState) -> bool {
        self.state == state.code()
    }

    /// The parent, `None` for the root.
    pub fn parent(&self) -> Option<NodeId> {
        self.parent.some()
    }

    /// The device block: the valid copy, the source of a swap-out, or the destination of a
    /// swap-in (by state).
    pub fn device(&self) -> Option<u32> {
        self.block(Tier::Device)
    }

    /// The host block: the valid copy or backup, or the destination of a swap-out (by state).
    pub fn host(&self) -> Option<u32> {
        self.block(Tier::Host)
    }

    pub(crate) fn block(&self, tier: Tier) -> Option<u32> {
        let block = self.blocks[tier as usize];
        (block != NO_BLOCK).then_some(block)
    }

    /// The state's code ([`NodeState::code`]), for tables indexed by state.
    #[inline]
    pub(super) fn state_code(&self) -> u8 {
        self.state
    }

    pub fn state(&self) -> NodeState {
        NodeState::from_code(self.state)
    }

    pub fn ref_count(&self) -> u32 {
        self.ref_count
    }

    /// 1 + the matches that hit it, saturating at `u16::MAX`.
    pub fn hit_count(&self) -> u32 {
        u32::from(self.hit_count)
    }

    /// Whether the node has children, in any tier.
    pub fn has_children(&self) -> bool {
        self.first_child != NodeId::NONE
    }

    /// The raw id of the copy in flight for this node, if any.
    pub fn transfer(&self) -> Option<u64> {
        let id = u64::from(self.transfer[0]) | u64::from(self.transfer[1]) << 32;
        (id != 0).then_some(id)
    }

    pub fn backup_queued(&self) -> bool {
        self.flags & BACKUP_QUEUED != 0
    }

    /// Whether the storage tier holds the block (counted in the tier's used blocks).
    pub fn stored(&self) -> bool {
        self.flags & STORED != 0
    }

    /// Whether the host copy only passes through from a LOAD to the device.
    pub fn passing_through_host(&self) -> bool {
        self.flags & PASSING_THROUGH_HOST != 0
    }

    /// Whether the node is not storage-only: its parent counts it in `upper_children`.
    #[inline]
    pub(super) fn is_upper(&self) -> bool {
        self.state < FIRST_STORAGE_ONLY_CODE
    }

    /// Whether the node has a valid host copy that no copy in flight is writing.
    pub fn has_valid_host(&self) -> bool {
        self.blocks[Tier::Host as usize] != NO_BLOCK
            && (self.is(NodeState::Device) || self.is(NodeState::Host))
    }

    /// The evictable sets the node is filed in.
    pub(super) fn membership(&self) -> Membership {
        Membership::from_bits(self.flags & Membership::ALL.bits())
    }

    pub(super) fn set_membership(&mut self, sets: Membership) {
        self.flags = (self.flags & !Membership::ALL.bits()) | sets.bits();
    }
}

/// The four little-endian words of a block hash, as a node stores it.
pub(super) fn split(hash: BlockHash) -> [u32; 4] {
    let value = hash.0;
    [value as u32, (value >> 32) as u32, (value >> 64) as u32, (value >> 96) as u32]
}

/// A mutable view of a node's own fields, handed to [`super::Tree::update`] closures. The
/// structural fields (parent, children, counts) stay with the tree, and so does filing the node
/// in the evictable sets once the change is made.
pub struct NodeMut<'a> {
    pub(super) node: &'a mut Node,
    /// The access recorded by [`NodeMut::access`], passed to the eviction policy.
    pub(super) access: Option<Access>,
    /// Whether the node went from above storage to storage-only or back (an odd number of
    /// times): its parent's `upper_children` must follow. Tracked by `set_state`, so that an
    /// update that changes no state pays nothing for it.
    pub(super) upper_changed: bool,
}

impl NodeMut<'_> {
    pub fn set_device(&mut self, block: Option<u32>) {
        self.node.blocks[Tier::Device as usize] = block.unwrap_or(NO_BLOCK);
    }
    pub fn set_host(&mut self, block: Option<u32>) {
        self.node.blocks[Tier::Host as usize] = block.unwrap_or(NO_BLOCK);
    }
    pub fn set_state(&mut self, state: NodeState) {
        let was_upper = self.node.is_upper();
        self.node.state = state.code();
        self.upper_changed ^= was_upper != self.node.is_upper();
    }
    pub fn set_transfer(&mut self, transfer: Option<u64>) {
        let id = transfer.unwrap_or(0);
        self.node.transfer = [id as u32, (id >> 32) as u32];
    }
    pub fn set_backup_queued(&mut self, queued: bool) {
        if queued {
            self.node.flags |= BACKUP_QUEUED;
        } else {
            self.node.flags &= !BACKUP_QUEUED;
        }
    }
    pub fn set_stored(&mut self, stored: bool) {
        if stored {
            self.node.flags |= STORED;
        } else {
            self.node.flags &= !STORED;
        }
    }
    pub fn set_passing_through_host(&mut self, passing: bool) {
        if passing {
            self.node.flags |= PASSING_THROUGH_HOST;
        } else {
            self.node.flags &= !PASSING_THROUGH_HOST;
        }
    }
    pub fn hold(&mut self) {
        self.node.hold_one();
    }
    /// # Panics
    /// If the node is not held: releasing more than was held is a programming error.
    pub fn release(&mut self) {
        self.node.release_one();
    }
    pub fn count_hit(&mut self) {
        self.node.count_hit();
    }
    /// Records an access for the eviction policy (DESIGN §4: a match's hit, a commit, or
    /// the release at the end of a request).
    pub fn access(&mut self, access: Access) {
        self.access = Some(access);
    }
    pub fn node(&self) -> &Node {
        self.node
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATES: [NodeState; 10] = [
        NodeState::Device,
        NodeState::Host,
        NodeState::SwapToHost(SwapOut::Backup),
        NodeState::SwapToHost(SwapOut::Evict),
        NodeState::SwapToHost(SwapOut::Claimed),
        NodeState::SwapToDevice,
        NodeState::Storage,
        NodeState::HostToStorage(StoreOut::Backup),
        NodeState::HostToStorage(StoreOut::Evict),
        NodeState::StorageToHost,
    ];

    #[test]
    fn every_state_code_decodes_to_its_state_and_only_storage_only_codes_are_not_upper() {
        for state in STATES {
            assert!(usize::from(state.code()) < STATE_CODES, "{state:?}");
            assert_eq!(NodeState::from_code(state.code()), state);
            let mut node = Node::new(crate::hash::BlockHash(7), NodeId::ROOT);
            node.state = state.code();
            assert_eq!(node.is_upper(), !state.storage_only(), "{state:?}");
        }
    }
}
