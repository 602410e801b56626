"""The offload manager and host tier, driven exactly as vLLM's offloading connector drives them.

vLLM's scheduler (``offloading/scheduler.py``) and worker (``offloading/worker.py``) make these
calls, in this order, for each request: ``on_new_request``; ``lookup`` of the chunk keys past its
GPU prefix-cache hits, one by one until the first miss (again on every step while a hit is
pending); ``prepare_load`` of the hits, a load job on every worker, ``complete_load`` when all
workers finished; after each step, ``prepare_store`` of the chunks that became full, a store job,
``complete_store(set of keys)``; at the end ``on_request_finished`` (keys' end-token positions in
``ReqContext``). The tests play that sequence with numpy tensors standing in for the KV cache and
check every loaded byte.
"""

from __future__ import annotations

import hashlib
import random
from typing import TYPE_CHECKING

import numpy as np
import pytest

import kvshm

if TYPE_CHECKING:
    from kvshm._kvshm import EvictionOrder

PAGE = 64
TOKENS_PER_CHUNK = 16


def key(prefix: tuple[int, ...], group: int = 0) -> bytes:
    """A vLLM-shaped key: a 32-byte hash of the whole prefix, then the 4-byte group index."""
    digest = hashlib.sha256(repr(prefix).encode()).digest()
    return digest + group.to_bytes(4, "big")


def chain(tokens: list[int]) -> list[bytes]:
    chunks = len(tokens) // TOKENS_PER_CHUNK
    return [key(tuple(tokens[: (i + 1) * TOKENS_PER_CHUNK])) for i in range(chunks)]


def page(key_bytes: bytes, tensor: int) -> np.ndarray:
    """What the model computed for one block of one tensor."""
    seed = hashlib.shake_128(key_bytes + bytes([tensor])).digest(PAGE)
    return np.frombuffer(seed, dtype=np.uint8)


class Engine:
    """vLLM's scheduler and one worker, reduced to the calls they make on kvshm."""

    def __init__(self, name: str, chunks: int, gpu_blocks: int, eviction: EvictionOrder) -> None:
        self.manager = kvshm.OffloadManager(chunks, tag_bytes=4, eviction=eviction, events=True)
        self.gpu = [np.zeros((gpu_blocks, PAGE), dtype=np.uint8) for _ in range(2)]
        self.tier = kvshm.HostTier(
            name,
            page_bytes=PAGE,
            device_blocks=gpu_blocks,
            chunks=chunks,
            blocks_per_chunk=1,
            groups=[[0, 1]],
            tensors=self.gpu,
        )
        self.free = list(range(gpu_blocks))
        self.job = 0
        self.loaded_blocks = 0
        self.stored = 0

    def run_request(self, request: str, keys: list[bytes]) -> int:
        """One request end to end; returns the chunks it loaded from the host tier."""
        manager = self.manager
        manager.on_new_request(request)
        hits = 0
        for chunk_key in keys:  # _maximal_prefix_lookup
            result = manager.lookup(chunk_key, request)
            if result == 0:
                break
            assert result == 1, "every store completed before the next request"
            hits += 1
        blocks = [self.free.pop() for _ in keys]
        if hits:
            chunks = manager.prepare_load(keys[:hits], request)  # update_state_after_alloc
            self.job += 1
            self.tier.submit_load(self.job, np.array(blocks[:hits], np.int32), [hits], [0], chunks)
            assert self.tier.take_finished()[0][:2] == (self.job, True)
            manager.complete_load(set(keys[:hits]))
            for position in range(hits):
                for tensor in range(2):
                    got = self.gpu[tensor][blocks[position]]
                    assert (got == page(keys[position], tensor)).all(), (request, position)
            self.loaded_blocks += hits
        for position in range(hits, len(keys)):  # the model computes the rest
            for tensor in range(2):
                self.gpu[tensor][blocks[position]] = page(keys[position], tensor)
        prepared = manager.prepare_store(keys[hits:], request)  # _build_store_jobs
        if prepared is not None and prepared[0]:  # vLLM skips a store with nothing new
            indices, chunks, _evicted = prepared
            to_store = [keys[hits + index] for index in indices]
            device = np.array([blocks[hits + index] for index in indices], np.int32)
            self.job += 1
            self.tier.submit_store(self.job, device, [len(device)], [hits + indices[0]], chunks)
            finished = self.tier.take_finished()
            assert finished[0][:2] == (self.job, True)
            manager.complete_store(set(to_store))  # a set, as the scheduler passes it
            self.stored += len(to_store)
        positions = [(keys.index(k) + 1) * TOKENS_PER_CHUNK for k in manager.request_keys(request)]
        manager.on_request_finished(request, positions)
        self.free.extend(blocks)
        manager.check_invariants()
        return hits


