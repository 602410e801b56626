"""vLLM's own v1 KVCacheManager over a Mooncake-format trace: the reference for `kvshm replay`.

Run it with the Python of a venv holding the pinned vLLM (scripts/test-vllm makes one; its path
is $KVSHM_VLLM_VENV):

    $KVSHM_VLLM_VENV/bin/python benches/vllm_kv_manager.py \
        --trace traces/mooncake_conversation_trace.jsonl --device-blocks 5859 \
        [--kvshm target/release/kvshm] [--per-request-hits FILE] [--limit N]

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
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time


def percentiles(samples):
    """p50 and p99 by the nearest rank, as kvshm's reports compute them."""
    ordered = sorted(samples)
    if not ordered:
        return {"p50": 0.0, "p99": 0.0}

    def rank(p):
        return ordered[min(len(ordered), max(1, math.ceil(p * len(ordered)))) - 1]

    return {"p50": rank(0.50), "p99": rank(0.99)}


def read_trace(path, limit):
    requests = []
    with open(path) as trace:
        for line in trace:
            if limit is not None and len(requests) >= limit:
                break
            if line.strip():
                requests.append(json.loads(line))
    return requests


def make_manager(device_blocks, block_tokens):
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


def trace_block_hasher(hash_ids, block_tokens):
    """A vLLM block hasher that hands out the trace's ids, one per full block."""

    def hasher(request):
        full_blocks = request.num_tokens // block_tokens
        start = len(request.block_hashes)
        return [hash_ids[i].to_bytes(8, "little") for i in range(start, full_blocks)]

    return hasher


def replay_vllm(requests, device_blocks, block_tokens):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    manager = make_manager(device_blocks, block_tokens)
    usable_blocks = manager.block_pool.get_num_free_blocks()
    params = SamplingParams(max_tokens=1)
    hits_per_request, times_us = [], []
    hit_tokens = 0
    for index, trace_request in enumerate(requests):
        prompt = trace_request["input_length"]
        request = Request(
            str(index),
            [0] * prompt,
            params,
            None,
            block_hasher=trace_block_hasher(trace_request["hash_ids"], block_tokens),
        )
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


def replay_kvshm(binary, trace, limit, device_blocks, block_tokens):
    with tempfile.NamedTemporaryFile("r", suffix=".txt") as hits_file:
        command = [
            binary, "replay", "--trace", trace, "--block-tokens", str(block_tokens),
            "--device-blocks", str(device_blocks), "--prompt-only", "--json",
            "--per-request-hits", hits_file.name,
        ]
        if limit is not None:
            command += ["--limit", str(limit)]
        report = json.loads(subprocess.run(command, check=True, capture_output=True).stdout)
        hits = [int(line) for line in hits_file.read().split()]
    return report, hits


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--device-blocks", type=int, required=True)
    parser.add_argument("--block-tokens", type=int, default=512)
    parser.add_argument("--limit", type=int)
    parser.add_argument("--kvshm", help="a kvshm binary to replay the same trace and compare")
    parser.add_argument("--per-request-hits", help="write vLLM's hit blocks per request here")
    args = parser.parse_args()

    started = time.perf_counter()
    import vllm

    import_s = time.perf_counter() - started
    requests = read_trace(args.trace, args.limit)
    vllm_report, vllm_hits = replay_vllm(requests, args.device_blocks, args.block_tokens)
    if args.per_request_hits:
        with open(args.per_request_hits, "w") as out:
            out.write("".join(f"{hits}\n" for hits in vllm_hits))
    result = {
        "vllm_version": vllm.__version__,
        "vllm_import_s": round(import_s, 1),
        "requests": len(requests),
        "block_tokens": args.block_tokens,
        "vllm": vllm_report,
    }
    mismatches = 0
    if args.kvshm:
        kvshm_blocks = vllm_report["usable_blocks"]
        report, kvshm_hits = replay_kvshm(
            args.kvshm, args.trace, args.limit, kvshm_blocks, args.block_tokens
        )
        differing = [i for i, (a, b) in enumerate(zip(vllm_hits, kvshm_hits)) if a != b]
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
