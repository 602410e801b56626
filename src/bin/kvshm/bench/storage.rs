//! `kvshm bench storage`: the storage tier's bandwidth against plain I/O of the same bytes on the
//! same system, measured in the same run.
//!
//! Disk (always; `--dir`, default the system temp directory):
//!
//! 1. for 64 KiB and 1 MiB blocks, fill `--mib` MiB of page-aligned memory (the host tier
//!    stand-in) with pseudo-random bytes;
//! 2. baseline: one file in the same directory, preallocated, written (twice: a first write into
//!    fresh extents, which the file system converts as it goes, and an overwrite) then read
//!    sequentially in block-sized `pwrite`/`pread` calls, with O_DIRECT when the file system
//!    allows it, as the tier does (in buffered mode both sides are synced and their pages dropped
//!    before reading, so neither reads from the page cache); it runs before and after each tier
//!    path and the mean of the two is the baseline. The tier's consecutive phase (a fresh slab)
//!    is compared with the first write, its scattered phase (reused slots) with the overwrite;
//! 3. the tier, through each path: `backend` (the disk back-end called in this process) and
//!    `worker` (a `kvshm worker --storage disk:…` process driven with STORE/LOAD commands of 32
//!    blocks through a segment's rings, 8 commands in flight: the scheduler's path). Checksums,
//!    index records and completions are all included. Phases on a slab of exactly the blocks'
//!    capacity: consecutive write (a fresh slab fills front to back) and read in the same order;
//!    then every block is read once in random order (untimed) so that the slab's LRU order is
//!    random, and a second set of blocks is written (each takes the least recently used slot:
//!    scattered offsets, the steady state of a full cache) and read back in random order.
//!
//! Redis (with `--redis URL`): for both block sizes, `--redis-mib` MiB through the same two
//! paths against plain pipelined `SET` (32 per pipeline) and `MGET` (32 keys) of the same sizes
//! on one connection, with no header or checksum; GB/s and milliseconds per block.
//!
//! One JSON object (`--json`): the tables, and at the top `disk_write_over_baseline` and
//! `disk_read_over_baseline` for 1 MiB scattered blocks through the worker.

mod redis;
mod target;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use kvshm_ipc::name::SegmentName;
use serde::Serialize;

use kvshm::storage::direct_io::{
    preallocate, read_exact_at, write_all_at, AlignedBuf, DataFile, IoMode,
};
use kvshm::storage::{BlockBytes, BlockBytesMut, BlockLayout, DiskBackend, DiskOptions};
use redis::{redis_report, RedisReport};
use target::{BackendTarget, Target, WorkerTarget};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Directory for the disk tier and its baseline file (on the file system to measure).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// A Redis server to measure too (redis://HOST:PORT); its keys are removed afterwards.
    #[arg(long)]
    redis: Option<String>,
    /// MiB of blocks per disk case.
    #[arg(long, default_value_t = 256)]
    mib: usize,
    /// MiB of blocks per Redis case.
    #[arg(long, default_value_t = 64)]
    redis_mib: usize,
    /// Use the page cache instead of O_DIRECT (tier and baseline alike).
    #[arg(long)]
    buffered: bool,
}

const MIB: usize = 1 << 20;
const BLOCK_SIZES: [usize; 2] = [64 << 10, 1 << 20];

#[derive(Debug, Serialize)]
struct Report {
    bench: &'static str,
    dir: String,
    io_mode: IoMode,
    disk_write_over_baseline: f64,
    disk_read_over_baseline: f64,
    disk: Vec<DiskRow>,
    redis: Option<RedisReport>,
    notes: Vec<&'static str>,
}

