"""benches/vllm_kv_manager.py --host-blocks drives vLLM's CPU offloading manager as vLLM does.

The bench calls the manager's methods directly (so that it times only them). Here the same trace
slice also runs through vLLM's own ``OffloadingConnectorScheduler`` (the scheduler side of the
offloading connector, over a spec-built ``CPUOffloadingManager``) with vLLM's scheduler calls
around it, for requests served one at a time as the bench serves them; both managers sit behind
a recorder, and the two call sequences (methods, keys in order, answers) must be equal.
"""

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.request import RequestStatus

REPOSITORY = Path(__file__).resolve().parents[2]
BLOCK_TOKENS = 512
# Small tiers over the trace's first requests: device and CPU evictions, loads, reused blocks.
DEVICE_BLOCKS, HOST_BLOCKS, REQUESTS = 301, 3000, 700
# The manager's methods that read or change its state (not its no-op step hooks).
RECORDED = (
    "on_new_request",
    "lookup",
    "prepare_load",
    "touch",
    "complete_load",
    "prepare_store",
    "complete_store",
    "on_request_finished",
)


def load_bench() -> ModuleType:
    path = REPOSITORY / "benches" / "vllm_kv_manager.py"
    spec = importlib.util.spec_from_file_location("vllm_kv_manager", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def comparable(value: Any) -> Any:
    """Arguments and answers as plain values: key sets sorted, contexts by request id."""
    if isinstance(value, set | frozenset):
        return ("set", sorted(value))
    if isinstance(value, list | tuple):
        return [comparable(item) for item in value]
    if hasattr(value, "req_id"):
        return ("request", value.req_id)
    if hasattr(value, "keys_to_store"):
        return ("stored", list(value.keys_to_store), list(value.evicted_keys))
    if hasattr(value, "block_ids"):
        return ("blocks", value.block_ids.tolist())
    return value


class Recorder:
    """Forwards every call to a manager, writing down the recorded methods' calls."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.manager, name)
        if name not in RECORDED:
            return method

        def recorded(*args: Any, **kwargs: Any) -> Any:
            answer = method(*args, **kwargs)
            self.calls.append((name, comparable(args), comparable(kwargs), comparable(answer)))
            return answer

        return recorded


def offloading_spec(make_config: Callable[..., OffloadingConfig]) -> CPUOffloadingSpec:
    """The spec vLLM builds for CPU offloading of HOST_BLOCKS blocks of the GPU block size
    (``make_config``: the conftest's ``offloading_config`` fixture)."""
    config = make_config(
        {"cpu_bytes_to_use": HOST_BLOCKS * CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT},
        world_size=1,
        tokens_per_block=BLOCK_TOKENS,
        bytes_per_block=CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT,
        events=False,
    )
    return CPUOffloadingSpec(config)


def step_output(
    new: list[tuple[str, tuple[list[int], ...], int]] = (), finished: set[str] = frozenset()
) -> SimpleNamespace:
    """The parts of a SchedulerOutput the connector scheduler reads."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=b) for r, b, _ in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
        num_scheduled_tokens={r: n for r, _, n in new},
        finished_req_ids=set(finished),
        preempted_req_ids=None,
        kv_cache_block_copies=None,
        kv_connector_block_state=None,
    )


def worker_reports(connector: OffloadingConnectorScheduler, job_ids: list[int]) -> None:
    """The worker's completion of these transfer jobs (one worker)."""
    meta = OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(job_ids, 1))
    connector.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta))


