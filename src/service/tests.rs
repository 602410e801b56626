//! Service behaviour that needs its private parts: a rank played by the test thread.

use std::time::Duration;

use kvshm_ipc::counters::Counter;
use kvshm_ipc::record::{CommandError, CommandSlot, Completion, Op};
use kvshm_ipc::segment::RankClaim;
use kvshm_ipc::worker_watch::Observation;

use super::*;
use crate::hash::BlockHash;
use crate::manager::{CacheConfig, RequestId, WritePolicy};

const BLOCK_TOKENS: u32 = 4;

/// Storage answers that say the tier could not be reached.
mod unreachable;

fn service(test: &str) -> Service {
    service_with(test, |_| {})
}

/// As [`service`], with `adjust` applied to the configuration first.
fn service_with(test: &str, adjust: impl FnOnce(&mut ServiceConfig)) -> Service {
    let name = SegmentName::new(&format!("svc-{test}-{}", std::process::id())).unwrap();
    let cache = CacheConfig::new(BLOCK_TOKENS, 8)
        .with_host_blocks(8)
        .with_write_policy(WritePolicy::WriteThrough);
    let mut config = ServiceConfig::new(cache, 1, 1, 2, 64);
    config.command_ring_slots = 16;
    config.completion_ring_slots = 4;
    adjust(&mut config);
    Service::create(&name, config).unwrap()
}

/// Attaches to the service's segment and claims rank 0 as a worker would.
fn claim_rank(service: &mut Service) -> (Segment, RankClaim) {
    let segment = Segment::attach(service.segment().name()).unwrap();
    let claim = segment.claim_rank(0).unwrap();
    claim.mark_serving().unwrap();
    service.wait_for_workers(Duration::from_secs(5)).unwrap();
    (segment, claim)
}

/// Attaches to the service's segment and claims every rank as workers would.
fn claim_every_rank(service: &mut Service) -> (Segment, Vec<RankClaim>) {
    let segment = Segment::attach(service.segment().name()).unwrap();
    let claims = (0..segment.config().tp_size)
        .map(|rank| {
            let claim = segment.claim_rank(rank).unwrap();
            claim.mark_serving().unwrap();
            claim
        })
        .collect();
    service.wait_for_workers(Duration::from_secs(5)).unwrap();
    (segment, claims)
}

/// Commits two blocks, so that the next poll issues their write-through backup.
fn cache_two_blocks(service: &mut Service) {
    let request = RequestId(1);
    let hashes = [BlockHash(11), BlockHash(12)];
    let tokens = 2 * BLOCK_TOKENS as usize;
    service.match_prefix(request, &hashes, tokens).unwrap();
    service.allocate(request, tokens, 0).unwrap();
    service.commit(request, tokens, &hashes).unwrap();
    service.finish(request).unwrap();
    service.poll();
}

/// Pops every command slot published to rank 0 and answers each command with success.
fn complete_every_command(segment: &Segment) -> usize {
    let mut commands = segment.command_consumer(0).unwrap();
    let mut completions = segment.completion_producer(0).unwrap();
    let mut slots: Vec<CommandSlot> = Vec::new();
    commands.pop_into(&mut slots, usize::MAX).unwrap();
    let mut pairs = Vec::new();
    let mut answered = 0;
    let mut rest = &slots[..];
    while !rest.is_empty() {
        let (header, used) = kvshm_ipc::record::decode_command(rest, &mut pairs).unwrap();
        completions.push(Completion::ok(header.command_id, 0)).unwrap();
        rest = &rest[used..];
        answered += 1;
    }
    answered
}

/// Pops every command slot published to `rank` and returns their headers, unanswered.
fn pop_commands(segment: &Segment, rank: u32) -> Vec<kvshm_ipc::record::CommandHeader> {
    let mut commands = segment.command_consumer(rank).unwrap();
    let mut slots: Vec<CommandSlot> = Vec::new();
    commands.pop_into(&mut slots, usize::MAX).unwrap();
    let (mut pairs, mut headers, mut rest) = (Vec::new(), Vec::new(), &slots[..]);
    while !rest.is_empty() {
        let (header, used) = kvshm_ipc::record::decode_command(rest, &mut pairs).unwrap();
        headers.push(header);
        rest = &rest[used..];
    }
    headers
}

