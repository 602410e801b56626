"""``python -m kvshm worker`` and ``python -m kvshm kvctl``: the tools inside the wheel."""

import json
import subprocess
import sys

import kvshm


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvshm", *args], capture_output=True, text=True, timeout=60
    )


def test_the_worker_and_kvctl_answer_help_and_refuse_bad_arguments() -> None:
    assert "--rank" in run("worker", "--help").stdout
    assert "stat" in run("kvctl", "--help").stdout
    bad = run("worker", "--name", "x")
    assert bad.returncode == 2
    assert "--rank" in bad.stderr
    assert run("kvctl", "stat").returncode == 2
    unknown = run("frobnicate")
    assert unknown.returncode == 2
    assert "unknown command" in unknown.stderr


def test_a_worker_for_a_missing_segment_fails_with_a_message() -> None:
    missing = "no-such-segment-kvshm"
    result = run("worker", "--name", missing, "--rank", "0", "--attach-timeout", "0")
    assert result.returncode == 1
    assert missing in result.stderr


def test_kvctl_reads_a_live_service_and_its_workers(name: str, spawn_worker) -> None:
    with kvshm.Service(name, block_tokens=4, device_blocks=8, region_bytes=64) as service:
        spawn_worker(name, 0)
        service.wait_for_workers(timeout=20)
        service.poll()
        listed = json.loads(run("kvctl", "ls", "--json").stdout)
        assert any(entry.get("name") == name for entry in listed["segments"])
        workers = run("kvctl", "workers", name)
        assert workers.returncode == 0, workers.stderr
        assert "0" in workers.stdout