#[derive(Debug, Serialize)]
struct DiskRow {
    path: &'static str,
    block_bytes: usize,
    pattern: &'static str,
    blocks: usize,
    write_gbps: f64,
    read_gbps: f64,
    /// Over the mean time of the two baseline runs (before and after the tier).
    baseline_write_gbps: f64,
    baseline_read_gbps: f64,
    baseline_write_gbps_samples: [f64; 2],
    baseline_read_gbps_samples: [f64; 2],
    write_over_baseline: f64,
    read_over_baseline: f64,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    check(&args)?;
    let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("kvshm-bench-storage-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let cleanup = RemoveOnDrop(dir.clone());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| u64::from(since.subsec_nanos()));
    let salt = u64::from(std::process::id()) << 32 | nanos;

    let mut disk = Vec::new();
    let mut io_mode = IoMode::Buffered;
    for block in BLOCK_SIZES {
        let blocks = (args.mib * MIB / block).max(1);
        let mut host = filled(blocks * block, block as u64);
        for path in ["backend", "worker"] {
            // The disk's speed drifts on a shared machine: bracket the tier with a baseline run
            // before and one after, and compare against their mean.
            let before = disk_baseline(&dir, &host, block, !args.buffered)?;
            let phases = disk_phases(&args, &dir, path, &mut host, block, blocks, salt)?;
            let after = disk_baseline(&dir, &host, block, !args.buffered)?;
            io_mode = before.mode;
            let bytes = (blocks * block) as f64;
            let gbps = |seconds: f64| bytes / seconds / 1e9;
            let baseline_read = gbps((before.read_seconds + after.read_seconds) / 2.0);
            let read_samples = [gbps(before.read_seconds), gbps(after.read_seconds)];
            // A fresh slab's first writes are compared with first writes into a fresh file; the
            // scattered phase overwrites written slots, and is compared with an overwrite.
            let first = [before.first_write_seconds, after.first_write_seconds];
            let over = [before.overwrite_seconds, after.overwrite_seconds];
            for (pattern, write, read, base) in [
                ("consecutive", phases[0], phases[1], first),
                ("scattered", phases[2], phases[3], over),
            ] {
                let (write_gbps, read_gbps) = (gbps(write), gbps(read));
                let baseline_write = gbps((base[0] + base[1]) / 2.0);
                disk.push(DiskRow {
                    path,
                    block_bytes: block,
                    pattern,
                    blocks,
                    write_gbps,
                    read_gbps,
                    baseline_write_gbps: baseline_write,
                    baseline_read_gbps: baseline_read,
                    baseline_write_gbps_samples: [gbps(base[0]), gbps(base[1])],
                    baseline_read_gbps_samples: read_samples,
                    write_over_baseline: write_gbps / baseline_write,
                    read_over_baseline: read_gbps / baseline_read,
                });
            }
        }
    }
    let headline = disk
        .iter()
        .find(|row| {
            row.path == "worker" && row.block_bytes == 1 << 20 && row.pattern == "scattered"
        })
        .expect("the 1 MiB scattered worker case is always measured");
    let redis = match &args.redis {
        Some(url) => Some(redis_report(&args, url, salt)?),
        None => None,
    };
    let report = Report {
        bench: "storage",
        dir: base.display().to_string(),
        io_mode,
        disk_write_over_baseline: headline.write_over_baseline,
        disk_read_over_baseline: headline.read_over_baseline,
        disk,
        redis,
        notes: vec![
            "baseline: sequential block-sized pwrite/pread of the same bytes in the same directory, same io_mode as the tier, run before and after each tier path (the mean time of both)",
            "consecutive rows compare a fresh slab's writes with first writes into a fresh preallocated file; scattered rows compare reused slots with an overwrite",
            "tier: checksums, index records and (worker path) commands and completions included",
            "scattered: slots reused in random LRU order (write), random read order",
        ],
    };
    drop(cleanup);
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

/// Refuses sizes the run cannot have, naming the option.
fn check(args: &Args) -> anyhow::Result<()> {
    use kvshm::cli::checks::{at_least, fits_in_dev_shm, fits_in_memory, mib_to_bytes, within};
    within(args.mib, 1..=1 << 20, "--mib")?;
    within(args.redis_mib, 1..=1 << 20, "--redis-mib")?;
    let bytes = mib_to_bytes(args.mib as u64, "--mib")?;
    at_least(bytes, BLOCK_SIZES[1] as u64, "--mib (in bytes: one 1 MiB block at least)")?;
    // The host-tier stand-in and the baseline's read-back buffer; the worker's host tier.
    fits_in_memory(u128::from(bytes) * 2, format_args!("--mib {}: two buffers", args.mib))?;
    fits_in_dev_shm(u128::from(bytes), format_args!("--mib {}: the worker's host tier", args.mib))?;
    let redis_bytes = mib_to_bytes(args.redis_mib as u64, "--redis-mib")?;
    fits_in_memory(u128::from(redis_bytes) * 2, format_args!("--redis-mib {}", args.redis_mib))?;
    if args.redis.is_some() {
        fits_in_dev_shm(u128::from(redis_bytes), format_args!("--redis-mib {}", args.redis_mib))?;
    }
    Ok(())
}

/// Removes the bench directory when the bench ends, however it ends.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Page-aligned memory of `len` pseudo-random bytes (xorshift; incompressible enough).
fn filled(len: usize, seed: u64) -> AlignedBuf {
    let mut buf = AlignedBuf::zeroed(len);
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for word in buf.as_mut_slice().chunks_exact_mut(8) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        word.copy_from_slice(&state.to_le_bytes());
    }
    buf
}

/// A permutation of `0..n` (Fisher-Yates over a xorshift stream).
fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut state = seed | 1;
    for i in (1..n).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        order.swap(i, (state % (i as u64 + 1)) as usize);
    }
    order
}