/// A rematch given more hashes than its match (the engine's input, not checked against the
/// match's) counts hits among blocks the match never queried: the published miss count stays a
/// count, never an underflow (a panic in debug builds, 2^64 misses in release ones).
#[test]
fn a_rematch_with_more_hashes_than_its_match_does_not_underflow_the_misses() {
    let mut service = service_with("rematch-misses", |config| {
        config.cache = CacheConfig::new(BLOCK_TOKENS, 8);
    });
    let hashes = [BlockHash(1), BlockHash(2), BlockHash(3), BlockHash(4)];
    let tokens = 4 * BLOCK_TOKENS as usize;
    // Both matches query no block.
    service.match_prefix(RequestId(1), &[], tokens).unwrap();
    service.allocate(RequestId(1), tokens, 0).unwrap();
    service.commit(RequestId(1), tokens, &hashes).unwrap();
    service.finish(RequestId(1)).unwrap();
    let prompt = tokens + 1;
    service.match_prefix(RequestId(2), &[], prompt).unwrap();
    let found = service.rematch(RequestId(2), &hashes, prompt).unwrap();
    assert_eq!(found.device_blocks, 4);
    service.poll();
    let misses = service.segment().counters().get(Counter::MissBlocks);
    assert!(misses <= 4, "{misses} misses");
}

/// A rematch that finds blocks cached since its match leaves the published miss count as it was:
/// a counter never falls (Prometheus would read a fall as a restart).
#[test]
fn a_rematch_leaves_the_misses_counted_at_the_match() {
    let mut service = service_with("rematch-counter", |config| {
        config.cache = CacheConfig::new(BLOCK_TOKENS, 16);
    });
    let hashes = [BlockHash(1), BlockHash(2), BlockHash(3), BlockHash(4)];
    let tokens = 4 * BLOCK_TOKENS as usize;
    let prompt = tokens + 1;
    service.match_prefix(RequestId(2), &hashes, prompt).unwrap();
    cache_blocks(&mut service, 1, &hashes);
    let misses = |service: &Service| service.segment().counters().get(Counter::MissBlocks);
    let before = misses(&service);
    assert_eq!(before, 8, "request 2's four, request 1's four");
    let found = service.rematch(RequestId(2), &hashes, prompt).unwrap();
    assert_eq!(found.device_blocks, 4);
    service.poll();
    assert_eq!(misses(&service), before);
}

/// A copy that failed on one rank shows no layer ready while another rank still copies, however
/// many layers that rank published: an engine reading them would read what never landed on the
/// failed rank.
#[test]
fn a_copy_failed_on_one_rank_has_no_layer_ready_while_another_still_copies() {
    const LAYERS: u32 = 4;
    let mut service = service_with("layers-after-failure", |config| {
        config.tp_size = 2;
        config.layers = LAYERS;
        config.regions = 2 * LAYERS;
    });
    let segment = Segment::attach(service.segment().name()).unwrap();
    let claims = [segment.claim_rank(0).unwrap(), segment.claim_rank(1).unwrap()];
    for claim in &claims {
        claim.mark_serving().unwrap();
    }
    service.wait_for_workers(Duration::from_secs(5)).unwrap();
    cache_two_blocks(&mut service);
    let backup = TransferId(1);
    assert_eq!(service.cache().transfers_in_flight(), 1, "the backup was issued");
    assert_eq!(service.transfer_layers_ready(backup), 0);

    // Rank 1 copies every layer and has not answered yet; rank 0 fails.
    let [on_rank_1] = pop_commands(&segment, 1)[..] else { panic!("one command per rank") };
    let progress = segment.layer_progress(1).unwrap();
    progress.begin(on_rank_1.command_id);
    progress.publish(on_rank_1.command_id, LAYERS);
    assert_eq!(service.transfer_layers_ready(backup), 0, "rank 0 has not begun");
    let [on_rank_0] = pop_commands(&segment, 0)[..] else { panic!("one command per rank") };
    let failed =
        Completion::failed(on_rank_0.command_id, on_rank_0.generation, CommandError::CopyFailed, 0);
    segment.completion_producer(0).unwrap().push(failed).unwrap();
    service.poll();
    assert_eq!(service.cache().transfers_in_flight(), 1, "rank 1 may still touch the blocks");
    assert_eq!(service.transfer_layers_ready(backup), 0, "the copy failed on rank 0");

    let done = Completion::ok(on_rank_1.command_id, on_rank_1.generation);
    segment.completion_producer(1).unwrap().push(done).unwrap();
    service.poll();
    assert_eq!(service.cache().transfers_in_flight(), 0);
    assert_eq!(service.stats().copy_failures, 1);
    service.cache().check_invariants().unwrap();
}

/// Commits `hashes` as request `request`, so that the next poll issues their write-through
/// backup.
fn cache_blocks(service: &mut Service, request: u64, hashes: &[BlockHash]) {
    let (request, tokens) = (RequestId(request), hashes.len() * BLOCK_TOKENS as usize);
    service.match_prefix(request, hashes, tokens).unwrap();
    service.allocate(request, tokens, 0).unwrap();
    service.commit(request, tokens, hashes).unwrap();
    service.finish(request).unwrap();
    service.poll();
}

