//! `kvctl stat`: a segment's configuration, whether its scheduler polls, its live counters and the
//! hit rates derived from them.
//!
//! Everything is read from the segment without asking the scheduler: the header (configuration,
//! creator, generation) and the counters it stores on every poll. Whether the scheduler is polling
//! is judged from `Counter::LastPollNs` (`CLOCK_MONOTONIC`, comparable across processes): a last
//! poll within [`POLLING_WINDOW`] counts as polling.
//!
//! Flow: 1. attach ([`crate::open`]); 2. [`StatReport::read`] copies the header fields and one
//! snapshot of the counters; 3. the report is written as text, JSON or Prometheus exposition.

use std::io::{self, Write};
use std::time::Duration;

use kvshm_ipc::config::{SegmentConfig, WritePolicy};
use kvshm_ipc::counters::Counter;
use kvshm_ipc::liveness::monotonic_ns;
use kvshm_ipc::segment::Segment;
use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};

use crate::text;

/// A scheduler whose last poll is at most this old counts as polling.
pub const POLLING_WINDOW: Duration = Duration::from_secs(1);

/// The configuration stored in the segment header, decoded.
#[derive(Debug, Clone, Serialize)]
pub struct ConfigReport {
    pub block_tokens: u32,
    pub tp_size: u32,
    pub device_blocks: u32,
    pub host_blocks: u32,
    /// Whose arenas hold the host tier: `own` (the segment's) or `shared` (a shared tier's).
    pub host_tier: String,
    pub regions: u32,
    pub layers: u32,
    pub region_bytes: u64,
    /// `regions * region_bytes`: one block on one rank.
    pub block_bytes: u64,
    /// Whose segment it is: `scheduler` (a kvshm scheduler decides evictions and write-backs)
    /// or `engine_host_tier` (an engine keeps its own cache and decides what to store).
    pub kind: String,
    /// The scheduler's write policy; `None` for an engine's host tier, where nothing applies one.
    pub write_policy: Option<String>,
    /// The hit count at which `write_through_selective` backs a node up.
    pub write_threshold: Option<u32>,
    pub backend: String,
    pub command_ring_slots: u32,
    pub completion_ring_slots: u32,
}

impl ConfigReport {
    pub fn new(config: &SegmentConfig) -> ConfigReport {
        // The header validated on attach, so the codes decode; still, never panic on them.
        let write_policy = config.write_policy();
        let engine_host_tier = config.kind == SegmentConfig::KIND_ENGINE_HOST_TIER;
        ConfigReport {
            block_tokens: config.block_tokens,
            tp_size: config.tp_size,
            device_blocks: config.device_blocks,
            host_blocks: config.host_blocks,
            host_tier: match config.host_tier {
                SegmentConfig::HOST_TIER_OWN => "own".to_owned(),
                SegmentConfig::HOST_TIER_SHARED => "shared".to_owned(),
                code => format!("unknown({code})"),
            },
            regions: config.regions,
            layers: config.layers,
            region_bytes: config.region_bytes,
            block_bytes: config.block_bytes(),
            kind: match config.kind {
                SegmentConfig::KIND_SCHEDULER => "scheduler".to_owned(),
                SegmentConfig::KIND_ENGINE_HOST_TIER => "engine_host_tier".to_owned(),
                code => format!("unknown({code})"),
            },
            write_policy: (!engine_host_tier).then(|| {
                write_policy.as_ref().map_or_else(
                    |_| format!("unknown({})", config.write_policy),
                    |policy| policy.name().to_owned(),
                )
            }),
            write_threshold: match write_policy {
                Ok(WritePolicy::WriteThroughSelective { threshold }) if !engine_host_tier => {
                    Some(threshold)
                }
                _ => None,
            },
            // `in_process` for an engine's tier whose engine copies itself (vLLM with CPU tensors).
            backend: config.copy_engine_name().map_or_else(
                |_| format!("unknown({}, copies {})", config.backend, config.copies),
                str::to_owned,
            ),
            command_ring_slots: config.command_ring_slots,
            completion_ring_slots: config.completion_ring_slots,
        }
    }
}

/// Whether the scheduler serves kvctl's requests.
#[derive(Debug, Clone, Serialize)]
pub struct SchedulerReport {
    /// Its last poll is at most [`POLLING_WINDOW`] old.
    pub polling: bool,
    /// Seconds since its last poll; `None` if it never polled.
    pub last_poll_age_seconds: Option<f64>,
}

impl SchedulerReport {
    /// Judges the `Counter::LastPollNs` value `last_poll_ns` at `now_ns`.
    pub fn judge(last_poll_ns: u64, now_ns: u64) -> SchedulerReport {
        if last_poll_ns == 0 {
            return SchedulerReport { polling: false, last_poll_age_seconds: None };
        }
        let age = Duration::from_nanos(now_ns.saturating_sub(last_poll_ns));
        SchedulerReport {
            polling: age <= POLLING_WINDOW,
            last_poll_age_seconds: Some(age.as_secs_f64()),
        }
    }

