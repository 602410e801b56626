"""kvshm as vLLM's CPU offloading backend (vLLM 0.32).

vLLM's ``OffloadingConnector`` loads an out-of-tree spec by name::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"spec_name": "KvshmOffloadingSpec",
        "spec_module_path": "kvshm.vllm", "cpu_bytes_to_use": 32000000000}}'

- :class:`KvshmOffloadingSpec` builds both halves from vLLM's ``OffloadingConfig``.
- :class:`KvshmOffloadingManager` (scheduler process) is vLLM's ``OffloadingManager`` contract
  over kvshm's Rust manager: vLLM's keys (block hash + 4-byte group index) taken as opaque bytes,
  prefix chains rebuilt from each request's key order, leaf-first LRU, events.
- :class:`KvshmOffloadingWorker` (each TP worker process) copies blocks between vLLM's KV tensors
  and the rank's shared-memory host tier: in process for CPU tensors, and for CUDA tensors through
  a ``python -m kvshm worker --backend cuda`` process that opens the tensors by their CUDA IPC
  handles (:mod:`kvshm.cuda_tier`, which needs no vLLM). That process is started and, if it
  dies, restarted by this worker; copies in flight are issued again on the new one, so vLLM
  never sees a failed transfer.

Options (``kv_connector_extra_config``): ``cpu_bytes_to_use`` (host tier bytes over all ranks) or
``num_chunks``; ``eviction`` (``leaf_first``, default, or ``lru``); ``warm_restart`` (default
true: the host tier and a table of its keys outlive the engine, stopped or killed, and the next
engine of the same model and layout starts with them; for CPU and CUDA tensors alike. A reset
of the connector's cache, ``reset_prefix_cache(reset_connector=True)`` (vLLM's default reset leaves
the tier as it is), makes every key stored before it a miss, after restarts too; an engine started
on new weights under the same model name with no such reset between needs it false);
``segment_name`` (prefix of the per-rank segments ``<name>-r<rank>``; by default
``kvshm-vllm-<model>-<digest of the model, dtype and block layout>``, the same at every start);
``spawn_workers`` (default true: start the copy workers; false: start
``python -m kvshm worker --name <name>-r<rank> --rank 0 --backend cuda --device <gpu>`` yourself
(``<gpu>`` the rank's CUDA device index), adding
``--shared-tier <tier> --shared-tier-rank <rank>`` on a shared tier; a wait for copies that no
worker answers is logged as a warning every 30 s).

``shared_tier`` (a name, or ``true`` for the name derived from the model and block layout): the
engine's host tier is one several engines on this machine share (:mod:`kvshm.shared_tier`): a
block one engine stored is a hit for every other of the same model and layout. The first engine
starts the tier's owner process, sized by its ``cpu_bytes_to_use``; it exits once no engine has
used the tier for ``shared_tier_idle_exit_s`` (default 600) seconds, and with
``shared_tier_client_bytes`` gives each engine a quota (an engine at it evicts its own blocks,
never another's). An engine that finds the owner gone (killed, crashed) keeps serving (misses,
nothing stored) and starts a new one on the same arenas, at most every ``shared_tier_restart_s``
seconds (default 5; 0: never). ``shared_tier_storage`` (``disk:DIR`` or ``redis://...``) puts
a storage tier below the shared one: the owner writes every stored block there too and brings
an evicted one back when an engine asks for it (vLLM retries that request a step later);
``shared_tier_storage_bytes`` (over all ranks) sizes it on disk, by default 4 times the tier.
Copies run in the engine's own process for CPU tensors and in its copy workers
(``--shared-tier``) for GPU tensors; warm restart is not offered for a shared tier (the tier's
owner keeps its keys).
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvshm._kvshm import (
    ConfigError,
    SegmentError,
    VllmManagerCore,
    VllmSharedTierCore,
    read_tier_keys,
)
from kvshm._vllm_support import ACTIVITY_COUNTERS, USAGE_GAUGES, StatsReport, logger
from kvshm.shared_tier import (
    OwnerRestart,
    TierIdentity,
    ensure_tier_owner,
    remove_dead_engine_segments,
    wait_for_tier_owner,
)
from kvshm.vllm_worker import KvshmLoadStoreSpec, KvshmOffloadingWorker

if TYPE_CHECKING:
    from kvshm._kvshm import EvictionOrder

_EVICTION_ORDERS: dict[str, EvictionOrder] = {"leaf_first": "leaf_first", "lru": "lru"}


def _eviction_order(value: object) -> EvictionOrder:
    """The ``eviction`` option, checked when the spec is made, so that a misspelt one fails at
    start-up rather than in the scheduler's first step."""
    order = _EVICTION_ORDERS.get(str(value))
    if order is None:
        raise ConfigError(
            f"kv_connector_extra_config eviction {value!r} is not one of "
            f"{', '.join(_EVICTION_ORDERS)}"
        )
    return order


