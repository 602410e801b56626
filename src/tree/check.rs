//! The tree's half of `check_invariants()`: structure, prefix closure, the child index and the
//! evictable sets.
//!
//! Everything here scans the whole tree; it is for tests and debugging, never the hot path.

use super::policy::EvictSet;
use super::{Membership, NodeId, NodeState, Tree};

impl Tree {
    /// Checks invariants 3 (prefix closure, reachability) and 5 (evictable sets), plus the
    /// tree's own bookkeeping (index, sibling lists, device child counts, the policy's order).
    /// Returns the number of the broken invariant and what is wrong.
    pub fn check(&self) -> Result<(), (u8, String)> {
        self.check_structure().map_err(|detail| (3, detail))?;
        self.check_sets().map_err(|detail| (5, detail))
    }

    fn check_structure(&self) -> Result<(), String> {
        let mut live = 0;
        for (slot, node) in self.nodes.iter().enumerate() {
            let id = NodeId(slot as u32);
            if !self.is_live(id) {
                continue;
            }
            live += 1;
            if id != NodeId::ROOT {
                self.check_links(id)?;
            }
            let (mut children, mut device_children, mut upper_children) = (0, 0, 0u32);
            let mut previous = NodeId::NONE;
            for child in self.children(id) {
                let child_node = &self.nodes[child.index()];
                if child_node.parent != id || child_node.prev_sibling != previous {
                    return Err(format!("{child:?} is linked under {id:?} but points elsewhere"));
                }
                children += 1;
                device_children += u32::from(child_node.device().is_some());
                upper_children += u32::from(child_node.is_upper());
                if id != NodeId::ROOT && node.state().storage_only() && child_node.is_upper() {
                    return Err(format!("{child:?} is above storage under storage-only {id:?}"));
                }
                previous = child;
                if children > self.nodes.len() {
                    return Err(format!("the child list of {id:?} loops"));
                }
            }
            for (what, counted, actual) in [
                ("on device", node.device_children, device_children),
                ("above storage", node.upper_children, upper_children),
            ] {
                let agrees = match counted {
                    super::COUNT_SATURATED => actual >= u32::from(counted),
                    counted => actual == u32::from(counted),
                };
                if !agrees {
                    return Err(format!(
                        "{id:?} counts {counted} children {what} but has {actual}"
                    ));
                }
            }
        }
        if live != self.index.len() + 1 {
            return Err(format!("{} live nodes but {} indexed", live - 1, self.index.len()));
        }
        if let Some(dead) = self.index.ids().find(|&id| !self.is_live(id) || id == NodeId::ROOT) {
            return Err(format!("the child index holds {dead:?}, not a live node"));
        }
        self.index.check(&self.nodes)?;
        let mut free = 0;
        let mut slot = self.free_slots;
        while let Some(id) = slot.some() {
            if self.is_live(id) {
                return Err(format!("the free slot list holds live {id:?}"));
            }
            free += 1;
            if free > self.nodes.len() {
                return Err("the free slot list loops".into());
            }
            slot = self.nodes[id.index()].next_sibling;
        }
        if live + free != self.nodes.len() {
            return Err(format!("{} slots: {live} live, {free} free", self.nodes.len()));
        }
        Ok(())
    }

    fn check_sets(&self) -> Result<(), String> {
        for (slot, node) in self.nodes.iter().enumerate() {
            let id = NodeId(slot as u32);
            if !self.is_live(id) {
                continue;
            }
            let expected = self.membership(id);
            if node.membership() != expected {
                return Err(format!(
                    "{id:?} is filed in {:?} but belongs in {expected:?}",
                    node.membership()
                ));
            }
        }
        // A front is a member the policy does not hold: it must come before all it holds.
        for set in [EvictSet::Device, EvictSet::Host] {
            let Some(front) = self.front.of(set) else { continue };
            if !self.is_live(front)
                || self.nodes[front.index()].membership() != Membership::NONE.with(set)
            {
                return Err(format!("{front:?}, the front of the {set:?} set, is not in it alone"));
            }
            if !self.policy.would_come_first(front, set) {
                return Err(format!("{front:?}, the front of the {set:?} set, is not its first"));
            }
        }
        let is_front = |id: NodeId| {
            [EvictSet::Device, EvictSet::Host].iter().any(|&set| self.front.of(set) == Some(id))
        };
        let membership = |id: NodeId| -> Option<Membership> {
            self.is_live(id).then(|| {
                if is_front(id) {
                    Membership::NONE
                } else {
                    self.nodes[id.index()].membership()
                }
            })
        };
        self.policy.check(&membership)
    }

    fn check_links(&self, id: NodeId) -> Result<(), String> {
        let node = &self.nodes[id.index()];
        if !self.is_live(node.parent) {
            return Err(format!("{id:?} hangs under a removed node {:?}", node.parent));
        }
        let parent = &self.nodes[node.parent.index()];
        if self.child(node.parent, node.hash()) != Some(id) {
            return Err(format!("{id:?} is not indexed under its parent"));
        }
        if node.device().is_some() && node.parent != NodeId::ROOT && parent.device().is_none() {
            return Err(format!("{id:?} has a device block but its parent does not"));
        }
        let state = node.state();
        if node.device().is_none() && node.host().is_none() && !state.storage_only() {
            return Err(format!("{id:?} ({}) holds no block at all", state.name()));
        }
        if state.storage_only() && (node.device().is_some() || node.host().is_some()) {
            return Err(format!("{id:?} is storage-only but holds a block"));
        }
        let needs_storage = matches!(state, NodeState::Storage | NodeState::StorageToHost);
        if needs_storage && !node.stored() {
            return Err(format!("{id:?} is {} without a storage copy", state.name()));
        }
        Ok(())
    }
}
