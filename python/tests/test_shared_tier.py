"""A shared host tier without vLLM: its owner started as an engine starts it (and outliving the
process that started it), and two engines' host tiers on its arena, the bytes one stored read
back by the other."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import kvshm
from kvshm import _kvshm
from kvshm.shared_tier import (
    OwnerRestart,
    TierIdentity,
    ensure_tier_owner,
    owner_command,
    owner_log,
    remove_dead_engine_segments,
    stop_tier,
    wait_for_tier_owner,
)

PAGE = 64
CHUNKS = 8
IDENTITY = TierIdentity(
    model="m",
    kv_dtype="float16",
    block_tokens=16,
    block_bytes=2 * PAGE,
    blocks_per_chunk=1,
    layout="tp1",
)


@pytest.fixture
def tier(name: str) -> Iterator[str]:
    """A tier's name; its owner stopped and its arenas removed at the end."""
    yield name
    stop_tier(name)
    assert not list(Path("/dev/shm").glob(f"kvshm.{name}*"))


def parent_of(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1])


def start(
    tier: str,
    client_quota: int | None = None,
    storage: str | None = None,
    timeout_s: float = 120.0,
) -> int:
    return ensure_tier_owner(
        tier,
        IDENTITY,
        chunks=CHUNKS,
        ranks=1,
        arena_block_bytes=2 * PAGE,
        idle_exit_s=600,
        client_quota=client_quota,
        storage=storage,
        timeout_s=timeout_s,
    )


def served_line(tier: str, pid: int) -> dict:
    """The line owner ``pid`` printed into its log when it began to serve: it prints it just
    after it opens the tier to engines, so an engine may find it serving a moment before."""
    deadline = time.monotonic() + 60
    while True:
        for line in owner_log(tier).read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("pid") == pid and "chunks" in event:
                return event
        assert time.monotonic() < deadline, owner_log(tier).read_text()
        time.sleep(0.01)


def test_an_engine_starts_the_owner_once_and_not_as_its_child(tier: str) -> None:
    pid = start(tier, client_quota=3)
    assert _kvshm.shared_tier_owner(tier) == pid
    arguments = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert arguments[arguments.index(b"--client-quota") + 1] == b"3"
    assert parent_of(pid) != os.getpid(), "the owner must not die with the engine's tree"
    assert start(tier) == pid, "a second engine finds the owner serving"
    assert served_line(tier, pid)["arenas_taken_over"] is False
    assert _kvshm.shared_tier_clients(tier) == []


def test_owners_that_fail_on_their_own_are_reported_at_once_with_their_reason(
    tier: str, tmp_path: Path
) -> None:
    """Two engines start the tier at once with a storage tier their owners cannot open. Each
    owner says why as it exits, the one that lost the name to the other included: both engines
    stop waiting at once (not after the whole start timeout) with that reason. No owner served
    meanwhile: an owner opens its tier to engines only once it has set up its storage tier."""
    not_a_directory = tmp_path / "file"
    not_a_directory.write_bytes(b"")
    errors: list[BaseException | None] = [None, None]

    def engine(index: int) -> None:
        try:
            start(tier, storage=f"disk:{not_a_directory}", timeout_s=600.0)
        except BaseException as error:
            # Handed to the test's thread, which checks it.
            errors[index] = error

    began = time.monotonic()
    engines = [threading.Thread(target=engine, args=(index,)) for index in range(2)]
    for thread in engines:
        thread.start()
    for thread in engines:
        thread.join()
    assert time.monotonic() - began < 300, "an engine waited for a failed owner"
    for error in errors:
        assert isinstance(error, kvshm.SegmentError), error
        assert "did not start" in str(error), error
        assert "storage tier" in str(error), error
    assert _kvshm.shared_tier_owner(tier) is None


