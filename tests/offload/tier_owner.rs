//! The tier owner's side of its clients (`TierOwner`), with real processes: a client killed
//! with SIGKILL has its pins and partial stores released at the owner's next sweep, and no other
//! client loses a block.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use kvshm::offload::{
    AttachError, LookupResult, OffloadConfig, OffloadKey, PreparedStore, SharedTierIndex,
    TierOwner, TierServer, DEAD_CLIENT_GRACE, SWEEP_INTERVAL,
};
use kvshm_ipc::liveness::ProcessIdentity;

use crate::shared_tier::identity;

fn keys(blocks: &[u8]) -> Vec<OffloadKey> {
    blocks.iter().map(|&block| OffloadKey::new(&[block; 16]).unwrap()).collect()
}

/// A process standing for an engine instance.
fn engine() -> (Child, ProcessIdentity) {
    let child = Command::new("sleep").arg("60").spawn().expect("sleep runs");
    let identity = ProcessIdentity::of_pid(child.id()).expect("the child runs");
    (child, identity)
}

/// A client found dead outside a sweep (its channel broke as it died) is released as a reaped
/// one is: the chunks its copy side may still be writing are held back for the grace.
#[test]
fn a_client_found_dead_outside_a_sweep_has_its_chunks_held_back_too() {
    let mut owner =
        TierOwner::new(SharedTierIndex::new(identity(), OffloadConfig::new(8)).unwrap());
    let (mut process, process_identity) = engine();
    let client = owner.attach_process(&identity(), "c", None, process_identity).unwrap();
    let mut out = PreparedStore::default();
    assert!(owner.index().prepare_store(client, "r", &keys(&[1, 2]), &mut out).unwrap());
    process.kill().unwrap();
    process.wait().unwrap();
    let released = owner.release_dead(client).unwrap();
    assert_eq!((released.stores, released.held_back), (2, 2));
    assert_eq!(owner.index().held_back_chunks().count(), 2);
    owner.index().check_invariants().unwrap();
    let mut reaped = Vec::new();
    owner.reap(&mut reaped);
    assert!(reaped.is_empty(), "released already: no longer watched");
}

#[test]
fn a_client_killed_mid_load_and_mid_store_is_released_and_the_others_keep_their_blocks() {
    let mut owner =
        TierOwner::new(SharedTierIndex::new(identity(), OffloadConfig::new(8)).unwrap());
    let (mut doomed_process, doomed_identity) = engine();
    let (mut survivor_process, survivor_identity) = engine();
    let survivor = owner.attach_process(&identity(), "survivor", None, survivor_identity).unwrap();
    let doomed = owner.attach_process(&identity(), "doomed", None, doomed_identity).unwrap();
    let mut out = PreparedStore::default();
    let index = owner.index();
    assert!(index.prepare_store(survivor, "s", &keys(&[1, 2]), &mut out).unwrap());
    index.complete_store(survivor, &keys(&[1, 2]), true).unwrap();
    // The doomed client loads the survivor's blocks and stores two of its own.
    assert_eq!(index.acquire_prefix(doomed, "d", &keys(&[1, 2]), &mut Vec::new()).unwrap(), 2);
    assert!(index.prepare_store(doomed, "d", &keys(&[1, 2, 3, 4]), &mut out).unwrap());
    index.check_invariants().unwrap();
    let mut reaped = Vec::new();
    owner.reap(&mut reaped);
    assert!(reaped.is_empty(), "both clients live");

    doomed_process.kill().unwrap(); // SIGKILL
    let killed = Instant::now();
    while reaped.is_empty() && killed.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(SWEEP_INTERVAL);
        owner.reap(&mut reaped);
    }
    eprintln!("released {:?} after the SIGKILL", killed.elapsed());
    assert_eq!(reaped.len(), 1, "the killed client is released");
    assert_eq!((reaped[0].client, reaped[0].pid), (doomed, doomed_identity.pid));
    let released = reaped[0].released;
    assert_eq!((released.pins, released.stores, released.held_back), (2, 2, 2));
    let index = owner.index();
    index.check_invariants().unwrap();
    assert_eq!(index.peek(&keys(&[3])[0]), LookupResult::Miss, "a partial store is never a hit");
    for key in keys(&[1, 2]) {
        assert_eq!(index.peek(&key), LookupResult::Hit, "the survivor's blocks stay");
    }
    // Its pins are gone: the survivor's blocks can be evicted again. The chunks of its partial
    // stores go to no store for the grace: its copy side may still be writing them.
    let mut held: Vec<u32> = index.held_back_chunks().collect();
    held.sort_unstable();
    assert!(index.prepare_store(survivor, "t", &keys(&[10, 11, 12, 13, 14]), &mut out).unwrap());
    assert_eq!(out.evicted.len(), 1, "{out:?}");
    assert!(out.chunks.iter().all(|chunk| !held.contains(chunk)), "{out:?} {held:?}");
    index.complete_store(survivor, &keys(&[10, 11, 12, 13, 14]), true).unwrap();
    assert_eq!(index.return_held_back(Instant::now()), 0, "within the grace");
    assert_eq!(index.return_held_back(Instant::now() + DEAD_CLIENT_GRACE), 2);
    index.check_invariants().unwrap();
    assert!(index.prepare_store(survivor, "t", &keys(&[15, 16]), &mut out).unwrap());
    let mut reused = out.chunks.clone();
    reused.sort_unstable();
    assert_eq!((reused, out.evicted.len()), (held, 0), "free again after the grace");
    index.complete_store(survivor, &keys(&[15, 16]), true).unwrap();
    let listed = owner.clients();
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0].pid, listed[0].summary.id), (survivor_identity.pid, survivor));
    doomed_process.wait().unwrap();
    // The survivor leaves on its own: its blocks stay, and its process is no longer watched.
    let released = owner.detach(survivor).unwrap();
    assert_eq!((released.pins, released.stores, released.chunks), (0, 0, 8));
    assert!(owner.clients().is_empty());
    survivor_process.kill().unwrap();
    survivor_process.wait().unwrap();
    owner.reap(&mut reaped);
    assert_eq!(reaped.len(), 1, "a detached client is not reaped");
    assert_eq!(owner.index().len(), 8);
}

