"""kvshm's offload manager against vLLM's own CPU offloading manager, on one call sequence.

``python benches/vllm_offloading_manager.py --json``, with the Python of a venv that has vLLM 0.32
and kvshm installed (``scripts/test-vllm --bench`` runs it), replays a workload through both
managers as vLLM's offloading connector drives a manager, timing every call, and prints one JSON
object: ``kvshm_us_per_call`` and ``vllm_us_per_call`` (each ``p50``, ``p99``), ``calls``, and
the speed-up at the median. kvshm's figure includes the Python-to-Rust crossing (the calls go
through ``kvshm.vllm.KvshmOffloadingManager``, as vLLM makes them).

The same driver serves the differential test (``replay``, ``Lockstep``): the workload is the
Mooncake conversation trace (one key per 512-token block, full blocks only) or a randomized one
(several requests at once, two KV-cache groups, stores and loads completing out of order, failed
stores, a GPU prefix cache in front of the offloaded tier); ``python/tests_vllm`` loads this file
by its path. It is not part of the installed package.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRACE_NAME = "mooncake_conversation_trace.jsonl"
TRACE_BLOCK_TOKENS = 512


def default_trace() -> str:
    """``$KVSHM_TRACE``, or the checkout's ``traces/<trace>``."""
    named = os.environ.get("KVSHM_TRACE")
    if named:
        return named
    candidate = Path(__file__).resolve().parents[1] / "traces" / TRACE_NAME
    if candidate.exists():
        return str(candidate)
    raise FileNotFoundError(f"{candidate} not found; set KVSHM_TRACE or pass --trace")


def chunk_key(block_id: int, group: int = 0) -> bytes:
    """A vLLM-shaped key: a 32-byte block hash (sha256 of the trace's block id), the group."""
    digest = hashlib.sha256(block_id.to_bytes(8, "little")).digest()
    return digest + group.to_bytes(4, "big")


@dataclass
class Request:
    name: str
    blocks: list[int]
    # Chunks computed per step (chunked prefill), after the hits.
    steps: int = 1


def trace_requests(path: str | None = None, limit: int | None = None) -> list[Request]:
    """The trace's requests; only full blocks are keys (engine rules)."""
    requests = []
    with open(path or default_trace()) as lines:
        for index, line in enumerate(lines):
            if limit is not None and index >= limit:
                break
            record = json.loads(line)
            full = record["input_length"] // TRACE_BLOCK_TOKENS
            requests.append(Request(f"t{index}", record["hash_ids"][:full], steps=1))
    return requests


def synthetic_requests(seed: int, count: int) -> list[Request]:
    """Conversations that share heads and grow turn by turn."""
    rng = random.Random(seed)
    next_block = 1_000_000
    conversations: list[list[int]] = []
    requests = []
    for index in range(count):
        if not conversations or rng.random() < 0.2:
            head = rng.choice(conversations)[: rng.randrange(1, 4)] if conversations else []
            conversations.append(list(head))
        conversation = rng.choice(conversations)
        for _ in range(rng.randrange(1, 5)):
            conversation.append(next_block)
            next_block += 1
        requests.append(Request(f"s{index}", list(conversation), steps=rng.randrange(1, 4)))
    return requests


@dataclass
class Running:
    """A request past its lookups: chunks computed so far, prefill steps left."""

    request: Request
    context: Any
    done: int
    steps: int
    load_keys: set[bytes] | None


@dataclass
class CallLog:
    """Per-call times in nanoseconds with the methods called, and what the calls returned (for
    comparison)."""

    times: list[int] = field(default_factory=list)
    methods: list[str] = field(default_factory=list)
    results: list[Any] = field(default_factory=list)
    keep_results: bool = True