struct DiskBaseline {
    mode: IoMode,
    /// Writing the freshly preallocated file (the file system converts its extents as it goes).
    first_write_seconds: f64,
    /// Writing it again, over written blocks.
    overwrite_seconds: f64,
    read_seconds: f64,
}

/// Step 2: sequential block-sized writes of `host` into a fresh preallocated file in `dir`, the
/// same writes again (over written blocks), then the reads.
fn disk_baseline(
    dir: &Path,
    host: &AlignedBuf,
    block: usize,
    direct: bool,
) -> anyhow::Result<DiskBaseline> {
    let path = dir.join("baseline");
    let _ = std::fs::remove_file(&path);
    let data = DataFile::open(&path, true, direct)
        .with_context(|| format!("opening {}", path.display()))?;
    let bytes = host.as_slice();
    preallocate(data.file(), bytes.len() as u64)?;
    let write_all = || -> anyhow::Result<f64> {
        let started = Instant::now();
        for (index, chunk) in bytes.chunks(block).enumerate() {
            write_all_at(data.file(), &[BlockBytes::new(chunk)], (index * block) as u64)?;
        }
        if data.mode() == IoMode::Buffered {
            data.file().sync_data()?;
        }
        Ok(started.elapsed().as_secs_f64())
    };
    let first_write = write_all()?;
    let overwrite = write_all()?;
    drop_page_cache(&path);
    let mut back = AlignedBuf::zeroed(bytes.len());
    let started = Instant::now();
    for (index, chunk) in back.as_mut_slice().chunks_mut(block).enumerate() {
        read_exact_at(data.file(), &mut [BlockBytesMut::new(chunk)], (index * block) as u64)?;
    }
    let read = started.elapsed().as_secs_f64();
    anyhow::ensure!(back.as_slice() == bytes, "the baseline read back other bytes");
    let mode = data.mode();
    drop(data);
    std::fs::remove_file(&path)?;
    Ok(DiskBaseline {
        mode,
        first_write_seconds: first_write.max(1e-9),
        overwrite_seconds: overwrite.max(1e-9),
        read_seconds: read.max(1e-9),
    })
}

