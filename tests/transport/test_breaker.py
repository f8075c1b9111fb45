"""The breaker transport judges each attempt for its replica's circuit: by its status when the
headers arrive, and by the whole attempt when its response is closed (or `send` raised)."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request

from kvgate.errors import KvgateError, ReplicaBusy, Unreachable, UpstreamError
from kvgate.fleet.health import CLOSED, HALF_OPEN, OPEN, Breakers
from kvgate.transport.base import Outcome, UpstreamRequest
from kvgate.transport.breaker import BreakerTransport
from kvgate.transport.relay import relay
from tests.plugins.gateway import gateway_config
from tests.transport.scripted import BUSY, FAILED, OK, Answer, ScriptedTransport, replica

CONFIG = gateway_config(
    ["http://a:8000"], routing={"circuit": {"failure_threshold": 3, "open_s": 10}}
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Verdicts(Breakers):
    """Real breakers that also keep every verdict they were given, in order."""

    def __init__(self, clock: Clock | None = None) -> None:
        super().__init__(lambda: CONFIG, clock or Clock())
        self.verdicts: list[bool | None] = []

    def judge(self, replica_id: str, failed: bool | None, holder: str) -> None:
        self.verdicts.append(failed)
        super().judge(replica_id, failed, holder)


async def attempt(transport: BreakerTransport, holder: str = "req") -> Outcome:
    """One whole-answer attempt at replica a, relayed to a client; what it was."""
    request = UpstreamRequest(replica("a"), "/v1/chat/completions", b"{}", {}, CONFIG.timeouts,
                              stream=False, holder=holder)
    try:
        answer = await transport.send(request)
        await relay(make_mocked_request("POST", "/v1/chat/completions"), answer, {}, False)
    except KvgateError:
        pass
    return request.attempt


async def test_an_answer_is_judged_at_its_headers_and_again_when_it_ends():
    inner, breakers = ScriptedTransport({"a": Answer(200, [OK])}), Verdicts()
    outcome = await attempt(BreakerTransport(inner, breakers))
    assert outcome.done and inner.closed == 1
    assert breakers.verdicts == [False, False]


async def test_a_5xx_says_nothing_at_its_headers_and_is_a_failure_when_it_ends():
    inner, breakers = ScriptedTransport({"a": Answer(500, [FAILED])}), Verdicts()
    outcome = await attempt(BreakerTransport(inner, breakers))
    assert outcome.upstream_failed and inner.closed == 1
    assert breakers.verdicts == [None, True]


async def test_a_replica_that_never_answered_is_one_failure_and_the_error_goes_on():
    inner = ScriptedTransport({"a": Unreachable("replica a could not be reached")})
    breakers = Verdicts()
    request = UpstreamRequest(replica("a"), "/v1/chat/completions", b"{}", {}, CONFIG.timeouts,
                              stream=False, holder="req")
    with pytest.raises(UpstreamError):
        await BreakerTransport(inner, breakers).send(request)
    assert breakers.verdicts == [True]


async def test_consecutive_failures_open_the_circuit():
    inner, breakers = ScriptedTransport({"a": Answer(500, [FAILED])}), Verdicts()
    transport = BreakerTransport(inner, breakers)
    for i in range(3):
        assert breakers.state("a") == CLOSED
        await attempt(transport, holder=f"req-{i}")
    assert breakers.state("a") == OPEN


async def test_vllms_busy_answer_says_nothing_of_the_replica():
    inner, breakers = ScriptedTransport({"a": Answer(503, [BUSY])}), Verdicts()
    transport = BreakerTransport(inner, breakers)
    for i in range(5):
        request = UpstreamRequest(replica("a"), "/v1/chat/completions", b"{}", {},
                                  CONFIG.timeouts, stream=False, holder=f"req-{i}")
        answer = await transport.send(request)
        with pytest.raises(ReplicaBusy):
            await relay(make_mocked_request("POST", "/"), answer, {}, False)
    assert breakers.verdicts == [None] * 10
    assert breakers.state("a") == CLOSED


async def test_a_half_open_trial_is_decided_by_its_headers_not_held_open_while_it_streams():
    clock = Clock()
    breakers = Verdicts(clock)
    for i in range(3):
        breakers.judge("a", True, f"old-{i}")
    clock.now = 10.0
    assert breakers.state("a") == HALF_OPEN and breakers.claim("a", "trial")
    inner = ScriptedTransport({"a": Answer(200, [OK])})
    request = UpstreamRequest(replica("a"), "/v1/chat/completions", b"{}", {}, CONFIG.timeouts,
                              stream=True, holder="trial")
    answer = await BreakerTransport(inner, breakers).send(request)
    assert breakers.state("a") == CLOSED  # before a byte of its body was read
    await answer.aclose()
    assert inner.closed == 1
