//! `kvctl tier` against a live shared tier: its owner (a `TierServer` this test serves turns
//! of) and one client in a thread of its own, holding pins and pending stores: the listing shows
//! them as the owner published them, and the client is gone from it once it detached.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvshm::offload::{
    CallAnswer, ClientOptions, OffloadConfig, OffloadKey, SharedTierIndex, TierCall, TierClient,
    TierIdentity, TierServer,
};
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
        let complete = TierCall::CompleteStore { keys: &keys[..1], success: true };
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
    assert_eq!(row["calls"], 3, "prepare, complete and acquire");

    let text = kvctl(&["tier", name.as_str()]);
    let text = &text.assert_ok().stdout;
    assert!(text.contains("owner pid") && text.contains("PINS") && text.contains("STORING"));

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
}
