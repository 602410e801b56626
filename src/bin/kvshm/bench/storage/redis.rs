//! The Redis half of `kvshm bench storage`: for both block sizes, `--redis-mib` MiB through the
//! tier's two paths (the back-end in this process, a worker through the rings) against plain
//! pipelined `SET` and `MGET` of the same bytes on one connection, measured in the same run.

use std::time::{Duration, Instant};

use anyhow::Context;
use kvshm::storage::direct_io::AlignedBuf;
use kvshm::storage::redis::{RedisBackend, RedisOptions};
use kvshm::storage::spec::redact;
use kvshm::storage::BlockLayout;
use kvshm_ipc::name::SegmentName;
use serde::Serialize;

use super::target::{bench_hash, BackendTarget, Target, WorkerTarget};
use super::{filled, timed, Args, BLOCK_SIZES, MIB};

/// Blocks per pipeline of the Redis baseline (as many as one storage command carries).
const PIPELINE: usize = kvshm_ipc::storage_record::MAX_STORAGE_ENTRIES;

#[derive(Debug, Serialize)]
pub(super) struct RedisReport {
    url: String,
    rows: Vec<RedisRow>,
}

impl RedisReport {
    pub(super) fn print_table(&self) {
        println!("redis at {}", self.url);
        for row in &self.rows {
            println!(
                "{:<8} {:>9} put {:.2} GB/s {:.3} ms/block (SET {:.2} GB/s {:.3} ms) get {:.2} GB/s {:.3} ms/block (MGET {:.2} GB/s {:.3} ms)",
                row.path,
                row.block_bytes,
                row.put_gbps,
                row.put_ms_per_block,
                row.baseline_set_gbps,
                row.baseline_set_ms_per_block,
                row.get_gbps,
                row.get_ms_per_block,
                row.baseline_get_gbps,
                row.baseline_get_ms_per_block
            );
        }
    }
}

#[derive(Debug, Serialize)]
struct RedisRow {
    path: &'static str,
    block_bytes: usize,
    blocks: usize,
    put_gbps: f64,
    get_gbps: f64,
    put_ms_per_block: f64,
    get_ms_per_block: f64,
    baseline_set_gbps: f64,
    baseline_get_gbps: f64,
    baseline_set_ms_per_block: f64,
    baseline_get_ms_per_block: f64,
    put_over_baseline: f64,
    get_over_baseline: f64,
}

