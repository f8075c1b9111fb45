"""Property: whatever body and headers a client sends, kvgate answers below 500 in OpenAI's
shape, logs no error, and forwards only requests that pass its own validation.

Hypothesis drives a synchronous test; the stub replica and kvgate run on an event loop of
their own in a background thread, started once for the module. The example count is bounded
(FUZZ_EXAMPLES, also in CI) and the generation derandomized, so CI runs the same cases.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvgate.app import build_app
from kvgate.errors import BadRequest
from kvgate.request.parsed import Endpoint, parse_body
from tests.plugins.gateway import RunningGateway, StubUpstream, gateway_config, serve_app

FUZZ_EXAMPLES = int(os.environ.get("KVGATE_FUZZ_EXAMPLES", "300"))
T = TypeVar("T")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
roles = st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard"])


def mostly(plausible: st.SearchStrategy[Any], odds: int = 5) -> st.SearchStrategy[Any]:
    """The plausible value, and once in `odds` anything at all."""
    # sampled_from draws uniformly; integers() would favour its bounds
    return st.sampled_from(range(odds)).flatmap(lambda i: json_values if i == 1 else plausible)


content = mostly(st.text(max_size=40) | st.lists(st.fixed_dictionaries({
    "type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=20)}), max_size=2))
message = st.fixed_dictionaries({"role": mostly(roles, odds=12), "content": content}, optional={
    "name": mostly(st.text(max_size=8)), "tool_calls": json_values,
    "tool_call_id": st.text(max_size=8),
})
# Plausible values for each known field, mixed with anything at all.
KNOWN: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5),
    "max_tokens": st.integers(-2, 5000), "max_completion_tokens": st.integers(-2, 50),
    "n": st.integers(0, 3), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3),
    "logprobs": st.booleans() | st.integers(-1, 25), "top_logprobs": st.integers(-1, 25),
    "seed": st.integers(-(2**64), 2**64), "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "logit_bias": st.dictionaries(st.text(max_size=5), st.floats(-150, 150), max_size=2),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function":
                      st.fixed_dictionaries({"name": st.text(max_size=5)})}), max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required", "sometimes"]),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    "user": st.text(max_size=8), "echo": st.booleans(), "suffix": st.text(max_size=4),
    "priority": st.integers(-5, 5), "ignore_eos": st.booleans(),
}
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
headers = st.dictionaries(
    st.sampled_from(["X-Request-Id", "X-Tenant-Id", "Authorization", "X-Session-Id",
                     "X-Kvgate-Pool", "Content-Type", "Accept", "X-Anything"]),
    header_text, max_size=4,
)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    chat = draw(st.booleans())
    path = "/v1/chat/completions" if chat else "/v1/completions"
    model = st.sampled_from(["stub-model"] * 9 + ["other"])
    body: dict[str, Any] = {"model": draw(mostly(model, odds=12))}
    if chat:
        body["messages"] = draw(mostly(st.lists(message, min_size=1, max_size=3), odds=12))
    else:
        body["prompt"] = draw(mostly(st.text(max_size=30) | st.lists(st.integers(-1, 100),
                                                                       max_size=4), odds=12))
    for name in draw(st.lists(st.sampled_from(sorted(KNOWN)), max_size=4, unique=True)):
        body[name] = draw(mostly(KNOWN[name]))
    if draw(st.sampled_from(range(30))) == 7:  # deeper than kvgate could forward
        body["vendor_extension"] = nested(draw(st.integers(250, 400)))
    if draw(st.booleans()):  # fields nobody knows: passed through untouched
        body.update(draw(st.dictionaries(st.text(min_size=1, max_size=8).filter(
            lambda k: k not in KNOWN), json_values, max_size=2)))
    raw = json.dumps(body, allow_nan=False).encode()  # stdlib: integers beyond 64 bits too
    if draw(st.sampled_from(range(20))) == 7:  # now and then, bytes that are not JSON at all
        raw = draw(st.binary(max_size=40))
    return path, raw, draw(headers)


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


RANGES = {"temperature": (0, 2), "top_p": (0, 1), "presence_penalty": (-2, 2),
          "frequency_penalty": (-2, 2), "top_logprobs": (0, 20)}
ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


def against_openai_types(body: dict[str, Any], chat: bool) -> str | None:
    """The test's own oracle, written apart from kvgate/request/schema.py: the first known field whose
    value the OpenAI API would refuse, or None."""
    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    for name, (low, high) in RANGES.items():
        if name == "top_logprobs" and not chat:  # a chat field; completions pass it through
            continue
        value = body.get(name)
        if value is not None and not (number(value) and low <= value <= high):
            return name
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        return "stop"
    logprobs = body.get("logprobs")
    if logprobs is not None and (not isinstance(logprobs, bool) if chat else not (
            isinstance(logprobs, int) and not isinstance(logprobs, bool) and 0 <= logprobs <= 20)):
        return "logprobs"
    seed = body.get("seed")
    if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool)
                                 and -(2**63) <= seed < 2**63):
        return "seed"
    for name in ("echo", "stream", "parallel_tool_calls"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            return name
    priority = body.get("priority")
    if priority is not None and not (type(priority) is int and priority >= 0):
        return "priority"
    if chat and not all(isinstance(m, dict) and m.get("role") in ROLES
                        for m in body.get("messages") or [None]):
        return "messages"
    return None


class ErrorLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class Background:
    """A stub replica and a kvgate serving on an event loop in another thread."""

    loop: asyncio.AbstractEventLoop
    stub: StubUpstream
    gw: RunningGateway
    http: aiohttp.ClientSession

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)


@pytest.fixture(scope="module")
def background() -> Iterator[Background]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> Background:
        stub = StubUpstream()
        stub.runner, stub.url = await serve_app(stub.app())
        app = build_app(gateway_config([stub.url]))
        runner, url = await serve_app(app)
        gw = RunningGateway(url, app, runner)
        await gw.wait_healthy()
        return Background(loop, stub, gw, aiohttp.ClientSession())

    bg = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
    try:
        yield bg
    finally:
        async def stop() -> None:
            await bg.http.close()
            await bg.gw.runner.cleanup()
            assert bg.stub.runner is not None
            await bg.stub.runner.cleanup()

        bg.run(stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


async def exchange(bg: Background, path: str, raw: bytes, sent: dict[str, str]) -> tuple[int, bytes]:
    async with bg.http.post(f"{bg.gw.url}{path}", data=raw, headers=sent) as response:
        return response.status, await response.read()


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=requests())
def test_any_request_is_answered_below_500_in_openai_shape_and_only_valid_ones_are_forwarded(
    background: Background, case: tuple[str, bytes, dict[str, str]]
) -> None:
    path, raw, sent = case
    errors = ErrorLog()
    logging.getLogger().addHandler(errors)
    before = len(background.stub.received)
    try:
        status, body = background.run(exchange(background, path, raw, sent))
    finally:
        logging.getLogger().removeHandler(errors)
    event(f"status {status}")
    assert status < 500, (status, body[:300], raw[:300])
    assert not errors.records, [r.getMessage() for r in errors.records]
    forwarded = background.stub.received[before:]
    if status >= 400:
        data = orjson.loads(body)
        assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}
        assert forwarded == [], "a refused request reached the replica"
        return
    endpoint = Endpoint.CHAT if path.endswith("chat/completions") else Endpoint.COMPLETIONS
    assert len(forwarded) == 1
    wrong = against_openai_types(forwarded[0], chat=endpoint is Endpoint.CHAT)
    assert wrong is None, f"forwarded a request whose {wrong!r} OpenAI would refuse"
    try:
        # as the replica parsed it: a pass-through field may hold an integer beyond 64 bits,
        # which only Python's json writes back
        parse_body(json.dumps(forwarded[0]).encode(), endpoint)
    except BadRequest as exc:
        raise AssertionError(f"forwarded a request that fails validation: {exc}") from None
