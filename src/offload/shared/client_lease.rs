//! [`LeaseBook`]: a client's side of its lease of chunks (`lease.rs` is the owner's), so that
//! [`TierClient::prepare_store`] answers its engine at once, with no wait on the owner.
//!
//! 1. A batch the client waits for anyway (a lookup's, most often) carries a [`TierCall::Lease`]
//!    when the book holds fewer chunks than its target ([`LeaseBook::top_up`]), unless the last
//!    top-up added none and the client stored nothing since; the chunks the owner adds are
//!    appended in order ([`LeaseBook::granted`]): the owner's list and the book's stay the
//!    same, numbered alike from 0 on each connection.
//! 2. [`TierClient::prepare_store`]: the keys this client is not storing already, each once, get
//!    the book's next chunks ([`LeaseBook::take`]), and a [`TierCall::StoreLeased`] numbered
//!    from the first is queued for the next batch; its engine copies into those chunks at once.
//!    When the book holds too few, the store is asked of the owner, as without a lease (and
//!    that batch tops the book up).
//! 3. [`LeaseBook::ended`]: a store's end (queued for the owner) lets its keys be stored again;
//!    the end of a store this connection did not make is not sent (`queue_complete_store`):
//!    [`StoreEpochs`] keeps, per key, the connection each store in flight was made on, so that
//!    an earlier connection's store of a key this one stores too ends neither.
//!    A reset ends them all at once ([`LeaseBook::take_storing`], `queue_abandon_stores`).
//! 4. The book is emptied when its connection ends: what it held stays the old slot's.

use std::collections::{HashMap, HashSet, VecDeque};

use super::batch::StoreEnd;
use super::client::{CallAnswer, TierCall, TierClient};
use super::SharedTierError;
use crate::offload::key::{BuildPassThrough, OffloadKey};

/// The chunks a client asks to hold ahead of its stores, by default (the owner grants at most a
/// 64th of its tier, and at most [`super::MAX_LEASE`]).
pub const DEFAULT_LEASE_CHUNKS: u32 = 16;

/// A client's lease (module flow).
#[derive(Debug, Default)]
pub(super) struct LeaseBook {
    /// The chunks leased and not yet taken, in sequence.
    chunks: VecDeque<u32>,
    /// The sequence number of `chunks[0]`.
    front: u64,
    /// The chunks it asks to hold.
    target: u32,
    /// Whether a top-up may add chunks: not once the owner answered one with none and the book
    /// has stored nothing since (a tier too small to lease, or the client's share or the tier's
    /// eighth leased already: asking each batch would change nothing).
    asking: bool,
    /// Keys it is storing (their store not yet ended), through the lease or not.
    storing: HashSet<OffloadKey, BuildPassThrough>,
}

impl LeaseBook {
    pub(super) fn new(target: u32) -> LeaseBook {
        LeaseBook { target, asking: true, ..LeaseBook::default() }
    }

    /// Module flow, step 1: the call that tops the book up, if it wants one.
    pub(super) fn top_up(&self) -> Option<TierCall<'static>> {
        (self.asking && self.chunks.len() < self.target as usize)
            .then_some(TierCall::Lease { target: self.target })
    }

    /// Module flow, step 1: the owner added `chunks`.
    pub(super) fn granted(&mut self, chunks: &[u32]) {
        self.asking = !chunks.is_empty();
        self.chunks.extend(chunks);
    }

    /// Module flow, step 2: for `keys`, the indices of those to store and their chunks, and the
    /// sequence number of the first, or `None` (nothing taken) when the book holds too few.
    fn take(&mut self, keys: &[OffloadKey]) -> Option<(Vec<u32>, Vec<u32>, u64)> {
        let mut new_keys: HashSet<OffloadKey, BuildPassThrough> = HashSet::default();
        let to_store: Vec<u32> = (0u32..)
            .zip(keys)
            .filter(|(_, key)| !self.storing.contains(*key) && new_keys.insert(**key))
            .map(|(index, _)| index)
            .collect();
        if to_store.len() > self.chunks.len() {
            return None;
        }
        let first = self.front;
        let chunks: Vec<u32> = self.chunks.drain(..to_store.len()).collect();
        self.front += to_store.len() as u64;
        self.asking |= !new_keys.is_empty();
        self.storing.extend(new_keys);
        Some((to_store, chunks, first))
    }

    /// Step 2: `keys` are being stored (the owner's answer to a store asked of it).
    pub(super) fn storing(&mut self, keys: impl IntoIterator<Item = OffloadKey>) {
        let before = self.storing.len();
        self.storing.extend(keys);
        self.asking |= self.storing.len() > before;
    }

    /// Module flow, step 3: the keys of `keys` this connection was storing, stored no more.
    pub(super) fn ended(&mut self, keys: &[OffloadKey]) -> Vec<OffloadKey> {
        keys.iter().filter(|key| self.storing.remove(*key)).copied().collect()
    }

    /// Every key it is storing, stored no more (their ends will not come: a reset).
    pub(super) fn take_storing(&mut self) -> Vec<OffloadKey> {
        self.storing.drain().collect()
    }

    /// Module flow, step 4.
    pub(super) fn clear(&mut self) {
        let target = self.target;
        *self = LeaseBook::new(target);
    }
}