def test_an_owner_that_may_have_lost_to_another_leaves_its_engine_waiting(tier: str) -> None:
    """An owner that finds another owner serving, or an arena another is making, exits saying
    another owner may serve: an engine that reads that goes on waiting rather than failing, and
    finds the owner that serves once one does."""
    start(tier)
    options = ["--chunks", str(CHUNKS), "--arena-block-bytes", str(2 * PAGE), "--ranks", "1"]

    def failure_of_an_owner() -> tuple[dict, str]:
        owner = subprocess.run(
            owner_command(tier, IDENTITY, options), capture_output=True, text=True, check=False
        )
        assert owner.returncode != 0
        return json.loads(owner.stdout.splitlines()[-1]), owner.stdout

    served, served_line = failure_of_an_owner()
    assert served["another_owner_may_serve"] is True, served
    assert "live owner" in served["failed"], served
    stop_tier(tier)
    # An arena of the tier that another starter has only just made (no header yet).
    arena = Path(f"/dev/shm/kvshm.{tier}.host.0")
    arena.write_bytes(b"")
    try:
        half_made, _ = failure_of_an_owner()
    finally:
        arena.unlink()
    assert half_made["another_owner_may_serve"] is True, half_made
    # No owner serves for a while after such an owner exited (its winner still starting), and
    # another engine's owner failed on its own options before it took the name: the engine
    # that launched the first waits on.
    log_from = owner_log(tier).stat().st_size if owner_log(tier).exists() else 0
    elsewhere = {"pid": 1, "failed": "bad", "another_owner_may_serve": False}
    with owner_log(tier).open("a") as log:
        log.write(served_line)
        log.write(json.dumps({**elsewhere, "held_the_name": False}) + "\n")
    later = threading.Timer(0.5, start, args=(tier,))
    later.start()
    try:
        pid = wait_for_tier_owner(tier, timeout_s=120.0, started=served["pid"], log_from=log_from)
    finally:
        later.join()
    assert pid == _kvshm.shared_tier_owner(tier)
    # The owner that held the name failing is the end of the wait for every engine.
    stop_tier(tier)
    log_from = owner_log(tier).stat().st_size if owner_log(tier).exists() else 0
    with owner_log(tier).open("a") as log:
        log.write(json.dumps({**elsewhere, "held_the_name": True}) + "\n")
    with pytest.raises(kvshm.SegmentError, match="pid 1\\) did not start: bad") as failed:
        wait_for_tier_owner(tier, timeout_s=120.0, started=served["pid"], log_from=log_from)
    # It crosses processes as any exception does (executors pickle them).
    copied = pickle.loads(pickle.dumps(failed.value))
    assert (str(copied), copied.pid) == (str(failed.value), 1)


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="pinning needs a second CPU to leave out"
)
def test_an_owner_started_by_a_pinned_engine_runs_on_every_cpu(
    tier: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM pins each CPU worker to its cores, by its mask and by OpenMP's variables (which
    vLLM's preloaded libgomp obeys in every process that inherits them). An owner such a worker
    starts must not stay on that CPU: it would answer every engine only when the worker's
    computation lets it (1 s late, seen under vLLM)."""
    every_cpu = os.sched_getaffinity(0)
    first = min(every_cpu)
    monkeypatch.setenv("GOMP_CPU_AFFINITY", str(first))
    monkeypatch.setenv("OMP_PROC_BIND", "true")
    os.sched_setaffinity(0, {first})
    try:
        pid = start(tier)
    finally:
        os.sched_setaffinity(0, every_cpu)
    # Every CPU the runner has, at least (a runner itself pinned to some leaves the rest).
    assert os.sched_getaffinity(pid) >= every_cpu
    environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert not [v for v in environment if v.startswith((b"GOMP_CPU_AFFINITY=", b"OMP_PROC_BIND="))]


def engine_on(tier: str, segment: str) -> tuple[list[np.ndarray], kvshm.HostTier]:
    """An engine's two KV tensors of 4 blocks and its host tier on shared tier ``tier``."""
    gpu = [np.zeros((4, PAGE), dtype=np.uint8) for _ in range(2)]
    host = kvshm.HostTier(
        segment,
        page_bytes=PAGE,
        device_blocks=4,
        chunks=1,
        blocks_per_chunk=1,
        groups=[[0, 1]],
        tensors=gpu,
        shared_tier=tier,
    )
    return gpu, host


def test_a_block_one_engine_stored_is_read_back_by_another(tier: str, name: str) -> None:
    start(tier)
    engines = [engine_on(tier, f"{name}-e{index}") for index in range(2)]
    (first_gpu, first), (second_gpu, second) = engines
    first_gpu[0][2] = 7
    first_gpu[1][2] = 9
    # Engine one stores its block 2 into chunk 5 (a chunk the owner would name); engine two
    # loads chunk 5 into its block 3. The tier is as large as the owner's arena, whatever
    # `chunks` each engine gave.
    first.submit_store(1, [2], [1], [0], [5])
    assert first.take_finished()[0][:2] == (1, True)
    second.submit_load(1, [3], [1], [0], [5])
    assert second.take_finished()[0][:2] == (1, True)
    assert (second_gpu[0][3] == 7).all()
    stat = subprocess.run(
        [sys.executable, "-m", "kvshm", "kvctl", "stat", f"{name}-e0", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    config = json.loads(stat.stdout)["config"]
    assert (config["host_tier"], config["host_blocks"]) == ("shared", CHUNKS)
    assert (second_gpu[1][3] == 9).all()
    with pytest.raises(kvshm.OffloadError):
        second.submit_load(2, [3], [1], [0], [CHUNKS])
    for _, host in engines:
        host.close()


def test_a_tier_of_other_blocks_or_no_owner_is_refused(tier: str, name: str) -> None:
    gpu = [np.zeros((4, PAGE), dtype=np.uint8)]

    def host_tier(segment: str) -> kvshm.HostTier:
        return kvshm.HostTier(
            segment,
            page_bytes=PAGE,
            device_blocks=4,
            chunks=1,
            blocks_per_chunk=1,
            groups=[[0]],
            tensors=gpu,
            shared_tier=tier,
        )

    with pytest.raises(kvshm.SegmentError, match="arena"):
        host_tier(f"{name}-none")
    start(tier)
    # One tensor: 64-byte blocks against the tier's 128.
    with pytest.raises(kvshm.SegmentError, match="128"):
        host_tier(f"{name}-other")


class _Spec:
    """Stands in for vLLM's load/store spec class: the chunks it is given."""

    def __init__(self, chunks: object, keys: object = None, parents: object = None) -> None:
        self.chunks = list(np.asarray(chunks))


def _store_output(keys_to_store: list[bytes], store_spec: _Spec, evicted_keys: object) -> object:
    return list(keys_to_store), store_spec.chunks


#: vLLM's types as VllmSharedTierCore takes them, stood in for: lookup results, the store
#: output, the spec class, the event class, the medium, the request context.
_TYPES = (("MISS", "HIT", "PENDING", "RETRY"), _store_output, _Spec, object, "CPU", dict)


def _core(tier: str, deadline_s: float = 1.0) -> _kvshm.VllmSharedTierCore:
    return _kvshm.VllmSharedTierCore(
        tier,
        model=IDENTITY.model,
        kv_dtype=IDENTITY.kv_dtype,
        block_tokens=IDENTITY.block_tokens,
        block_bytes=IDENTITY.block_bytes,
        blocks_per_chunk=IDENTITY.blocks_per_chunk,
        layout=IDENTITY.layout,
        vllm_types=_TYPES,
        answer_deadline_s=deadline_s,
    )


def _step_ends(core: _kvshm.VllmSharedTierCore) -> None:
    """vLLM's scheduler steps end and the engine goes idle: what it queued is sent, and (the
    test waits for it) carried out by the owner."""
    core.on_schedule_end(None)
    core.on_schedule_end(None)
    assert not core.has_pending_work()
    core.flush()


def _key(n: int) -> bytes:
    return n.to_bytes(8, "little") + bytes(4)


def _request(name: str) -> SimpleNamespace:
    return SimpleNamespace(req_id=name)


def test_a_pin_of_a_dropped_connection_is_no_hit_after_the_engine_attaches_again(
    tier: str,
) -> None:
    """An engine pins a key at lookup, gives up on its stalled owner, and attaches again in a
    new slot: the key is asked of the owner again (a new pin on the new connection) rather than
    answered from the old connection's pin, which the new one does not hold."""
    pid = ensure_tier_owner(
        tier, IDENTITY, chunks=2, ranks=1, arena_block_bytes=2 * PAGE, idle_exit_s=600
    )
    storer, loader = _core(tier), _core(tier, deadline_s=0.3)
    storer.prepare_store([_key(1)], _request("a1"))
    storer.complete_store([_key(1)], _request("a1"))
    storer.on_request_finished(_request("a1"))
    _step_ends(storer)
    assert loader.lookup(_key(1), _request("c1")) == "HIT"

    os.kill(pid, signal.SIGSTOP)
    try:
        assert loader.lookup(_key(9), _request("c2")) == "MISS"
        assert not loader.connected
    finally:
        os.kill(pid, signal.SIGCONT)
    # The old slot keeps the loader's pin of key 1 while this process lives (the engine's copy
    # from its chunk may still run), so in the two-chunk tier key 3 evicts key 2, not key 1.
    for n in (2, 3):
        storer.prepare_store([_key(n)], _request(f"a{n}"))
        storer.complete_store([_key(n)], _request(f"a{n}"))
        storer.on_request_finished(_request(f"a{n}"))
        _step_ends(storer)
    time.sleep(1.1)  # the loader's reattach interval
    loader.lookup(_key(9), _request("c3"))
    assert loader.connected
    # Key 1's pin is the old connection's: the lookup asks the owner and pins it anew.
    pins_before = sum(client["pins"] for client in _kvshm.shared_tier_clients(tier))
    assert loader.lookup(_key(1), _request("c1")) == "HIT"
    pins_after = sum(client["pins"] for client in _kvshm.shared_tier_clients(tier))
    assert pins_after == pins_before + 1, "answered from the old connection's pin"
    chunks = loader.prepare_load([_key(1)], _request("c1")).chunks
    loader.complete_load([_key(1)], _request("c1"))
    _step_ends(loader)
    assert sum(client["pins"] for client in _kvshm.shared_tier_clients(tier)) == pins_before
    assert len(chunks) == 1


def test_a_store_of_keys_the_tier_holds_is_not_counted_refused(tier: str) -> None:
    """Engines that share store the same blocks: finding them stored is no refusal; a store
    while no owner serves is."""
    start(tier)
    first, second = _core(tier), _core(tier)
    assert first.prepare_store([_key(1)], _request("a")) == ([_key(1)], [0])
    first.complete_store([_key(1)], _request("a"))
    assert second.prepare_store([_key(1)], _request("b")) == ([], [])
    assert second.stats()["stores_refused"] == 0
    stop_tier(tier)
    assert second.prepare_store([_key(2)], _request("b")) == ([], [])
    assert second.stats()["stores_refused"] == 1


def test_calls_without_an_answer_wait_for_the_step_end_or_the_next_call(tier: str) -> None:
    """A store done, a load done and a request ended cost the engine no wait on the owner: they
    go with the next call that needs an answer, in the order made, or at the end of the vLLM
    step after the one they were made in (``on_schedule_end``), or when the engine would go
    idle (``has_pending_work``)."""
    start(tier)
    storer, loader = _core(tier), _core(tier)

    def pins() -> int:
        return sum(client["pins"] for client in _kvshm.shared_tier_clients(tier))

    assert storer.prepare_store([_key(1), _key(2)], _request("a")) == ([_key(1), _key(2)], [0, 1])
    waits = storer.stats()["owner_calls"]
    storer.complete_store([_key(1), _key(2)], _request("a"))
    storer.on_request_finished(_request("a"))
    assert storer.stats()["owner_calls"] == waits, "a call with no answer waited"
    storer.on_schedule_end(None)
    assert storer.stats()["owner_calls"] == waits, "sent in the step it was queued in"
    assert loader.lookup(_key(1), _request("b")) == "MISS", "stored before the step's end"
    storer.on_schedule_end(None)
    assert storer.stats()["owner_calls"] == waits + 1
    assert storer.stats()["owner_waits"] == waits, "the step's end waited"
    _step_ends(storer)
    assert storer.stats()["owner_calls"] == waits + 1, "sent twice"
    assert loader.lookup(_key(1), _request("c")) == "HIT"
    assert pins() == 1

    # The load's end is queued; the next lookup carries it ahead of its own call.
    loader.prepare_load([_key(1), _key(2)], _request("c"))  # asks for key 2: a wait
    loader.complete_load([_key(1), _key(2)], _request("c"))
    loader.on_request_finished(_request("c"))
    assert pins() == 2
    waits = loader.stats()["owner_calls"]
    assert loader.lookup(_key(3), _request("d")) == "MISS"
    assert loader.stats()["owner_calls"] == waits + 1
    assert pins() == 0

    # An engine about to idle sends what it queued, without waiting, and idles.
    loader.on_request_finished(_request("d"))
    calls, waited = loader.stats()["owner_calls"], loader.stats()["owner_waits"]
    assert not loader.has_pending_work()
    assert loader.stats()["owner_calls"] == calls + 1
    assert loader.stats()["owner_waits"] == waited


def test_a_store_takes_leased_chunks_without_waiting_on_the_owner(tier: str) -> None:
    """Once a wait has leased an engine chunks (its first lookup's), its stores are answered
    from the lease with no wait on the owner, which learns with the next batch which keys went
    where: hits for another engine once stored. A key it is storing is not stored twice; a
    store the lease cannot cover is asked of the owner."""
    ensure_tier_owner(
        tier, IDENTITY, chunks=1024, ranks=1, arena_block_bytes=2 * PAGE, idle_exit_s=600
    )
    storer, loader = _core(tier), _core(tier)
    assert storer.lookup(_key(9), _request("a")) == "MISS"  # a wait: the lease comes with it
    waits = storer.stats()["owner_waits"]
    keys, chunks = storer.prepare_store([_key(1), _key(2), _key(1)], _request("a"))
    assert keys == [_key(1), _key(2)]
    assert len(set(chunks)) == 2
    assert storer.prepare_store([_key(1)], _request("a")) == ([], []), "being stored"
    assert storer.stats()["owner_waits"] == waits, "answered from the lease"
    assert loader.lookup(_key(1), _request("b")) == "MISS", "the owner was not told yet"
    storer.complete_store([_key(1), _key(2)], _request("a"))
    storer.on_request_finished(_request("a"))
    assert not storer.has_pending_work()  # sends the keys' chunks and the stores' ends
    storer.flush()
    assert loader.lookup(_key(1), _request("c")) == "HIT"
    # 16 chunks leased at most (a 64th of the tier): 20 keys are asked of the owner.
    many = [_key(100 + n) for n in range(20)]
    keys, chunks = storer.prepare_store(many, _request("d"))
    assert keys == many
    assert len(set(chunks)) == 20
    assert storer.stats()["owner_waits"] > waits


def test_a_store_is_not_taken_from_the_lease_of_an_owner_that_exited(tier: str) -> None:
    """A new owner gives the chunks a dead one leased to other stores once its store grace is
    over: an engine looks at its owner's process before it answers a store from its lease."""
    pid = ensure_tier_owner(
        tier, IDENTITY, chunks=1024, ranks=1, arena_block_bytes=2 * PAGE, idle_exit_s=600
    )
    core = _core(tier)
    assert core.lookup(_key(9), _request("a")) == "MISS"  # a wait: the lease comes with it
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while _kvshm.shared_tier_owner(tier) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert core.prepare_store([_key(1)], _request("a")) == ([], [])
    assert not core.connected


def test_a_step_end_and_an_idling_engine_send_without_waiting(tier: str) -> None:
    """The calls a step's end or an engine about to idle sends need no answer: the engine goes
    on while the owner is stopped and keeps its connection; the owner carries them out once it
    runs again."""
    pid = start(tier)
    storer, loader = _core(tier), _core(tier)
    for step_end, request, key in ((True, "a", _key(1)), (False, "b", _key(2))):
        storer.prepare_store([key], _request(request))
        storer.complete_store([key], _request(request))
        storer.on_request_finished(_request(request))
        storer.on_schedule_end(None)
        calls, waited = storer.stats()["owner_calls"], storer.stats()["owner_waits"]
        os.kill(pid, signal.SIGSTOP)
        try:
            if step_end:
                storer.on_schedule_end(None)
            else:
                assert not storer.has_pending_work()
            assert storer.connected, "waited for a stopped owner until it gave up"
            assert storer.stats()["owner_calls"] == calls + 1
            assert storer.stats()["owner_waits"] == waited
        finally:
            os.kill(pid, signal.SIGCONT)
        storer.flush()
        assert storer.connected
        assert loader.lookup(key, _request(f"{request}-loader")) == "HIT"


def test_a_step_end_finds_a_dead_owner_gone_so_the_engine_can_start_another(tier: str) -> None:
    """A step's end that sends without waiting still looks at the owner's process: vLLM's
    manager starts a new owner in that step only if the client says it is gone."""
    pid = start(tier)
    core = _core(tier)
    core.prepare_store([_key(1)], _request("a"))
    core.complete_store([_key(1)], _request("a"))
    core.on_schedule_end(None)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while _kvshm.shared_tier_owner(tier) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    core.on_schedule_end(None)  # sends the store's end
    assert not core.connected


def test_an_idling_engine_is_not_raised_at_by_a_tier_it_can_no_longer_use(tier: str) -> None:
    """vLLM asks ``has_pending_work`` in its engine loop, where an exception would end the
    engine: when the tier's name has come to be served by an owner of other blocks, it sends
    nothing and says no; the engine's next call that attaches raises."""
    start(tier)
    core = _core(tier)
    core.prepare_store([_key(1)], _request("a"))
    stop_tier(tier)
    other = dataclasses.replace(IDENTITY, kv_dtype="bfloat16")
    ensure_tier_owner(
        tier, other, chunks=CHUNKS, ranks=1, arena_block_bytes=2 * PAGE, idle_exit_s=600
    )
    core.complete_store([_key(1)], _request("a"))
    assert not core.has_pending_work()  # finds its owner gone
    time.sleep(1.1)  # the reattach interval
    core.complete_store([_key(2)], _request("a"))
    assert not core.has_pending_work()  # attaches, and is refused
    assert not core.connected
    time.sleep(1.1)
    with pytest.raises(kvshm.ConfigError, match="bfloat16"):
        core.lookup(_key(3), _request("b"))


def test_a_wait_for_a_step_end_the_owner_has_not_answered_counts(tier: str) -> None:
    """`owner_waits` counts each time the engine waited on the owner, the wait for a batch the
    step's end sent (a later call's pages are that batch's until its end is answered)."""
    pid = start(tier)
    core = _core(tier, deadline_s=5.0)
    core.prepare_store([_key(1)], _request("a"))
    core.complete_store([_key(1)], _request("a"))
    core.on_schedule_end(None)
    os.kill(pid, signal.SIGSTOP)
    # Resumed by another process while this thread waits in the lookup.
    resume = subprocess.Popen(["sh", "-c", f"sleep 0.3; kill -CONT {pid}"])
    try:
        core.on_schedule_end(None)  # the store's end, not waited for
        waits = core.stats()["owner_waits"]
        assert core.lookup(_key(2), _request("b")) == "MISS"
    finally:
        resume.wait()
        os.kill(pid, signal.SIGCONT)
    assert core.stats()["owner_waits"] == waits + 2


def test_a_wait_on_a_stopped_owner_lets_the_engines_other_threads_run(tier: str) -> None:
    """A lookup waiting on an owner that does not answer (stopped here; starved of CPU in
    practice) stalls the thread that asked, for its deadline, and no other Python thread: the
    wait past its first millisecond lets go of the GIL."""
    pid = start(tier)
    core = _core(tier, deadline_s=0.5)
    counted = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            counted[0] += 1

    def pace() -> float:
        """The counter's counts a second while this thread sleeps (the GIL free for it)."""
        before = counted[0]
        time.sleep(0.1)
        return (counted[0] - before) / 0.1

    counter = threading.Thread(target=count)
    os.kill(pid, signal.SIGSTOP)
    try:
        counter.start()
        pace_before = pace()
        before = counted[0]
        started = time.monotonic()
        assert core.lookup(_key(1), _request("a")) == "MISS"
        waited = time.monotonic() - started
        during = counted[0] - before
        pace_after = pace()
    finally:
        stop.set()
        counter.join()
        os.kill(pid, signal.SIGCONT)
    assert not core.connected
    assert waited >= 0.4
    # Had the wait held the GIL, the counter would have run only in the switches to it before
    # and after the lookup (5 ms each), about 2% of the wait's time. The slower of the two
    # paces: a machine busier during one of them counts against the wait no more.
    share = during / (min(pace_before, pace_after) * waited)
    assert share > 0.25, f"the other thread ran {share:.0%} of its pace during the wait"


def _two_stored_keys_and_a_request_of_four(
    tier: str,
) -> tuple[_kvshm.VllmSharedTierCore, _kvshm.VllmSharedTierCore, SimpleNamespace]:
    """A served tier holding keys 1 and 2 (the storer's), a second engine (the loader), and a
    request of keys 1 to 4 with vLLM's position table."""
    start(tier)
    storer, loader = _core(tier), _core(tier)
    storer.prepare_store([_key(1), _key(2)], _request("a"))
    storer.complete_store([_key(1), _key(2)], _request("a"))
    _step_ends(storer)
    request = SimpleNamespace(
        req_id="b", _offload_key_positions={_key(n): 16 * n for n in (1, 2, 3, 4)}
    )
    return storer, loader, request


def test_the_key_past_a_found_prefix_is_a_miss_without_a_call_once(tier: str) -> None:
    """A lookup asks for the key and the request's keys after it: the prefix found is pinned,
    and the key that ended it is a miss without a call when vLLM looks it up next; a lookup of
    it in a later step asks again."""
    _, loader, request = _two_stored_keys_and_a_request_of_four(tier)
    waits = loader.stats()["owner_calls"]
    assert [loader.lookup(_key(n), request) for n in (1, 2, 3)] == ["HIT", "HIT", "MISS"]
    assert loader.stats()["owner_calls"] == waits + 1
    assert loader.lookup(_key(3), request) == "MISS"
    assert loader.stats()["owner_calls"] == waits + 2, "a later lookup of the miss asks again"


def test_a_reset_lets_go_of_the_pins_of_lookups_but_not_of_loads_in_flight(tier: str) -> None:
    """vLLM's reset of its prefix cache forgets its lookups: the reset lets their pins go, or
    no engine could ever evict their chunks. A load in flight may still be copying into blocks
    a request goes on with (vLLM drops only its completion): its pin stays."""
    _, loader, request = _two_stored_keys_and_a_request_of_four(tier)

    def pins() -> int:
        return sum(client["pins"] for client in _kvshm.shared_tier_clients(tier))

    assert loader.lookup(_key(1), request) == "HIT"
    loader.prepare_load([_key(1)], request)
    assert loader.lookup(_key(2), _request("c")) == "HIT"
    _step_ends(loader)
    assert pins() == 2, "a load's pin and a lookup's"
    loader.reset_cache()
    _step_ends(loader)
    assert pins() == 1, "the load's pin stays"
    # The requests live on in vLLM: finishing them lets go of nothing twice.
    loader.on_request_finished(request)
    loader.on_request_finished(_request("c"))
    _step_ends(loader)
    assert pins() == 1
    assert loader.lookup(_key(2), _request("d")) == "HIT", "the tier kept its keys"


def test_a_reset_abandons_the_stores_in_flight_so_any_engine_stores_their_keys(
    tier: str,
) -> None:
    """vLLM's reset drops the completions of the store jobs in flight, so their keys would stay
    pending, a miss that no engine could store, until this engine left the tier. The reset
    abandons them: the keys may be stored again at once, by this engine or another; their
    chunks stay the engine's until it leaves."""
    start(tier)
    first, second = _core(tier), _core(tier)
    assert first.prepare_store([_key(1), _key(2)], _request("a")) == ([_key(1), _key(2)], [0, 1])
    _step_ends(first)
    first.reset_cache()
    _step_ends(first)
    assert second.lookup(_key(1), _request("b")) == "MISS"
    stored, _ = second.prepare_store([_key(1)], _request("b"))
    assert stored == [_key(1)], "another engine stores the key at once"
    second.complete_store([_key(1)], _request("b"))
    _step_ends(second)
    assert second.lookup(_key(1), _request("c")) == "HIT"
    second.on_request_finished(_request("c"))
    # The two chunks the abandoned copies may still write stay the first engine's, however long
    # it takes to step again (its worker runs a store then): past any grace, the second engine
    # filling the tier gets the other six chunks only.
    time.sleep(2.5)
    for n in range(10, 10 + CHUNKS):
        second.prepare_store([_key(n)], _request(f"f{n}"))
        second.complete_store([_key(n)], _request(f"f{n}"))
        second.on_request_finished(_request(f"f{n}"))
        _step_ends(second)
    cached = [
        n for n in range(10, 10 + CHUNKS) if second.lookup(_key(n), _request(f"g{n}")) == "HIT"
    ]
    assert len(cached) == CHUNKS - 2, cached
    for n in range(10, 10 + CHUNKS):
        second.on_request_finished(_request(f"g{n}"))
    _step_ends(second)
    stored, _ = first.prepare_store([_key(2)], _request("a2"))
    assert stored == [_key(2)], "and the engine that reset stores its keys again"


def test_an_engine_restarts_a_dead_owner_on_the_arenas_it_maps(tier: str, name: str) -> None:
    """The owner is SIGKILLed while an engine runs: the engine misses, starts a new owner that
    takes over the arenas it maps (their bytes kept, none made) and the keys the tier held, and
    is served again, its stores after the new owner's grace."""
    pid = start(tier)
    gpu, host = engine_on(tier, f"{name}-e")
    gpu[0][1] = 5
    host.submit_store(1, [1], [1], [0], [3])
    assert host.take_finished()[0][:2] == (1, True)
    core = _core(tier)
    assert core.prepare_store([_key(2)], _request("s")) == ([_key(2)], [0])
    core.complete_store([_key(2)], _request("s"))
    _step_ends(core)
    restart = OwnerRestart(
        tier, IDENTITY, ranks=1, idle_exit_s=600, interval_s=0.3, takeover_grace_ms=300
    )
    assert restart.poll() is None, "an owner serves: none started"

    os.kill(pid, signal.SIGKILL)
    while _kvshm.shared_tier_owner(tier) is not None:
        time.sleep(0.01)
    assert core.lookup(_key(1), _request("a")) == "MISS"
    assert not core.connected
    time.sleep(0.3)  # the restart's interval since its last look
    started = restart.poll()
    assert started is not None
    assert restart.poll() is None, "one attempt an interval"
    assert wait_for_tier_owner(tier, timeout_s=30, started=started) == started
    started_line = served_line(tier, started)
    assert (started_line["arenas_taken_over"], started_line["keys_restored"]) == (True, 1)

    # The engine's mapping is still the tier's: its bytes are there for a load.
    gpu[0][2] = 0
    host.submit_load(2, [2], [1], [0], [3])
    assert host.take_finished()[0][:2] == (2, True)
    assert (gpu[0][2] == 5).all()
    time.sleep(1.1)  # the client's reattach interval, and the new owner's grace
    assert core.lookup(_key(2), _request("b")) == "HIT", "the key stored before is back"
    assert core.connected
    assert core.prepare_store([_key(1)], _request("b")) == ([_key(1)], [1])
    host.close()


def test_a_load_of_more_keys_than_one_call_carries_pins_them_all(tier: str) -> None:
    """``prepare_load`` of keys no lookup pinned asks for them in as many calls as it takes
    (one call carries at most 4,096 keys)."""
    count = 5000
    # Room beyond the keys: a full tier's owner evicts a few ahead of demand (--free-chunks).
    ensure_tier_owner(
        tier, IDENTITY, chunks=count + 100, ranks=1, arena_block_bytes=2 * PAGE, idle_exit_s=600
    )
    storer, loader = _core(tier), _core(tier)
    keys = [_key(n) for n in range(count)]
    stored, _ = storer.prepare_store(keys, _request("a"))
    assert len(stored) == count
    storer.complete_store(keys, _request("a"))
    _step_ends(storer)
    chunks = loader.prepare_load(keys, _request("b")).chunks
    assert sorted(chunks) == list(range(count))
    pins = sum(client["pins"] for client in _kvshm.shared_tier_clients(tier))
    assert pins == count


def test_a_missed_key_from_an_earlier_step_is_asked_again(tier: str) -> None:
    """The key past a found prefix, not looked up in that step, is stored by another engine; a
    later step's lookup of it (its earlier blocks in the GPU prefix cache, or vLLM's
    sliding-window scan from the end) asks the owner rather than miss."""
    storer, loader, request = _two_stored_keys_and_a_request_of_four(tier)
    assert loader.lookup(_key(1), request) == "HIT"
    loader.on_schedule_end(None)
    storer.prepare_store([_key(3)], _request("a2"))
    storer.complete_store([_key(3)], _request("a2"))
    _step_ends(storer)
    loader.on_schedule_end(None)
    assert loader.lookup(_key(3), request) == "HIT"


def test_a_restart_that_brings_no_owner_is_tried_less_and_less_often(tier: str) -> None:
    """No arenas to take over: the owner a restart starts exits at once (it makes none, for
    engines might map the ones that are gone), and the engine waits twice as long before the
    next start."""
    restart = OwnerRestart(tier, IDENTITY, ranks=1, idle_exit_s=600, interval_s=0.3)
    assert restart.poll() is not None
    time.sleep(0.35)
    assert restart.poll() is None, "tried again after one interval"
    time.sleep(0.3)
    assert restart.poll() is not None, "tried again after two"
    deadline = time.monotonic() + 10
    while "no arena of rank 0 to take over" not in owner_log(tier).read_text():
        assert time.monotonic() < deadline, owner_log(tier).read_text()
        time.sleep(0.05)


def test_a_block_on_the_storage_tier_is_retried_until_it_is_back(tier: str, tmp_path: Path) -> None:
    """An owner with a storage tier below (``disk:DIR``): a key the arena evicted is one the
    engine is told to look up again (``RETRY``), the keys after it that the storage holds too,
    and the first it does not a miss, all from one call to the owner; once back it is a hit."""
    storage = f"disk:{tmp_path}"
    owner = ensure_tier_owner(
        tier,
        IDENTITY,
        chunks=8,
        ranks=1,
        arena_block_bytes=2 * PAGE,
        idle_exit_s=600,
        storage=storage,
        storage_chunks=16,
    )
    # The storage spec (a Redis URL may carry a password) is in the owner's environment, which
    # only its user reads, not on its command line, which every user does.
    assert storage not in Path(f"/proc/{owner}/cmdline").read_text()
    assert f"KVSHM_STORAGE={storage}" in Path(f"/proc/{owner}/environ").read_text().split("\0")
    storer, loader = _core(tier), _core(tier)

    def store(keys: list[bytes], request: str) -> bool:
        stored, _ = storer.prepare_store(keys, _request(request))
        storer.complete_store(stored, _request(request))
        storer.on_request_finished(_request(request))
        _step_ends(storer)
        return len(stored) == len(keys)

    assert store([_key(1), _key(2), _key(3)], "a")
    # Storing 5..12 evicts 1..3, once they are written to disk (until then they are pinned).
    deadline = time.monotonic() + 10
    while not store([_key(n) for n in range(5, 13)], "b"):
        assert time.monotonic() < deadline, "the writes to disk never finished"
        time.sleep(0.01)

    keys = [_key(n) for n in (1, 2, 3, 99)]
    context = SimpleNamespace(
        req_id="c", _offload_key_positions={key: at for at, key in enumerate(keys)}
    )

    def calls() -> int:
        return sum(client["calls"] for client in _kvshm.shared_tier_clients(tier))

    # Bringing 1..3 back takes chunks that 5..12's writes may still pin: until they are done,
    # the owner cannot make room, and the lookup is a miss.
    while loader.lookup(keys[0], context) != "RETRY":
        assert time.monotonic() < deadline, "key 1 never started coming back"
        loader.on_schedule_end(None)
        time.sleep(0.01)
    before = calls()
    assert [loader.lookup(key, context) for key in keys[1:]] == ["RETRY", "RETRY", "MISS"]
    assert calls() == before, "the keys after the first were answered without a call"
    loader.on_schedule_end(None)
    while loader.lookup(keys[0], context) != "HIT":
        assert time.monotonic() < deadline, "key 1 never came back"
        loader.on_schedule_end(None)
        time.sleep(0.01)
    assert [loader.lookup(key, context) for key in keys[1:]] == ["HIT", "HIT", "MISS"]
    assert len(loader.prepare_load(keys[:3], context).chunks) == 3
    loader.complete_load(keys[:3], context)
    loader.on_request_finished(context)
    _step_ends(loader)


def test_the_segments_of_dead_engines_go_and_no_other(name: str) -> None:
    """An engine on a shared tier removes, at start, the segments ``<prefix>-<engine>-r<rank>``
    that engines killed before left; a running engine's segment stays, and so do dead segments
    of other names."""
    holder = (
        "import sys, kvshm\n"
        "service = kvshm.Service(sys.argv[1], block_tokens=4, device_blocks=8, region_bytes=64)\n"
        "print('up', flush=True)\n"
        "sys.stdin.read()\n"
    )

    def hold(segment: str) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, "-c", holder, segment],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None
        assert process.stdout.readline() == "up\n"
        return process

    dead_engine, live_engine = f"{name}-0badf00d-r0", f"{name}-1234abcd-r0"
    dead_other = f"{name}-r0"
    processes = [hold(segment) for segment in (dead_engine, live_engine, dead_other)]
    try:
        for process in (processes[0], processes[2]):
            process.kill()
            process.wait()
        assert remove_dead_engine_segments(name) == [dead_engine]
        shm = Path("/dev/shm")
        assert not list(shm.glob(f"kvshm.{dead_engine}*"))
        assert (shm / f"kvshm.{live_engine}").exists()
        assert (shm / f"kvshm.{dead_other}").exists()
        assert remove_dead_engine_segments(name) == []
    finally:
        for process in processes:
            process.kill()
            process.wait()
        cleanup = [sys.executable, "-m", "kvshm", "kvctl", "cleanup", live_engine, dead_other]
        subprocess.run(cleanup, capture_output=True, check=False)
