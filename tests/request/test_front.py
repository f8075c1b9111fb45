"""The front of the request path takes a large body in a worker process, and what comes back is
what the loop would have made of it: the same request forwarded byte for byte, the same count,
fingerprint and session key, the same OpenAI-style 4xx for bad input, in the same order."""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import orjson
import pytest

from kvgate.config import TenantConfig, parse_config
from kvgate.errors import KvgateError, NotFound, Unauthorized
from kvgate.metrics import Metrics
from kvgate.normalize.stage import PromptStage
from kvgate.request.catalog import Bound, upstream_payload
from kvgate.request.front import Front, FrontStage
from kvgate.request.parsed import Endpoint, ParsedRequest
from kvgate.routing.sessions import session_key
from kvgate.runtime import Runtime
from tests.plugins import bodies
from tests.request.vectors import REFUSALS, REFUSED, nested

CONFIG = parse_config({"pools": {"default": {"replicas": [{"url": "http://127.0.0.1:9"}]}}})
RUNTIME = Runtime.load(CONFIG)
MODELS = {"m", "stub-model"}
TENANT = TenantConfig(name="acme")
SYSTEM = "You are a careful assistant.  \r\nAnswer in full sentences.\u200b "
TOOL = {"type": "function", "function": {"name": "lookup", "description": "finds things",
                                         "parameters": {"type": "object", "properties": {
                                             "q": {"type": "string", "enum": ["a", "ß", "東京"]},
                                             "deep": nested(40)}}}}


chat = partial(bodies.chat, "naïve café — 東京 ✓ 🙂 e\u0301 \u202eRTL\u202c", model="m",
               max_tokens=16, system_prompt=SYSTEM)


# (id, endpoint, body): every one both ways, its Front or its error compared
GOOD: list[tuple[str, Endpoint, Any]] = [
    ("unicode", Endpoint.CHAT, chat()),
    ("escaped-surrogates", Endpoint.CHAT,
     b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00 \\u00e9"}]}'),
    ("nested-tools", Endpoint.CHAT, chat(tools=[TOOL, TOOL], tool_choice="auto")),
    ("multimodal-parts", Endpoint.CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this? " * 40},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "iVBOR" * 300}}]}])),
    ("tool-calls-history", Endpoint.CHAT, chat(messages=[
        {"role": "user", "content": "look it up"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "found " * 100}], tools=[TOOL])),
    ("stream-without-usage", Endpoint.CHAT, chat(stream=True, max_tokens=None)),
    ("long-conversation", Endpoint.CHAT, chat(messages=[
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " * 60}
        for i in range(300)])),
    ("completion-batch", Endpoint.COMPLETIONS,
     {"model": "m", "prompt": ["Once upon a time ", "déjà vu " * 100], "max_tokens": 8}),
    ("completion-token-ids", Endpoint.COMPLETIONS,
     {"model": "m", "prompt": [[1, 2, 3] * 200], "max_tokens": 8}),
    ("vllm-extensions", Endpoint.CHAT, chat(ignore_eos=True, guided_json={"type": "object"},
                                            chat_template_kwargs={"x": "y" * 400})),
]
BAD: list[tuple[str, Endpoint, Any]] = [
    *[(name, Endpoint(path), body) for name, path, body, *_ in REFUSALS],
    *[(name, endpoint, body) for name, endpoint, body, _ in REFUSED],
    ("invalid-utf8", Endpoint.CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "\xff"}]}'),
    ("too-deep-to-forward", Endpoint.CHAT, chat(tools=[{**TOOL, "x": nested(300)}])),
    ("too-many-messages", Endpoint.CHAT, chat(messages=[{"role": "user", "content": "x"}] * 5000)),
]


@pytest.fixture(scope="module")
def stages() -> Iterator[tuple[FrontStage, FrontStage]]:
    """The front on the loop, and one that sends every body to its worker process."""
    here = FrontStage(PromptStage(Metrics()), off_process_bytes=1 << 40,
                      off_process_objects=1 << 40)
    there = FrontStage(PromptStage(Metrics()), off_process_bytes=0, workers=1)
    yield here, there
    there.close()


class Labels:
    model, tenant_name = "unknown", "unknown"


def allow(parsed: ParsedRequest, tenant: TenantConfig) -> None:
    if parsed.model not in MODELS:
        raise NotFound(f"the model {parsed.model!r} does not exist", code="model_not_found",
                       param="model")


