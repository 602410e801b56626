//! A shared tier's leases (`SharedTierIndex::lease`, `store_leased`): chunks a client holds
//! ahead of its stores, named later; `check_invariants` after every step.

use std::time::{Duration, Instant};

use kvshm::offload::{LookupResult, OffloadKey, PreparedStore, SharedTierError, DEAD_CLIENT_GRACE};

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

/// A key a client writes into a spare (the tier had it when its lease named it) is not stored
/// again for that client while the spare is held, even once the tier lost the key: the spare's
/// end would otherwise free it and make the new chunk loadable while the engine still wrote it.
#[test]
fn a_key_written_into_a_spare_is_not_stored_again_until_that_store_ends() {
    let mut index = tier(1024);
    let a = index.attach(&identity(), "a", None).unwrap();
    let b = index.attach(&identity(), "b", None).unwrap();
    let mut granted = Vec::new();
    index.lease(a, 4, &mut granted).unwrap();
    let mut out = PreparedStore::default();
    assert!(index.prepare_store(b, "rb", &keys(&[1]), &mut out).unwrap());
    index.store_leased(a, "ra", &keys(&[1]), 0).unwrap();
    assert_eq!(index.client_summary(a).unwrap().leased, 4, "3 leased and a spare");
    // b's store of key 1 is dropped: the tier no longer has the key.
    index.release_client(b).unwrap();
    assert_eq!(index.peek(&key(1)), LookupResult::Miss);
    check(&index);

    // a's engine offers keys 2, 1 and 3 through the owner: key 1 is skipped.
    assert!(index.prepare_store(a, "ra2", &keys(&[2, 1, 3]), &mut out).unwrap());
    assert_eq!(out.to_store, vec![0, 2], "key 1 is being written into a spare");
    check(&index);
    index.complete_store(a, &keys(&[1]), true).unwrap();
    assert_eq!(index.peek(&key(1)), LookupResult::Miss, "the spare's end stores nothing");
    index.complete_store(a, &keys(&[2, 3]), true).unwrap();
    check(&index);
    // The spare gone, key 1 may be stored again.
    assert!(index.prepare_store(a, "ra3", &keys(&[1]), &mut out).unwrap());
    assert_eq!(out.to_store, vec![0]);
    check(&index);
}

/// A client that died may have copies still running into its leased chunks (its engine writes
/// one at once, before telling the owner) and into its partial stores' chunks: they go to no
/// other store until the grace has passed. A client that detaches frees them at once.
#[test]
fn a_dead_clients_lease_and_partial_stores_go_to_no_store_until_the_grace_ends() {
    let mut index = tier(256);
    index.keep_free(0);
    let a = index.attach(&identity(), "a", None).unwrap();
    let b = index.attach(&identity(), "b", None).unwrap();
    let mut granted = Vec::new();
    index.lease(a, 4, &mut granted).unwrap();
    assert_eq!(granted.len(), 4);
    index.store_leased(a, "ra", &keys(&[1]), 0).unwrap();
    let died = Instant::now();
    let released = index.release_dead_client(a, died + DEAD_CLIENT_GRACE).unwrap();
    assert_eq!((released.leased, released.stores, released.held_back), (3, 1, 4));
    check(&index);
    let mut held: Vec<u32> = index.held_back_chunks().collect();
    held.sort_unstable();
    granted.sort_unstable();
    assert_eq!(held, granted);

    // b takes every free chunk, and none of a's; then there is no room left.
    let mut out = PreparedStore::default();
    let fill: Vec<u32> = (100..352).collect();
    assert!(index.prepare_store(b, "rb", &keys(&fill), &mut out).unwrap());
    assert!(out.chunks.iter().all(|chunk| !held.contains(chunk)), "{held:?}");
    assert!(!index.prepare_store(b, "rb", &keys(&[999]), &mut out).unwrap());
    check(&index);
    let almost = died + DEAD_CLIENT_GRACE - Duration::from_millis(1);
    assert_eq!(index.return_held_back(almost), 0);
    assert_eq!(index.return_held_back(died + DEAD_CLIENT_GRACE), 4);
    check(&index);
    assert!(index.prepare_store(b, "rb", &keys(&[999]), &mut out).unwrap());
    assert!(held.contains(&out.chunks[0]));
    check(&index);

    // Detached, a client's lease is free at once.
    let c = index.attach(&identity(), "c", None).unwrap();
    index.complete_store(b, &keys(&fill), true).unwrap();
    index.lease(c, 4, &mut granted).unwrap();
    let leased = granted.len() as u32;
    assert!(leased > 0);
    let released = index.release_client(c).unwrap();
    assert_eq!((released.leased, released.held_back), (leased, 0));
    assert_eq!(index.held_back_chunks().count(), 0);
    check(&index);
}

