"""kvshm's manager and vLLM's own CPU offloading manager (LRU, equal capacity), call for call.

With ``eviction="lru"`` kvshm must answer every call exactly as vLLM does (lookups, stores with
their evictions, events): 0 mismatches. With the default leaf-first order the two agree until
vLLM first evicts a key that still has a cached child; every such first divergence is checked to
be exactly that. Figures go to stdout (and ``$KVSHM_DIFF_OUT`` as JSON) for the report.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest


def load_bench() -> ModuleType:
    """benches/vllm_offloading_manager.py, which drives both managers (not in the package)."""
    path = Path(__file__).resolve().parents[2] / "benches" / "vllm_offloading_manager.py"
    spec = importlib.util.spec_from_file_location("vllm_offloading_manager", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: its dataclasses look their module up by name.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = load_bench()

SUMMARY: dict[str, object] = {}


def record(name: str, value: object) -> None:
    SUMMARY[name] = value
    print(name, json.dumps(value))
    path = os.environ.get("KVSHM_DIFF_OUT")
    if path:
        with open(path, "w") as out:
            json.dump(SUMMARY, out)


@pytest.mark.parametrize("groups", [1, 2])
def test_randomized_calls_get_the_same_answers_from_kvshm_lru_and_vllm(groups: int) -> None:
    totals = {"calls": 0, "mismatches": 0, "seeds": 0}
    for seed in range(1, 6):
        requests = bench.synthetic_requests(seed, 400)
        options = {
            "groups": groups,
            "gpu_cache_blocks": 24,
            "concurrency": 6,
            "seed": seed,
            "failure_percent": 5,
        }
        theirs = bench.replay(bench.vllm_manager(48), requests, **options)
        ours = bench.replay(bench.kvshm_manager(48, "lru"), requests, **options)
        result = bench.compare(ours.log, theirs.log)
        assert result["call_counts_equal"], result
        assert result["mismatches"] == 0, result
        assert theirs.hit_chunks > 0
        totals["calls"] += result["calls"]
        totals["seeds"] += 1
    record(f"synthetic_lru_groups{groups}", totals)


def test_the_mooncake_trace_gets_the_same_answers_from_kvshm_lru_and_vllm() -> None:
    requests = bench.trace_requests()
    theirs = bench.replay(bench.vllm_manager(4000), requests, gpu_cache_blocks=1000)
    ours = bench.replay(bench.kvshm_manager(4000, "lru"), requests, gpu_cache_blocks=1000)
    result = bench.compare(ours.log, theirs.log)
    assert result["call_counts_equal"], result
    assert result["mismatches"] == 0, result
    record(
        "trace_lru",
        {
            "requests": len(requests),
            "calls": result["calls"],
            "mismatches": result["mismatches"],
            "hit_chunks": theirs.hit_chunks,
            "looked_up_chunks": theirs.lookup_chunks,
        },
    )


def test_leaf_first_agrees_with_vllm_until_vllm_evicts_a_key_with_a_cached_child() -> None:
    divergences = explained = compared = 0
    for seed in range(1, 11):
        lockstep = bench.Lockstep(bench.vllm_manager(48), bench.kvshm_manager(48, "leaf_first"))
        requests = bench.synthetic_requests(seed, 400)
        bench.replay(
            lockstep,
            requests,
            gpu_cache_blocks=24,
            concurrency=6,
            seed=seed,
            failure_percent=5,
            keep_results=False,
        )
        compared += lockstep.calls
        if lockstep.divergence is not None:
            divergences += 1
            assert lockstep.divergence["vllm_evicted_a_key_with_a_cached_child"], (
                seed,
                lockstep.divergence,
            )
            explained += 1
    trace = bench.trace_requests()
    ours = bench.replay(bench.kvshm_manager(4000, "leaf_first"), trace, gpu_cache_blocks=1000)
    theirs = bench.replay(bench.vllm_manager(4000), trace, gpu_cache_blocks=1000)
    record(
        "leaf_first",
        {
            "runs": 10,
            "calls_compared_before_divergence": compared,
            "divergences": divergences,
            "explained": explained,
            "trace_hit_chunks": {
                "kvshm_leaf_first": ours.hit_chunks,
                "vllm_lru": theirs.hit_chunks,
            },
        },
    )
    assert ours.hit_chunks >= theirs.hit_chunks
