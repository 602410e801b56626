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
//!    a load: no store may take their chunks while they are read; but no use of the blocks:
//!    [`SharedTierIndex::pin_to_read`]) and handed to the I/O thread, which puts each rank's
//!    part of each chunk;
//! 2. promotion ([`TierStorage::promote`]): an `AcquirePrefix` whose prefix stops at a key the
//!    storage holds takes chunks for it and the held keys after it (a store of the storage
//!    client: pending, so no lookup answers a hit and no client reads them; charged to the client
//!    that asked, within its quota) and hands them to the I/O thread, which gets each rank's part
//!    into its chunk; the answer tells the client how many keys are coming, and the client asks
//!    again later (vLLM's `RETRY`). The I/O thread serves reads before writes, and writes go in
//!    small jobs, so a read waits for one at most. A storage that finishes no job for
//!    [`PROMOTION_PATIENCE`] hangs: the keys coming are then misses while the reads run on, and
//!    nothing more is brought back until it finishes one;
//! 3. [`TierStorage::poll`], at each turn of the owner's loop: finished puts let go of their
//!    pins and count as held, and the next waiting keys go; finished gets make their keys
//!    loadable, or drop them: a key absent from the back-end is forgotten, and after a read the
//!    back-end failed nothing is brought back for [`PROMOTION_BACKOFF`].
//!
//! What the storage holds is known from the back-end's listing when the owner starts and from
//! the puts it made since, up to the storage's capacity (`held.rs`). A stored block is named by
//! the XXH3-128 of its key seeded with the tier identity's digest, in a namespace of that digest:
//! tiers of other blocks never read each other's. A stopping owner drains what waits
//! ([`TierStorage::drain`]), then stops the thread between two jobs.

mod held;
mod io;
mod stats;

use kvshm_ipc::sync::{AtomicBool, Ordering};
use std::collections::{HashSet, VecDeque};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvshm_ipc::arena::{Arena, ArenaError, ArenaKind};
use kvshm_ipc::name::SegmentName;

use self::held::Held;
use self::io::{Batch, Done, IoThread, Job, Outcome};
pub use self::stats::TierStorageStats;
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

/// The most keys one job carries: a read waits for one write job at most, and a storage that
/// works shows it at least every this many keys.
const JOB_KEYS: usize = 16;

/// How long the storage may go without finishing a job while it has one: past it, it counts as
/// hung (a stopped Redis, a dead NFS server): the keys being brought back are misses, and the
/// engine computes the blocks while the reads run on, and nothing more is brought back until a
/// job finishes. A storage that is slow but works finishes a job within it.
const PROMOTION_PATIENCE: Duration = Duration::from_secs(1);

/// How long nothing is brought back after the back-end failed a read (a timeout, a server
/// away).
const PROMOTION_BACKOFF: Duration = Duration::from_secs(1);

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

/// The storage tier below one shared tier, as its owner runs it (module flow).
pub struct TierStorage {
    client: ClientId,
    seed: u64,
    jobs: Option<mpsc::Sender<Job>>,
    done: mpsc::Receiver<Done>,
    thread: Option<JoinHandle<()>>,
    /// Set when the owner stops: the thread drops the jobs it has not started.
    stop: Arc<AtomicBool>,
    /// What the storage holds, as far as the owner knows (`held.rs`).
    held: Held,
    /// Keys being brought back, and keys being written (pinned).
    promoting: HashSet<OffloadKey, BuildPassThrough>,
    writing: HashSet<OffloadKey, BuildPassThrough>,
    /// The most keys being written (a quarter of the tier), and being brought back (half), at
    /// once.
    max_writing: usize,
    max_promoting: usize,
    /// Jobs handed to the I/O thread and not finished, and when it last finished one (or was
    /// handed one with none in flight): how the owner tells a storage that hangs.
    jobs_in_flight: usize,
    last_progress: Instant,
    /// After a read the back-end failed, nothing more is brought back until then.
    promotions_paused_until: Option<Instant>,
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
        let capacity = options.capacity_blocks.unwrap_or(1) as usize;
        let held = Held::new(
            capacity,
            list(&options, &layout).unwrap_or_else(|error| {
                // A cache that cannot say what it holds still takes writes: start knowing nothing.
                tracing::warn!(%error, "what the storage holds could not be listed");
                Vec::new()
            }),
        );
        let client = index.attach(&identity, REQUEST, None)?;
        let (jobs, to_thread) = mpsc::channel();
        let (from_thread, done) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let io = IoThread {
            arenas,
            backends,
            chunk_bytes: chunk_bytes as usize,
            stop: Arc::clone(&stop),
        };
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
            stop,
            held,
            promoting: HashSet::default(),
            jobs_in_flight: 0,
            last_progress: Instant::now(),
            writing: HashSet::default(),
            max_writing: (chunks as usize / 4).max(1),
            max_promoting: (chunks as usize / 2).max(1),
            promotions_paused_until: None,
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

