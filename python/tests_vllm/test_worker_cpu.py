"""kvshm's offloading worker with CPU tensors: stores and loads of real bytes through the
shared-memory host tier, as vLLM's worker connector submits them."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    OffloadingWorker,
    ReqContext,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

import kvshm
from kvshm.vllm import KvshmLoadStoreSpec, KvshmOffloadingWorker

BLOCKS = 32
PAGE = 256


def kv_caches(groups: list[list[int]], tensors: int) -> CanonicalKVCaches:
    return CanonicalKVCaches(
        tensors=[
            CanonicalKVCacheTensor(
                tensor=torch.zeros((BLOCKS, PAGE), dtype=torch.int8), page_size_bytes=PAGE
            )
            for _ in range(tensors)
        ],
        group_data_refs=[
            [CanonicalKVCacheRef(tensor_idx=index, page_size_bytes=PAGE) for index in group]
            for group in groups
        ],
    )


def fill(caches: CanonicalKVCaches, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    for entry in caches.tensors:
        entry.tensor.copy_(torch.randint(-128, 127, (BLOCKS, PAGE), generator=generator))
    return [entry.tensor.clone() for entry in caches.tensors]


def spec_options(segment: str | None, *, num_chunks: int, warm_restart: bool) -> dict:
    """kvshm's ``kv_connector_extra_config`` for these tests: ``segment`` its segment name
    (``None``: the name derived from the model and layout)."""
    options: dict[str, object] = {
        "spec_name": "KvshmOffloadingSpec",
        "spec_module_path": "kvshm.vllm",
        "num_chunks": num_chunks,
        "warm_restart": warm_restart,
    }
    if segment is not None:
        options["segment_name"] = segment
    return options


def key(n: int, group: int) -> bytes:
    return n.to_bytes(32, "little") + group.to_bytes(4, "big")


def finish(worker: OffloadingWorker, job: int) -> None:
    results = worker.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(job, True)]
    assert results[0].transfer_size > 0


def test_blocks_stored_from_cpu_tensors_load_back_into_other_blocks(
    name: str, offloading_config
) -> None:
    extra = spec_options(name, num_chunks=16, warm_restart=False)
    spec = OffloadingSpecFactory.create_spec(offloading_config(extra, world_size=1))
    manager = spec.get_manager()
    caches = kv_caches([[0, 1], [2]], tensors=3)
    worker = spec.get_worker(caches)
    assert isinstance(worker, KvshmOffloadingWorker)
    original = fill(caches, seed=1)
    context = ReqContext(req_id="r")
    manager.on_new_request(context)
    keys = [key(n, 0) for n in range(3)] + [key(n, 1) for n in range(2)]
    prepared = manager.prepare_store(keys, context)
    assert prepared.keys_to_store == keys
    # Group 0: blocks 4, 5, 6; group 1: blocks 9, 10.
    source = GPULoadStoreSpec([4, 5, 6, 9, 10], group_sizes=[3, 2], block_indices=[0, 0])
    assert worker.submit_store(1, source, prepared.store_spec)
    finish(worker, 1)
    manager.complete_store(set(keys), context)
    for entry in caches.tensors:
        entry.tensor.zero_()
    load = manager.prepare_load(keys, context)
    assert isinstance(load, KvshmLoadStoreSpec)
    target = GPULoadStoreSpec([20, 21, 22, 27, 28], group_sizes=[3, 2], block_indices=[0, 0])
    assert worker.submit_load(2, load, target, expedited=True)
    worker.wait({2})
    finish(worker, 2)
    manager.complete_load(keys, context)
    tensors = [entry.tensor for entry in caches.tensors]
    for tensor in (0, 1):
        for src, dst in [(4, 20), (5, 21), (6, 22)]:
            assert torch.equal(tensors[tensor][dst], original[tensor][src])
        assert not tensors[tensor][27].any(), "group 1's blocks are not in tensors 0 and 1"
    for src, dst in [(9, 27), (10, 28)]:
        assert torch.equal(tensors[2][dst], original[2][src])
    worker.shutdown()


def test_a_tensor_layout_the_host_tier_cannot_hold_is_refused(name: str) -> None:
    caches = CanonicalKVCaches(
        tensors=[
            CanonicalKVCacheTensor(
                tensor=torch.zeros((4, 64), dtype=torch.int8), page_size_bytes=64
            ),
            CanonicalKVCacheTensor(
                tensor=torch.zeros((4, 32), dtype=torch.int8), page_size_bytes=32
            ),
        ],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=64)]],
    )
    with pytest.raises(kvshm.ConfigError, match="page size"):
        KvshmOffloadingWorker(caches, segment=name, num_chunks=4, blocks_per_chunk=1)


def test_a_second_engine_on_a_live_tier_is_refused_with_a_hint(
    name: str, offloading_config
) -> None:
    extra = spec_options(name, num_chunks=4, warm_restart=False)
    first = OffloadingSpecFactory.create_spec(offloading_config(extra, world_size=1))
    worker = first.get_worker(kv_caches([[0]], tensors=1))
    second = OffloadingSpecFactory.create_spec(offloading_config(extra, world_size=1))
    with pytest.raises(kvshm.SegmentError, match="give each its own segment_name"):
        second.get_worker(kv_caches([[0]], tensors=1))
    worker.shutdown()


def test_a_warm_restart_after_a_reset_takes_back_each_key_from_its_newest_chunk(
    name: str, offloading_config
) -> None:
    """A reset of the connector hands chunks out again from the lowest while the workers' key
    tables still name the keys stored before: a key stored again after the reset is in two
    slots. The next start takes it back once, from the chunk it was stored in last."""
    extra = spec_options(name, num_chunks=4, warm_restart=True)
    try:
        spec = OffloadingSpecFactory.create_spec(offloading_config(extra, world_size=1))
        caches = kv_caches([[0]], tensors=1)
        worker = spec.get_worker(caches)
        manager = spec.get_manager()
        original = fill(caches, seed=3)
        x, k = key(1, 0), key(2, 0)
        job = 0
        for keys in ([x, k], [k]):
            context = ReqContext(req_id=f"r{job}")
            manager.on_new_request(context)
            prepared = manager.prepare_store(keys, context)
            assert prepared is not None
            assert prepared.keys_to_store == keys
            job += 1
            source = GPULoadStoreSpec(
                [5 + n for n in range(len(keys))], group_sizes=[len(keys)], block_indices=[0]
            )
            assert worker.submit_store(job, source, prepared.store_spec)
            finish(worker, job)
            manager.complete_store(set(keys), context)
            manager.on_request_finished(context)
            # vLLM's reset of the prefix cache with the connector's: the manager forgets all.
            manager.reset_cache()
        worker.shutdown()

        restarted = OffloadingSpecFactory.create_spec(offloading_config(extra, world_size=1))
        caches = kv_caches([[0]], tensors=1)
        worker = restarted.get_worker(caches)
        manager = restarted.get_manager()
        context = ReqContext(req_id="after")
        manager.on_new_request(context)
        assert manager.lookup(k, context) == LookupResult.HIT, "the key came back"
        load = manager.prepare_load([k], context)
        assert worker.submit_load(
            job + 1,
            load,
            GPULoadStoreSpec([20], group_sizes=[1], block_indices=[0]),
            expedited=True,
        )
        worker.wait({job + 1})
        finish(worker, job + 1)
        assert torch.equal(caches.tensors[0].tensor[20], original[0][5]), "its newest bytes"
        worker.shutdown()
    finally:
        for left in Path("/dev/shm").glob(f"kvshm.{name}-*"):
            left.unlink()


def test_a_host_tier_that_cannot_be_made_says_why_without_the_hint_for_two_engines(
    name: str, offloading_config
) -> None:
    extra = spec_options(name, num_chunks=4, warm_restart=False)
    # A fresh object under the tier's name, being made by another process as far as anyone can
    # tell (another engine starting under the same name): the hint.
    planted = Path(f"/dev/shm/kvshm.{name}-r0")
    planted.write_bytes(bytes(64))
    try:
        spec = OffloadingSpecFactory.create_spec(offloading_config(extra, world_size=1))
        # Fresh as of now: an object unchanged for 2 s is garbage, and is replaced.
        os.utime(planted)
        with pytest.raises(kvshm.SegmentError, match=r"being created.*give each its own"):
            spec.get_worker(kv_caches([[0]], tensors=1))
        # Another user's object under the name: no engine of this user's made it.
        if os.geteuid() != 0:
            pytest.skip("giving an object to another user takes root (CI runs as root)")
        os.chown(planted, 54321, -1)
        with pytest.raises(kvshm.SegmentError) as refused:
            spec.get_worker(kv_caches([[0]], tensors=1))
        assert "belongs to uid 54321" in str(refused.value)
        assert "segment_name" not in str(refused.value), str(refused.value)
    finally:
        planted.unlink()


@pytest.mark.parametrize("named", [True, False])
def test_a_restart_takes_no_key_back_into_pages_of_another_layout(
    name: str, offloading_config, named: bool
) -> None:
    """An engine restarted under the same segment name (given, or derived: the name leaves the
    page's layout out) with another attention backend (pages laid out HND where they were NHD,
    the same size) starts with an empty tier: its pages' bytes would be read in the wrong
    order."""
    extra = spec_options(name if named else None, num_chunks=4, warm_restart=True)
    model = f"model-{name}"
    prefix = name

    def start(layout: str) -> tuple[OffloadingWorker, object]:
        nonlocal prefix
        config = offloading_config(extra, world_size=1)
        config = dataclasses.replace(
            config,
            kv_cache_layout=layout,
            model=dataclasses.replace(config.model, name=model),
        )
        spec = OffloadingSpecFactory.create_spec(config)
        prefix = spec.segment_prefix
        worker = spec.get_worker(kv_caches([[0]], tensors=1))
        return worker, spec.get_manager()

    try:
        worker, manager = start("LBNHC")
        context = ReqContext(req_id="r")
        manager.on_new_request(context)
        prepared = manager.prepare_store([key(1, 0)], context)
        assert prepared is not None
        source = GPULoadStoreSpec([5], group_sizes=[1], block_indices=[0])
        assert worker.submit_store(1, source, prepared.store_spec)
        finish(worker, 1)
        manager.complete_store({key(1, 0)}, context)
        worker.shutdown()

        worker, manager = start("LBNHC")
        assert isinstance(worker, KvshmOffloadingWorker)
        assert worker.tier.restored, "the same layout takes its tier back"
        worker.shutdown()

        worker, manager = start("LBHNC")
        assert isinstance(worker, KvshmOffloadingWorker)
        assert not worker.tier.restored
        context = ReqContext(req_id="after")
        manager.on_new_request(context)
        assert manager.lookup(key(1, 0), context) == LookupResult.MISS
        worker.shutdown()
    finally:
        for left in Path("/dev/shm").glob(f"kvshm.{prefix}-*"):
            left.unlink()


def test_kvctl_stat_shows_an_emptied_manager_right_after_a_reset(
    name: str, offloading_config
) -> None:
    extra = spec_options(name, num_chunks=4, warm_restart=False)
    spec = OffloadingSpecFactory.create_spec(offloading_config(extra, world_size=1))
    worker = spec.get_worker(kv_caches([[0]], tensors=1))
    manager = spec.get_manager()
    context = ReqContext(req_id="r")
    manager.on_new_request(context)
    keys = [key(1, 0), key(2, 0)]
    prepared = manager.prepare_store(keys, context)
    assert prepared is not None
    assert worker.submit_store(
        1, GPULoadStoreSpec([5, 6], group_sizes=[2], block_indices=[0]), prepared.store_spec
    )
    finish(worker, 1)
    manager.complete_store(set(keys), context)
    manager.on_request_finished(context)

    def cached_nodes() -> int:
        stat = subprocess.run(
            [sys.executable, "-m", "kvshm", "kvctl", "stat", f"{name}-r0", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return int(json.loads(stat.stdout)["counters"]["cached_nodes"])

    assert cached_nodes() == 2
    manager.reset_cache()
    assert cached_nodes() == 0, "published at the reset, not at the next finished request"
    worker.shutdown()
