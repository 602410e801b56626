"""Type stubs of the native module ``kvshm._kvshm`` (the PyO3 extension)."""

import sys
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any, Literal, Self, TypeAlias, final

if sys.version_info >= (3, 12):
    from collections.abc import Buffer
else:
    from typing_extensions import Buffer

__version__: str

EvictionOrder: TypeAlias = Literal["leaf_first", "lru"]
"""The host tier's eviction orders: leaf-first LRU (a key's parent never goes before it), or
plain LRU."""

class KvshmError(Exception):
    """Base class of every kvshm error."""

class ConfigError(KvshmError):
    """A configuration kvshm refuses (sizes, geometry, names, policies)."""

class SegmentError(KvshmError):
    """Creating, attaching to or mapping shared memory failed; or the service is closed."""

class RequestError(KvshmError):
    """An operation on a request that cannot be carried out."""

class UnknownRequestError(RequestError):
    """The request is not live."""

class DuplicateRequestError(RequestError):
    """The request is live already."""

class RequestFailedError(RequestError):
    """A swap-in the request waited on failed; abort it."""

class OutOfBlocksError(RequestError):
    """Not enough device blocks can be had; nothing changed."""

class CommitError(RequestError):
    """A commit that does not fit the request."""

class TicketError(KvshmError):
    """The ticket is not known."""

class TransferFailedError(KvshmError):
    """A copy the caller waited on failed on a rank."""

class KvshmTimeoutError(KvshmError):
    """A wait ran out of time."""

class ResetRefusedError(KvshmError):
    """Requests still hold blocks; reset with force."""

class ResizeError(KvshmError):
    """The device tier cannot take that size."""

class OffloadError(KvshmError):
    """An offload-manager or host-tier call on keys or blocks that do not allow it."""

class DeviceHandleError(KvshmError):
    """A tensor that cannot be shared with the worker processes."""

class WorkerError(KvshmError):
    """A worker or kvctl run that failed."""

IntegerBuffer: TypeAlias = Buffer | Iterable[int]
"""Token ids or block ids: a numpy integer array, ``array.array``, or a sequence of ints."""

HashesLike: TypeAlias = BlockHashes | Buffer | Iterable[int]
"""Block hashes: a ``BlockHashes``, 16 little-endian bytes per hash, or ints below 2**128."""

@final
class U32Array:
    """A read-only array of uint32 (buffer format ``I``): ``numpy.asarray`` wraps it. Pickles."""

    def __init__(self, values: Iterable[int] | Buffer) -> None: ...
    def __reduce__(self) -> tuple[type[U32Array], tuple[list[int]]]: ...
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> int: ...
    def __iter__(self) -> Iterator[int]: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def tolist(self) -> list[int]: ...

