//! The storage tier below a shared tier (`TierStorage`), in process over a disk slab, the index
//! checked after every step: what the owner believes the storage holds stays within its
//! capacity, and a key the disk made room for is neither brought back for nothing nor kept from
//! being written again; a client at its quota brings blocks back only in place of its own.

use std::time::{Duration, Instant};

use kvshm::offload::manager::{LookupResult, PreparedStore};
use kvshm::offload::shared::{ClientId, TierArenas, TierStorage};
use kvshm::offload::{OffloadConfig, OffloadKey, SharedTierIndex, TierIdentity};
use kvshm::storage::spec::{StorageOptions, StorageSpec};
use kvshm_ipc::name::SegmentName;

use crate::support::{unique_name, Scratch};

const CHUNKS: u32 = 8;
const BLOCK_BYTES: u64 = 4096;

fn identity() -> TierIdentity {
    TierIdentity {
        model: "m".into(),
        kv_dtype: "float16".into(),
        block_tokens: 16,
        block_bytes: BLOCK_BYTES,
        blocks_per_chunk: 1,
        layout: String::new(),
    }
}

fn key(n: u8) -> OffloadKey {
    OffloadKey::new(&[n; 16]).unwrap()
}

/// A tier of 8 chunks in process: its arena, its index, and a disk storage tier of
/// `storage_chunks` below.
struct Rig {
    _scratch: Scratch,
    name: SegmentName,
    index: SharedTierIndex,
    storage: Option<TierStorage>,
}

impl Rig {
    fn new(storage_chunks: Option<u64>) -> Rig {
        let scratch = Scratch::new("tier-storage-rig");
        let name = unique_name("tier-storage");
        drop(TierArenas::create_or_adopt(&name, 1, u64::from(CHUNKS), BLOCK_BYTES).unwrap());
        let mut index = SharedTierIndex::new(identity(), OffloadConfig::new(CHUNKS)).unwrap();
        let mut options = StorageOptions::new(StorageSpec::Disk { dir: scratch.0.clone() });
        options.capacity_blocks = storage_chunks;
        let storage = TierStorage::open(&name, 1, CHUNKS, &options, &mut index).unwrap();
        Rig { _scratch: scratch, name, index, storage: Some(storage) }
    }

    fn storage(&mut self) -> &mut TierStorage {
        self.storage.as_mut().unwrap()
    }

    /// `client`'s whole store of `keys` (the owner writes them through), in one request.
    fn store(&mut self, client: ClientId, request: &str, keys: &[u8]) {
        let keys: Vec<OffloadKey> = keys.iter().map(|&n| key(n)).collect();
        let mut out = PreparedStore::default();
        assert!(self.index.prepare_store(client, request, &keys, &mut out).unwrap(), "refused");
        let stored: Vec<OffloadKey> = out.to_store.iter().map(|&at| keys[at as usize]).collect();
        self.index.complete_store(client, &stored, true).unwrap();
        self.storage.as_mut().unwrap().stored(&mut self.index, &stored);
        self.index.finish_request(client, request).unwrap();
        self.index.check_invariants().unwrap();
    }

    /// `client`'s `AcquirePrefix` of `keys` as the owner serves it: how many it pinned, and how
    /// many are coming from storage. The pins go at once.
    fn acquire(&mut self, client: ClientId, request: &str, keys: &[u8]) -> (usize, u32) {
        let keys: Vec<OffloadKey> = keys.iter().map(|&n| key(n)).collect();
        let mut chunks = Vec::new();
        let hits = self.index.acquire_prefix(client, request, &keys, &mut chunks).unwrap();
        let coming =
            self.storage.as_mut().unwrap().promote(&mut self.index, client, &keys, hits, true);
        self.index.release_loads(client, &keys[..hits]).unwrap();
        self.index.finish_request(client, request).unwrap();
        self.index.check_invariants().unwrap();
        (hits, coming)
    }

    /// Turns the owner's loop until no storage work is in flight.
    fn settle(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let storage = self.storage.as_mut().unwrap();
            storage.poll(&mut self.index);
            self.index.check_invariants().unwrap();
            if !storage.busy() {
                return;
            }
            assert!(Instant::now() < deadline, "the storage's work never finished");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn loadable(&self, keys: impl IntoIterator<Item = u8>) -> usize {
        keys.into_iter().filter(|&n| self.index.peek(&key(n)) == LookupResult::Hit).count()
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        drop(self.storage.take());
        TierArenas::unlink(&self.name, 1);
    }
}

/// A disk of 4 chunks below a tier of 8, 16 keys written through it: the owner believes it
/// holds the last 4 written (what the slab kept), not all 16. A key the disk made room for is a
/// miss (no block of the arena goes for a read that would miss), and stored again it is
/// written again.
#[test]
fn the_owner_forgets_what_a_full_storage_made_room_for() {
    let mut rig = Rig::new(Some(4));
    let writer = rig.index.attach(&identity(), "writer", None).unwrap();
    let reader = rig.index.attach(&identity(), "reader", None).unwrap();
    rig.store(writer, "a", &[1, 2, 3, 4, 5, 6, 7, 8]);
    rig.settle();
    rig.store(writer, "b", &[9, 10, 11, 12, 13, 14, 15, 16]);
    rig.settle();
    let stats = rig.storage().stats();
    assert_eq!((stats.puts, stats.held), (16, 4), "{stats:?}");

    assert_eq!(rig.acquire(reader, "r", &[2]), (0, 0), "dropped by the disk: a miss");
    assert_eq!(rig.loadable(9..=16), 8, "no block of the arena went for it");
    rig.store(writer, "c", &[3]);
    rig.settle();
    assert_eq!(rig.storage().stats().puts, 17, "stored again, written again");

    // Storing 3 took the chunk of 16, the leaf of 9..16; the disk kept 16 (among the last
    // written): it comes back.
    assert_eq!(rig.loadable([16]), 0);
    assert_eq!(rig.acquire(reader, "t", &[16]), (0, 1));
    rig.settle();
    assert_eq!(rig.loadable([16]), 1, "brought back from disk");
}

/// A client at its quota (DESIGN §12.5) has blocks brought back only in place of its own, and
/// they are charged to it: another client's blocks stay.
#[test]
fn a_client_at_its_quota_has_blocks_brought_back_in_place_of_its_own() {
    let mut rig = Rig::new(None);
    let other = rig.index.attach(&identity(), "other", None).unwrap();
    let capped = rig.index.attach(&identity(), "capped", Some(2)).unwrap();
    rig.store(other, "o", &[1, 2, 3, 4, 5, 6]);
    rig.store(capped, "a", &[101, 102]);
    rig.settle();
    rig.store(capped, "b", &[103, 104]);
    rig.settle();
    assert_eq!(rig.loadable([101, 102]), 0, "at its quota: 103, 104 took its own chunks");

    assert_eq!(rig.acquire(capped, "c", &[101, 102]), (0, 2));
    rig.settle();
    assert_eq!(rig.loadable(1..=6), 6, "the other client's blocks stay");
    assert_eq!(rig.loadable([101, 102]), 2, "brought back in place of 103, 104");
    assert_eq!(rig.loadable([103, 104]), 0);
    let summary = rig.index.client_summary(capped).unwrap();
    assert_eq!(summary.chunks, 2, "the blocks brought back are charged to the client that asked");
}
