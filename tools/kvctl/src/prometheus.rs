//! `kvctl stat --prometheus`: a segment's figures in the Prometheus text exposition format.
//!
//! Every live counter becomes `kvshm_<name>` with a `# HELP` and a `# TYPE` line; monotonic
//! counters (`!Counter::is_gauge`) are typed `counter` and get the `_total` suffix, gauges keep
//! their name. Every sample carries `segment="NAME"`. Three derived series follow: whether the
//! scheduler polls, the age of its last poll, and an info series with the configuration as labels.
//!
//! Flow: 1. `stat` reads a [`StatReport`]; 2. [`write()`] prints one family per series.

use std::io::{self, Write};

use kvshm_ipc::counters::Counter;

use crate::stat::StatReport;

/// The metric name of `counter`.
pub fn metric_name(counter: Counter) -> String {
    let name = counter.name();
    if counter.is_gauge() || name.ends_with("_total") {
        format!("kvshm_{name}")
    } else {
        format!("kvshm_{name}_total")
    }
}

/// The `# HELP` text of `counter`.
pub fn help(counter: Counter) -> String {
    let text = match counter {
        Counter::DeviceBlocksTotal => "Blocks of the device tier.",
        Counter::DeviceBlocksFree => "Free blocks of the device tier.",
        Counter::HostBlocksTotal => "Blocks of the host tier.",
        Counter::HostBlocksFree => "Free blocks of the host tier.",
        Counter::CachedNodes => "Blocks cached in the prefix tree.",
        Counter::DeviceHitBlocks => "Queried blocks that hit on device.",
        Counter::HostHitBlocks => "Queried blocks that hit on host.",
        Counter::MissBlocks => "Queried blocks that missed.",
        Counter::HitTokens => "Tokens covered by hits.",
        Counter::Lookups => "Prefix matches served.",
        Counter::RequestsLive => "Requests holding blocks.",
        Counter::Evictions => "Blocks evicted from a tier.",
        Counter::SwapsIn => "Blocks copied host to device.",
        Counter::SwapsOut => "Blocks copied device to host.",
        Counter::Backups => "Blocks backed up to host while staying on device.",
        Counter::CopyFailures => "Copies that failed and were rolled back.",
        Counter::CommandsIssued => "Commands pushed to worker rings.",
        Counter::CommandsCompleted => "Commands completed by workers.",
        Counter::CommandsInFlight => "Commands in worker rings now.",
        Counter::BytesCopied => "Bytes copied by workers for successful transfers.",
        Counter::Generation => "Cache generation, bumped by every reset.",
        Counter::Resets => "Cache resets carried out.",
        Counter::WorkerDeaths => "Workers found dead.",
        Counter::DroppedNodes => "Cached blocks dropped without a copy.",
        Counter::LastPollNs => "CLOCK_MONOTONIC nanoseconds of the scheduler's last poll.",
        Counter::WorkerCopyBytes => "Bytes the workers copied, all ranks together.",
        Counter::WorkerCopyNs => "Nanoseconds the workers spent copying, all ranks together.",
        Counter::StorageStoredBlocks => {
            "Blocks the workers stored in the storage tier (including ones it held already)."
        }
        Counter::StorageStoreFailures => "Blocks a storage write could not store.",
        Counter::StorageLoadHits => "Blocks read back from the storage tier and verified.",
        Counter::StorageLoadMisses => "Blocks a storage load did not find.",
        Counter::StorageCorruptBlocks => {
            "Stored blocks that failed their checksum (read as misses)."
        }
        Counter::StorageQueryBlocks => "Blocks asked about by storage queries.",
        Counter::StorageErrors => "Storage I/O or protocol errors.",
        Counter::StorageTimeouts => "Storage operations that timed out.",
        Counter::StorageUnavailable => "Blocks that missed because storage was unreachable.",
        Counter::StorageNoSpace => "Blocks not stored because storage is full.",
        Counter::StorageBytesWritten => {
            "Block bytes stored in the storage tier (including blocks it held already)."
        }
        Counter::StorageBytesRead => "Block bytes read back from the storage tier.",
        Counter::StorageEvictions => "Records the storage back-ends dropped to make room.",
        Counter::StorageIoNs => "Nanoseconds the workers spent in storage I/O.",
        Counter::StorageBlocksTotal => "Blocks per rank the storage tier can hold (0: none).",
        Counter::StorageBlocksUsed => "Blocks the scheduler counts on the storage tier.",
        Counter::StorageHitBlocks => "Queried blocks that hit on the storage tier.",
        Counter::StorageForgottenBlocks => {
            "Blocks the scheduler dropped and told the storage back-ends to forget."
        }
        Counter::Prefetches => "Prefetch calls that started storage loads or queries.",
        Counter::PrefetchLoadBlocks => "Blocks prefetches loaded from storage into host blocks.",
        Counter::PrefetchFoundBlocks => "Blocks prefetches found on a shared tier and adopted.",
        Counter::PrefetchFailedBlocks => "Blocks whose prefetch load failed.",
        Counter::PrefetchQueryBlocks => "Blocks prefetches asked the storage tier about.",
        Counter::ExpiredOrphans => {
            "Stored blocks given up because their parent never came back to the cache."
        }
        Counter::StorageForgetFailures => "Storage forget commands that failed on some rank.",
        Counter::StorageForgetsDropped => {
            "Blocks whose storage forget was given up (a disk tier keeps them)."
        }
        Counter::StorageSharedTier => {
            "1 when the storage tier is shared with other services (prefetch asks it)."
        }
        Counter::LoadMissingBlocks => {
            "Blocks a storage LOAD found missing or damaged (no hit from then on)."
        }
        Counter::LostBlocksDropped => "Blocks dropped because the storage tier lost them.",
        Counter::ShortenedTickets => {
            "Tickets whose hit a storage miss shortened (the request computes the rest)."
        }
        Counter::WriteThroughSkipped => {
            "Write-through stores skipped for lack of free storage room."
        }
        Counter::StorageTierDown => {
            "1 while the storage tier is down (no work goes to it until a probe reaches it)."
        }
        Counter::StorageTierDownSinceNs => {
            "CLOCK_MONOTONIC ns when the storage tier's current outage began (0 while up)."
        }
        Counter::StorageTierOutages => "Times the storage tier was marked down.",
        Counter::StorageTierProbes => "Probes sent to the storage tier while it was down.",
        Counter::StorageTierProbesFailed => {
            "Probes that did not reach the storage tier on every rank."
        }
        Counter::StorageDownSkippedBlocks => {
            "Blocks dropped or not written through because the storage tier was down."
        }
    };
    text.to_owned()
}

