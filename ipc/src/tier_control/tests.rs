//! The tier's control object in one process: create, attach, checks, client slots.

use std::time::Instant;

use super::*;
use crate::doorbell::WaitPolicy;
use crate::listing::{self, ListingState, SegmentKind};
use crate::worker_slot::{RankStatus, WorkerState};

fn unique_name(test: &str) -> SegmentName {
    SegmentName::new(&format!("t-tier-{test}-{}", std::process::id())).unwrap()
}

const CONFIG: TierConfig =
    TierConfig { clients: 3, identity_capacity: 256, ring_slots: 8, page_keys: 16 };

/// A process that has exited (and was reaped).
fn dead_process() -> ProcessIdentity {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    ProcessIdentity::new(pid, 0)
}

#[test]
fn a_client_attaches_by_name_and_reads_the_owners_identity() {
    let name = unique_name("attach");
    let owner = TierControl::create(&name, &CONFIG, b"model=m;dtype=bf16").unwrap();
    let client = TierControl::attach(&name).unwrap();
    assert_eq!(client.identity(), b"model=m;dtype=bf16");
    assert_eq!(client.config(), CONFIG);
    assert_eq!(client.owner(), ProcessIdentity::current());
    drop(client);
    drop(owner);
    assert!(matches!(
        TierControl::attach(&name),
        Err(TierAttachError::Shm(ShmError::NotFound { .. }))
    ));
}

#[test]
fn a_second_owner_is_refused_while_the_first_lives() {
    let name = unique_name("second");
    let _owner = TierControl::create(&name, &CONFIG, b"id").unwrap();
    let second = TierControl::create(&name, &CONFIG, b"id");
    assert!(
        matches!(second, Err(TierCreateError::Create(CreateError::InUse { .. }))),
        "{second:?}"
    );
}

/// An owner with more to set up makes the name its own closed: clients are refused until it
/// opens, and another owner finds the name in use all the same.
#[test]
fn a_closed_tier_refuses_clients_until_its_owner_opens_it() {
    let name = unique_name("closed");
    let owner = TierControl::create_closed(&name, &CONFIG, b"id").unwrap();
    let me = ProcessIdentity::current();
    assert!(matches!(
        TierControl::attach(&name),
        Err(TierAttachError::NotReady { creator }) if creator == me
    ));
    assert_eq!(TierControl::setting_up(&name), Some(me.pid));
    assert!(matches!(
        TierControl::create(&name, &CONFIG, b"id"),
        Err(TierCreateError::Create(CreateError::InUse { .. }))
    ));
    owner.open_to_clients();
    assert_eq!(TierControl::attach(&name).unwrap().identity(), b"id");
    assert_eq!(TierControl::setting_up(&name), None, "open: it serves");
}

#[test]
fn an_identity_longer_than_its_area_is_refused() {
    let name = unique_name("long");
    let created = TierControl::create(&name, &CONFIG, &[7; 257]);
    assert!(matches!(created, Err(TierCreateError::IdentityTooLong { len: 257, capacity: 256 })));
    assert!(TierControl::attach(&name).is_err(), "nothing left behind");
}

#[test]
fn a_scribbled_header_is_a_typed_error_for_the_attacher() {
    let name = unique_name("scribble");
    let owner = TierControl::create(&name, &CONFIG, b"id").unwrap();
    let header = owner.memory.as_ptr().cast::<TierHeaderFields>();
    let fields = owner.fields;
    let write = |fields: TierHeaderFields| {
        // SAFETY: the header lies at the start of the owner's mapping; a volatile store of a Pod,
        // as a scribbling process would make (the test's own object, no other process).
        unsafe { header.write_volatile(fields) }
    };
    write(TierHeaderFields { identity_len: 999, ..fields });
    assert!(matches!(TierControl::attach(&name), Err(TierAttachError::Corrupt { .. })));
    write(TierHeaderFields { config: TierConfig { clients: 0, ..CONFIG }, ..fields });
    assert!(matches!(TierControl::attach(&name), Err(TierAttachError::Config(_))));
    write(TierHeaderFields { total_size: 1 << 40, ..fields });
    assert!(matches!(TierControl::attach(&name), Err(TierAttachError::Corrupt { .. })));
    write(TierHeaderFields { layout_version: 99, ..fields });
    assert!(matches!(
        TierControl::attach(&name),
        Err(TierAttachError::VersionMismatch { found: 99, .. })
    ));
    write(TierHeaderFields { magic: 1, ..fields });
    assert!(matches!(TierControl::attach(&name), Err(TierAttachError::BadMagic { found: 1 })));
    write(fields);
    TierControl::attach(&name).unwrap();
}