/// Chunks held back for a dead client are free within the grace: the owner does not evict cached
/// keys ahead of demand to stand in for them (they would be lost for nothing when the grace ends).
#[test]
fn chunks_held_back_for_a_dead_client_count_as_free_ahead_of_demand() {
    let mut index = tier(2048);
    index.keep_free(8);
    assert_eq!(index.free_target(), 8);
    let a = index.attach(&identity(), "a", None).unwrap();
    let b = index.attach(&identity(), "b", None).unwrap();
    let mut granted = Vec::new();
    index.lease(a, 4, &mut granted).unwrap();
    assert_eq!(granted.len(), 4);
    let fill: Vec<u32> = (0..2044).collect();
    let mut out = PreparedStore::default();
    assert!(index.prepare_store(b, "rb", &keys(&fill), &mut out).unwrap());
    index.complete_store(b, &keys(&fill), true).unwrap();
    index.release_dead_client(a, Instant::now() + DEAD_CLIENT_GRACE).unwrap();
    assert_eq!(index.evict_ahead(100), 4, "8 free wanted, 4 held back");
    assert_eq!(index.evict_ahead(100), 0);
    check(&index);
}

/// A client that abandons its stores (its engine reset its cache with the copies in flight, and
/// will report none) drops their keys, so that any engine may store them again at once, and holds
/// their chunks, and its spare of a key the tier had, until it leaves: its engine may run those
/// copies at its next step, however late.
#[test]
fn abandoned_stores_free_their_keys_at_once_and_their_chunks_when_the_client_leaves() {
    let mut index = tier(256);
    index.keep_free(0);
    let a = index.attach(&identity(), "a", None).unwrap();
    let b = index.attach(&identity(), "b", None).unwrap();
    let mut out = PreparedStore::default();
    assert!(index.prepare_store(b, "rb", &keys(&[2]), &mut out).unwrap());
    index.complete_store(b, &keys(&[2]), true).unwrap();
    let mut granted = Vec::new();
    index.lease(a, 4, &mut granted).unwrap();
    // Key 1 pending in a's first leased chunk, key 2 (the tier's) in a spare.
    index.store_leased(a, "ra", &keys(&[1, 2]), 0).unwrap();
    assert!(index.prepare_store(a, "ra", &keys(&[3]), &mut out).unwrap());
    let three = out.chunks[0];
    assert_eq!(index.peek(&key(1)), LookupResult::HitPending);
    assert_eq!(index.abandon_stores(a, &keys(&[1, 2, 3, 9])).unwrap(), 3);
    check(&index);
    assert_eq!(index.peek(&key(1)), LookupResult::Miss, "free to be stored again");
    assert_eq!(index.peek(&key(3)), LookupResult::Miss);
    assert_eq!(index.peek(&key(2)), LookupResult::Hit, "b's key stays");
    let summary = index.client_summary(a).unwrap();
    assert_eq!((summary.storing, summary.leased, summary.chunks), (0, 5, 0), "2 leased, 3 held");
    // b stores key 1 at once, into none of a's chunks, and fills the tier: a's stay a's.
    let mut held = granted[..2].to_vec();
    held.push(three);
    let fill: Vec<u32> = (100..349).collect();
    assert!(index.prepare_store(b, "rb", &keys(&[1]), &mut out).unwrap());
    assert!(!held.contains(&out.chunks[0]));
    assert!(index.prepare_store(b, "rb", &keys(&fill), &mut out).unwrap());
    assert!(out.chunks.iter().all(|chunk| !held.contains(chunk)), "{held:?}");
    index.complete_store(b, &keys(&[1]), true).unwrap();
    index.complete_store(b, &keys(&fill), true).unwrap();
    // a's completion, had it come after all, would change nothing.
    index.complete_store(a, &keys(&[1]), true).unwrap();
    assert_eq!(index.peek(&key(1)), LookupResult::Hit);
    check(&index);
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

/// Each client's lease is topped up to at most its equal share of an eighth of the tier among
/// the clients attached, so a client that never names its chunks holds no more than its share;
/// and the unnamed chunks of all leases stay within that eighth, also when clients attach after
/// the others leased: a chunk named (even as a spare) or a client gone makes room again.
#[test]
fn leases_hold_an_equal_share_of_an_eighth_of_the_tier_and_never_more_than_the_eighth() {
    let mut index = tier(1024);
    assert_eq!((index.max_lease(), index.max_leased()), (16, 128));
    let attach = |index: &mut kvshm::offload::SharedTierIndex, at: usize| {
        index.attach(&identity(), &format!("c{at}"), None).unwrap()
    };
    let mut granted = Vec::new();
    let mut lease = |index: &mut kvshm::offload::SharedTierIndex, client| {
        index.lease(client, 16, &mut granted).unwrap();
        check(index);
        granted.len()
    };
    // Ten attached: a share of 12 each, 120 in all.
    let first: Vec<_> = (0..10).map(|at| attach(&mut index, at)).collect();
    assert_eq!(index.max_lease(), 12);
    let leased: Vec<usize> = first.iter().map(|&client| lease(&mut index, client)).collect();
    assert_eq!(leased, [12; 10]);
    for client in first {
        index.release_client(client).unwrap();
    }
    // Eight lease 16 each (the whole eighth); two more attach: their share is 12, but nothing
    // is left of the eighth until chunks are named or a client goes.
    let clients: Vec<_> = (0..8).map(|at| attach(&mut index, at)).collect();
    let leased: Vec<usize> = clients.iter().map(|&client| lease(&mut index, client)).collect();
    assert_eq!(leased, [16; 8]);
    let (late, later) = (attach(&mut index, 8), attach(&mut index, 9));
    assert_eq!((index.max_lease(), lease(&mut index, late)), (12, 0));
    // Client 0 names 5 chunks, one of them for a key the tier had (a spare): 5 free for `late`.
    let mut out = PreparedStore::default();
    assert!(index.prepare_store(clients[1], "r1", &keys(&[1]), &mut out).unwrap());
    index.store_leased(clients[0], "r0", &keys(&[1, 2, 3, 4, 5]), 0).unwrap();
    check(&index);
    assert_eq!((lease(&mut index, late), lease(&mut index, later)), (5, 0));
    // A client that goes gives its lease back.
    index.release_client(clients[2]).unwrap();
    assert_eq!(lease(&mut index, later), 14, "its share with 9 attached, of the 16 left");
}

/// A leased store refused for its request (the client has `MAX_REQUESTS` live) still takes its
/// chunks out of the lease, held, as the client's book took them: the next store, numbered on,
/// is served, and the chunks go back when the client leaves.
#[test]
fn a_leased_store_refused_for_its_request_keeps_the_lease_in_step() {
    use kvshm::offload::shared::MAX_REQUESTS;
    let mut index = tier(1024);
    let a = index.attach(&identity(), "a", None).unwrap();
    let mut granted = Vec::new();
    index.lease(a, 4, &mut granted).unwrap();
    for request in 0..MAX_REQUESTS {
        index.acquire_prefix(a, &request.to_string(), &keys(&[99]), &mut Vec::new()).unwrap();
    }
    let refused = index.store_leased(a, "new", &keys(&[1, 2]), 0).unwrap_err();
    assert!(matches!(refused, SharedTierError::TooManyRequests { .. }), "{refused}");
    check(&index);
    assert_eq!(index.client_summary(a).unwrap().leased, 4, "2 leased and 2 held");
    index.store_leased(a, "7", &keys(&[3]), 2).unwrap();
    check(&index);
    assert_eq!(index.peek(&key(3)), LookupResult::HitPending);
    assert_eq!(index.release_client(a).unwrap().leased, 3, "1 leased and 2 held");
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