class KvshmOffloadingManager(VllmManagerCore, OffloadingManager):
    """vLLM's ``OffloadingManager`` over kvshm's Rust manager.

    The contract's methods (``lookup``, ``prepare_load``, ``touch``, ``complete_load``,
    ``prepare_store``, ``complete_store``, ``on_new_request``, ``on_request_finished``,
    ``take_events``, ``reset_cache``) are ``VllmManagerCore``'s, implemented in Rust: each of
    vLLM's calls is one crossing, with no Python frame in between. ``get_stats`` (once per
    engine step at most) reports the host tier's occupancy and what the manager did since.
    """

    def __new__(
        cls, num_chunks: int, eviction: EvictionOrder = "leaf_first", events: bool = False
    ) -> KvshmOffloadingManager:
        return super().__new__(
            cls, num_chunks, vllm_types=_vllm_types(), eviction=eviction, events=events
        )

    def __init__(
        self, num_chunks: int, eviction: EvictionOrder = "leaf_first", events: bool = False
    ) -> None:
        OffloadingManager.__init__(self)  # later vLLMs keep state there (the lock)
        self.num_chunks = num_chunks
        self._stats_report = StatsReport()

    @property
    def rust(self) -> VllmManagerCore:
        """The Rust manager (stats, invariants, keys)."""
        return self

    def get_stats(self) -> OffloadingConnectorStats | None:
        gauges, counters = self._stats_report.sample(self.stats())
        stats = OffloadingConnectorStats()
        for name, value in gauges.items():
            stats.set_gauge(name, value)
        for name, increase in counters.items():
            stats.increase_counter(name, increase)
        return stats

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def shutdown(self) -> None:
        return


class KvshmSharedOffloadingManager(VllmSharedTierCore, OffloadingManager):
    """vLLM's ``OffloadingManager`` over a host tier several engines share: a client of the
    tier's owner (``VllmSharedTierCore``, in Rust). ``get_stats`` reports this engine's
    lookups, loads and stores through the tier. One thread calls it at a time, as vLLM's
    scheduler does: a call waiting on the owner lets go of the GIL, and a call from another
    thread meanwhile raises ``RuntimeError`` (already borrowed)."""

    def __new__(
        cls,
        tier: str,
        identity: TierIdentity,
        restart: OwnerRestart | None = None,
        lease_chunks: int = 16,
    ) -> KvshmSharedOffloadingManager:
        return super().__new__(
            cls,
            tier,
            model=identity.model,
            kv_dtype=identity.kv_dtype,
            block_tokens=identity.block_tokens,
            block_bytes=identity.block_bytes,
            blocks_per_chunk=identity.blocks_per_chunk,
            layout=identity.layout,
            vllm_types=_vllm_types(),
            lease_chunks=lease_chunks,
        )

    def __init__(
        self,
        tier: str,
        identity: TierIdentity,
        restart: OwnerRestart | None = None,
        lease_chunks: int = 16,
    ) -> None:
        OffloadingManager.__init__(self)
        self.tier = tier
        self._restart = restart
        self._previous: dict[str, int] = {}

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Sends the queued calls; while the owner is gone, starts a new one (``restart``)."""
        super().on_schedule_end(context)
        if self._restart is None or self.connected:
            return
        try:
            started = self._restart.poll()
        except SegmentError as error:
            logger.warning("kvshm: %s", error)
            return
        if started is not None:
            logger.warning(
                "kvshm: the shared tier %s has no owner (%s); started one (pid %d)",
                self.tier,
                self.last_error,
                started,
            )

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        now = self.stats()
        for name, field, _ in ACTIVITY_COUNTERS:
            increase = now.get(field, 0) - self._previous.get(field, 0)
            if increase > 0:
                stats.increase_counter(name, increase)
        self._previous = now
        return stats

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def shutdown(self) -> None:
        self.flush()


def _vllm_types() -> tuple[Any, ...]:
    """vLLM's types that the Rust core returns."""
    return (
        (LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY),
        PrepareStoreOutput,
        KvshmLoadStoreSpec,
        OffloadingEvent,
        Medium.CPU,
        RequestOffloadingContext,
    )