/// A worker answers its copies in ring order: an answer that overtakes an earlier copy's proves
/// that copy's answer lost (a command or completion written over in the ring). The earlier copy
/// fails at once, the later one lands, and the worker keeps its rank: before, the lost copy
/// stayed in flight for as long as other answers kept coming, the command deadline restarted by
/// each of them.
#[test]
fn an_answer_that_overtakes_an_earlier_copy_fails_that_copy_as_lost() {
    let mut service = service("overtaken");
    let (segment, _claim) = claim_rank(&mut service);
    cache_blocks(&mut service, 1, &[BlockHash(31)]);
    cache_blocks(&mut service, 2, &[BlockHash(32)]);
    assert_eq!(service.cache().transfers_in_flight(), 2, "two backups, a command each");
    let [first, second] = pop_commands(&segment, 0)[..] else { panic!("two commands") };
    let done = Completion::ok(second.command_id, second.generation);
    segment.completion_producer(0).unwrap().push(done).unwrap();
    service.poll();
    assert_eq!(service.cache().transfers_in_flight(), 0);
    let stats = service.stats();
    assert_eq!((stats.lost_answers, stats.copy_failures, stats.stray_completions), (1, 1, 0));
    assert_eq!(service.cache().stats().counters.backup_blocks, 1, "the second backup landed");
    assert!(matches!(service.rank_states()[0], RankState::Up { .. }), "the worker stays");
    // The lost command's answer, should it come after all, is a stray.
    let late = Completion::ok(first.command_id, first.generation);
    segment.completion_producer(0).unwrap().push(late).unwrap();
    service.poll();
    assert_eq!(service.stats().stray_completions, 1);
    service.cache().check_invariants().unwrap();
}

/// An answer to a command still in the scheduler's backlog answers nothing the worker was
/// given: it is a stray, and the copy lands only once its real answer comes.
#[test]
fn an_answer_to_a_command_not_yet_in_the_ring_is_a_stray() {
    let mut service = service("backlog-answer");
    let segment = Segment::attach(service.segment().name()).unwrap();
    let claim = segment.claim_rank(0).unwrap();
    // Setting up: the rank's commands wait in the scheduler's backlog.
    service.transport.watch_workers_now();
    service.poll();
    assert!(matches!(service.rank_states()[0], RankState::Starting { .. }));
    cache_blocks(&mut service, 1, &[BlockHash(41)]);
    assert_eq!(service.cache().transfers_in_flight(), 1);
    let guessed = Completion::ok(1, service.segment().generation());
    segment.completion_producer(0).unwrap().push(guessed).unwrap();
    service.poll();
    assert_eq!(service.stats().stray_completions, 1);
    assert_eq!(service.cache().transfers_in_flight(), 1, "no worker has the copy yet");

    claim.mark_serving().unwrap();
    service.transport.watch_workers_now();
    service.poll();
    assert_eq!(complete_every_command(&segment), 1);
    service.poll();
    assert_eq!(service.cache().transfers_in_flight(), 0);
    assert_eq!(service.stats().copy_failures, 0);
    service.cache().check_invariants().unwrap();
}

/// A rank whose worker sets up is sent nothing: its commands wait in the backlog for at most
/// the command deadline, then fail unsent (`WorkerNotServing`), and the worker stays, free to
/// come up (a large tier takes a while to map in). Before, they waited without end for a worker
/// stuck in its set-up.
#[test]
fn copies_waiting_for_a_worker_that_sets_up_fail_at_the_command_deadline() {
    let mut service = service_with("setting-up", |config| {
        config.command_deadline = Duration::from_millis(200);
    });
    let segment = Segment::attach(service.segment().name()).unwrap();
    let claim = segment.claim_rank(0).unwrap();
    service.transport.watch_workers_now();
    service.poll();
    assert!(matches!(service.rank_states()[0], RankState::Starting { .. }));
    cache_blocks(&mut service, 1, &[BlockHash(51)]);
    service.poll();
    assert_eq!(service.cache().transfers_in_flight(), 1, "waiting in the backlog");
    std::thread::sleep(Duration::from_millis(300));
    claim.heartbeat().unwrap();
    service.transport.watch_workers_now();
    service.poll();
    assert_eq!(service.cache().transfers_in_flight(), 0);
    let stats = service.stats();
    assert_eq!((stats.setup_waits_failed, stats.copy_failures), (1, 1));
    assert!(matches!(service.rank_states()[0], RankState::Starting { .. }), "not fenced");
    assert!(pop_commands(&segment, 0).is_empty(), "nothing was sent");

    // It comes up: copies flow again.
    claim.mark_serving().unwrap();
    service.transport.watch_workers_now();
    service.poll();
    cache_blocks(&mut service, 2, &[BlockHash(52)]);
    assert_eq!(complete_every_command(&segment), 1);
    service.poll();
    assert_eq!(service.cache().transfers_in_flight(), 0);
    assert_eq!(service.stats().copy_failures, 1);
    service.cache().check_invariants().unwrap();
}

