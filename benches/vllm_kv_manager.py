"""vLLM's own v1 KVCacheManager over a Mooncake-format trace: the reference for `kvshm replay`.

Run it with the Python of a venv holding the pinned vLLM (scripts/test-vllm makes one; its path
is $KVSHM_VLLM_VENV):

    $KVSHM_VLLM_VENV/bin/python benches/vllm_kv_manager.py \
        --trace traces/mooncake_conversation_trace.jsonl --device-blocks 5859 \
        [--host-blocks N] [--kvshm target/release/kvshm] [--per-request-hits FILE] [--limit N]

It prints one JSON object. For each trace request, in order (vLLM's "prompt mode", as its
scheduler drives the manager for a prefill that runs to completion at once):
1. build a vLLM `Request` of `input_length` tokens whose block hashes are the trace's
   `hash_ids` as given, one per full block (a trace id names its whole prefix already);
2. time `get_computed_blocks` (the longest cached prefix, capped at `input_length - 1`
   tokens), `allocate_slots` for the rest of the prompt (which caches its full blocks) and
   `free`: the manager's work per request;
3. count the hit blocks.

vLLM takes block 0 of its pool as a null block that never caches, so with `--device-blocks N`
it caches in `N - 1` blocks. With `--kvshm BIN` it also runs `BIN replay --prompt-only
--device-blocks N-1` on the same trace (one process after the other, same machine, same run),
compares the hit blocks of every request, and reports kvshm's scheduler time beside vLLM's;
it exits with status 1 if any request differs.

With `--host-blocks N` it also replays the trace through vLLM's host tier, its CPU offloading:
the `CPUOffloadingManager` (LRU, N blocks, no null block, events off, no store threshold) that
the offloading connector's scheduler side (`OffloadingConnectorScheduler`) drives, beside a
fresh KVCacheManager. It calls the two managers' methods directly, in the order and with the
arguments the connector scheduler and vLLM's scheduler use for a request served alone (CPU
blocks of the GPU block size, so one offload key per block: `make_offload_key(hash, 0)`):
1. `on_new_request` (the connector's `on_new_request`, when the request arrives);
2. `get_computed_blocks`, then `lookup` of the blocks past the device hit until the first miss,
   if a full block lies past it (`get_num_new_matched_tokens` -> `_maximal_prefix_lookup`);
3. without CPU hits, `allocate_slots` for the rest of the prompt; with CPU hits (a load is
   asynchronous): `allocate_slots` with the hits as external tokens and `delay_cache_blocks`,
   `prepare_load` of the hit keys (`update_state_after_alloc`), `complete_load` of them (the
   worker's load reported, `update_connector_output`), `cache_blocks` of the loaded prefix
   (`_update_waiting_for_remote_kv`, which then recomputes the last token of a whole-prompt hit)
   and `allocate_slots` for the rest;
4. `prepare_store` of the prompt's full blocks from the first one not hit (from block 0 when
   nothing was loaded, as the connector offers them: blocks already in CPU are reused, the
   others stored, evicting the CPU LRU; `_build_store_jobs`);
5. `free` (the request ends), `on_request_finished` (the next step's `build_connector_meta`;
   the LRU's recency of the request's blocks is set here: the connector never calls `touch`)
   and `complete_store` of the stored keys (the worker's store reported).
Only the two managers' calls are timed, not the connector's own work around them (the keys,
the jobs, the specs, the worker), so vLLM's figure is a lower bound of its cost per request.
The plain KVCacheManager replay above runs too (the manager alone); with `--kvshm BIN`, `BIN
replay --prompt-only --device-blocks N-1 --host-blocks N` runs with both write policies:
`write_through` is the like-for-like one (vLLM's CPU offloading stores every new full block of
a prompt, as a write-through tier does), `write_back` is kvshm's default. Their hits differ
from vLLM's (the tiers' policies differ): they are reported, not checked.
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_offload.base import OffloadingManager
    from vllm.v1.request import Request


def percentiles(samples: list[float]) -> dict[str, float]:
    """p50 and p99 by the nearest rank, as kvshm's reports compute them."""
    ordered = sorted(samples)
    if not ordered:
        return {"p50": 0.0, "p99": 0.0}

    def rank(p: float) -> float:
        return ordered[min(len(ordered), max(1, math.ceil(p * len(ordered)))) - 1]

    return {"p50": rank(0.50), "p99": rank(0.99)}


