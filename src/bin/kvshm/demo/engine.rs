//! The demo's engine: a stand-in that drives a [`Service`] with real bytes.
//!
//! The demo plays the engine of a tensor-parallel model: on the host backend its KV blocks live in
//! the service's device arenas; on the CUDA backend (feature `cuda`) in GPU buffers of its own
//! ([`DeviceKvBuffers`](kvshm::worker::cuda::DeviceKvBuffers)) that the workers open. It serves a
//! conversation trace two requests per engine step ([`DemoEngine::run_batch`]: both matched and
//! allocated before either waits, so that requests sharing a prefix share its storage LOADs).
//! For each request it:
//!
//! 1. matches the request's block hashes ([`Service::match_prefix`]);
//! 2. allocates blocks for the rest of the prompt and the output, and waits on the ticket (host
//!    hits arrive by copy from the host tier, through the worker processes);
//!    A hit the storage tier misses shortens the ticket's hit ([`TicketReady::Shortened`]): the
//!    blocks from the first miss on are computed in step 4 like new ones, into the block table
//!    that status carries (a request that shared a LOAD has blocks of its own there);
//! 3. checks the bytes of every hit block, on every rank and region, against
//!    [`pattern::verify`]: a hit must hold exactly what was written when the block was computed,
//!    whichever tiers it has travelled through since;
//! 4. "computes" the new full prompt blocks by writing [`pattern::fill`] bytes into them;
//! 5. commits the prompt's full blocks and finishes the request.
//!
//! Like an engine, it caches only full blocks, and the last-token rule of `match_prefix` leaves
//! at least the last prompt token to compute.
//!
//! [`DemoReport`] gathers hit rates per tier, swaps, copy bandwidth, ticket waits and the number
//! of corrupted blocks (which must be 0).

use std::time::{Duration, Instant};

use serde::Serialize;

use kvshm::cli::pattern::{self, RegionIdentity};
use kvshm::hash::BlockHash;
use kvshm::manager::{Allocation, RequestId};
use kvshm::percentiles::Percentiles;
use kvshm::service::{Service, TicketReady, WaitError};
use kvshm::trace::TraceRequest;

/// How long one ticket may take before the demo calls it a failure.
const TICKET_TIMEOUT: Duration = Duration::from_secs(30);

/// What one demo run measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DemoReport {
    pub requests: u64,
    /// Requests the cache could not hold at all (more blocks than the device tier).
    pub skipped_requests: u64,
    /// Requests whose ticket failed (a copy failed) and that were aborted.
    pub failed_requests: u64,
    /// Requests whose hit a storage miss shortened (served: they computed the missed blocks).
    pub shortened_requests: u64,
    /// Storage hits the tier missed (missing, damaged, or the tier down), computed instead.
    pub storage_missed_blocks: u64,
    pub blocks: u64,
    pub hit_blocks: u64,
    pub device_hit_blocks: u64,
    pub host_hit_blocks: u64,
    /// Hits on the storage tier: loaded into host blocks, then swapped in, then verified.
    pub storage_hit_blocks: u64,
    pub hit_rate_blocks: f64,
    pub device_hit_rate_blocks: f64,
    pub host_hit_rate_blocks: f64,
    pub storage_hit_rate_blocks: f64,
    /// Blocks written to the storage tier (STOREs landed) and read back (LOADs landed).
    pub storage_stores: u64,
    pub storage_loads: u64,
    /// Blocks whose bytes were checked (hits, on every rank and region).
    pub verified_blocks: u64,
    pub corrupted_blocks: u64,
    pub swap_in_blocks: u64,
    pub swap_out_blocks: u64,
    pub backup_blocks: u64,
    pub evictions: u64,
    pub bytes_copied: u64,
    /// Bytes copied by the workers per second of their copying (from the workers' own counters).
    pub copy_gb_per_s: f64,
    pub ticket_wait_us: Percentiles,
    /// Ticket waits of requests that had host hits (and so waited on a swap-in).
    pub swap_in_wait_us: Percentiles,
    pub elapsed_s: f64,
}

