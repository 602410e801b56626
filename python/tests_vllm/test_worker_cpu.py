"""kvshm's offloading worker with CPU tensors: stores and loads of real bytes through the
shared-memory host tier, as vLLM's worker connector submits them."""

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    OffloadingWorker,
    PrepareStoreOutput,
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


class _Engine:
    """One start of an engine with kvshm's spec on a persistent tier: its worker, manager and
    CPU tensors, and the job ids it uses."""

    def __init__(self, offloading_config: Callable[..., Any], extra: dict, seed: int) -> None:
        spec = OffloadingSpecFactory.create_spec(offloading_config(extra, world_size=1))
        self.caches = kv_caches([[0]], tensors=1)
        self.worker = spec.get_worker(self.caches)
        self.manager = spec.get_manager()
        self.original = fill(self.caches, seed=seed)
        self.jobs = 0

    def prepare(self, keys: list[bytes], request: str) -> tuple[ReqContext, PrepareStoreOutput]:
        context = ReqContext(req_id=request)
        self.manager.on_new_request(context)
        prepared = self.manager.prepare_store(keys, context)
        assert prepared is not None
        assert prepared.keys_to_store == keys
        return context, prepared

    def store(
        self,
        keys: list[bytes],
        context: ReqContext,
        prepared: PrepareStoreOutput,
        first_block: int,
    ) -> None:
        """Copies device blocks from ``first_block`` on into the chunks ``prepared`` names."""
        self.jobs += 1
        source = GPULoadStoreSpec(
            [first_block + n for n in range(len(keys))],
            group_sizes=[len(keys)],
            block_indices=[0],
        )
        assert self.worker.submit_store(self.jobs, source, prepared.store_spec)
        finish(self.worker, self.jobs)
        self.manager.complete_store(set(keys), context)
        self.manager.on_request_finished(context)

    def hits(self, keys: list[bytes]) -> list[bool]:
        context = ReqContext(req_id=f"lookup{self.jobs}")
        self.manager.on_new_request(context)
        return [self.manager.lookup(k, context) == LookupResult.HIT for k in keys]

    def load(self, stored: bytes, block: int) -> torch.Tensor:
        context = ReqContext(req_id=f"load{self.jobs}")
        self.manager.on_new_request(context)
        load = self.manager.prepare_load([stored], context)
        self.jobs += 1
        device = GPULoadStoreSpec([block], group_sizes=[1], block_indices=[0])
        assert self.worker.submit_load(self.jobs, load, device, expedited=True)
        self.worker.wait({self.jobs})
        finish(self.worker, self.jobs)
        return self.caches.tensors[0].tensor[block].clone()


def test_a_warm_restart_takes_back_no_key_stored_before_a_reset(
    name: str, offloading_config
) -> None:
    """A reset of the connector (vLLM's reset of the prefix cache, say for new weights) makes
    every key stored before it stale for a warm restart too: one stored before it, and one whose
    store was chosen before it and copied after it. A key stored again after the reset comes
    back with its newest bytes, though its first chunk still names it. The reset's epoch
    outlives the engine: a key the next engine stores comes back at the start after it, and a
    reset there makes all of them stale again."""
    extra = spec_options(name, num_chunks=8, warm_restart=True)
    x, k, y, z = (key(n, 0) for n in (1, 2, 3, 4))
    try:
        engine = _Engine(offloading_config, extra, seed=3)
        engine.store([x, k], *engine.prepare([x, k], "before"), first_block=5)
        late = engine.prepare([y], "late")
        engine.manager.reset_cache()
        engine.store([y], *late, first_block=9)
        engine.store([k], *engine.prepare([k], "after"), first_block=12)
        newest = engine.original[0][12]
        # k's first chunk and y's still name them, in the epoch before the reset: not read.
        table = kvshm.read_tier_keys(f"{name}-r0", 8, 1)
        assert [entry[1] for entry in table] == [k], table
        engine.worker.shutdown()

        engine = _Engine(offloading_config, extra, seed=4)
        assert engine.hits([x, k, y]) == [False, True, False]
        assert torch.equal(engine.load(k, 20), newest), "k's bytes of after the reset"
        engine.store([z], *engine.prepare([z], "next start"), first_block=2)
        engine.worker.shutdown()

        engine = _Engine(offloading_config, extra, seed=5)
        assert engine.hits([x, k, y, z]) == [False, True, False, True]
        engine.manager.reset_cache()
        engine.worker.shutdown()

        engine = _Engine(offloading_config, extra, seed=6)
        assert engine.hits([k, z]) == [False, False]
        engine.worker.shutdown()
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
