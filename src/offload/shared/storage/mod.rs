//! [`TierStorage`]: the storage tier below a shared tier (DESIGN §12.8), run by the tier's owner.
//! Every block a client stores in the tier is written to a storage back-end as well (local disk
//! or Redis, `crate::storage`), and a block the arenas lost to eviction comes back from there
//! when a client asks for it.
//!
//! The owner's thread decides and asks the index as any client does, as a client of its own
//! (named `storage`); a thread of its own does the I/O (`io.rs`), so the owner never waits on a
//! disk or a server while clients wait on it:
//! 1. write-through ([`TierStorage::stored`]): once a client's store completes, the new keys
//!    queue for writing; as many as may be written at once are pinned for the storage client (as
//!    a load: no store may take their chunks while they are read) and handed to the I/O thread,
//!    which puts each rank's part of each chunk;
//! 2. promotion ([`TierStorage::promote`]): an `AcquirePrefix` whose prefix stops at a key the
//!    storage holds takes chunks for it and the held keys after it (a store of the storage
//!    client: pending, so no lookup answers a hit and no client reads them) and hands them to the
//!    I/O thread, which gets each rank's part into its chunk; the answer tells the client how
//!    many keys are coming, and the client asks again later (vLLM's `RETRY`). The I/O thread
//!    serves reads before writes, and writes go in small jobs, so a read waits for one at most.
//!    A key counts as coming for [`PROMOTION_PATIENCE`] at most: a storage that hangs costs an
//!    engine that long, then the key is a miss while the read runs on;
//! 3. [`TierStorage::poll`], at each turn of the owner's loop: finished puts let go of their
//!    pins and count as held, and the next waiting keys go; finished gets make their keys
//!    loadable, or drop those a rank missed.
//!
//! What the storage holds is known from the back-end's listing when the owner starts and from
//! the puts it made since; a key the back-end dropped on its own since (its LRU when full, a
//! Redis expiry) costs one promotion that misses, and is then forgotten. A stored block is named
//! by the XXH3-128 of its key seeded with the tier identity's digest, in a namespace of that
//! digest: tiers of other blocks never read each other's.

mod io;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvshm_ipc::arena::{Arena, ArenaError, ArenaKind};
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::tier_control::STORAGE_FIGURES;
use serde::Serialize;

use self::io::{Batch, Done, IoThread, Job};
use super::{ClientId, SharedTierError, SharedTierIndex};
use crate::hash::BlockHash;
use crate::offload::key::{BuildPassThrough, OffloadKey};
use crate::offload::manager::{LookupResult, PreparedStore};
use crate::storage::backend::BlockLayout;
use crate::storage::spec::{
    OpenError, StorageNamespace, StorageOptions, StorageSpec, DEFAULT_CAPACITY_PER_HOST_BLOCK,
};

/// The most keys one promotion brings back (the rest of a longer prefix comes with the next
/// ask).
const MAX_PROMOTED: usize = 256;

/// The most keys one write job carries: a read waits for one write job at most.
const PUT_JOB_KEYS: usize = 16;

/// How long a key being brought back counts as coming: past it (a storage that hangs), lookups
/// of it are misses, and the engine computes the block, while the read runs on.
const PROMOTION_PATIENCE: Duration = Duration::from_secs(1);

/// The storage client's request name in the index (its calls end the request at once).
const REQUEST: &str = "storage";

