"""Shared fixtures: unique segment names and real ``python -m kvshm worker`` processes."""

import itertools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

_counter = itertools.count()


def unique_name(test: str) -> str:
    """A segment name no other test (or test run) uses."""
    return f"py-{test[:24]}-{os.getpid()}-{next(_counter)}"


@pytest.fixture
def name(request: pytest.FixtureRequest) -> str:
    return unique_name(request.node.name.replace("_", "")[:24])


@pytest.fixture
def spawn_worker() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Starts ``python -m kvshm worker`` processes; kills whatever is left at the end."""
    started: list[subprocess.Popen[bytes]] = []

    def spawn(
        segment: str, rank: int, env: dict[str, str] | None = None, args: list[str] | None = None
    ) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "kvshm", "worker", "--name", segment, "--rank", str(rank)]
        command += args or []
        process = subprocess.Popen(
            command, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL
        )
        started.append(process)
        return process

    yield spawn
    for process in started:
        process.kill()
        process.wait()