#[test]
fn clients_claim_distinct_slots_until_none_is_free() {
    let name = unique_name("claims");
    let owner = TierControl::create(&name, &CONFIG, b"id").unwrap();
    let client = TierControl::attach(&name).unwrap();
    let claims: Vec<ClientClaim> = (0..3).map(|_| client.claim_client_slot().unwrap()).collect();
    assert_eq!(claims.iter().map(ClientClaim::index).collect::<Vec<_>>(), [0, 1, 2]);
    assert_eq!(client.claim_client_slot().err(), Some(ClientClaimError::NoFreeSlot { clients: 3 }));
    let verdict = owner.client_verdict(1, |process| process.is_alive()).unwrap();
    assert_eq!(verdict.status, RankStatus::Alive { pid: std::process::id() });
    drop(claims);
    assert!(
        client.claim_client_slot().is_err(),
        "a dropped claim leaves the slot to the owner, who has not reclaimed it"
    );
}

#[test]
fn a_dead_clients_slot_is_claimable_only_after_the_owner_reclaims_it() {
    let name = unique_name("reclaim");
    let owner = TierControl::create(&name, &TierConfig { clients: 1, ..CONFIG }, b"id").unwrap();
    let dead = owner.claim_client_slot_as(dead_process()).unwrap();
    assert!(owner.claim_client_slot().is_err(), "a dead client's slot waits for the owner");
    let verdict = owner.client_verdict(0, |process| process.is_alive()).unwrap();
    assert!(matches!(verdict.status, RankStatus::Dead { .. }));
    assert_eq!(verdict.word, dead.owner_word());
    owner.reclaim_client(0, verdict.word).unwrap();
    assert!(!dead.is_held());
    assert_eq!(owner.client_slot(0).unwrap().owner().state(), WorkerState::Empty);
    let claim = owner.claim_client_slot().unwrap();
    assert!(claim.is_held());
    // A reclaim judged on an older word changes nothing.
    assert!(owner.reclaim_client(0, verdict.word).is_err());
    assert!(claim.is_held());
}

#[test]
fn an_idle_client_is_judged_by_its_process_and_never_by_a_heartbeat() {
    let name = unique_name("idle");
    let owner = TierControl::create(&name, &CONFIG, b"id").unwrap();
    let claim = owner.claim_client_slot().unwrap();
    owner.client_slot(0).unwrap().overwrite_heartbeat(1);
    let verdict = owner.client_verdict(claim.index(), |process| process.is_alive()).unwrap();
    assert_eq!(verdict.status, RankStatus::Alive { pid: std::process::id() });
}

#[test]
fn listing_calls_a_tier_live_while_its_owner_runs_and_stale_once_it_is_dead() {
    let name = unique_name("listed");
    let owner = TierControl::create(&name, &CONFIG, b"id").unwrap();
    let listed = listing::list().into_iter().find(|listed| listed.name == name).unwrap();
    assert_eq!((listed.kind, listed.state), (SegmentKind::SharedTier, ListingState::Live));
    assert_eq!(listed.creator, Some(ProcessIdentity::current()));
    let header = owner.memory.as_ptr().cast::<TierHeaderFields>();
    let fields = TierHeaderFields { creator: dead_process(), ..owner.fields };
    // SAFETY: as in the scribble test: the test's own object, a volatile store of a Pod.
    unsafe { header.write_volatile(fields) };
    let listed = listing::list().into_iter().find(|listed| listed.name == name).unwrap();
    assert_eq!((listed.kind, listed.state), (SegmentKind::SharedTier, ListingState::Stale));
    // A new owner takes a dead one's name over (the old handle is forgotten, as a killed owner
    // leaves its object behind).
    std::mem::forget(owner);
    let successor = TierControl::create(&name, &CONFIG, b"id").unwrap();
    assert_eq!(TierControl::attach(&name).unwrap().owner(), successor.owner());
}