def replay_through_the_connector(
    bench: ModuleType, requests: list[dict], make_config: Callable[..., OffloadingConfig]
) -> tuple[Recorder, int]:
    """Each request as vLLM's scheduler serves it alone with the offloading connector."""
    kv_manager = bench.make_manager(DEVICE_BLOCKS, BLOCK_TOKENS)
    spec = offloading_spec(make_config)
    recorder = Recorder(spec.get_manager())
    spec._manager = recorder
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(
            prefix_cache_retention_interval=None, enable_prefix_caching=True
        ),
        speculative_config=None,
        parallel_config=SimpleNamespace(world_size=1, decode_context_parallel_size=1),
    )
    connector = OffloadingConnectorScheduler(spec, vllm_config, kv_manager.kv_cache_config)
    params = SamplingParams(max_tokens=1)
    loads = 0
    for index, trace_request in enumerate(requests):
        prompt = trace_request["input_length"]
        request = bench.trace_request_of(index, trace_request, params, BLOCK_TOKENS)
        request_id = request.request_id
        connector.on_new_request(request)
        # Scheduler.schedule: the local hit, then the connector's.
        blocks, local_tokens, _ = kv_manager.get_computed_blocks(request)
        external_tokens, load_async = connector.get_num_new_matched_tokens(request, local_tokens)
        assert external_tokens is not None
        assert load_async == (external_tokens > 0)
        computed_tokens = local_tokens + external_tokens
        if load_async:
            loads += 1
            allocated = kv_manager.allocate_slots(
                request,
                0,
                local_tokens,
                blocks,
                num_external_computed_tokens=external_tokens,
                delay_cache_blocks=True,
            )
            assert allocated is not None
            connector.update_state_after_alloc(
                request, kv_manager.get_blocks(request_id), external_tokens
            )
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            request.num_computed_tokens = computed_tokens
            meta = connector.build_connector_meta(step_output())
            worker_reports(connector, list(meta.load_jobs))
            # _update_waiting_for_remote_kv, then the request is scheduled again.
            kv_manager.cache_blocks(request, computed_tokens)
            if computed_tokens == prompt:
                computed_tokens = prompt - 1
            request.num_computed_tokens = computed_tokens
            request.status = RequestStatus.WAITING
            allocated = kv_manager.allocate_slots(
                request, prompt - computed_tokens, 0, kv_manager.empty_kv_cache_blocks
            )
            connector.update_state_after_alloc(request, kv_manager.get_blocks(request_id), 0)
        else:
            allocated = kv_manager.allocate_slots(
                request, prompt - local_tokens, local_tokens, blocks
            )
            connector.update_state_after_alloc(request, kv_manager.get_blocks(request_id), 0)
        assert allocated is not None
        request.num_computed_tokens = computed_tokens
        scheduled = (request_id, kv_manager.get_block_ids(request_id), prompt - computed_tokens)
        meta = connector.build_connector_meta(step_output(new=[scheduled]))
        store_jobs = list(meta.store_jobs)
        # The prefill ran and the request ends (Scheduler._free_request).
        request.num_computed_tokens = prompt
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        connector.request_finished(request)
        kv_manager.free(request)
        meta = connector.build_connector_meta(step_output(finished={request_id}))
        assert not meta.store_jobs
        worker_reports(connector, store_jobs)
    return recorder, loads


def test_the_bench_makes_the_offloading_connectors_manager_calls_in_its_order(
    offloading_config: Callable[..., OffloadingConfig],
) -> None:
    bench = load_bench()
    trace = os.environ.get("KVSHM_TRACE") or str(
        REPOSITORY / "traces" / "mooncake_conversation_trace.jsonl"
    )
    requests = bench.read_trace(trace, REQUESTS)

    theirs, loads = replay_through_the_connector(bench, requests, offloading_config)
    ours = Recorder(bench.make_offloading_manager(HOST_BLOCKS))
    report, _ = bench.replay_vllm_offloading(
        requests, DEVICE_BLOCKS, HOST_BLOCKS, BLOCK_TOKENS, offload=ours
    )

    # The bench's manager is the one the spec builds.
    spec_manager, bench_manager = theirs.manager, ours.manager
    assert type(bench_manager) is type(spec_manager)
    assert type(bench_manager._policy) is type(spec_manager._policy)
    for field in ("_num_chunks", "store_threshold", "events", "counts"):
        assert getattr(bench_manager, field) == getattr(spec_manager, field), field

    # The slice exercises every path: loads, CPU evictions, blocks already in CPU re-offered.
    assert loads > 0
    assert report["cpu_hit_blocks"] > 0
    assert report["cpu_evicted_blocks"] > 0
    assert any(
        name == "prepare_store" and answer is not None and len(answer[1]) < len(args[0])
        for name, args, _, answer in ours.calls
    )
    for index, (mine, vllms) in enumerate(zip(ours.calls, theirs.calls, strict=False)):
        assert mine == vllms, f"call {index} differs"
    assert len(ours.calls) == len(theirs.calls)
