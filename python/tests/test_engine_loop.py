"""A Python engine loop over real ``kvshm worker`` processes, verifying every hit's bytes.

The loop is the one the README shows: hash the prompt, match, allocate, wait for the ticket,
"compute" the new blocks (write their bytes), commit, finish. A small device tier makes
prefixes move to the host tier and back, through the workers, on both ranks.
"""

import contextlib
import hashlib
import random
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvshm

BLOCK_TOKENS = 16
TP = 2
LAYERS = 2
REGIONS = 2 * LAYERS
REGION_BYTES = 256


def pattern(block_hash: int, region: int, rank: int) -> bytes:
    """The bytes an engine would have computed for one region of one block on one rank."""
    seed = f"{block_hash:032x}/{region}/{rank}".encode()
    return hashlib.shake_128(seed).digest(REGION_BYTES)


def wait_layer_by_layer(service: kvshm.Service, ticket: int) -> None:
    """Waits for a ticket as a layer-wise engine does, checking what it is told: the count of
    ready layers never goes back and ends at every layer."""
    ready, deadline = 0, time.monotonic() + 30
    while ready < LAYERS:
        assert time.monotonic() < deadline, f"ticket {ticket}: {ready} of {LAYERS} layers ready"
        service.poll()
        now = service.ticket_layers_ready(ticket)
        assert ready <= now <= LAYERS
        ready = now


def run_engine(service: kvshm.Service, requests: int, seed: int) -> dict[str, int]:
    """Serves `requests` requests two at a time, as a batching engine schedules them: both of a
    pair share a conversation prefix, both are matched and allocated before either waits (so the
    second shares the first one's storage loads), and the second commits first."""
    hasher = kvshm.BlockHasher(BLOCK_TOKENS, model="test-model")
    rng = random.Random(seed)
    conversations = [rng.sample(range(1000), 5 * BLOCK_TOKENS) for _ in range(6)]
    figures = {"verified": 0, "hits": 0, "shortened": 0, "shortened_to_nothing": 0}
    for first in range(0, requests, 2):
        # A conversation prefix plus a fresh tail: prefixes repeat, tails do not.
        shared = conversations[rng.randrange(len(conversations))][: rng.randrange(1, 5) * 16]
        batch = []
        for request in (first, first + 1):
            prompt = np.array(shared + rng.sample(range(1000, 2000), 20), dtype=np.int32)
            hashes = hasher.hash_prompt(prompt)
            found = service.match_prefix(request, hashes, len(prompt))
            batch.append((request, prompt, hashes, found))
        allocations = [
            service.allocate(request, len(prompt) - found.cached_tokens)
            for request, prompt, _, found in batch
        ]
        for (request, prompt, hashes, found), allocation in reversed(
            list(zip(batch, allocations, strict=True))
        ):
            if request % 2:
                wait_layer_by_layer(service, allocation.ticket)
            shortened = service.wait(allocation.ticket, timeout=30)
            # A storage miss shortens the hit: the positions from there on are computed below,
            # into the table the shortened hit carries (the allocation's may be stale there).
            if shortened is None:
                cached, table = found.blocks, np.asarray(allocation.block_table)
            else:
                assert shortened, "a shortened hit is truthy, even with nothing cached"
                cached, table = shortened.cached_blocks, np.asarray(shortened.block_table)
                assert list(table) == list(service.block_table(request))
                figures["shortened"] += 1
                figures["shortened_to_nothing"] += cached == 0
            assert cached <= found.blocks
            assert service.ticket_cached_blocks(allocation.ticket) == (
                None if shortened is None else shortened.cached_blocks
            )
            for position in range(cached):  # hits: the bytes must be what was computed
                for rank in range(TP):
                    for region in range(REGIONS):
                        got = service.read_device_region(rank, int(table[position]), region)
                        assert got == pattern(hashes[position], region, rank), (request, position)
                        figures["verified"] += 1
            for position in range(cached, len(hashes)):  # "compute" the new full blocks
                for rank in range(TP):
                    for region in range(REGIONS):
                        data = pattern(hashes[position], region, rank)
                        service.write_device_region(rank, int(table[position]), region, data)
            service.commit(request, len(prompt), hashes)
            figures["hits"] += cached
        for request, _, _, _ in batch:
            service.finish(request)
        service.check_invariants()
    return figures