#[test]
fn copies_stay_in_flight_when_a_successor_claims_between_the_verdict_and_the_reclaim() {
    let mut service = service("successor-race");
    let (segment, claim) = claim_rank(&mut service);
    cache_two_blocks(&mut service);
    assert_eq!(service.cache().transfers_in_flight(), 1, "the backup was issued");

    // The worker leaves cleanly and the rank is judged lost from the empty slot; a successor
    // claims the rank before the reclaim, and carries on with the rings.
    drop(claim);
    let Observation::Lost(lost) = service.transport.observe_worker(0) else {
        panic!("a worker that let go of its slot is lost")
    };
    let successor = segment.claim_rank(0).unwrap();
    successor.mark_serving().unwrap();
    service.transport.lose_worker(0, lost);
    service.apply_events();
    assert_eq!(
        service.cache().transfers_in_flight(),
        1,
        "a reclaim from a word the slot no longer holds must fail, and fail no copy"
    );
    assert_eq!(service.stats().copy_failures, 0);
    assert!(successor.heartbeat().is_ok(), "the successor's claim survived");

    assert_eq!(complete_every_command(&segment), 1);
    service.transport.watch_workers_now();
    service.poll();
    assert_eq!(service.cache().transfers_in_flight(), 0);
    assert_eq!(service.stats().copy_failures, 0);
    assert!(matches!(service.rank_states()[0], RankState::Up { .. }));
    service.cache().check_invariants().unwrap();
}

#[test]
fn completions_a_worker_pushed_before_leaving_are_applied_not_lost_to_the_reclaim() {
    let mut service = service("leave-after-answer");
    let (segment, claim) = claim_rank(&mut service);
    cache_two_blocks(&mut service);
    assert_eq!(service.cache().transfers_in_flight(), 1, "the backup was issued");

    // The worker answers its last command and exits cleanly before the scheduler polls again.
    assert_eq!(complete_every_command(&segment), 1);
    drop(claim);
    service.transport.watch_workers_now();
    service.poll();

    assert_eq!(service.cache().transfers_in_flight(), 0);
    assert_eq!(service.stats().copy_failures, 0, "the copy succeeded; its completion was there");
    assert_eq!(service.cache().stats().counters.backup_blocks, 2);
    assert_eq!(service.rank_states(), [RankState::Down]);
    service.cache().check_invariants().unwrap();
}

#[test]
fn a_wait_with_duration_max_as_its_timeout_does_not_overflow_its_deadline() {
    let mut service = service("wait-forever");
    let request = RequestId(1);
    let hashes = [BlockHash(21)];
    service.match_prefix(request, &hashes, BLOCK_TOKENS as usize).unwrap();
    let ticket = service.allocate(request, BLOCK_TOKENS as usize, 0).unwrap().ticket;
    service.wait(ticket, Duration::MAX).unwrap();
    assert!(service.wait_for_copies(Duration::MAX));
}

/// A ring header a worker scribbled over never panics the scheduler: the reclaim after the
/// worker leaves describes the ring again (`ring::reset`), and the next worker brings the rank
/// up on it. (Before, the rank stayed down until someone wrote the header back.)
#[test]
fn a_ring_header_scribbled_over_is_restored_by_the_reclaim_and_never_panics() {
    use std::os::unix::fs::FileExt;

    let mut service = service("scribbled-ring");
    let (_segment, claim) = claim_rank(&mut service);
    let layout = service.segment().layout();
    let magic_at = layout.rank_area(0) as u64 + layout.offsets.completion_ring;
    let object =
        format!("{}{}", kvshm_ipc::listing::SHM_DIR, service.segment().name().control_object());
    let control = std::fs::OpenOptions::new().read(true).write(true).open(object).unwrap();
    let mut magic = [0u8; 8];
    control.read_exact_at(&mut magic, magic_at).unwrap();
    control.write_all_at(b"garbage!", magic_at).unwrap();

    // The worker leaves; the reclaim describes its rings again.
    drop(claim);
    service.transport.watch_workers_now();
    service.poll();
    assert_eq!(service.rank_states(), [RankState::Down]);
    let mut restored = [0u8; 8];
    control.read_exact_at(&mut restored, magic_at).unwrap();
    assert_eq!(restored, magic, "the reclaim wrote the ring's magic again");

    // The next worker brings the rank up on the rings the reclaim restored.
    let segment = Segment::attach(service.segment().name()).unwrap();
    let claim = segment.claim_rank(0).unwrap();
    claim.mark_serving().unwrap();
    service.transport.watch_workers_now();
    service.poll();
    assert!(matches!(service.rank_states()[0], RankState::Up { .. }));
}

