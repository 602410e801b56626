"""The GPU side of kvshm's offloading worker, without a GPU: reading the CUDA IPC handles of
vLLM's KV tensors (and refusing expandable segments), publishing them for a copy worker, and
restarting that worker (or giving up on one that cannot start)."""

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)

import kvshm
from kvshm.cuda_tier import WorkerProcess, device_handle
from kvshm.vllm import KvshmLoadStoreSpec, KvshmOffloadingWorker

MEMORY_HANDLE = bytes(range(64))


class FakeCudaTensor:
    """What the worker reads from a CUDA tensor: shape, strides, storage and its IPC handle."""

    is_cuda = True

    def __init__(self, handle: bytes, storage_offset_bytes: int, stride: int = 256) -> None:
        self.shape = (16, 256)
        self.device = SimpleNamespace(index=1)
        self._handle = handle
        self._storage_offset_bytes = storage_offset_bytes
        self._stride = stride

    def untyped_storage(self) -> SimpleNamespace:
        # torch's (device, handle, size, offset, ref counter file, ref offset, event, sync)
        shared = (1, self._handle, 1 << 20, self._storage_offset_bytes, b"ref", 0, b"", False)
        return SimpleNamespace(_share_cuda_=lambda: shared)

    def storage_offset(self) -> int:
        return 8

    def element_size(self) -> int:
        return 1

    def stride(self, dim: int | None = None) -> int | tuple[int, int]:
        strides = (self._stride, 1)
        return strides if dim is None else strides[dim]


def caches(tensors: list[FakeCudaTensor]) -> CanonicalKVCaches:
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=256) for t in tensors],
        group_data_refs=[
            [CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=256) for i in range(len(tensors))]
        ],
    )


def test_a_tensors_handle_offset_length_and_stride_come_from_its_storage() -> None:
    tensor = FakeCudaTensor(b"\x02c" + MEMORY_HANDLE, storage_offset_bytes=4096)
    handle, offset, length, stride = device_handle(tensor, 256)
    assert handle == MEMORY_HANDLE
    assert offset == 4096 + 8, "the storage's offset in its block, then the tensor's in it"
    assert (length, stride) == (15 * 256 + 256, 256)


def test_a_tensor_in_an_expandable_segment_is_refused_naming_the_setting() -> None:
    tensor = FakeCudaTensor(b"\x02e" + bytes(30), storage_offset_bytes=0)
    with pytest.raises(kvshm.DeviceHandleError, match="expandable_segments:False"):
        device_handle(tensor, 256)
    with pytest.raises(kvshm.DeviceHandleError):
        KvshmOffloadingWorker(caches([tensor]), segment="unused", num_chunks=4, blocks_per_chunk=1)


def test_the_worker_publishes_every_tensors_handle_for_the_copy_worker(name: str) -> None:
    tensors = [FakeCudaTensor(b"\x02c" + MEMORY_HANDLE, 0) for _ in range(2)]
    worker = KvshmOffloadingWorker(
        caches(tensors), segment=name, num_chunks=8, blocks_per_chunk=1, spawn_workers=False
    )
    assert not worker.tier.worker_up, "no copy worker started: spawn_workers is off"
    assert worker.tier.name == name
    worker.shutdown()


def test_tensors_of_different_block_strides_are_refused(name: str) -> None:
    tensors = [FakeCudaTensor(MEMORY_HANDLE, 0, stride=256), FakeCudaTensor(MEMORY_HANDLE, 0, 512)]
    with pytest.raises(kvshm.ConfigError, match="stride"):
        KvshmOffloadingWorker(caches(tensors), segment=name, num_chunks=4, blocks_per_chunk=1)


#: A key without a parent chunk, as the tier's key table writes it.
NO_PARENT = 2**32 - 1


class ReadyEvent:
    """torch.cuda.Event on a machine without CUDA: the compute it waits for has always ended."""

    def record(self, stream: object = None) -> None:
        return

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return


def test_a_warm_restart_tier_of_gpu_tensors_is_persistent_and_takes_a_stores_keys(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "Event", ReadyEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: None)
    tensors = [FakeCudaTensor(b"\x02c" + MEMORY_HANDLE, 0) for _ in range(2)]
    worker = KvshmOffloadingWorker(
        caches(tensors),
        segment=name,
        num_chunks=8,
        blocks_per_chunk=1,
        spawn_workers=False,
        persistent=True,
    )
    try:
        assert not worker.tier.restored, "a new tier"
        src = GPULoadStoreSpec([3, 4], group_sizes=[2], block_indices=[0])
        # The keys reach the tier with the store: one per chunk, or the tier refuses it.
        short = KvshmLoadStoreSpec(
            kvshm.U32Array([0, 1]), keys=[b"k0"], parents=kvshm.U32Array([NO_PARENT])
        )
        with pytest.raises(kvshm.ConfigError, match="1 keys for a store of 2 chunks"):
            worker.submit_store(1, src, short)
        whole = KvshmLoadStoreSpec(
            kvshm.U32Array([0, 1]), keys=[b"k0", b"k1"], parents=kvshm.U32Array([NO_PARENT, 0])
        )
        assert worker.submit_store(2, src, whole)
        assert worker.tier.pending == 1, "handed to the (absent) copy worker"
    finally:
        worker.shutdown()
        # A persistent tier outlives its worker (warm restart): this test's goes with it.
        for left in Path("/dev/shm").glob(f"kvshm.{name}.*"):
            left.unlink()


def test_a_copy_worker_that_cannot_start_is_given_up_with_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(WorkerProcess, "RESTART_INTERVAL_S", 0.05)
    worker = WorkerProcess([sys.executable, "-c", "raise SystemExit(3)"])
    deadline = time.monotonic() + 60
    given_up = None
    while given_up is None and time.monotonic() < deadline:
        try:
            worker.ensure_running()
        except kvshm.WorkerError as error:
            given_up = str(error)
        time.sleep(0.01)
    assert given_up is not None
    assert "5 times in a row" in given_up
    assert "last with status 3" in given_up
    assert worker.restarts == WorkerProcess.MAX_EARLY_EXITS - 1
    with pytest.raises(kvshm.WorkerError, match="giving up"):
        worker.ensure_running()


def test_a_copy_worker_that_ran_a_while_is_restarted_however_often_it_dies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(WorkerProcess, "RESTART_INTERVAL_S", 0.05)
    monkeypatch.setattr(WorkerProcess, "STEADY_S", 0.1)
    worker = WorkerProcess([sys.executable, "-c", "import time; time.sleep(0.2)"])
    deadline = time.monotonic() + 60
    while worker.restarts <= WorkerProcess.MAX_EARLY_EXITS and time.monotonic() < deadline:
        worker.ensure_running()
        time.sleep(0.01)
    assert worker.restarts > WorkerProcess.MAX_EARLY_EXITS
    worker.stop()
