//! A shared tier's leases (`SharedTierIndex::lease`, `store_leased`): chunks a client holds
//! ahead of its stores, named later; `check_invariants` after every step.

use kvshm::offload::{LookupResult, OffloadKey, PreparedStore, SharedTierError};

use crate::shared_tier::{check, identity, key, keys, tier};

#[test]
fn leased_chunks_take_the_stores_named_later_and_a_key_the_tier_had_frees_its_chunk() {
    let mut index = tier(1024);
    assert_eq!(index.max_lease(), 16);
    let a = index.attach(&identity(), "a", None).unwrap();
    let b = index.attach(&identity(), "b", None).unwrap();
    let mut granted = Vec::new();
    index.lease(a, 100, &mut granted).unwrap();
    assert_eq!(granted.len(), 16, "capped at a 64th of the tier");
    check(&index);
    let summary = index.client_summary(a).unwrap();
    assert_eq!((summary.leased, summary.chunks), (16, 0), "leased, no key stored");
    index.lease(a, 100, &mut granted).unwrap();
    assert!(granted.is_empty(), "topped up already");

    // b stores block 2 first; a then names blocks 1 to 3 in its first three chunks.
    let mut out = PreparedStore::default();
    assert!(index.prepare_store(b, "rb", &keys(&[2]), &mut out).unwrap());
    index.complete_store(b, &keys(&[2]), true).unwrap();
    let before = index.stats().chunks_used;
    index.store_leased(a, "ra", &keys(&[1, 2, 3]), 0).unwrap();
    check(&index);
    assert_eq!(index.peek(&key(1)), LookupResult::HitPending);
    assert_eq!(index.client_summary(a).unwrap().leased, 14, "13 leased and a spare");
    index.complete_store(a, &keys(&[1, 2, 3]), true).unwrap();
    check(&index);
    assert_eq!(index.peek(&key(3)), LookupResult::Hit);
    assert_eq!(index.stats().chunks_used, before - 1, "the spare is free again");
    assert_eq!(index.client_summary(a).unwrap().chunks, 2, "keys 1 and 3");

    // The next call goes on from chunk 3; a top-up adds the 3 used.
    index.store_leased(a, "ra", &keys(&[4]), 3).unwrap();
    index.lease(a, 16, &mut granted).unwrap();
    assert_eq!(granted.len(), 4);
    check(&index);
    let released = index.release_client(a).unwrap();
    assert_eq!((released.leased, released.stores), (16, 1));
    check(&index);
    assert_eq!(index.peek(&key(4)), LookupResult::Miss, "a store never completed");
}

#[test]
fn a_store_out_of_its_lease_changes_nothing_and_a_key_stored_twice_holds_its_chunk() {
    let mut index = tier(1024);
    let a = index.attach(&identity(), "a", None).unwrap();
    let mut granted = Vec::new();
    index.lease(a, 6, &mut granted).unwrap();
    let refused = |result: Result<(), SharedTierError>| {
        assert!(matches!(result, Err(SharedTierError::LeaseMismatch { .. })), "{result:?}");
    };
    refused(index.store_leased(a, "r", &keys(&[1]), 1));
    refused(index.store_leased(a, "r", &keys(&[1, 2, 3, 4, 5, 6, 7]), 0));
    check(&index);
    assert_eq!(index.client_summary(a).unwrap().leased, 6, "nothing changed");
    // Key 1 twice in a call, then again while its store is pending: both later chunks held.
    index.store_leased(a, "r", &keys(&[1, 1]), 0).unwrap();
    index.store_leased(a, "r", &keys(&[1]), 2).unwrap();
    check(&index);
    refused(index.store_leased(a, "r", &keys(&[2]), 2));
    assert_eq!(index.peek(&key(1)), LookupResult::HitPending);
    index.complete_store(a, &keys(&[1]), true).unwrap();
    check(&index);
    let summary = index.client_summary(a).unwrap();
    assert_eq!((summary.leased, summary.chunks), (5, 1), "3 leased and 2 held, and key 1");
    assert_eq!(index.release_client(a).unwrap().leased, 5);
    check(&index);
}

