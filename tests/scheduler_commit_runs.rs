//! A commit caches a run of new blocks in one tree call (`Tree::insert_chain`); committing the
//! same blocks one per call inserts them one by one (`Tree::insert`). Two caches driven alike but
//! for that must stay identical: every node (parent, state, blocks, holders, hits, the policy's
//! stamp), the counters, the copies handed out and the block tables, under every eviction policy
//! (the offline optimum too) and write policy, with and without a storage tier.
//!
//! The workload is built to reach what a trace replay never does: prompts over a vocabulary of
//! three block hashes (so a request repeats a hash at several depths, and a commit often starts
//! on blocks another request cached meanwhile), partial commits, decode steps, aborts mid-way,
//! request ids reused as soon as they end, copies left in flight so that allocations claim blocks
//! from swap-outs, and hits on host and storage copies.

mod scheduler_support;

use kvshm::hash::BlockHash;
use kvshm::manager::{
    AllocateError, CacheConfig, CacheManager, CommitError, Committed, EvictionPolicy, RequestId,
    TicketId, TicketStatus, Transfer, TransferKind, WritePolicy,
};
use kvshm::tree::FutureUses;
use scheduler_support::{check, Rng, BLOCK_TOKENS};

const BT: usize = BLOCK_TOKENS as usize;
const VOCABULARY: u64 = 3;
const MAX_LIVE: usize = 4;

/// A prompt of the workload: its full blocks' hashes and its length in tokens.
#[derive(Clone)]
struct Prompt {
    hashes: Vec<BlockHash>,
    tokens: usize,
}

/// Prompts that share prefixes with earlier ones, over a vocabulary of three hashes.
fn prompts(rng: &mut Rng, count: usize) -> Vec<Prompt> {
    let mut prompts: Vec<Prompt> = Vec::new();
    for _ in 0..count {
        let mut hashes = match prompts.len() {
            0 => Vec::new(),
            n => {
                // Often the last one, likely still live: its new blocks are then computed twice
                // and the later commit starts on blocks the other one cached meanwhile.
                let earlier = &prompts[if rng.chance(50) { n - 1 } else { rng.below(n) }].hashes;
                earlier[..rng.below(earlier.len() + 1)].to_vec()
            }
        };
        let blocks = 1 + rng.below(6);
        while hashes.len() < blocks {
            hashes.push(BlockHash(1 + u128::from(rng.next_u64() % VOCABULARY)));
        }
        // Full blocks, and at times a partial one (not hashed).
        let tokens = hashes.len() * BT + if rng.chance(30) { 1 + rng.below(BT - 1) } else { 0 };
        prompts.push(Prompt { hashes, tokens });
    }
    prompts
}

/// What a replay would hand the offline optimum: the blocks of each prompt that may hit.
fn future_of(prompts: &[Prompt]) -> FutureUses {
    let mut future = FutureUses::default();
    for prompt in prompts {
        let bound = prompt.tokens.saturating_sub(1) / BT;
        future.push_request(prompt.hashes[..prompt.hashes.len().min(bound)].iter().copied());
    }
    future
}

/// A live request, as both caches see it.
struct Live {
    id: RequestId,
    hashes: Vec<BlockHash>,
    /// Tokens the block table covers.
    allocated: usize,
    /// Tokens committed so far.
    committed: usize,
    ticket: TicketId,
    /// Commit calls so far.
    commits: usize,
}

/// The two caches: `whole` commits each time in one call, `stepwise` one block per call.
struct Twins {
    whole: CacheManager,
    stepwise: CacheManager,
    /// Copies handed out and not completed yet, alike in both.
    copies: Vec<(Transfer, Transfer)>,
}

impl Twins {
    fn both<R: PartialEq + std::fmt::Debug>(
        &mut self,
        what: &str,
        mut call: impl FnMut(&mut CacheManager) -> R,
    ) -> R {
        let whole = call(&mut self.whole);
        let stepwise = call(&mut self.stepwise);
        assert_eq!(whole, stepwise, "{what}");
        whole
    }

