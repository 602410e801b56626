//! The tier's control object in one process: create, attach, checks, client slots.

use super::*;
use crate::listing::{self, ListingState, SegmentKind};
use crate::worker_slot::{RankStatus, WorkerState};

fn unique_name(test: &str) -> SegmentName {
    SegmentName::new(&format!("t-tier-{test}-{}", std::process::id())).unwrap()
}

const CONFIG: TierConfig = TierConfig { clients: 3, identity_capacity: 256 };

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
    let mut reset = false;
    owner.reclaim_client(0, verdict.word, || reset = true).unwrap();
    assert!(reset);
    assert!(!dead.is_held());
    assert_eq!(owner.client_slot(0).unwrap().owner().state(), WorkerState::Empty);
    let claim = owner.claim_client_slot().unwrap();
    assert!(claim.is_held());
    // A reclaim judged on an older word changes nothing.
    assert!(owner.reclaim_client(0, verdict.word, || panic!("must not reset")).is_err());
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