/// A request matched and allocated in an engine step, waiting to be served.
struct Scheduled {
    id: u64,
    hashes: Vec<BlockHash>,
    /// The block table `allocate` returned (a shortened ticket brings the current one).
    table: Vec<u32>,
    ticket: kvshm::manager::TicketId,
    /// The match's (device, host, storage) hits.
    hits: (usize, usize, usize),
}

/// The engine stand-in.
pub struct DemoEngine<'a> {
    service: &'a mut Service,
    /// The ranks' KV buffers on a GPU; `None`: the service's device arenas.
    #[cfg(feature = "cuda")]
    gpu: Option<&'a [kvshm::worker::cuda::DeviceKvBuffers]>,
    report: DemoReport,
    waits: Vec<Duration>,
    swap_in_waits: Vec<Duration>,
    region: Vec<u8>,
    next_request: u64,
}

/// Why the demo stopped.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("request {request}: {source}")]
    Cache { request: u64, source: Box<dyn std::error::Error + Send + Sync> },
    #[error("request {request}: block access: {source}")]
    Memory { request: u64, source: kvshm::service::BlockAccessError },
    #[error("the service has no block memory for rank {0} (the demo needs the host backend)")]
    NoMemory(u32),
    #[cfg(feature = "cuda")]
    #[error("request {request}: GPU block access: {source}")]
    Gpu { request: u64, source: kvshm::worker::cuda::KvBufferError },
}

impl<'a> DemoEngine<'a> {
    pub fn new(service: &'a mut Service) -> DemoEngine<'a> {
        let region = vec![0; service.geometry().region_bytes() as usize];
        DemoEngine {
            service,
            #[cfg(feature = "cuda")]
            gpu: None,
            report: DemoReport::default(),
            waits: Vec::new(),
            swap_in_waits: Vec::new(),
            region,
            next_request: 1,
        }
    }

    /// An engine whose rank `r` keeps its blocks in `buffers[r]` (the segment's CUDA backend).
    #[cfg(feature = "cuda")]
    pub fn on_gpu(
        service: &'a mut Service,
        buffers: &'a [kvshm::worker::cuda::DeviceKvBuffers],
    ) -> DemoEngine<'a> {
        DemoEngine { gpu: Some(buffers), ..DemoEngine::new(service) }
    }

    /// Runs trace requests as one engine step, with data verification: every one is matched and
    /// allocated before any waits (requests sharing a prefix then share its storage LOADs, as in
    /// a batching engine), then each is served, the last one first. A request that finds no room
    /// while others of the step hold blocks is scheduled again once those are served.
    pub fn run_batch(&mut self, requests: &[TraceRequest]) -> Result<(), DemoError> {
        let mut step: Vec<Scheduled> = Vec::with_capacity(requests.len());
        for request in requests {
            let id = self.next_request;
            self.next_request += 1;
            let mut scheduled = self.schedule(id, request)?;
            if scheduled.is_none() && !step.is_empty() {
                while let Some(earlier) = step.pop() {
                    self.serve(earlier)?;
                }
                scheduled = self.schedule(id, request)?;
            }
            match scheduled {
                Some(scheduled) => step.push(scheduled),
                // Larger than what the device tier can free: an engine would reject or chunk it.
                None => {
                    let block_tokens = self.service.cache().config().block_tokens as usize;
                    self.report.requests += 1;
                    self.report.blocks += request.full_block_hashes(block_tokens).count() as u64;
                    self.report.skipped_requests += 1;
                }
            }
        }
        while let Some(scheduled) = step.pop() {
            self.serve(scheduled)?;
        }
        Ok(())
    }