async def take(stage: FrontStage, endpoint: Endpoint, body: Any,
               identify: Callable[[], TenantConfig] = lambda: TENANT) -> Front | dict[str, Any]:
    raw = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
    labels = Labels()
    try:
        front = await stage.take(raw, endpoint, RUNTIME, labels, identify, allow)
    except KvgateError as exc:
        return {"status": exc.status, "type": type(exc).__name__, **exc.body()["error"],
                "labels": vars(labels)}
    return front


def seen(front: Front | dict[str, Any], raw: bytes) -> Any:
    """What the rest of the path takes from a Front: the bytes forwarded, the count, the
    fingerprint, the session key, the request's own fields."""
    if isinstance(front, dict):
        return front
    parsed = front.parsed
    fields = {k: getattr(parsed, k) for k in ("endpoint", "model", "stream", "max_tokens",
                                              "sequences", "user", "client_wants_usage")}
    kept = Bound(10, 16, 26, set_max_tokens=False)
    edited = Bound(10, 16, 26, set_max_tokens=True)
    return {
        **fields, "edited": front.edited, "fingerprint": front.fingerprint, "count": front.count,
        "forwarded": upstream_payload(parsed, kept, None if front.edited else raw),
        "forwarded_with_max_tokens": upstream_payload(parsed, edited, None),
        "session": session_key(parsed, {}, CONFIG.routing.sessions, TENANT.name),
    }


@pytest.mark.parametrize(("endpoint", "body"), [pytest.param(*c[1:], id=c[0]) for c in GOOD + BAD])
async def test_a_worker_process_makes_of_a_body_what_the_loop_makes_of_it(stages, endpoint, body):
    here, there = stages
    raw = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
    on_loop, off_loop = await take(here, endpoint, body), await take(there, endpoint, body)
    assert seen(off_loop, raw) == seen(on_loop, raw)


async def test_the_body_s_own_errors_come_before_the_tenant_s_as_on_the_loop(stages):
    def refused() -> TenantConfig:
        raise Unauthorized("invalid API key")

    for body, status in ((b'{"model": ', 400), (chat(), 401), (chat(model="nope"), 401)):
        results = [await take(stage, Endpoint.CHAT, body, refused) for stage in stages]
        assert results[0] == results[1]
        assert isinstance(results[0], dict) and results[0]["status"] == status


async def test_above_the_threshold_the_body_is_read_in_another_process_and_kept_as_json(stages):
    """The loop keeps a large value as the JSON the worker sent (an orjson.Fragment, never
    parsed here); below the threshold, as values."""
    here, there = stages
    body = chat(tools=[TOOL], messages=[{"role": "system", "content": SYSTEM * 20},
                                        {"role": "user", "content": "東京 " * 300}])
    on_loop = await take(here, Endpoint.CHAT, body)
    off_loop = await take(there, Endpoint.CHAT, body)
    assert isinstance(on_loop, Front) and isinstance(off_loop, Front)
    assert any(p.pid != os.getpid() for p in multiprocessing.active_children())
    assert isinstance(on_loop.parsed.body["tools"], list)
    assert isinstance(off_loop.parsed.body["tools"], orjson.Fragment)
    for message in off_loop.parsed.body["messages"]:
        assert isinstance(message["role"], str)
        assert isinstance(message["content"], orjson.Fragment)


async def test_a_large_streamed_body_with_long_stream_options_is_forwarded_not_a_500():
    """stream_options is an open object (extra keys allowed). Above 256 bytes the worker sends
    it back as JSON and the loop keeps it as an orjson.Fragment; upstream_body then does
    dict(body['stream_options']) and raises TypeError (a 500) for a body the loop path
    forwards fine. Taken off the loop when the body is large (>128 KiB) and normalization
    edited it (or the client did not ask for usage)."""
    body = chat(stream=True, stream_options={"include_usage": False, "note": "x" * 300})
    raw = json.dumps(body).encode()
    here = FrontStage(PromptStage(Metrics()), off_process_bytes=1 << 40,
                      off_process_objects=1 << 40)
    there = FrontStage(PromptStage(Metrics()), off_process_bytes=0, workers=1)
    try:
        bound = Bound(10, 16, 26, set_max_tokens=False)
        on_loop = await here.take(raw, Endpoint.CHAT, RUNTIME, Labels(), lambda: TENANT, allow)
        expected = upstream_payload(on_loop.parsed, bound, None)
        off = await there.take(raw, Endpoint.CHAT, RUNTIME, Labels(), lambda: TENANT, allow)
        assert upstream_payload(off.parsed, bound, None) == expected
    finally:
        there.close()
