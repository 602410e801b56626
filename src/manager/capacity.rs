//! What an allocation would take, and whether it could get it, without changing anything: vLLM's
//! `can_fit_full_sequence`, SGLang's "free + evictable".
//!
//! 1. [`CacheManager::demand`] counts the device blocks `allocate` would take for a request: one
//!    per host or storage hit not yet given a block (a storage hit also takes a host block), and
//!    the blocks for the new and lookahead tokens beyond what the block table covers
//!    ([`CacheManager::fresh_blocks`], checked arithmetic: an absurd count is a typed error; an
//!    allocation without a host tier, whose hits are all on device, counts only these).
//! 2. [`CacheManager::obtainable_device_blocks`] counts free blocks, then what claims and
//!    evictions could free, up to a limit ([`count_evictable`]: every eviction of a tier's
//!    victim gives one block of that tier, whatever its fate, so the count is of victims, those
//!    there are and those their evictions would expose; O(1) when the sets' members alone
//!    reach the limit, else a walk of the sets in eviction order that stops at the limit: at
//!    most one visit per member, never a scan of the tree).
//! 3. [`CacheManager::can_allocate`] puts the two together.

use std::ops::ControlFlow;

use serde::Serialize;

use super::evict::Tier;
use super::ids::IdMap;
use super::{AllocateError, CacheManager, Request, RequestId};
use crate::tree::policy::EvictSet;
use crate::tree::{NodeId, NodeState, Tree};

/// What `allocate` would need and what it could get, counted without changing anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct AllocationCheck {
    /// Device blocks the allocation would take.
    pub needed: usize,
    /// Device blocks it could get (free, claimable, evictable), counted up to `needed`: when it
    /// fits, this equals `needed` even if more could be had.
    pub available: usize,
}

impl AllocationCheck {
    /// Whether `allocate` with the same arguments would succeed now.
    pub fn fits(&self) -> bool {
        self.available >= self.needed
    }
}

/// The device blocks one allocation takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Demand {
    /// Host and storage hits that get a device block and a swap-in.
    pub swap_ins: usize,
    /// Storage hits, which also get a host block and a load.
    pub loads: usize,
    /// Blocks for the new and lookahead tokens.
    pub fresh: usize,
}

impl Demand {
    pub fn blocks(&self) -> usize {
        self.swap_ins + self.fresh
    }
}

impl CacheManager {
    /// Whether `allocate(request, new_tokens, lookahead)` would succeed now, and how many blocks it
    /// needs; changes nothing (module flow).
    pub fn can_allocate(
        &mut self,
        request: RequestId,
        new_tokens: usize,
        lookahead: usize,
    ) -> Result<AllocationCheck, AllocateError> {
        let record = self.requests.get(&request).ok_or(AllocateError::UnknownRequest(request))?;
        if record.failed {
            return Err(AllocateError::RequestFailed(request));
        }
        let hits_end = self.hits_end(record);
        let demand = self.demand(request, record, hits_end, new_tokens, lookahead)?;
        let needed = demand.blocks();
        let available = self.obtainable_device_blocks(needed);
        if available >= needed && self.obtainable_host_blocks(demand.loads) < demand.loads {
            // The loads cannot get their host blocks: it does not fit, whatever the device has.
            return Ok(AllocationCheck { needed, available: needed - 1 });
        }
        Ok(AllocationCheck { needed, available })
    }

    /// Device blocks an allocation could get now: the free ones, then those that claims of blocks
    /// being swapped out and evictions of unheld cached blocks would free, counted up to `limit`.
    /// Changes nothing.
    pub fn obtainable_device_blocks(&mut self, limit: usize) -> usize {
        let free = self.device.free_count();
        if free >= limit {
            return limit;
        }
        free + self.reclaimable_up_to(limit - free)
    }

    /// Host blocks an allocation's loads could get now, counted up to `limit`: free ones, then
    /// what evictions of host candidates could give (the cascade included). Changes nothing.
    pub(super) fn obtainable_host_blocks(&mut self, limit: usize) -> usize {
        let free = self.host.free_count();
        if free >= limit {
            return limit;
        }
        let (gone, exposed) = &mut self.scratch_reclaim;
        free + count_evictable(&self.tree, Tier::Host, gone, exposed, limit - free)
    }

