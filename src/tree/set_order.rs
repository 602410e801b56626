//! The calls the tree's slice forms make on an eviction policy ([`SetOrder`]), for a loop over
//! many nodes that dispatches on the policy once: implemented by the dispatching [`Policies`]
//! and by every [`Policy`]. Its own module, so that no module that calls a policy's own methods
//! has both traits in scope.

use super::policy::{EvictSet, Membership, Policies, Policy};
use super::NodeId;
use crate::hash::BlockHash;

/// The calls the tree's slice forms make on an eviction policy, implemented by the dispatching
/// [`Policies`] and by every [`Policy`]: a loop over many nodes dispatches on the policy once
/// and runs with the policy itself ([`crate::tree::Tree::write_back_run`]), where a call
/// through [`Policies`] tests the policy's tag on every call (and inlines every policy's arm).
pub trait SetOrder {
    fn first(&self, set: EvictSet) -> Option<NodeId>;
    fn enter(&mut self, node: NodeId, sets: Membership);
    fn leave(&mut self, node: NodeId, sets: Membership);
    fn would_come_first(&self, node: NodeId, set: EvictSet) -> bool;
    /// [`Policy::removing`], `key` asked for only by a policy that reads it.
    fn removing(
        &mut self,
        node: NodeId,
        key: impl FnOnce() -> BlockHash,
        sole_child_of: Option<NodeId>,
    );
}

impl SetOrder for Policies {
    #[inline(always)]
    fn first(&self, set: EvictSet) -> Option<NodeId> {
        Policies::first(self, set)
    }
    #[inline(always)]
    fn enter(&mut self, node: NodeId, sets: Membership) {
        Policies::enter(self, node, sets);
    }
    #[inline(always)]
    fn leave(&mut self, node: NodeId, sets: Membership) {
        Policies::leave(self, node, sets);
    }
    #[inline(always)]
    fn would_come_first(&self, node: NodeId, set: EvictSet) -> bool {
        Policies::would_come_first(self, node, set)
    }
    #[inline(always)]
    fn removing(
        &mut self,
        node: NodeId,
        key: impl FnOnce() -> BlockHash,
        sole_child_of: Option<NodeId>,
    ) {
        Policies::removing(self, node, key, sole_child_of);
    }
}

impl<P: Policy> SetOrder for P {
    #[inline(always)]
    fn first(&self, set: EvictSet) -> Option<NodeId> {
        Policy::first(self, set)
    }
    #[inline(always)]
    fn enter(&mut self, node: NodeId, sets: Membership) {
        Policy::enter(self, node, sets);
    }
    #[inline(always)]
    fn leave(&mut self, node: NodeId, sets: Membership) {
        Policy::leave(self, node, sets);
    }
    #[inline(always)]
    fn would_come_first(&self, node: NodeId, set: EvictSet) -> bool {
        Policy::would_come_first(self, node, set)
    }
    #[inline(always)]
    fn removing(
        &mut self,
        node: NodeId,
        key: impl FnOnce() -> BlockHash,
        sole_child_of: Option<NodeId>,
    ) {
        if P::HEARS_REMOVALS {
            Policy::removing(self, node, key(), sole_child_of);
        }
    }
}
