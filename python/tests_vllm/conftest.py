"""Tests that need vLLM 0.32 (run by scripts/test-vllm inside its venv)."""

import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

_counter = itertools.count()

#: Where vLLM's processes keep the shared memory of their message queues (Python's
#: ``multiprocessing`` names): a process SIGKILLed leaves them behind.
_SHM = Path("/dev/shm")
_VLLM_SHM_PREFIXES = ("psm_", "sem.mp-")


def _vllm_shm_objects() -> set[str]:
    return {p.name for p in _SHM.iterdir() if p.name.startswith(_VLLM_SHM_PREFIXES)}


def _mapped_shm_objects() -> set[str]:
    """The /dev/shm objects some live process maps (any user's we may read)."""
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            at = line.find("/dev/shm/")
            if at >= 0:
                mapped.add(line[at + len("/dev/shm/") :].split(" ")[0])
    return mapped


@pytest.fixture(scope="session", autouse=True)
def _no_vllm_shared_memory_left_behind() -> Iterator[None]:
    """The engines these tests SIGKILL (a crash, on purpose) leave vLLM's shared memory in
    /dev/shm: at the end, the objects that appeared during the tests and that no live process
    maps are removed, so that runs do not fill it."""
    before = _vllm_shm_objects()
    yield
    for name in _vllm_shm_objects() - before - _mapped_shm_objects():
        (_SHM / name).unlink(missing_ok=True)


@pytest.fixture
def name(request: pytest.FixtureRequest) -> str:
    return f"pyv-{request.node.name.replace('_', '')[:20]}-{os.getpid()}-{next(_counter)}"


def make_offloading_config(
    extra: dict,
    world_size: int = 2,
    *,
    tokens_per_block: int = 16,
    bytes_per_block: int = 64 * 1024,
    events: bool = True,
) -> OffloadingConfig:
    """The OffloadingConfig vLLM hands a spec: one group of `tokens_per_block`-token blocks."""
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(
                tokens_per_block=tokens_per_block, layer_names=("l0",), group_id=0
            ),
        ),
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=events,
        extra_config=extra,
        engine_id="engine/0",
        model=OffloadingModelConfig(name="m", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_block, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


@pytest.fixture
def offloading_config() -> Callable[..., OffloadingConfig]:
    """Builds the OffloadingConfig vLLM hands a spec (one group, 16-token blocks)."""
    return make_offloading_config
