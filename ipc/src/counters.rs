//! Live counters that the scheduler stores and `kvctl` reads without stopping it.
//!
//! [`Counters`] is a fixed array of [`COUNTER_SLOTS`] u64 atomics in the control segment, indexed
//! by [`Counter`]; slots past the last known counter are spare, so later counters fit within this
//! layout version. All accesses are Relaxed: each counter is an independent statistic, and no
//! reader infers anything about other memory from a counter's value.
//!
//! Flow: 1. the scheduler updates counters as it works (`set`, `add`); 2. `kvctl stat` calls
//! [`Counters::snapshot`] and prints `Counter::name()` with each value.

use crate::sync::{AtomicU64, Ordering};

/// Number of counter slots in the segment (known counters plus spares).
pub const COUNTER_SLOTS: usize = 64;

/// One live counter. Gauges (`*_free`, `*_live`, `*_in_flight`) go up and down; the rest only grow.
#[repr(usize)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Counter {
    DeviceBlocksTotal,
    DeviceBlocksFree,
    HostBlocksTotal,
    HostBlocksFree,
    CachedNodes,
    DeviceHitBlocks,
    HostHitBlocks,
    MissBlocks,
    HitTokens,
    Lookups,
    RequestsLive,
    Evictions,
    SwapsIn,
    SwapsOut,
    Backups,
    CopyFailures,
    CommandsIssued,
    CommandsCompleted,
    CommandsInFlight,
    BytesCopied,
    Generation,
    Resets,
    WorkerDeaths,
    DroppedNodes,
    /// `CLOCK_MONOTONIC` ns of the scheduler's last poll: tells kvctl whether requests will be served.
    LastPollNs,
    /// Bytes the workers copied, all ranks together. Workers add to it; the scheduler never stores.
    WorkerCopyBytes,
    /// Nanoseconds the workers spent copying, all ranks together. Workers add to it.
    WorkerCopyNs,
    /// Blocks the workers wrote to the storage tier (or found there already), all ranks together.
    StorageStoredBlocks,
    /// Blocks a STORE could not write (error, timeout, unreachable, full).
    StorageStoreFailures,
    /// Blocks a LOAD read back whole and verified.
    StorageLoadHits,
    /// Blocks a LOAD did not find (absent, corrupt or failed).
    StorageLoadMisses,
    /// Stored blocks whose checksum, length or layout tag was wrong: dropped, read as misses.
    StorageCorruptBlocks,
    /// Blocks asked about by QUERY commands.
    StorageQueryBlocks,
    /// Storage I/O or protocol errors (each failed block or batch once).
    StorageErrors,
    /// Storage operations that did not answer in time.
    StorageTimeouts,
    /// Blocks that missed because the storage back-end could not be reached.
    StorageUnavailable,
    /// Blocks not stored because the file system or server is full.
    StorageNoSpace,
    /// Block bytes of the blocks counted by `StorageStoredBlocks`: stored, including blocks the
    /// tier held already and did not write again.
    StorageBytesWritten,
    /// Block bytes read back from the storage tier and verified.
    StorageBytesRead,
    /// Records a back-end dropped to make room (its own LRU).
    StorageEvictions,
    /// Nanoseconds the workers' storage threads spent in the back-end.
    StorageIoNs,
    /// Capacity of the storage tier in blocks per rank (0: none), as the scheduler counts it.
    StorageBlocksTotal,
    /// Blocks the scheduler counts on the storage tier (held, or being written).
    StorageBlocksUsed,
    /// Queried blocks that hit on the storage tier.
    StorageHitBlocks,
    /// Blocks FORGET commands told the workers' back-ends the scheduler dropped (per rank, summed).
    StorageForgottenBlocks,
    /// Prefetch calls that started work (a LOAD or a QUERY) and got a ticket.
    Prefetches,
    /// Blocks prefetches loaded from storage into host blocks, issued.
    PrefetchLoadBlocks,
    /// Blocks prefetches found on a shared storage tier by QUERY and adopted.
    PrefetchFoundBlocks,
    /// Blocks whose prefetch LOAD failed (storage-only again).
    PrefetchFailedBlocks,
    /// Blocks prefetches asked the storage tier about (QUERY), past what the cache knew.
    PrefetchQueryBlocks,
    /// Stored blocks given up because their parent never came back to the cache.
    ExpiredOrphans,
    /// FORGET commands that failed on some rank (each is sent once more).
    StorageForgetFailures,
    /// Blocks whose FORGET was given up (a second failure, or past the backlog of a rank
    /// without a worker): a disk slab keeps them.
    StorageForgetsDropped,
    /// 1 once a worker runs a storage back-end other services may write to (Redis): the
    /// scheduler then asks it about blocks past what it knows (prefetch discovery). Set by the
    /// workers, never by the scheduler.
    StorageSharedTier,
    /// Blocks a LOAD found missing or damaged on the storage tier (no hit from then on).
    LoadMissingBlocks,
    /// Blocks dropped because the tier lost them (a missing block and the storage-only blocks below it).
    LostBlocksDropped,
    /// Tickets whose hit a LOAD's miss shortened (the request computes the rest).
    ShortenedTickets,
    /// Write-through STOREs skipped because the tier was full of blocks it holds alone (written back later).
    WriteThroughSkipped,
    /// 1 while the storage tier is marked down (a STORE or LOAD said it failed; no work goes to
    /// it until a probe reaches it on every rank), 0 while it is up.
    StorageTierDown,
    /// `CLOCK_MONOTONIC` ns when the current outage of the storage tier began (0 while it is up).
    StorageTierDownSinceNs,
    /// Times the storage tier was marked down.
    StorageTierOutages,
    /// Probes sent to the storage tier while it was down (a one-block QUERY to every rank), and
    /// those that did not reach it on every rank.
    StorageTierProbes,
    StorageTierProbesFailed,
    /// Blocks not sent to the storage tier while it was down: host evictions that dropped a
    /// block instead of writing it back, and write-through STOREs skipped.
    StorageDownSkippedBlocks,
}