def _segment_prefix(config: OffloadingConfig) -> str:
    """``segment_name``, or a name derived from what makes blocks interchangeable: the model, its
    KV dtype, the block layout (tokens and bytes per block, blocks per chunk, the groups' layers)
    and the parallel layout; never the engine id, which vLLM draws anew at every start. An
    engine started again with the same model and layout finds its tier under the same name. The
    page's byte layout (vLLM's resolved KV cache layout, which the attention backend picks) is
    not in the name but in the tier's key table: an engine whose pages lay their bytes out
    otherwise takes the tier's memory over and no key with it (``page_format``), whether the
    name was derived or given, and a kvshm of before that check finds its tier again."""
    named = config.extra_config.get("segment_name")
    if named:
        return str(named)
    parallel = config.parallel
    layout = (
        str(config.model.name),
        str(config.model.dtype),
        int(config.worker_kv_bytes_per_block),
        int(config.cache.blocks_per_chunk),
        tuple((group.tokens_per_block, tuple(group.layer_names)) for group in config.groups),
        (parallel.world_size, parallel.tp_size, parallel.pp_size, parallel.pcp_size),
        (parallel.dcp_size, parallel.data_parallel_index),
    )
    digest = hashlib.sha256(repr(layout).encode()).hexdigest()[:12]
    model = re.sub(r"[^A-Za-z0-9_-]", "-", str(config.model.name).rstrip("/").split("/")[-1])
    return f"kvshm-vllm-{model[:24]}-{digest}"


def _shared_identity(config: OffloadingConfig) -> TierIdentity:
    """What makes this engine's blocks interchangeable with another's: the model, its KV dtype,
    the block layout, the page's byte layout and the parallel layout; never the engine id or the
    data-parallel index, which differ between the engines that share."""
    parallel = config.parallel
    layout = (
        tuple((group.tokens_per_block, tuple(group.layer_names)) for group in config.groups),
        (parallel.world_size, parallel.tp_size, parallel.pp_size, parallel.pcp_size),
        parallel.dcp_size,
        str(config.kv_cache_layout),
    )
    return TierIdentity(
        model=str(config.model.name),
        kv_dtype=str(config.model.dtype),
        block_tokens=int(config.groups[0].tokens_per_block),
        block_bytes=int(config.worker_kv_bytes_per_block),
        blocks_per_chunk=int(config.cache.blocks_per_chunk),
        layout=repr(layout),
    )


def _restore(
    manager: KvshmOffloadingManager, segments: list[str], chunks: int, blocks_per_chunk: int
) -> int:
    """Takes back the keys every rank's persistent tier holds in the same chunk (oldest store
    first, under their parents where those came back); how many came back. The tables list only
    stores chosen since the last reset of the cache (their epoch). A key in two slots (evicted
    from one chunk, whose slot names it until the chunk is stored into again, and stored in
    another) comes back from the one written last; the other slot is stale."""
    tables = [read_tier_keys(segment, chunks, blocks_per_chunk) for segment in segments]
    held = [{chunk: key for chunk, key, _, _ in table} for table in tables[1:]]
    # Oldest store first: a key's last slot overwrites its earlier ones here.
    newest = {key: chunk for chunk, key, _, _ in tables[0]}
    by_chunk: dict[int, bytes] = {}
    for chunk, key, _, parent in tables[0]:
        if newest[key] != chunk or any(other.get(chunk) != key for other in held):
            continue
        manager.restore(key, chunk, by_chunk.get(parent) if parent is not None else None)
        by_chunk[chunk] = key
    return len(by_chunk)