def test_an_engine_loop_over_real_workers_reads_back_every_hit_byte_for_byte(
    name: str, spawn_worker
) -> None:
    with kvshm.Service(
        name,
        block_tokens=BLOCK_TOKENS,
        device_blocks=24,
        host_blocks=96,
        region_bytes=REGION_BYTES,
        tp_size=TP,
        layers=LAYERS,
        write_policy="write_back",
    ) as service:
        for rank in range(TP):
            spawn_worker(name, rank)
        service.wait_for_workers(timeout=20)
        figures = run_engine(service, requests=120, seed=7)
        stats = service.stats()
        assert figures["hits"] > 50
        assert figures["verified"] == figures["hits"] * TP * REGIONS
        assert stats["cache"]["swap_in_blocks"] > 0, "some hits came back from the host tier"
        assert stats["cache"]["swap_out_blocks"] > 0
        assert stats["service"]["copy_failures"] == 0


def test_wait_releases_the_gil_while_a_slow_copy_lands(name: str, spawn_worker) -> None:
    with kvshm.Service(
        name,
        block_tokens=BLOCK_TOKENS,
        device_blocks=5,
        host_blocks=16,
        region_bytes=REGION_BYTES,
        layers=LAYERS,
        write_policy="write_through",
    ) as service:
        # 150 ms after each layer of each copy.
        spawn_worker(name, 0, env={"KVSHM_WORKER_LAYER_DELAY_US": "150000"})
        service.wait_for_workers(timeout=20)
        hashes = kvshm.BlockHasher(BLOCK_TOKENS).hash_prompt(range(4 * BLOCK_TOKENS))
        service.match_prefix(1, hashes, 4 * BLOCK_TOKENS)
        service.allocate(1, 4 * BLOCK_TOKENS)
        service.commit(1, 4 * BLOCK_TOKENS, hashes)
        service.finish(1)
        assert service.wait_for_copies(timeout=30)  # the write-through backups
        other = kvshm.BlockHasher(BLOCK_TOKENS, model="other").hash_prompt(range(80))
        service.match_prefix(2, other, 80)
        service.allocate(2, 80)  # evicts the first prompt (metadata only: backed up)
        service.abort(2)
        found = service.match_prefix(3, hashes, 4 * BLOCK_TOKENS + 1)
        assert found.host_blocks == 4
        ticket = service.allocate(3, 1).ticket  # a swap-in of 2 slow layers

        ticks = 0
        stop = threading.Event()

        def count() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                time.sleep(0.001)

        counter = threading.Thread(target=count)
        counter.start()
        started = time.monotonic()
        service.wait(ticket, timeout=30)
        waited = time.monotonic() - started
        stop.set()
        counter.join()
        assert waited > 0.1, "the copy was slow"
        assert ticks > 20, f"another thread ran while wait() blocked ({ticks} ticks)"


@contextlib.contextmanager
def three_tier_service(
    name: str, spawn_worker, tmp_path, *, device: int, host: int, storage: int, slab: int
) -> Iterator[kvshm.Service]:
    """A service with a disk tier of `storage` blocks (slabs of `slab` blocks in `tmp_path`),
    its workers started on every rank."""
    with kvshm.Service(
        name,
        block_tokens=BLOCK_TOKENS,
        device_blocks=device,
        host_blocks=host,
        region_bytes=REGION_BYTES,
        tp_size=TP,
        layers=LAYERS,
        storage_blocks=storage,
    ) as service:
        args = ["--storage", f"disk:{tmp_path}", "--storage-blocks", str(slab)]
        for rank in range(TP):
            spawn_worker(name, rank, args=args)
        service.wait_for_workers(timeout=20)
        yield service


def test_an_engine_loop_over_three_tiers_reads_back_every_storage_hit_byte_for_byte(
    name: str, spawn_worker, tmp_path
) -> None:
    # A host tier too small for the working set: prefixes go down to a disk tier and come back
    # through host to device, on both ranks, in one ticket.
    with three_tier_service(
        name, spawn_worker, tmp_path, device=16, host=16, storage=256, slab=512
    ) as service:
        figures = run_engine(service, requests=160, seed=11)
        stats = service.stats()
        assert figures["verified"] == figures["hits"] * TP * REGIONS
        assert stats["cache"]["hits"]["storage_blocks"] > 0, stats["cache"]["hits"]
        assert stats["service"]["copy_failures"] == 0


