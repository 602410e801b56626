"""kvshm's vLLM worker path on a real GPU, without vLLM (these tests need a CUDA device and
torch built for it, and fail without one; ``scripts/gpu-check`` runs them on a GPU machine),
on a host tier of its own and on a shared one.

torch tensors shaped as vLLM's KV caches (per layer ``[2, blocks, tokens, heads, dim]`` in
bfloat16, K and V each a canonical tensor of whole blocks) go through kvshm's handle parsing
into a ``kvshm worker --backend cuda`` process (:class:`kvshm.cuda_tier.CudaHostTier`, the code
:class:`kvshm.vllm.KvshmOffloadingWorker` runs for GPU tensors); stores and loads are checked byte
for byte, and a copy worker killed in the middle of a store is restarted with the copy issued
again."""

import itertools
import os
import signal
import time

import pytest
import torch

import kvshm
from kvshm.cuda_tier import CudaHostTier, device_handle
from kvshm.shared_tier import TierIdentity, ensure_tier_owner, stop_tier

BLOCKS = 64
LAYERS = 4
TOKENS, HEADS, DIM = 16, 8, 64
PAGE = TOKENS * HEADS * DIM * 2  # one block of K (or V) of one layer, in bfloat16
BLOCKS_PER_CHUNK = 2
CHUNKS = 48

_names = itertools.count()


@pytest.fixture
def name() -> str:
    return f"py-gpu-{os.getpid()}-{next(_names)}"


def kv_tensors() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(per-layer caches, their K and V as canonical tensors), filled with random bits."""
    assert torch.cuda.is_available(), "these tests need a CUDA device"
    layers = [
        torch.empty((2, BLOCKS, TOKENS, HEADS, DIM), dtype=torch.bfloat16, device="cuda")
        for _ in range(LAYERS)
    ]
    for layer in layers:
        layer.view(torch.int16).random_(-(2**15), 2**15 - 1)
    return layers, [half for layer in layers for half in (layer[0], layer[1])]


def block_bytes(tensors: list[torch.Tensor], block: int) -> bytes:
    """Device block ``block`` as the host tier holds it: each tensor's page in turn."""
    pages = [
        tensor[block].contiguous().view(torch.uint8).cpu().numpy().tobytes() for tensor in tensors
    ]
    return b"".join(pages)


def make_tier(
    tensors: list[torch.Tensor],
    segment: str,
    persistent: bool = False,
    shared_tier: str | None = None,
) -> CudaHostTier:
    tier = CudaHostTier(
        tensors,
        page_bytes=PAGE,
        groups=[list(range(len(tensors)))],
        segment=segment,
        num_chunks=CHUNKS,
        blocks_per_chunk=BLOCKS_PER_CHUNK,
        persistent=persistent,
        shared_tier=shared_tier,
    )
    deadline = time.monotonic() + 60
    while not tier.tier.worker_up:
        assert time.monotonic() < deadline, "the copy worker did not come up"
        assert tier.take_finished() == []  # polls the tier: it sees the worker attach
        time.sleep(0.01)
    return tier


def run_job(
    tier: CudaHostTier, job: int, store: bool, blocks: list[int], first: int, chunks: list[int]
) -> int:
    """Submits one job (its blocks from request block ``first`` on) and waits; its bytes."""
    tier.submit(job, store, blocks, [len(blocks)], [first], kvshm.U32Array(chunks))
    tier.wait({job})
    finished = tier.take_finished()
    assert [(done[0], done[1]) for done in finished] == [(job, True)], finished
    return finished[0][2]


def test_a_tensors_handle_offset_and_stride_come_from_its_storage() -> None:
    _, tensors = kv_tensors()
    handle, offset, length, stride = device_handle(tensors[1], PAGE)
    assert len(handle) == 64
    assert offset == BLOCKS * PAGE, "V starts after K in the layer's allocation"
    assert (length, stride) == (BLOCKS * PAGE, PAGE)


