//! The eviction engine (DESIGN §4.4): the one place where a victim's fate is decided and carried
//! out, for every tier, write policy and eviction policy.
//!
//! Three tiers give blocks up by eviction ([`Tier`]): the device, the host and the storage tier.
//! Each has its evictable set in the tree, ordered by the eviction policy, and a victim is always
//! the first member of its tier's set. What becomes of it is one function, [`fate`], of the
//! node, the tier it is evicted from, the tiers below and the write policy ([`Below`]):
//! - **drop a copy that is backed up** ([`Fate::DropCopy`]): another tier holds a valid copy
//!   (a device copy over a host backup, a host copy of a node still on device, a host copy of a
//!   block the storage tier holds), so only this tier's copy goes, metadata only;
//! - **write back** ([`Fate::WriteBack`]): a device copy that the write policy wants kept
//!   (write-back; write-through for a node whose backup has not happened; selective for a node
//!   hit `threshold` times) is copied to a host block (a swap-out);
//! - **store** ([`Fate::Store`]): a host copy above a storage tier that is up is written to it
//!   (a STORE);
//! - **drop** ([`Fate::Drop`]): anything else leaves the tree with its subtree (the nodes below
//!   it are host-only or storage-only, and no match could reach them again); so does a write-back
//!   or a store that cannot get a block on the tier below.
//!
//! One loop carries it out, [`CacheManager::evict`], for every caller:
//! 1. take the first member of the tier's set (none left: stop);
//! 2. decide its [`fate`];
//! 3. carry it out ([`CacheManager::evict_victim`]), taking a block on the tier below for a
//!    write-back ([`CacheManager::obtain_host_block`], itself one turn of the loop on the host
//!    tier) or a store ([`CacheManager::reserve_storage_block`], one on the storage tier);
//! 4. hand the victim's block to the caller, who takes it at once (an allocation; a write-back
//!    or a store that needs a block), or give it back: to its pool, or, for a write-back ahead of
//!    demand, claimable until its swap-out lands.
//!
//! An allocation takes its device blocks ([`CacheManager::obtain_device_blocks`]) free first,
//! then claims blocks being swapped out (the claimer's ticket then covers that copy), then runs
//! the loop for the rest; a swap-out it starts is claimed at once (`SwapToHost(Claimed)`). `poll`
//! runs it ahead of demand to keep `free_watermark` device blocks free or on their way
//! ([`CacheManager::evict_toward`]). The tree files every node a change exposes (a parent that
//! becomes a candidate) at once, so the next turn of the loop sees it in its place.
//!
//! A node that leaves the tree (a drop here, a failed copy, a reset) gives its blocks back
//! through [`CacheManager::drop_subtree`]: to their pools, or to the copy in flight still touching
//! them, and its storage copy is uncounted and forgotten.

use super::{CacheManager, TransferId, WritePolicy};
use crate::tree::policy::EvictSet;
use crate::tree::{Node, NodeId, NodeState, StoreOut, SwapOut};

/// A block an eviction gave: its number, and the copy still reading it, which a copy into the
/// block (or the ticket of the request it goes to) must wait for.
pub(super) type Reclaimed = (u32, Option<TransferId>);

/// A tier that gives blocks up by eviction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tier {
    Device,
    Host,
    /// Below host; its blocks are named by hash, so its evictions give room, not numbers.
    Storage,
}

impl Tier {
    /// The evictable set of the tier's victims.
    fn victims(self) -> EvictSet {
        match self {
            Tier::Device => EvictSet::Device,
            Tier::Host => EvictSet::Host,
            Tier::Storage => EvictSet::Storage,
        }
    }
}

/// What a victim's fate reads of the cache besides the node: the tiers below and the write
/// policy.
#[derive(Clone, Copy, Debug)]
pub(super) struct Below {
    /// Whether there is a host tier.
    pub host: bool,
    /// Whether there is a storage tier, and it is up (a tier that is down takes no write).
    pub storage_up: bool,
    pub write_policy: WritePolicy,
}

/// What becomes of a victim (module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fate {
    DropCopy,
    WriteBack,
    Store,
    Drop,
}

/// The fate of `node`, a victim of `tier` (module documentation).
pub(super) fn fate(node: &Node, tier: Tier, below: Below) -> Fate {
    match tier {
        // A device candidate is `Device`: its host block is a valid copy.
        Tier::Device if node.host().is_some() => Fate::DropCopy,
        Tier::Device if below.host && keeps(below.write_policy, node.hit_count()) => {
            Fate::WriteBack
        }
        Tier::Host if node.device().is_some() || node.stored() => Fate::DropCopy,
        Tier::Host if below.storage_up => Fate::Store,
        _ => Fate::Drop,
    }
}