/// Why the storage tier below a shared tier could not open. The tier is not served.
#[derive(Debug, thiserror::Error)]
pub enum TierStorageError {
    #[error("the tier's arena of rank {rank}: {source}")]
    Arena { rank: u32, source: ArenaError },
    #[error("a chunk of {bytes} bytes per rank cannot be stored")]
    Layout { bytes: u64 },
    #[error("the storage of rank {rank}: {source}")]
    Open { rank: u32, source: OpenError },
    #[error("starting the storage thread: {0}")]
    Thread(std::io::Error),
    #[error(transparent)]
    Tier(#[from] SharedTierError),
}

/// What the storage tier has done and has in flight, for the owner's log and `kvctl tier` (the
/// owner publishes it in the tier's control object as words: `StorageStats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TierStorageStats {
    /// Keys every rank's storage held when the owner started, and known to be held now.
    pub held_at_start: u64,
    pub held: u64,
    /// Keys being written, waiting to be written, being brought back.
    pub writing: u64,
    pub waiting: u64,
    pub promoting: u64,
    /// Keys written through, and those a rank failed to write.
    pub puts: u64,
    pub puts_failed: u64,
    /// Keys dropped unwritten from a queue of writes longer than the tier (the storage is
    /// behind).
    pub puts_skipped: u64,
    /// Keys brought back into the arenas, and those a rank no longer had.
    pub promoted: u64,
    pub promotions_missed: u64,
    /// Promotions that found no chunk to evict.
    pub promotions_refused: u64,
}

impl TierStorageStats {
    /// The words the owner publishes, in the fields' order (the rest zero).
    pub fn to_words(&self) -> [u64; STORAGE_FIGURES] {
        let figures = [
            self.held_at_start,
            self.held,
            self.writing,
            self.waiting,
            self.promoting,
            self.puts,
            self.puts_failed,
            self.puts_skipped,
            self.promoted,
            self.promotions_missed,
            self.promotions_refused,
        ];
        let mut words = [0; STORAGE_FIGURES];
        words[..figures.len()].copy_from_slice(&figures);
        words
    }

    /// The figures [`TierStorageStats::to_words`] published.
    pub fn from_words(words: &[u64; STORAGE_FIGURES]) -> TierStorageStats {
        // A struct expression evaluates its fields in the order written: `to_words`' order.
        let mut words = words.iter().copied();
        let mut next = || words.next().unwrap_or_default();
        TierStorageStats {
            held_at_start: next(),
            held: next(),
            writing: next(),
            waiting: next(),
            promoting: next(),
            puts: next(),
            puts_failed: next(),
            puts_skipped: next(),
            promoted: next(),
            promotions_missed: next(),
            promotions_refused: next(),
        }
    }
}

/// The storage tier below one shared tier, as its owner runs it (module flow).
pub struct TierStorage {
    client: ClientId,
    seed: u64,
    jobs: Option<mpsc::Sender<Job>>,
    done: mpsc::Receiver<Done>,
    thread: Option<JoinHandle<()>>,
    /// What the storage holds (stored names).
    held: HashSet<BlockHash>,
    /// Keys being brought back (since when), and keys being written (pinned).
    promoting: HashMap<OffloadKey, Instant, BuildPassThrough>,
    writing: HashSet<OffloadKey, BuildPassThrough>,
    max_writing: usize,
    /// Keys waiting to be written, oldest first (and as a set).
    to_write: VecDeque<OffloadKey>,
    waiting: HashSet<OffloadKey, BuildPassThrough>,
    max_waiting: usize,
    stats: TierStorageStats,
    prepared: PreparedStore,
    chunks: Vec<u32>,
}

impl std::fmt::Debug for TierStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierStorage").field("stats", &self.stats).finish()
    }
}

