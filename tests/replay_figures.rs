//! The replay's hit figures on the whole Mooncake conversation trace, pinned.
//!
//! They are deterministic: any change to them is a change of the scheduler's behaviour. Speed
//! work must leave them alone; they are re-pinned only when the replay's rules or an eviction
//! policy change on purpose (say so in the commit).
//!
//! The prompt-only rows are vLLM's own figures: `benches/vllm_kv_manager.py` drives vLLM's
//! `KVCacheManager` over the same trace and gets 40,637 hit blocks with 5,859 blocks and 84,165
//! with 19,531, request for request what kvshm gets with one block fewer (vLLM keeps block 0 of
//! its pool as the null block, which never caches anything).

mod scheduler_support;

use kvshm::cli::replay::{replay, Replayed};
use kvshm::manager::{CacheConfig, WritePolicy};
use kvshm::trace::{read_trace, TraceRequest};

/// One pinned configuration and what its replay must report.
struct Pinned {
    device_blocks: u32,
    host_blocks: u32,
    write_policy: WritePolicy,
    prompt_only: bool,
    /// (device hit blocks, host hit blocks, device evictions, swaps in, swaps out, backups)
    figures: (u64, u64, u64, u64, u64, u64),
    /// FNV-1a of the per-request hit counts: the same totals spread differently still differ.
    hits_digest: u64,
}

fn digest(hits: &[u32]) -> u64 {
    hits.iter().flat_map(|hits| hits.to_le_bytes()).fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn check(trace: &[TraceRequest], pinned: &Pinned) {
    let config = CacheConfig::new(512, pinned.device_blocks)
        .with_host_blocks(pinned.host_blocks)
        .with_write_policy(pinned.write_policy);
    let Replayed { report, hits_per_request } =
        replay(trace, config, pinned.prompt_only).expect("the replay runs");
    let figures = (
        report.device_hit_blocks,
        report.host_hit_blocks,
        report.evictions,
        report.swaps_in,
        report.swaps_out,
        report.backups,
    );
    let name = format!(
        "{} device + {} host blocks, {}{}",
        pinned.device_blocks,
        pinned.host_blocks,
        pinned.write_policy,
        if pinned.prompt_only { ", prompt only" } else { "" }
    );
    assert_eq!((report.requests, report.failed_requests, report.blocks), (12_031, 0, 276_491));
    assert_eq!(figures, pinned.figures, "{name}");
    assert_eq!(digest(&hits_per_request), pinned.hits_digest, "{name}: hits per request");
}

fn whole_trace() -> Vec<TraceRequest> {
    read_trace(&scheduler_support::mooncake_trace(), None).expect("the trace reads")
}

#[test]
fn kvshm_with_one_block_fewer_hits_what_vllm_hits_request_for_request() {
    let trace = whole_trace();
    for (device_blocks, hits, evictions, hits_digest) in [
        (5_858, 40_637, 229_997, 16_809_977_033_611_674_972),
        (19_530, 84_165, 172_797, 9_658_833_704_926_943_832),
    ] {
        let figures = (hits, 0, evictions, 0, 0, 0);
        let pinned = Pinned {
            device_blocks,
            host_blocks: 0,
            write_policy: WritePolicy::WriteBack,
            prompt_only: true,
            figures,
            hits_digest,
        };
        check(&trace, &pinned);
    }
}

#[test]
fn device_only_figures_are_pinned() {
    let trace = whole_trace();
    for (device_blocks, hits, evictions, hits_digest) in [
        (1_953, 15_797, 258_743, 2_110_968_972_567_947_156),
        (5_859, 40_638, 229_996, 5_388_832_027_419_536_717),
        (19_531, 84_165, 172_797, 9_658_833_704_926_943_832),
    ] {
        let pinned = Pinned {
            device_blocks,
            host_blocks: 0,
            write_policy: WritePolicy::WriteBack,
            prompt_only: false,
            figures: (hits, 0, evictions, 0, 0, 0),
            hits_digest,
        };
        check(&trace, &pinned);
    }
}

#[test]
fn host_tier_figures_are_pinned() {
    let trace = whole_trace();
    let rows = [
        (
            WritePolicy::WriteBack,
            (15_797, 44_370, 258_743, 44_370, 214_716, 0),
            15_315_484_251_877_033_290,
        ),
        (
            WritePolicy::WriteThrough,
            (15_797, 36_509, 258_743, 36_509, 0, 224_146),
            7_526_422_689_449_002_489,
        ),
        (
            WritePolicy::WriteThroughSelective { threshold: 2 },
            (15_797, 6_160, 258_743, 6_160, 0, 2_519),
            13_599_487_626_179_770_670,
        ),
    ];
    for (write_policy, figures, hits_digest) in rows {
        let pinned = Pinned {
            device_blocks: 1_953,
            host_blocks: 7_812,
            write_policy,
            prompt_only: false,
            figures,
            hits_digest,
        };
        check(&trace, &pinned);
    }
}
