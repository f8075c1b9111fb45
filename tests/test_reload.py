"""A reload takes effect for every section of the config, observed from outside where it can
be; the few settings read only at start (listen address, drain time, the state store) are
named in the reload's log line instead. A request in flight keeps the snapshot it started
with; the background stages follow the one in force."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

import orjson
import pytest

from kvgate.app import RESTART_ONLY, reload
from kvgate.config import Config, parse_config
from kvgate.state.memory import MemoryStore
from tests.plugins import client
from tests.plugins.client import Reply
from tests.plugins.clock import VirtualTime
from tests.plugins.gateway import RunningGateway, StubUpstream, gateway_config
from tests.plugins.waiting import eventually

CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
STREAM = {**CHAT, "stream": True}


@pytest.fixture
async def running(stub_factory, gateway_factory) -> tuple[RunningGateway, Any, Any]:
    first, second = await stub_factory(), await stub_factory()
    gw = await gateway_factory(gateway_config([first.url]))
    return gw, first, second


async def again(gw: RunningGateway, **sections: Any) -> Config:
    """The running config with `sections` replaced, reloaded."""
    tree = gw.gateway.runtime.config.model_dump(mode="json", exclude_none=True)
    tree.update(sections)
    config = parse_config(tree)
    assert await reload(gw.app, lambda: config) is True
    return config


async def answer(gw: RunningGateway, body: Any, headers: dict[str, str] | None = None) -> Reply:
    return await client.post(f"{gw.url}/v1/chat/completions", body, headers=headers)


async def post(gw: RunningGateway, body: Any, headers: dict[str, str] | None = None) -> int:
    return (await answer(gw, body, headers)).status


async def test_server_body_limit_and_headers_change_at_once(running):
    gw, _, _ = running
    await again(gw, server={"max_body_bytes": 64, "accounting_headers": False})
    assert await post(gw, {**CHAT, "padding": "x" * 200}) == 413


async def test_timeouts_take_effect_for_the_next_request(running):
    gw, first, _ = running
    first.delay_headers_s = 0.5
    assert await post(gw, CHAT) == 200  # within the 10 s it started with
    await again(gw, timeouts={"connect_s": 1, "first_byte_s": 0.1, "idle_s": 4, "total_s": 5})
    assert await post(gw, CHAT) == 504


async def test_routing_takes_effect(running):
    gw, first, second = running
    # the same chat again and again: prefix affinity keeps it on one replica, round robin not
    await again(gw, pools={"default": {"replicas": [{"url": first.url}, {"url": second.url}]}},
          routing={"scorers": {"round_robin": 1}})
    await gw.wait_healthy()
    for _ in range(4):
        assert await post(gw, CHAT) == 200
    assert len(first.received) == len(second.received) == 2


async def test_calibration_bounds_take_effect(running):
    gw, _, _ = running
    chat = {**CHAT, "messages": [{"role": "user", "content": "word " * 200}]}
    _, before, _ = await answer(gw, chat)
    await again(gw, calibration={"min_ratio": 3, "max_ratio": 4})
    _, after, _ = await answer(gw, chat)
    # at least 3 of kvgate's counted tokens per text token now, at most 1.5 before
    assert int(after["X-Kvgate-Prompt-Tokens"]) > int(before["X-Kvgate-Prompt-Tokens"]) + 300


async def test_admission_takes_effect(running):
    gw, _, _ = running
    g = gw.gateway
    await again(gw, admission={"target_utilization": 0.5, "lease_ttl_s": 9})
    assert g.admission.keeper.ttl_s == 9
    (view,) = g.view.take(g.current())
    assert view.admissible_blocks == 500  # 0.5 × the stub's 1,000 blocks


async def test_upstream_pool_sizes_get_a_new_connection_pool(running):
    gw, _, _ = running
    before = gw.gateway.http.session
    await again(gw, upstream={"max_connections": 7, "max_connections_per_replica": 3})
    session = gw.gateway.http.session
    assert session is not before and session is not None
    assert (session.connector.limit, session.connector.limit_per_host) == (7, 3)
    assert await post(gw, CHAT) == 200
    assert before is not None and not before.closed  # closes once its requests can be done


async def test_pools_models_and_discovery_take_effect(running):
    gw, first, second = running
    await again(gw, pools={"default": {"replicas": [{"url": second.url}]}},
          models=[{"name": "stub-model", "default_max_tokens": 7}])
    await gw.wait_healthy()
    assert [r.url for r in gw.gateway.registry] == [second.url]
    assert await post(gw, CHAT) == 200
    assert second.received[-1]["max_tokens"] == 7 and not first.received
    await again(gw, discovery={"interval_s": 0.1, "timeout_s": 1, "stale_after_s": 1e-6})
    (view,) = gw.gateway.view.take(gw.gateway.current())
    assert not view.scraped  # every scrape is now too old to trust


async def test_auth_and_tenants_take_effect(running):
    gw, _, _ = running
    key = "sk-reloaded"
    await again(gw, auth={"mode": "api_key"},
          tenants=[{"name": "acme", "api_key_sha256": [hashlib.sha256(key.encode()).hexdigest()]}])
    assert await post(gw, CHAT) == 401
    assert await post(gw, CHAT, {"Authorization": f"Bearer {key}"}) == 200


async def test_restart_only_settings_are_named_in_the_reload_log(running, caplog):
    gw, _, _ = running
    with caplog.at_level(logging.INFO, logger="kvgate.app"):
        await again(gw, server={"port": 9999, "drain_s": 1},
              state={"backend": "memory", "key_prefix": "other"})
    (line,) = [r.getMessage() for r in caplog.records if "reloaded" in r.getMessage()]
    assert "restart" in line and "server.port" in line and "server.drain_s" in line
    assert "state" in line and "server.host" not in line
    assert set(RESTART_ONLY) == {"server.host", "server.port", "server.drain_s", "state",
                                 "server.max_connections", "server.client_timeout_s",
                                 "server.admin.host", "server.admin.port", "server.epp"}


# ---------------------------------------------------------------- in flight: its own snapshot


async def test_a_request_queued_through_a_reload_is_forwarded_under_its_own_timeouts(
    stub_factory, gateway_factory
):
    stub = await stub_factory(num_gpu_blocks=10, gate=asyncio.Event())  # 160 tokens
    gw = await gateway_factory(gateway_config(
        [stub.url], admission={"target_utilization": 1.0}  # first_byte_s 10
    ))
    body = {**CHAT, "max_tokens": 100}  # 7 of the 10 blocks: one at a time
    holding = asyncio.ensure_future(answer(gw, {**body, "stream": True}))
    await eventually(lambda: _received(stub, 1), what="the first request reached the replica")
    queued = asyncio.ensure_future(answer(gw, body))
    queue = gw.gateway.admission.pool("default").queue
    await eventually(lambda: _queued(queue, 1), what="the second request queued")
    await again(gw, admission={"target_utilization": 1.0},
          timeouts={"connect_s": 1, "first_byte_s": 0.1, "idle_s": 10, "total_s": 30})
    stub.delay_headers_s = 0.5  # past the new first_byte_s, well within the old
    assert stub.gate is not None
    stub.gate.set()
    assert [(await holding)[0], (await queued)[0]] == [200, 200]
    # a request that starts after the reload has the new limit
    assert (await answer(gw, body))[0] == 504


async def test_a_request_in_flight_keeps_its_retry_across_a_reload(stub_factory, gateway_factory):
    failing = await stub_factory(status=500, delay_headers_s=0.5)
    healthy = await stub_factory()
    # round robin alone takes replicas in the order of their names: the failing one first
    gw = await gateway_factory(gateway_config(
        [], pools={"default": {"replicas": [{"url": failing.url, "name": "a-failing"},
                                            {"url": healthy.url, "name": "b-healthy"}]}},
        routing={"scorers": {"round_robin": 1}, "retry": {"attempts": 1}},
    ))
    request = asyncio.ensure_future(post(gw, CHAT))
    await eventually(lambda: _received(failing, 1), what="the request reached the failing replica")
    await again(gw, routing={"scorers": {"round_robin": 1}, "retry": {"attempts": 0}})
    assert await request == 200  # retried elsewhere, as its own config allowed
    assert len(healthy.received) == 1
    # round robin's turn (two rankings later) is back at the failing replica, and a new request
    # may not retry
    assert await post(gw, CHAT) == 502
    assert len(failing.received) == 2 and len(healthy.received) == 1


async def _received(stub: StubUpstream, count: int) -> bool:
    return len(stub.received) >= count


# ---------------------------------------------------------------- background: the one in force


async def test_a_lower_queue_depth_refuses_the_next_newcomer(stub_factory, gateway_factory):
    stub = await stub_factory(num_gpu_blocks=10, gate=asyncio.Event())  # 160 tokens
    gw = await gateway_factory(gateway_config(
        [stub.url], admission={"target_utilization": 1.0, "queue": {"max_depth": 8}}
    ))
    body = {**STREAM, "max_tokens": 100}  # 7 of the 10 blocks: one at a time
    running = asyncio.ensure_future(answer(gw, body))
    await eventually(lambda: _received(stub, 1), what="the first request reached the replica")
    waiting = asyncio.ensure_future(answer(gw, body))
    queue = gw.gateway.admission.pool("default").queue
    await eventually(lambda: _queued(queue, 1), what="the second request queued")
    await again(gw, admission={"target_utilization": 1.0, "queue": {"max_depth": 1}})
    status, _, refused = await answer(gw, body)
    assert status == 429 and orjson.loads(refused)["error"]["code"] == "queue_full"
    assert stub.gate is not None
    stub.gate.set()  # nobody already queued was shed: both finish
    assert [(await running)[0], (await waiting)[0]] == [200, 200]


async def _queued(queue: Any, count: int) -> bool:
    return len(queue) >= count


async def test_leases_taken_under_a_shorter_ttl_are_renewed_in_time(stub_factory, gateway_factory):
    stub = await stub_factory(gate=asyncio.Event())
    time = VirtualTime()
    gw = await gateway_factory(  # 30 s: renewed every 10 s
        gateway_config([stub.url]), MemoryStore(clock=time), clock=time, sleep=time.sleep
    )
    await again(gw, admission={"lease_ttl_s": 1.0})
    streaming = asyncio.ensure_future(answer(gw, STREAM))
    await eventually(lambda: _received(stub, 1), what="the request reached the replica")
    (replica,) = gw.gateway.registry
    held = await gw.store.held(f"ledger:{replica.id}")
    await time.elapse(2.5)  # its lease would have expired 1 s after it was taken
    assert held > 0 and await gw.store.held(f"ledger:{replica.id}") == held
    assert stub.gate is not None
    stub.gate.set()
    assert (await streaming)[0] == 200


async def test_a_longer_ttl_lets_no_lease_expire_before_its_next_renewal(
    stub_factory, gateway_factory
):
    # Leases in flight were last renewed under 0.6 s; the reload makes it 6 s. Waiting the new
    # interval (2 s) before renewing would let them lapse at 0.6 s, and never come back.
    stub = await stub_factory(gate=asyncio.Event())
    time = VirtualTime()
    gw = await gateway_factory(
        gateway_config([stub.url], admission={"lease_ttl_s": 0.6}),
        MemoryStore(clock=time), clock=time, sleep=time.sleep,
    )
    streaming = asyncio.ensure_future(answer(gw, STREAM))
    await eventually(lambda: _received(stub, 1), what="the request reached the replica")
    (replica,) = gw.gateway.registry
    held = await gw.store.held(f"ledger:{replica.id}")
    await again(gw, admission={"lease_ttl_s": 6.0})
    await time.elapse(1.5)
    assert held > 0 and await gw.store.held(f"ledger:{replica.id}") == held
    assert stub.gate is not None
    stub.gate.set()
    assert (await streaming)[0] == 200


async def test_discovery_follows_a_shorter_interval_at_once(stub_factory, gateway_factory):
    stub = await stub_factory()
    gw = await gateway_factory(gateway_config([stub.url], discovery={"interval_s": 30}))
    scraped = stub.scrapes
    await again(gw, discovery={"interval_s": 0.1})

    async def scraped_again() -> bool:
        return stub.scrapes >= scraped + 3

    # the loop was 30 s from its next round; it follows the new interval within a second
    await eventually(scraped_again, timeout_s=3.0, what="three rounds at the new interval")


async def test_reloads_asked_together_run_one_at_a_time_and_the_last_asked_wins(running):
    """Each reload reads its file in a thread; two SIGHUPs close together must not race to
    install an older file over a newer one."""
    gw, _, _ = running
    tree = gw.gateway.runtime.config.model_dump(mode="json", exclude_none=True)
    configs = [parse_config({**tree, "server": {**tree["server"], "max_body_bytes": size}})
               for size in (1000, 2000, 3000)]  # fmt: skip
    loaded: list[int] = []

    def load(config: Config) -> Config:
        loaded.append(config.server.max_body_bytes)
        return config

    results = await asyncio.gather(*(reload(gw.app, lambda c=c: load(c)) for c in configs))
    assert results == [True, True, True]
    assert loaded == [1000, 2000, 3000]
    assert gw.gateway.runtime.config.server.max_body_bytes == 3000