#[test]
fn a_transfer_is_split_into_commands_of_at_most_max_command_bytes() {
    // A block is 2 regions of 64 bytes: 300 bytes hold 2 blocks.
    let mut service = service_with("command-bytes", |config| config.max_command_bytes = 300);
    let (segment, _claim) = claim_rank(&mut service);
    let request = RequestId(1);
    let hashes: Vec<BlockHash> = (0..5).map(|i| BlockHash(40 + i)).collect();
    let tokens = hashes.len() * BLOCK_TOKENS as usize;
    service.match_prefix(request, &hashes, tokens).unwrap();
    service.allocate(request, tokens, 0).unwrap();
    service.commit(request, tokens, &hashes).unwrap();
    service.finish(request).unwrap();
    service.poll();
    assert_eq!(service.cache().transfers_in_flight(), 1, "one backup of 5 blocks");
    assert_eq!(complete_every_command(&segment), 3, "2 + 2 + 1 blocks");
    service.poll();
    assert_eq!(service.cache().transfers_in_flight(), 0);
    assert_eq!(service.cache().stats().counters.backup_blocks, 5);
}

#[test]
fn a_limit_below_one_block_still_sends_a_block_per_command() {
    let mut service = service_with("command-bytes-tiny", |config| config.max_command_bytes = 1);
    let (segment, _claim) = claim_rank(&mut service);
    cache_two_blocks(&mut service);
    assert_eq!(complete_every_command(&segment), 2);
    service.poll();
    assert_eq!(service.cache().transfers_in_flight(), 0);
}

#[test]
fn a_rank_that_owes_an_answer_past_the_deadline_is_dropped_and_an_idle_one_is_not() {
    let mut service =
        service_with("deadline", |config| config.command_deadline = Duration::from_millis(50));
    let (segment, claim) = claim_rank(&mut service);
    cache_two_blocks(&mut service);
    assert!(service.transport.owes_answers(0));
    assert_eq!(complete_every_command(&segment), 1);
    service.poll();
    assert!(!service.transport.owes_answers(0));
    std::thread::sleep(Duration::from_millis(80));
    claim.heartbeat().unwrap();
    service.poll();
    assert_eq!(service.stats().command_deadlines_missed, 0, "a rank that owes nothing is idle");

    // A command that is never answered while the worker heartbeats: the rank is dropped at the
    // deadline. The test thread plays the worker, which the fence leaves alone and counts as gone
    // (a real worker is killed first: tests/service/recovery.rs).
    let request = RequestId(2);
    let hashes = [BlockHash(31)];
    service.match_prefix(request, &hashes, BLOCK_TOKENS as usize).unwrap();
    service.allocate(request, BLOCK_TOKENS as usize, 0).unwrap();
    service.commit(request, BLOCK_TOKENS as usize, &hashes).unwrap();
    service.finish(request).unwrap();
    service.poll();
    assert!(service.transport.owes_answers(0));
    std::thread::sleep(Duration::from_millis(80));
    claim.heartbeat().unwrap();
    service.poll();
    assert_eq!(service.stats().command_deadlines_missed, 1);
    assert_eq!(service.cache().transfers_in_flight(), 0, "the unanswered copy failed");
    assert_eq!(service.stats().copy_failures, 1);
    assert_eq!(service.rank_states(), [RankState::Down]);
    service.cache().check_invariants().unwrap();
    drop(claim);
}

/// Pops every command slot published to rank 0 and answers each with `error` (success for
/// `None`); returns the ops answered.
fn answer_every_command(segment: &Segment, error: Option<CommandError>) -> Vec<u32> {
    let mut commands = segment.command_consumer(0).unwrap();
    let mut completions = segment.completion_producer(0).unwrap();
    let mut slots: Vec<CommandSlot> = Vec::new();
    commands.pop_into(&mut slots, usize::MAX).unwrap();
    let mut pairs = Vec::new();
    let mut ops = Vec::new();
    let mut rest = &slots[..];
    while !rest.is_empty() {
        let (header, used) = kvshm_ipc::record::decode_command(rest, &mut pairs).unwrap();
        let completion = match error {
            None => Completion::ok(header.command_id, header.generation),
            Some(error) => Completion::failed(header.command_id, header.generation, error, 0),
        };
        completions.push(completion).unwrap();
        ops.push(header.op);
        rest = &rest[used..];
    }
    ops
}

/// A service with a storage tier of 8 blocks and one claimed rank that cached two blocks, had
/// every command answered, and was reset: the two blocks' FORGETs are queued next.
fn reset_after_caching_two_stored_blocks(name: &str) -> (Service, Segment, RankClaim) {
    let mut service = service_with(name, |config| {
        config.cache = config.cache.clone().with_storage_blocks(8);
    });
    let (segment, claim) = claim_rank(&mut service);
    cache_two_blocks(&mut service);
    answer_every_command(&segment, None);
    service.poll();
    service.reset(true).unwrap();
    service.poll();
    (service, segment, claim)
}