class Driver:
    """Plays vLLM's offloading scheduler against one manager (its own answers steer it)."""

    def __init__(
        self,
        manager: Any,
        request_context: Callable[[str], Any],
        groups: int,
        gpu_cache_blocks: int,
        log: CallLog,
        seed: int,
        failure_percent: int = 0,
    ) -> None:
        self.manager = manager
        self.request_context = request_context
        self.groups = groups
        self.gpu_capacity = gpu_cache_blocks
        self.gpu: dict[int, None] = {}  # an LRU of the GPU prefix cache, by block id
        self.log = log
        self.rng = random.Random(seed)
        self.failure_percent = failure_percent
        self.jobs: list[tuple[str, int, set[bytes], Any]] = []  # (kind, due step, keys, ctx)
        self.step = 0
        self.hit_chunks = 0
        self.lookup_chunks = 0

    def call(self, method: str, *args: Any) -> Any:
        function = getattr(self.manager, method)
        started = time.perf_counter_ns()
        result = function(*args)
        if method == "take_events":
            result = list(result)  # vLLM's is a generator: taking the events is the work
        self.log.times.append(time.perf_counter_ns() - started)
        self.log.methods.append(method)
        if method == "take_events":
            result = [(event.removed, list(event.keys)) for event in result]
        if self.log.keep_results:
            self.log.results.append((method, _comparable(method, result)))
        return result

    def keys(self, blocks: list[int], group: int) -> list[bytes]:
        return [chunk_key(block, group) for block in blocks]

    def run(self, requests: list[Request], concurrency: int) -> None:
        waiting: list[tuple[Request, Any]] = []  # admitted, looking up
        running: list[Running] = []
        pending = list(requests)
        # vLLM steps while the manager has work pending; it asks only when it would idle
        # otherwise, and the asking is the manager's work too (it may send what it deferred).
        while pending or waiting or running or self.jobs or self.call("has_pending_work"):
            while pending and len(waiting) + len(running) < concurrency:
                request = pending.pop(0)
                context = self.admit(request)
                waiting.append((request, context))
            still_waiting = []
            new_requests = []
            for request, context in waiting:
                started = self.look_up(request, context)
                if started is None:  # a hit is still being stored: ask again next step
                    still_waiting.append((request, context))
                else:
                    running.append(started)
                    new_requests.append(request.name)
            waiting = still_waiting
            self.call("on_schedule_end", schedule_end_context(new_requests))
            still_running = []
            for state in running:
                if state.load_keys is not None and self.loading(state.load_keys):
                    still_running.append(state)  # waits for its load (WAITING_FOR_REMOTE_KVS)
                    continue
                state.load_keys = None
                self.compute(state)
                if state.done >= len(state.request.blocks):
                    self.call("on_request_finished", state.context)
                    self.remember_gpu(state.request.blocks)
                else:
                    still_running.append(state)
            running = still_running
            self.complete_jobs(drain=not pending and not waiting and not running)
            self.call("take_events")
            self.step += 1

    def loading(self, keys: set[bytes]) -> bool:
        return any(kind == "load" and job_keys is keys for kind, _, job_keys, _ in self.jobs)

    def admit(self, request: Request) -> Any:
        context = self.request_context(request.name)
        for group in range(self.groups):
            for index, key in enumerate(self.keys(request.blocks, group)):
                context.set_offload_key_position(key, (index + 1) * TRACE_BLOCK_TOKENS)
        self.call("on_new_request", context)
        return context

    def look_up(self, request: Request, context: Any) -> Running | None:
        """vLLM's lookup: past the GPU prefix-cache hits, each group up to its first miss;
        a pending hit defers the request. Then the load of the hits."""
        local = 0
        for block in request.blocks:
            if block not in self.gpu:
                break
            local += 1
        hits = len(request.blocks) - local
        deferred = False
        for group in range(self.groups):
            found = 0
            for key in self.keys(request.blocks[local : local + hits], group):
                result = self.call("lookup", key, context)
                if result.name == "MISS":
                    break
                deferred |= result.name == "HIT_PENDING"
                found += 1
            hits = min(hits, found)
        if deferred:
            return None
        self.lookup_chunks += len(request.blocks) - local
        self.hit_chunks += hits
        load_keys = None
        if hits:
            keys = [
                key
                for group in range(self.groups)
                for key in self.keys(request.blocks[local : local + hits], group)
            ]
            self.call("prepare_load", keys, context)
            load_keys = set(keys)
            self.jobs.append(("load", self.step + self.rng.randrange(0, 3), load_keys, context))
        return Running(request, context, local + hits, request.steps, load_keys)

    def compute(self, state: Running) -> None:
        """One step of prefill: some chunks become full and are offered for storing."""
        remaining = len(state.request.blocks) - state.done
        now = remaining if state.steps <= 1 else max(1, remaining // state.steps)
        blocks = state.request.blocks[state.done : state.done + now]
        keys = [key for group in range(self.groups) for key in self.keys(blocks, group)]
        output = self.call("prepare_store", keys, state.context)
        if output is not None and output.keys_to_store:
            due = self.step + self.rng.randrange(0, 3)
            self.jobs.append(("store", due, set(output.keys_to_store), state.context))
        state.done += now
        state.steps -= 1

    def complete_jobs(self, drain: bool) -> None:
        kept = []
        for kind, due, keys, context in self.jobs:
            if due > self.step and not drain:
                kept.append((kind, due, keys, context))
            elif kind == "load":
                self.call("complete_load", keys, context)
            else:
                success = self.rng.randrange(100) >= self.failure_percent
                self.call("complete_store", keys, context, success)
        self.jobs = kept

    def remember_gpu(self, blocks: list[int]) -> None:
        for block in blocks:
            self.gpu.pop(block, None)
            self.gpu[block] = None
        while len(self.gpu) > self.gpu_capacity:
            self.gpu.pop(next(iter(self.gpu)))


def schedule_end_context(new_requests: list[str]) -> Any:
    """What vLLM's scheduler hands ``on_schedule_end`` (no preemptions here)."""
    from vllm.v1.kv_offload.base import ScheduleEndContext

    return ScheduleEndContext(new_req_ids=new_requests, preempted_req_ids=())


def _comparable(method: str, result: Any) -> Any:
    if method == "lookup":
        return result.name
    if method == "prepare_store":
        if result is None:
            return None
        return (list(result.keys_to_store), list(result.evicted_keys))
    if method == "prepare_load":
        return len(result.block_ids)
    return result


@dataclass
class Replay:
    log: CallLog
    hit_chunks: int
    lookup_chunks: int


def replay(
    manager: Any,
    requests: list[Request],
    *,
    groups: int = 1,
    gpu_cache_blocks: int = 0,
    concurrency: int = 1,
    seed: int = 0,
    failure_percent: int = 0,
    keep_results: bool = True,
) -> Replay:
    """Plays `requests` against `manager` as vLLM's scheduler does; every call is logged."""
    from vllm.v1.kv_offload.base import ReqContext

    log = CallLog(keep_results=keep_results)
    driver = Driver(
        manager,
        lambda name: ReqContext(req_id=name),
        groups,
        gpu_cache_blocks,
        log,
        seed,
        failure_percent,
    )
    driver.run(requests, concurrency)
    return Replay(log, driver.hit_chunks, driver.lookup_chunks)


def vllm_manager(chunks: int) -> Any:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager(num_chunks=chunks, cache_policy="lru", enable_events=True)


def kvshm_manager(chunks: int, eviction: str = "lru") -> Any:
    from kvshm.vllm import KvshmOffloadingManager

    return KvshmOffloadingManager(chunks, eviction=eviction, events=True)


def compare(ours: CallLog, theirs: CallLog) -> dict[str, Any]:
    """Calls compared and mismatches, by method, with the first few mismatches."""
    mismatches: dict[str, int] = {}
    examples = []
    for index, (mine, reference) in enumerate(zip(ours.results, theirs.results, strict=False)):
        if mine != reference:
            mismatches[reference[0]] = mismatches.get(reference[0], 0) + 1
            if len(examples) < 3:
                examples.append(
                    {"call": index, "kvshm": repr(mine)[:200], "vllm": repr(reference)[:200]}
                )
    return {
        "calls": min(len(ours.results), len(theirs.results)),
        "call_counts_equal": len(ours.results) == len(theirs.results),
        "mismatches": sum(mismatches.values()),
        "by_method": mismatches,
        "examples": examples,
    }


class Lockstep:
    """vLLM's manager steering the workload, with kvshm's leaf-first manager given the same
    calls until their answers first differ. That first difference must be explained: vLLM's
    flat LRU evicted a key that still had a cached child (the tail of its prefix), which
    leaf-first LRU never does; from there on the caches hold different keys."""

    def __init__(self, reference: Any, candidate: Any) -> None:
        self.reference = reference
        self.candidate = candidate
        self.calls = 0
        self.divergence: dict[str, Any] | None = None

    def __getattr__(self, method: str) -> Callable[..., Any]:
        def forward(*args: Any) -> Any:
            interior: set[bytes] = set()
            if self.divergence is None and method == "prepare_store":
                rust = self.candidate.rust
                cached = rust.keys()
                interior = {parent for key in cached if (parent := rust.parent_of(key))}
            result = getattr(self.reference, method)(*args)
            if method == "take_events":
                result = list(result)
            if self.divergence is not None:
                return result
            mine = getattr(self.candidate, method)(*args)
            if method == "take_events":
                mine = list(mine)
                same = [(e.removed, e.keys) for e in mine] == [(e.removed, e.keys) for e in result]
            else:
                same = _comparable(method, mine) == _comparable(method, result)
            self.calls += 1
            if not same:
                evicted = list(result.evicted_keys) if method == "prepare_store" and result else []
                self.divergence = {
                    "call": self.calls,
                    "method": method,
                    "vllm_evicted_a_key_with_a_cached_child": any(k in interior for k in evicted),
                }
            return result

        return forward


def percentiles_us(times: list[int]) -> dict[str, float]:
    ordered = sorted(times)
    if not ordered:
        return {"p50": 0.0, "p99": 0.0}

    def at(fraction: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] / 1000, 3)

    return {"p50": at(0.50), "p99": at(0.99)}


