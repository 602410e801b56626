//! Opening a worker's storage back-end before it serves: the segment's block layout as the tier
//! records it, `SIGXFSZ` turned into a counted "no space", and the wait for a slab that a worker
//! being replaced still holds, heartbeating all along.
//!
//! Core items: [`open_backend`], [`segment_layout`], [`StorageStartError`].
//!
//! [`open_backend`]:
//! 1. refuse a segment without a host tier, or whose block layout the tier cannot record;
//! 2. make writes beyond the file size limit fail with `EFBIG` instead of killing the worker;
//! 3. open the back-end on a helper thread while this one heartbeats (creating a large slab takes
//!    a while); a slab still held by another process is retried until the patience runs out or
//!    a stop is requested.

use std::time::{Duration, Instant};

use kvshm_ipc::segment::{RankClaim, Segment};
use kvshm_ipc::worker_slot::ClaimLost;

use crate::storage::spec::{OpenError, StorageOptions};
use crate::storage::{BlockLayout, StorageBackend};

/// How often the worker heartbeats while its back-end opens.
const OPEN_POLL: Duration = Duration::from_millis(10);

/// Why a worker's storage tier cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum StorageStartError {
    #[error("the storage tier of rank {rank}: {reason}")]
    Open { rank: u32, reason: OpenError },
    #[error("the storage tier needs a host tier, and this segment has none (host_blocks = 0)")]
    NoHostTier,
    #[error("the segment's host tier is a shared tier's: a storage tier below it is not offered")]
    SharedHostTier,
    #[error(
        "the segment's block layout cannot be stored ({block_bytes} bytes, {regions} regions)"
    )]
    BadLayout { block_bytes: u64, regions: u32 },
    #[error("the scheduler reclaimed the rank while its storage tier was opening: {0}")]
    ClaimLost(#[from] ClaimLost),
}

/// The block layout of `segment`'s ranks, as the storage tier records it.
pub fn segment_layout(segment: &Segment) -> Result<BlockLayout, StorageStartError> {
    let config = segment.config();
    BlockLayout::new(config.block_bytes(), config.regions, config.tp_size).ok_or(
        StorageStartError::BadLayout { block_bytes: config.block_bytes(), regions: config.regions },
    )
}

/// Makes a write beyond the process's file size limit fail with `EFBIG` (a counted "no space")
/// instead of killing the worker with SIGXFSZ.
fn ignore_file_size_signal() {
    use nix::sys::signal::{signal, SigHandler, Signal};
    // SAFETY: SIG_IGN runs no handler code; nothing in the worker relies on SIGXFSZ.
    if let Err(error) = unsafe { signal(Signal::SIGXFSZ, SigHandler::SigIgn) } {
        tracing::warn!(%error, "cannot ignore SIGXFSZ");
    }
}

/// Opens `rank`'s back-end (module flow), heartbeating meanwhile; a slab another process holds (a
/// worker being replaced) is retried until `patience` runs out or `stop` says so.
pub fn open_backend(
    segment: &Segment,
    claim: &RankClaim,
    options: &StorageOptions,
    patience: Duration,
    stop: &(dyn Fn() -> bool + Sync),
) -> Result<Box<dyn StorageBackend>, StorageStartError> {
    let config = segment.config();
    if config.host_blocks == 0 {
        return Err(StorageStartError::NoHostTier);
    }
    if config.host_tier_is_shared() {
        return Err(StorageStartError::SharedHostTier);
    }
    let layout = segment_layout(segment)?;
    let rank = claim.rank();
    ignore_file_size_signal();
    let started = Instant::now();
    loop {
        let opened = std::thread::scope(|scope| {
            let opening = scope.spawn(|| options.open(rank, layout, config.host_blocks));
            while !opening.is_finished() {
                claim.heartbeat()?;
                std::thread::sleep(OPEN_POLL);
            }
            claim.heartbeat()?;
            Ok::<_, ClaimLost>(opening.join().expect("opening a back-end does not panic"))
        })?;
        match opened {
            Ok(backend) => return Ok(backend),
            Err(reason) if reason.is_busy() && started.elapsed() < patience && !stop() => {
                tracing::info!(rank, %reason, "waiting for the storage slab");
                std::thread::sleep(OPEN_POLL * 5);
            }
            Err(reason) => return Err(StorageStartError::Open { rank, reason }),
        }
    }
}