def read_trace(path: str, limit: int | None) -> list[dict[str, Any]]:
    requests = []
    with open(path) as trace:
        for line in trace:
            if limit is not None and len(requests) >= limit:
                break
            if line.strip():
                requests.append(json.loads(line))
    return requests


def make_manager(device_blocks: int, block_tokens: int) -> "KVCacheManager":
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    # One full-attention group; the tensor shape does not matter to the manager.
    spec = FullAttentionSpec(
        block_size=block_tokens, num_kv_heads=1, head_size=1, dtype=torch.float16
    )
    config = KVCacheConfig(
        num_blocks=device_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )
    return KVCacheManager(
        config,
        max_model_len=1 << 24,
        scheduler_block_size=block_tokens,
        hash_block_size=block_tokens,
        enable_caching=True,
    )


def trace_block_hasher(
    hash_ids: list[int], block_tokens: int
) -> Callable[["Request"], list[bytes]]:
    """A vLLM block hasher that hands out the trace's ids, one per full block."""

    def hasher(request: "Request") -> list[bytes]:
        full_blocks = request.num_tokens // block_tokens
        start = len(request.block_hashes)
        return [hash_ids[i].to_bytes(8, "little") for i in range(start, full_blocks)]

    return hasher


def trace_request_of(
    index: int, trace_request: dict[str, Any], params: "SamplingParams", block_tokens: int
) -> "Request":
    """vLLM's `Request` for trace request number `index`: `input_length` tokens whose block
    hashes are the trace's ids."""
    from vllm.v1.request import Request

    return Request(
        str(index),
        [0] * trace_request["input_length"],
        params,
        None,
        block_hasher=trace_block_hasher(trace_request["hash_ids"], block_tokens),
    )