    /// Hands the I/O thread as many waiting keys as may be written now: those still loadable,
    /// pinned for the storage client.
    fn write_waiting(&mut self, index: &mut SharedTierIndex) {
        if self.jobs.is_none() {
            return;
        }
        let room = self.max_writing.saturating_sub(self.writing.len());
        let mut batch: Vec<OffloadKey> = Vec::new();
        while batch.len() < room {
            let Some(key) = self.to_write.pop_front() else { break };
            self.waiting.remove(&key);
            // A key the storage may hold already is written again: a put of a block stored is
            // cheap (its name is its content), and the owner's knowledge of it may be stale.
            if index.peek(&key) == LookupResult::Hit && !self.writing.contains(&key) {
                batch.push(key);
            }
        }
        if batch.is_empty() {
            return;
        }
        let pinned = match index.pin_to_read(self.client, &batch, &mut self.chunks) {
            Ok(pinned) => pinned,
            Err(error) => {
                tracing::warn!(%error, "the storage client could not pin keys to write");
                return;
            }
        };
        let pinned: Batch = batch[..pinned]
            .iter()
            .zip(&self.chunks)
            .map(|(key, &chunk)| (*key, self.stored_name(key), chunk))
            .collect();
        self.writing.extend(pinned.iter().map(|&(key, _, _)| key));
        // In small jobs: a read to bring a block back waits for one at most (`IoThread::run`).
        for job in pinned.chunks(JOB_KEYS) {
            self.send(index, Job::Put(job.to_vec()));
        }
    }

    /// Module flow, step 2: after an `AcquirePrefix` of `asker` for `keys` pinned their first
    /// `hits`, brings back the keys after them that the storage holds (those already coming
    /// included); returns how many of the keys after the hits are coming. The chunks are charged
    /// to `asker`, within its quota. `stores_allowed` is false during the owner's takeover grace:
    /// no chunk may be written then. At most half the tier is being brought back at once, and
    /// nothing for a while after the back-end failed a read.
    pub fn promote(
        &mut self,
        index: &mut SharedTierIndex,
        asker: ClientId,
        keys: &[OffloadKey],
        hits: usize,
        stores_allowed: bool,
    ) -> u32 {
        // A storage that hangs, or failed a read a moment ago, or has no thread: nothing comes
        // back, and what was coming is a miss while it hangs.
        let hung = self.hung();
        let paused = self.jobs.is_none()
            || hung
            || self.promotions_paused_until.is_some_and(|until| Instant::now() < until);
        // At most the asker's quota: more could never be charged to it.
        let quota = index.client_summary(asker).and_then(|summary| summary.quota);
        let room = self
            .max_promoting
            .saturating_sub(self.promoting.len())
            .min(MAX_PROMOTED)
            .min(quota.map_or(usize::MAX, |quota| quota as usize));
        let (mut coming, mut started) = (0, 0);
        let mut first_new = None;
        for key in &keys[hits.min(keys.len())..] {
            let state = index.peek(key);
            let new = state == LookupResult::Miss
                && stores_allowed
                && !paused
                && started < room
                && self.held.contains(&self.stored_name(key));
            let coming_back = !hung && self.promoting.contains(key);
            let known = coming_back || (state == LookupResult::Hit && coming > 0);
            if !new && !known {
                break;
            }
            if new && first_new.is_none() {
                first_new = Some(coming);
            }
            started += usize::from(new);
            coming += 1;
        }
        let Some(coming_before) = first_new else { return coming as u32 };
        let end = hits + coming;
        // Charged to the client that asked, within its quota: bringing blocks back is its store.
        let stored =
            index.prepare_store_for(self.client, asker, REQUEST, &keys[..end], &mut self.prepared);
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
        self.promoting.extend(job.iter().map(|&(key, _, _)| key));
        for part in job.chunks(JOB_KEYS) {
            self.send(index, Job::Get(part.to_vec()));
        }
        coming as u32
    }

    /// Whether the storage hangs: it has a job and finished none for [`PROMOTION_PATIENCE`].
    fn hung(&self) -> bool {
        self.jobs_in_flight > 0 && self.last_progress.elapsed() >= PROMOTION_PATIENCE
    }

    /// Hands `job` to the I/O thread; with the thread gone (it cannot be, short of a panic
    /// there), the job fails, and so does everything in flight.
    fn send(&mut self, index: &mut SharedTierIndex, job: Job) {
        let Some(jobs) = &self.jobs else {
            self.fail(index, job);
            return;
        };
        match jobs.send(job) {
            Ok(()) => {
                // The storage's time to finish a job counts from the first it has.
                if self.jobs_in_flight == 0 {
                    self.last_progress = Instant::now();
                }
                self.jobs_in_flight += 1;
            }
            Err(mpsc::SendError(job)) => {
                self.fail(index, job);
                self.thread_gone(index);
            }
        }
    }

