"""build_store: the configured backend, behind the configured failure mode."""

from __future__ import annotations

import pytest

from kvgate.state.factory import build_store
from kvgate.state.memory import MemoryStore
from kvgate.state.resilient import ResilientStore


async def test_memory_backend_is_a_plain_memory_store() -> None:
    store = build_store("memory", None, "kvgate", "fail_open", 0.25)
    assert isinstance(store, MemoryStore)


async def test_redis_backend_is_wrapped_in_the_failure_policy() -> None:
    store = build_store("redis", "redis://127.0.0.1:1/0", "kvgate", "fail_closed", 0.25)
    assert isinstance(store, ResilientStore)
    assert store.backend == "redis"
    assert store.mode == "fail_closed"
    await store.close()


@pytest.mark.parametrize(
    ("backend", "url", "mode", "message"),
    [
        ("etcd", None, "fail_open", "backend"),
        ("redis", None, "fail_open", "redis_url"),
        ("redis", "redis://127.0.0.1:1/0", "fail_maybe", "failure mode"),
    ],
)
def test_a_bad_configuration_is_refused(
    backend: str, url: str | None, mode: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build_store(backend, url, "kvgate", mode, 0.25)