#[test]
fn a_forget_that_fails_is_sent_once_more_and_then_given_up_and_counted() {
    let (mut service, segment, _claim) = reset_after_caching_two_stored_blocks("forget-retry");
    let forget = Op::StorageForget as u32;
    assert_eq!(answer_every_command(&segment, Some(CommandError::NoStorage)), [forget]);
    service.poll();
    service.poll();
    assert_eq!(
        answer_every_command(&segment, Some(CommandError::NoStorage)),
        [forget],
        "sent once more"
    );
    service.poll();
    service.poll();
    assert!(answer_every_command(&segment, None).is_empty(), "then given up");
    let stats = service.stats();
    assert_eq!((stats.storage_forget_failures, stats.storage_forgets_dropped), (2, 2), "{stats:?}");
    assert_eq!(stats.storage_forgets_sent, 4);
    let counters = service.segment().counters();
    assert_eq!(counters.get(Counter::StorageForgetFailures), 2, "published for kvctl");
    assert_eq!(counters.get(Counter::StorageForgetsDropped), 2);
}

/// Pops every command published to rank 0, answers each with success but the FORGETs (left
/// unanswered); returns the ops answered and the blocks of the FORGETs popped.
fn answer_all_but_forgets(segment: &Segment) -> (Vec<u32>, Vec<u128>) {
    use kvshm_ipc::storage_record::{entries_from_pairs, StorageResults};

    let mut commands = segment.command_consumer(0).unwrap();
    let mut completions = segment.completion_producer(0).unwrap();
    let mut slots: Vec<CommandSlot> = Vec::new();
    commands.pop_into(&mut slots, usize::MAX).unwrap();
    let (mut pairs, mut entries, mut rest) = (Vec::new(), Vec::new(), &slots[..]);
    let (mut ops, mut forgotten) = (Vec::new(), Vec::new());
    while !rest.is_empty() {
        pairs.clear();
        let (header, used) = kvshm_ipc::record::decode_command(rest, &mut pairs).unwrap();
        rest = &rest[used..];
        if header.op == Op::StorageForget as u32 {
            entries.clear();
            entries_from_pairs(&pairs, &mut entries).unwrap();
            forgotten.extend(entries.iter().map(|entry| entry.hash()));
            continue;
        }
        let mut completion = Completion::ok(header.command_id, header.generation);
        completion.detail = StorageResults { done: u32::MAX, failed: 0 }.to_detail();
        completions.push(completion).unwrap();
        ops.push(header.op);
    }
    (ops, forgotten)
}

/// A FORGET that failed (here its answer was overtaken in the storage lane, so lost) is sent once
/// more, but not for a block stored again since: behind the new STORE in the ring, it would free
/// the copy the tree counts now, and that block's next LOAD would miss.
#[test]
fn a_failed_forget_is_not_sent_again_for_a_block_stored_again_since() {
    let mut service = service_with("forget-after-store", |config| {
        config.cache = config
            .cache
            .clone()
            .with_storage_blocks(8)
            .with_storage_write_policy(crate::manager::StorageWritePolicy::WriteThrough);
    });
    let (segment, _claim) = claim_rank(&mut service);
    // Blocks 11 and 12 reach the host tier (eight newer blocks take the device), and are
    // written through to storage.
    let newer = |base: u128| (base..base + 8).map(BlockHash).collect::<Vec<_>>();
    let settle = |service: &mut Service| {
        for _ in 0..6 {
            answer_all_but_forgets(&segment);
            service.poll();
        }
    };
    cache_blocks(&mut service, 1, &[BlockHash(11), BlockHash(12)]);
    settle(&mut service);
    cache_blocks(&mut service, 2, &newer(20));
    settle(&mut service);
    assert_eq!(service.cache().storage_used_blocks(), 2, "blocks 11 and 12 stored");
    service.reset(true).unwrap();
    service.poll();
    let (_, forgotten) = answer_all_but_forgets(&segment);
    assert!(forgotten.contains(&11) && forgotten.contains(&12), "{forgotten:?}");

    // Stored again while that FORGET is in the ring, unanswered: the STOREs' answers overtake
    // it, and it fails as lost.
    cache_blocks(&mut service, 3, &[BlockHash(11), BlockHash(12)]);
    settle(&mut service);
    cache_blocks(&mut service, 4, &newer(40));
    let mut sent_again = Vec::new();
    for _ in 0..6 {
        sent_again.extend(answer_all_but_forgets(&segment).1);
        service.poll();
    }
    assert_eq!(service.cache().storage_used_blocks(), 2, "blocks 11 and 12 stored again");
    assert!(!sent_again.is_empty(), "the failed FORGET is sent once more");
    assert!(
        !sent_again.contains(&11) && !sent_again.contains(&12),
        "sent again behind the STOREs of 11 and 12: {sent_again:?}"
    );
    service.cache().check_invariants().unwrap();
}

