"""The vLLM adapter's torch-free helpers: the byte span of a CUDA KV tensor's blocks, and the
warning of a copy wait that goes on."""

import logging

import pytest

import kvshm
from kvshm._vllm_support import (
    ACTIVITY_COUNTERS,
    USAGE_GAUGES,
    SlowWaitWarning,
    StatsReport,
    block_span,
)


def test_the_span_of_contiguous_blocks_ends_with_the_last_page_whatever_the_rank_of_the_tensor():
    # vLLM's canonical int8 tensors: (num_blocks, page_bytes).
    assert block_span((10, 4096), (4096, 1), 1, 4096) == (40960, 4096)
    # A 5-D bf16 tensor (blocks, 2, block_size, heads, head_dim): the old formula took
    # shape[1] * element_size (4 bytes) as the last block's length.
    shape, strides = (10, 2, 16, 8, 64), (2 * 16 * 8 * 64, 16 * 8 * 64, 8 * 64, 64, 1)
    page = 2 * 16 * 8 * 64 * 2
    assert block_span(shape, strides, 2, page) == (10 * page, page)


def test_blocks_with_padding_between_them_span_up_to_the_last_page_only():
    # Blocks of 1000 bytes, 1024 apart, in a (blocks, 1024) view.
    assert block_span((4, 1024), (1024, 1), 1, 1000) == (3 * 1024 + 1000, 1024)


def test_a_page_beyond_the_tensor_or_overlapping_blocks_are_refused():
    # Rows of 512 bytes, 1024 apart: a page of 1000 runs past the end of the last row.
    with pytest.raises(kvshm.ConfigError, match="spans"):
        block_span((4, 512), (1024, 1), 1, 1000)
    with pytest.raises(kvshm.ConfigError, match="overlap"):
        block_span((4, 512), (512, 1), 1, 1024)
    with pytest.raises(kvshm.ConfigError, match="no blocks"):
        block_span((0, 512), (512, 1), 1, 512)


def test_a_long_wait_warns_after_a_while_and_again_every_interval(caplog):
    now = [100.0]
    slow = SlowWaitWarning({7, 3}, spawned_worker=False, after_s=30.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="vllm.kvshm"):
        now[0] = 129.0
        assert not slow.check()
        now[0] = 131.0
        assert slow.check()
        now[0] = 140.0
        assert not slow.check()
        now[0] = 161.5
        assert slow.check()
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2
    assert "[3, 7]" in messages[0]
    assert "spawn_workers is false" in messages[0]
    assert "after 61 s" in messages[1] or "after 62 s" in messages[1]


def test_stats_reports_occupancy_as_fractions_and_counters_as_increases() -> None:
    report = StatsReport()
    stats = {
        "chunks": 8,
        "chunks_used": 4,
        "chunks_storing": 2,
        "chunks_loading": 1,
        "lookups": 10,
        "lookup_hits": 3,
        "keys_stored": 4,
        "keys_loaded": 0,
        "stores_refused": 0,
        "stores_failed": 0,
        "evictions": 0,
        "resets": 0,
    }
    gauges, counters = report.sample(stats)
    assert gauges == {
        "vllm:kv_offload_kvshm_cache_usage_perc": 0.5,
        "vllm:kv_offload_kvshm_cache_write_usage_perc": 0.25,
        "vllm:kv_offload_kvshm_cache_read_usage_perc": 0.125,
    }
    assert counters == {
        "vllm:kv_offload_kvshm_lookups": 10,
        "vllm:kv_offload_kvshm_lookup_hits": 3,
        "vllm:kv_offload_kvshm_keys_stored": 4,
    }
    # The next report carries only what happened since.
    _, counters = report.sample({**stats, "lookups": 15, "evictions": 2})
    assert counters == {"vllm:kv_offload_kvshm_lookups": 5, "vllm:kv_offload_kvshm_evictions": 2}
    _, counters = report.sample({**stats, "lookups": 15, "evictions": 2})
    assert counters == {}
    # A counter that went down (a rebuilt manager) reports its new value whole.
    _, counters = report.sample({**stats, "lookups": 1, "evictions": 2})
    assert counters == {"vllm:kv_offload_kvshm_lookups": 1}


def test_stats_of_an_empty_tier_are_zero_not_a_division_by_zero() -> None:
    gauges, _ = StatsReport().sample(
        {
            field: 0
            for field in (
                "chunks",
                "chunks_used",
                "chunks_storing",
                "chunks_loading",
                "lookups",
                "lookup_hits",
                "keys_stored",
                "keys_loaded",
                "stores_refused",
                "stores_failed",
                "evictions",
            )
        }
    )
    assert set(gauges.values()) == {0.0}


def test_the_stats_fields_reported_are_those_the_rust_manager_has() -> None:
    from kvshm._kvshm import OffloadManager

    stats = OffloadManager(4).stats()
    for _, field, _ in USAGE_GAUGES + ACTIVITY_COUNTERS:
        assert field in stats, field