    /// How long ago the scheduler last polled, if ever.
    pub fn last_poll_age(&self) -> Option<Duration> {
        self.last_poll_age_seconds.map(Duration::from_secs_f64)
    }

    /// `polling (last poll 3.1 ms ago)`, `not polling (last poll 2.0 min ago)`, `never polled`.
    pub fn describe(&self) -> String {
        match self.last_poll_age() {
            None => "never polled".to_owned(),
            Some(age) => {
                let verdict = if self.polling { "polling" } else { "not polling" };
                format!("{verdict} (last poll {} ago)", text::age(age))
            }
        }
    }
}

/// Hit rates over the blocks the scheduler was asked about (device hits, host hits, misses).
#[derive(Debug, Clone, Serialize)]
pub struct HitRates {
    pub queried_blocks: u64,
    pub device: Option<f64>,
    pub host: Option<f64>,
    pub storage: Option<f64>,
    pub total: Option<f64>,
}

impl HitRates {
    pub fn from_counts(
        device_hits: u64,
        host_hits: u64,
        storage_hits: u64,
        misses: u64,
    ) -> HitRates {
        let hits = device_hits.saturating_add(host_hits).saturating_add(storage_hits);
        let queried = hits.saturating_add(misses);
        let rate = |hits: u64| (queried > 0).then(|| hits as f64 / queried as f64);
        HitRates {
            queried_blocks: queried,
            device: rate(device_hits),
            host: rate(host_hits),
            storage: rate(storage_hits),
            total: rate(hits),
        }
    }
}

/// What the workers copied, summed over ranks, and the rate while copying.
#[derive(Debug, Clone, Serialize)]
pub struct CopyRate {
    pub bytes: u64,
    pub seconds: f64,
    /// Bytes per second of copying time; `None` before the first copy.
    pub bytes_per_second: Option<f64>,
}

impl CopyRate {
    pub fn from_counts(bytes: u64, nanoseconds: u64) -> CopyRate {
        let seconds = Duration::from_nanos(nanoseconds).as_secs_f64();
        CopyRate {
            bytes,
            seconds,
            bytes_per_second: (nanoseconds > 0).then(|| bytes as f64 / seconds),
        }
    }
}

/// The live counters in slot order; serialized as one JSON object `{name: value}`.
#[derive(Debug, Clone)]
pub struct CounterValues(pub Vec<(Counter, u64)>);

impl CounterValues {
    pub fn get(&self, counter: Counter) -> u64 {
        self.0.iter().find(|(c, _)| *c == counter).map_or(0, |(_, value)| *value)
    }
}

impl Serialize for CounterValues {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (counter, value) in &self.0 {
            map.serialize_entry(counter.name(), value)?;
        }
        map.end()
    }
}

/// The storage tier's health: up, or down since when (the scheduler stops routing work to a tier
/// that failed until a probe reaches it again).
#[derive(Debug, Clone, Serialize)]
pub struct TierReport {
    pub down: bool,
    /// How long the current outage has lasted (`None` while up).
    pub down_for_seconds: Option<f64>,
    pub outages: u64,
    pub probes: u64,
    pub probes_failed: u64,
    /// Blocks dropped or not written through because the tier was down.
    pub skipped_blocks: u64,
}

impl TierReport {
    /// The tier's state from `counters` at `now_ns` (`CLOCK_MONOTONIC`); `None` without a tier.
    pub fn from_counters(counters: &CounterValues, now_ns: u64) -> Option<TierReport> {
        if counters.get(Counter::StorageBlocksTotal) == 0 {
            return None;
        }
        let down = counters.get(Counter::StorageTierDown) != 0;
        let since = counters.get(Counter::StorageTierDownSinceNs);
        let down_for_seconds = (down && since != 0)
            .then(|| Duration::from_nanos(now_ns.saturating_sub(since)).as_secs_f64());
        Some(TierReport {
            down,
            down_for_seconds,
            outages: counters.get(Counter::StorageTierOutages),
            probes: counters.get(Counter::StorageTierProbes),
            probes_failed: counters.get(Counter::StorageTierProbesFailed),
            skipped_blocks: counters.get(Counter::StorageDownSkippedBlocks),
        })
    }

    /// "up" or "DOWN for 3.2 s", then the outages and probes.
    pub fn describe(&self) -> String {
        let state = match (self.down, self.down_for_seconds) {
            (false, _) => "up".to_owned(),
            (true, Some(seconds)) => {
                format!("DOWN for {}", text::age(Duration::from_secs_f64(seconds)))
            }
            (true, None) => "DOWN".to_owned(),
        };
        format!(
            "{state}; {} outages, {} probes ({} failed), {} blocks dropped or not written \
             while down",
            self.outages, self.probes, self.probes_failed, self.skipped_blocks
        )
    }
}