fn key(text: &str) -> WireKey {
    WireKey::new(text.as_bytes()).unwrap()
}

/// The client end of `claim`'s slot.
fn client_end(control: &TierControl, claim: &ClientClaim) -> ClientChannel {
    // SAFETY: each test holds at most one client end of a slot at a time.
    unsafe { control.client_channel(claim) }.unwrap()
}

/// The owner end of slot `index`.
fn owner_end(control: &TierControl, index: u32) -> OwnerChannel {
    // SAFETY: each test holds at most one owner end of a slot at a time.
    unsafe { control.owner_channel(index) }.unwrap()
}

#[test]
fn a_batch_goes_to_the_owner_and_its_answers_come_back_with_their_entries() {
    let name = unique_name("batch");
    let owner = TierControl::create(&name, &CONFIG, b"id").unwrap();
    let client = TierControl::attach(&name).unwrap();
    let claim = client.claim_client_slot().unwrap();
    let mut to_owner = client_end(&client, &claim);
    let mut from_client = owner_end(&owner, claim.index());

    to_owner.write_keys(0, &[key("a"), key("b"), key("c")]).unwrap();
    let calls = [
        TierRequest::new(1, TierOp::AcquirePrefix, 7, 0, 2),
        TierRequest::new(2, TierOp::CompleteStore, 7, 2, 1).with_flags(1),
        TierRequest::new(3, TierOp::EndBatch, 0, 0, 0),
    ];
    to_owner.send(&calls).unwrap();

    let mut requests = Vec::new();
    assert_eq!(from_client.take_requests(&mut requests).unwrap(), 3);
    assert_eq!(requests, calls);
    let mut keys = Vec::new();
    from_client.read_keys(&requests[1], &mut keys).unwrap();
    assert_eq!(keys[0].bytes().unwrap(), b"c");
    from_client.read_keys(&requests[0], &mut keys).unwrap();
    assert_eq!(keys.iter().map(|key| key.bytes().unwrap()).collect::<Vec<_>>(), [b"a", b"b"]);
    from_client.write_entries(0, &[40, 41]).unwrap();
    from_client
        .answer(&[
            TierAnswer::new(1, TierOp::AcquirePrefix, AnswerStatus::Done).with_entries(2, 0),
            TierAnswer::new(3, TierOp::EndBatch, AnswerStatus::Done),
        ])
        .unwrap();

    let mut answers = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    to_owner.wait_answers(&mut answers, WaitPolicy::default(), deadline).unwrap();
    assert_eq!(answers.len(), 2);
    assert_eq!(
        (answers[0].call, answers[0].count, answers[0].status()),
        (1, 2, AnswerStatus::Done)
    );
    let mut entries = Vec::new();
    to_owner.read_entries(answers[0].first_entry, answers[0].count, &mut entries).unwrap();
    assert_eq!(entries, [40, 41]);
}

#[test]
fn records_that_name_keys_outside_the_page_or_bad_keys_are_typed_errors() {
    let name = unique_name("bad-record");
    let owner = TierControl::create(&name, &CONFIG, b"id").unwrap();
    let claim = owner.claim_client_slot().unwrap();
    let from_client = owner_end(&owner, claim.index());
    let mut keys = Vec::new();
    for (first, count) in [(15, 2), (u32::MAX, 2), (0, 17)] {
        let request = TierRequest::new(1, TierOp::ReleaseLoads, 0, first, count);
        assert_eq!(
            from_client.read_keys(&request, &mut keys),
            Err(RecordError::KeysOutOfPage { first, count, page: 16 })
        );
    }
    let mut too_long = key("x");
    too_long.len = 65;
    assert_eq!(too_long.bytes(), Err(RecordError::KeyTooLong { len: 65 }));
    let unknown = TierRequest { op: 99, ..TierRequest::new(1, TierOp::EndBatch, 0, 0, 0) };
    assert_eq!(unknown.op(), Err(RecordError::UnknownOp { code: 99 }));
    let mut to_owner = client_end(&owner, &claim);
    assert!(to_owner.write_keys(10, &[key("k"); 7]).is_err());
    let mut out = Vec::new();
    assert!(to_owner.read_entries(30, 3, &mut out).is_err());
}

