"""Fixtures live in tests/plugins/, one file per concern."""

pytest_plugins = [
    "tests.plugins.redis_server",
    "tests.plugins.sim",
    "tests.plugins.gateway",
]