#[test]
fn a_process_that_is_gone_cannot_attach() {
    let mut owner =
        TierOwner::new(SharedTierIndex::new(identity(), OffloadConfig::new(4)).unwrap());
    let (mut process, process_identity) = engine();
    process.kill().unwrap();
    process.wait().unwrap();
    let refused = owner.attach_process(&identity(), "late", None, process_identity).unwrap_err();
    assert!(matches!(refused, AttachError::Process(_)), "{refused}");
    assert!(owner.clients().is_empty() && owner.index().clients().is_empty());
}

/// A client the owner lets go while its process lives (here: it leaves no room for its answers)
/// keeps its slot fenced: that process may still write the slot's rings and key page, so no
/// other client may claim the slot until the process exits.
#[test]
fn a_live_client_let_go_for_its_channel_keeps_its_slot_and_chunks_fenced() {
    use kvshm_ipc::tier_control::{ClientClaimError, TierConfig, TierControl, TierOp, TierRequest};

    let name =
        kvshm_ipc::name::SegmentName::new(&format!("t-fence-{}", std::process::id())).unwrap();
    let index = SharedTierIndex::new(identity(), OffloadConfig::new(8)).unwrap();
    let mut server = TierServer::create(&name, index, &TierConfig::with_clients(1)).unwrap();
    let control = TierControl::attach(&name).unwrap();
    let claim = control.claim_client_slot().unwrap();
    // SAFETY: the one client end of this slot in this test.
    let mut to_owner = unsafe { control.client_channel(&claim) }.unwrap();
    server.turn();
    // A store it is copying into, pending.
    let client = server.owner().clients()[0].summary.id;
    let mut out = PreparedStore::default();
    assert!(server.owner().index().prepare_store(client, "r", &keys(&[1]), &mut out).unwrap());
    let mut gone = Vec::new();
    for call in 0..10_000u64 {
        // Batches whose answers are never read, until the owner lets the client go.
        if to_owner.send(&[TierRequest::new(call, TierOp::EndBatch, 0, 0, 0)]).is_err() {
            server.turn();
            continue;
        }
        server.turn();
        gone = server.take_gone();
        if !gone.is_empty() {
            break;
        }
    }
    assert_eq!(gone.len(), 1, "the owner let the client go");
    assert!(!gone[0].died, "{gone:?}");
    for _ in 0..3 {
        server.turn();
    }
    assert!(
        matches!(control.claim_client_slot(), Err(ClientClaimError::NoFreeSlot { .. })),
        "the slot of a live client is fenced, not handed to another"
    );
    // Its process may still copy into the chunk of its pending store: held until it exits.
    let held = server.owner().index().client_summary(client).expect("still attached");
    assert_eq!(held.storing, 1);
    assert_eq!(gone[0].released, Default::default(), "nothing released while it lives");
}

/// The owner evicts ahead of demand at each turn of its loop, once it has answered: a full tier
/// of 512 chunks has 2 free (its free target) after a turn.
#[test]
fn a_turn_of_the_owner_frees_chunks_ahead_of_demand() {
    use kvshm_ipc::tier_control::TierConfig;

    let mut index = SharedTierIndex::new(identity(), OffloadConfig::new(512)).unwrap();
    let client = index.attach(&identity(), "engine", None).unwrap();
    let keys: Vec<OffloadKey> = (0..512u32)
        .map(|block| {
            let mut bytes = [0u8; 16];
            bytes[..4].copy_from_slice(&block.to_le_bytes());
            OffloadKey::new(&bytes).unwrap()
        })
        .collect();
    let mut out = PreparedStore::default();
    assert!(index.prepare_store(client, "r", &keys, &mut out).unwrap());
    index.complete_store(client, &keys, true).unwrap();
    index.finish_request(client, "r").unwrap();
    assert_eq!(index.stats().chunks_used, 512);

    let name =
        kvshm_ipc::name::SegmentName::new(&format!("t-ahead-{}", std::process::id())).unwrap();
    let mut server = TierServer::create(&name, index, &TierConfig::with_clients(1)).unwrap();
    server.turn();
    assert_eq!(server.owner().index().stats().chunks_used, 510);
    server.owner().index().check_invariants().unwrap();
}
