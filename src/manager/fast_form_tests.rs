//! Differential tests of the manager's fast forms with a host tier: an allocation whose hits are
//! all on device (`allocate_hits_on_device`), its evictions in write-back runs
//! (`Tree::write_back_run`, with the swap-out opened before the first run and taken back if
//! nothing joined it), the landing of an allocation's claimed swap-outs in one pass of the tree
//! (`swap_outs_landed` through `Tree::land_claimed_swap_outs`), and write-through's backups
//! started in runs (`issue_backups` through `Tree::backup_run`) and landed in one pass
//! (`Tree::land_backup_swap_outs`). Two managers built alike are driven by the same random
//! engine, one with the fast forms turned off (`general_forms_only`): every answer, every copy
//! handed out, the counters and the tree must stay the same, with `check_invariants` after
//! every step.

use super::*;
use crate::test_rng::picker;

const BLOCK_TOKENS: usize = 4;

/// The two managers, the fast one first, and what the engine knows of them.
struct Pair {
    fast: CacheManager,
    general: CacheManager,
    /// Live requests: id, prompt hashes, the tickets of their allocations.
    live: Vec<(RequestId, Vec<crate::hash::BlockHash>, Vec<TicketId>)>,
    /// Copies handed out and not completed yet.
    issued: Vec<TransferId>,
    next_request: u64,
}

impl Pair {
    /// Asserts that both managers answer alike and hold the same state; `what` names the step.
    fn same(&self, what: &str) {
        let (a, b) = (&self.fast, &self.general);
        a.check_invariants().unwrap_or_else(|error| panic!("{what}: fast: {error}"));
        b.check_invariants().unwrap_or_else(|error| panic!("{what}: general: {error}"));
        assert_eq!(format!("{:?}", a.stats()), format!("{:?}", b.stats()), "{what}: counters");
        assert_eq!(
            format!("{:?}", a.tree_snapshot(u32::MAX)),
            format!("{:?}", b.tree_snapshot(u32::MAX)),
            "{what}: trees"
        );
        assert_eq!(a.free_device_blocks(), b.free_device_blocks(), "{what}: free device blocks");
        assert_eq!(a.free_host_blocks(), b.free_host_blocks(), "{what}: free host blocks");
        for (id, _, tickets) in &self.live {
            assert_eq!(a.block_table(*id), b.block_table(*id), "{what}: table of {id}");
            let fast = a.requests.get(id).expect("live");
            let general = b.requests.get(id).expect("live");
            assert_eq!(fast.claims, general.claims, "{what}: claims of {id}");
            assert_eq!(fast.pending_tickets, general.pending_tickets, "{what}: {id}");
            for ticket in tickets {
                assert_eq!(
                    a.ticket_status(*ticket),
                    b.ticket_status(*ticket),
                    "{what}: {ticket:?}"
                );
                let waits = |cache: &CacheManager| cache.ticket_transfers(*ticket).count();
                assert_eq!(waits(a), waits(b), "{what}: copies {ticket:?} waits on");
            }
        }
    }

    /// A new request for a prompt of `blocks` blocks of conversation `chain`: matched, then
    /// allocated (aborted if that fails).
    fn start(&mut self, chain: u128, blocks: usize, output_tokens: usize) {
        let id = RequestId(self.next_request);
        self.next_request += 1;
        let hashes: Vec<_> =
            (0..blocks as u128).map(|i| crate::hash::BlockHash(chain << 32 | (i + 1))).collect();
        let prompt_tokens = blocks * BLOCK_TOKENS + 1;
        let mut cached = None;
        for cache in [&mut self.fast, &mut self.general] {
            let found = cache.match_prefix(id, &hashes, prompt_tokens).expect("a valid prompt");
            assert_eq!(*cached.get_or_insert(found), found, "{id}: match");
        }
        let found = cached.expect("matched");
        let new_tokens = prompt_tokens - found.cached_tokens + output_tokens;
        let fast =
            self.fast.allocate(id, new_tokens, 0).map(|a| (a.ticket, a.block_table.to_vec()));
        let general =
            self.general.allocate(id, new_tokens, 0).map(|a| (a.ticket, a.block_table.to_vec()));
        assert_eq!(fast, general, "{id}: allocation");
        let Ok((ticket, _)) = fast else {
            self.fast.abort(id).expect("live");
            self.general.abort(id).expect("live");
            return;
        };
        self.live.push((id, hashes, vec![ticket]));
    }