/// Syncs `path` and drops its pages from the page cache (a no-op for pages O_DIRECT never
/// cached), so that the next read goes to the device.
fn drop_page_cache(path: &Path) {
    use std::os::fd::AsRawFd;
    if let Ok(file) = std::fs::File::open(path) {
        let _ = file.sync_data();
        // SAFETY: posix_fadvise takes a descriptor we own and integers; it only drops clean pages.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
}

/// Step 3 for one path: the four timed phases, in seconds (consecutive write and read,
/// scattered write and read).
fn disk_phases(
    args: &Args,
    dir: &Path,
    path: &'static str,
    host: &mut AlignedBuf,
    block: usize,
    blocks: usize,
    salt: u64,
) -> anyhow::Result<[f64; 4]> {
    let namespace = format!("bench-{path}-{block}");
    let slab = dir.join(&namespace).join("rank-0.slab");
    let salt = salt ^ (block as u64) ^ (path.len() as u64) << 40;
    let run = |target: &mut dyn Target| -> anyhow::Result<[f64; 4]> {
        let n = blocks as u64;
        let in_order: Vec<(u64, u32)> = (0..n).map(|i| (i, i as u32)).collect();
        let write_consecutive = timed(|| target.store(&in_order), blocks, "consecutive write")?;
        drop_page_cache(&slab);
        let read_consecutive = timed(|| target.load(&in_order), blocks, "consecutive read")?;
        let scramble: Vec<(u64, u32)> =
            shuffled(blocks, salt).into_iter().map(|i| (i as u64, i as u32)).collect();
        target.load(&scramble)?;
        let scattered_store: Vec<(u64, u32)> =
            shuffled(blocks, salt ^ 1).into_iter().map(|i| (n + i as u64, i as u32)).collect();
        let write_scattered = timed(|| target.store(&scattered_store), blocks, "scattered write")?;
        drop_page_cache(&slab);
        let scattered_load: Vec<(u64, u32)> =
            shuffled(blocks, salt ^ 2).into_iter().map(|i| (n + i as u64, i as u32)).collect();
        let read_scattered = timed(|| target.load(&scattered_load), blocks, "scattered read")?;
        Ok([write_consecutive, read_consecutive, write_scattered, read_scattered])
    };
    let phases = match path {
        "backend" => {
            let backend = DiskBackend::open(&DiskOptions {
                dir: dir.to_owned(),
                namespace: namespace.clone(),
                rank: 0,
                layout: BlockLayout::new(block as u64, 2, 1).expect("an even block size"),
                capacity_blocks: blocks as u64,
                prefer_direct: !args.buffered,
                crash: None,
            })?;
            run(&mut BackendTarget { backend: Box::new(backend), host, block_bytes: block, salt })?
        }
        _ => {
            let name = SegmentName::new(&format!("bench-storage-{}-{block}", std::process::id()))?;
            let mut storage_args = vec![
                "--storage".to_owned(),
                format!("disk:{}", dir.display()),
                "--storage-namespace".to_owned(),
                namespace.clone(),
                "--storage-blocks".to_owned(),
                blocks.to_string(),
            ];
            if args.buffered {
                storage_args.push("--storage-buffered".to_owned());
            }
            let log = dir.join("worker.log");
            let mut worker =
                WorkerTarget::start(&name, block, blocks as u32, &storage_args, salt, &log)?;
            worker.host_mut()[..host.len()].copy_from_slice(host.as_slice());
            let phases = run(&mut worker)?;
            worker.stop()?;
            phases
        }
    };
    let _ = std::fs::remove_dir_all(dir.join(&namespace));
    Ok(phases)
}

/// Runs `phase` (which answers how many blocks it moved) and returns its seconds; fewer blocks
/// than expected is an error: the tier lost some.
fn timed(
    phase: impl FnOnce() -> anyhow::Result<usize>,
    expected: usize,
    what: &str,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    let moved = phase()?;
    let seconds = started.elapsed().as_secs_f64();
    anyhow::ensure!(moved == expected, "{what}: the tier moved {moved} of {expected} blocks");
    Ok(seconds.max(1e-9))
}

fn print_table(report: &Report) {
    println!("storage tier in {} ({:?} I/O)", report.dir, report.io_mode);
    println!(
        "{:<8} {:>9} {:<12} {:>7} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7}",
        "path",
        "block",
        "pattern",
        "blocks",
        "write",
        "read",
        "base_w",
        "base_r",
        "w/base",
        "r/base"
    );
    for row in &report.disk {
        println!(
            "{:<8} {:>9} {:<12} {:>7} {:>8.2}G {:>8.2}G {:>8.2}G {:>8.2}G {:>7.2} {:>7.2}",
            row.path,
            row.block_bytes,
            row.pattern,
            row.blocks,
            row.write_gbps,
            row.read_gbps,
            row.baseline_write_gbps,
            row.baseline_read_gbps,
            row.write_over_baseline,
            row.read_over_baseline
        );
    }
    println!(
        "1 MiB scattered through the worker: write {:.2}x, read {:.2}x of the baseline",
        report.disk_write_over_baseline, report.disk_read_over_baseline
    );
    if let Some(redis) = &report.redis {
        redis.print_table();
    }
}
