"""Fixtures live in tests/plugins/, one file per concern.

tests/conformance runs in a virtualenv of its own that has vLLM (`./scripts/conformance`);
this suite's virtualenv has none, so it does not collect them.
"""

import importlib.util

pytest_plugins = [
    "tests.plugins.redis_server",
    "tests.plugins.sim",
    "tests.plugins.gateway",
]

collect_ignore = [] if importlib.util.find_spec("vllm") else ["conformance"]
