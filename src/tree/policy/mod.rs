//! Eviction policies: the order in which the tree's evictable sets give up their members.
//!
//! The tree decides *which* nodes may be evicted (DESIGN §4), and keeps one evictable set
//! per kind of victim ([`EvictSet`]): device candidates (a device copy, no child with one, not
//! held, nothing in flight), host candidates (a valid host copy, no child above the storage tier,
//! not held), claimable nodes (an eviction to host in flight whose device block is not claimed
//! yet) and storage candidates (storage-only leaves, not held). A node may be in the device and
//! host sets at once; a storage candidate is in no other set. The policy decides *in which order*: it is told
//! every change of membership and every access, and answers with the first member of a set.
//!
//! Core types: [`Policy`] (the contract), [`EvictionPolicy`] (the names a configuration picks
//! from), [`Policies`] (the tree's policy, dispatched statically over the registered ones).
//!
//! One change to a node, as the tree drives it ([`super::Tree::update`]):
//! 1. if the node is filed and is being accessed or changes sets, [`Policy::leave`] its sets;
//! 2. [`Policy::touch`] with the access, if any (the node is in no set at that moment);
//! 3. [`Policy::enter`] its new sets, if any.
//!
//! Accesses come in a fixed order: a match touches its path from the root down, a commit its new
//! blocks in order, and the end of a request releases its path tail first, so that for equal
//! recency a deeper block goes first (the tail of a prefix before its head). A node's key
//! (its block hash) and [`Policy::request_started`] give a policy what it needs to index the
//! future: the offline optimum (`optimal`, Belady under the prefix constraint) is built with
//! each key's future request numbers, counts requests with `request_started`, and at each touch
//! sets the node's next use, keeping its members ordered by farthest next use. Because a parent
//! is used whenever a child is, such an order never puts a parent before its descendants, and
//! the tree only files leaves anyway.
//!
//! Besides the changes of nodes, a policy hears of requests (all hooks have no-op defaults, so a
//! policy that needs none implements none): [`Policy::request_started`] at a match, with where
//! the match ended, returning a tag the manager keeps with the request; [`Policy::request_ending`]
//! with that tag before the end of the request releases its path, and [`Policy::turn_ended`]
//! after a finish; [`Policy::removing`] when a node leaves the tree; [`Policy::configure`] with
//! the shape of the tiers. `conv` uses them to follow conversations; `optimal` counts requests.
//!
//! Adding a policy: write `policy/NAME.rs` with a type implementing [`Policy`], and add one line
//! to the `registry!` invocation below (its name, variant and type). Everything else (the
//! `--eviction` options, `CacheConfig`, `check_invariants`, the randomized tests, which run for
//! every registered online policy) picks it up from there. An offline policy (one that needs
//! the future, as `optimal`) is named in [`EvictionPolicy::is_offline`] too.

mod conv;
mod lru;
mod optimal;
mod recency;

use std::ops::ControlFlow;

use serde::{Serialize, Serializer};

use super::NodeId;
use crate::hash::BlockHash;
pub use optimal::FutureUses;

/// A kind of victim, with the set of nodes that can be it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvictSet {
    /// Device candidates: evicting one frees (or starts freeing) a device block.
    Device,
    /// Host candidates: evicting one frees a host block.
    Host,
    /// Nodes being evicted to host whose device block an allocation may claim at once.
    Claimable,
    /// Storage candidates: storage-only leaves, not held; evicting one frees a storage block.
    /// A storage-only node is in no other set.
    Storage,
}

impl EvictSet {
    pub const ALL: [EvictSet; 4] =
        [EvictSet::Device, EvictSet::Host, EvictSet::Claimable, EvictSet::Storage];

    const fn bit(self) -> u8 {
        match self {
            EvictSet::Device => 1,
            EvictSet::Host => 2,
            EvictSet::Claimable => 4,
            EvictSet::Storage => 8,
        }
    }
}

/// The evictable sets one node is in, as bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Membership(u8);

impl Membership {
    pub const NONE: Membership = Membership(0);
    pub const ALL: Membership = Membership(15);

    pub const fn from_bits(bits: u8) -> Membership {
        Membership(bits & Membership::ALL.0)
    }

    pub const fn bits(self) -> u8 {
        self.0
    }

    pub const fn with(self, set: EvictSet) -> Membership {
        Membership(self.0 | set.bit())
    }

    pub fn contains(self, set: EvictSet) -> bool {
        self.0 & set.bit() != 0
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

/// Why a node was touched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// A match held it (a prefix hit).
    Hit,
    /// A commit cached it, or found it cached already.
    Commit,
    /// The request holding it ended (it is released right after).
    Release,
}

/// Where a request's match ended, for [`Policy::request_started`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MatchEnd {
    /// The deepest node matched, if any, and whether it has no children.
    pub deepest: Option<(NodeId, bool)>,
    /// The key of the prompt's first block past the match, if the prompt has one.
    pub next_key: Option<BlockHash>,
}

