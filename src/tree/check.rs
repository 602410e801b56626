//! The tree's half of `check_invariants()`: structure, prefix closure and candidate sets.
//!
//! Everything here scans the whole tree; it is for tests and debugging, never the hot path.

use super::{NodeId, Tree, IN_CLAIMABLE_SET, IN_DEVICE_SET, IN_HOST_SET, NO_BLOCK};

impl Tree {
    /// Checks SPEC invariants 3 (prefix closure, reachability) and 5 (candidate sets), plus the
    /// tree's own bookkeeping (index, sibling lists, child counts, depths). Returns the number of
    /// the broken invariant and what is wrong.
    pub fn check(&self) -> Result<(), (u8, String)> {
        self.check_structure().map_err(|detail| (3, detail))?;
        self.check_candidates().map_err(|detail| (5, detail))
    }

    fn check_structure(&self) -> Result<(), String> {
        let mut live = 0;
        for (slot, node) in self.nodes.iter().enumerate() {
            let id = NodeId(slot as u32);
            if id != NodeId::ROOT && node.parent == NodeId::NONE {
                continue;
            }
            live += 1;
            if id != NodeId::ROOT {
                self.check_links(id)?;
            }
            let (mut children, mut device_children) = (0, 0);
            let mut previous = NodeId::NONE;
            for child in self.children(id) {
                let child_node = &self.nodes[child.index()];
                if child_node.parent != id || child_node.prev_sibling != previous {
                    return Err(format!("{child:?} is linked under {id:?} but points elsewhere"));
                }
                children += 1;
                device_children += u32::from(child_node.device != NO_BLOCK);
                previous = child;
                if children > self.nodes.len() {
                    return Err(format!("the child list of {id:?} loops"));
                }
            }
            if children != node.child_count as usize || device_children != node.device_child_count {
                return Err(format!(
                    "{id:?} counts {} children ({} on device) but has {children} ({device_children})",
                    node.child_count, node.device_child_count
                ));
            }
        }
        if live != self.children.len() + 1 {
            return Err(format!(
                "{} live nodes but {} indexed children",
                live - 1,
                self.children.len()
            ));
        }
        Ok(())
    }

    fn check_candidates(&self) -> Result<(), String> {
        for (slot, node) in self.nodes.iter().enumerate() {
            let id = NodeId(slot as u32);
            if id != NodeId::ROOT && node.parent == NodeId::NONE {
                if node.filed != 0 {
                    return Err(format!("removed slot {id:?} is still filed"));
                }
                continue;
            }
            let expected = if id == NodeId::ROOT { 0 } else { self.predicates(id) };
            if node.filed != expected {
                return Err(format!(
                    "{id:?} is filed as {:#b} but should be {expected:#b}",
                    node.filed
                ));
            }
            let key = node.key(id);
            let sets = [
                (IN_DEVICE_SET, &self.device_candidates, "device"),
                (IN_HOST_SET, &self.host_candidates, "host"),
                (IN_CLAIMABLE_SET, &self.claimable, "claimable"),
            ];
            for (bit, set, name) in sets {
                if (node.filed & bit != 0) != set.contains(&key) {
                    return Err(format!("{id:?} and the {name} candidate set disagree"));
                }
            }
        }
        let filed = |bit: u8| self.nodes.iter().filter(|node| node.filed & bit != 0).count();
        if filed(IN_DEVICE_SET) != self.device_candidates.len()
            || filed(IN_HOST_SET) != self.host_candidates.len()
            || filed(IN_CLAIMABLE_SET) != self.claimable.len()
        {
            return Err("a candidate set holds a node that is not filed in it".into());
        }
        Ok(())
    }

    fn check_links(&self, id: NodeId) -> Result<(), String> {
        let node = &self.nodes[id.index()];
        if !self.is_live(node.parent) {
            return Err(format!("{id:?} hangs under a removed node {:?}", node.parent));
        }
        let parent = &self.nodes[node.parent.index()];
        if self.child(node.parent, node.hash) != Some(id) {
            return Err(format!("{id:?} is not indexed under its parent"));
        }
        if node.depth != parent.depth + 1 {
            return Err(format!("{id:?} has depth {} under depth {}", node.depth, parent.depth));
        }
        if node.device != NO_BLOCK && node.parent != NodeId::ROOT && parent.device == NO_BLOCK {
            return Err(format!("{id:?} has a device block but its parent does not"));
        }
        if node.device == NO_BLOCK && node.host == NO_BLOCK {
            return Err(format!("{id:?} holds no block at all"));
        }
        Ok(())
    }
}