#[test]
fn a_reclaimed_slot_hands_its_next_client_empty_rings() {
    let name = unique_name("reset");
    let owner = TierControl::create(&name, &TierConfig { clients: 1, ..CONFIG }, b"id").unwrap();
    let dead = owner.claim_client_slot_as(dead_process()).unwrap();
    {
        let mut to_owner = client_end(&owner, &dead);
        to_owner.send(&[TierRequest::new(1, TierOp::EndBatch, 0, 0, 0)]).unwrap();
    }
    owner.reclaim_client(0, dead.owner_word()).unwrap();
    let claim = owner.claim_client_slot().unwrap();
    let _to_owner = client_end(&owner, &claim);
    let mut from_client = owner_end(&owner, 0);
    let mut requests = Vec::new();
    assert_eq!(
        from_client.take_requests(&mut requests).unwrap(),
        0,
        "the dead client's call is gone"
    );
}

/// A client that scribbled over its rings' descriptions (its request ring's capacity set to 1,
/// its answer ring's magic broken) before it died leaves the next client of its slot the rings
/// the owner made: the reclaim describes them again.
#[test]
fn a_reclaimed_slot_hands_its_next_client_rings_as_made_whatever_the_last_one_wrote() {
    use crate::sync::{AtomicU64, Ordering};
    let name = unique_name("redescribed");
    let owner = TierControl::create(&name, &TierConfig { clients: 1, ..CONFIG }, b"id").unwrap();
    let dead = owner.claim_client_slot_as(dead_process()).unwrap();
    let batch = client_end(&owner, &dead).batch_capacity();
    let (requests, answers) = owner.ring_bases(0);
    // The description's words: magic, element size, capacity (`ring/layout.rs`).
    // SAFETY: both ring headers lie in the mapping, 64-aligned, and are atomics only.
    let word = |base: *mut u8, at: usize| unsafe { &*base.add(at * 8).cast::<AtomicU64>() };
    word(requests, 2).store(1, Ordering::Relaxed);
    // SAFETY: the one owner end of the slot in this test.
    let refused = unsafe { owner.owner_channel(0) }.map(|_| ());
    let slots = u64::from(CONFIG.ring_slots);
    assert_eq!(refused, Err(RingError::CapacityMismatch { found: 1, expected: slots }));
    word(answers, 0).store(7, Ordering::Relaxed);
    owner.reclaim_client(0, dead.owner_word()).unwrap();
    let claim = owner.claim_client_slot().unwrap();
    assert_eq!(client_end(&owner, &claim).batch_capacity(), batch);
    let _from_client = owner_end(&owner, 0);
}

#[test]
fn the_figures_an_owner_publishes_for_a_slot_are_read_by_another_mapping() {
    let name = unique_name("stats");
    let owner = TierControl::create(&name, &CONFIG, b"m").unwrap();
    let figures = ClientFigures { chunks: 7, pins: 2, storing: 3, calls: 41 };
    owner.client_stats(1).unwrap().publish(figures);
    let reader = TierControl::attach(&name).unwrap();
    assert_eq!(reader.client_stats(1).unwrap().read(), figures);
    assert_eq!(reader.client_stats(0).unwrap().read(), ClientFigures::default());
    assert!(reader.client_stats(CONFIG.clients).is_none(), "no stats past the last slot");
    assert_eq!(reader.storage_stats().read(), None, "no storage tier published");
    let storage: [u64; STORAGE_FIGURES] = std::array::from_fn(|at| at as u64 * 3 + 1);
    owner.storage_stats().publish(&storage);
    assert_eq!(reader.storage_stats().read(), Some(storage));
    // The stats sit between the slots and the identity, which they leave whole.
    assert_eq!(reader.identity(), b"m");
}
