"""Everything kvshm hands vLLM that crosses a process boundary pickles: vLLM sends its connector
metadata (with kvshm's load and store specs) from the scheduler to its worker processes, and
events, stats and metric definitions between its processes, with pickle."""

import pickle
from pathlib import Path

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    OffloadingManager,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvshm.vllm import KvshmLoadStoreSpec


def roundtrip(value: object) -> object:
    return pickle.loads(pickle.dumps(value))


def test_vllms_connector_metadata_carrying_kvshms_specs_pickles(
    name: str, offloading_config
) -> None:
    extra = {
        "spec_name": "KvshmOffloadingSpec",
        "spec_module_path": "kvshm.vllm",
        "num_chunks": 8,
        "segment_name": name,
    }
    spec = OffloadingSpecFactory.create_spec(offloading_config(extra, world_size=1))
    # The worker first, as vLLM makes them: its persistent tier's key table is what the
    # manager's store specs name keys for.
    page = 64
    tensor = CanonicalKVCacheTensor(
        tensor=torch.zeros((4, page), dtype=torch.int8), page_size_bytes=page
    )
    caches = CanonicalKVCaches(
        tensors=[tensor],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=page)]],
    )
    worker = spec.get_worker(caches)
    try:
        check_specs_pickle(spec.get_manager())
    finally:
        worker.shutdown()
        for left in Path("/dev/shm").glob(f"kvshm.{name}-*"):
            left.unlink()


def check_specs_pickle(manager: OffloadingManager) -> None:
    context = ReqContext(req_id="r")
    manager.on_new_request(context)
    keys = [make_offload_key(bytes([n]) * 32, 0) for n in range(3)]
    prepared = manager.prepare_store(keys, context)
    assert prepared is not None
    manager.complete_store(set(keys), context)
    load = manager.prepare_load(keys[:2], context)
    metadata = OffloadingConnectorMetadata(
        load_jobs={1: TransferJob("r", load, GPULoadStoreSpec([4, 5], [2], [0]))},
        store_jobs={
            2: TransferJob("r", GPULoadStoreSpec([1, 2, 3], [3], [0]), prepared.store_spec)
        },
        jobs_to_flush={2},
    )

    copy = roundtrip(metadata)

    stored = copy.store_jobs[2].dst_spec
    assert isinstance(stored, KvshmLoadStoreSpec)
    assert stored.chunks.tolist() == prepared.store_spec.chunks.tolist()
    assert stored.keys == keys
    # Each key's parent's chunk: the first has none, the others the chunk of the key before.
    chunks = stored.chunks.tolist()
    assert stored.parents.tolist() == [2**32 - 1, chunks[0], chunks[1]]
    loaded = copy.load_jobs[1].src_spec
    assert isinstance(loaded, KvshmLoadStoreSpec)
    assert loaded.chunks.tolist() == chunks[:2]
    assert loaded.keys is None
    assert list(loaded.block_ids) == chunks[:2]
    assert copy.jobs_to_flush == {2}
    # A store chosen after a reset carries the manager's next epoch to the worker.
    assert stored.epoch == 0
    manager.reset_cache()
    again = manager.prepare_store(keys[:1], ReqContext(req_id="after"))
    assert again is not None
    assert roundtrip(again.store_spec).epoch == 1


def test_a_manager_that_holds_no_key_table_names_no_keys_in_its_store_specs(
    offloading_config,
) -> None:
    """No worker made a tier for this manager, so it holds no key table and sets no epoch:
    its store specs name no keys, which a persistent tier it does not know of would otherwise
    record in an epoch that a reset of this manager never raises."""
    extra = {"spec_name": "KvshmOffloadingSpec", "spec_module_path": "kvshm.vllm", "num_chunks": 8}
    spec = OffloadingSpecFactory.create_spec(offloading_config(extra, world_size=1))
    manager = spec.get_manager()
    context = ReqContext(req_id="r")
    manager.on_new_request(context)
    prepared = manager.prepare_store([make_offload_key(b"k" * 32, 0)], context)
    assert prepared is not None
    assert isinstance(prepared.store_spec, KvshmLoadStoreSpec)
    assert prepared.store_spec.keys is None
    assert len(prepared.store_spec.chunks.tolist()) == 1


def test_kvshms_events_stats_and_metric_definitions_pickle(offloading_config) -> None:
    extra = {"spec_name": "KvshmOffloadingSpec", "spec_module_path": "kvshm.vllm", "num_chunks": 8}
    spec = OffloadingSpecFactory.create_spec(offloading_config(extra, world_size=1))
    manager = spec.get_manager()
    context = ReqContext(req_id="r")
    manager.on_new_request(context)
    key = make_offload_key(b"\x07" * 32, 0)
    manager.prepare_store([key], context)
    manager.complete_store({key}, context)

    events = list(manager.take_events())
    assert events
    assert [(list(e.keys), e.removed) for e in roundtrip(events)] == [
        (list(e.keys), e.removed) for e in events
    ]
    stats = manager.get_stats()
    assert roundtrip(stats).reduce() == stats.reduce()
    definitions = type(spec).build_metric_definitions(extra)
    assert set(roundtrip(definitions)) == set(definitions)
