"""The shared host tier's cost per request through vLLM's manager API (issue 26, DESIGN §12.3).

``python benches/vllm_shared_tier_cost.py --json``, with the Python of a venv that has vLLM 0.32
and kvshm installed, replays the Mooncake conversation trace as vLLM's offloading connector drives
its manager (the driver of ``vllm_offloading_manager.py``, every call timed) through

- the baseline, ``kvshm.vllm.KvshmOffloadingManager``: one per instance, each its own tier of
  ``chunks / instances`` chunks (today's per-instance manager, leaf-first LRU, no KV events, as
  vLLM builds it by default), and
- ``kvshm.vllm.KvshmSharedOffloadingManager``: one per instance, each a client of one
  ``python -m kvshm tier-owner`` process holding ``chunks`` chunks; every contract call that
  needs the owner is one batch and one wait on it; a store its lease of chunks covers needs
  none (with ``--without-lease``, a third variant whose clients lease none, for comparison).

The trace's requests go round-robin to the instances (all of them through one with
``--instances 1``); each request runs to its end, its stores and loads completed, before the
next starts. A request's cost is the sum of the calls made while it runs (its own calls and the
``take_events`` of its steps). Each round replays the trace through both, the order alternating
between rounds, each shared replay against a fresh owner. It prints one JSON object: per round
and variant the per-request p50 and p99, per method the call p50, the chunks hit, and for the
shared tier the owner calls per request; the ratio shared / per-instance at p50 and p99; and a
check, on the first requests, of how many owner calls each request's lookups made (a lookup of a
key the request's first lookup pinned is a hit with no call). The owner is stopped (SIGTERM) and
its arenas removed at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_offloading_manager as driver

#: The identity the owner and its clients share (every field must agree); the arenas' blocks are
#: small, since nothing is copied here.
BLOCK_BYTES = 4096


def tier_identity() -> Any:
    from kvshm.shared_tier import TierIdentity

    return TierIdentity(
        model="bench-model",
        kv_dtype="float16",
        block_tokens=driver.TRACE_BLOCK_TOKENS,
        block_bytes=BLOCK_BYTES,
        blocks_per_chunk=1,
        layout="",
    )


class OwnerSetup(NamedTuple):
    """How the benchmark starts each owner: the CPU it is pinned to, and its ``--free-chunks``
    (``None``: the owner's defaults)."""

    cpu: int | None = None
    free_chunks: int | None = None


@contextmanager
def tier_owner(tier: str, chunks: int, setup: OwnerSetup) -> Iterator[dict[str, Any]]:
    """A ``tier-owner`` process serving ``tier`` while the block runs, started as ``setup``
    says; the dictionary it yields gets the owner's counters once it stopped."""
    from kvshm.shared_tier import owner_command

    options = ["--chunks", str(chunks)]
    if setup.free_chunks is not None:
        options += ["--free-chunks", str(setup.free_chunks)]
    command = owner_command(tier, tier_identity(), options)
    if setup.cpu is not None:
        # taskset execs: the pid is the owner's.
        command = ["taskset", "-c", str(setup.cpu), *command]
    owner = subprocess.Popen(command, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    report: dict[str, Any] = {}
    try:
        assert owner.stdout is not None
        started = owner.stdout.readline()  # one JSON line once it serves
        if not started:
            raise RuntimeError(f"tier-owner exited with {owner.wait()} before serving")
        yield report
    finally:
        owner.terminate()
        output, _ = owner.communicate(timeout=30)
        lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
        if lines:
            report.update(lines[-1])
        for arena in Path("/dev/shm").glob(f"kvshm.{tier}.*"):  # its arena and key table
            arena.unlink(missing_ok=True)


def shared_managers(tier: str, instances: int, lease_chunks: int = 16) -> list[Any]:
    from kvshm.vllm import KvshmSharedOffloadingManager

    managers = [
        KvshmSharedOffloadingManager(tier, tier_identity(), lease_chunks=lease_chunks)
        for _ in range(instances)
    ]
    for manager in managers:
        if not manager.connected:
            raise RuntimeError(f"not attached to {tier}: {manager.last_error}")
    return managers


def per_instance_managers(chunks: int, instances: int) -> list[Any]:
    from kvshm.vllm import KvshmOffloadingManager

    return [KvshmOffloadingManager(chunks // instances) for _ in range(instances)]


def replay_round_robin(managers: list[Any], requests: list[driver.Request]) -> dict[str, Any]:
    """The requests round-robin over one driver per manager; per request the sum of its calls."""
    from vllm.v1.kv_offload.base import ReqContext

    log = driver.CallLog(keep_results=False)
    drivers = [
        driver.Driver(manager, lambda name: ReqContext(req_id=name), 1, 0, log, seed=index)
        for index, manager in enumerate(managers)
    ]
    per_request = []
    for index, request in enumerate(requests):
        first = len(log.times)
        drivers[index % len(drivers)].run([request], concurrency=1)
        per_request.append(sum(log.times[first:]))
    by_method: dict[str, list[int]] = {}
    for method, elapsed in zip(log.methods, log.times, strict=True):
        by_method.setdefault(method, []).append(elapsed)
    return {
        "per_request_us": driver.percentiles_us(per_request),
        "per_call_p50_us": {
            method: driver.percentiles_us(times)["p50"] for method, times in by_method.items()
        },
        "calls": len(log.times),
        "hit_chunks": sum(each.hit_chunks for each in drivers),
        "lookup_chunks": sum(each.lookup_chunks for each in drivers),
    }


def replay_shared(
    tier: str,
    chunks: int,
    instances: int,
    requests: list[driver.Request],
    setup: OwnerSetup,
    lease_chunks: int = 16,
) -> dict[str, Any]:
    with tier_owner(tier, chunks, setup) as owner:
        managers = shared_managers(tier, instances, lease_chunks)
        result = replay_round_robin(managers, requests)
        totals: dict[str, int] = {}
        for manager in managers:
            for name, value in manager.stats().items():
                totals[name] = totals.get(name, 0) + value
        del managers  # detach before the owner stops
    result["owner_calls_per_request"] = round(totals["owner_calls"] / len(requests), 2)
    result["owner_waits_per_request"] = round(totals["owner_waits"] / len(requests), 2)
    result["client_stats"] = {k: v for k, v in totals.items() if k != "connected"}
    result["owner_counters"] = owner
    return result


def lookup_check(tier: str, chunks: int, requests: list[driver.Request]) -> dict[str, Any]:
    """Owner calls made by each request's lookups (its other calls untimed here): with the
    ``ReqContext``'s key positions filled as vLLM fills them, the first lookup asks the owner
    for the key and those after it; the keys it pinned are hits without a call, and the first
    key past them asks once more (a miss)."""

    class CountingDriver(driver.Driver):
        lookups = 0
        lookup_owner_calls = 0
        hits_without_call = 0

        def call(self, method: str, *args: Any) -> Any:
            before = self.manager.stats()["owner_calls"]
            result = super().call(method, *args)
            if method == "lookup":
                asked = self.manager.stats()["owner_calls"] - before
                self.lookup_owner_calls += asked
                self.lookups += 1
                self.hits_without_call += int(result.name == "HIT" and not asked)
            return result

    from vllm.v1.kv_offload.base import ReqContext

    with tier_owner(tier, chunks, OwnerSetup()):
        (manager,) = shared_managers(tier, 1)
        log = driver.CallLog(keep_results=False)
        counting = CountingDriver(manager, lambda name: ReqContext(req_id=name), 1, 0, log, 0)
        histogram: dict[int, int] = {}
        for request in requests:
            calls_before = counting.lookup_owner_calls
            counting.run([request], concurrency=1)
            asked = counting.lookup_owner_calls - calls_before
            histogram[asked] = histogram.get(asked, 0) + 1
        del manager
    return {
        "requests": len(requests),
        "lookups": counting.lookups,
        "hits_without_owner_call": counting.hits_without_call,
        "requests_by_lookup_owner_calls": dict(sorted(histogram.items())),
        "hit_chunks": counting.hit_chunks,
    }


def bench(
    trace: str | None,
    limit: int | None,
    chunks: int,
    instance_counts: list[int],
    rounds: int,
    setup: OwnerSetup,
    without_lease: bool = False,
) -> dict[str, Any]:
    requests = driver.trace_requests(trace, limit=limit)
    prefix = f"kvshm-cost-{os.getpid()}"
    # Warm both (imports, allocator), then measure.
    replay_round_robin(per_instance_managers(chunks, 1), requests[:200])
    replay_shared(f"{prefix}-warm", chunks, 1, requests[:200], setup)
    runs = []
    for instances in instance_counts:
        for round_index in range(rounds):
            order = ["per_instance", "shared"] + (["shared_without_lease"] if without_lease else [])
            if round_index % 2:
                order.reverse()
            run: dict[str, Any] = {"instances": instances, "round": round_index, "order": order}
            for variant in order:
                if variant.startswith("shared"):
                    tier = f"{prefix}-{instances}-{round_index}-{variant}"
                    lease = 0 if variant == "shared_without_lease" else 16
                    run[variant] = replay_shared(tier, chunks, instances, requests, setup, lease)
                else:
                    managers = per_instance_managers(chunks, instances)
                    run[variant] = replay_round_robin(managers, requests)
            for at in ("p50", "p99"):
                shared = run["shared"]["per_request_us"][at]
                baseline = run["per_instance"]["per_request_us"][at]
                run[f"ratio_{at}"] = round(shared / baseline, 2) if baseline else None
                if without_lease:
                    unleased = run["shared_without_lease"]["per_request_us"][at]
                    run[f"without_lease_ratio_{at}"] = round(unleased / baseline, 2)
            runs.append(run)
    return {
        "benchmark": "vllm-shared-tier-cost",
        "workload": f"mooncake conversation trace, {len(requests)} requests, 512-token chunks",
        "chunks": chunks,
        "cpus": {"client": sorted(os.sched_getaffinity(0)), "owner": setup.cpu},
        "owner_free_chunks": setup.free_chunks,
        "load_average": os.getloadavg()[0],
        "runs": runs,
        "ratio_p50_range": {
            str(n): [
                min(run["ratio_p50"] for run in runs if run["instances"] == n),
                max(run["ratio_p50"] for run in runs if run["instances"] == n),
            ]
            for n in instance_counts
        },
        "lookup_check": lookup_check(f"{prefix}-check", chunks, requests[:500]),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="benches/vllm_shared_tier_cost.py",
        description="the shared host tier's cost per request through vLLM's manager API",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--requests", type=int, default=None, help="trace requests to replay")
    parser.add_argument("--chunks", type=int, default=4000, help="host chunks in all")
    parser.add_argument("--instances", default="1", help="instance counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=2, help="replays of each variant")
    parser.add_argument("--owner-cpu", type=int, default=None, help="pin the owner to this CPU")
    parser.add_argument(
        "--owner-free-chunks", type=int, default=None, help="the owner's --free-chunks"
    )
    parser.add_argument("--trace", default=None, help="Mooncake trace (default: the checkout's)")
    parser.add_argument(
        "--without-lease",
        action="store_true",
        help="also replay the shared tier with clients that lease no chunks (lease_chunks=0)",
    )
    args = parser.parse_args(argv)
    counts = [int(count) for count in args.instances.split(",")]
    setup = OwnerSetup(cpu=args.owner_cpu, free_chunks=args.owner_free_chunks)
    result = bench(
        args.trace, args.requests, args.chunks, counts, args.rounds, setup, args.without_lease
    )
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
