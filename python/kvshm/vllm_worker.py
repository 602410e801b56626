"""vLLM's worker side of kvshm (vLLM 0.32): the spec that names a load's or store's chunks, and
the worker that copies between one rank's KV tensors and its host tier. :mod:`kvshm.vllm`
builds them and re-exports both."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvshm._kvshm import ConfigError, HostTier, U32Array
from kvshm._vllm_support import logger
from kvshm.cuda_tier import CudaHostTier


class KvshmLoadStoreSpec(LoadStoreSpec):
    """Chunks of kvshm's host tier, one per key, in key order; a store's spec also names the
    keys, their parents' chunks and the manager's epoch (raised by each reset of its cache),
    which a persistent tier records for a warm restart. It pickles: vLLM sends it to its worker
    processes."""

    def __init__(
        self,
        chunks: U32Array,
        keys: list[bytes] | None = None,
        parents: U32Array | None = None,
        epoch: int = 0,
    ) -> None:
        self.chunks = chunks
        self.keys = keys
        self.parents = parents
        self.epoch = epoch

    @property
    def block_ids(self) -> np.ndarray:
        """The chunk ids as int32, as vLLM's block-id specs hold them."""
        return np.asarray(self.chunks).view(np.int32)

    def __repr__(self) -> str:
        return f"KvshmLoadStoreSpec({self.chunks.tolist()})"


def _int_list(values: Iterable[int]) -> list[int]:
    return [int(value) for value in values]


class KvshmOffloadingWorker(OffloadingWorker):
    """Copies between one rank's vLLM KV tensors and its shared-memory host tier: in process for
    CPU tensors, through a copy worker process (:class:`kvshm.cuda_tier.CudaHostTier`) for CUDA
    tensors."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        *,
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
        super().__init__()
        tensors = [entry.tensor for entry in kv_caches.tensors]
        if not tensors:
            raise ConfigError("vLLM registered no KV tensors to offload")
        pages = {int(entry.page_size_bytes) for entry in kv_caches.tensors}
        if len(pages) != 1:
            raise ConfigError(
                f"kvshm's host tier needs one page size for every KV tensor, got {sorted(pages)}"
            )
        page_bytes = pages.pop()
        groups = [[ref.tensor_idx for ref in refs] for refs in kv_caches.group_data_refs]
        self._tensors = tensors
        self._gpu: CudaHostTier | None = None
        if tensors[0].is_cuda:
            self._gpu = CudaHostTier(
                tensors,
                page_bytes=page_bytes,
                groups=groups,
                segment=segment,
                num_chunks=num_chunks,
                blocks_per_chunk=blocks_per_chunk,
                spawn_workers=spawn_workers,
                worker_command=worker_command,
                block_tokens=block_tokens,
                layers=layers,
                persistent=persistent,
                shared_tier=shared_tier,
                shared_rank=shared_rank,
                page_format=page_format,
            )
            self._tier = self._gpu.tier
            if self._tier.restored:
                logger.info("kvshm: %s found its host tier of an earlier start", segment)
            return
        views = [tensor.view(torch.uint8).numpy() for tensor in tensors]
        self._tier = HostTier(
            segment,
            page_bytes=page_bytes,
            device_blocks=int(tensors[0].shape[0]),
            chunks=num_chunks,
            blocks_per_chunk=blocks_per_chunk,
            groups=groups,
            tensors=views,
            block_tokens=block_tokens,
            layers=layers,
            persistent=persistent,
            shared_tier=shared_tier,
            shared_rank=shared_rank,
            page_format=page_format,
        )
        if self._tier.restored:
            logger.info("kvshm: %s found its host tier of an earlier start", segment)

    @property
    def tier(self) -> HostTier:
        return self._tier

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        assert isinstance(dst_spec, KvshmLoadStoreSpec), dst_spec
        if self._gpu is not None and dst_spec.keys is not None:
            self._gpu.submit(
                job_id,
                True,
                src_spec.block_ids,
                _int_list(src_spec.group_sizes),
                _int_list(src_spec.block_indices),
                dst_spec.chunks,
                keys=dst_spec.keys,
                parents=dst_spec.parents,
                epoch=dst_spec.epoch,
            )
            return True
        if self._gpu is None and dst_spec.keys is not None:
            self._tier.submit_store(
                job_id,
                src_spec.block_ids,
                _int_list(src_spec.group_sizes),
                _int_list(src_spec.block_indices),
                dst_spec.chunks,
                keys=dst_spec.keys,
                parents=dst_spec.parents,
                epoch=dst_spec.epoch,
            )
            return True
        self._submit(job_id, True, src_spec, dst_spec.chunks)
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        assert isinstance(src_spec, KvshmLoadStoreSpec), src_spec
        self._submit(job_id, False, dst_spec, src_spec.chunks)
        return True

    def _submit(self, job: int, store: bool, device: GPULoadStoreSpec, chunks: U32Array) -> None:
        group_sizes = _int_list(device.group_sizes)
        block_indices = _int_list(device.block_indices)
        if self._gpu is not None:
            self._gpu.submit(job, store, device.block_ids, group_sizes, block_indices, chunks)
            return
        submit = self._tier.submit_store if store else self._tier.submit_load
        submit(job, device.block_ids, group_sizes, block_indices, chunks)

    def get_finished(self) -> list[TransferResult]:
        if self._gpu is not None:
            finished = self._gpu.take_finished()
        else:
            finished = self._tier.take_finished()
        return [
            TransferResult(job_id=job, success=success, transfer_size=size, transfer_time=seconds)
            for job, success, size, seconds in finished
        ]

    def wait(self, job_ids: set[int]) -> None:
        if self._gpu is not None:
            self._gpu.wait(job_ids)
            return
        self._tier.wait(list(job_ids), timeout=1.0)

    def shutdown(self) -> None:
        if self._gpu is not None:
            self._gpu.shutdown()
        else:
            self._tier.close()