impl TierStorage {
    /// Opens the storage `options` name below tier `name` (its `ranks` arenas, `chunks` chunks of
    /// `index`'s identity): one back-end per rank, holding at most `options.capacity_blocks`
    /// chunks each (by default 4 times the tier's), what they hold listed, the storage client
    /// attached to `index`, and the I/O thread started.
    ///
    /// # Errors
    /// [`TierStorageError`] when an arena, a back-end or the listing cannot be opened: the
    /// owner should not serve a tier whose storage was asked for and is not there.
    pub fn open(
        name: &SegmentName,
        ranks: u32,
        chunks: u32,
        options: &StorageOptions,
        index: &mut SharedTierIndex,
    ) -> Result<TierStorage, TierStorageError> {
        let identity = index.identity().clone();
        let blocks_per_chunk = u64::from(identity.blocks_per_chunk.max(1));
        let mut arenas = Vec::with_capacity(ranks as usize);
        for rank in 0..ranks {
            let arena = Arena::open(name, ArenaKind::Host, rank)
                .map_err(|source| TierStorageError::Arena { rank, source })?;
            arenas.push(arena);
        }
        let block_bytes = arenas.first().map_or(0, Arena::block_bytes);
        let chunk_bytes = block_bytes.saturating_mul(blocks_per_chunk);
        let layout = BlockLayout::new(chunk_bytes, 1, ranks)
            .ok_or(TierStorageError::Layout { bytes: chunk_bytes })?;
        let mut options = options.clone();
        options.namespace = StorageNamespace::new(&identity.storage_namespace())
            .expect("a hex digest is a valid namespace");
        options.capacity_blocks = Some(
            options
                .capacity_blocks
                .unwrap_or(u64::from(chunks) * DEFAULT_CAPACITY_PER_HOST_BLOCK)
                .max(1),
        );
        let mut backends = Vec::with_capacity(ranks as usize);
        for rank in 0..ranks {
            let backend = options
                .open(rank, layout, chunks)
                .map_err(|source| TierStorageError::Open { rank, source })?;
            backends.push(backend);
        }
        let held: HashSet<BlockHash> = match list(&options, &layout) {
            Ok(held) => held.into_iter().collect(),
            Err(error) => {
                // A cache that cannot say what it holds still takes writes: start knowing nothing.
                tracing::warn!(%error, "what the storage holds could not be listed");
                HashSet::new()
            }
        };
        let client = index.attach(&identity, REQUEST, None)?;
        let (jobs, to_thread) = mpsc::channel();
        let (from_thread, done) = mpsc::channel();
        let io = IoThread { arenas, backends, chunk_bytes: chunk_bytes as usize };
        let thread = std::thread::Builder::new()
            .name("tier-storage".into())
            .spawn(move || io.run(&to_thread, &from_thread))
            .map_err(TierStorageError::Thread)?;
        let stats = TierStorageStats {
            held_at_start: held.len() as u64,
            held: held.len() as u64,
            ..TierStorageStats::default()
        };
        Ok(TierStorage {
            client,
            seed: identity.digest(),
            jobs: Some(jobs),
            done,
            thread: Some(thread),
            held,
            promoting: HashMap::default(),
            writing: HashSet::default(),
            max_writing: (chunks as usize / 4).max(1),
            to_write: VecDeque::new(),
            waiting: HashSet::default(),
            max_waiting: (chunks as usize).max(1),
            stats,
            prepared: PreparedStore::default(),
            chunks: Vec::new(),
        })
    }

    pub fn stats(&self) -> TierStorageStats {
        TierStorageStats {
            held: self.held.len() as u64,
            writing: self.writing.len() as u64,
            waiting: self.to_write.len() as u64,
            promoting: self.promoting.len() as u64,
            ..self.stats
        }
    }

    /// Whether a job is in flight (the owner's loop then turns sooner, to finish it).
    pub fn busy(&self) -> bool {
        !self.promoting.is_empty() || !self.writing.is_empty() || !self.to_write.is_empty()
    }

    /// The name `key` is stored under.
    fn stored_name(&self, key: &OffloadKey) -> BlockHash {
        BlockHash(xxhash_rust::xxh3::xxh3_128_with_seed(key.as_bytes(), self.seed))
    }

    /// Module flow, step 1: writes through the keys of `keys` a client's store just made
    /// loadable. They wait in a queue while the writes in flight pin as many chunks as they may
    /// (a quarter of the tier's), so that writes never pin the tier full; a key the queue holds
    /// past the tier's size is dropped unwritten, the oldest first.
    pub fn stored(&mut self, index: &mut SharedTierIndex, keys: &[OffloadKey]) {
        for key in keys {
            if self.waiting.insert(*key) {
                self.to_write.push_back(*key);
            }
        }
        while self.to_write.len() > self.max_waiting {
            let dropped = self.to_write.pop_front().expect("longer than the limit");
            self.waiting.remove(&dropped);
            self.stats.puts_skipped += 1;
        }
        self.write_waiting(index);
    }