impl Counter {
    /// Every counter, in slot order.
    pub const ALL: [Counter; 64] = [
        Counter::DeviceBlocksTotal,
        Counter::DeviceBlocksFree,
        Counter::HostBlocksTotal,
        Counter::HostBlocksFree,
        Counter::CachedNodes,
        Counter::DeviceHitBlocks,
        Counter::HostHitBlocks,
        Counter::MissBlocks,
        Counter::HitTokens,
        Counter::Lookups,
        Counter::RequestsLive,
        Counter::Evictions,
        Counter::SwapsIn,
        Counter::SwapsOut,
        Counter::Backups,
        Counter::CopyFailures,
        Counter::CommandsIssued,
        Counter::CommandsCompleted,
        Counter::CommandsInFlight,
        Counter::BytesCopied,
        Counter::Generation,
        Counter::Resets,
        Counter::WorkerDeaths,
        Counter::DroppedNodes,
        Counter::LastPollNs,
        Counter::WorkerCopyBytes,
        Counter::WorkerCopyNs,
        Counter::StorageStoredBlocks,
        Counter::StorageStoreFailures,
        Counter::StorageLoadHits,
        Counter::StorageLoadMisses,
        Counter::StorageCorruptBlocks,
        Counter::StorageQueryBlocks,
        Counter::StorageErrors,
        Counter::StorageTimeouts,
        Counter::StorageUnavailable,
        Counter::StorageNoSpace,
        Counter::StorageBytesWritten,
        Counter::StorageBytesRead,
        Counter::StorageEvictions,
        Counter::StorageIoNs,
        Counter::StorageBlocksTotal,
        Counter::StorageBlocksUsed,
        Counter::StorageHitBlocks,
        Counter::StorageForgottenBlocks,
        Counter::Prefetches,
        Counter::PrefetchLoadBlocks,
        Counter::PrefetchFoundBlocks,
        Counter::PrefetchFailedBlocks,
        Counter::PrefetchQueryBlocks,
        Counter::ExpiredOrphans,
        Counter::StorageForgetFailures,
        Counter::StorageForgetsDropped,
        Counter::StorageSharedTier,
        Counter::LoadMissingBlocks,
        Counter::LostBlocksDropped,
        Counter::ShortenedTickets,
        Counter::WriteThroughSkipped,
        Counter::StorageTierDown,
        Counter::StorageTierDownSinceNs,
        Counter::StorageTierOutages,
        Counter::StorageTierProbes,
        Counter::StorageTierProbesFailed,
        Counter::StorageDownSkippedBlocks,
    ];