    /// How many device blocks beyond the free ones evictions and claims could provide, counted up
    /// to `limit`. Changes nothing.
    pub(super) fn reclaimable_up_to(&mut self, limit: usize) -> usize {
        let (gone, exposed) = &mut self.scratch_reclaim;
        count_evictable(&self.tree, Tier::Device, gone, exposed, limit)
    }

    /// Where `record`'s hits end for an allocation: its path's end, or the first block of it the
    /// storage tier reported missing (still held by some request: no hit, DESIGN §9), or its
    /// first storage-only block while the tier is down (`tier_health`).
    pub(super) fn hits_end(&self, record: &Request) -> usize {
        if self.unloadable.is_empty() && !self.tier.is_down() {
            return record.path.len();
        }
        self.first_lost_hit(record).unwrap_or(record.path.len())
    }

    /// The device blocks `allocate` takes for `record` (module flow, step 1), its hits ending at
    /// path position `hits_end`.
    #[inline]
    pub(super) fn demand(
        &self,
        request: RequestId,
        record: &Request,
        hits_end: usize,
        new_tokens: usize,
        lookahead: usize,
    ) -> Result<Demand, AllocateError> {
        let hits = record.path.get(record.table.len()..hits_end).unwrap_or_default();
        let (mut swap_ins, mut loads) = (0, 0);
        for &id in hits {
            match self.tree.node(id).state() {
                NodeState::Host => swap_ins += 1,
                NodeState::Storage => loads += 1,
                // A prefetch brings it to host; it needs a device block to go on.
                NodeState::StorageToHost => {
                    swap_ins += usize::from(self.tree.node(id).device().is_none());
                }
                _ => {}
            }
        }
        swap_ins += loads;
        let covered = record.table.len().max(hits_end);
        let fresh = self.fresh_blocks(request, record, covered, new_tokens, lookahead)?;
        Ok(Demand { swap_ins, loads, fresh })
    }

    /// The fresh blocks of [`CacheManager::demand`]: those that `new_tokens` and `lookahead`
    /// more tokens need past the `covered` positions of `record`'s block table and hits.
    #[inline]
    pub(super) fn fresh_blocks(
        &self,
        request: RequestId,
        record: &Request,
        covered: usize,
        new_tokens: usize,
        lookahead: usize,
    ) -> Result<usize, AllocateError> {
        let block_tokens = self.config.block_tokens as usize;
        Ok(record
            .tokens
            .checked_add(new_tokens)
            .and_then(|tokens| tokens.checked_add(lookahead))
            .ok_or(AllocateError::TooManyTokens { request, new_tokens, lookahead })?
            .div_ceil(block_tokens)
            .saturating_sub(covered))
    }
}

/// Counts, up to `limit`, the blocks of `tier` (device or host) that claims and evictions could
/// give: every claimable node (device), every member of the tier's set, and every node that
/// joins the set once the children counted before it have left the tier (evicted, each
/// candidate's cascade followed as soon as it is found, so that a shortfall that a few chains
/// cover stops early). A host victim that keeps a device copy stays above storage: its parent
/// keeps it. `gone` (children counted as gone, per parent) and `exposed` (parents whose last
/// such child was counted) are scratch space.
pub(super) fn count_evictable(
    tree: &Tree,
    tier: Tier,
    gone: &mut IdMap<NodeId, u32>,
    exposed: &mut Vec<NodeId>,
    limit: usize,
) -> usize {
    let sets: &[EvictSet] = match tier {
        Tier::Device => &[EvictSet::Claimable, EvictSet::Device],
        Tier::Host => &[EvictSet::Host],
        Tier::Storage => unreachable!("storage blocks are counted, not obtained"),
    };
    let direct: usize = sets.iter().map(|&set| tree.count(set)).sum();
    if direct >= limit {
        return limit;
    }
    gone.clear();
    exposed.clear();
    let mut count = direct;
    let mut expose = |id: NodeId, exposed: &mut Vec<NodeId>| {
        let node = tree.node(id);
        let parent = node.parent().expect("a counted node is not the root");
        if parent == NodeId::ROOT || (tier == Tier::Host && node.device().is_some()) {
            return;
        }
        let children = match tier {
            Tier::Device => tree.device_child_count(parent),
            _ => tree.upper_child_count(parent),
        };
        let set = if tier == Tier::Device { EvictSet::Device } else { EvictSet::Host };
        if counted_gone(gone, parent, children) == children
            && tree.joins_once_children_go(parent, set)
        {
            exposed.push(parent);
        }
    };
    let mut reached = false;
    for &set in sets {
        tree.visit(set, |id| {
            expose(id, exposed);
            while let Some(parent) = exposed.pop() {
                count += 1;
                if count >= limit {
                    reached = true;
                    return ControlFlow::Break(());
                }
                expose(parent, exposed);
            }
            ControlFlow::Continue(())
        });
        if reached {
            return limit;
        }
    }
    count
}