    /// A live request picked at random, if its last allocation is ready on both twins.
    fn pick_ready<'a>(
        &mut self,
        rng: &mut Rng,
        live: &'a mut [Live],
        what: &str,
    ) -> Option<&'a mut Live> {
        let request = &mut live[rng.below(live.len())];
        let status = self.both(what, |cache| cache.ticket_status(request.ticket).unwrap());
        (status == TicketStatus::Ready).then_some(request)
    }

    fn take_copies(&mut self) {
        let whole = self.whole.take_transfers();
        let stepwise = self.stepwise.take_transfers();
        assert_eq!(format!("{whole:?}"), format!("{stepwise:?}"), "the copies handed out");
        self.copies.extend(whole.into_iter().zip(stepwise));
    }

    fn complete_copy(&mut self, index: usize) {
        let (whole, stepwise) = self.copies.remove(index);
        self.whole.complete_transfer(whole.id, Ok(())).unwrap();
        self.stepwise.complete_transfer(stepwise.id, Ok(())).unwrap();
    }

    /// How many blocks of request `id`'s table a swap-out in flight still reads (blocks its
    /// allocation claimed); 0 if it failed (`allocated` false).
    fn claimed(&self, id: RequestId, allocated: bool) -> usize {
        if !allocated {
            return 0;
        }
        let table = self.whole.block_table(id).unwrap();
        self.copies
            .iter()
            .filter(|(copy, _)| copy.kind == TransferKind::DeviceToHost)
            .flat_map(|(copy, _)| &copy.pairs)
            .filter(|pair| table.contains(&pair.src))
            .count()
    }

    /// Both caches hold the same nodes, counters, copies in flight and block tables.
    fn same(&self, live: &[Live], what: &str) {
        check(&self.whole);
        check(&self.stepwise);
        let (whole, stepwise) =
            (self.whole.tree_snapshot(u32::MAX), self.stepwise.tree_snapshot(u32::MAX));
        assert_eq!(whole.total_nodes, stepwise.total_nodes, "{what}: nodes");
        for (x, y) in whole.nodes.iter().zip(&stepwise.nodes) {
            assert_eq!(format!("{x:?}"), format!("{y:?}"), "{what}: node");
        }
        let (x, y) = (self.whole.stats(), self.stepwise.stats());
        assert_eq!(x.counters, y.counters, "{what}: counters");
        assert_eq!(
            (x.device_free, x.host_free, x.storage_used, x.transfers_in_flight, x.live_requests),
            (y.device_free, y.host_free, y.storage_used, y.transfers_in_flight, y.live_requests),
            "{what}: sizes"
        );
        assert_eq!(self.whole.pending_backups(), self.stepwise.pending_backups(), "{what}");
        for request in live {
            assert_eq!(
                self.whole.block_table(request.id),
                self.stepwise.block_table(request.id),
                "{what}: block table of {:?}",
                request.id
            );
        }
    }
}