/// Whether `write_policy` keeps an evicted device copy hit `hits` times (counting its commit) on
/// host: write-back always, and write-through too (the node's backup has not happened), the
/// selective policy once it was hit `threshold` times.
fn keeps(write_policy: WritePolicy, hits: u32) -> bool {
    match write_policy {
        WritePolicy::WriteBack | WritePolicy::WriteThrough => true,
        WritePolicy::WriteThroughSelective { threshold } => hits >= threshold,
    }
}

impl CacheManager {
    /// The engine's loop (module flow): evicts up to `count` victims of `tier`, each the first of
    /// its set, and returns how many it evicted (fewer when the set ran out). With `taken`, the
    /// caller takes each victim's block at once and it is appended there; otherwise a block goes
    /// back to its pool, or stays with its swap-out, claimable.
    pub(super) fn evict(
        &mut self,
        tier: Tier,
        count: usize,
        mut taken: Option<&mut Vec<Reclaimed>>,
    ) -> usize {
        for evicted in 0..count {
            let Some(victim) = self.tree.first(tier.victims()) else { return evicted };
            let block = self.evict_victim(victim, tier, taken.is_some());
            if let (Some(taken), Some(block)) = (taken.as_deref_mut(), block) {
                taken.push(block);
            }
        }
        count
    }

    /// Decides and carries out the fate of `victim`, the first member of `tier`'s set (module
    /// flow, steps 2 to 4). `take`: the caller takes its block, which is returned (the storage
    /// tier has none to return); a host block is always taken (a host eviction is for a block).
    // Inline in the loop, with the tree's removal: a call here costs 10% more instructions per
    // request at 5,859 device blocks (callgrind, `kvshm replay` of the Mooncake trace).
    #[inline(always)]
    fn evict_victim(&mut self, victim: NodeId, tier: Tier, take: bool) -> Option<Reclaimed> {
        debug_assert!(take || tier != Tier::Host, "a host eviction is for the caller's block");
        let node = self.tree.node(victim);
        let block = match tier {
            Tier::Device => node.device(),
            Tier::Host => node.host(),
            Tier::Storage => None,
        };
        let mut reader = None;
        match fate(node, tier, self.below()) {
            Fate::DropCopy => self.drop_copy(victim, tier),
            Fate::WriteBack => match self.obtain_host_block() {
                Some(host) => reader = Some(self.write_back(victim, host, take)),
                None => self.drop_victim(victim, tier),
            },
            Fate::Store if self.reserve_storage_block() => {
                let block = block.expect("a host candidate has a host block");
                reader = Some(self.start_store(victim, block, StoreOut::Evict));
                self.stats.evictions.host_written_back += 1;
            }
            Fate::Store | Fate::Drop => self.drop_victim(victim, tier),
        }
        let block = block?;
        if !take {
            // Dropped or written back ahead of demand: back to the pool, or claimable.
            if reader.is_none() {
                self.free_device(block);
            }
            return None;
        }
        Some((block, reader))
    }

    /// What [`fate`] reads of the cache besides the node.
    fn below(&self) -> Below {
        Below {
            host: self.host_enabled(),
            storage_up: self.storage_enabled() && !self.tier.is_down(),
            write_policy: self.config.write_policy,
        }
    }

    /// [`Fate::DropCopy`] of `victim` on `tier`: its copy there goes, and its block with it (to
    /// the caller); it keeps the copy that backs it up.
    fn drop_copy(&mut self, victim: NodeId, tier: Tier) {
        let node = self.tree.node(victim);
        match tier {
            Tier::Device => {
                self.tree.update(victim, |node| {
                    node.set_device(None);
                    node.set_state(NodeState::Host);
                });
                self.stats.evictions.device_to_host_metadata += 1;
                self.settled_on_host(victim);
            }
            Tier::Host if node.device().is_some() => {
                self.tree.update(victim, |node| node.set_host(None));
                self.stats.evictions.host_dropped += 1;
            }
            Tier::Host => {
                self.tree.update(victim, |node| {
                    node.set_host(None);
                    node.set_state(NodeState::Storage);
                });
                self.stats.evictions.host_to_storage_metadata += 1;
            }
            Tier::Storage => unreachable!("a storage-only node has no copy backed up below"),
        }
    }

    /// [`Fate::WriteBack`] of device victim `victim` into `host` (a host block, with the STORE
    /// still reading it if one claimed it): its swap-out starts, claimed at once when the
    /// caller `take`s its device block, else claimable until it lands. Returns the swap-out.
    fn write_back(&mut self, victim: NodeId, (host, store): Reclaimed, take: bool) -> TransferId {
        let swap = if take { SwapOut::Claimed } else { SwapOut::Evict };
        let transfer = self.start_swap_out(victim, host, swap);
        self.order_after_store(transfer, store);
        self.stats.evictions.device_written_back += 1;
        transfer
    }