/// Escapes a label value (backslash, double quote, newline).
pub fn escape_label(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn family(
    out: &mut dyn Write,
    name: &str,
    kind: &str,
    help: &str,
    labels: &str,
    value: impl std::fmt::Display,
) -> io::Result<()> {
    writeln!(out, "# HELP {name} {}", help.replace('\\', "\\\\").replace('\n', "\\n"))?;
    writeln!(out, "# TYPE {name} {kind}")?;
    writeln!(out, "{name}{{{labels}}} {value}")
}

/// Writes `report` in the text exposition format.
pub fn write(report: &StatReport, out: &mut dyn Write) -> io::Result<()> {
    let segment = format!("segment=\"{}\"", escape_label(&report.segment));
    for &(counter, value) in &report.counters.0 {
        let kind = if counter.is_gauge() { "gauge" } else { "counter" };
        family(out, &metric_name(counter), kind, &help(counter), &segment, value)?;
    }
    let scheduler = &report.scheduler;
    family(
        out,
        "kvshm_scheduler_polling",
        "gauge",
        "1 if the scheduler polled within the last second.",
        &segment,
        u8::from(scheduler.polling),
    )?;
    if let Some(age) = scheduler.last_poll_age_seconds {
        family(
            out,
            "kvshm_scheduler_last_poll_age_seconds",
            "gauge",
            "Seconds since the scheduler's last poll.",
            &segment,
            age,
        )?;
    }
    let config = &report.config;
    let policy = config
        .write_policy
        .as_deref()
        .map_or_else(String::new, |policy| format!(",write_policy=\"{}\"", escape_label(policy)));
    let info = format!(
        "{segment},kind=\"{}\",backend=\"{}\"{policy},tp_size=\"{}\",block_tokens=\"{}\"",
        escape_label(&config.kind),
        escape_label(&config.backend),
        config.tp_size,
        config.block_tokens
    );
    family(out, "kvshm_segment_info", "gauge", "Segment configuration as labels.", &info, 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_get_the_total_suffix_and_gauges_do_not() {
        assert_eq!(metric_name(Counter::Lookups), "kvshm_lookups_total");
        assert_eq!(metric_name(Counter::DeviceBlocksFree), "kvshm_device_blocks_free");
        assert_eq!(metric_name(Counter::DeviceBlocksTotal), "kvshm_device_blocks_total");
    }

    #[test]
    fn every_counter_has_a_help_line() {
        for counter in Counter::ALL {
            assert!(help(counter).ends_with('.'), "{counter:?}");
        }
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