/// Per key, the connection ([`TierClient::connection_epoch`]) of each of its stores in flight,
/// oldest first (module flow, step 3). An engine ends a key's stores in the order it made them,
/// or not: either way, a connection's store is ended only by the end that comes once every
/// older store of the key has ended, when that copy too is over.
#[derive(Debug, Default)]
pub(super) struct StoreEpochs {
    by_key: HashMap<OffloadKey, VecDeque<u64>, BuildPassThrough>,
}

impl StoreEpochs {
    /// Stores of `keys` began on connection `epoch`.
    fn began(&mut self, epoch: u64, keys: impl IntoIterator<Item = OffloadKey>) {
        for key in keys {
            self.by_key.entry(key).or_default().push_back(epoch);
        }
    }

    /// One store of `key` ended: the connection of the oldest in flight, if any.
    fn ended(&mut self, key: &OffloadKey) -> Option<u64> {
        let epochs = self.by_key.get_mut(key)?;
        let epoch = epochs.pop_front();
        if epochs.is_empty() {
            self.by_key.remove(key);
        }
        epoch
    }
}

impl TierClient {
    /// Queues [`TierCall::CompleteStore`] of `keys` for the next batch (module flow, step 3).
    /// Only the ends of this connection's stores are sent: a store made on an earlier
    /// connection is that slot's (the owner drops it when this process exits), and the same key
    /// may be this connection's store now, which that end must not end.
    pub fn queue_complete_store(&mut self, keys: &[OffloadKey], success: bool) {
        let epoch = self.connection_epoch();
        let current: Vec<OffloadKey> = keys
            .iter()
            .filter(|key| self.store_epochs.ended(key) == Some(epoch))
            .copied()
            .collect();
        let mine = self.lease.ended(&current);
        let end = if success { StoreEnd::Stored } else { StoreEnd::Failed };
        self.queue.complete_store(&mine, end);
    }

    /// Queues the end of every store this connection is making, as [`StoreEnd::Abandoned`]: its
    /// engine reset its cache and will report none of them (vLLM drops the completions of the
    /// jobs in flight at a reset). The keys may be stored again, by any engine, at once.
    pub fn queue_abandon_stores(&mut self) {
        self.store_epochs = StoreEpochs::default();
        let mine = self.lease.take_storing();
        self.queue.complete_store(&mine, StoreEnd::Abandoned);
    }