def bench_vllm_manager(trace: str | None, limit: int | None, chunks: int) -> dict[str, Any]:
    """Times the trace's call sequence through both managers (module documentation)."""
    requests = trace_requests(trace, limit=limit)
    # Warm both (imports, allocator), then measure.
    for make in (vllm_manager, kvshm_manager):
        replay(make(chunks), requests[:200], keep_results=False)
    theirs = replay(vllm_manager(chunks), requests, keep_results=False)
    ours = replay(kvshm_manager(chunks), requests, keep_results=False)
    kvshm_us = percentiles_us(ours.log.times)
    vllm_us = percentiles_us(theirs.log.times)
    return {
        "benchmark": "vllm-manager",
        "workload": f"mooncake conversation trace, {len(requests)} requests, 512-token chunks",
        "chunks": chunks,
        "calls": len(ours.log.times),
        "kvshm_us_per_call": kvshm_us,
        "vllm_us_per_call": vllm_us,
        "speedup_p50": round(vllm_us["p50"] / kvshm_us["p50"], 2) if kvshm_us["p50"] else None,
        "speedup_p99": round(vllm_us["p99"] / kvshm_us["p99"], 2) if kvshm_us["p99"] else None,
        "hit_chunks": {"kvshm": ours.hit_chunks, "vllm": theirs.hit_chunks},
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="benches/vllm_offloading_manager.py",
        description="kvshm's offload manager against vLLM's CPU offloading manager",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--requests", type=int, default=None, help="trace requests to replay")
    parser.add_argument("--chunks", type=int, default=4000, help="host tier chunks (both)")
    parser.add_argument("--trace", default=None, help="Mooncake trace (default: the checkout's)")
    args = parser.parse_args(argv)
    result = bench_vllm_manager(args.trace, args.requests, args.chunks)
    if args.json:
        print(json.dumps(result))
    else:
        for name, value in result.items():
            print(f"{name:20} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
