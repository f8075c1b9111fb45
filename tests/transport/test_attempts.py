"""The attempts stage (Envoy's retry policy): a replica that failed before any byte reached the
client is excluded and the request tried once more elsewhere; a failure after that is not
tried again; a busy replica's refusal places the request again without spending a retry."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from kvgate.admission.demand import Demand, Slot
from kvgate.errors import NoReplica, Unreachable, UpstreamError
from kvgate.exchange import Exchange, Planned
from kvgate.fleet.health import Breakers
from kvgate.metrics import Metrics
from kvgate.request.parsed import Endpoint
from kvgate.routing.route import Route
from kvgate.runtime import Runtime
from kvgate.transport.attempts import Attempts
from kvgate.transport.base import UpstreamRequest
from kvgate.transport.breaker import BreakerTransport
from kvgate.transport.relay import relay
from tests.plugins.gateway import gateway_config, serve_app
from tests.transport.scripted import BUSY, FAILED, OK, Answer, ScriptedTransport, replica

URLS = ["http://a:8000", "http://b:8000", "http://c:8000"]
RETRY_ONCE = Runtime.load(gateway_config(URLS, routing={"retry": {"attempts": 1}}))
NEVER_RETRY = Runtime.load(gateway_config(URLS, routing={"retry": {"attempts": 0}}))
STREAMED = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'


def exchange(rt: Runtime = RETRY_ONCE, stream: bool = False) -> Exchange:
    x = Exchange("req", "key", 0.0, {}, rt, Endpoint.CHAT)
    demand = Demand("default", "m", 100, "t", "normal")
    x.planned = Planned(Route(demand), b'{"stream": true}' if stream else b"{}")
    return x


class Stage:
    """The attempts stage over one attempt that, like the gateway's, places the request on the
    first replica not excluded (nor busy since), sends it and relays the answer."""

    def __init__(self, script: dict[str, Answer | UpstreamError]) -> None:
        self.metrics = Metrics()
        self.breakers = Breakers(lambda: RETRY_ONCE.config)
        self.inner = ScriptedTransport(script)
        self.transport = BreakerTransport(self.inner, self.breakers)
        self.attempts = Attempts(self.breakers, self.metrics)

    async def attempt(self, client: web.Request, x: Exchange) -> web.StreamResponse:
        busy = {o.replica.id for o in x.attempts if o.busy and o.replica is not None}
        names = [n for n in self.inner.script if n not in x.route.exclude | busy]
        if not names:
            raise NoReplica("no replica takes it")
        x.attempt.replica = replica(names[0])
        x.slot = Slot(x.attempt.replica, "lease", 1)  # admitted there
        request = UpstreamRequest(
            x.attempt.replica, "/v1/chat/completions", x.payload, {}, x.rt.config.timeouts,
            stream=x.payload != b"{}", holder=x.key, attempt=x.attempt,
        )
        return await relay(client, await self.transport.send(request), {}, False)

    async def run(self, x: Exchange) -> web.StreamResponse:
        client = make_mocked_request("POST", "/v1/chat/completions")
        return await self.attempts.run(x, lambda x: self.attempt(client, x))

    def retries(self) -> str:
        return "\n".join(line for line in self.metrics.render().decode().splitlines()
                         if line.startswith("kvgate_upstream_retries_total{"))


async def test_a_5xx_before_any_byte_goes_once_more_to_another_replica():
    stage = Stage({"a": Answer(500, [FAILED]), "b": Answer(200, [OK])})
    x = exchange()
    response = await stage.run(x)
    assert response.status == 200 and stage.inner.sent == ["a", "b"]
    assert x.route.exclude == {"a"} and len(x.attempts) == 2 and x.attempt.done
    assert 'reason="upstream_error"} 1.0' in stage.retries()


async def test_an_unreachable_replica_is_excluded_and_the_next_one_tried():
    stage = Stage({"a": Unreachable("replica a could not be reached"), "b": Answer(200, [OK])})
    response = await stage.run(exchange())
    assert response.status == 200 and stage.inner.sent == ["a", "b"]
    assert 'reason="unreachable"} 1.0' in stage.retries()


async def test_a_failure_once_the_replica_answered_is_not_tried_again():
    stage = Stage({"a": Answer(200, [OK], breaks=True), "b": Answer(200, [OK])})
    with pytest.raises(UpstreamError, match="mid-response"):
        await stage.run(exchange())
    assert stage.inner.sent == ["a"] and stage.retries() == ""


async def test_a_stream_broken_after_its_first_byte_ends_in_band_and_is_not_tried_again():
    stage = Stage({"a": Answer(200, [STREAMED], breaks=True), "b": Answer(200, [OK])})
    x = exchange(stream=True)

    async def handler(client: web.Request) -> web.StreamResponse:
        return await stage.attempts.run(x, lambda x: stage.attempt(client, x))

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner, url = await serve_app(app)
    try:
        async with aiohttp.ClientSession() as client, client.post(
            f"{url}/v1/chat/completions", data=b"{}"
        ) as response:
            body = await response.read()
    finally:
        await runner.cleanup()
    assert response.status == 200
    assert body.startswith(STREAMED) and b'data: {"error"' in body
    assert stage.inner.sent == ["a"] and len(x.attempts) == 1 and x.attempt.upstream_failed
    assert stage.retries() == ""


async def test_failover_stops_after_the_configured_attempts():
    stage = Stage({"a": Answer(500, [FAILED]), "b": Answer(502, [FAILED]), "c": Answer(200, [OK])})
    with pytest.raises(UpstreamError, match="replica b answered 502"):
        await stage.run(exchange())
    assert stage.inner.sent == ["a", "b"]


async def test_when_no_other_replica_takes_it_the_replicas_failure_stands():
    stage = Stage({"a": Answer(500, [FAILED])})
    with pytest.raises(UpstreamError, match="replica a answered 500"):
        await stage.run(exchange())


async def test_a_busy_replica_places_the_request_again_without_spending_a_retry():
    stage = Stage({"a": Answer(503, [BUSY]), "b": Answer(200, [OK])})
    x = exchange(NEVER_RETRY)
    response = await stage.run(x)
    assert response.status == 200 and stage.inner.sent == ["a", "b"]
    assert x.since is not None  # its wait budget runs from its first ask
    assert x.route.exclude == frozenset() and stage.retries() == ""
    assert [o.busy for o in x.attempts] == ["max_num_queued_reqs", None]
    assert stage.breakers.state("a") == "closed"


async def test_a_trial_the_request_claimed_and_never_used_goes_to_the_next_one():
    stage = Stage({"b": Answer(200, [OK])})
    stage.breakers.claim("a", "key")  # closed: nothing held
    for i in range(3):
        stage.breakers.judge("a", True, f"old-{i}")
    stage.breakers.clock = lambda: 1e9  # long after it opened: half open
    assert stage.breakers.claim("a", "key") and not stage.breakers.claim("a", "other")
    await stage.run(exchange())
    assert stage.breakers.claim("a", "other")
