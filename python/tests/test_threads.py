"""Two Python threads using one ``Service`` or ``HostTier``: one waits (GIL released) while the
other calls in. Each scenario runs in a child interpreter with a time limit, so that a deadlock
fails the test instead of hanging the suite (faulthandler dumps the child's threads if it hangs).
"""

import subprocess
import sys
import textwrap

import pytest

# Far longer than any scenario needs on a loaded machine; only a deadlock gets near it.
CHILD_LIMIT_S = 120

PRELUDE = """
import faulthandler, sys, threading, time
import kvshm
faulthandler.dump_traceback_later({limit}, exit=True)

def in_thread(call):
    outcome = {{}}
    def run():
        try:
            outcome["value"] = call()
        except BaseException as error:  # noqa: BLE001 - reported to the main thread
            outcome["error"] = error
    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome

def until(condition):
    while not condition():
        time.sleep(0.01)
"""


def run_child(name: str, body: str) -> str:
    script = PRELUDE.format(limit=CHILD_LIMIT_S - 10) + textwrap.dedent(body)
    try:
        done = subprocess.run(
            [sys.executable, "-c", script, name],
            capture_output=True,
            text=True,
            timeout=CHILD_LIMIT_S,
        )
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the scenario hung:\n{expired.stderr!r}")
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done.stdout


def test_a_thread_calls_the_service_while_another_waits_for_workers(name: str) -> None:
    out = run_child(
        name,
        """
        service = kvshm.Service(sys.argv[1], block_tokens=4, device_blocks=8, region_bytes=64)
        # No worker ever comes: the wait lasts its whole timeout, with the GIL released.
        waiter, outcome = in_thread(lambda: service.wait_for_workers(timeout=60.0))
        time.sleep(0.3)
        for _ in range(20):
            service.poll()
            assert service.rank_states() == ["down"]
        # The calls above returned while the wait went on: they did not wait for it to end.
        assert waiter.is_alive()
        service.close()
        waiter.join()
        assert isinstance(outcome.get("error"), kvshm.SegmentError), outcome
        print("ok")
        """,
    )
    assert out.strip() == "ok"


def test_a_thread_calls_the_host_tier_while_another_waits_on_its_jobs(name: str) -> None:
    out = run_child(
        name,
        """
        tier = kvshm.HostTier(
            sys.argv[1], page_bytes=64, device_blocks=8, chunks=4, blocks_per_chunk=1,
            groups=[[0]], tensor_count=1,
        )
        # A worker process would copy; none runs, so the job stays pending.
        tier.submit_store(7, [1], [1], [0], [2])
        waiter, outcome = in_thread(lambda: tier.wait([7], timeout=60.0))
        time.sleep(0.3)
        for _ in range(20):
            assert tier.pending == 1
            assert tier.take_finished() == []
            assert not tier.worker_up
        assert waiter.is_alive()
        tier.close()
        waiter.join()
        assert isinstance(outcome.get("error"), kvshm.SegmentError), outcome
        print("ok")
        """,
    )
    assert out.strip() == "ok"