/// Runs `steps` random operations on twin caches built from `config` (the future of the
/// workload handed to an offline policy) and returns what it covered.
fn run_twins(config: CacheConfig, seed: u64, steps: usize) -> Covered {
    let mut rng = Rng::new(seed);
    let workload = prompts(&mut rng, steps);
    let build = || {
        if config.eviction.is_offline() {
            CacheManager::with_future(config.clone(), future_of(&workload)).unwrap()
        } else {
            CacheManager::new(config.clone()).unwrap()
        }
    };
    let mut twins = Twins { whole: build(), stepwise: build(), copies: Vec::new() };
    let mut next_prompt = 0;
    let mut live: Vec<Live> = Vec::new();
    // Ids free for a request: one that ends goes back to the pool, to be taken again soon.
    let mut free_ids: Vec<u64> = (1..=MAX_LIVE as u64 + 2).collect();
    let mut covered = Covered::default();
    for step in 0..steps {
        let what = format!("{:?} seed {seed} step {step}", config.eviction);
        match rng.below(10) {
            0 | 1 if live.len() < MAX_LIVE && next_prompt < workload.len() => {
                // A request: match, then allocate its prompt (abort if it does not fit).
                let prompt = workload[next_prompt].clone();
                next_prompt += 1;
                let id = RequestId(free_ids.remove(rng.below(free_ids.len())));
                let found = twins.both(&what, |cache| {
                    cache.match_prefix(id, &prompt.hashes, prompt.tokens).unwrap()
                });
                let lookahead = rng.below(3);
                let new_tokens = prompt.tokens - found.cached_tokens;
                let allocated = twins.both(&what, |cache| {
                    cache.allocate(id, new_tokens, lookahead).map(|allocation| allocation.ticket)
                });
                twins.take_copies();
                covered.claimed_from_swap_outs += twins.claimed(id, allocated.is_ok());
                match allocated {
                    Ok(ticket) => live.push(Live {
                        id,
                        hashes: prompt.hashes,
                        allocated: prompt.tokens,
                        committed: found.cached_tokens,
                        ticket,
                        commits: 0,
                    }),
                    Err(
                        AllocateError::OutOfBlocks { .. } | AllocateError::OutOfHostBlocks { .. },
                    ) => {
                        twins.both(&what, |cache| cache.abort(id).unwrap());
                        free_ids.push(id.0);
                    }
                    Err(error) => panic!("{what}: {error}"),
                }
                twins.take_copies();
            }
            2 | 3 if !live.is_empty() => {
                // A commit of some of what the request computed: one call in `whole`, one per
                // block in `stepwise`.
                let Some(request) = twins.pick_ready(&mut rng, &mut live, &what) else { continue };
                let blocks = request.allocated / BT;
                while request.hashes.len() < blocks {
                    // Decoded tokens filled a block: its hash, from the same vocabulary.
                    request.hashes.push(BlockHash(1 + u128::from(rng.next_u64() % VOCABULARY)));
                }
                let computed =
                    request.committed + rng.below(request.allocated - request.committed + 1);
                let whole = twins.whole.commit(request.id, computed, &request.hashes).unwrap();
                let mut stepwise = Committed::default();
                // From the first block: the blocks of the path return at once, and a commit
                // that stopped at a copy in flight left the rest to this one.
                for block in 1..=computed / BT {
                    let part = twins.stepwise.commit(request.id, block * BT, &request.hashes);
                    let part = part.unwrap();
                    stepwise.inserted += part.inserted;
                    stepwise.duplicates += part.duplicates;
                }
                let last = twins.stepwise.commit(request.id, computed, &request.hashes).unwrap();
                assert_eq!(last, Committed::default(), "{what}: nothing left to commit");
                assert_eq!(whole, stepwise, "{what}: what the commits did");
                covered.chains += usize::from(whole.inserted >= 2);
                covered.after_duplicates += usize::from(whole.inserted > 0 && whole.duplicates > 0);
                covered.after_partial += usize::from(whole.inserted > 0 && request.commits > 0);
                request.commits += 1;
                request.committed = computed;
            }
            4 if !live.is_empty() => {
                // Decode: room for a few more tokens.
                let Some(request) = twins.pick_ready(&mut rng, &mut live, &what) else { continue };
                let tokens = 1 + rng.below(2 * BT);
                let id = request.id;
                let allocated =
                    twins.both(&what, |cache| cache.allocate(id, tokens, 0).map(|a| a.ticket));
                twins.take_copies();
                covered.claimed_from_swap_outs += twins.claimed(id, allocated.is_ok());
                match allocated {
                    Ok(ticket) => {
                        request.ticket = ticket;
                        request.allocated += tokens;
                    }
                    Err(
                        AllocateError::OutOfBlocks { .. } | AllocateError::OutOfHostBlocks { .. },
                    ) => {}
                    Err(error) => panic!("{what}: {error}"),
                }
                twins.take_copies();
            }
            5 if !live.is_empty() => {
                // The end of a request, finished or aborted, its ticket ready or not.
                let request = live.swap_remove(rng.below(live.len()));
                if rng.chance(50) {
                    twins.both(&what, |cache| cache.finish(request.id).unwrap());
                } else {
                    twins.both(&what, |cache| cache.abort(request.id).unwrap());
                }
                // Its id is unknown now, and nothing answers for it.
                let hashes = &request.hashes;
                twins.both(&what, |cache| {
                    assert!(matches!(
                        cache.allocate(request.id, 1, 0),
                        Err(AllocateError::UnknownRequest(_))
                    ));
                    assert_eq!(
                        cache.commit(request.id, request.allocated, hashes),
                        Err(CommitError::UnknownRequest(request.id))
                    );
                });
                free_ids.push(request.id.0);
            }
            6 => twins.both(&what, |cache| cache.poll()),
            _ if !twins.copies.is_empty() => {
                // One copy lands (the oldest more often).
                let index = if rng.chance(70) { 0 } else { rng.below(twins.copies.len()) };
                twins.complete_copy(index);
                twins.take_copies();
            }
            _ => {}
        }
        twins.take_copies();
        twins.same(&live, &what);
    }
    let hits = twins.whole.stats().counters.hits;
    covered.lower_tier_hits = (hits.host_blocks + hits.storage_blocks) as usize;
    covered
}