def test_stores_and_loads_move_every_byte(name: str) -> None:
    layers, tensors = kv_tensors()
    tier = make_tier(tensors, name)
    try:
        expected = {block: block_bytes(tensors, block) for block in range(BLOCKS)}
        # Store 16 consecutive blocks, then 7 scattered ones starting one block into a chunk.
        stored = list(range(5, 21))
        assert run_job(tier, 1, True, stored, 0, list(range(8))) == 16 * 8 * PAGE
        scattered = [3, 60, 17, 41, 29, 8, 55]
        run_job(tier, 2, True, scattered, 1, [8, 9, 10, 11])
        host_of = {block: index for index, block in enumerate(stored)}
        host_of.update({block: 8 * BLOCKS_PER_CHUNK + 1 + i for i, block in enumerate(scattered)})
        for block, host in host_of.items():
            assert tier.tier.host_block(host) == expected[block], f"host copy of block {block}"

        # Scribble over the device, then load everything back to other blocks.
        for layer in layers:
            layer.view(torch.int16).fill_(0x5A5A)
        run_job(tier, 3, False, list(range(30, 46)), 0, list(range(8)))
        run_job(tier, 4, False, [0, 1, 2, 4, 6, 7, 9], 1, [8, 9, 10, 11])
        torch.cuda.synchronize()
        for device, block in zip(range(30, 46), stored, strict=True):
            assert block_bytes(tensors, device) == expected[block], f"loaded block {device}"
        for device, block in zip([0, 1, 2, 4, 6, 7, 9], scattered, strict=True):
            assert block_bytes(tensors, device) == expected[block], f"loaded block {device}"
        untouched = block_bytes(tensors, 50)
        assert untouched == bytes.fromhex("5a5a") * (len(untouched) // 2), "no stray writes"
    finally:
        tier.shutdown()


def test_a_copy_worker_killed_mid_store_is_restarted_and_the_store_issued_again(name: str) -> None:
    _, tensors = kv_tensors()
    # The first worker sleeps 2 s after copying, before it answers: killed in that window.
    os.environ["KVSHM_WORKER_LAYER_DELAY_US"] = "2000000"
    try:
        tier = make_tier(tensors, name)
    finally:
        del os.environ["KVSHM_WORKER_LAYER_DELAY_US"]
    try:
        assert tier.worker is not None
        first_pid = tier.worker.pid
        expected = {block: block_bytes(tensors, block) for block in range(BLOCKS)}
        blocks = list(range(BLOCKS - 32, BLOCKS))
        torch.cuda.synchronize()  # the store is handed to the worker at once
        tier.submit(7, True, blocks, [len(blocks)], [0], kvshm.U32Array(list(range(16))))
        time.sleep(0.3)
        assert tier.tier.pending == 1, "the store is in flight"
        os.kill(first_pid, signal.SIGKILL)
        started = time.monotonic()
        tier.wait({7})
        finished = tier.take_finished()
        print(f"store re-issued and done {time.monotonic() - started:.2f} s after the kill")
        assert [(done[0], done[1]) for done in finished] == [(7, True)], finished
        assert tier.worker.restarts == 1
        assert tier.worker.pid != first_pid
        for index, block in enumerate(blocks):
            assert tier.tier.host_block(index) == expected[block], f"host copy of block {block}"
    finally:
        tier.shutdown()


def test_a_persistent_tier_keeps_its_stores_and_keys_for_the_next_start(name: str) -> None:
    no_parent = 2**32 - 1
    _, tensors = kv_tensors()
    expected = {block: block_bytes(tensors, block) for block in range(BLOCKS)}
    first = make_tier(tensors, name, persistent=True)
    try:
        assert not first.tier.restored
        keys = [b"key-a", b"key-b"]
        first.submit(
            1,
            True,
            [7, 8, 9, 10],
            [4],
            [0],
            kvshm.U32Array([0, 1]),
            keys=keys,
            parents=kvshm.U32Array([no_parent, 0]),
        )
        first.wait({1})
        assert [(done[0], done[1]) for done in first.take_finished()] == [(1, True)]
    finally:
        first.shutdown()
    # The next start finds the chunks, their keys and their bytes.
    second = make_tier(tensors, name, persistent=True)
    try:
        assert second.tier.restored
        table = kvshm.read_tier_keys(name, CHUNKS, BLOCKS_PER_CHUNK)
        assert [(chunk, key, parent) for chunk, key, _, parent in table] == [
            (0, b"key-a", None),
            (1, b"key-b", 0),
        ]
        for host, block in enumerate([7, 8, 9, 10]):
            assert second.tier.host_block(host) == expected[block]
    finally:
        second.shutdown()


def test_two_engines_copy_through_one_shared_tier(name: str) -> None:
    """Two engines' copy workers on one shared tier's arena: what one stored, the other loads
    byte for byte into its own tensors."""
    _, first_tensors = kv_tensors()
    _, second_tensors = kv_tensors()
    tier_name = f"{name}-tier"
    identity = TierIdentity(
        model="m",
        kv_dtype="bfloat16",
        block_tokens=TOKENS,
        block_bytes=len(first_tensors) * PAGE,
        blocks_per_chunk=BLOCKS_PER_CHUNK,
        layout="gpu-test",
    )
    ensure_tier_owner(
        tier_name,
        identity,
        chunks=CHUNKS,
        ranks=1,
        arena_block_bytes=len(first_tensors) * PAGE,
        idle_exit_s=600,
    )
    first = second = None
    try:
        first = make_tier(first_tensors, f"{name}-a", shared_tier=tier_name)
        second = make_tier(second_tensors, f"{name}-b", shared_tier=tier_name)
        expected = {block: block_bytes(first_tensors, block) for block in range(8)}
        run_job(first, 1, True, list(range(8)), 0, [10, 11, 12, 13])
        run_job(second, 2, False, list(range(20, 28)), 0, [10, 11, 12, 13])
        torch.cuda.synchronize()
        for device, block in zip(range(20, 28), range(8), strict=True):
            assert block_bytes(second_tensors, device) == expected[block], f"block {device}"
            host = 10 * BLOCKS_PER_CHUNK + block
            assert second.tier.host_block(host) == expected[block], "the tier's copy"
    finally:
        for tier in (first, second):
            if tier is not None:
                tier.shutdown()
        stop_tier(tier_name)