@final
class BlockHashes:
    """Chained 128-bit block hashes; its buffer is 16 little-endian bytes per hash."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> int: ...
    def __iter__(self) -> Iterator[int]: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def tolist(self) -> list[int]: ...
    def prefix(self, count: int) -> BlockHashes: ...
    def to_bytes(self) -> bytes: ...

@final
class BlockHasher:
    """Hashes token ids into chained block hashes of one namespace (model, LoRA, salt)."""

    def __init__(
        self,
        block_tokens: int,
        model: str = "",
        lora: str | None = None,
        salt: bytes | None = None,
    ) -> None: ...
    @property
    def block_tokens(self) -> int: ...
    @property
    def namespace_root(self) -> int: ...
    def hash_prompt(
        self, tokens: IntegerBuffer, mm_items: Iterable[tuple[int, int, int]] | None = None
    ) -> BlockHashes:
        """The hashes of every full block; ``mm_items`` are (start, length, content hash)."""

    def extend(
        self,
        hashes: HashesLike,
        tokens: IntegerBuffer,
        mm_items: Iterable[tuple[int, int, int]] | None = None,
    ) -> BlockHashes:
        """``hashes`` extended with the blocks of ``tokens`` that became full since."""

@final
class PrefixMatch:
    device_blocks: int
    host_blocks: int
    storage_blocks: int
    cached_tokens: int
    @property
    def blocks(self) -> int: ...

@final
class Allocation:
    ticket: int
    block_table: U32Array
    new_blocks: int

@final
class ShortenedHit:
    """What ``wait`` returns when the storage tier missed some hits (always truthy).

    The first ``cached_blocks`` positions hold cached KV; the engine computes the rest into
    ``block_table``, the request's table now. From ``cached_blocks`` on it may differ from
    ``Allocation.block_table`` (a request that shared a storage load with another one gets
    blocks of its own there): use this one."""

    cached_blocks: int
    block_table: U32Array

@final
class AllocationCheck:
    needed: int
    available: int
    @property
    def fits(self) -> bool: ...

@final
class Service:
    """The cache manager of one engine, its shared-memory segment and its worker processes."""

    def __init__(
        self,
        name: str,
        *,
        block_tokens: int,
        device_blocks: int,
        region_bytes: int,
        host_blocks: int = 0,
        tp_size: int = 1,
        layers: int = 1,
        regions: int | None = None,
        write_policy: str = "write_back",
        free_watermark: int = 0,
        backend: Literal["host", "cuda"] = "host",
        layerwise: bool = True,
        command_ring_slots: int = 4096,
        completion_ring_slots: int = 256,
        storage_blocks: int = 0,
        storage_write_policy: str = "write_back",
        storage_backoff: float = 1.0,
        storage_backoff_max: float = 30.0,
    ) -> None:
        """``storage_blocks`` (per rank) puts a storage tier below the host tier: start each
        worker with ``--storage disk:DIR`` (and ``--storage-blocks``, at least this many) or
        ``--storage redis://HOST:PORT``. A tier that fails is marked down (no hits, write-backs
        or prefetches go to it) until a probe reaches it, after ``storage_backoff`` seconds,
        doubling up to ``storage_backoff_max``."""
    @property
    def name(self) -> str: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def layers(self) -> int: ...
    @property
    def regions(self) -> int: ...
    @property
    def region_bytes(self) -> int: ...
    @property
    def block_tokens(self) -> int: ...
    @property
    def storage_tier_down(self) -> bool: ...
    def wait_for_workers(self, timeout: float = 10.0) -> None:
        """Polls until every rank has a live worker (GIL released)."""

    def rank_states(self) -> list[Literal["up", "starting", "down"]]: ...
    def lookup(self, hashes: HashesLike, prompt_tokens: int | None = None) -> tuple[int, int, int]:
        """(device hits, host hits, storage hits) of the leading blocks; no side effects. With
        the prompt's length, what match_prefix would hold (the last prompt token is left to
        compute)."""

    def match_prefix(self, request: int, hashes: HashesLike, prompt_tokens: int) -> PrefixMatch:
        """Holds the request's cached prefix; the last prompt token is left to compute."""

    def rematch(self, request: int, hashes: HashesLike, prompt_tokens: int) -> PrefixMatch: ...
    def release_match(self, request: int) -> None: ...
    def can_allocate(
        self, request: int, new_tokens: int, lookahead: int = 0
    ) -> AllocationCheck: ...
    def allocate(self, request: int, new_tokens: int, lookahead: int = 0) -> Allocation: ...
    def block_table(self, request: int) -> U32Array: ...
    def commit(self, request: int, computed_tokens: int, hashes: HashesLike) -> tuple[int, int]:
        """Caches the computed full blocks; returns (inserted, duplicates)."""

    def finish(self, request: int) -> None: ...
    def abort(self, request: int) -> None: ...
    def reset(self, force: bool = False) -> list[int]:
        """Drops every cached block; returns the requests a forced reset ended."""

    def take_requests_dropped_by_kvctl(self) -> list[int]: ...
    def resize_device(self, blocks: int) -> None: ...
    def common_prefix_blocks(self, request: int) -> int: ...
    def poll(self) -> None: ...
    def wait(self, ticket: int, timeout: float = 30.0) -> ShortenedHit | None:
        """Waits until the ticket's blocks are ready (GIL released).

        Returns ``None`` when every hit is in its blocks, or a :class:`ShortenedHit` when the
        storage tier missed some hits (a lost or damaged object, a tier that is down): its
        ``cached_blocks`` leading positions are cached, and the engine computes the positions
        from there on into its ``block_table`` (not ``Allocation.block_table``, which may be
        stale from there on), and commits them as usual. A storage miss never fails a request.
        """

    def wait_for_copies(self, timeout: float = 30.0) -> bool: ...
    def prefetch(self, hashes: HashesLike) -> int | None:
        """Starts storage loads (and a query of a shared tier) for a prompt; returns the ticket."""

    def prefetch_status(self, ticket: int) -> Literal["ready", "pending"]:
        """A prefetch ticket's status; forgotten once read as done. A storage miss is no
        failure: the ticket ends ``"ready"`` (the blocks that landed are on host; ``stats()``
        counts the misses)."""

    def ticket_status(self, ticket: int) -> Literal["ready", "shortened", "pending"]: ...
    def ticket_cached_blocks(self, ticket: int) -> int | None:
        """Leading positions still cached when a storage miss shortened the hit, else None."""
    def ticket_layers_ready(self, ticket: int) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def check_invariants(self) -> None: ...
    def write_device_region(self, rank: int, block: int, region: int, data: Buffer) -> None: ...
    def read_device_region(self, rank: int, block: int, region: int) -> bytes: ...
    def read_host_region(self, rank: int, block: int, region: int) -> bytes: ...
    def close(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...

class OffloadManager:
    """The host tier's keys (opaque bytes, up to 64), chunks and leaf-first LRU evictions."""

    def __init__(
        self,
        chunks: int,
        *,
        tag_bytes: int = 0,
        eviction: EvictionOrder = "leaf_first",
        events: bool = False,
    ) -> None: ...
    def lookup(self, key: bytes, request: str) -> Literal[0, 1, 2]:
        """0 miss, 1 hit (loadable), 2 hit pending (being stored)."""

    def on_new_request(self, request: str) -> None: ...
    def prepare_load(self, keys: Iterable[bytes], request: str) -> U32Array: ...
    def complete_load(self, keys: Iterable[bytes]) -> None: ...
    def touch(self, keys: Iterable[bytes]) -> None: ...
    def prepare_store(
        self, keys: Sequence[bytes], request: str
    ) -> tuple[list[int], U32Array, list[bytes]] | None:
        """``None`` if it cannot store; else (indices to store, their chunks, evicted keys)."""

    def complete_store(self, keys: Iterable[bytes], success: bool = True) -> None: ...
    def restore(self, key: bytes, chunk: int, parent: bytes | None = None) -> None:
        """Takes ``key`` back into ``chunk`` as stored (a persistent tier's keys at start)."""
    def on_request_finished(self, request: str, positions: Sequence[int] | None = None) -> None: ...
    def request_keys(self, request: str) -> list[bytes]: ...
    def take_events(self) -> list[tuple[bool, list[bytes]]]: ...
    def reset(self) -> None: ...
    def chunk_of(self, key: bytes) -> int | None: ...
    def parent_of(self, key: bytes) -> bytes | None: ...
    def keys(self) -> dict[bytes, bool]: ...
    def __len__(self) -> int: ...
    def stats(self) -> dict[str, int]: ...
    def check_invariants(self) -> None: ...

def run_worker(argv: list[str]) -> int:
    """``kvshm worker`` with ``argv``; returns the exit status."""

def run_kvctl(argv: list[str]) -> int:
    """``kvctl`` with ``argv``; returns the exit status."""

@final
class HostTier:
    """One rank's shared-memory host tier and the copies between it and the engine's tensors."""

    def __init__(
        self,
        name: str,
        *,
        page_bytes: int,
        device_blocks: int,
        chunks: int,
        blocks_per_chunk: int,
        groups: list[list[int]],
        tensors: Sequence[Buffer] | None = None,
        tensor_count: int | None = None,
        block_tokens: int = 1,
        layers: int = 1,
        persistent: bool = False,
        shared_tier: str | None = None,
        shared_rank: int = 0,
        page_format: str = "",
    ) -> None:
        """With ``tensors`` (2-D, one row per block) copies run in process; without, a
        ``kvshm worker --backend cuda`` process copies after ``publish_device_handles``.
        ``block_tokens`` and ``layers`` are the engine's, for ``kvctl stat``. A ``persistent``
        tier's keys are taken back by the next tier of its name, shape and ``page_format`` (the
        engine's name for how a page lays its bytes out, vLLM's KV cache layout) only. With
        ``shared_tier``, the chunks are rank ``shared_rank``'s arena of that shared tier, copied
        in process or by a worker started with ``--shared-tier SHARED_TIER --shared-tier-rank
        SHARED_RANK``."""

    @property
    def name(self) -> str: ...
    @property
    def worker_up(self) -> bool: ...
    @property
    def pending(self) -> int: ...
    def publish_device_handles(self, handles: list[tuple[bytes, int, int, int]]) -> None:
        """(CUDA IPC handle, offset of block 0, bytes, block stride) per tensor."""

    @property
    def restored(self) -> bool:
        """This persistent tier took over the chunks and keys an earlier one left."""

    def submit_store(
        self,
        job: int,
        device: IntegerBuffer,
        group_sizes: IntegerBuffer,
        block_indices: IntegerBuffer,
        chunks: IntegerBuffer,
        keys: Iterable[bytes] | None = None,
        parents: IntegerBuffer | None = None,
        epoch: int = 0,
    ) -> None: ...
    def submit_load(
        self,
        job: int,
        device: IntegerBuffer,
        group_sizes: IntegerBuffer,
        block_indices: IntegerBuffer,
        chunks: IntegerBuffer,
    ) -> None: ...
    def take_finished(self) -> list[tuple[int, bool, int, float]]:
        """(job, success, bytes, seconds) of the jobs that ended."""

    def wait(self, jobs: list[int], timeout: float = 60.0) -> bool: ...
    def host_block(self, block: int) -> bytes | None: ...
    def close(self) -> None: ...

class VllmManagerCore(OffloadManager):
    """vLLM's ``OffloadingManager`` methods over the Rust manager (``kvshm.vllm`` subclasses it).

    The contract methods take vLLM's arguments (a ``ReqContext``) and return vLLM's types; the
    inspection methods are ``OffloadManager``'s."""

    def __new__(
        cls,
        chunks: int,
        *,
        vllm_types: tuple[Any, ...],
        eviction: EvictionOrder = "leaf_first",
        events: bool = False,
        tag_bytes: int = 4,
    ) -> Self: ...
    def publish_to(self, segments: list[str], key_blocks: int, key_tokens: int) -> None:
        """Publishes the manager's figures to these host tier segments (``kvctl stat``) after
        every finished request; a key is ``key_blocks`` blocks of ``key_tokens`` tokens."""
    def publish_counters(self) -> None: ...
    def lookup(self, key: bytes, req_context: Any) -> Any: ...
    def on_new_request(self, req_context: Any) -> Any: ...
    def prepare_load(self, keys: Iterable[bytes], req_context: Any) -> Any: ...
    def touch(self, keys: Iterable[bytes], req_context: Any) -> None: ...  # type: ignore[override]
    def complete_load(self, keys: Iterable[bytes], req_context: Any) -> None: ...  # type: ignore[override]
    def prepare_store(self, keys: Iterable[bytes], req_context: Any) -> Any: ...
    def complete_store(  # type: ignore[override]
        self, keys: Iterable[bytes], req_context: Any, success: bool = True
    ) -> None: ...
    def on_request_finished(self, req_context: Any) -> None: ...  # type: ignore[override]
    def take_events(self) -> list[Any]: ...
    def reset_cache(self) -> None: ...

class VllmSharedTierCore:
    """vLLM's ``OffloadingManager`` methods over a host tier several engines share, as a client
    of its owner (``kvshm.vllm`` subclasses it). A key a lookup finds stays pinned for the
    request until its load ends or the request finishes."""

    def __new__(
        cls,
        tier: str,
        *,
        model: str,
        kv_dtype: str,
        block_tokens: int,
        block_bytes: int,
        blocks_per_chunk: int,
        layout: str,
        vllm_types: tuple[Any, ...],
        answer_deadline_s: float = 1.0,
        lease_chunks: int = 16,
    ) -> Self: ...
    @property
    def connected(self) -> bool:
        """Whether the tier's owner serves this engine now."""
    @property
    def last_error(self) -> str | None: ...
    def lookup(self, key: bytes, req_context: Any) -> Any: ...
    def on_new_request(self, req_context: Any) -> Any: ...
    def prepare_load(self, keys: Iterable[bytes], req_context: Any) -> Any: ...
    def touch(self, keys: Iterable[bytes], req_context: Any) -> None: ...
    def complete_load(self, keys: Iterable[bytes], req_context: Any) -> None: ...
    def prepare_store(self, keys: Iterable[bytes], req_context: Any) -> Any: ...
    def complete_store(
        self, keys: Iterable[bytes], req_context: Any, success: bool = True
    ) -> None: ...
    def on_request_finished(self, req_context: Any) -> None: ...
    def on_schedule_end(self, context: Any) -> None:
        """Sends the calls queued for the owner (pins let go, stores done, requests ended)
        that have waited since the previous step's end, without waiting for the owner."""
    def has_pending_work(self) -> bool:
        """Sends the queued calls without waiting for the owner (but for an earlier batch it has
        not answered), and returns ``False``: vLLM asks only when its engine would go idle
        otherwise, and the owner carries them out with no step of the engine's. Never raises."""
    def flush(self) -> None:
        """Sends the queued calls now, and waits until the owner has carried out every call
        sent."""
    def take_events(self) -> list[Any]: ...
    def reset_cache(self) -> None: ...
    def stats(self) -> dict[str, int]:
        """This engine's counters: lookups, lookup_hits, owner_calls (batches sent),
        owner_waits (those waited for), keys_loaded,
        keys_stored, stores_refused, stores_failed, connected (0 or 1)."""

def shared_tier_name(
    *,
    model: str,
    kv_dtype: str,
    block_tokens: int,
    block_bytes: int,
    blocks_per_chunk: int,
    layout: str,
) -> str:
    """The name of the shared tier of blocks of this identity."""

def shared_tier_owner(name: str, *, setting_up: bool = False) -> int | None:
    """The pid of the live owner of shared tier ``name``, or ``None``; with ``setting_up``, also
    that of a live owner still setting up, closed to engines."""

def shared_tier_clients(name: str) -> list[dict[str, Any]]:
    """Shared tier ``name``'s clients as its owner published them (``kvctl tier``): ``slot``,
    ``state``, ``pid``, ``chunks``, ``pins``, ``storing``, ``calls``."""

def run_tier_owner(argv: list[str]) -> int: ...
def read_tier_keys(
    name: str, chunks: int, blocks_per_chunk: int
) -> list[tuple[int, bytes, int, int | None]]:
    """``(chunk, key, seq, parent chunk)`` of a persistent host tier, oldest store first."""

def parse_cuda_handle(handle: bytes) -> bytes:
    """The 64-byte ``cudaIpcMemHandle_t`` in ``storage._share_cuda_()[1]``; refuses expandable
    segments with ``DeviceHandleError``."""
