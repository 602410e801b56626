//! `kvctl tier` against a live shared tier: its owner (a `TierServer` this test serves turns
//! of, with a storage tier on disk below) and one client in a thread of its own, holding pins and
//! pending stores: the listing shows them and the storage's figures as the owner published them,
//! and the client is gone from it once it detached.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvshm::offload::shared::{TierArenas, TierStorage};
use kvshm::offload::{
    CallAnswer, ClientOptions, OffloadConfig, OffloadKey, SharedTierIndex, StoreEnd, TierCall,
    TierClient, TierIdentity, TierServer,
};
use kvshm::storage::spec::{StorageOptions, StorageSpec};
use kvshm_ipc::tier_control::TierConfig;

use crate::support::{kvctl, unique_name, Cleanup};

fn identity() -> TierIdentity {
    TierIdentity {
        model: "m".into(),
        kv_dtype: "float16".into(),
        block_tokens: 16,
        block_bytes: 4096,
        blocks_per_chunk: 1,
        layout: "tp1".into(),
    }
}

fn key(n: u8) -> OffloadKey {
    OffloadKey::new(&[n; 16]).unwrap()
}

#[test]
fn tier_lists_each_client_with_its_chunks_pins_and_pending_stores() {
    let name = unique_name("tier");
    let _cleanup = Cleanup(name.clone());
    let index = SharedTierIndex::new(identity(), OffloadConfig::new(8)).unwrap();
    let mut server = TierServer::create(&name, index, &TierConfig::with_clients(4)).unwrap();
    // A storage tier below, on disk, over the tier's arena.
    let _arenas = TierArenas::create_or_adopt(&name, 1, 8, 4096).unwrap();
    let disk = std::env::temp_dir().join(format!("kvctl-tier-{}", name.as_str()));
    let options = StorageOptions::new(StorageSpec::Disk { dir: disk.clone() });
    let storage = TierStorage::open(&name, 1, 8, &options, server.owner().index()).unwrap();
    server.keep_storage(storage);

    // The client stores 1,2,3, completes 1, and loads it (one pin); 2 and 3 stay pending.
    let (done, client_done) = mpsc::channel();
    let (leave, client_leaves) = mpsc::channel::<()>();
    let client_name = name.clone();
    let client = std::thread::spawn(move || {
        let mut client =
            TierClient::new(client_name, identity(), ClientOptions::default()).unwrap();
        let mut answers = Vec::new();
        let keys = [key(1), key(2), key(3)];
        let prepare = TierCall::PrepareStore { request: "r", keys: &keys };
        client.call(&[prepare], &mut answers).unwrap();
        assert!(matches!(&answers[0], CallAnswer::Store { to_store, .. } if to_store.len() == 3));
        let complete = TierCall::CompleteStore { keys: &keys[..1], end: StoreEnd::Stored };
        let acquire = TierCall::AcquirePrefix { request: "r", keys: &keys[..1] };
        client.call(&[complete, acquire], &mut answers).unwrap();
        let loaded = matches!(&answers[1], CallAnswer::Prefix { chunks, .. } if chunks.len() == 1);
        assert!(loaded, "the completed key is no hit: {:?}", answers[1]);
        done.send(()).unwrap();
        client_leaves.recv().unwrap();
        drop(client); // detaches
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while client_done.try_recv().is_err() {
        assert!(Instant::now() < deadline, "the client's calls were never answered");
        server.turn();
    }
    // The completed key is written through to disk.
    while server.storage().unwrap().stats().puts < 1 {
        assert!(Instant::now() < deadline, "the completed key was never written");
        server.turn();
    }

    let listed = kvctl(&["tier", name.as_str(), "--json"]);
    let report: serde_json::Value = serde_json::from_str(&listed.assert_ok().stdout).unwrap();
    assert_eq!(report["owner_pid"], std::process::id());
    assert_eq!(report["identity"]["model"], "m");
    let clients = report["clients"].as_array().unwrap();
    assert_eq!(clients.len(), 1, "{report}");
    let row = &clients[0];
    assert_eq!(row["state"], "attached");
    assert_eq!(row["pid"], std::process::id());
    assert_eq!((&row["chunks"], &row["pins"], &row["storing"]), (&3.into(), &1.into(), &2.into()));
    // Each batch it waited for asked to top its lease up too (an 8-chunk tier leases none).
    assert_eq!(row["calls"], 5, "prepare, complete and acquire, and two lease top-ups");
    let storage = &report["storage"];
    assert_eq!(
        (&storage["held"], &storage["puts"], &storage["writing"]),
        (&1.into(), &1.into(), &0.into())
    );

    let text = kvctl(&["tier", name.as_str()]);
    let text = &text.assert_ok().stdout;
    assert!(text.contains("owner pid") && text.contains("PINS") && text.contains("STORING"));
    assert!(text.contains("storage below: 1 keys held (0 at start)"), "{text}");

    // Detached: its pins and pending stores released, the slot emptied.
    leave.send(()).unwrap();
    client.join().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        server.turn();
        let listed = kvctl(&["tier", name.as_str(), "--json"]);
        let report: serde_json::Value = serde_json::from_str(&listed.assert_ok().stdout).unwrap();
        if report["clients"].as_array().unwrap().is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "the detached client is still listed: {report}");
    }

    drop(server);
    kvctl(&["tier", name.as_str()]).assert_fails_saying(&[name.as_str(), "kvctl cleanup"]);
    let _ = std::fs::remove_dir_all(disk);
}

/// The engine-segment commands on a shared tier name it for what it is and point at `kvctl
/// tier`: a tier's control object read as an engine's header looks half-written, and kvctl used
/// to say "still being created; retry", which never helps.
#[test]
fn engine_commands_on_a_shared_tier_point_at_kvctl_tier() {
    let name = unique_name("tier-stat");
    let _cleanup = Cleanup(name.clone());
    let index = SharedTierIndex::new(identity(), OffloadConfig::new(8)).unwrap();
    let _server = TierServer::create(&name, index, &TierConfig::with_clients(4)).unwrap();
    for command in ["stat", "workers", "tree", "reset"] {
        kvctl(&[command, name.as_str()])
            .assert_fails_saying(&["is a shared tier", &format!("kvctl tier {}", name.as_str())]);
    }
}