/// The result of `kvctl stat`.
#[derive(Debug, Clone, Serialize)]
pub struct StatReport {
    pub segment: String,
    pub generation: u64,
    pub creator_pid: u32,
    /// Bytes of the control object.
    pub size_bytes: u64,
    pub config: ConfigReport,
    pub scheduler: SchedulerReport,
    pub counters: CounterValues,
    pub hit_rate: HitRates,
    pub worker_copy: CopyRate,
    /// The storage tier's health (absent without a tier).
    pub storage_tier: Option<TierReport>,
}

impl StatReport {
    /// Reads everything from `segment` at one moment (each counter atomically, not as a set).
    pub fn read(segment: &Segment) -> StatReport {
        let counters = CounterValues(segment.counters().snapshot());
        let now_ns = monotonic_ns();
        let scheduler = SchedulerReport::judge(counters.get(Counter::LastPollNs), now_ns);
        let storage_tier = TierReport::from_counters(&counters, now_ns);
        let hit_rate = HitRates::from_counts(
            counters.get(Counter::DeviceHitBlocks),
            counters.get(Counter::HostHitBlocks),
            counters.get(Counter::StorageHitBlocks),
            counters.get(Counter::MissBlocks),
        );
        let worker_copy = CopyRate::from_counts(
            counters.get(Counter::WorkerCopyBytes),
            counters.get(Counter::WorkerCopyNs),
        );
        StatReport {
            segment: segment.name().to_string(),
            generation: segment.generation(),
            creator_pid: segment.creator().pid,
            size_bytes: segment.size() as u64,
            config: ConfigReport::new(segment.config()),
            scheduler,
            counters,
            hit_rate,
            worker_copy,
            storage_tier,
        }
    }

