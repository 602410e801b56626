//! A serializable picture of the top of the tree, for `kvctl tree`.
//!
//! The snapshot is flat (each node names its parent) so that a deep tree neither recurses nor
//! nests: nodes come in depth-first order, children by hash, down to a maximum depth.

use serde::{Serialize, Serializer};

use super::{NodeId, NodeState, Tree};
use crate::hash::BlockHash;

/// The nodes of the tree down to some depth.
#[derive(Clone, Debug, Serialize)]
pub struct TreeSnapshot {
    /// Cached blocks in the whole tree.
    pub total_nodes: usize,
    pub max_depth: u32,
    /// The nodes down to `max_depth`, depth-first; the root is not listed.
    pub nodes: Vec<SnapshotNode>,
}

/// One node of a [`TreeSnapshot`].
#[derive(Clone, Debug, Serialize)]
pub struct SnapshotNode {
    pub id: NodeId,
    /// `None` under the root.
    pub parent: Option<NodeId>,
    pub depth: u32,
    pub hash: BlockHash,
    /// Serialised by name (`"device"`, `"swap_to_host(evict)"`, ...), as kvctl prints it.
    #[serde(serialize_with = "serialize_state_name")]
    pub state: NodeState,
    pub device: Option<u32>,
    pub host: Option<u32>,
    pub ref_count: u32,
    pub hit_count: u32,
    /// The eviction policy's recency of the node (LRU: the order of its last release).
    pub last_access: u64,
    pub children: u32,
}

impl Tree {
    /// The nodes from depth 1 to `max_depth`.
    pub fn snapshot(&self, max_depth: u32) -> TreeSnapshot {
        let mut nodes = Vec::new();
        let mut stack: Vec<(NodeId, u32)> = if max_depth > 0 {
            self.sorted_children(NodeId::ROOT).into_iter().map(|id| (id, 1)).collect()
        } else {
            Vec::new()
        };
        while let Some((id, depth)) = stack.pop() {
            let node = self.node(id);
            nodes.push(SnapshotNode {
                id,
                parent: node.parent().filter(|&parent| parent != NodeId::ROOT),
                depth,
                hash: node.hash(),
                state: node.state(),
                device: node.device(),
                host: node.host(),
                ref_count: node.ref_count(),
                hit_count: node.hit_count(),
                last_access: self.last_access(id),
                children: self.child_count(id) as u32,
            });
            if depth < max_depth {
                stack.extend(self.sorted_children(id).into_iter().map(|child| (child, depth + 1)));
            }
        }
        TreeSnapshot { total_nodes: self.len(), max_depth, nodes }
    }

    /// Children in reverse hash order, so that popping from a stack visits them by hash.
    fn sorted_children(&self, id: NodeId) -> Vec<NodeId> {
        let mut children: Vec<NodeId> = self.children(id).collect();
        children.sort_unstable_by_key(|&child| std::cmp::Reverse(self.node(child).hash()));
        children
    }
}

fn serialize_state_name<S: Serializer>(
    state: &NodeState,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(state.name())
}