    /// Live request `index` allocates for `tokens` more (a decode step), maybe with its
    /// earlier tickets still pending and claims of its own noted already.
    fn extend(&mut self, index: usize, tokens: usize, lookahead: usize) {
        let id = self.live[index].0;
        let fast =
            self.fast.allocate(id, tokens, lookahead).map(|a| (a.ticket, a.block_table.to_vec()));
        let general = self
            .general
            .allocate(id, tokens, lookahead)
            .map(|a| (a.ticket, a.block_table.to_vec()));
        assert_eq!(fast, general, "{id}: allocation of {tokens} more");
        if let Ok((ticket, _)) = fast {
            self.live[index].2.push(ticket);
        }
    }

    /// Hands out the copies ready to go, to both.
    fn take(&mut self) {
        let (fast, general) = (self.fast.take_transfers(), self.general.take_transfers());
        assert_eq!(fast, general, "copies handed out");
        self.issued.extend(fast.iter().map(|transfer| transfer.id));
    }

    /// Completes issued copy `index`, failed when `fail`.
    fn complete(&mut self, index: usize, fail: bool) {
        let id = self.issued.swap_remove(index);
        let outcome = if fail {
            Err(TransferFailure { rank: 0, error: CommandError::CopyFailed, detail: 0 })
        } else {
            Ok(())
        };
        let fast = self.fast.complete_transfer(id, outcome);
        let general = self.general.complete_transfer(id, outcome);
        assert_eq!(fast, general, "completing {id:?}");
    }

    /// Ends live request `index`: committed and finished once its tickets are ready, else
    /// aborted.
    fn end(&mut self, index: usize) {
        let (id, hashes, tickets) = self.live.swap_remove(index);
        let ready = tickets
            .iter()
            .all(|&ticket| self.fast.ticket_status(ticket) == Ok(TicketStatus::Ready));
        for cache in [&mut self.fast, &mut self.general] {
            if ready {
                cache.commit(id, hashes.len() * BLOCK_TOKENS, &hashes).expect("ready to commit");
                cache.finish(id).expect("live");
            } else {
                cache.abort(id).expect("live");
            }
        }
    }
}