@pytest.mark.parametrize("eviction", ["leaf_first", "lru"])
def test_a_conversation_workload_loads_back_every_stored_byte(
    name: str, eviction: EvictionOrder
) -> None:
    engine = Engine(name, chunks=40, gpu_blocks=64, eviction=eviction)
    rng = random.Random(3)
    conversations = [[rng.randrange(50_000) for _ in range(6 * 16)] for _ in range(8)]
    for turn in range(200):
        conversation = conversations[rng.randrange(len(conversations))]
        length = rng.randrange(1, 7) * TOKENS_PER_CHUNK
        engine.run_request(f"req-{turn}", chain(conversation[:length]))
    stats = engine.manager.stats()
    assert engine.loaded_blocks > 100
    assert stats["evictions"] > 0
    assert stats["chunks_used"] <= 40
    events = engine.manager.take_events()
    assert any(removed for removed, _ in events)
    assert any(not removed for removed, _ in events)
    engine.tier.close()


def test_lookups_report_pending_stores_and_a_failed_store_is_forgotten(name: str) -> None:
    manager = kvshm.OffloadManager(4, tag_bytes=4)
    keys = [key((1,)), key((1, 2))]
    assert manager.lookup(keys[0], "a") == 0
    prepared = manager.prepare_store(keys, "a")
    assert prepared is not None
    indices, chunks, evicted = prepared
    assert (indices, len(chunks), evicted) == ([0, 1], 2, [])
    assert [manager.lookup(k, "b") for k in keys] == [2, 2]
    with pytest.raises(kvshm.OffloadError, match="being stored"):
        manager.prepare_load(keys, "b")
    manager.complete_store({keys[0]})
    manager.complete_store([keys[1]], success=False)
    assert [manager.lookup(k, "b") for k in keys] == [1, 0]
    assert manager.parent_of(keys[0]) is None
    with pytest.raises(kvshm.OffloadError, match="no load"):
        manager.complete_load([keys[0]])
    with pytest.raises(kvshm.OffloadError, match="not in the host tier"):
        manager.prepare_load([keys[1]], "b")
    with pytest.raises(ValueError, match="64"):
        manager.lookup(b"x" * 65, "a")
    with pytest.raises(TypeError, match="bytes"):
        manager.lookup("not bytes", "a")  # type: ignore[arg-type]
    manager.check_invariants()


def test_a_store_that_finds_no_room_returns_none_and_evicts_nothing() -> None:
    manager = kvshm.OffloadManager(2, tag_bytes=4)
    keys = [key((n,)) for n in range(3)]
    manager.prepare_store(keys[:2], "a")  # both still being stored
    assert manager.prepare_store(keys[2:], "b") is None
    assert len(manager) == 2
    assert manager.stats()["stores_refused"] == 1


def test_keys_of_20_36_and_64_bytes_are_distinct_and_events_carry_them_whole() -> None:
    manager = kvshm.OffloadManager(8, events=True)
    keys = [b"\x01" * 20, b"\x01" * 36, b"\x01" * 64]
    prepared = manager.prepare_store(keys, "a")
    assert prepared is not None
    assert prepared[0] == [0, 1, 2]
    manager.complete_store(keys)
    [(removed, stored)] = manager.take_events()
    assert not removed
    assert stored == keys