def serve_prompt(
    service: kvshm.Service, request: int, hashes: kvshm.BlockHashes | list[int], tokens: int
) -> int:
    """Runs one request over real workers, checking its hit bytes; returns its host hits."""
    found = service.match_prefix(request, hashes, tokens)
    allocation = service.allocate(request, tokens - found.cached_tokens)
    service.wait(allocation.ticket, timeout=30)
    table = np.asarray(allocation.block_table)
    for position, block_hash in enumerate(hashes):
        for rank in range(TP):
            for region in range(REGIONS):
                if position < found.blocks:
                    got = service.read_device_region(rank, int(table[position]), region)
                    assert got == pattern(block_hash, region, rank), (request, position)
                else:
                    data = pattern(block_hash, region, rank)
                    service.write_device_region(rank, int(table[position]), region, data)
    service.commit(request, tokens, hashes)
    service.finish(request)
    service.check_invariants()
    return found.host_blocks


def test_a_prefetch_brings_a_prompt_up_from_disk_so_its_request_hits_on_host(
    name: str, spawn_worker, tmp_path
) -> None:
    with three_tier_service(
        name, spawn_worker, tmp_path, device=8, host=8, storage=64, slab=80
    ) as service:
        hasher = kvshm.BlockHasher(BLOCK_TOKENS, model="prefetch")
        prompt = hasher.hash_prompt(range(4 * BLOCK_TOKENS))
        serve_prompt(service, 0, prompt, 4 * BLOCK_TOKENS)
        # Other prompts push it through host down to the disk tier.
        for request in range(1, 6):
            other = hasher.hash_prompt(range(1000 * request, 1000 * request + 4 * BLOCK_TOKENS))
            serve_prompt(service, request, other, 4 * BLOCK_TOKENS)
        assert service.wait_for_copies(timeout=30)
        ticket = service.prefetch(prompt)
        assert ticket is not None
        service.wait(ticket, timeout=30)
        assert service.prefetch_status(ticket) == "ready"
        with pytest.raises(kvshm.TicketError):
            service.prefetch_status(ticket)  # read as done: forgotten
        assert serve_prompt(service, 10, prompt, 4 * BLOCK_TOKENS + 1) == 4
        stats = service.stats()
        assert stats["cache"]["prefetch_load_blocks"] >= 1, stats["cache"]


def test_prefetch_without_a_storage_tier_is_a_config_error(name: str) -> None:
    with (
        kvshm.Service(
            name,
            block_tokens=BLOCK_TOKENS,
            device_blocks=4,
            region_bytes=REGION_BYTES,
            layers=LAYERS,
        ) as service,
        pytest.raises(kvshm.ConfigError),
    ):
        service.prefetch([1, 2])


def test_damaged_disk_records_shorten_hits_and_the_engine_computes_those_blocks(
    name: str, spawn_worker, tmp_path
) -> None:
    # A storage miss is never a failed request: `wait` says how many leading blocks are still
    # cached, and the engine computes (and commits) the rest.
    with three_tier_service(
        name, spawn_worker, tmp_path, device=16, host=16, storage=256, slab=512
    ) as service:
        run_engine(service, requests=80, seed=11)
        assert service.wait_for_copies(timeout=30)
        slab = tmp_path / "default" / "rank-0.slab"
        damaged = bytearray(slab.read_bytes())
        for offset in range(100, len(damaged), 512):  # every record on rank 0
            damaged[offset] ^= 0x5A
        slab.write_bytes(bytes(damaged))
        figures = run_engine(service, requests=80, seed=11)
        stats = service.stats()
        assert figures["shortened"] > 0, stats["cache"]
        # Every record of rank 0 is damaged: some hits miss their first block, and `wait` still
        # returns a (truthy) shortened hit with nothing cached, never a falsy 0.
        assert figures["shortened_to_nothing"] > 0, figures
        assert figures["verified"] == figures["hits"] * TP * REGIONS
        assert stats["cache"]["load_missing_blocks"] > 0, stats["cache"]
        assert stats["cache"]["shortening_failed"] == 0
        assert stats["service"]["copy_failures"] == 0
        service.check_invariants()