    /// [`Fate::Drop`] of `victim` on `tier`: it leaves the tree with its subtree. While the
    /// storage tier is down, the storage-only nodes below a host victim that the tier holds
    /// intact are kept as orphans (`tier_health`).
    #[inline(always)] // as `evict_victim`
    fn drop_victim(&mut self, victim: NodeId, tier: Tier) {
        let evictions = &mut self.stats.evictions;
        match tier {
            Tier::Device => evictions.device_dropped += 1,
            Tier::Host => evictions.host_dropped += 1,
            Tier::Storage => evictions.storage_dropped += 1,
        }
        if tier == Tier::Host && self.storage_enabled() && self.tier.is_down() {
            self.stats.storage_down_dropped_blocks += 1;
            self.orphan_stored_children(victim);
        }
        while let Some(child) = self.tree.first_child(victim) {
            self.drop_subtree(child);
        }
        // Its one block (its other tiers hold none, or it would have dropped a copy) is for
        // `evict_victim` to hand on; its storage copy, if any, goes.
        if self.storage_enabled() {
            self.give_up_storage_copy(victim);
        }
        self.tree.remove(victim);
    }

    /// Takes `count` device blocks (module flow), each with the swap-out still reading it when
    /// it was claimed from one, appended to `out`.
    ///
    /// # Panics
    /// If fewer can be had: callers check with [`CacheManager::reclaimable_up_to`] first.
    pub(super) fn obtain_device_blocks(&mut self, count: usize, out: &mut Vec<Reclaimed>) {
        let start = out.len();
        out.reserve(count);
        while out.len() - start < count {
            let Some(block) = self.device.allocate_one() else { break };
            out.push((block, None));
        }
        while out.len() - start < count {
            let Some(id) = self.tree.first(EvictSet::Claimable) else { break };
            out.push(self.claim(id));
        }
        let left = count - (out.len() - start);
        let evicted = self.evict(Tier::Device, left, Some(out));
        assert_eq!(evicted, left, "evicting past what the dry run counted is a programming error");
    }

    /// Evicts ahead of demand until `target` device blocks are free or on their way to free
    /// (claimable), or no device candidate is left; for the watermark of `poll`. Each eviction
    /// gives one block: its victim has no device child.
    pub(super) fn evict_toward(&mut self, target: usize) {
        let have = self.device.free_count() + self.tree.count(EvictSet::Claimable);
        if have < target {
            self.evict(Tier::Device, target - have, None);
        }
    }

    /// A host block, from the pool or by evicting the first host candidate (module flow), with
    /// the STORE still reading it when it was claimed from a write-back to storage: the caller's
    /// copy into the block must wait for that STORE.
    pub(super) fn obtain_host_block(&mut self) -> Option<Reclaimed> {
        if let Some(block) = self.host.allocate_one() {
            return Some((block, None));
        }
        // One turn of the loop.
        let victim = self.tree.first(EvictSet::Host)?;
        self.evict_victim(victim, Tier::Host, true)
    }

    /// Makes room for one more block on the storage tier when it is full, by evicting its first
    /// candidate. False when it is full and nothing can go.
    pub(super) fn make_storage_room(&mut self) -> bool {
        self.storage_used < self.config.storage_blocks || self.evict(Tier::Storage, 1, None) == 1
    }

    /// Takes the device block of a node being swapped out, leaving the copy in flight.
    fn claim(&mut self, id: NodeId) -> Reclaimed {
        let node = self.tree.node(id);
        let block = node.device().expect("a claimable node has its device block");
        let transfer =
            TransferId(node.transfer().expect("a claimable node has its copy in flight"));
        self.tree.update(id, |node| {
            node.set_device(None);
            node.set_state(NodeState::SwapToHost(SwapOut::Claimed));
        });
        (block, Some(transfer))
    }
}

/// Dropping nodes: what a drop gives back.
impl CacheManager {
    /// Removes `id` and its whole subtree from the tree, freeing the blocks the nodes own and
    /// handing the blocks their copies in flight still touch to those copies (detaching them).
    /// Children go before their parents, found by walking down first-child links: no stack.
    ///
    /// # Panics
    /// If a node of the subtree is held: callers drop only unheld subtrees.
    pub(super) fn drop_subtree(&mut self, id: NodeId) {
        let mut next = id;
        loop {
            while let Some(child) = self.tree.first_child(next) {
                next = child;
            }
            let parent = self.tree.node(next).parent();
            self.drop_leaf(next);
            if next == id {
                return;
            }
            next = parent.expect("a node below the dropped one has a parent");
        }
    }

    /// Removes node `id`, which has no children, freeing its blocks, or handing them to the copy
    /// in flight that still touches them.
    ///
    /// # Panics
    /// If the node is held.
    pub(super) fn drop_leaf(&mut self, id: NodeId) {
        self.give_up_blocks_of_leaf(id);
        self.tree.remove(id);
    }

