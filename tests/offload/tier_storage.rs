//! The storage tier below a shared tier (`TierStorage`), in process over a disk slab (and a
//! Redis that hangs), the index checked after every step: what the owner believes the storage
//! holds stays within its capacity and in the disk's order, so a key the disk made room for is
//! neither brought back for nothing nor kept from being written again; a client at its quota
//! brings blocks back only in place of its own, and a promotion outlives the client it was for;
//! a hung storage costs no more evictions.

use std::time::{Duration, Instant};

use kvshm::offload::manager::{LookupResult, PreparedStore};
use kvshm::offload::shared::{ClientId, TierArenas, TierStorage};
use kvshm::offload::{OffloadConfig, OffloadKey, SharedTierIndex, TierIdentity};
use kvshm::storage::spec::{StorageOptions, StorageSpec};
use kvshm_ipc::name::SegmentName;

use crate::support::{unique_name, RedisServer, Scratch};

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

/// Writing a block through to storage is no use of it: a block whose write waited its turn
/// keeps its place in the eviction order (behind a block a client read meanwhile), and the
/// storage client's pins for the write count as no lookup or load of the tier.
#[test]
fn a_write_through_leaves_the_eviction_order_and_the_lookups_alone() {
    let mut rig = Rig::new(None);
    let writer = rig.index.attach(&identity(), "writer", None).unwrap();
    let reader = rig.index.attach(&identity(), "reader", None).unwrap();
    rig.store(writer, "x", &[10]);
    rig.settle();
    // Two writes at a time in a tier of 8 chunks: 3, the chain's leaf, waits for its turn.
    rig.store(writer, "s", &[1, 2, 3]);
    assert_eq!(rig.acquire(reader, "r", &[10]), (1, 0));
    let before = rig.index.stats();
    rig.settle();
    assert_eq!(rig.storage().stats().puts, 4);
    let after = rig.index.stats();
    assert_eq!(
        (after.lookups, after.lookup_hits, after.keys_loaded),
        (before.lookups, before.lookup_hits, before.keys_loaded),
        "the writes counted as lookups or loads"
    );
    // Five new keys in four free chunks evict one leaf: 3, stored before 10 was read.
    rig.store(writer, "n", &[30, 31, 32, 33, 34]);
    assert_eq!(rig.loadable([10]), 1, "the write of 3 made it newer than 10");
    assert_eq!(rig.loadable([3]), 0);
}

/// Empties the arena without writing anything to storage: a client's store of 8 new keys
/// evicts every key of the tier, then fails.
fn empty_the_arena(rig: &mut Rig) {
    let flusher = rig.index.attach(&identity(), "flusher", None).unwrap();
    let keys: Vec<OffloadKey> = (200..208).map(key).collect();
    let mut out = PreparedStore::default();
    assert!(rig.index.prepare_store(flusher, "f", &keys, &mut out).unwrap());
    rig.index.complete_store(flusher, &keys, false).unwrap();
    rig.index.finish_request(flusher, "f").unwrap();
    rig.index.release_client(flusher).unwrap();
    rig.index.check_invariants().unwrap();
}

/// The owner's guide keeps the disk's order: of a write of 1,2 the disk makes 1 its newest, so a
/// 2-chunk disk then written 3 drops 2; the owner brings 1 back and answers 2 as a miss, no
/// promotion missing.
#[test]
fn the_guide_orders_a_write_as_the_disk_does() {
    let mut rig = Rig::new(Some(2));
    let writer = rig.index.attach(&identity(), "writer", None).unwrap();
    let reader = rig.index.attach(&identity(), "reader", None).unwrap();
    rig.store(writer, "a", &[1, 2]);
    rig.settle();
    rig.store(writer, "b", &[3]);
    rig.settle();
    empty_the_arena(&mut rig);
    assert_eq!(rig.acquire(reader, "r1", &[1]), (0, 1));
    rig.settle();
    assert_eq!(rig.acquire(reader, "r2", &[2]), (0, 0));
    assert_eq!(rig.storage().stats().promotions_missed, 0);
}

/// A block read back is the disk's newest, and the owner's: of 1 (read back since) and 2, a
/// write of 3 drops 2.
#[test]
fn the_guide_counts_a_read_as_a_use() {
    let mut rig = Rig::new(Some(2));
    let writer = rig.index.attach(&identity(), "writer", None).unwrap();
    let reader = rig.index.attach(&identity(), "reader", None).unwrap();
    rig.store(writer, "a", &[1]);
    rig.settle();
    rig.store(writer, "b", &[2]);
    rig.settle();
    empty_the_arena(&mut rig);
    assert_eq!(rig.acquire(reader, "r0", &[1]), (0, 1));
    rig.settle();
    rig.store(writer, "c", &[3]);
    rig.settle();
    empty_the_arena(&mut rig);
    assert_eq!(rig.acquire(reader, "r2", &[2]), (0, 0), "dropped by the disk");
    assert_eq!(rig.acquire(reader, "r1", &[1]), (0, 1));
    rig.settle();
    assert_eq!(rig.storage().stats().promotions_missed, 0);
}

