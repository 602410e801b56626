"""Everything kvshm hands vLLM that crosses a process boundary pickles: vLLM sends its connector
metadata (with kvshm's load and store specs) from the scheduler to its worker processes, and
events, stats and metric definitions between its processes, with pickle."""

import pickle

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec, ReqContext, make_offload_key
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvshm.vllm import KvshmLoadStoreSpec


def roundtrip(value: object) -> object:
    return pickle.loads(pickle.dumps(value))


def test_vllms_connector_metadata_carrying_kvshms_specs_pickles(offloading_config) -> None:
    extra = {"spec_name": "KvshmOffloadingSpec", "spec_module_path": "kvshm.vllm", "num_chunks": 8}
    spec = OffloadingSpecFactory.create_spec(offloading_config(extra, world_size=1))
    manager = spec.get_manager()
    context = ReqContext(req_id="r")
    manager.on_new_request(context)
    keys = [make_offload_key(bytes([n]) * 32, 0) for n in range(3)]
    prepared = manager.prepare_store(keys, context)
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