    pub fn write_text(&self, out: &mut dyn Write) -> io::Result<()> {
        let config = &self.config;
        writeln!(
            out,
            "segment    {} ({}, generation {}, creator pid {})",
            self.segment,
            text::bytes(self.size_bytes),
            self.generation,
            self.creator_pid
        )?;
        // An engine's host tier is polled by the engine's process, and the engine decides what
        // is stored: no write policy applies.
        let (poller, policy) = match (&config.write_policy, config.write_threshold) {
            (None, _) => ("engine    ", "stores decided by the engine".to_owned()),
            (Some(policy), Some(threshold)) => {
                ("scheduler ", format!("{policy} (threshold {threshold})"))
            }
            (Some(policy), None) => ("scheduler ", policy.clone()),
        };
        writeln!(out, "{poller} {}", self.scheduler.describe())?;
        writeln!(
            out,
            "config     {} tokens per block, tp {}, backend {}, {policy}",
            config.block_tokens, config.tp_size, config.backend
        )?;
        writeln!(
            out,
            "           {} regions ({} layers) x {} = {} per block per rank",
            config.regions,
            config.layers,
            text::bytes(config.region_bytes),
            text::bytes(config.block_bytes)
        )?;
        writeln!(
            out,
            "           device {} blocks, host {} blocks, rings {} command slots / {} completions",
            config.device_blocks,
            config.host_blocks,
            config.command_ring_slots,
            config.completion_ring_slots
        )?;
        let rates = &self.hit_rate;
        writeln!(
            out,
            "hit rate   {} of {} queried blocks (device {}, host {}, storage {})",
            text::percent(rates.total),
            rates.queried_blocks,
            text::percent(rates.device),
            text::percent(rates.host),
            text::percent(rates.storage)
        )?;
        let storage_total = self.counters.get(Counter::StorageBlocksTotal);
        if storage_total > 0 {
            let value = |counter| self.counters.get(counter);
            writeln!(
                out,
                "storage    {} of {} blocks used; {} stored, {} loaded, {} missed, {} corrupt; \
                 {} written, {} read; {} errors, {} timeouts, {} unavailable, {} no space",
                value(Counter::StorageBlocksUsed),
                storage_total,
                value(Counter::StorageStoredBlocks),
                value(Counter::StorageLoadHits),
                value(Counter::StorageLoadMisses),
                value(Counter::StorageCorruptBlocks),
                text::bytes(value(Counter::StorageBytesWritten)),
                text::bytes(value(Counter::StorageBytesRead)),
                value(Counter::StorageErrors),
                value(Counter::StorageTimeouts),
                value(Counter::StorageUnavailable),
                value(Counter::StorageNoSpace)
            )?;
            writeln!(
                out,
                "prefetch   {} prefetches; {} blocks loaded, {} asked about, {} found on a shared \
                 tier, {} failed; {} blocks forgotten, {} forget failures, {} forgets given up, \
                 {} orphans expired",
                value(Counter::Prefetches),
                value(Counter::PrefetchLoadBlocks),
                value(Counter::PrefetchQueryBlocks),
                value(Counter::PrefetchFoundBlocks),
                value(Counter::PrefetchFailedBlocks),
                value(Counter::StorageForgottenBlocks),
                value(Counter::StorageForgetFailures),
                value(Counter::StorageForgetsDropped),
                value(Counter::ExpiredOrphans)
            )?;
            writeln!(
                out,
                "misses     {} blocks missing on the tier, {} lost blocks dropped, {} hits \
                 shortened; {} write-throughs skipped for room",
                value(Counter::LoadMissingBlocks),
                value(Counter::LostBlocksDropped),
                value(Counter::ShortenedTickets),
                value(Counter::WriteThroughSkipped)
            )?;
            if let Some(tier) = &self.storage_tier {
                writeln!(out, "tier       {}", tier.describe())?;
            }
        }
        let copy = &self.worker_copy;
        let copy_rate = copy.bytes_per_second.map_or_else(
            || "no copies yet".to_owned(),
            |rate| format!("{}/s while copying", text::bytes(rate as u64)),
        );
        writeln!(
            out,
            "copies     {} in {} ({copy_rate})",
            text::bytes(copy.bytes),
            text::age(Duration::from_secs_f64(copy.seconds))
        )?;
        writeln!(out, "counters")?;
        let width = self.counters.0.iter().map(|(c, _)| c.name().len()).max().unwrap_or(0);
        for (counter, value) in &self.counters.0 {
            writeln!(out, "  {:width$}  {value}", counter.name())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recent_poll_is_polling_and_an_old_one_is_not() {
        let now = 100_000_000_000;
        assert!(SchedulerReport::judge(now - 1_000_000, now).polling);
        let old = SchedulerReport::judge(now - 5_000_000_000, now);
        assert!(!old.polling);
        assert_eq!(old.last_poll_age(), Some(Duration::from_secs(5)));
        assert!(old.describe().starts_with("not polling"));
        let never = SchedulerReport::judge(0, now);
        assert!(!never.polling && never.last_poll_age_seconds.is_none());
    }

    #[test]
    fn the_storage_tier_line_says_up_or_how_long_it_has_been_down() {
        let counters = |values: &[(Counter, u64)]| CounterValues(values.to_vec());
        assert!(TierReport::from_counters(&counters(&[]), 0).is_none(), "no tier, no line");
        let now = 100_000_000_000;
        let down = counters(&[
            (Counter::StorageBlocksTotal, 64),
            (Counter::StorageTierDown, 1),
            (Counter::StorageTierDownSinceNs, now - 12_500_000_000),
            (Counter::StorageTierOutages, 2),
            (Counter::StorageTierProbes, 5),
            (Counter::StorageTierProbesFailed, 4),
            (Counter::StorageDownSkippedBlocks, 7),
        ]);
        let report = TierReport::from_counters(&down, now).unwrap();
        assert_eq!(report.down_for_seconds, Some(12.5));
        assert_eq!(
            report.describe(),
            "DOWN for 12.5 s; 2 outages, 5 probes (4 failed), 7 blocks dropped or not written \
             while down"
        );
        let up = counters(&[(Counter::StorageBlocksTotal, 64), (Counter::StorageTierOutages, 2)]);
        let report = TierReport::from_counters(&up, now).unwrap();
        assert!(!report.down && report.down_for_seconds.is_none());
        assert!(report.describe().starts_with("up; 2 outages"), "{}", report.describe());
    }

    #[test]
    fn hit_rates_are_fractions_of_queried_blocks() {
        let rates = HitRates::from_counts(5, 2, 1, 2);
        assert_eq!(rates.queried_blocks, 10);
        assert_eq!(rates.total, Some(0.8));
        assert_eq!((rates.device, rates.storage), (Some(0.5), Some(0.1)));
        assert_eq!(HitRates::from_counts(0, 0, 0, 0).total, None);
    }

    #[test]
    fn the_copy_rate_is_bytes_over_copying_time() {
        let rate = CopyRate::from_counts(3 << 30, 1_500_000_000);
        assert_eq!(rate.bytes_per_second, Some(2.0 * (1u64 << 30) as f64));
        assert_eq!(CopyRate::from_counts(0, 0).bytes_per_second, None);
    }

    #[test]
    fn counters_serialize_as_an_object_in_slot_order() {
        let values = CounterValues(vec![(Counter::Lookups, 3), (Counter::CachedNodes, 5)]);
        let json = serde_json::to_string(&values).unwrap();
        assert_eq!(json, r#"{"lookups":3,"cached_nodes":5}"#);
    }
}