def replay_vllm(
    requests: list[dict[str, Any]], device_blocks: int, block_tokens: int
) -> tuple[dict[str, Any], list[int]]:
    from vllm.sampling_params import SamplingParams

    manager = make_manager(device_blocks, block_tokens)
    usable_blocks = manager.block_pool.get_num_free_blocks()
    params = SamplingParams(max_tokens=1)
    hits_per_request, times_us = [], []
    hit_tokens = 0
    for index, trace_request in enumerate(requests):
        prompt = trace_request["input_length"]
        request = trace_request_of(index, trace_request, params, block_tokens)
        start = time.perf_counter()
        blocks, cached_tokens, _ = manager.get_computed_blocks(request)
        allocated = manager.allocate_slots(request, prompt - cached_tokens, cached_tokens, blocks)
        manager.free(request)
        times_us.append((time.perf_counter() - start) * 1e6)
        if allocated is None:
            raise SystemExit(f"vLLM could not allocate request {index} ({prompt} tokens)")
        hits_per_request.append(cached_tokens // block_tokens)
        hit_tokens += cached_tokens
    return {
        "num_gpu_blocks": device_blocks,
        "usable_blocks": usable_blocks,
        "hit_blocks": sum(hits_per_request),
        "hit_tokens": hit_tokens,
        "us_per_request": percentiles(times_us),
    }, hits_per_request


def make_offloading_manager(host_blocks: int) -> "OffloadingManager":
    """vLLM's CPU offloading manager as CPUOffloadingSpec.get_manager builds it by default.

    LRU, store_threshold 0 (every offered block is stored), KV events off (vLLM's
    enable_kv_cache_events is off by default); `host_blocks` CPU blocks of the GPU block size.
    """
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager(
        num_chunks=host_blocks, cache_policy="lru", enable_events=False, store_threshold=0
    )


def replay_vllm_offloading(
    requests: list[dict[str, Any]],
    device_blocks: int,
    host_blocks: int,
    block_tokens: int,
    offload: "OffloadingManager | None" = None,
) -> tuple[dict[str, Any], list[int]]:
    """The trace through vLLM's KVCacheManager and CPU offloading manager (the module's doc).

    `offload` replaces the CPU offloading manager (a test records the calls through it).
    """
    from vllm.sampling_params import SamplingParams
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.request import RequestStatus

    manager = make_manager(device_blocks, block_tokens)
    if offload is None:
        offload = make_offloading_manager(host_blocks)
    usable_blocks = manager.block_pool.get_num_free_blocks()
    params = SamplingParams(max_tokens=1)
    clock = time.perf_counter
    total_us, manager_us, offload_us = [], [], []
    hits_per_request = []
    device_hit_blocks = cpu_hit_blocks = stored_blocks = evicted_blocks = 0
    store_failures = whole_prompt_loads = 0
    for index, trace_request in enumerate(requests):
        prompt = trace_request["input_length"]
        request = trace_request_of(index, trace_request, params, block_tokens)
        # The connector's own work, untimed: the request's context (_create_req_context) and
        # its offload keys with their end positions (RequestOffloadState.update_offload_keys).
        context = ReqContext(req_id=request.request_id, kv_hints=request.kv_hints)
        keys = [make_offload_key(block_hash, 0) for block_hash in request.block_hashes]
        for position, key in enumerate(keys, 1):
            context.set_offload_key_position(key, position * block_tokens)
        full_blocks = len(keys)
        in_manager = in_offload = 0.0

        # 1. The request arrives (OffloadingConnectorScheduler.on_new_request).
        start = clock()
        offload.on_new_request(context)
        after_new = clock()
        in_offload += after_new - start

        # 2. The device hit, then the CPU blocks past it up to the first miss
        #    (get_num_new_matched_tokens -> _lookup_complete_chunks -> _maximal_prefix_lookup;
        #    it looks nothing up unless a whole block lies past the device hit).
        blocks, local_tokens, _ = manager.get_computed_blocks(request)
        after_match = clock()
        in_manager += after_match - after_new
        local_blocks = local_tokens // block_tokens
        cpu_hits = 0
        if full_blocks > local_blocks:
            for key in keys[local_blocks:full_blocks]:
                result = offload.lookup(key, context)
                if result is LookupResult.MISS:
                    break
                if result is not LookupResult.HIT:
                    # Every store and load completed before this request: nothing is pending.
                    raise SystemExit(f"request {index}: CPU lookup answered {result}")
                cpu_hits += 1
        in_offload += clock() - after_match
        external_tokens = cpu_hits * block_tokens

        # 3. Allocation; with CPU hits the load is asynchronous (load_kv_async).
        if external_tokens:
            load_keys = keys[local_blocks : local_blocks + cpu_hits]
            load_job_keys = set(load_keys)
            start = clock()
            allocated = manager.allocate_slots(
                request,
                0,
                local_tokens,
                blocks,
                num_external_computed_tokens=external_tokens,
                delay_cache_blocks=True,
            )
            after_allocate = clock()
            in_manager += after_allocate - start
            if allocated is None:
                raise SystemExit(f"vLLM could not allocate request {index} ({prompt} tokens)")
            # update_state_after_alloc: the load's source.
            offload.prepare_load(load_keys, context)
            # The worker's load reported (update_connector_output).
            offload.complete_load(load_job_keys, context)
            in_offload += clock() - after_allocate
            computed_tokens = local_tokens + external_tokens
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            request.num_computed_tokens = computed_tokens
            # _update_waiting_for_remote_kv: the loaded blocks join the prefix cache, and a
            # whole-prompt hit recomputes its last token.
            start = clock()
            manager.cache_blocks(request, computed_tokens)
            in_manager += clock() - start
            if computed_tokens == prompt:
                computed_tokens = prompt - 1
                whole_prompt_loads += 1
            request.num_computed_tokens = computed_tokens
            request.status = RequestStatus.WAITING
            # Scheduled again, its prefill: the rest of the prompt.
            no_blocks = manager.empty_kv_cache_blocks
            start = clock()
            allocated = manager.allocate_slots(request, prompt - computed_tokens, 0, no_blocks)
            in_manager += clock() - start
            # update_state_after_alloc: next_stored_chunk_idx past the hits.
            first_store = local_blocks + cpu_hits
        else:
            start = clock()
            allocated = manager.allocate_slots(request, prompt - local_tokens, local_tokens, blocks)
            in_manager += clock() - start
            first_store = 0
        if allocated is None:
            raise SystemExit(f"vLLM could not allocate request {index} ({prompt} tokens)")

        # 4. The store after the prefill (_build_store_jobs, offload_prompt_only: the prompt's
        #    full blocks not yet offered).
        store_keys = keys[first_store:full_blocks]
        stored: list[bytes] = []
        if store_keys:
            start = clock()
            output = offload.prepare_store(store_keys, context)
            in_offload += clock() - start
            if output is None:
                store_failures += 1
            else:
                stored = output.keys_to_store
                evicted_blocks += len(output.evicted_keys)
        store_job_keys = set(stored)

        # 5. The request ends: its device blocks freed, the offloading manager told, the
        #    worker's store reported.
        start = clock()
        manager.free(request)
        after_free = clock()
        in_manager += after_free - start
        offload.on_request_finished(context)
        if store_job_keys:
            offload.complete_store(store_job_keys, context)
        in_offload += clock() - after_free

        manager_us.append(in_manager * 1e6)
        offload_us.append(in_offload * 1e6)
        total_us.append((in_manager + in_offload) * 1e6)
        hits_per_request.append(local_blocks + cpu_hits)
        device_hit_blocks += local_blocks
        cpu_hit_blocks += cpu_hits
        stored_blocks += len(stored)
    return {
        "num_gpu_blocks": device_blocks,
        "usable_blocks": usable_blocks,
        "cpu_blocks": host_blocks,
        "hit_blocks": device_hit_blocks + cpu_hit_blocks,
        "device_hit_blocks": device_hit_blocks,
        "cpu_hit_blocks": cpu_hit_blocks,
        "whole_prompt_loads": whole_prompt_loads,
        "cpu_stored_blocks": stored_blocks,
        "cpu_evicted_blocks": evicted_blocks,
        "store_failures": store_failures,
        "us_per_request": percentiles(total_us),
        "kv_cache_manager_us_per_request": percentiles(manager_us),
        "offloading_manager_us_per_request": percentiles(offload_us),
    }, hits_per_request


def replay_kvshm(
    binary: str,
    trace: str,
    limit: int | None,
    device_blocks: int,
    block_tokens: int,
    host_args: list[str] | None = None,
) -> tuple[dict[str, Any], list[int]]:
    with tempfile.NamedTemporaryFile("r", suffix=".txt") as hits_file:
        command = [
            binary,
            "replay",
            "--trace",
            trace,
            "--block-tokens",
            str(block_tokens),
            "--device-blocks",
            str(device_blocks),
            "--prompt-only",
            "--json",
            "--per-request-hits",
            hits_file.name,
        ]
        if host_args:
            command += host_args
        if limit is not None:
            command += ["--limit", str(limit)]
        report = json.loads(subprocess.run(command, check=True, capture_output=True).stdout)
        hits = [int(line) for line in hits_file.read().split()]
    return report, hits


def compare_host_tiers(
    args: argparse.Namespace,
    device_blocks: int,
    offloading: dict[str, Any],
    offloading_hits: list[int],
) -> dict[str, Any]:
    """kvshm with a host tier, both write policies, beside vLLM's CPU offloading."""
    result: dict[str, Any] = {}
    vllm_us = offloading["us_per_request"]
    for policy in ("write_back", "write_through"):
        host_args = ["--host-blocks", str(args.host_blocks), "--write-policy", policy]
        report, hits = replay_kvshm(
            args.kvshm, args.trace, args.limit, device_blocks, args.block_tokens, host_args
        )
        differing = sum(a != b for a, b in zip(offloading_hits, hits, strict=False))
        result[f"kvshm_{policy}"] = {
            "device_blocks": device_blocks,
            "host_blocks": report["host_blocks"],
            "write_policy": report["write_policy"],
            "hit_blocks": report["hit_blocks"],
            "device_hit_blocks": report["device_hit_blocks"],
            "host_hit_blocks": report["host_hit_blocks"],
            "swaps_out": report["swaps_out"],
            "backups": report["backups"],
            "requests_with_other_hits_than_vllm": differing + abs(len(offloading_hits) - len(hits)),
            "sched_us_per_request": report["sched_us_per_request"],
        }
        for rank in ("p50", "p99"):
            result[f"kvshm_{policy}_over_vllm_offloading_{rank}"] = (
                report["sched_us_per_request"][rank] / vllm_us[rank]
            )
    result["compared"] = (
        "kvshm_write_through with vllm_offloading: both copy every new full prompt block to "
        "the host tier when the request is served; kvshm_write_back copies a block when the "
        "device evicts it"
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--device-blocks", type=int, required=True)
    parser.add_argument("--block-tokens", type=int, default=512)
    parser.add_argument(
        "--host-blocks",
        type=int,
        help="also replay vLLM's CPU offloading with this many CPU blocks (and kvshm's host tier)",
    )
    parser.add_argument("--limit", type=int)
    parser.add_argument("--kvshm", help="a kvshm binary to replay the same trace and compare")
    parser.add_argument(
        "--per-request-hits",
        help="write vLLM's hit blocks per request here (device + CPU with --host-blocks)",
    )
    args = parser.parse_args()
    if args.host_blocks is not None and args.host_blocks < 1:
        parser.error("--host-blocks must be at least 1")

    started = time.perf_counter()
    import vllm

    import_s = time.perf_counter() - started
    requests = read_trace(args.trace, args.limit)
    vllm_report, vllm_hits = replay_vllm(requests, args.device_blocks, args.block_tokens)
    result: dict[str, Any] = {
        "vllm_version": vllm.__version__,
        "vllm_import_s": round(import_s, 1),
        "requests": len(requests),
        "block_tokens": args.block_tokens,
        "vllm": vllm_report,
    }
    written_hits = vllm_hits
    if args.host_blocks is not None:
        offloading, written_hits = replay_vllm_offloading(
            requests, args.device_blocks, args.host_blocks, args.block_tokens
        )
        result["vllm_offloading"] = offloading
        result["vllm_offloading_over_vllm_p50"] = (
            offloading["us_per_request"]["p50"] / vllm_report["us_per_request"]["p50"]
        )
        if args.kvshm:
            result.update(
                compare_host_tiers(args, vllm_report["usable_blocks"], offloading, written_hits)
            )
    if args.per_request_hits:
        with open(args.per_request_hits, "w") as out:
            out.write("".join(f"{hits}\n" for hits in written_hits))
    mismatches = 0
    if args.kvshm and args.host_blocks is None:
        kvshm_blocks = vllm_report["usable_blocks"]
        report, kvshm_hits = replay_kvshm(
            args.kvshm, args.trace, args.limit, kvshm_blocks, args.block_tokens
        )
        differing = [
            i for i, (a, b) in enumerate(zip(vllm_hits, kvshm_hits, strict=False)) if a != b
        ]
        mismatches = len(differing) + abs(len(vllm_hits) - len(kvshm_hits))
        result["kvshm"] = {
            "device_blocks": kvshm_blocks,
            "hit_blocks": report["hit_blocks"],
            "hit_tokens": report["hit_tokens"],
            "sched_us_per_request": report["sched_us_per_request"],
        }
        result["mismatched_requests"] = mismatches
        result["first_mismatch"] = differing[0] if differing else None
        result["kvshm_over_vllm_p50"] = (
            report["sched_us_per_request"]["p50"] / vllm_report["us_per_request"]["p50"]
        )
    print(json.dumps(result))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
