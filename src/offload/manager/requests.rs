//! What the manager remembers of each live request: the keys it accessed (vLLM's recency rule
//! reranks them when it finishes) and, per chain tag, the last cached key it presented, which is
//! the parent of the next key it stores in that chain (the prefix order vLLM's keys do not carry).

use std::collections::HashMap;

use super::{find, OffloadManager, RequestKeys};
use crate::offload::key::{BuildPassThrough, OffloadKey, RequestName};

impl RequestKeys {
    pub(super) fn record(&mut self, key: OffloadKey) {
        if self.seen_set.insert(key) {
            self.seen.push(key);
        }
    }

    pub(super) fn chain_last(&self, tag: &[u8]) -> Option<OffloadKey> {
        self.chain_last.iter().find(|(chain, _)| chain.as_bytes() == tag).map(|&(_, key)| key)
    }

    pub(super) fn set_chain_last(&mut self, tag: &[u8], key: OffloadKey) {
        match self.chain_last.iter_mut().find(|(chain, _)| chain.as_bytes() == tag) {
            Some(slot) => slot.1 = key,
            None => self
                .chain_last
                .push((OffloadKey::new(tag).expect("a chain tag is shorter than a key"), key)),
        }
    }
}

impl OffloadManager {
    /// Records the cached keys among `keys` as links of `request`'s chains, storing nothing: the
    /// next key it stores in a chain is linked under the last of them (an engine storing a block
    /// whose parent was stored earlier, by another request or another engine).
    pub fn present(&mut self, request: &str, keys: &[OffloadKey]) {
        request_state(&mut self.requests, request);
        self.link_presented(request, keys);
    }

    /// Records keys of a store that were all cached already as links of the request's chains.
    pub(super) fn link_presented(&mut self, request: &str, keys: &[OffloadKey]) {
        let tag_bytes = self.config.layout.tag_bytes;
        let Some(state) = self.requests.get_mut(request) else { return };
        for key in keys {
            if find(&self.heads, &self.entries, key).is_some() {
                state.set_chain_last(key.chain_tag(tag_bytes), *key);
            }
        }
    }
}

/// The record of `request`, made on first use (vLLM makes it on a request's first access too).
pub(super) fn request_state<'a>(
    requests: &'a mut HashMap<RequestName, RequestKeys, BuildPassThrough>,
    request: &str,
) -> &'a mut RequestKeys {
    if !requests.contains_key(request) {
        requests.insert(RequestName::new(request), RequestKeys::default());
    }
    requests.get_mut(request).expect("inserted just above")
}
