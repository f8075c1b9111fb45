"""Fixtures live in tests/plugins/, one file per concern.

tests/conformance runs in a virtualenv of its own that has vLLM (`./scripts/conformance`);
this suite's virtualenv has none, so it does not collect them. tests/real starts vLLM's CPU
build (`./scripts/vllm-cpu test`), and is collected only when KVGATE_REAL_VLLM is set.
"""

import importlib.util
import os

import pytest

pytest_plugins = [
    "tests.plugins.blocking",
    "tests.plugins.processes",  # imported by the two below: registered first
    "tests.plugins.redis_server",
    "tests.plugins.sim",
    "tests.plugins.gateway",
    "tests.plugins.envoy",
]

collect_ignore = [] if importlib.util.find_spec("vllm") else ["conformance"]
# tests/real starts real vLLM engines from vLLM's CPU build: `./scripts/vllm-cpu test` runs it.
if not os.environ.get("KVGATE_REAL_VLLM"):
    collect_ignore.append("real")

# Fixtures that start a process (kvgate, Envoy): a test that uses one is `slow`.
PROCESS_FIXTURES = {"start_kvgate", "envoy_factory"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `slow` what starts processes without saying so in the test: a test using a
    fixture of PROCESS_FIXTURES, and the conformance suite (a vLLM engine each)."""
    for item in items:
        uses_a_process = bool(PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())))
        if uses_a_process or item.nodeid.startswith(("tests/conformance/", "tests/real/")):
            item.add_marker(pytest.mark.slow)