    /// Steps 1 and 2 up to the wait: matches request `id` and allocates its blocks; `None` (its
    /// holds released) when the device tier cannot give them.
    fn schedule(
        &mut self,
        id: u64,
        request: &TraceRequest,
    ) -> Result<Option<Scheduled>, DemoError> {
        let cache_error = |source: Box<dyn std::error::Error + Send + Sync>| DemoError::Cache {
            request: id,
            source,
        };
        let block_tokens = self.service.cache().config().block_tokens as usize;
        // Engines cache only full blocks: a trailing partial block is computed, never cached.
        let hashes: Vec<BlockHash> = request.full_block_hashes(block_tokens).collect();
        let matched = self
            .service
            .match_prefix(RequestId(id), &hashes, request.input_length)
            .map_err(|error| cache_error(error.into()))?;
        let new_tokens = request.input_length - matched.cached_tokens + request.output_length;
        let owned =
            |allocation: Allocation<'_>| (allocation.block_table.to_vec(), allocation.ticket);
        let mut allocated = self.service.allocate(RequestId(id), new_tokens, 0).map(owned);
        if allocated.is_err() && self.service.wait_for_copies(TICKET_TIMEOUT) {
            // The blocks it would evict were being copied (backups, swap-outs); they have landed.
            allocated = self.service.allocate(RequestId(id), new_tokens, 0).map(owned);
        }
        let Ok((table, ticket)) = allocated else {
            self.service.abort(RequestId(id)).map_err(|error| cache_error(error.into()))?;
            return Ok(None);
        };
        self.report.requests += 1;
        self.report.blocks += hashes.len() as u64;
        Ok(Some(Scheduled {
            id,
            hashes,
            table,
            ticket,
            hits: (matched.device_blocks, matched.host_blocks, matched.storage_blocks),
        }))
    }

    /// Steps 2 (the wait) to 5 for a scheduled request.
    fn serve(&mut self, scheduled: Scheduled) -> Result<(), DemoError> {
        let Scheduled { id, hashes, mut table, ticket, hits } = scheduled;
        let cache_error = |source: Box<dyn std::error::Error + Send + Sync>| DemoError::Cache {
            request: id,
            source,
        };
        let (device_hits, host_hits, mut storage_hits) = hits;
        let mut hits = device_hits + host_hits + storage_hits;
        let waited = Instant::now();
        match self.service.wait(ticket, TICKET_TIMEOUT) {
            Ok(TicketReady::AllHits) => {}
            Ok(TicketReady::Shortened { cached_blocks, block_table }) => {
                // The storage tier missed some hits (a lost or damaged record, a tier that is
                // down): the blocks from there on are computed below, like any new block, into
                // the table as it is now (a request that shared the LOAD has new blocks there).
                table = block_table;
                let cached = (cached_blocks as usize).min(hits);
                self.report.shortened_requests += 1;
                self.report.storage_missed_blocks += (hits - cached) as u64;
                storage_hits -= (hits - cached).min(storage_hits);
                hits = cached;
            }
            Err(WaitError::TransferFailed(_)) => {
                self.service.abort(RequestId(id)).map_err(|error| cache_error(error.into()))?;
                self.report.failed_requests += 1;
                return Ok(());
            }
            Err(error) => return Err(cache_error(error.into())),
        }
        let waited = waited.elapsed();
        self.waits.push(waited);
        if host_hits + storage_hits > 0 {
            self.swap_in_waits.push(waited);
        }
        self.report.device_hit_blocks += device_hits as u64;
        self.report.host_hit_blocks += host_hits as u64;
        self.report.storage_hit_blocks += storage_hits as u64;
        self.report.hit_blocks += hits as u64;

        for (index, &block) in table.iter().enumerate().take(hits) {
            self.check_block(id, hashes[index], block)?;
        }
        for (index, &block) in table.iter().enumerate().take(hashes.len()).skip(hits) {
            self.write_block(id, hashes[index], block)?;
        }
        let block_tokens = self.service.cache().config().block_tokens as usize;
        let computed_tokens = hashes.len() * block_tokens;
        self.service
            .commit(RequestId(id), computed_tokens, &hashes)
            .map_err(|error| cache_error(error.into()))?;
        self.service.finish(RequestId(id)).map_err(|error| cache_error(error.into()))?;
        self.service.poll();
        Ok(())
    }