/// Counts one more child of `parent` (which has `children` of the kind counted) as gone, and
/// returns how many are gone. The only child of its kind is gone at once: a chain, the usual
/// shape, counts without touching the map (each child is counted once).
fn counted_gone(gone: &mut IdMap<NodeId, u32>, parent: NodeId, children: u32) -> u32 {
    if children == 1 {
        return 1;
    }
    let removed = gone.entry(parent).or_insert(0);
    *removed += 1;
    *removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::BlockHash;
    use crate::tree::{EvictionPolicy, SwapOut};

    /// What a node of a test tree is: its state and blocks (and whether something holds it).
    #[derive(Clone, Copy)]
    enum Kind {
        /// Idle on device, without a host copy.
        Device,
        /// Idle on device with a valid host copy (a backup).
        Backup,
        /// Host only.
        Host,
        /// On the storage tier only.
        Storage,
        /// Being copied to host as an eviction (claimable), its device block still there.
        Evicting,
        /// Being copied to host, its device block claimed by an allocation.
        Claimed,
        /// Being copied to host as a backup (stays on device).
        BackingUp,
        /// Host only, its host copy being written to storage as a backup.
        StoringBackup,
        /// Any of the above, held by a request.
        Held(&'static Kind),
    }

    /// A tree's nodes, each `(parent index or None for the root, kind)`, parents first.
    type Shape = &'static [(Option<usize>, Kind)];

    /// What a case is called, its tree, and the blocks its dry run must count.
    type Case = (&'static str, Shape, usize);

    /// A tree of `nodes` (each `(parent index or None for the root, kind)`, parents first).
    fn tree_of(policy: EvictionPolicy, nodes: Shape) -> Tree {
        let mut tree = Tree::new(policy);
        let mut ids: Vec<NodeId> = Vec::new();
        for (index, &(parent, kind)) in nodes.iter().enumerate() {
            let parent = parent.map_or(NodeId::ROOT, |parent| ids[parent]);
            let block = index as u32;
            let id = tree.insert(parent, BlockHash(index as u128 + 1), |node| {
                let mut kind = kind;
                if let Kind::Held(inner) = kind {
                    node.hold();
                    kind = *inner;
                }
                let (device, host, state) = match kind {
                    Kind::Device => (true, false, NodeState::Device),
                    Kind::Backup => (true, true, NodeState::Device),
                    Kind::Host => (false, true, NodeState::Host),
                    Kind::Storage => (false, false, NodeState::Storage),
                    Kind::Evicting => (true, true, NodeState::SwapToHost(SwapOut::Evict)),
                    Kind::Claimed => (false, true, NodeState::SwapToHost(SwapOut::Claimed)),
                    Kind::BackingUp => (true, true, NodeState::SwapToHost(SwapOut::Backup)),
                    Kind::StoringBackup => {
                        (false, true, NodeState::HostToStorage(crate::tree::StoreOut::Backup))
                    }
                    Kind::Held(_) => unreachable!("one level of holding"),
                };
                node.set_device(device.then_some(block));
                node.set_host(host.then_some(block));
                node.set_state(state);
                if matches!(kind, Kind::Storage) {
                    node.set_stored(true);
                }
                if matches!(
                    kind,
                    Kind::Evicting | Kind::Claimed | Kind::BackingUp | Kind::StoringBackup
                ) {
                    node.set_transfer(Some(1));
                }
            });
            ids.push(id);
        }
        tree.check().unwrap();
        tree
    }

    /// The dry runs count what evictions would give, hand-counted per shape of parent: chains
    /// (counted without the map), parents of several children of the kind counted, cascades,
    /// and children that keep their parent (held, a device or host copy that stays, a copy in
    /// flight) or do not count (storage-only, claimed, host-only below a device node).
    #[test]
    fn the_dry_runs_count_each_parent_once_its_every_child_of_the_kind_counted_is_gone() {
        use Kind::*;
        const HELD_DEVICE: Kind = Held(&Device);
        const HELD_HOST: Kind = Held(&Host);
        let device_shapes: &[Case] = &[
            ("a chain", &[(None, Device), (Some(0), Device), (Some(1), Device)], 3),
            ("two leaves", &[(None, Device), (Some(0), Device), (Some(0), Device)], 3),
            ("a held leaf", &[(None, Device), (Some(0), Device), (Some(0), HELD_DEVICE)], 1),
            ("a held parent", &[(None, HELD_DEVICE), (Some(0), Device)], 1),
            ("a leaf backing up", &[(None, Device), (Some(0), Device), (Some(0), BackingUp)], 1),
            ("a claimable leaf", &[(None, Device), (Some(0), Device), (Some(0), Evicting)], 3),
            ("a claimed leaf", &[(None, Device), (Some(0), Device), (Some(0), Claimed)], 2),
            ("a host-only leaf", &[(None, Device), (Some(0), Device), (Some(0), Host)], 2),
            (
                "a cascade over two levels",
                &[
                    (None, Device),
                    (Some(0), Device),
                    (Some(0), Device),
                    (Some(2), Device),
                    (Some(2), Backup),
                ],
                5,
            ),
        ];
        let host_shapes: &[Case] = &[
            ("a chain", &[(None, Host), (Some(0), Host), (Some(1), Host)], 3),
            ("two leaves", &[(None, Host), (Some(0), Host), (Some(0), Host)], 3),
            ("a held leaf", &[(None, Host), (Some(0), Host), (Some(0), HELD_HOST)], 1),
            ("a held parent", &[(None, HELD_HOST), (Some(0), Host)], 1),
            ("a backup leaf", &[(None, Backup), (Some(0), Host), (Some(0), Backup)], 2),
            ("a storage-only leaf", &[(None, Host), (Some(0), Host), (Some(0), Storage)], 2),
            ("a parent storing", &[(None, StoringBackup), (Some(0), Host)], 1),
            ("a device parent", &[(None, Device), (Some(0), Host), (Some(0), Host)], 2),
            (
                "a cascade over two levels",
                &[
                    (None, Host),
                    (Some(0), Host),
                    (Some(0), Host),
                    (Some(1), Host),
                    (Some(2), Host),
                    (Some(2), Host),
                ],
                6,
            ),
        ];
        let (mut gone, mut exposed) = (IdMap::default(), Vec::new());
        for policy in EvictionPolicy::ALL.iter().copied() {
            for &(what, nodes, expected) in device_shapes {
                let tree = tree_of(policy, nodes);
                let counted = count_evictable(&tree, Tier::Device, &mut gone, &mut exposed, 100);
                assert_eq!(counted, expected, "device blocks, {what}, {policy:?}");
                assert_eq!(
                    count_evictable(&tree, Tier::Device, &mut gone, &mut exposed, 2),
                    expected.min(2)
                );
            }
            for &(what, nodes, expected) in host_shapes {
                let tree = tree_of(policy, nodes);
                let counted = count_evictable(&tree, Tier::Host, &mut gone, &mut exposed, 100);
                assert_eq!(counted, expected, "host blocks, {what}, {policy:?}");
            }
        }
    }
}