/// An allocation whose hits are all on device, and the landing of its claimed swap-outs in one
/// pass, leave what the general forms leave, under every online eviction policy and write
/// policy, with copies completed late, out of order or failed, write-through backups,
/// claims from earlier swap-outs and decode allocations (earlier tickets still pending) mixed
/// in.
#[test]
fn the_fast_allocation_and_landing_leave_what_the_general_forms_leave() {
    let policies = EvictionPolicy::ALL.iter().copied().filter(|policy| !policy.is_offline());
    let (mut allocations_checked, mut extended_while_pending) = (0, 0);
    let (mut backups_issued, mut backups_landed) = (0, 0);
    let mut backups_with_device_copy_victim = 0;
    for eviction in policies {
        let write_policies = [
            WritePolicy::WriteBack,
            WritePolicy::WriteThrough,
            WritePolicy::WriteThroughSelective { threshold: 2 },
        ];
        for write_policy in write_policies {
            for seed in 1..=12u64 {
                let mut pick = picker(seed);
                // A free watermark on odd seeds: `poll` starts swap-outs that allocations then
                // claim from, beside their own. A host tier smaller than the device on two seeds
                // in three: write-through's backups then fill it with nodes still on device, and
                // a backup's host victim may be one of them.
                let config = CacheConfig::new(BLOCK_TOKENS as u32, 12)
                    .with_host_blocks(if seed % 3 == 1 { 20 } else { 6 })
                    .with_free_watermark(if seed % 2 == 1 { 4 } else { 0 })
                    .with_write_policy(write_policy)
                    .with_eviction(eviction);
                let mut general = CacheManager::new(config.clone()).expect("valid");
                general.general_forms_only = true;
                let mut pair = Pair {
                    fast: CacheManager::new(config).expect("valid"),
                    general,
                    live: Vec::new(),
                    issued: Vec::new(),
                    next_request: 1,
                };
                for step in 0..400 {
                    match pick(11) {
                        0..=3 if pair.live.len() < 4 => {
                            let (chain, blocks) = (pick(8) as u128, 1 + pick(6));
                            pair.start(chain, blocks, pick(2 * BLOCK_TOKENS));
                            allocations_checked += 1;
                        }
                        4 | 5 => pair.take(),
                        6 | 7 if !pair.issued.is_empty() => {
                            let index = pick(pair.issued.len());
                            pair.complete(index, pick(12) == 0);
                        }
                        8 if !pair.live.is_empty() => pair.end(pick(pair.live.len())),
                        9 => {
                            // Backups to issue with the host pool empty and a host candidate
                            // with a device copy first: the run hands the host eviction back.
                            let fast = &pair.fast;
                            let first_host = fast.tree.first_host_candidate();
                            backups_with_device_copy_victim += usize::from(
                                !fast.pending_backups.is_empty()
                                    && fast.free_host_blocks() == 0
                                    && first_host
                                        .is_some_and(|id| fast.tree.node(id).device().is_some()),
                            );
                            pair.fast.poll();
                            pair.general.poll();
                        }
                        10 if !pair.live.is_empty() => {
                            let index = pick(pair.live.len());
                            let record = pair.fast.requests.get(&pair.live[index].0);
                            let pending = record.expect("live").pending_tickets > 0;
                            pair.extend(index, 1 + pick(2 * BLOCK_TOKENS), pick(BLOCK_TOKENS));
                            extended_while_pending += usize::from(pending);
                        }
                        _ => {}
                    }
                    pair.same(&format!("{eviction:?} {write_policy:?} seed {seed} step {step}"));
                }
                backups_issued += pair.fast.stats.backups_issued;
                backups_landed += pair.fast.stats.backup_blocks;
            }
        }
    }
    assert!(allocations_checked > 1000, "{allocations_checked} allocations");
    assert!(extended_while_pending > 100, "{extended_while_pending} decode allocations");
    assert!(backups_issued > 400, "{backups_issued} backups issued");
    assert!(backups_landed > 200, "{backups_landed} backups landed");
    assert!(
        backups_with_device_copy_victim > 5,
        "{backups_with_device_copy_victim} polls with a host victim holding a device copy"
    );
}

/// Caches `chains` one-block prompts, one conversation each, and finishes them: their device
/// blocks become device candidates (leaves) in that order.
fn cache_one_block_prompts(cache: &mut CacheManager, chains: std::ops::RangeInclusive<u64>) {
    for chain in chains {
        let id = RequestId(chain);
        let hashes = [crate::hash::BlockHash(u128::from(chain) << 32 | 1)];
        let found = cache.match_prefix(id, &hashes, BLOCK_TOKENS).expect("a valid prompt");
        assert_eq!(found.cached_tokens, 0);
        cache.allocate(id, BLOCK_TOKENS, 0).expect("room");
        cache.commit(id, BLOCK_TOKENS, &hashes).expect("ready");
        cache.finish(id).expect("live");
    }
}

/// A cache whose device is full of cached blocks, and the allocation of four new blocks for
/// request 100: two claimed from an earlier swap-out (the free watermark's, handed out), two
/// written back by the allocation's own swap-out (not handed out yet). Returns the cache, the
/// prompt's hashes, the allocation's ticket, the earlier and the own swap-out.
fn allocation_claiming_from_two_swap_outs(
    general_forms_only: bool,
) -> (CacheManager, Vec<crate::hash::BlockHash>, TicketId, TransferId, TransferId) {
    let form = if general_forms_only { "general" } else { "fast" };
    let config = CacheConfig::new(BLOCK_TOKENS as u32, 8)
        .with_host_blocks(20)
        .with_free_watermark(2)
        .with_eviction(EvictionPolicy::Lru);
    let mut cache = CacheManager::new(config).expect("valid");
    cache.general_forms_only = general_forms_only;
    cache_one_block_prompts(&mut cache, 1..=8);
    assert_eq!(cache.free_device_blocks(), 0, "{form}: the device is full of cached blocks");
    // The watermark's swap-outs of the two least recently used blocks, handed out.
    cache.poll();
    let earlier = cache.take_transfers();
    assert_eq!(earlier.len(), 1, "{form}: one swap-out for the watermark");
    let earlier = earlier[0].id;
    cache.check_invariants().unwrap();

    let id = RequestId(100);
    let hashes: Vec<_> = (1..=4).map(|i| crate::hash::BlockHash(100 << 32 | i)).collect();
    cache.match_prefix(id, &hashes, 4 * BLOCK_TOKENS).expect("a valid prompt");
    let ticket = cache.allocate(id, 4 * BLOCK_TOKENS, 0).expect("room").ticket;
    cache.check_invariants().unwrap();
    let runs: Vec<_> = cache.requests.get(&id).expect("live").claims.to_vec();
    assert_eq!(runs.len(), 2, "{form}: claims from two swap-outs: {runs:?}");
    assert_eq!(runs[0].transfer, earlier, "{form}: the earlier swap-out's claims first");
    assert_eq!((runs[0].start, runs[0].end, runs[1].start, runs[1].end), (0, 2, 2, 4), "{form}");
    let own = runs[1].transfer;
    assert_ne!(own, earlier, "{form}");
    let mut waits: Vec<_> = cache.ticket_transfers(ticket).collect();
    waits.sort_unstable();
    assert_eq!(waits, [earlier, own], "{form}: the ticket waits on both copies");
    (cache, hashes, ticket, earlier, own)
}