/// The tiers a cache has, for [`Policy::configure`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierShape {
    pub device_blocks: u32,
    /// 0: no host tier.
    pub host_blocks: u32,
}

/// The contract of an eviction policy. The tree calls it on every change of a node's sets
/// (module flow); a policy keeps whatever per-node state it needs, indexed by node id.
pub trait Policy: Default + std::fmt::Debug {
    /// Makes room for per-node state of ids below `nodes` (the arena grew).
    fn reserve_nodes(&mut self, nodes: usize);
    /// A request started: its match ended at `matched` (see [`MatchEnd`]). Returns a tag that
    /// the manager keeps with the request and hands to [`Policy::request_ending`]. Called only
    /// for a policy that sets [`Policy::HEARS_REQUEST_STARTS`] (0 for the others).
    fn request_started(&mut self, _matched: MatchEnd) -> u8 {
        0
    }
    /// Whether [`Policy::request_started`] does anything: the tree skips the call (and working
    /// out where the match ended, at every match) otherwise. A policy that implements it sets
    /// this.
    const HEARS_REQUEST_STARTS: bool = false;
    /// The releases that follow (until the next call) end the request tagged `tag`.
    fn request_ending(&mut self, _tag: u8) {}
    /// A request finished (not aborted): `last` is the last node of its path, its prompt's end.
    fn turn_ended(&mut self, _last: NodeId) {}
    /// `node`, keyed by `key`, leaves the tree (after it left its sets). `sole_child_of` is its
    /// parent when that is not the root and has no other child: the parent becomes the end of
    /// the chain.
    fn removing(&mut self, _node: NodeId, _key: BlockHash, _sole_child_of: Option<NodeId>) {}
    /// Whether [`Policy::removing`] does anything: the tree skips the call (and reading the
    /// node's key for it) otherwise.
    const HEARS_REMOVALS: bool = false;
    /// The shape of the tiers, told before the first node and again when a tier is resized;
    /// kept across [`Policy::clear`].
    fn configure(&mut self, _tiers: TierShape) {}
    /// Whether [`Policy::touch`] wants to hear of accesses of this kind (the tree skips the call
    /// otherwise: most accesses of most policies change nothing).
    fn wants(&self, access: Access) -> bool;
    /// `node`, keyed by `key`, was accessed. It is in no set while this is called.
    fn touch(&mut self, node: NodeId, key: BlockHash, access: Access);
    /// `node`, in no set before, joins `sets` (not empty).
    fn enter(&mut self, node: NodeId, sets: Membership);
    /// `node` leaves every set; it was in exactly `sets` (not empty).
    fn leave(&mut self, node: NodeId, sets: Membership);
    /// The member of `set` to give up next.
    fn first(&self, set: EvictSet) -> Option<NodeId>;
    /// Whether `node`, in no set, would be [`Policy::first`] of `set` if it joined `set` alone
    /// now. `false` when unsure: the tree then hands it over with [`Policy::enter`] (it keeps
    /// a node that would come first as the set's front instead, see `Tree`).
    fn would_come_first(&self, _node: NodeId, _set: EvictSet) -> bool {
        false
    }
    fn len(&self, set: EvictSet) -> usize;
    /// Visits the members of `set` in the order they would be given up, until `visit` breaks.
    fn visit(&self, set: EvictSet, visit: &mut dyn FnMut(NodeId) -> ControlFlow<()>);
    /// The node's recency as this policy sees it, for snapshots (larger: more recent).
    fn stamp(&self, node: NodeId) -> u64;
    /// Forgets every member and every node's state.
    fn clear(&mut self);
    /// Checks the policy's own bookkeeping against the tree's: `membership(id)` is the sets the
    /// tree has filed node `id` in, `None` for ids that are not live nodes. Scans everything.
    fn check(&self, membership: &dyn Fn(NodeId) -> Option<Membership>) -> Result<(), String>;
    /// Bytes of heap memory held.
    fn heap_bytes(&self) -> usize;
}

