"""vLLM's OffloadingSpecFactory loads kvshm's spec from the documented --kv-transfer-config."""

import dataclasses
import json

import pytest
from vllm.config import KVTransferConfig
from vllm.v1.kv_offload.base import (
    OffloadingManager,
    OffloadingSpec,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

import kvshm
import kvshm.vllm

# The README's `vllm serve ... --kv-transfer-config` value.
KV_TRANSFER_CONFIG = json.dumps(
    {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KvshmOffloadingSpec",
            "spec_module_path": "kvshm.vllm",
            "cpu_bytes_to_use": 64 * 1024 * 1024,
        },
    }
)


def test_the_factory_loads_kvshms_spec_from_the_kv_transfer_config(offloading_config) -> None:
    transfer = KVTransferConfig(**json.loads(KV_TRANSFER_CONFIG))
    assert transfer.kv_connector == "OffloadingConnector"
    extra = transfer.kv_connector_extra_config
    spec_class = OffloadingSpecFactory.get_spec_cls(extra)
    assert spec_class is kvshm.vllm.KvshmOffloadingSpec
    assert issubclass(spec_class, OffloadingSpec)
    spec = OffloadingSpecFactory.create_spec(offloading_config(extra))
    assert isinstance(spec, kvshm.vllm.KvshmOffloadingSpec)
    # 64 MiB over 2 ranks of 64 KiB per block: 512 chunks of one block.
    assert spec.num_chunks == 512
    assert spec.segment_prefix.startswith("kvshm-vllm-m-")
    assert spec.segment(1) == f"{spec.segment_prefix}-r1"
    manager = spec.get_manager()
    assert isinstance(manager, OffloadingManager)
    assert manager is spec.get_manager()
    assert manager.rust.stats()["chunks"] == 512


def test_a_spec_without_a_host_tier_size_is_refused_with_a_message(offloading_config) -> None:
    extra = {"spec_name": "KvshmOffloadingSpec", "spec_module_path": "kvshm.vllm"}
    with pytest.raises(kvshm.ConfigError, match="cpu_bytes_to_use"):
        OffloadingSpecFactory.create_spec(offloading_config(extra))


def test_a_shared_tier_refuses_self_describing_kv_events(offloading_config) -> None:
    """vLLM keeps every stored or hit key's event payload until the manager reports the key
    removed, and a shared tier reports no events: the two together would grow without end."""
    extra = json.loads(KV_TRANSFER_CONFIG)["kv_connector_extra_config"]
    shared = {**extra, "shared_tier": True, "self_describing_kv_events": True}
    with pytest.raises(kvshm.ConfigError, match="self_describing_kv_events"):
        OffloadingSpecFactory.create_spec(offloading_config(shared))
    # Without KV events, the option is inert in vLLM, and a shared tier is fine.
    spec = OffloadingSpecFactory.create_spec(offloading_config(shared, events=False))
    assert spec.shared_tier is not None


def test_a_misspelt_eviction_order_is_refused_when_the_spec_is_made(offloading_config) -> None:
    extra = json.loads(KV_TRANSFER_CONFIG)["kv_connector_extra_config"]
    with pytest.raises(kvshm.ConfigError, match="'leaf-first' is not one of leaf_first, lru"):
        OffloadingSpecFactory.create_spec(offloading_config({**extra, "eviction": "leaf-first"}))
    spec = OffloadingSpecFactory.create_spec(offloading_config({**extra, "eviction": "lru"}))
    assert spec.eviction == "lru"


def test_get_stats_reports_only_metrics_the_spec_defines(offloading_config) -> None:
    extra = json.loads(KV_TRANSFER_CONFIG)["kv_connector_extra_config"]
    spec = OffloadingSpecFactory.create_spec(offloading_config(extra))
    definitions = type(spec).build_metric_definitions(extra)
    manager = spec.get_manager()
    context = ReqContext(req_id="r")
    manager.on_new_request(context)
    key = make_offload_key(b"\x01" * 32, 0)
    manager.lookup(key, context)
    assert manager.prepare_store([key], context) is not None
    manager.complete_store({key}, context)
    reduced = manager.get_stats().reduce()
    assert set(reduced) <= set(definitions)
    assert reduced["vllm:kv_offload_kvshm_cache_usage_perc"] == pytest.approx(1 / 512)
    assert reduced["vllm:kv_offload_kvshm_keys_stored"] == 1
    assert reduced["vllm:kv_offload_kvshm_lookups"] == 1
    # Counters report what happened since the previous call.
    assert "vllm:kv_offload_kvshm_keys_stored" not in manager.get_stats().reduce()


def test_the_default_segment_name_follows_the_block_layout_not_the_engine_id(
    offloading_config,
) -> None:
    extra = json.loads(KV_TRANSFER_CONFIG)["kv_connector_extra_config"]
    first = OffloadingSpecFactory.create_spec(offloading_config(extra))
    config = offloading_config(extra)
    restarted = dataclasses.replace(config, engine_id="another-engine-id")
    assert OffloadingSpecFactory.create_spec(restarted).segment_prefix == first.segment_prefix
    for other in (
        offloading_config(extra, tokens_per_block=32),
        offloading_config(extra, bytes_per_block=128 * 1024),
        offloading_config(extra, world_size=4),
        dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="bfloat16")),
        dataclasses.replace(config, model=dataclasses.replace(config.model, name="other")),
    ):
        assert OffloadingSpecFactory.create_spec(other).segment_prefix != first.segment_prefix
    # The page's byte layout is the key table's to check (test_worker_cpu.py), not the name's:
    # the name a kvshm of before that check derived is found again.
    hnd = dataclasses.replace(config, kv_cache_layout="LBHNC")
    assert OffloadingSpecFactory.create_spec(hnd).segment_prefix == first.segment_prefix
    named = OffloadingSpecFactory.create_spec(offloading_config({**extra, "segment_name": "mine"}))
    assert named.segment_prefix == "mine"


def test_engines_whose_pages_lay_their_bytes_out_otherwise_never_share_a_tier(
    offloading_config,
) -> None:
    extra = json.loads(KV_TRANSFER_CONFIG)["kv_connector_extra_config"]
    config = offloading_config(extra)
    nhd = kvshm.vllm._shared_identity(dataclasses.replace(config, kv_cache_layout="LBNHC"))
    hnd = kvshm.vllm._shared_identity(dataclasses.replace(config, kv_cache_layout="LBHNC"))
    assert nhd.tier_name() != hnd.tier_name()
    assert nhd != hnd, "the owner compares every field of a client's identity with its own"
    again = kvshm.vllm._shared_identity(dataclasses.replace(config, kv_cache_layout="LBNHC"))
    assert again.tier_name() == nhd.tier_name()


def test_a_host_tier_too_small_for_one_chunk_is_refused_when_the_spec_is_made(
    offloading_config,
) -> None:
    extra = {**json.loads(KV_TRANSFER_CONFIG)["kv_connector_extra_config"], "cpu_bytes_to_use": 1}
    with pytest.raises(kvshm.ConfigError, match="would hold no chunk"):
        OffloadingSpecFactory.create_spec(offloading_config(extra))
    extra = {"spec_name": "KvshmOffloadingSpec", "spec_module_path": "kvshm.vllm", "num_chunks": 0}
    with pytest.raises(kvshm.ConfigError, match="num_chunks >= 1"):
        OffloadingSpecFactory.create_spec(offloading_config(extra))