    /// Hands the I/O thread as many waiting keys as may be written now: those still loadable and
    /// not on storage, pinned for the storage client.
    fn write_waiting(&mut self, index: &mut SharedTierIndex) {
        let room = self.max_writing.saturating_sub(self.writing.len());
        let mut batch: Vec<OffloadKey> = Vec::new();
        while batch.len() < room {
            let Some(key) = self.to_write.pop_front() else { break };
            self.waiting.remove(&key);
            if index.peek(&key) == LookupResult::Hit
                && !self.writing.contains(&key)
                && !self.held.contains(&self.stored_name(&key))
            {
                batch.push(key);
            }
        }
        if batch.is_empty() {
            return;
        }
        let pinned = match index.acquire_prefix(self.client, REQUEST, &batch, &mut self.chunks) {
            Ok(pinned) => pinned,
            Err(error) => {
                tracing::warn!(%error, "the storage client could not pin keys to write");
                return;
            }
        };
        let _ = index.finish_request(self.client, REQUEST);
        let pinned: Batch = batch[..pinned]
            .iter()
            .zip(&self.chunks)
            .map(|(key, &chunk)| (*key, self.stored_name(key), chunk))
            .collect();
        self.writing.extend(pinned.iter().map(|&(key, _, _)| key));
        // In small jobs: a read to bring a block back waits for one at most (`IoThread::run`).
        for job in pinned.chunks(PUT_JOB_KEYS) {
            self.send(index, Job::Put(job.to_vec()));
        }
    }

    /// Module flow, step 2: after an `AcquirePrefix` of `keys` pinned its first `hits`, brings
    /// back the keys after them that the storage holds (those already coming included); returns
    /// how many of the keys after the hits are coming. `stores_allowed` is false during the
    /// owner's takeover grace: no chunk may be written then.
    pub fn promote(
        &mut self,
        index: &mut SharedTierIndex,
        keys: &[OffloadKey],
        hits: usize,
        stores_allowed: bool,
    ) -> u32 {
        let mut coming = 0;
        let mut first_new = None;
        for key in &keys[hits.min(keys.len())..] {
            let state = index.peek(key);
            let new = state == LookupResult::Miss
                && stores_allowed
                && coming < MAX_PROMOTED
                && self.held.contains(&self.stored_name(key));
            let coming_back =
                self.promoting.get(key).is_some_and(|since| since.elapsed() < PROMOTION_PATIENCE);
            let known = coming_back || (state == LookupResult::Hit && coming > 0);
            if !new && !known {
                break;
            }
            if new && first_new.is_none() {
                first_new = Some(coming);
            }
            coming += 1;
        }
        let Some(coming_before) = first_new else { return coming as u32 };
        let end = hits + coming;
        let stored = index.prepare_store(self.client, REQUEST, &keys[..end], &mut self.prepared);
        let _ = index.finish_request(self.client, REQUEST);
        match stored {
            Ok(true) => {}
            Ok(false) => {
                self.stats.promotions_refused += 1;
                return coming_before as u32;
            }
            Err(error) => {
                tracing::warn!(%error, "the storage client could not take chunks to promote into");
                return coming_before as u32;
            }
        }
        let job: Batch = self
            .prepared
            .to_store
            .iter()
            .zip(&self.prepared.chunks)
            .map(|(&at, &chunk)| {
                let key = keys[at as usize];
                (key, self.stored_name(&key), chunk)
            })
            .collect();
        let now = Instant::now();
        self.promoting.extend(job.iter().map(|&(key, _, _)| (key, now)));
        self.send(index, Job::Get(job));
        coming as u32
    }