/// A new owner lists what the disk holds oldest written first, whichever order the hashes
/// sort in: the one the disk drops next is the one it forgets.
#[test]
fn a_new_owner_lists_the_disk_oldest_written_first() {
    for (first, second) in [(1u8, 2u8), (2, 1)] {
        let mut rig = Rig::new(Some(2));
        let writer = rig.index.attach(&identity(), "writer", None).unwrap();
        let reader = rig.index.attach(&identity(), "reader", None).unwrap();
        rig.store(writer, "a", &[first]);
        rig.settle();
        rig.store(writer, "b", &[second]);
        rig.settle();
        drop(rig.storage.take());
        let mut options = StorageOptions::new(StorageSpec::Disk { dir: rig._scratch.0.clone() });
        options.capacity_blocks = Some(2);
        let storage = TierStorage::open(&rig.name, 1, CHUNKS, &options, &mut rig.index).unwrap();
        rig.storage = Some(storage);
        assert_eq!(rig.storage().stats().held_at_start, 2);
        rig.store(writer, "c", &[3]);
        rig.settle();
        empty_the_arena(&mut rig);
        assert_eq!(rig.acquire(reader, "r1", &[first]), (0, 0), "{first} then {second}");
        assert_eq!(rig.acquire(reader, "r2", &[second]), (0, 1), "{first} then {second}");
        rig.settle();
    }
}

/// A client whose quota is below the run of keys on storage gets as many back as its quota
/// allows, not none.
#[test]
fn a_client_with_a_small_quota_gets_what_its_quota_allows() {
    let mut rig = Rig::new(None);
    let capped = rig.index.attach(&identity(), "capped", Some(2)).unwrap();
    rig.store(capped, "a", &[1, 2]);
    rig.settle();
    rig.store(capped, "b", &[3, 4]);
    rig.settle();
    rig.store(capped, "c", &[5, 6]);
    rig.settle();
    assert_eq!(rig.acquire(capped, "r", &[1, 2, 3, 4]), (0, 2));
    rig.settle();
    assert_eq!(rig.loadable([1, 2]), 2);
}

/// The client a promotion is charged to leaves, and a new client takes its slot: the chunks are
/// charged to no one, the new client to nothing; the storer released mid-promotion gives back
/// the charge it made for another.
#[test]
fn a_promotion_outlives_the_client_it_was_for() {
    let mut rig = Rig::new(None);
    let writer = rig.index.attach(&identity(), "writer", None).unwrap();
    rig.store(writer, "a", &[1, 2]);
    rig.settle();
    empty_the_arena(&mut rig);
    let asker = rig.index.attach(&identity(), "asker", Some(4)).unwrap();
    assert_eq!(rig.acquire(asker, "r", &[1, 2]), (0, 2));
    rig.index.release_client(asker).unwrap();
    rig.index.check_invariants().unwrap();
    let next = rig.index.attach(&identity(), "next", Some(4)).unwrap();
    assert_eq!(next.slot, asker.slot);
    rig.settle();
    assert_eq!(rig.loadable([1, 2]), 2);
    assert_eq!(rig.index.client_summary(next).unwrap().chunks, 0);
    assert_eq!(rig.index.owner_of(&key(1)), None);

    let mut index = SharedTierIndex::new(identity(), OffloadConfig::new(CHUNKS)).unwrap();
    let storer = index.attach(&identity(), "storage", None).unwrap();
    let asker = index.attach(&identity(), "asker", None).unwrap();
    let mut out = PreparedStore::default();
    assert!(index.prepare_store_for(storer, asker, "s", &[key(1)], &mut out).unwrap());
    index.check_invariants().unwrap();
    index.release_client(storer).unwrap();
    index.check_invariants().unwrap();
    assert_eq!(index.client_summary(asker).unwrap().chunks, 0);
}

/// A Redis that hangs: once a read has been out past the promotion patience, the storage counts
/// as away and nothing more is brought back (no live block evicted for a read that would fail),
/// before the first read has even timed out.
#[test]
fn a_hung_storage_costs_no_more_evictions() {
    let mut redis = RedisServer::start();
    let scratch = Scratch::new("tier-storage-rig");
    let name = unique_name("tier-storage");
    drop(TierArenas::create_or_adopt(&name, 1, u64::from(CHUNKS), BLOCK_BYTES).unwrap());
    let mut index = SharedTierIndex::new(identity(), OffloadConfig::new(CHUNKS)).unwrap();
    let options = StorageOptions::new(StorageSpec::Redis { url: redis.url() });
    let storage = TierStorage::open(&name, 1, CHUNKS, &options, &mut index).unwrap();
    let mut rig = Rig { _scratch: scratch, name, index, storage: Some(storage) };
    let writer = rig.index.attach(&identity(), "writer", None).unwrap();
    let reader = rig.index.attach(&identity(), "reader", None).unwrap();
    rig.store(writer, "a", &[1, 2, 3, 4]);
    rig.settle();
    rig.store(writer, "b", &[11, 12, 13, 14, 15, 16, 17, 18]);
    rig.settle();
    redis.pause();
    assert_eq!(rig.acquire(reader, "r1", &[1]), (0, 1));
    std::thread::sleep(Duration::from_millis(1300));
    rig.storage.as_mut().unwrap().poll(&mut rig.index);
    let second = rig.acquire(reader, "r2", &[2]);
    let live = rig.loadable(11..=18);
    redis.resume();
    rig.settle();
    assert_eq!((second, live), ((0, 0), 7), "{:?}", rig.storage().stats());
}