pub(super) fn redis_report(args: &Args, url: &str, salt: u64) -> anyhow::Result<RedisReport> {
    let mut rows = Vec::new();
    for block in BLOCK_SIZES {
        let blocks = (args.redis_mib * MIB / block).max(1);
        let mut host = filled(blocks * block, block as u64 ^ 0xabc);
        for path in ["backend", "worker"] {
            let (set, get) = redis_baseline(url, &host, block, salt)?;
            let namespace = format!("bench-{}-{path}", std::process::id());
            let layout = BlockLayout::new(block as u64, 2, 1).expect("an even block size");
            let options = RedisOptions {
                url: url.to_owned(),
                namespace: namespace.clone(),
                rank: 0,
                layout,
                ttl: None,
                connections: kvshm::storage::spec::DEFAULT_CONNECTIONS,
                io_timeout: Duration::from_secs(10),
                connect_timeout: Duration::from_secs(2),
            };
            let in_order: Vec<(u64, u32)> = (0..blocks as u64).map(|i| (i, i as u32)).collect();
            let (put, got) = match path {
                "backend" => {
                    let mut backend = RedisBackend::open(&options)?;
                    backend.connect_all().map_err(|failure| {
                        anyhow::anyhow!("redis at {}: {failure}", redact(url))
                    })?;
                    let mut target = BackendTarget {
                        backend: Box::new(backend),
                        host: &mut host,
                        block_bytes: block,
                        salt,
                    };
                    (
                        timed(|| target.store(&in_order), blocks, "redis put")?,
                        timed(|| target.load(&in_order), blocks, "redis get")?,
                    )
                }
                _ => {
                    let name = SegmentName::new(&format!(
                        "bench-storage-r{}-{block}",
                        std::process::id()
                    ))?;
                    let storage_args = vec![
                        "--storage".to_owned(),
                        url.to_owned(),
                        "--storage-namespace".to_owned(),
                        namespace.clone(),
                        "--storage-timeout".to_owned(),
                        "10".to_owned(),
                    ];
                    let log = std::env::temp_dir()
                        .join(format!("kvshm-bench-storage-{}.log", std::process::id()));
                    let started =
                        WorkerTarget::start(&name, block, blocks as u32, &storage_args, salt, &log);
                    let _ = std::fs::remove_file(&log);
                    let mut worker = started?;
                    worker.host_mut()[..host.len()].copy_from_slice(host.as_slice());
                    let times = (
                        timed(|| worker.store(&in_order), blocks, "redis put")?,
                        timed(|| worker.load(&in_order), blocks, "redis get")?,
                    );
                    worker.stop()?;
                    times
                }
            };
            // Remove what the tier stored.
            let mut cleaner = RedisBackend::open(&options)?;
            let hashes: Vec<_> = (0..blocks as u64).map(|tag| bench_hash(salt, tag)).collect();
            let mut outcomes = Vec::new();
            for chunk in hashes.chunks(1024) {
                kvshm::storage::StorageBackend::remove(&mut cleaner, chunk, &mut outcomes);
            }
            let bytes = (blocks * block) as f64;
            let per_block = |seconds: f64| seconds * 1e3 / blocks as f64;
            rows.push(RedisRow {
                path,
                block_bytes: block,
                blocks,
                put_gbps: bytes / put / 1e9,
                get_gbps: bytes / got / 1e9,
                put_ms_per_block: per_block(put),
                get_ms_per_block: per_block(got),
                baseline_set_gbps: bytes / set / 1e9,
                baseline_get_gbps: bytes / get / 1e9,
                baseline_set_ms_per_block: per_block(set),
                baseline_get_ms_per_block: per_block(get),
                put_over_baseline: set / put,
                get_over_baseline: get / got,
            });
        }
    }
    Ok(RedisReport { url: redact(url), rows })
}

/// Plain pipelined SETs (32 per pipeline) and MGETs (32 keys) of the blocks on one connection;
/// (set seconds, get seconds). The keys are removed afterwards.
fn redis_baseline(
    url: &str,
    host: &AlignedBuf,
    block: usize,
    salt: u64,
) -> anyhow::Result<(f64, f64)> {
    let client =
        ::redis::Client::open(url).with_context(|| format!("redis url {}", redact(url)))?;
    let mut connection = client
        .get_connection_with_timeout(Duration::from_secs(5))
        .with_context(|| format!("connecting to {}", redact(url)))?;
    let keys: Vec<String> =
        (0..host.len() / block).map(|i| format!("kvshm-bench-baseline:{salt:x}:{i}")).collect();
    let started = Instant::now();
    for (chunk_keys, chunk) in keys.chunks(PIPELINE).zip(host.as_slice().chunks(PIPELINE * block)) {
        let mut pipe = ::redis::pipe();
        for (key, bytes) in chunk_keys.iter().zip(chunk.chunks(block)) {
            pipe.cmd("SET").arg(key).arg(bytes).ignore();
        }
        pipe.query::<()>(&mut connection)?;
    }
    let set = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let mut read = 0usize;
    for chunk_keys in keys.chunks(PIPELINE) {
        let values: Vec<Vec<u8>> = ::redis::cmd("MGET").arg(chunk_keys).query(&mut connection)?;
        read += values.iter().map(Vec::len).sum::<usize>();
    }
    let get = started.elapsed().as_secs_f64();
    anyhow::ensure!(read == host.len(), "the baseline read {read} of {} bytes", host.len());
    for chunk_keys in keys.chunks(1024) {
        ::redis::cmd("UNLINK").arg(chunk_keys).query::<i64>(&mut connection)?;
    }
    Ok((set.max(1e-9), get.max(1e-9)))
}