class KvshmOffloadingSpec(OffloadingSpec):
    """vLLM's ``OffloadingSpec`` for kvshm: a Rust manager and shared-memory host tiers."""

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        definitions: dict[str, OffloadingMetricMetadata] = {
            name: OffloadingGaugeMetadata(documentation=doc) for name, _, doc in USAGE_GAUGES
        }
        for name, _, doc in ACTIVITY_COUNTERS:
            definitions[name] = OffloadingCounterMetadata(documentation=doc)
        return definitions

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        extra = self.extra_config
        world = max(int(config.parallel.world_size), 1)
        chunk_bytes = int(config.worker_kv_bytes_per_block) * int(self.blocks_per_chunk) * world
        if "num_chunks" in extra:
            self.num_chunks = int(extra["num_chunks"])
        elif extra.get("cpu_bytes_to_use"):
            self.num_chunks = int(extra["cpu_bytes_to_use"]) // chunk_bytes if chunk_bytes else 0
        else:
            raise ConfigError(
                "KvshmOffloadingSpec needs cpu_bytes_to_use (or num_chunks) in "
                "kv_connector_extra_config"
            )
        if self.num_chunks < 1:
            raise ConfigError(
                f"kvshm's host tier would hold no chunk: a chunk is {chunk_bytes} bytes (blocks "
                f"of {config.worker_kv_bytes_per_block} bytes, {self.blocks_per_chunk} a chunk, "
                f"on {world} ranks); give cpu_bytes_to_use at least that, or num_chunks >= 1"
            )
        self.eviction = _eviction_order(extra.get("eviction", "leaf_first"))
        self.segment_prefix = _segment_prefix(config)
        self.spawn_workers = bool(extra.get("spawn_workers", True))
        self.warm_restart = bool(extra.get("warm_restart", True))
        shared = extra.get("shared_tier")
        if shared and config.enable_kv_cache_events and extra.get("self_describing_kv_events"):
            # vLLM keeps each stored or hit key's payload until the manager reports the key
            # removed: a shared tier reports no events, so they would pile up for good.
            raise ConfigError(
                "self_describing_kv_events needs the tier's KV events, and a shared tier reports "
                "none (another engine's evictions are not this one's to announce): leave it off"
            )
        self.shared_identity = _shared_identity(config) if shared else None
        self.engines_prefix: str | None = None
        self.shared_tier: str | None = None
        self.shared_idle_exit_s = int(extra.get("shared_tier_idle_exit_s", 600))
        self.shared_restart_s = float(extra.get("shared_tier_restart_s", 5.0))
        quota_bytes = extra.get("shared_tier_client_bytes")
        self.shared_client_quota = (
            max(int(quota_bytes) // chunk_bytes, 1) if quota_bytes and chunk_bytes else None
        )
        storage = extra.get("shared_tier_storage")
        self.shared_storage: str | None = str(storage) if storage else None
        storage_bytes = extra.get("shared_tier_storage_bytes")
        self.shared_storage_chunks = (
            max(int(storage_bytes) // chunk_bytes, 1) if storage_bytes and chunk_bytes else None
        )
        if self.shared_identity is not None:
            named = shared if isinstance(shared, str) else None
            self.shared_tier = named or self.shared_identity.tier_name()
            # The engine's own segment (its copy counters) is this engine's alone.
            self.warm_restart = False
            if not extra.get("segment_name"):
                # The prefix of every engine's own segment: those of dead ones are removed at
                # start (get_manager).
                self.engines_prefix = self.segment_prefix
                engine = hashlib.sha256(str(config.engine_id).encode()).hexdigest()[:8]
                self.segment_prefix = f"{self.segment_prefix}-{engine}"
        self._manager: KvshmOffloadingManager | None = None
        self._shared_manager: KvshmSharedOffloadingManager | None = None
        self._worker: KvshmOffloadingWorker | None = None

    def segment(self, rank: int) -> str:
        """The host tier segment of worker rank ``rank``."""
        return f"{self.segment_prefix}-r{rank}"

    def get_manager(self) -> OffloadingManager:
        if self.shared_tier is not None and self.shared_identity is not None:
            if self._shared_manager is None:
                restart = None
                if self.shared_restart_s > 0:
                    restart = OwnerRestart(
                        self.shared_tier,
                        self.shared_identity,
                        ranks=max(int(self.config.parallel.world_size), 1),
                        idle_exit_s=self.shared_idle_exit_s,
                        client_quota=self.shared_client_quota,
                        storage=self.shared_storage,
                        storage_chunks=self.shared_storage_chunks,
                        interval_s=self.shared_restart_s,
                    )
                self._shared_manager = KvshmSharedOffloadingManager(
                    self.shared_tier, self.shared_identity, restart
                )
                # vLLM makes its workers (and so this engine's segments) before its scheduler.
                if self.engines_prefix is not None:
                    removed = remove_dead_engine_segments(self.engines_prefix)
                    if removed:
                        logger.info("kvshm: removed dead engines' segments %s", removed)
                logger.info(
                    "kvshm: sharing host tier %s (%s)",
                    self.shared_tier,
                    "attached" if self._shared_manager.connected else "its owner not up yet",
                )
            return self._shared_manager
        if self._manager is None:
            manager = KvshmOffloadingManager(
                self.num_chunks,
                eviction=self.eviction,
                events=self.kv_events_config.enable_kv_cache_events,
            )
            # vLLM makes its workers (and so their segments) before its scheduler.
            world = max(int(self.config.parallel.world_size), 1)
            segments = [self.segment(rank) for rank in range(world)]
            blocks = int(self.blocks_per_chunk)
            try:
                if self.warm_restart:
                    restored = _restore(manager, segments, self.num_chunks, blocks)
                    if restored:
                        logger.info("kvshm: %d keys back from the host tier", restored)
                manager.publish_to(segments, blocks, blocks * self.tokens_per_block[0])
            except SegmentError as error:
                logger.info("kvshm: no host tier segments to read or publish to: %s", error)
            self._manager = manager
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            layers = {name for group in self.config.groups for name in group.layer_names}
            rank = int(self.config.parallel.rank)
            segment = self.segment(rank)
            if self.shared_tier is not None:
                self._start_shared_tier(kv_caches, rank)
            try:
                self._worker = KvshmOffloadingWorker(
                    kv_caches,
                    segment=segment,
                    num_chunks=self.num_chunks,
                    blocks_per_chunk=int(self.blocks_per_chunk),
                    spawn_workers=self.spawn_workers,
                    block_tokens=int(self.tokens_per_block[0]),
                    layers=len(layers),
                    persistent=self.warm_restart,
                    shared_tier=self.shared_tier,
                    shared_rank=rank,
                    page_format=str(self.config.kv_cache_layout or ""),
                )
            except SegmentError as error:
                # Only a segment of the name that another process holds or is creating may be
                # another engine's; anything else (a full /dev/shm, another user's objects)
                # says what it is on its own.
                held = any(words in str(error) for words in ("in use", "being created"))
                hint = (
                    " (engines of one model and layout on one machine share a segment name: "
                    "give each its own segment_name)"
                    if held
                    else ""
                )
                raise SegmentError(f"kvshm's host tier {segment}: {error}{hint}") from error
        return self._worker

    def _start_shared_tier(self, kv_caches: CanonicalKVCaches, rank: int) -> None:
        """Rank 0 starts the shared tier's owner if none serves it (its arenas sized for this
        engine: ``num_chunks`` chunks of every KV tensor's page); the other ranks wait for it."""
        assert self.shared_tier is not None
        assert self.shared_identity is not None
        if rank != 0:
            wait_for_tier_owner(self.shared_tier, timeout_s=120.0)
            return
        page_bytes = sum(int(entry.page_size_bytes) for entry in kv_caches.tensors)
        ensure_tier_owner(
            self.shared_tier,
            self.shared_identity,
            chunks=self.num_chunks,
            ranks=max(int(self.config.parallel.world_size), 1),
            arena_block_bytes=page_bytes,
            idle_exit_s=self.shared_idle_exit_s,
            client_quota=self.shared_client_quota,
            storage=self.shared_storage,
            storage_chunks=self.shared_storage_chunks,
        )