/// An allocation that claims blocks from two swap-outs, an earlier one (the free watermark's,
/// handed out) and the one its own write-backs start, waits on both, in the fast form and in
/// the general one: its request notes two runs of claims, and its ticket stays pending when
/// the earlier copy lands, until its own does. The random differential test compares the two
/// forms with each other; a mistake they share (`Request::note_claim` saying a run started
/// only for the first run) needs this one.
#[test]
fn an_allocation_claiming_from_two_swap_outs_waits_for_both() {
    for general_forms_only in [false, true] {
        let form = if general_forms_only { "general" } else { "fast" };
        let (mut cache, hashes, ticket, earlier, own) =
            allocation_claiming_from_two_swap_outs(general_forms_only);
        let id = RequestId(100);
        let issued: Vec<_> = cache.take_transfers().iter().map(|transfer| transfer.id).collect();
        assert_eq!(issued, [own], "{form}: the allocation's own swap-out is handed out");

        // The earlier copy lands: the blocks of the later one are still being read.
        cache.complete_transfer(earlier, Ok(())).expect("in flight");
        cache.check_invariants().unwrap();
        assert_eq!(
            cache.ticket_status(ticket),
            Ok(TicketStatus::Pending),
            "{form}: ready while its own swap-out still reads its blocks"
        );
        assert_eq!(
            cache.commit(id, 4 * BLOCK_TOKENS, &hashes),
            Err(CommitError::TicketPending(id)),
            "{form}"
        );
        cache.complete_transfer(own, Ok(())).expect("in flight");
        cache.check_invariants().unwrap();
        assert_eq!(cache.ticket_status(ticket), Ok(TicketStatus::Ready), "{form}");
        cache.commit(id, 4 * BLOCK_TOKENS, &hashes).expect("ready");
        cache.finish(id).expect("live");
        cache.check_invariants().unwrap();
        assert_eq!(cache.free_device_blocks(), 0, "{form}: four blocks cached, four still");
    }
}

/// A request aborted while both swap-outs it claimed blocks from still read them gives no
/// block back to the pool: each stays with its copy (found by its run of claims) and returns
/// to the pool when that copy lands.
#[test]
fn an_aborted_allocation_leaves_each_claimed_block_to_the_copy_reading_it() {
    for general_forms_only in [false, true] {
        let form = if general_forms_only { "general" } else { "fast" };
        let (mut cache, _, _, earlier, own) =
            allocation_claiming_from_two_swap_outs(general_forms_only);
        cache.take_transfers();
        cache.abort(RequestId(100)).expect("live");
        cache.check_invariants().unwrap();
        assert_eq!(cache.free_device_blocks(), 0, "{form}: a block still being read was freed");
        cache.complete_transfer(own, Ok(())).expect("in flight");
        cache.check_invariants().unwrap();
        assert_eq!(cache.free_device_blocks(), 2, "{form}: the own copy's two blocks");
        cache.complete_transfer(earlier, Ok(())).expect("in flight");
        cache.check_invariants().unwrap();
        assert_eq!(cache.free_device_blocks(), 4, "{form}: and the earlier copy's two");
    }
}
