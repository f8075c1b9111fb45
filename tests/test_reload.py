"""A reload takes effect for every section of the config, observed from outside where it can
be; the few settings read only at start (listen address, drain time, the state store) are
named in the reload's log line instead."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import aiohttp
import pytest

from kvgate.app import RESTART_ONLY, reload
from kvgate.config import Config
from tests.plugins.gateway import RunningGateway, gateway_config

CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def running(stub_factory, gateway_factory) -> tuple[RunningGateway, Any, Any]:
    first, second = await stub_factory(), await stub_factory()
    gw = await gateway_factory(gateway_config([first.url]))
    return gw, first, second


def again(gw: RunningGateway, **sections: Any) -> Config:
    """The running config with `sections` replaced, reloaded."""
    tree = gw.gateway.runtime.config.model_dump(mode="json", exclude_none=True)
    tree.update(sections)
    from kvgate.config import parse_config

    config = parse_config(tree)
    assert reload(gw.app, lambda: config) is True
    return config


async def post(gw: RunningGateway, body: Any, headers: dict[str, str] | None = None) -> int:
    async with aiohttp.ClientSession() as http, http.post(
        f"{gw.url}/v1/chat/completions", json=body, headers=headers or {}
    ) as resp:
        await resp.read()
        return resp.status


async def test_server_body_limit_and_headers_change_at_once(running):
    gw, _, _ = running
    again(gw, server={"max_body_bytes": 64, "accounting_headers": False})
    assert await post(gw, {**CHAT, "padding": "x" * 200}) == 413


async def test_timeouts_routing_calibration_and_admission_take_effect(running):
    gw, _, _ = running
    g = gw.gateway
    await post(gw, CHAT)  # the default pool's queue exists from here on
    again(
        gw,
        timeouts={"connect_s": 1, "first_byte_s": 3, "idle_s": 4, "total_s": 5},
        routing={"scorers": {"round_robin": 1}},
        calibration={"min_ratio": 0.9, "max_ratio": 1.1},
        admission={"target_utilization": 0.5, "lease_ttl_s": 9,
                   "queue": {"max_depth": 3}},
    )
    assert g.relay.timeouts.first_byte_s == 3
    assert set(g.router._scorers) == {"round_robin"}
    assert (g.calibration.low, g.calibration.high) == (0.9, 1.1)
    assert g.admission._pool("default").queue.max_depth == 3
    assert g.admission.keeper.ttl_s == 9
    (view,) = g.fleet()
    assert view.admissible_blocks == 500  # 0.5 × the stub's 1,000 blocks


async def test_upstream_pool_sizes_get_a_new_connection_pool(running):
    gw, _, _ = running
    before = gw.gateway.relay.session
    again(gw, upstream={"max_connections": 7, "max_connections_per_replica": 3})
    session = gw.gateway.relay.session
    assert session is not before and session is not None
    assert (session.connector.limit, session.connector.limit_per_host) == (7, 3)
    assert await post(gw, CHAT) == 200
    assert before is not None and not before.closed  # closes once its requests can be done


async def test_pools_models_and_discovery_take_effect(running):
    gw, first, second = running
    again(gw, pools={"default": {"replicas": [{"url": second.url}]}},
          models=[{"name": "stub-model", "default_max_tokens": 7}])
    await gw.wait_healthy()
    assert [r.url for r in gw.gateway.registry] == [second.url]
    assert await post(gw, CHAT) == 200
    assert second.received[-1]["max_tokens"] == 7 and not first.received
    again(gw, discovery={"interval_s": 0.1, "timeout_s": 1, "stale_after_s": 1e-6})
    (view,) = gw.gateway.fleet()
    assert not view.scraped  # every scrape is now too old to trust


async def test_auth_and_tenants_take_effect(running):
    gw, _, _ = running
    key = "sk-reloaded"
    again(gw, auth={"mode": "api_key"},
          tenants=[{"name": "acme", "api_key_sha256": [hashlib.sha256(key.encode()).hexdigest()]}])
    assert await post(gw, CHAT) == 401
    assert await post(gw, CHAT, {"Authorization": f"Bearer {key}"}) == 200


async def test_restart_only_settings_are_named_in_the_reload_log(running, caplog):
    gw, _, _ = running
    with caplog.at_level(logging.INFO, logger="kvgate.app"):
        again(gw, server={"port": 9999, "drain_s": 1},
              state={"backend": "memory", "key_prefix": "other"})
    (line,) = [r.getMessage() for r in caplog.records if "reloaded" in r.getMessage()]
    assert "restart" in line and "server.port" in line and "server.drain_s" in line
    assert "state" in line and "server.host" not in line
    assert set(RESTART_ONLY) == {"server.host", "server.port", "server.drain_s", "state"}
