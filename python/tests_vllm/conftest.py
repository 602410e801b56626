"""Tests that need vLLM 0.32 (run by scripts/test-vllm inside its venv)."""

import itertools
import os

import pytest

_counter = itertools.count()


@pytest.fixture
def name(request: pytest.FixtureRequest) -> str:
    return f"pyv-{request.node.name.replace('_', '')[:20]}-{os.getpid()}-{next(_counter)}"
