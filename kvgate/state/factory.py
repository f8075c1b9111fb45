"""Build the configured StateStore: memory alone, or Redis behind the failure policy."""

from __future__ import annotations

import logging
from typing import get_args

from kvgate.state.base import StateStore
from kvgate.state.memory import MemoryStore
from kvgate.state.redis import RedisStore
from kvgate.state.resilient import FailureMode, ResilientStore


def build_store(
    backend: str,
    redis_url: str | None,
    key_prefix: str,
    failure_mode: str,
    timeout_s: float,
    *,
    probe_interval_s: float = 1.0,
    logger: logging.Logger | None = None,
) -> StateStore:
    """`memory` → MemoryStore; `redis` → ResilientStore(RedisStore, MemoryStore, failure_mode).

    Raises ValueError for an unknown backend or failure mode, or `redis` without a URL. Nothing
    connects here: the first call does (and a dead Redis then meets the failure mode).
    """
    if backend == "memory":
        return MemoryStore()
    if backend != "redis":
        raise ValueError(f"state backend must be 'memory' or 'redis', got {backend!r}")
    if not redis_url:
        raise ValueError("state backend 'redis' needs a redis_url")
    mode = _failure_mode(failure_mode)
    primary = RedisStore(redis_url, key_prefix=key_prefix, timeout_s=timeout_s)
    return ResilientStore(
        primary, MemoryStore(), mode, probe_interval_s=probe_interval_s, logger=logger
    )


def _failure_mode(value: str) -> FailureMode:
    if value == "fail_open":
        return "fail_open"
    if value == "fail_closed":
        return "fail_closed"
    raise ValueError(f"failure mode must be one of {get_args(FailureMode)}, got {value!r}")
