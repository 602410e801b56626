//! The reference a tiered cache's hit rates are compared with: [`reference_lru`], a plain LRU
//! cache of blocks under the replay's rules, written on its own (an index map and a recency list
//! in a slab), sharing nothing with the scheduler.

use serde::Serialize;

use crate::trace::TraceRequest;

/// What a plain LRU cache of blocks hit on a trace: the reference a tiered cache is compared
/// with.
#[derive(Clone, Debug, Serialize)]
pub struct ReferenceLru {
    pub capacity_blocks: u64,
    pub hit_blocks: u64,
    pub hit_rate_blocks: f64,
    pub hit_tokens: u64,
    pub hit_rate_tokens: f64,
}

/// Replays `requests` through a plain LRU cache of `capacity` blocks, one tier, no copies, under
/// the replay's rules: only full prompt blocks are cached, a request hits the leading blocks it
/// finds, at most `(input_length - 1) / block_tokens` of them (the last-token rule), then every
/// full block of its prompt is used, the least recently used blocks leaving first. A prompt's
/// blocks are used from its last to its first, so that its head is the most recent and its tail
/// leaves first (evicting a head first would leave the blocks after it unreachable). A
/// trace's block id names its whole prefix (Mooncake ids are chained), so blocks are keyed by id.
///
/// Written on its own (an index map and a recency list in a slab), sharing nothing with the
/// scheduler it is the reference for.
pub fn reference_lru(
    requests: &[TraceRequest],
    block_tokens: usize,
    capacity: u64,
) -> ReferenceLru {
    /// A cached block: its id and its neighbours in recency order (indices into the slab).
    struct Entry {
        id: u64,
        older: usize,
        newer: usize,
    }
    const NIL: usize = usize::MAX;
    let mut index: std::collections::HashMap<u64, usize> = std::collections::HashMap::new();
    let mut slab: Vec<Entry> = Vec::new();
    let (mut oldest, mut newest) = (NIL, NIL);
    let unlink = |slab: &mut Vec<Entry>, slot: usize, oldest: &mut usize, newest: &mut usize| {
        let (older, newer) = (slab[slot].older, slab[slot].newer);
        match older {
            NIL => *oldest = newer,
            older => slab[older].newer = newer,
        }
        match newer {
            NIL => *newest = older,
            newer => slab[newer].older = older,
        }
    };
    let (mut blocks, mut hit_blocks, mut input_tokens, mut hit_tokens) = (0u64, 0u64, 0u64, 0u64);
    for request in requests {
        let full =
            &request.hash_ids[..(request.input_length / block_tokens).min(request.hash_ids.len())];
        let bound = request.input_length.saturating_sub(1) / block_tokens;
        let hits = full.iter().take(bound).take_while(|id| index.contains_key(id)).count();
        blocks += full.len() as u64;
        hit_blocks += hits as u64;
        input_tokens += request.input_length as u64;
        hit_tokens += (hits * block_tokens) as u64;
        for &id in full.iter().rev() {
            let slot = match index.get(&id) {
                Some(&slot) => {
                    unlink(&mut slab, slot, &mut oldest, &mut newest);
                    slot
                }
                None if (index.len() as u64) < capacity => {
                    slab.push(Entry { id, older: NIL, newer: NIL });
                    index.insert(id, slab.len() - 1);
                    slab.len() - 1
                }
                None if oldest != NIL => {
                    let slot = oldest;
                    unlink(&mut slab, slot, &mut oldest, &mut newest);
                    index.remove(&slab[slot].id);
                    slab[slot].id = id;
                    index.insert(id, slot);
                    slot
                }
                None => continue,
            };
            slab[slot].older = newest;
            slab[slot].newer = NIL;
            match newest {
                NIL => oldest = slot,
                newest => slab[newest].newer = slot,
            }
            newest = slot;
        }
    }
    let ratio = |part: u64, whole: u64| if whole == 0 { 0.0 } else { part as f64 / whole as f64 };
    ReferenceLru {
        capacity_blocks: capacity,
        hit_blocks,
        hit_rate_blocks: ratio(hit_blocks, blocks),
        hit_tokens,
        hit_rate_tokens: ratio(hit_tokens, input_tokens),
    }
}