/// Declares the registered policies: the name enum of configurations and the dispatching enum
/// of the tree, from one line per policy.
macro_rules! registry {
    ($($name:literal => $variant:ident($policy:ty), $doc:literal;)+) => {
        /// The eviction policies a cache can be configured with (`--eviction NAME`).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum EvictionPolicy {
            $(#[doc = $doc] $variant,)+
        }

        impl EvictionPolicy {
            /// Every registered policy.
            pub const ALL: &'static [EvictionPolicy] = &[$(EvictionPolicy::$variant,)+];

            pub fn name(self) -> &'static str {
                match self {
                    $(EvictionPolicy::$variant => $name,)+
                }
            }
        }

        /// The policy of one tree, dispatched statically (a policy is consulted several times
        /// per block, too often for an indirect call).
        // One per tree: the size of the largest variant costs nothing, where a box would add an
        // indirection to every call.
        #[allow(clippy::large_enum_variant)]
        #[derive(Debug)]
        // An explicit tag byte: each call compares it, where a tag folded into a policy's own
        // fields (a niche) takes several instructions to decode.
        #[repr(u8)]
        pub enum Policies {
            $($variant($policy),)+
        }

        impl Policies {
            pub fn new(policy: EvictionPolicy) -> Policies {
                match policy {
                    $(EvictionPolicy::$variant => Policies::$variant(<$policy>::default()),)+
                }
            }

            pub fn kind(&self) -> EvictionPolicy {
                match self {
                    $(Policies::$variant(_) => EvictionPolicy::$variant,)+
                }
            }
        }

        // Forwarding to the policy of the variant, one `match` per call (inlined).
        impl Policies {
            #[inline]
            pub fn reserve_nodes(&mut self, nodes: usize) {
                match self {
                    $(Policies::$variant(p) => p.reserve_nodes(nodes),)+
                }
            }
            #[inline]
            pub fn wants(&self, access: Access) -> bool {
                match self {
                    $(Policies::$variant(p) => p.wants(access),)+
                }
            }
            /// `matched` is worked out only for a policy that hears request starts (most do
            /// not); 0 for the others.
            #[inline]
            pub fn request_started(&mut self, matched: impl FnOnce() -> MatchEnd) -> u8 {
                match self {
                    $(Policies::$variant(p) => {
                        if <$policy as Policy>::HEARS_REQUEST_STARTS {
                            p.request_started(matched())
                        } else {
                            0
                        }
                    })+
                }
            }
            #[inline]
            pub fn hears_request_starts(&self) -> bool {
                match self {
                    $(Policies::$variant(_) => <$policy as Policy>::HEARS_REQUEST_STARTS,)+
                }
            }
            #[inline]
            pub fn request_ending(&mut self, tag: u8) {
                match self {
                    $(Policies::$variant(p) => p.request_ending(tag),)+
                }
            }
            #[inline]
            pub fn turn_ended(&mut self, last: NodeId) {
                match self {
                    $(Policies::$variant(p) => p.turn_ended(last),)+
                }
            }
            /// `key` is asked for only by a policy that reads it (most ignore it).
            #[inline]
            pub fn removing(
                &mut self,
                node: NodeId,
                key: impl FnOnce() -> BlockHash,
                sole_child_of: Option<NodeId>,
            ) {
                // Not `key()` in every arm: the compiler would then read the key before the
                // match, for every policy.
                match self {
                    $(Policies::$variant(p) => {
                        if <$policy as Policy>::HEARS_REMOVALS {
                            p.removing(node, key(), sole_child_of);
                        }
                    })+
                }
            }
            pub fn configure(&mut self, tiers: TierShape) {
                match self {
                    $(Policies::$variant(p) => p.configure(tiers),)+
                }
            }
            /// `key` is asked for only by a policy that reads it (most ignore it).
            #[inline]
            pub fn touch(&mut self, node: NodeId, key: impl FnOnce() -> BlockHash, access: Access) {
                match self {
                    $(Policies::$variant(p) => p.touch(node, key(), access),)+
                }
            }
            #[inline]
            pub fn enter(&mut self, node: NodeId, sets: Membership) {
                match self {
                    $(Policies::$variant(p) => p.enter(node, sets),)+
                }
            }
            #[inline]
            pub fn leave(&mut self, node: NodeId, sets: Membership) {
                match self {
                    $(Policies::$variant(p) => p.leave(node, sets),)+
                }
            }
            #[inline]
            pub fn first(&self, set: EvictSet) -> Option<NodeId> {
                match self {
                    $(Policies::$variant(p) => p.first(set),)+
                }
            }
            #[inline]
            pub fn would_come_first(&self, node: NodeId, set: EvictSet) -> bool {
                match self {
                    $(Policies::$variant(p) => p.would_come_first(node, set),)+
                }
            }
            #[inline]
            pub fn len(&self, set: EvictSet) -> usize {
                match self {
                    $(Policies::$variant(p) => p.len(set),)+
                }
            }
            #[inline]
            pub fn visit(&self, set: EvictSet, visit: &mut dyn FnMut(NodeId) -> ControlFlow<()>) {
                match self {
                    $(Policies::$variant(p) => p.visit(set, visit),)+
                }
            }
            #[inline]
            pub fn stamp(&self, node: NodeId) -> u64 {
                match self {
                    $(Policies::$variant(p) => p.stamp(node),)+
                }
            }
            #[inline]
            pub fn clear(&mut self) {
                match self {
                    $(Policies::$variant(p) => p.clear(),)+
                }
            }
            #[inline]
            pub fn check(&self, membership: &dyn Fn(NodeId) -> Option<Membership>) -> Result<(), String> {
                match self {
                    $(Policies::$variant(p) => p.check(membership),)+
                }
            }
            #[inline]
            pub fn heap_bytes(&self) -> usize {
                match self {
                    $(Policies::$variant(p) => p.heap_bytes(),)+
                }
            }
        }
    };
}