    /// Chunks for the keys of `keys` to store for `request` (module flow, step 2): as
    /// [`TierCall::PrepareStore`]'s answer, from the lease with no wait when it holds enough,
    /// else asked of the owner. A key this client is storing already is not stored again; a key
    /// another engine stored meanwhile is stored again (the owner frees that chunk when its
    /// store ends).
    ///
    /// # Errors
    /// As [`TierClient::call`].
    pub fn prepare_store(
        &mut self,
        request: &str,
        keys: &[OffloadKey],
    ) -> Result<CallAnswer, SharedTierError> {
        self.give_up_if_owner_exited();
        if self.is_connected() {
            if let Some((to_store, chunks, first)) = self.lease.take(keys) {
                let named: Vec<OffloadKey> = to_store.iter().map(|&at| keys[at as usize]).collect();
                if !named.is_empty() {
                    self.queue.store_leased(request, &named, first);
                }
                self.store_epochs.began(self.connection_epoch(), named);
                return Ok(CallAnswer::Store { to_store, chunks, refused: false });
            }
        }
        let mut answers = Vec::new();
        self.call(&[TierCall::PrepareStore { request, keys }], &mut answers)?;
        // `call` noted the keys to store as this connection's stores.
        let answer = answers.pop().unwrap_or(CallAnswer::Store {
            to_store: Vec::new(),
            chunks: Vec::new(),
            refused: true,
        });
        // On the connection the call went to (it may have attached first): a connection
        // dropped after the answer holds no such store, and `lease.ended` sends no end of it.
        if let CallAnswer::Store { to_store, .. } = &answer {
            let epoch = self.connection_epoch();
            self.store_epochs.began(epoch, to_store.iter().map(|&at| keys[at as usize]));
        }
        Ok(answer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> OffloadKey {
        OffloadKey::new(&[n; 4]).unwrap()
    }

    /// A store takes the book's next chunks, numbered on from the last, for the keys not being
    /// stored already (each once); too few chunks take nothing; a store's end frees its keys.
    #[test]
    fn a_store_takes_the_next_chunks_for_keys_not_being_stored() {
        let mut book = LeaseBook::new(4);
        assert!(matches!(book.top_up(), Some(TierCall::Lease { target: 4 })));
        book.granted(&[10, 11, 12]);
        let taken = book.take(&[key(1), key(2), key(1)]);
        assert_eq!(taken, Some((vec![0, 1], vec![10, 11], 0)));
        assert_eq!(book.take(&[key(2), key(3)]), Some((vec![1], vec![12], 2)));
        assert_eq!(book.take(&[key(4)]), None, "the book is empty");
        assert_eq!(book.ended(&[key(1), key(9)]), [key(1)], "key 9 is not being stored");
        book.granted(&[13]);
        assert_eq!(book.take(&[key(1), key(2)]), Some((vec![0], vec![13], 3)));
        book.clear();
        assert_eq!(book.take(&[key(5)]), None);
        assert!(book.top_up().is_some());
    }

    /// A top-up answered with no chunk is not asked again until the client stores (through the
    /// book or the owner): a tier too small to lease, or a share leased in full, costs no call
    /// in every batch.
    #[test]
    fn a_top_up_that_granted_nothing_is_asked_again_only_after_a_store() {
        let mut book = LeaseBook::new(4);
        book.granted(&[10, 11]);
        assert!(book.top_up().is_some(), "2 of 4, the last answer granted some");
        book.granted(&[]);
        assert!(book.top_up().is_none(), "nothing granted, nothing stored since");
        assert!(book.take(&[key(1)]).is_some());
        assert!(book.top_up().is_some(), "a store through the book");
        book.granted(&[]);
        book.storing([]);
        assert!(book.top_up().is_none(), "a store the owner refused, or of keys stored already");
        book.storing([key(2)]);
        assert!(book.top_up().is_some(), "a store through the owner");
        book.granted(&[]);
        book.clear();
        assert!(book.top_up().is_some(), "a new connection asks");
    }

    /// The end of a store this connection did not make (an earlier one's, or none) is not sent:
    /// the same key may be this connection's store.
    #[test]
    fn the_end_of_a_store_this_connection_did_not_make_is_not_sent() {
        let mut client = client_without_owner("made");
        client.queue_complete_store(&[key(1)], true);
        assert!(!client.has_queued());
        client.lease.storing([key(1)]);
        client.store_epochs.began(client.connection_epoch(), [key(1)]);
        client.queue_complete_store(&[key(1)], true);
        assert!(client.has_queued());
    }

    /// Another connection's store of a key (made before the client attached again) and this
    /// connection's store of the same key, both in flight: the first end is the older store's
    /// and ends neither (this one's copy may still run); the next ends this connection's.
    #[test]
    fn an_earlier_connections_store_end_does_not_end_this_connections_store_of_the_key() {
        let mut client = client_without_owner("two");
        let now = client.connection_epoch();
        client.store_epochs.began(now + 1, [key(1)]);
        client.lease.storing([key(1)]);
        client.store_epochs.began(now, [key(1)]);
        client.queue_complete_store(&[key(1)], true);
        assert!(!client.has_queued(), "the older store's end");
        client.queue_complete_store(&[key(1)], true);
        assert!(client.has_queued(), "this connection's");
    }

    fn client_without_owner(test: &str) -> TierClient {
        let name = format!("t-no-owner-{test}-{}", std::process::id());
        let name = kvshm_ipc::name::SegmentName::new(&name).unwrap();
        let identity = super::super::TierIdentity {
            model: "m".into(),
            kv_dtype: "float16".into(),
            block_tokens: 16,
            block_bytes: 4096,
            blocks_per_chunk: 1,
            layout: String::new(),
        };
        TierClient::new(name, identity, super::super::ClientOptions::default()).unwrap()
    }
}