    /// Hands `job` to the I/O thread; a thread that is gone (it cannot be, short of a panic
    /// there) has the job undone as failed.
    fn send(&mut self, index: &mut SharedTierIndex, job: Job) {
        let Some(jobs) = &self.jobs else { return };
        if let Err(mpsc::SendError(job)) = jobs.send(job) {
            tracing::warn!("the storage thread is gone: the tier goes on without its storage");
            self.jobs = None;
            let (put, batch) = match job {
                Job::Put(batch) => (true, batch),
                Job::Get(batch) => (false, batch),
            };
            let keys = batch.into_iter().map(|(key, _, _)| (key, false)).collect();
            self.finish(index, Done { put, keys });
        }
    }

    /// Module flow, step 3: finishes the jobs the I/O thread has done.
    pub fn poll(&mut self, index: &mut SharedTierIndex) {
        while let Ok(done) = self.done.try_recv() {
            self.finish(index, done);
        }
        self.write_waiting(index);
    }

    /// Finishes what is in flight and writes what waits, for at most `limit`: an owner that
    /// stops leaves on storage every block it was given to keep, as far as the time allows.
    pub fn drain(&mut self, index: &mut SharedTierIndex, limit: Duration) {
        let deadline = Instant::now() + limit;
        self.write_waiting(index);
        while self.busy() {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.done.recv_timeout(left) {
                Ok(done) => self.finish(index, done),
                Err(_) => break,
            }
            self.write_waiting(index);
        }
    }

    fn finish(&mut self, index: &mut SharedTierIndex, done: Done) {
        let (made, missed): (Vec<_>, Vec<_>) = done.keys.iter().partition(|(_, made)| *made);
        let made: Vec<OffloadKey> = made.into_iter().map(|&(key, _)| key).collect();
        let missed: Vec<OffloadKey> = missed.into_iter().map(|&(key, _)| key).collect();
        if done.put {
            let all: Vec<OffloadKey> = done.keys.iter().map(|&(key, _)| key).collect();
            if let Err(error) = index.release_loads(self.client, &all) {
                tracing::warn!(%error, "the storage client's pins of a write could not go");
            }
            for key in &all {
                self.writing.remove(key);
            }
            for key in &made {
                self.held.insert(self.stored_name(key));
            }
            self.stats.puts += made.len() as u64;
            self.stats.puts_failed += missed.len() as u64;
        } else {
            let _ = index.complete_store(self.client, &made, true);
            let _ = index.complete_store(self.client, &missed, false);
            for key in done.keys.iter().map(|(key, _)| key) {
                self.promoting.remove(key);
            }
            for key in &missed {
                self.held.remove(&self.stored_name(key));
            }
            self.stats.promoted += made.len() as u64;
            self.stats.promotions_missed += missed.len() as u64;
        }
    }
}

impl Drop for TierStorage {
    fn drop(&mut self) {
        // The thread finishes the jobs it has (they are short) and ends when the channel closes.
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The stored names every rank holds under `options` (disk: the slabs' indexes; Redis: a scan).
fn list(options: &StorageOptions, layout: &BlockLayout) -> Result<Vec<BlockHash>, String> {
    let namespace = options.namespace.as_str();
    let blocks = match &options.spec {
        StorageSpec::Disk { dir } => {
            crate::storage::disk_index::blocks_on_every_rank(&dir.join(namespace), layout)
                .map_err(|error| error.to_string())?
        }
        StorageSpec::Redis { url } => crate::storage::redis_listing::blocks_on_every_rank(
            url,
            namespace,
            layout,
            options.connect_timeout.max(options.io_timeout),
        )
        .map_err(|error| error.to_string())?,
    };
    Ok(blocks.into_iter().map(|block| block.hash).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The figures come back from the words the owner publishes, each in its own field.
    #[test]
    fn the_published_words_give_back_every_figure() {
        let stats = TierStorageStats {
            held_at_start: 1,
            held: 2,
            writing: 3,
            waiting: 4,
            promoting: 5,
            puts: 6,
            puts_failed: 7,
            puts_skipped: 8,
            promoted: 9,
            promotions_missed: 10,
            promotions_refused: 11,
        };
        assert_eq!(TierStorageStats::from_words(&stats.to_words()), stats);
    }
}