/// A probe of a tier that is down, refused because a reset came after it was queued (its
/// generation is old), tells nothing of the tier: no failed probe is counted, and the next one goes
/// out at once rather than after a doubled wait (up to 30 s more of a healthy tier kept down).
#[test]
fn a_probe_refused_as_stale_after_a_reset_is_sent_again_at_once() {
    let mut service = service_with("probe-stale", |config| {
        config.cache = config.cache.clone().with_storage_blocks(8);
        config.storage_backoff =
            TierBackoff { first: Duration::from_millis(1), max: Duration::from_secs(30) };
    });
    let (segment, _claim) = claim_rank(&mut service);
    assert!(service.manager.storage_tier_failed());
    service.poll();
    std::thread::sleep(Duration::from_millis(5));
    service.poll();
    let probes = pop_commands(&segment, 0);
    assert_eq!(probes.iter().map(|h| h.op).collect::<Vec<_>>(), [Op::StorageQuery as u32]);

    service.reset(true).unwrap();
    let mut completions = segment.completion_producer(0).unwrap();
    let refused = Completion::failed(
        probes[0].command_id,
        probes[0].generation,
        CommandError::StaleGeneration,
        0,
    );
    completions.push(refused).unwrap();
    service.poll();
    service.poll();
    assert_eq!(service.stats().storage_tier_probes_failed, 0);
    let again = pop_commands(&segment, 0);
    assert!(again.iter().any(|h| h.op == Op::StorageQuery as u32), "probed again at once");
}

/// A block every rank failed to forget is given up once, not once per rank: each rank's failed
/// bits queue it to be sent again once, and the second failure counts it once in
/// `storage_forgets_dropped` (blocks given up, not rank events).
#[test]
fn a_block_every_rank_failed_to_forget_is_sent_again_and_given_up_once() {
    use kvshm_ipc::storage_record::StorageResults;

    let mut service = service_with("forget-per-block", |config| {
        config.cache = config.cache.clone().with_storage_blocks(8);
        config.tp_size = 2;
    });
    let (segment, _claims) = claim_every_rank(&mut service);
    // Answers every command on both ranks with `results`; the entries of their FORGETs.
    let answer = |results: StorageResults| {
        let mut ops = Vec::new();
        for rank in 0..2 {
            let mut completions = segment.completion_producer(rank).unwrap();
            for header in pop_commands(&segment, rank) {
                let mut completion = Completion::ok(header.command_id, header.generation);
                completion.detail = results.to_detail();
                completions.push(completion).unwrap();
                ops.push((header.op, header.pair_count));
            }
        }
        ops
    };
    cache_two_blocks(&mut service);
    for _ in 0..3 {
        answer(StorageResults { done: u32::MAX, failed: 0 });
        service.poll();
    }
    service.reset(true).unwrap();
    service.poll();
    let forget = Op::StorageForget as u32;
    // Block 11 (the first entry) fails on both ranks; block 12 is forgotten.
    let first = answer(StorageResults { done: 0b10, failed: 0b01 });
    assert!(first.iter().all(|&(op, _)| op == forget) && first.len() == 2, "{first:?}");
    service.poll();
    service.poll();
    let again = answer(StorageResults { done: 0, failed: 0b1 });
    let one_entry = kvshm_ipc::storage_record::storage_pair_count(1);
    assert_eq!(again, [(forget, one_entry), (forget, one_entry)], "block 11 once, to each rank");
    service.poll();
    service.poll();
    let stats = service.stats();
    assert_eq!(stats.storage_forgets_dropped, 1, "{stats:?}");
}

/// A probe one rank answered with its tier failed is a failed probe, whatever another rank's
/// command met (here refused as of an older generation, which alone would say nothing).
#[test]
fn a_probe_one_rank_found_failed_counts_failed_whatever_the_others_met() {
    use kvshm_ipc::storage_record::StorageResults;

    let mut service = service_with("probe-mixed", |config| {
        config.cache = config.cache.clone().with_storage_blocks(8);
        config.tp_size = 2;
        config.storage_backoff =
            TierBackoff { first: Duration::from_millis(1), max: Duration::from_secs(30) };
    });
    let (segment, _claims) = claim_every_rank(&mut service);
    assert!(service.manager.storage_tier_failed());
    service.poll();
    std::thread::sleep(Duration::from_millis(5));
    service.poll();
    let probe = |rank| {
        let headers = pop_commands(&segment, rank);
        assert_eq!(headers.len(), 1, "one probe to rank {rank}");
        headers[0]
    };
    let (first, second) = (probe(0), probe(1));
    let mut failed_bit = Completion::ok(first.command_id, first.generation);
    failed_bit.detail = StorageResults { done: 0, failed: 1 }.to_detail();
    segment.completion_producer(0).unwrap().push(failed_bit).unwrap();
    let stale =
        Completion::failed(second.command_id, second.generation, CommandError::StaleGeneration, 0);
    segment.completion_producer(1).unwrap().push(stale).unwrap();
    service.poll();
    service.poll();
    assert_eq!(service.stats().storage_tier_probes_failed, 1);
    assert!(service.cache().storage_tier_down());
}