    /// The snake_case name kvctl prints (and Prometheus exports with a `kvshm_` prefix).
    pub fn name(self) -> &'static str {
        match self {
            Counter::DeviceBlocksTotal => "device_blocks_total",
            Counter::DeviceBlocksFree => "device_blocks_free",
            Counter::HostBlocksTotal => "host_blocks_total",
            Counter::HostBlocksFree => "host_blocks_free",
            Counter::CachedNodes => "cached_nodes",
            Counter::DeviceHitBlocks => "device_hit_blocks",
            Counter::HostHitBlocks => "host_hit_blocks",
            Counter::MissBlocks => "miss_blocks",
            Counter::HitTokens => "hit_tokens",
            Counter::Lookups => "lookups",
            Counter::RequestsLive => "requests_live",
            Counter::Evictions => "evictions",
            Counter::SwapsIn => "swaps_in",
            Counter::SwapsOut => "swaps_out",
            Counter::Backups => "backups",
            Counter::CopyFailures => "copy_failures",
            Counter::CommandsIssued => "commands_issued",
            Counter::CommandsCompleted => "commands_completed",
            Counter::CommandsInFlight => "commands_in_flight",
            Counter::BytesCopied => "bytes_copied",
            Counter::Generation => "generation",
            Counter::Resets => "resets",
            Counter::WorkerDeaths => "worker_deaths",
            Counter::DroppedNodes => "dropped_nodes",
            Counter::LastPollNs => "last_poll_ns",
            Counter::WorkerCopyBytes => "worker_copy_bytes",
            Counter::WorkerCopyNs => "worker_copy_ns",
            Counter::StorageStoredBlocks => "storage_stored_blocks",
            Counter::StorageStoreFailures => "storage_store_failures",
            Counter::StorageLoadHits => "storage_load_hits",
            Counter::StorageLoadMisses => "storage_load_misses",
            Counter::StorageCorruptBlocks => "storage_corrupt_blocks",
            Counter::StorageQueryBlocks => "storage_query_blocks",
            Counter::StorageErrors => "storage_errors",
            Counter::StorageTimeouts => "storage_timeouts",
            Counter::StorageUnavailable => "storage_unavailable",
            Counter::StorageNoSpace => "storage_no_space",
            Counter::StorageBytesWritten => "storage_bytes_written",
            Counter::StorageBytesRead => "storage_bytes_read",
            Counter::StorageEvictions => "storage_evictions",
            Counter::StorageIoNs => "storage_io_ns",
            Counter::StorageBlocksTotal => "storage_blocks_total",
            Counter::StorageBlocksUsed => "storage_blocks_used",
            Counter::StorageHitBlocks => "storage_hit_blocks",
            Counter::StorageForgottenBlocks => "storage_forgotten_blocks",
            Counter::Prefetches => "prefetches",
            Counter::PrefetchLoadBlocks => "prefetch_load_blocks",
            Counter::PrefetchFoundBlocks => "prefetch_found_blocks",
            Counter::PrefetchFailedBlocks => "prefetch_failed_blocks",
            Counter::PrefetchQueryBlocks => "prefetch_query_blocks",
            Counter::ExpiredOrphans => "expired_orphans",
            Counter::StorageForgetFailures => "storage_forget_failures",
            Counter::StorageForgetsDropped => "storage_forgets_dropped",
            Counter::StorageSharedTier => "storage_shared_tier",
            Counter::LoadMissingBlocks => "load_missing_blocks",
            Counter::LostBlocksDropped => "lost_blocks_dropped",
            Counter::ShortenedTickets => "shortened_tickets",
            Counter::WriteThroughSkipped => "write_through_skipped",
            Counter::StorageTierDown => "storage_tier_down",
            Counter::StorageTierDownSinceNs => "storage_tier_down_since_ns",
            Counter::StorageTierOutages => "storage_tier_outages",
            Counter::StorageTierProbes => "storage_tier_probes",
            Counter::StorageTierProbesFailed => "storage_tier_probes_failed",
            Counter::StorageDownSkippedBlocks => "storage_down_skipped_blocks",
        }
    }

    /// True for values that go up and down (Prometheus gauge), false for monotonic counters.
    pub fn is_gauge(self) -> bool {
        matches!(
            self,
            Counter::DeviceBlocksTotal
                | Counter::DeviceBlocksFree
                | Counter::HostBlocksTotal
                | Counter::HostBlocksFree
                | Counter::StorageBlocksTotal
                | Counter::StorageBlocksUsed
                | Counter::CachedNodes
                | Counter::RequestsLive
                | Counter::CommandsInFlight
                | Counter::Generation
                | Counter::LastPollNs
                | Counter::StorageSharedTier
                | Counter::StorageTierDown
                | Counter::StorageTierDownSinceNs
        )
    }

    /// Looks a counter up by its [`name`](Self::name).
    pub fn from_name(name: &str) -> Option<Counter> {
        Counter::ALL.into_iter().find(|counter| counter.name() == name)
    }
}

