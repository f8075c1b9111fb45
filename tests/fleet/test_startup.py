"""kvgate serves once it knows its replicas: an app's start-up waits for the first round of
discovery (bounded), so a request that arrives at once is not told its model does not exist
(with `kvgate serve --workers N`, every worker binds the port after its own first round)."""

from __future__ import annotations

from aiohttp import web

from kvgate.api.routes import GATEWAY
from kvgate.app import build_app
from tests.plugins.gateway import gateway_config


async def test_start_up_ends_with_the_replicas_models_known(stub_factory):
    stub = await stub_factory()
    app = build_app(gateway_config([stub.url], discovery={"interval_s": 60, "timeout_s": 1.0}))
    runner = web.AppRunner(app)
    await runner.setup()  # what `kvgate serve` awaits before it binds its port
    try:
        assert "stub-model" in app[GATEWAY].registry.models()
    finally:
        await runner.cleanup()


async def test_a_fleet_that_is_down_does_not_keep_kvgate_from_starting():
    """Its first round fails (connection refused): start-up ends, nothing is known, and the
    replicas are found later by the loop, as before."""
    app = build_app(gateway_config(["http://127.0.0.1:9"], discovery={"interval_s": 60}))
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        assert not app[GATEWAY].registry.models()
        assert not any(r.healthy for r in app[GATEWAY].registry)
    finally:
        await runner.cleanup()
