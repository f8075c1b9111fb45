"""Fixtures live in tests/plugins/, one file per concern."""

import importlib.util

pytest_plugins = [
    "tests.plugins.redis_server",
    "tests.plugins.sim",
    "tests.plugins.gateway",
]

# tests/conformance compares the simulator with vLLM's own code; it runs only in a virtualenv
# that has vLLM (see tests/conformance/conftest.py).
collect_ignore = [] if importlib.util.find_spec("vllm") else ["conformance"]