    fn ranks(&self) -> u32 {
        self.service.rank_states().len() as u32
    }

    fn check_block(&mut self, request: u64, hash: BlockHash, block: u32) -> Result<(), DemoError> {
        let mut intact = true;
        let mut bytes = std::mem::take(&mut self.region);
        for rank in 0..self.ranks() {
            for region in 0..self.service.geometry().regions() {
                self.read_region(request, rank, block, region, &mut bytes)?;
                let identity = RegionIdentity { block_hash: hash.0, region, rank };
                intact &= pattern::verify(identity, &bytes).is_ok();
            }
        }
        self.region = bytes;
        self.report.verified_blocks += 1;
        if !intact {
            self.report.corrupted_blocks += 1;
        }
        Ok(())
    }

    fn write_block(&mut self, request: u64, hash: BlockHash, block: u32) -> Result<(), DemoError> {
        let mut bytes = std::mem::take(&mut self.region);
        for rank in 0..self.ranks() {
            for region in 0..self.service.geometry().regions() {
                let identity = RegionIdentity { block_hash: hash.0, region, rank };
                pattern::fill(identity, &mut bytes);
                self.write_region(request, rank, block, region, &bytes)?;
            }
        }
        self.region = bytes;
        Ok(())
    }

    /// Reads region `region` of device block `block` of rank `rank`, wherever the blocks live.
    fn read_region(
        &self,
        request: u64,
        rank: u32,
        block: u32,
        region: u32,
        out: &mut [u8],
    ) -> Result<(), DemoError> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = self.gpu {
            return gpu[rank as usize]
                .read_region(block, region, out)
                .map_err(|source| DemoError::Gpu { request, source });
        }
        let memory = self.service.memory(rank).ok_or(DemoError::NoMemory(rank))?;
        memory
            .read_device_region(block, region, out)
            .map_err(|source| DemoError::Memory { request, source })
    }

    /// Writes region `region` of device block `block` of rank `rank`, wherever the blocks live.
    fn write_region(
        &self,
        request: u64,
        rank: u32,
        block: u32,
        region: u32,
        bytes: &[u8],
    ) -> Result<(), DemoError> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = self.gpu {
            return gpu[rank as usize]
                .write_region(block, region, bytes)
                .map_err(|source| DemoError::Gpu { request, source });
        }
        let memory = self.service.memory(rank).ok_or(DemoError::NoMemory(rank))?;
        memory
            .write_device_region(block, region, bytes)
            .map_err(|source| DemoError::Memory { request, source })
    }

    /// The figures so far; `elapsed` is the wall time of the run.
    pub fn report(&mut self, elapsed: Duration) -> DemoReport {
        let mut report = self.report.clone();
        let stats = self.service.cache().stats();
        let service = self.service.stats();
        let ratio =
            |part: u64, whole: u64| if whole == 0 { 0.0 } else { part as f64 / whole as f64 };
        report.hit_rate_blocks = ratio(report.hit_blocks, report.blocks);
        report.device_hit_rate_blocks = ratio(report.device_hit_blocks, report.blocks);
        report.host_hit_rate_blocks = ratio(report.host_hit_blocks, report.blocks);
        report.storage_hit_rate_blocks = ratio(report.storage_hit_blocks, report.blocks);
        report.storage_stores = stats.counters.stored_blocks;
        report.storage_loads = stats.counters.loaded_blocks;
        report.swap_in_blocks = stats.counters.swap_in_blocks;
        report.swap_out_blocks = stats.counters.swap_out_blocks;
        report.backup_blocks = stats.counters.backup_blocks;
        report.evictions = stats.counters.evictions.device_total();
        report.bytes_copied = service.bytes_copied;
        report.copy_gb_per_s = self.service.worker_copy_gb_per_s();
        report.ticket_wait_us = Percentiles::of_micros(&self.waits);
        report.swap_in_wait_us = Percentiles::of_micros(&self.swap_in_waits);
        report.elapsed_s = elapsed.as_secs_f64();
        report
    }
}
