"""kvshm: a KV-cache manager for LLM serving engines, in Rust, for Python.

- :class:`Service` is the scheduler API for engines that let kvshm own both KV tiers: a radix
  prefix cache over chained block hashes, device and host block pools, and copy workers
  (``python -m kvshm worker --name NAME --rank R``) driven through shared memory.
- :class:`BlockHasher` turns token ids into the chained 128-bit block hashes it keys on.
- :mod:`kvshm.vllm` plugs kvshm into vLLM's offloading connector (imported on demand, so that
  ``import kvshm`` works without vLLM).
- Every failure of kvshm's is a :class:`KvshmError` (a bad argument is ``TypeError`` or
  ``ValueError``); block tables are read-only buffers (``numpy.asarray``).

``HashesLike`` and ``IntegerBuffer``, the argument types of hashes and of token or block ids, are
type aliases of the stubs: use them in annotations (``from kvshm import HashesLike`` under
``typing.TYPE_CHECKING``); they do not exist at run time.
"""

from typing import TYPE_CHECKING

from kvshm._kvshm import (
    Allocation,
    AllocationCheck,
    BlockHasher,
    BlockHashes,
    CommitError,
    ConfigError,
    DeviceHandleError,
    DuplicateRequestError,
    HostTier,
    KvshmError,
    KvshmTimeoutError,
    OffloadError,
    OffloadManager,
    OutOfBlocksError,
    PrefixMatch,
    RequestError,
    RequestFailedError,
    ResetRefusedError,
    ResizeError,
    SegmentError,
    Service,
    ShortenedHit,
    TicketError,
    TransferFailedError,
    U32Array,
    UnknownRequestError,
    WorkerError,
    __version__,
    parse_cuda_handle,
    read_tier_keys,
)

if TYPE_CHECKING:
    from kvshm._kvshm import HashesLike as HashesLike
    from kvshm._kvshm import IntegerBuffer as IntegerBuffer

__all__ = [
    "Allocation",
    "AllocationCheck",
    "BlockHasher",
    "BlockHashes",
    "CommitError",
    "ConfigError",
    "DeviceHandleError",
    "DuplicateRequestError",
    "HostTier",
    "KvshmError",
    "KvshmTimeoutError",
    "OffloadError",
    "OffloadManager",
    "OutOfBlocksError",
    "PrefixMatch",
    "RequestError",
    "RequestFailedError",
    "ResetRefusedError",
    "ResizeError",
    "SegmentError",
    "Service",
    "ShortenedHit",
    "TicketError",
    "TransferFailedError",
    "U32Array",
    "UnknownRequestError",
    "WorkerError",
    "__version__",
    "parse_cuda_handle",
    "read_tier_keys",
]
