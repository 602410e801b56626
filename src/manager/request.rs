//! What the manager remembers about one live request.
//!
//! A request holds a path of cached nodes from the root (matched, then committed) and owns the
//! blocks of its block table past that path, plus the blocks it computed twice ("private": a
//! commit found the block cached already). Positions of the block table inside the path are the
//! nodes' device blocks, except private ones.

use serde::Serialize;

use super::{TicketId, TransferId};
use crate::tree::NodeId;

/// The engine's name for a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "request {}", self.0)
    }
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Request {
    /// Nodes held (ref_count += 1 each), block 0 first.
    pub path: Vec<NodeId>,
    /// The block table: device block of every position; shorter than `path` until the first
    /// allocation gives the host hits device blocks.
    pub table: Vec<u32>,
    /// Blocks kept privately at positions inside `path`.
    pub private: Vec<u32>,
    /// Tokens the block table covers (lookahead excluded).
    pub tokens: usize,
    /// Device blocks claimed from a swap-out still reading them, with that copy.
    pub claims: Vec<(u32, TransferId)>,
    pub tickets: Vec<TicketId>,
    /// Tickets of this request still waiting.
    pub pending_tickets: u32,
    /// Set when a swap-in it waited on failed; only finish or abort are accepted afterwards.
    pub failed: bool,
}

impl Request {
    /// The same record emptied for the next request, its buffers kept (so that serving a
    /// request allocates nothing once the buffers have grown).
    pub fn recycled(mut self) -> Request {
        self.path.clear();
        self.table.clear();
        self.private.clear();
        self.claims.clear();
        self.tickets.clear();
        Request {
            path: self.path,
            table: self.table,
            private: self.private,
            claims: self.claims,
            tickets: self.tickets,
            ..Request::default()
        }
    }

    /// The blocks this request owns (to free when it ends), in table order.
    pub fn owned_blocks(&self) -> impl DoubleEndedIterator<Item = u32> + '_ {
        let start = self.path.len().min(self.table.len());
        self.private.iter().copied().chain(self.table[start..].iter().copied())
    }

    /// Whether it holds nodes or owns blocks.
    pub fn holds_anything(&self) -> bool {
        !self.path.is_empty() || !self.table.is_empty()
    }
}