/// FORGETs for a rank whose worker sets up go into its backlog in order with the copies
/// queued after them (a FORGET kept aside would overtake a later STORE of its block and free
/// what the scheduler counts), and, when the backlog fails unsent at the command deadline
/// (`WorkerNotServing`), are sent again as new, not counted failed: a FORGET failed twice is
/// dropped, the tier keeping blocks the scheduler no longer counts.
#[test]
fn forgets_for_a_worker_that_sets_up_keep_their_place_and_outlast_the_deadline() {
    let mut service = service_with("forget-setting-up", |config| {
        config.cache = config.cache.clone().with_storage_blocks(8);
        config.command_deadline = Duration::from_millis(100);
    });
    let (segment, claim) = claim_rank(&mut service);
    cache_two_blocks(&mut service);
    answer_every_command(&segment, None);
    service.poll();
    // The worker exits cleanly; the next one claims the rank and sets up.
    drop(claim);
    service.transport.watch_workers_now();
    service.poll();
    let claim = segment.claim_rank(0).unwrap();
    service.transport.watch_workers_now();
    service.poll();
    assert!(
        matches!(service.rank_states()[0], RankState::Starting { .. }),
        "{:?}",
        service.rank_states()
    );
    service.reset(true).unwrap();
    for _ in 0..4 {
        service.poll();
        std::thread::sleep(Duration::from_millis(60));
        claim.heartbeat().unwrap();
    }
    service.transport.watch_workers_now();
    service.poll();
    let stats = service.stats();
    assert!(stats.setup_waits_failed >= 1, "{stats:?}");
    assert_eq!((stats.storage_forget_failures, stats.storage_forgets_dropped), (0, 0), "{stats:?}");

    // The same two blocks are cached again while the worker still sets up: their backup goes
    // behind the FORGETs.
    cache_two_blocks(&mut service);
    claim.mark_serving().unwrap();
    service.transport.watch_workers_now();
    service.poll();
    let ops = answer_every_command(&segment, None);
    assert_eq!(ops.first(), Some(&(Op::StorageForget as u32)), "{ops:?}");
    assert!(ops.contains(&(Op::CopyDeviceToHost as u32)), "{ops:?}");
    service.poll();
    let stats = service.stats();
    assert_eq!((stats.storage_forget_failures, stats.storage_forgets_dropped), (0, 0), "{stats:?}");
    service.cache().check_invariants().unwrap();
}

#[test]
fn blocks_a_forget_completion_says_the_tier_failed_to_forget_are_sent_once_more() {
    use kvshm_ipc::storage_record::StorageResults;

    let (mut service, segment, _claim) = reset_after_caching_two_stored_blocks("forget-entries");
    // The back-end forgot the second block, not the first.
    let answer = |segment: &Segment, failed: u32| {
        let mut commands = segment.command_consumer(0).unwrap();
        let mut completions = segment.completion_producer(0).unwrap();
        let mut slots: Vec<CommandSlot> = Vec::new();
        commands.pop_into(&mut slots, usize::MAX).unwrap();
        let mut pairs = Vec::new();
        let (header, used) = kvshm_ipc::record::decode_command(&slots, &mut pairs).unwrap();
        assert_eq!(used, slots.len(), "one command");
        assert_eq!(header.op, Op::StorageForget as u32);
        let mut entries = Vec::new();
        kvshm_ipc::storage_record::entries_from_pairs(&pairs, &mut entries).unwrap();
        let mut completion = Completion::ok(header.command_id, header.generation);
        let done = (1u32 << entries.len()) - 1;
        completion.detail = StorageResults { done: done & !failed, failed }.to_detail();
        completions.push(completion).unwrap();
        entries.iter().map(|entry| entry.hash()).collect::<Vec<_>>()
    };
    let first = answer(&segment, 0b01);
    assert_eq!(first.len(), 2);
    service.poll();
    service.poll();
    assert_eq!(answer(&segment, 0b01), [first[0]], "only the block that failed, once more");
    service.poll();
    service.poll();
    assert!(answer_every_command(&segment, None).is_empty(), "then given up");
    assert_eq!(service.stats().storage_forgets_dropped, 1);
}