    /// A job the I/O thread finished.
    fn job_done(&mut self, index: &mut SharedTierIndex, done: Done) {
        self.jobs_in_flight = self.jobs_in_flight.saturating_sub(1);
        self.last_progress = Instant::now();
        self.finish(index, done);
    }

    /// Finishes `job` as failed on every key, without I/O.
    fn fail(&mut self, index: &mut SharedTierIndex, job: Job) {
        let (put, batch) = match job {
            Job::Put(batch) => (true, batch),
            Job::Get(batch) => (false, batch),
        };
        let keys = batch.into_iter().map(|(key, _, _)| (key, Outcome::Failed)).collect();
        self.finish(index, Done { put, keys });
    }

    /// The I/O thread is gone (it panicked): no job runs any more, so what it had is failed
    /// (its pins go, its promotions are dropped) and the tier goes on without its storage.
    fn thread_gone(&mut self, index: &mut SharedTierIndex) {
        if self.jobs.take().is_some() {
            tracing::warn!("the storage thread is gone: the tier goes on without its storage");
        }
        let writing: Batch = self.writing.iter().map(|&key| (key, BlockHash(0), 0)).collect();
        let promoting: Batch = self.promoting.iter().map(|&key| (key, BlockHash(0), 0)).collect();
        self.jobs_in_flight = 0;
        self.fail(index, Job::Put(writing));
        self.fail(index, Job::Get(promoting));
        self.to_write.clear();
        self.waiting.clear();
        self.held = Held::new(1, []);
    }

    /// Module flow, step 3: finishes the jobs the I/O thread has done.
    pub fn poll(&mut self, index: &mut SharedTierIndex) {
        loop {
            match self.done.try_recv() {
                Ok(done) => self.job_done(index, done),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.thread_gone(index);
                    return;
                }
            }
        }
        self.write_waiting(index);
    }

    /// Finishes what is in flight and writes what waits, for at most `limit`: an owner that
    /// stops leaves on storage every block it was given to keep, as far as the time allows.
    pub fn drain(&mut self, index: &mut SharedTierIndex, limit: Duration) {
        let deadline = Instant::now() + limit;
        self.write_waiting(index);
        while self.busy() && self.jobs.is_some() {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.done.recv_timeout(left) {
                Ok(done) => self.job_done(index, done),
                Err(mpsc::RecvTimeoutError::Timeout) => break,
                Err(mpsc::RecvTimeoutError::Disconnected) => self.thread_gone(index),
            }
            self.write_waiting(index);
        }
    }

    fn finish(&mut self, index: &mut SharedTierIndex, done: Done) {
        let keys_of = |wanted: &[Outcome]| -> Vec<OffloadKey> {
            let keys = done.keys.iter().filter(|(_, outcome)| wanted.contains(outcome));
            keys.map(|&(key, _)| key).collect()
        };
        let (made, gone, failed) =
            (keys_of(&[Outcome::Made]), keys_of(&[Outcome::Gone]), keys_of(&[Outcome::Failed]));
        let all: Vec<OffloadKey> = done.keys.iter().map(|&(key, _)| key).collect();
        if done.put {
            if let Err(error) = index.release_loads(self.client, &all) {
                tracing::warn!(%error, "the storage client's pins of a write could not go");
            }
            for key in &all {
                self.writing.remove(key);
            }
            // The disk makes the first of a batch its newest (it touches in reverse order).
            for key in made.iter().rev() {
                self.held.insert(self.stored_name(key));
            }
            self.stats.puts += made.len() as u64;
            self.stats.puts_failed += (gone.len() + failed.len()) as u64;
            return;
        }
        let _ = index.complete_store(self.client, &made, true);
        let _ =
            index.complete_store(self.client, &keys_of(&[Outcome::Gone, Outcome::Failed]), false);
        for key in &all {
            self.promoting.remove(key);
        }
        // Absent or damaged: the back-end does not hold it. Failed: it may; nothing more is
        // brought back for a while, so that a storage away costs no more evictions for nothing.
        for key in &gone {
            self.held.forget(&self.stored_name(key));
        }
        // A block read is the disk's most recently used.
        for key in made.iter().rev() {
            self.held.insert(self.stored_name(key));
        }
        if !failed.is_empty() {
            self.promotions_paused_until = Some(Instant::now() + PROMOTION_BACKOFF);
        }
        self.stats.promoted += made.len() as u64;
        self.stats.promotions_missed += gone.len() as u64;
        self.stats.promotions_failed += failed.len() as u64;
    }
}

impl Drop for TierStorage {
    fn drop(&mut self) {
        // The thread drops the jobs it has not started and ends: a stop waits for one job at
        // most. Relaxed: the join orders what matters.
        self.stop.store(true, Ordering::Relaxed);
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
    // Oldest written first, as the back-end's recency has them (disk; Redis gives none).
    let mut blocks = blocks;
    blocks.sort_by_key(|block| block.sequence);
    Ok(blocks.into_iter().map(|block| block.hash).collect())
}