registry! {
    "lru" => Lru(lru::Lru), "Least recently used first (deeper first on equal recency); the default.";
    "conv" => Conv(conv::Conv), "Conversation-generation aging: blocks of conversations continued more often are kept longer, by the median think time per continuation.";
    "optimal" => Optimal(optimal::Optimal), "The offline optimum (farthest next use first): needs the trace's future, so `kvshm replay` only; an upper bound, not a policy to serve with.";
}

/// Runs `$body` with `$policy` bound to the policy itself inside `$policies` (a [`Policies`]):
/// one dispatch for a whole tree operation, whose calls on the policy are then direct and inline.
/// It lists the variants of `registry!` above (a policy missing here fails to compile).
macro_rules! with_policy {
    ($policies:expr, $policy:ident => $body:expr) => {
        match $policies {
            $crate::tree::policy::Policies::Lru($policy) => $body,
            $crate::tree::policy::Policies::Conv($policy) => $body,
            $crate::tree::policy::Policies::Optimal($policy) => $body,
        }
    };
}
pub(crate) use with_policy;

impl EvictionPolicy {
    /// Whether the policy needs the future (the requests to come), so that only a replay of a
    /// known trace can run it.
    pub fn is_offline(self) -> bool {
        matches!(self, EvictionPolicy::Optimal)
    }

    /// Every registered policy that can serve live requests.
    pub fn online() -> impl Iterator<Item = EvictionPolicy> {
        EvictionPolicy::ALL.iter().copied().filter(|policy| !policy.is_offline())
    }
}

impl Policies {
    /// Hands the offline policy the future it orders by; `false` (and nothing done) for an
    /// online one.
    pub fn foresee(&mut self, future: FutureUses) -> bool {
        match self {
            Policies::Optimal(optimal) => {
                optimal.foresee(future);
                true
            }
            _ => false,
        }
    }
}

// The default is chosen here, not by the order of the registry (which the derive would need).
#[allow(clippy::derivable_impls)]
impl Default for EvictionPolicy {
    fn default() -> EvictionPolicy {
        EvictionPolicy::Lru
    }
}

impl std::fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A policy name that is not registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown eviction policy {name:?} (known: {known})")]
pub struct ParseEvictionPolicyError {
    pub name: String,
    pub known: String,
}

impl std::str::FromStr for EvictionPolicy {
    type Err = ParseEvictionPolicyError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        EvictionPolicy::ALL.iter().copied().find(|policy| policy.name() == name).ok_or_else(|| {
            let known: Vec<&str> = EvictionPolicy::ALL.iter().map(|policy| policy.name()).collect();
            ParseEvictionPolicyError { name: name.to_owned(), known: known.join(", ") }
        })
    }
}

impl Serialize for EvictionPolicy {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_names_round_trip_and_unknown_ones_are_refused() {
        for &policy in EvictionPolicy::ALL {
            assert_eq!(policy.name().parse::<EvictionPolicy>(), Ok(policy));
            assert_eq!(Policies::new(policy).kind(), policy);
        }
        assert_eq!(EvictionPolicy::default(), EvictionPolicy::Lru);
        let online: Vec<_> = EvictionPolicy::online().collect();
        assert_eq!(online, [EvictionPolicy::Lru, EvictionPolicy::Conv]);
        let error = "fifo".parse::<EvictionPolicy>().unwrap_err();
        assert!(error.to_string().contains("lru"), "{error}");
    }

    #[test]
    fn memberships_combine_sets() {
        let both = Membership::NONE.with(EvictSet::Device).with(EvictSet::Host);
        assert!(both.contains(EvictSet::Device) && both.contains(EvictSet::Host));
        assert!(!both.contains(EvictSet::Claimable) && !both.is_empty());
        assert!(!both.contains(EvictSet::Storage));
        assert_eq!(Membership::from_bits(0xff), Membership::ALL);
    }
}