def test_a_host_tier_refuses_bad_specs_and_bad_tensors(name: str) -> None:
    gpu = [np.zeros((8, PAGE), dtype=np.uint8)]
    tier = kvshm.HostTier(
        name,
        page_bytes=PAGE,
        device_blocks=8,
        chunks=4,
        blocks_per_chunk=2,
        groups=[[0], [0], [0], [0]],
        tensors=gpu,
    )
    with pytest.raises(kvshm.OffloadError, match="device block 8"):
        tier.submit_store(1, [8], [1, 0, 0, 0], [0] * 4, [0])
    with pytest.raises(kvshm.OffloadError, match="chunks"):
        tier.submit_store(1, [1, 2, 3], [3, 0, 0, 0], [0] * 4, [0])
    # Sizes that add up to the (zero) blocks given only modulo 2**64.
    with pytest.raises(kvshm.OffloadError, match="add up to 18446744073709551616"):
        tier.submit_store(1, [], [2**62] * 4, [0] * 4, [])
    with pytest.raises(kvshm.OffloadError, match="add up to"):
        tier.submit_load(1, [], [2**63 - 1] * 4, [2**63 - 1] * 4, [])
    assert tier.take_finished() == []
    with pytest.raises(kvshm.DeviceHandleError):
        tier.publish_device_handles([(b"\0" * 64, 0, 8 * PAGE, PAGE)])
    tier.close()
    with pytest.raises(ValueError, match="read-only"):
        kvshm.HostTier(
            name,
            page_bytes=PAGE,
            device_blocks=8,
            chunks=4,
            blocks_per_chunk=1,
            groups=[[0]],
            tensors=[bytes(8 * PAGE)],
        )
    with pytest.raises(kvshm.OffloadError, match="blocks"):
        kvshm.HostTier(
            name,
            page_bytes=PAGE,
            device_blocks=9,
            chunks=4,
            blocks_per_chunk=1,
            groups=[[0]],
            tensors=[np.zeros((8, PAGE), dtype=np.uint8)],
        )


def test_strided_tensors_with_blocks_per_chunk_copy_the_right_rows(name: str) -> None:
    # Rows of 96 bytes of which a block's page is the first 64 (a packed layout).
    backing = [np.zeros((8, 96), dtype=np.uint8) for _ in range(2)]
    tensors = [array[:, :PAGE] for array in backing]
    for tensor, array in enumerate(tensors):
        for block in range(8):
            array[block] = block * 10 + tensor
    tier = kvshm.HostTier(
        name,
        page_bytes=PAGE,
        device_blocks=8,
        chunks=4,
        blocks_per_chunk=2,
        groups=[[0, 1]],
        tensors=tensors,
    )
    # Request blocks 1..3 (skip one block into chunk 3), then back into blocks 5..7.
    tier.submit_store(1, np.array([2, 3, 4], np.int32), [3], [1], [3, 0])
    tier.submit_load(2, np.array([5, 6, 7], np.int32), [3], [1], [3, 0])
    assert [job for job, *_ in tier.take_finished()] == [1, 2]
    for tensor, array in enumerate(tensors):
        assert [int(array[block][0]) for block in (5, 6, 7)] == [
            20 + tensor,
            30 + tensor,
            40 + tensor,
        ]
    assert (backing[0][:, PAGE:] == 0).all(), "the bytes past a page are not touched"
    tier.close()


def test_parse_cuda_handle_reads_pytorch_bytes_and_refuses_expandable_segments() -> None:
    memory_handle = bytes(range(64))
    assert kvshm.parse_cuda_handle(b"\x02c" + memory_handle) == memory_handle
    assert kvshm.parse_cuda_handle(memory_handle) == memory_handle
    with pytest.raises(kvshm.DeviceHandleError, match="expandable_segments:False"):
        kvshm.parse_cuda_handle(b"\x02e" + bytes(20))
    with pytest.raises(kvshm.DeviceHandleError, match="version"):
        kvshm.parse_cuda_handle(b"\x09c" + memory_handle)