    /// The blocks part of [`CacheManager::drop_leaf`]: frees them, or hands them to the copy in
    /// flight that still touches them.
    #[inline]
    pub(super) fn give_up_blocks_of_leaf(&mut self, id: NodeId) {
        let node = self.tree.node(id);
        assert_eq!(node.ref_count(), 0, "dropping a held node is a programming error");
        let (device, host, state, transfer) =
            (node.device(), node.host(), node.state(), node.transfer());
        if self.storage_enabled() {
            self.give_up_storage_copy(id);
        }
        match state {
            NodeState::Device | NodeState::Host | NodeState::Storage => {
                if let Some(block) = device {
                    self.free_device(block);
                }
                if let Some(block) = host {
                    self.free_host(block);
                }
            }
            NodeState::SwapToHost(_)
            | NodeState::SwapToDevice
            | NodeState::HostToStorage(_)
            | NodeState::StorageToHost => {
                let mut transfer = TransferId(transfer.expect("a node in flight names its copy"));
                if state == NodeState::StorageToHost {
                    // The swap-in behind the load reads the host block and writes the device
                    // block, after the load: it keeps both until it completes. A prefetch load
                    // with no swap-in behind keeps its host block itself.
                    let then = self.flight(transfer).and_then(|load| load.then);
                    transfer = self.swap_in_behind(transfer, then, id).unwrap_or(transfer);
                }
                let flight = self
                    .flight_mut(transfer)
                    .expect("the copy of a node in flight is known: a programming error otherwise");
                flight.reserved_device.extend(device);
                flight.reserved_host.extend(host);
            }
        }
    }

    /// The storage part of dropping node `id`, with a storage tier (without one no node is on
    /// it): uncounts its storage block (stored, or being stored), and tells the tier to forget
    /// it.
    fn give_up_storage_copy(&mut self, id: NodeId) {
        let node = self.tree.node(id);
        let (stored, hash, state) = (node.stored(), node.hash(), node.state());
        if stored || matches!(state, NodeState::HostToStorage(_)) {
            self.storage_used -= 1;
        }
        // The tier may hold it (stored, or loaded from it once): told to forget it, but a node
        // whose STORE or LOAD is in flight only once that copy completed (detached).
        self.forget_dropped(hash, state);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::BlockHash;
    use crate::tree::{EvictionPolicy, Tree};

    /// The fate of every kind of victim, by tier, tiers below and write policy (DESIGN §4.3).
    #[test]
    fn a_victims_fate_follows_its_copies_the_tiers_below_and_the_write_policy() {
        let mut tree = Tree::new(EvictionPolicy::Lru);
        let mut node = |device: bool, host: bool, stored: bool, hits: u32| {
            let id = tree.insert(NodeId::ROOT, BlockHash(tree.len() as u128 + 1), |node| {
                node.set_device(device.then_some(1));
                node.set_host(host.then_some(2));
                node.set_state(if device { NodeState::Device } else { NodeState::Host });
                node.set_stored(stored);
                for _ in 1..hits {
                    node.count_hit();
                }
            });
            tree.node(id).clone()
        };
        let (device_only, backed_up, hit_twice) =
            (node(true, false, false, 1), node(true, true, false, 1), node(true, false, false, 2));
        let (host_only, host_stored) = (node(false, true, false, 1), node(false, true, true, 1));
        let below = |host, storage_up, write_policy| Below { host, storage_up, write_policy };
        let back = below(true, false, WritePolicy::WriteBack);
        let selective = below(true, false, WritePolicy::WriteThroughSelective { threshold: 2 });
        let cases = [
            (&device_only, Tier::Device, below(false, false, WritePolicy::WriteBack), Fate::Drop),
            (&device_only, Tier::Device, back, Fate::WriteBack),
            (
                &device_only,
                Tier::Device,
                below(true, false, WritePolicy::WriteThrough),
                Fate::WriteBack,
            ),
            (&device_only, Tier::Device, selective, Fate::Drop),
            (&hit_twice, Tier::Device, selective, Fate::WriteBack),
            (&backed_up, Tier::Device, back, Fate::DropCopy),
            (&backed_up, Tier::Host, below(true, true, WritePolicy::WriteBack), Fate::DropCopy),
            (&host_stored, Tier::Host, below(true, true, WritePolicy::WriteBack), Fate::DropCopy),
            (&host_stored, Tier::Host, back, Fate::DropCopy),
            (&host_only, Tier::Host, below(true, true, WritePolicy::WriteBack), Fate::Store),
            (&host_only, Tier::Host, back, Fate::Drop),
        ];
        for (index, &(node, tier, below, expected)) in cases.iter().enumerate() {
            assert_eq!(fate(node, tier, below), expected, "case {index}: {tier:?}, {below:?}");
        }
    }
}
