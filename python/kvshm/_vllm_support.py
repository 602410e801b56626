"""The parts of :mod:`kvshm.vllm` that need neither vLLM nor torch, so that they can be tested
without them: the byte range a CUDA KV tensor's blocks span, and the warning of a copy wait that
goes on too long."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

from kvshm._kvshm import ConfigError

# Under vLLM's own logger, so that its handler and level (VLLM_LOGGING_LEVEL) apply: a logger of
# our own would have no handler, and its INFO lines (a warm restart's "keys back from the host
# tier") would reach no one.
logger = logging.getLogger("vllm.kvshm")

#: A wait for copy jobs that has not ended after this long is logged as a warning.
WAIT_WARN_AFTER_S = 30.0


def block_span(
    shape: Sequence[int], strides: Sequence[int], element_size: int, page_bytes: int
) -> tuple[int, int]:
    """(bytes from the start of block 0 to the end of the last block, block stride in bytes) of a
    KV tensor whose first dimension is the block, each block ``page_bytes`` long.

    The span is what a copy worker may touch: ``stride * (blocks - 1) + page_bytes``. It is
    refused (``ConfigError``) unless it lies inside the tensor's real extent (from its first
    element to the end of its last, whatever its shape and strides), and unless blocks do not
    overlap (``page_bytes <= stride``).
    """
    if not shape or any(size <= 0 for size in shape) or len(strides) != len(shape):
        raise ConfigError(f"a KV tensor of shape {tuple(shape)} holds no blocks")
    if element_size <= 0 or page_bytes <= 0 or any(step < 0 for step in strides):
        raise ConfigError(
            f"a KV tensor of element size {element_size}, strides {tuple(strides)} and page "
            f"size {page_bytes} cannot be copied block by block"
        )
    blocks = shape[0]
    stride = strides[0] * element_size
    if blocks > 1 and page_bytes > stride:
        raise ConfigError(
            f"the KV tensor's blocks overlap: {page_bytes} bytes each, {stride} bytes apart"
        )
    extent = (
        sum((size - 1) * step for size, step in zip(shape, strides, strict=True)) + 1
    ) * element_size
    span = stride * (blocks - 1) + page_bytes
    if span > extent:
        raise ConfigError(
            f"{blocks} blocks of {page_bytes} bytes, {stride} bytes apart, need {span} bytes; "
            f"the KV tensor of shape {tuple(shape)} spans {extent}"
        )
    return span, stride


class SlowWaitWarning:
    """Logs a warning when a wait for copy jobs goes on past ``after_s`` seconds, then again
    every ``after_s`` seconds, saying what may be missing: no copy worker answers."""

    def __init__(
        self,
        jobs: Iterable[int],
        *,
        spawned_worker: bool,
        after_s: float = WAIT_WARN_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._jobs = sorted(jobs)
        self._spawned_worker = spawned_worker
        self._after_s = after_s
        self._clock = clock
        self._started = clock()
        self._next = self._started + after_s

    def check(self) -> bool:
        """Warns if the next warning is due; whether it warned."""
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + self._after_s
        hint = (
            "the copy worker this process started does not answer"
            if self._spawned_worker
            else "spawn_workers is false: is a `python -m kvshm worker --backend cuda` process "
            "running for this rank's segment?"
        )
        logger.warning(
            "kvshm: still waiting for copy jobs %s after %.0f s; %s",
            self._jobs[:8],
            now - self._started,
            hint,
        )
        return True


#: The host tier's occupancy, as fractions of its chunks: (metric name, stats field, help).
USAGE_GAUGES: tuple[tuple[str, str, str], ...] = (
    (
        "vllm:kv_offload_kvshm_cache_usage_perc",
        "chunks_used",
        "Fraction of kvshm's host-tier chunks that hold a key (stored or being stored).",
    ),
    (
        "vllm:kv_offload_kvshm_cache_write_usage_perc",
        "chunks_storing",
        "Fraction of kvshm's host-tier chunks being written by stores not yet completed.",
    ),
    (
        "vllm:kv_offload_kvshm_cache_read_usage_perc",
        "chunks_loading",
        "Fraction of kvshm's host-tier chunks pinned by loads not yet completed.",
    ),
)

#: What the manager did since the previous report: (metric name, stats field, help).
ACTIVITY_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("vllm:kv_offload_kvshm_lookups", "lookups", "Keys looked up in kvshm's host tier."),
    ("vllm:kv_offload_kvshm_lookup_hits", "lookup_hits", "Keys found in kvshm's host tier."),
    ("vllm:kv_offload_kvshm_keys_stored", "keys_stored", "Keys stored into kvshm's host tier."),
    ("vllm:kv_offload_kvshm_keys_loaded", "keys_loaded", "Keys loaded from kvshm's host tier."),
    (
        "vllm:kv_offload_kvshm_stores_refused",
        "stores_refused",
        "Stores refused because no chunk could be freed (every chunk pinned or being written).",
    ),
    (
        "vllm:kv_offload_kvshm_stores_failed",
        "stores_failed",
        "Stores whose copy failed (their chunks were returned).",
    ),
    ("vllm:kv_offload_kvshm_evictions", "evictions", "Keys evicted from kvshm's host tier."),
)


class StatsReport:
    """Turns the Rust manager's cumulative statistics into what vLLM's ``get_stats`` reports:
    the occupancy gauges, and for each counter the increase since the previous report (a counter
    that went down, as after the manager was rebuilt, reports its whole new value)."""

    def __init__(self) -> None:
        self._previous: dict[str, int] = {}

    def sample(self, stats: dict[str, int]) -> tuple[dict[str, float], dict[str, int]]:
        """(gauges, counter increases) for the statistics ``stats`` (``VllmManagerCore.stats``).
        Counters that did not move are left out."""
        chunks = stats["chunks"]
        gauges = {
            name: (stats[field] / chunks if chunks else 0.0) for name, field, _ in USAGE_GAUGES
        }
        increases: dict[str, int] = {}
        for name, field, _ in ACTIVITY_COUNTERS:
            now = stats[field]
            before = self._previous.get(field, 0)
            increase = now - before if now >= before else now
            if increase:
                increases[name] = increase
            self._previous[field] = now
        return gauges, increases