/// What a run covered: commits of two new blocks or more, commits whose new blocks follow
/// blocks cached meanwhile, commits after an earlier one of the same request, blocks an
/// allocation claimed from a swap-out, and hits below the device tier.
#[derive(Debug, Default)]
struct Covered {
    chains: usize,
    after_duplicates: usize,
    after_partial: usize,
    claimed_from_swap_outs: usize,
    /// Hits on host or storage copies.
    lower_tier_hits: usize,
}

fn every_policy(config: CacheConfig) -> impl Iterator<Item = CacheConfig> {
    EvictionPolicy::ALL.iter().map(move |&policy| config.clone().with_eviction(policy))
}

const STEPS: usize = 3_000;
const SEEDS: u64 = 3;

/// Runs every eviction policy on `config`; `claims`: whether it has a host tier, so that
/// allocations claimed blocks from swap-outs and prompts hit below the device tier.
fn run_every_policy(config: CacheConfig, claims: bool) {
    for config in every_policy(config) {
        let mut covered = Covered::default();
        for seed in 1..=SEEDS {
            let run = run_twins(config.clone(), seed, STEPS);
            covered.chains += run.chains;
            covered.after_duplicates += run.after_duplicates;
            covered.after_partial += run.after_partial;
            covered.claimed_from_swap_outs += run.claimed_from_swap_outs;
            covered.lower_tier_hits += run.lower_tier_hits;
        }
        let what = format!("{:?} {:?}: {covered:?}", config.eviction, config.write_policy);
        assert!(covered.chains >= 50 && covered.after_duplicates >= 5, "{what}");
        assert!(covered.after_partial >= 50, "{what}");
        assert_eq!(covered.claimed_from_swap_outs > 0, claims, "{what}");
        assert_eq!(covered.lower_tier_hits > 0, claims, "{what}");
    }
}

#[test]
fn one_commit_of_a_run_caches_what_one_commit_per_block_caches_without_a_host_tier() {
    run_every_policy(CacheConfig::new(BLOCK_TOKENS, 12), false);
}

#[test]
fn one_commit_of_a_run_caches_what_one_commit_per_block_caches_under_write_back() {
    run_every_policy(CacheConfig::new(BLOCK_TOKENS, 10).with_host_blocks(12), true);
}

#[test]
fn one_commit_of_a_run_caches_what_one_commit_per_block_caches_under_write_through() {
    for policy in [
        WritePolicy::WriteThrough,
        WritePolicy::WriteThroughSelective { threshold: 1 },
        WritePolicy::WriteThroughSelective { threshold: 2 },
    ] {
        run_every_policy(
            CacheConfig::new(BLOCK_TOKENS, 10).with_host_blocks(12).with_write_policy(policy),
            true,
        );
    }
}

#[test]
fn one_commit_of_a_run_caches_what_one_commit_per_block_caches_with_a_storage_tier() {
    run_every_policy(
        CacheConfig::new(BLOCK_TOKENS, 10).with_host_blocks(8).with_storage_blocks(40),
        true,
    );
}
