//! What the demo's `--storage` options make of its workers and its tier: the tier's size per
//! rank, each worker's storage options, the breaker's back-off, and the blocks a tier already
//! holds put back into the cache at start.

use std::time::Duration;

use anyhow::Context;
use kvshm::service::{Service, TierBackoff};
use kvshm::storage::backend::BlockLayout;
use kvshm::storage::spec::StorageSpec;

use super::Args;

/// The waits before probing a storage tier that is down (`--storage-backoff-ms`,
/// `--storage-backoff-max-ms`).
pub(super) fn storage_backoff(args: &Args) -> anyhow::Result<TierBackoff> {
    let backoff = TierBackoff {
        first: Duration::from_millis(args.storage_backoff_ms),
        max: Duration::from_millis(args.storage_backoff_max_ms),
    };
    backoff.validate().map_err(|error| {
        anyhow::anyhow!(
            "--storage-backoff-ms {} / --storage-backoff-max-ms {}: {error}",
            args.storage_backoff_ms,
            args.storage_backoff_max_ms
        )
    })?;
    Ok(backoff)
}

/// The storage tier's blocks per rank: as given, or 4 times the host tier.
pub(super) fn storage_blocks(args: &Args) -> u32 {
    args.storage_blocks.unwrap_or(args.host_blocks.saturating_mul(4))
}

/// A disk worker's slab slots: the tier's blocks plus one per device and host block (see
/// [`worker_storage_args`]).
pub(super) fn slab_blocks(args: &Args) -> u64 {
    u64::from(storage_blocks(args)) + u64::from(args.host_blocks) + u64::from(args.device_blocks)
}

/// The `--storage-*` options of each worker and the storage spec it is given (in its
/// environment: [`STORAGE_ENV`](kvshm::storage::spec::STORAGE_ENV)); none without `--storage`.
pub(super) fn worker_storage_args(args: &Args) -> (Vec<String>, Option<String>) {
    let Some(spec) = &args.storage else { return (Vec::new(), None) };
    let mut worker_args = vec!["--storage-from-env".into()];
    worker_args.extend(["--storage-namespace".into(), args.storage_namespace.clone()]);
    let spec = match spec {
        // The slab keeps, beside the blocks the scheduler counts on the tier, the blocks it
        // loaded back above storage (the scheduler no longer counts that copy, the slab keeps it
        // and the block's next write-back finds it there): at most one per device and host
        // block. Every block the scheduler drops is forgotten (FORGET), so with this room the
        // slab's own LRU never drops a block the scheduler still counts.
        StorageSpec::Disk { dir } => {
            worker_args.extend(["--storage-blocks".into(), slab_blocks(args).to_string()]);
            format!("disk:{}", dir.display())
        }
        // Redis holds what its memory does: the capacity is the scheduler's budget alone.
        StorageSpec::Redis { url } => url.clone(),
    };
    (worker_args, Some(spec))
}

/// Puts back the blocks the storage tier holds on every rank (a previous run's, or another
/// service's sharing the namespace): a disk tier's persisted index, a Redis tier's keys and value
/// headers. Returns how many were found (some wait for their parent to be cached again).
pub(super) fn adopt_stored_blocks(args: &Args, service: &mut Service) -> anyhow::Result<usize> {
    let Some(spec) = &args.storage else { return Ok(0) };
    let regions = args.layers * 2;
    let layout = BlockLayout::new(u64::from(regions) * args.region_bytes, regions, args.tp)
        .context("the block layout of the storage tier")?;
    let blocks = match spec {
        StorageSpec::Disk { dir } => {
            let namespace_dir = dir.join(&args.storage_namespace);
            kvshm::storage::disk_index::blocks_on_every_rank(&namespace_dir, &layout).with_context(
                || format!("reading the disk tier's index under {}", namespace_dir.display()),
            )?
        }
        StorageSpec::Redis { url } => kvshm::storage::redis_listing::blocks_on_every_rank(
            url,
            &args.storage_namespace,
            &layout,
            Duration::from_secs(10),
        )
        .with_context(|| format!("listing the blocks of {spec}"))?,
    };
    service.adopt_stored_blocks(
        blocks.into_iter().map(|block| (block.hash, block.parent, block.depth)),
    );
    Ok(service.cache().storage_used_blocks() as usize
        + service.cache().storage_blocks_waiting_for_parent())
}
