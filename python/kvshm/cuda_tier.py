"""One rank's host tier served by a copy worker process over the CUDA IPC handles of an engine's
KV tensors, with no vLLM in sight: what :class:`kvshm.vllm.KvshmOffloadingWorker` runs for GPU
tensors, usable (and tested on a GPU) on its own.

One job's path:

1. :meth:`CudaHostTier.submit` records a CUDA event on the caller's current stream behind the
   work that writes (or last wrote) the job's blocks, and queues the job;
2. jobs whose event has passed are handed, in order, to the rank's :class:`kvshm.HostTier`, which
   sends their block pairs to the ``kvshm worker --backend cuda`` process through the segment's
   rings; that process opened the tensors from their IPC handles and copies with its own stream;
3. :meth:`CudaHostTier.take_finished` and :meth:`CudaHostTier.wait` collect the results. A copy
   worker that died is restarted there (:class:`WorkerProcess`), and the copies it held are
   issued again on the new one, whole: the caller never sees a failed job for a crash. One that
   cannot start at all is given up with a :class:`kvshm.WorkerError`.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from kvshm._kvshm import (
    ConfigError,
    DeviceHandleError,
    HostTier,
    U32Array,
    WorkerError,
    parse_cuda_handle,
)
from kvshm._vllm_support import SlowWaitWarning, block_span

logger = logging.getLogger(__name__)

#: A store's keys, their parents' chunks and its manager's epoch, which a persistent tier records
#: (or ``None``).
_Keys = tuple[list[bytes], Any, int] | None
#: (job, whether it is a store, device block ids, group sizes, block indices, chunks, keys,
#: event).
_GatedJob = tuple[int, bool, Any, list[int], list[int], U32Array, _Keys, Any]


class WorkerProcess:
    """A ``python -m kvshm worker`` process for one rank, restarted whenever it exits, unless it
    cannot start: one that exited ``MAX_EARLY_EXITS`` times in a row, each time within
    ``STEADY_S`` of its start (a device it cannot open, a wrong command), is given up, and
    :meth:`ensure_running` raises :class:`kvshm.WorkerError` from then on. Its copies would never
    end otherwise, and the engine would wait for them forever."""

    RESTART_INTERVAL_S = 0.5
    STEADY_S = 30.0
    MAX_EARLY_EXITS = 5

    def __init__(self, command: list[str]) -> None:
        self._command = command
        self._process = self._start()
        self._started_at = time.monotonic()
        self.restarts = 0
        self._early_exits = 0
        self._given_up: str | None = None

    def _start(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self._command, stdin=subprocess.DEVNULL)

    def ensure_running(self) -> None:
        """Starts the process again if it exited (at most every ``RESTART_INTERVAL_S``).

        Raises:
            WorkerError: the process cannot start (class documentation).
        """
        if self._given_up is not None:
            raise WorkerError(self._given_up)
        if self._process.poll() is None:
            return
        ran = time.monotonic() - self._started_at
        if ran < self.RESTART_INTERVAL_S:
            return
        command, status = " ".join(self._command), self._process.returncode
        self._early_exits = self._early_exits + 1 if ran < self.STEADY_S else 0
        if self._early_exits >= self.MAX_EARLY_EXITS:
            self._given_up = (
                f"kvshm worker ({command}) exited {self._early_exits} times in a row within "
                f"{self.STEADY_S:g} s of its start, last with status {status}: giving up"
            )
            raise WorkerError(self._given_up)
        logger.warning("kvshm worker (%s) exited with %s; restarting it", command, status)
        self._process = self._start()
        self._started_at = time.monotonic()
        self.restarts += 1

    @property
    def pid(self) -> int:
        return self._process.pid

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


def device_handle(tensor: torch.Tensor, page_bytes: int) -> tuple[bytes, int, int, int]:
    """(CUDA IPC handle, offset of block 0, bytes its blocks span, block stride) of a CUDA KV
    tensor whose first dimension is the block, each block ``page_bytes`` long."""
    length, stride = block_span(
        tuple(tensor.shape), tensor.stride(), tensor.element_size(), page_bytes
    )
    shared = tensor.untyped_storage()._share_cuda_()
    handle, storage_offset = shared[1], int(shared[3])
    try:
        memory_handle = parse_cuda_handle(handle)
    except DeviceHandleError as error:
        raise DeviceHandleError(f"KV tensor on {tensor.device}: {error}") from error
    offset = storage_offset + int(tensor.storage_offset()) * tensor.element_size()
    return memory_handle, offset, length, stride


class CudaHostTier:
    """The host tier ``segment`` of one rank whose KV ``tensors`` are on a GPU (module flow).

    ``groups`` lists, per KV-cache group, the tensors its blocks live in (each must span every
    tensor: a copy worker copies whole blocks). With ``spawn_workers`` the copy worker is started
    here (``worker_command``, default ``python -m kvshm worker``) and restarted when it dies;
    without, the caller runs ``kvshm worker --name SEGMENT --rank 0 --backend cuda --device GPU``
    itself, ``GPU`` the tensors' CUDA device index (with
    ``--shared-tier SHARED_TIER --shared-tier-rank SHARED_RANK`` on a shared tier).
    A ``persistent`` tier keeps its chunks and the keys of its stores (given to :meth:`submit`)
    for the next start of the same ``page_format``, as :class:`kvshm.HostTier` does;
    ``block_tokens`` and ``layers`` are the engine's, for ``kvctl stat``. With ``shared_tier``
    the chunks are rank ``shared_rank``'s arena of that shared tier, which the copy worker maps
    (``--shared-tier``).
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        page_bytes: int,
        groups: list[list[int]],
        segment: str,
        num_chunks: int,
        blocks_per_chunk: int,
        spawn_workers: bool = True,
        worker_command: list[str] | None = None,
        block_tokens: int = 1,
        layers: int = 1,
        persistent: bool = False,
        shared_tier: str | None = None,
        shared_rank: int = 0,
        page_format: str = "",
    ) -> None:
        if not tensors:
            raise ConfigError("no KV tensors to offload")
        handles = [device_handle(tensor, page_bytes) for tensor in tensors]
        strides = {stride for _, _, _, stride in handles}
        if len(strides) != 1:
            raise ConfigError(
                "a kvshm worker process copies with one block stride for every KV tensor, "
                f"got {sorted(strides)}"
            )
        self._tier = HostTier(
            segment,
            page_bytes=page_bytes,
            device_blocks=int(tensors[0].shape[0]),
            chunks=num_chunks,
            blocks_per_chunk=blocks_per_chunk,
            groups=groups,
            tensor_count=len(tensors),
            block_tokens=block_tokens,
            layers=layers,
            persistent=persistent,
            shared_tier=shared_tier,
            shared_rank=shared_rank,
            page_format=page_format,
        )
        self._tier.publish_device_handles(handles)
        # Held so that the memory the copy worker opened stays allocated while the tier lives.
        self._tensors = list(tensors)
        self._gated: deque[_GatedJob] = deque()
        self.worker: WorkerProcess | None = None
        if spawn_workers:
            device = tensors[0].device.index or 0
            command = worker_command or [sys.executable, "-m", "kvshm", "worker"]
            shared = (
                ["--shared-tier", shared_tier, "--shared-tier-rank", str(shared_rank)]
                if shared_tier is not None
                else []
            )
            self.worker = WorkerProcess(
                [
                    *command,
                    *("--name", segment, "--rank", "0", "--backend", "cuda"),
                    *("--device", str(device)),
                    *shared,
                ]
            )

    @property
    def tier(self) -> HostTier:
        return self._tier

    def submit(
        self,
        job: int,
        store: bool,
        block_ids: Any,
        group_sizes: list[int],
        block_indices: list[int],
        chunks: U32Array,
        keys: list[bytes] | None = None,
        parents: Any = None,
        epoch: int = 0,
    ) -> None:
        """Queues a store (device blocks to chunks) or a load (chunks to device blocks) behind
        the work queued so far on the current CUDA stream (module flow, step 1). A store's
        ``keys`` (one per chunk) and ``parents`` (each key's parent chunk) go into a persistent
        tier's key table once the copy landed, with ``epoch``, its manager's when it chose the
        store."""
        # A store reads blocks the model is still writing, and a load writes blocks whose last
        # writes (zeroing) may still run: both wait for the work queued on the caller's stream.
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        stored = (keys, parents, epoch) if store and keys is not None else None
        self._gated.append(
            (job, store, block_ids, group_sizes, block_indices, chunks, stored, event)
        )
        self._release_gated()

    def _release_gated(self, block_for: set[int] | None = None) -> None:
        """Hands jobs whose compute has finished to the worker, in order; with ``block_for``,
        first waits for the compute of the last of those jobs (and so of every job before it:
        the events were recorded in order on one stream)."""
        if block_for:
            waiting = [index for index, gated in enumerate(self._gated) if gated[0] in block_for]
            if waiting:
                self._gated[waiting[-1]][7].synchronize()
        while self._gated and self._gated[0][7].query():
            job, store, block_ids, sizes, indices, chunks, stored, _ = self._gated.popleft()
            if stored is not None:
                keys, parents, epoch = stored
                self._tier.submit_store(
                    job, block_ids, sizes, indices, chunks, keys=keys, parents=parents, epoch=epoch
                )
            elif store:
                self._tier.submit_store(job, block_ids, sizes, indices, chunks)
            else:
                self._tier.submit_load(job, block_ids, sizes, indices, chunks)

    def take_finished(self) -> list[tuple[int, bool, int, float]]:
        """(job, success, bytes, seconds) of every job ended since the last call.

        Raises:
            WorkerError: the copy worker cannot start (:class:`WorkerProcess`).
        """
        if self.worker is not None:
            self.worker.ensure_running()
        self._release_gated()
        return self._tier.take_finished()

    def wait(self, job_ids: set[int]) -> None:
        """Returns once every job of ``job_ids`` has ended (collect them with
        :meth:`take_finished`), restarting a copy worker that died meanwhile.

        Raises:
            WorkerError: the copy worker cannot start (:class:`WorkerProcess`).
        """
        self._release_gated(block_for=set(job_ids))
        slow = SlowWaitWarning(job_ids, spawned_worker=self.worker is not None)
        while not self._tier.wait(list(job_ids), timeout=1.0):
            # A worker that died is restarted here; its copies are issued again on the new one.
            if self.worker is not None:
                self.worker.ensure_running()
            self._release_gated(block_for=set(job_ids))
            slow.check()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.stop()
        self._tier.close()