#[test]
fn a_lease_stays_within_the_quota_and_the_free_chunks() {
    let mut index = tier(512);
    index.keep_free(0);
    let a = index.attach(&identity(), "a", Some(3)).unwrap();
    let b = index.attach(&identity(), "b", None).unwrap();
    let mut granted = Vec::new();
    index.lease(a, 8, &mut granted).unwrap();
    assert_eq!(granted.len(), 3, "a's quota");
    // Fill the tier: no chunk is free, so no lease is granted (a lease never evicts).
    let mut out = PreparedStore::default();
    let rest: Vec<OffloadKey> = (100..609).map(key).collect();
    assert!(index.prepare_store(b, "fill", &rest, &mut out).unwrap());
    index.lease(b, 8, &mut granted).unwrap();
    assert!(granted.is_empty());
    check(&index);
}

/// However many clients lease, their leases hold at most an eighth of the tier together; a
/// chunk a store names leaves the lease and makes room for another client's.
#[test]
fn the_leases_of_all_clients_together_hold_at_most_an_eighth_of_the_tier() {
    let mut index = tier(1024);
    assert_eq!((index.max_lease(), index.max_leased()), (16, 128));
    let clients: Vec<_> =
        (0..10).map(|at| index.attach(&identity(), &format!("c{at}"), None).unwrap()).collect();
    let mut granted = Vec::new();
    let mut leased = Vec::new();
    for &client in &clients {
        index.lease(client, 16, &mut granted).unwrap();
        leased.push(granted.len());
        check(&index);
    }
    assert_eq!(leased, [16, 16, 16, 16, 16, 16, 16, 16, 0, 0], "128 chunks in all");
    // The first client names 5 of its chunks: the ninth may take those 5.
    index.store_leased(clients[0], "r", &keys(&[1, 2, 3, 4, 5]), 0).unwrap();
    index.lease(clients[8], 16, &mut granted).unwrap();
    assert_eq!(granted.len(), 5);
    index.lease(clients[9], 16, &mut granted).unwrap();
    assert!(granted.is_empty());
    check(&index);
    // A client that leaves gives its lease back to the others.
    index.release_client(clients[1]).unwrap();
    index.lease(clients[9], 16, &mut granted).unwrap();
    assert_eq!(granted.len(), 16);
    check(&index);
}

/// A lease asked for after a store that filled the answer page gets what the page has room
/// for, and the owner keeps serving (it panicked on the undo before).
#[test]
fn a_lease_after_a_store_that_fills_the_answer_page_is_cut_to_the_room_left() {
    use kvshm::offload::{OffloadConfig, SharedTierIndex, TierServer};
    use kvshm_ipc::tier_control::{TierConfig, TierControl, TierOp, TierRequest, WireKey};

    let name =
        kvshm_ipc::name::SegmentName::new(&format!("t-lease-page-{}", std::process::id())).unwrap();
    let index = SharedTierIndex::new(identity(), OffloadConfig::new(1024)).unwrap();
    let mut config = TierConfig::with_clients(1);
    config.page_keys = 4;
    let mut server = TierServer::create(&name, index, &config).unwrap();
    let control = TierControl::attach(&name).unwrap();
    let claim = control.claim_client_slot().unwrap();
    // SAFETY: the one client end of this slot in this test.
    let mut to_owner = unsafe { control.client_channel(&claim) }.unwrap();
    server.turn();
    let wire: Vec<WireKey> =
        keys(&[1, 2, 3]).iter().map(|key| WireKey::new(key.as_bytes()).unwrap()).collect();
    to_owner.write_keys(0, &wire).unwrap();
    // Three keys to store: 6 of the page's 8 entries; the lease gets the 2 left.
    let batch = [
        TierRequest::new(1, TierOp::PrepareStore, 0, 0, 3),
        TierRequest::new(2, TierOp::Lease, 0, 0, 0).with_lease(16),
        TierRequest::new(3, TierOp::EndBatch, 0, 0, 0),
    ];
    to_owner.send(&batch).unwrap();
    server.turn();
    let client = server.owner().clients()[0].summary.id;
    assert_eq!(server.owner().index().client_summary(client).unwrap().leased, 2);
    check(server.owner().index());
}