const _: () = assert!(Counter::ALL.len() <= COUNTER_SLOTS);
const _: () = assert!(Counter::StorageDownSkippedBlocks as usize == Counter::ALL.len() - 1);

/// The counter array as it lies in the segment. Zeroed memory is all counters at 0.
#[repr(C, align(64))]
pub struct Counters {
    slots: [AtomicU64; COUNTER_SLOTS],
}

const _: () = assert!(size_of::<Counters>() == COUNTER_SLOTS * size_of::<AtomicU64>());

// SAFETY: an array of AtomicU64 with no padding (asserted above); any bits are valid counts.
unsafe impl crate::shm::SharedArea for Counters {}

impl Counters {
    pub fn get(&self, counter: Counter) -> u64 {
        self.slots[counter as usize].load(Ordering::Relaxed)
    }

    pub fn set(&self, counter: Counter, value: u64) {
        self.slots[counter as usize].store(value, Ordering::Relaxed);
    }

    pub fn add(&self, counter: Counter, delta: u64) {
        self.slots[counter as usize].fetch_add(delta, Ordering::Relaxed);
    }

    /// Subtracts, saturating at zero (a gauge never shows a wrapped value).
    pub fn sub(&self, counter: Counter, delta: u64) {
        let slot = &self.slots[counter as usize];
        let mut current = slot.load(Ordering::Relaxed);
        while let Err(actual) = slot.compare_exchange_weak(
            current,
            current.saturating_sub(delta),
            Ordering::Relaxed,
            Ordering::Relaxed,
        ) {
            current = actual;
        }
    }

    /// Every known counter with its current value, in slot order.
    pub fn snapshot(&self) -> Vec<(Counter, u64)> {
        Counter::ALL.into_iter().map(|counter| (counter, self.get(counter))).collect()
    }

    /// Sets every slot, spares included, to zero.
    pub fn clear(&self) {
        for slot in &self.slots {
            slot.store(0, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_listed_in_slot_order_with_unique_names() {
        for (index, counter) in Counter::ALL.into_iter().enumerate() {
            assert_eq!(counter as usize, index);
            assert_eq!(Counter::from_name(counter.name()), Some(counter));
        }
        let mut names: Vec<_> = Counter::ALL.iter().map(|c| c.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), Counter::ALL.len());
    }

    #[test]
    fn gauges_saturate_at_zero_when_decremented() {
        let counters: Counters = Counters { slots: std::array::from_fn(|_| AtomicU64::new(0)) };
        counters.set(Counter::DeviceBlocksFree, 3);
        counters.sub(Counter::DeviceBlocksFree, 5);
        assert_eq!(counters.get(Counter::DeviceBlocksFree), 0);
        counters.add(Counter::Lookups, 2);
        counters.add(Counter::Lookups, 2);
        assert_eq!(counters.snapshot()[Counter::Lookups as usize], (Counter::Lookups, 4));
    }
}
