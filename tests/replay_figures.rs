//! The replay's hit figures on the whole Mooncake conversation trace, pinned.
//!
//! They are deterministic: any change to them is a change of the scheduler's behaviour. Speed
//! work must leave them alone; they are re-pinned only when the replay's rules or an eviction
//! policy change on purpose (say so in the commit).
//!
//! The eviction policies other than LRU are pinned too (`conv` at every configuration of the
//! README's table, the offline `optimal` at two), each replay checking the cache's invariants
//! every 2,000 requests and at its end.
//!
//! The prompt-only rows are vLLM's own figures: `benches/vllm_kv_manager.py` drives vLLM's
//! `KVCacheManager` over the same trace and gets 40,637 hit blocks with 5,859 blocks and 84,165
//! with 19,531, request for request what kvshm gets with one block fewer (vLLM keeps block 0 of
//! its pool as the null block, which never caches anything).

mod scheduler_support;

use kvshm::cli::replay::{future_uses, reference_lru, replay, Replayed, Replayer};
use kvshm::manager::{CacheConfig, EvictionPolicy, StorageWritePolicy, WritePolicy};
use kvshm::trace::{read_trace, TraceRequest};

/// (device hit blocks, host hit blocks, device evictions, swaps in, swaps out, backups)
type Figures = (u64, u64, u64, u64, u64, u64);

/// One pinned configuration and what its replay must report.
struct Pinned {
    device_blocks: u32,
    host_blocks: u32,
    write_policy: WritePolicy,
    prompt_only: bool,
    figures: Figures,
    /// FNV-1a of the per-request hit counts: the same totals spread differently still differ.
    hits_digest: u64,
}

fn digest(hits: &[u32]) -> u64 {
    hits.iter().flat_map(|hits| hits.to_le_bytes()).fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn check(trace: &[TraceRequest], pinned: &Pinned) {
    check_with(trace, pinned, EvictionPolicy::Lru);
}

/// Replays `trace` with `eviction` as [`kvshm::cli::replay::replay`] does, checking the cache's
/// invariants along the way, and compares the figures with `pinned`.
fn check_with(trace: &[TraceRequest], pinned: &Pinned, eviction: EvictionPolicy) {
    let config = CacheConfig::new(512, pinned.device_blocks)
        .with_host_blocks(pinned.host_blocks)
        .with_write_policy(pinned.write_policy)
        .with_eviction(eviction);
    let mut replayer = if eviction.is_offline() {
        Replayer::with_future(config, pinned.prompt_only, future_uses(trace, 512))
    } else {
        Replayer::new(config, pinned.prompt_only, trace.len())
    }
    .expect("the replayer starts");
    for (served, request) in trace.iter().enumerate() {
        replayer.serve(request).expect("the request is served");
        if served % 2_000 == 1_999 {
            replayer.cache().check_invariants().expect("invariants hold during the replay");
        }
    }
    replayer.cache().check_invariants().expect("invariants hold after the replay");
    let Replayed { report, hits_per_request } = replayer.finish();
    let figures = (
        report.device_hit_blocks,
        report.host_hit_blocks,
        report.evictions,
        report.swaps_in,
        report.swaps_out,
        report.backups,
    );
    let name = format!(
        "{eviction}: {} device + {} host blocks, {}{}",
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

/// Figures of `eviction` with no host tier and with a 4x host tier in write-back:
/// (device blocks, host blocks, figures, digest of the hits per request).
fn check_policy(eviction: EvictionPolicy, rows: &[(u32, u32, Figures, u64)]) {
    let trace = whole_trace();
    for &(device_blocks, host_blocks, figures, hits_digest) in rows {
        let pinned = Pinned {
            device_blocks,
            host_blocks,
            write_policy: WritePolicy::WriteBack,
            prompt_only: false,
            figures,
            hits_digest,
        };
        check_with(&trace, &pinned, eviction);
    }
}

#[test]
fn conv_figures_without_a_host_tier_are_pinned() {
    check_policy(
        EvictionPolicy::Conv,
        &[
            (1_953, 0, (29_414, 0, 245_126, 0, 0, 0), 13_933_926_614_897_214_001),
            (5_859, 0, (50_459, 0, 220_175, 0, 0, 0), 9_290_532_173_908_936_430),
            (19_531, 0, (87_117, 0, 169_845, 0, 0, 0), 17_528_207_272_709_769_970),
        ],
    );
}

#[test]
fn conv_figures_with_a_host_tier_are_pinned() {
    check_policy(
        EvictionPolicy::Conv,
        &[
            (
                1_953,
                7_812,
                (15_797, 49_514, 258_743, 49_514, 209_500, 0),
                13_897_925_620_570_292_718,
            ),
            (
                5_859,
                23_436,
                (40_638, 53_730, 229_996, 53_730, 177_774, 0),
                13_790_990_346_384_007_903,
            ),
            (
                19_531,
                78_124,
                (84_165, 20_624, 172_797, 20_624, 155_430, 0),
                11_190_222_274_385_041_858,
            ),
        ],
    );
}

#[test]
fn the_offline_optimum_figures_are_pinned() {
    check_policy(
        EvictionPolicy::Optimal,
        &[
            (5_859, 0, (101_336, 0, 169_298, 0, 0, 0), 6_601_225_716_967_819_289),
            (
                1_953,
                7_812,
                (71_128, 34_464, 203_412, 34_464, 169_446, 0),
                18_442_766_531_123_785_627,
            ),
        ],
    );
}

#[test]
fn three_tier_figures_are_pinned_and_come_within_0_02_of_a_plain_lru_of_the_combined_capacity() {
    let trace = whole_trace();
    let (device_blocks, host_blocks, storage_blocks) = (1_953, 7_812, 39_062);
    let reference = reference_lru(&trace, 512, device_blocks + host_blocks + storage_blocks);
    assert_eq!(reference.capacity_blocks, 48_827);
    assert_eq!((reference.hit_blocks, reference.hit_tokens), (102_377, 52_417_024));
    // (device, host, storage hit blocks, hit tokens, stores, loads, storage evictions), digest
    let rows = [
        (
            StorageWritePolicy::WriteBack,
            (15_797, 44_273, 42_307, 52_417_024, 207_001, 42_307, 125_632),
            7_211_302_105_817_691_002,
        ),
        (
            StorageWritePolicy::WriteThrough,
            (15_797, 44_273, 42_074, 52_297_728, 208_649, 42_074, 127_513),
            6_777_938_795_277_570_823,
        ),
    ];
    for (policy, figures, hits_digest) in rows {
        let config = CacheConfig::new(512, device_blocks as u32)
            .with_host_blocks(host_blocks as u32)
            .with_storage_blocks(storage_blocks as u32)
            .with_storage_write_policy(policy);
        let Replayed { report, hits_per_request } =
            replay(&trace, config, false).expect("the replay runs");
        assert_eq!((report.requests, report.failed_requests, report.blocks), (12_031, 0, 276_491));
        let actual = (
            report.device_hit_blocks,
            report.host_hit_blocks,
            report.storage_hit_blocks,
            report.hit_tokens,
            report.storage_stores,
            report.storage_loads,
            report.storage_evictions,
        );
        assert_eq!(actual, figures, "storage {policy}");
        assert_eq!(digest(&hits_per_request), hits_digest, "storage {policy}: hits per request");
        let gap = (report.hit_rate_tokens - reference.hit_rate_tokens).abs();
        assert!(
            gap < 0.02,
            "storage {policy}: {} against {}",
            report.hit_rate_tokens,
            reference.hit_rate_tokens
        );
    }
}
