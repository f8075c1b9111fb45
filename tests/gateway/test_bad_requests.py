"""Bad input: every mistake a client can make gets a clear 4xx in OpenAI's error shape, never a
500, and nothing of it reaches a replica.

One stub replica and one kvgate serve the whole module (the cases only read), so the ~70
requests here cost one start-up.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio

from kvgate.app import build_app
from tests.plugins.bodies import chat
from tests.plugins.client import Reply, post
from tests.plugins.gateway import (
    RunningGateway,
    StubUpstream,
    gateway_config,
    openai_error,
    serve_app,
    wait_settled,
)
from tests.request.vectors import CHAT, COMPLETIONS, REFUSALS, USER_HI

pytestmark = pytest.mark.asyncio(loop_scope="module")

BODY_LIMIT = 64 * 1024


@dataclass
class Target:
    stub: StubUpstream
    gw: RunningGateway
    session: aiohttp.ClientSession

    async def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> Reply:
        """`body` as bytes: encoded here unless it is already."""
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        return await post(f"{self.gw.url}{path}", data, http=self.session, headers=headers)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def target() -> AsyncIterator[Target]:
    stub = StubUpstream()  # reports max_model_len 4096
    stub.runner, stub.url = await serve_app(stub.app())
    app = build_app(gateway_config([stub.url], server={"max_body_bytes": BODY_LIMIT}))
    runner, url = await serve_app(app)
    gw = RunningGateway(url, app, runner)
    try:
        await gw.wait_healthy()
        async with aiohttp.ClientSession() as session:
            yield Target(stub, gw, session)
    finally:
        await runner.cleanup()
        await stub.runner.cleanup()


@pytest.fixture
def nothing_forwarded(target: Target) -> Iterator[None]:
    before = len(target.stub.received)
    yield
    assert target.stub.received[before:] == [], "a refused request reached the replica"


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "param"),
    [pytest.param(*case[1:], id=case[0]) for case in REFUSALS],
)
async def test_bad_request_is_refused_in_openai_shape_and_not_forwarded(
    target: Target, nothing_forwarded: None,
    path: str, body: Any, status: int, code: str | None, param: str | None,
) -> None:
    got, headers, raw = await target.post(path, body, headers={"X-Request-Id": "bad-1"})
    assert got == status, raw
    error = openai_error(raw)
    assert error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code
    assert error["param"] == param
    assert headers["x-request-id"] == "bad-1"
    assert headers["content-type"].startswith("application/json")


async def test_a_request_that_fits_the_context_is_forwarded(target: Target) -> None:
    """The control for the context cases above: just under the limit goes through."""
    status, _, raw = await target.post(CHAT, chat(max_tokens=4000))
    assert status == 200, raw
    assert target.stub.received[-1]["max_tokens"] == 4000


async def test_body_over_the_limit_with_content_length_is_413(
    target: Target, nothing_forwarded: None
) -> None:
    body = orjson.dumps(chat(messages=[{"role": "user", "content": "x" * (BODY_LIMIT + 1)}]))
    status, _, raw = await target.post(CHAT, body)
    assert status == 413
    assert openai_error(raw)["code"] == "request_too_large"


async def test_body_of_exactly_the_limit_is_read(target: Target) -> None:
    template = orjson.dumps(chat(messages=[{"role": "user", "content": ""}]))
    padding = b"x" * (BODY_LIMIT - len(template))
    body = template.replace(b'"content":""', b'"content":"' + padding + b'"')
    assert len(body) == BODY_LIMIT
    status, _, raw = await target.post(CHAT, body)
    assert status in (200, 400), raw  # not 413: read and parsed
    if status == 400:
        assert openai_error(raw)["code"] == "context_length_exceeded"


async def test_body_over_the_limit_in_chunked_encoding_is_413(
    target: Target, nothing_forwarded: None
) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "stub-model", "messages": [{"role": "user", "content": "'
        for _ in range(BODY_LIMIT // 4096 + 2):
            yield b"x" * 4096
        yield b'"}]}'

    status, _, raw = await _post_stream(target, CHAT, chunks())
    assert status == 413
    assert openai_error(raw)["code"] == "request_too_large"


async def _post_stream(target: Target, path: str, body: AsyncIterator[bytes]) -> Reply:
    """aiohttp itself, not tests.plugins.client.post: this checks how the request went out
    (chunked), which a Reply does not carry."""
    async with target.session.post(f"{target.gw.url}{path}", data=body) as r:
        assert r.request_info.headers.get("Transfer-Encoding") == "chunked"
        return Reply(r.status, r.headers, await r.read())


async def test_body_under_the_limit_in_chunked_encoding_is_served(target: Target) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        raw = orjson.dumps(chat())
        yield raw[:10]
        yield raw[10:]

    status, _, raw = await _post_stream(target, CHAT, chunks())
    assert status == 200, raw


async def test_unknown_path_is_404_in_openai_shape(target: Target, nothing_forwarded: None) -> None:
    status, _, raw = await target.post("/v1/embeddingz", chat())
    assert status == 404
    assert openai_error(raw)["code"] == "unknown_url"


async def test_wrong_method_is_405_naming_the_allowed_one(
    target: Target, nothing_forwarded: None
) -> None:
    async with target.session.get(f"{target.gw.url}{CHAT}") as r:
        status, allow, raw = r.status, r.headers.get("Allow"), await r.read()
    assert status == 405
    assert allow == "POST"
    error = openai_error(raw)
    assert error["code"] == "method_not_allowed" and "POST" in error["message"]


# Hostile bodies: each must come back a 4xx in OpenAI's shape, whatever is inside.
DEEP = b"[" * 100_000 + b"]" * 100_000
HOSTILE: list[tuple[str, str, Any]] = [
    ("deeply-nested-array", CHAT, DEEP),
    ("deeply-nested-model", CHAT, b'{"model": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}"),
    ("model-object", CHAT, chat(model={"name": [[["stub-model"]]]})),
    ("model-list", CHAT, chat(model=["stub-model"])),
    ("all-null", CHAT, {"model": None, "messages": None, "max_tokens": None, "stream": None,
                        "stream_options": None, "user": None}),
    ("messages-null-only", CHAT, chat(messages=None)),
    ("messages-list-of-null", CHAT, chat(messages=[None])),
    ("messages-null-after-good", CHAT, chat(messages=[*USER_HI, None])),
    ("role-null", CHAT, chat(messages=[{"role": None, "content": "hi"}])),
    ("role-number", CHAT, chat(messages=[{"role": 1, "content": "hi"}])),
    ("content-part-without-type", CHAT,
     chat(messages=[{"role": "user", "content": [{"text": "hi"}]}])),
    ("content-part-null", CHAT, chat(messages=[{"role": "user", "content": [None]}])),
    ("content-part-type-number", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": 3, "text": "hi"}]}])),
    ("content-part-list", CHAT, chat(messages=[{"role": "user", "content": [["text", "hi"]]}])),
    ("content-bool", CHAT, chat(messages=[{"role": "user", "content": True}])),
    ("tool-calls-number", CHAT,
     chat(messages=[*USER_HI, {"role": "assistant", "content": None, "tool_calls": 5}])),
    ("tool-calls-list-of-null", CHAT,
     chat(messages=[*USER_HI, {"role": "assistant", "content": None, "tool_calls": [None]}])),
    ("name-object", CHAT, chat(messages=[{"role": "user", "content": "hi", "name": {"a": 1}}])),
    ("max-tokens-huge-integer", CHAT, b'{"model": "stub-model", "messages": [{"role": "user",'
     b' "content": "hi"}], "max_tokens": 123456789012345678901234567890}'),
    ("max-tokens-1e308", CHAT, chat(max_tokens=1e308)),
    ("max-tokens-infinity-literal", CHAT, b'{"model": "stub-model", "messages": [{"role": "user",'
     b' "content": "hi"}], "max_tokens": Infinity}'),
    ("max-tokens-nan-literal", CHAT, b'{"model": "stub-model", "messages": [{"role": "user",'
     b' "content": "hi"}], "max_tokens": NaN}'),
    ("max-tokens-object", CHAT, chat(max_tokens={"$gt": 1})),
    ("max-tokens-list", CHAT, chat(max_tokens=[5])),
    ("max-tokens-negative-zero", CHAT, chat(max_tokens=-0.0)),
    ("stream-number", CHAT, chat(stream=1)),
    ("stream-options-list", CHAT, chat(stream=True, stream_options=[{"include_usage": True}])),
    ("user-object", CHAT, chat(user={"id": 1})),
    ("invalid-utf8", CHAT, b'{"model": "\xff\xfe", "messages": [{"role": "user", "content": "hi"}]}'),
    ("lone-surrogate", CHAT,
     b'{"model": "stub-model", "messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("unicode-unknown-model", CHAT, chat(model="模型-🙂-\u202e")),
    ("nul-in-model", CHAT, chat(model="stub-model\u0000")),
    ("prompt-mixed-types", COMPLETIONS, {"model": "stub-model", "prompt": ["a", 1, None, [2]]}),
    ("prompt-strings-and-null", COMPLETIONS, {"model": "stub-model", "prompt": ["a", None]}),
    ("prompt-negative-token", COMPLETIONS, {"model": "stub-model", "prompt": [1, -1]}),
    ("prompt-nested-bools", COMPLETIONS, {"model": "stub-model", "prompt": [[1, 2], [True]]}),
    ("prompt-nested-negative", COMPLETIONS, {"model": "stub-model", "prompt": [[1, -5]]}),
    ("prompt-nested-empty", COMPLETIONS, {"model": "stub-model", "prompt": [[]]}),
    ("prompt-empty-list", COMPLETIONS, {"model": "stub-model", "prompt": []}),
    ("prompt-object", COMPLETIONS, {"model": "stub-model", "prompt": {"text": "hi"}}),
    ("prompt-number", COMPLETIONS, {"model": "stub-model", "prompt": 42}),
    ("prompt-null", COMPLETIONS, {"model": "stub-model", "prompt": None}),
]


@pytest.mark.parametrize(
    ("path", "body"), [pytest.param(*case[1:], id=case[0]) for case in HOSTILE]
)
async def test_hostile_body_gets_a_4xx_in_openai_shape_never_a_500(
    target: Target, nothing_forwarded: None, path: str, body: Any
) -> None:
    status, _, raw = await target.post(path, body)
    assert 400 <= status < 500, (status, raw[:300])
    openai_error(raw)


async def test_after_every_refusal_nothing_is_held(target: Target) -> None:
    """Every refused and every hostile body, sent by this test itself (so it holds in any
    order, alone included), leaves no ledger, lease, shared prefix or charge behind."""
    for _, path, body, *_ in [*REFUSALS, *HOSTILE]:
        status, _, raw = await target.post(path, body)
        assert 400 <= status < 500, (status, raw[:300])
    await wait_settled(target.gw)


async def test_json_nested_deeper_than_kvgate_can_encode_is_a_400_not_a_500(
    target: Target, nothing_forwarded: None
):
    deep: object = {}
    for _ in range(300):
        deep = {"x": deep}
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    body = json.dumps(chat(tools=[tool])).encode()  # orjson writes at most 255 levels
    status, _, raw = await target.post(CHAT, body, headers={"Content-Type": "application/json"})
    assert status == 400
    assert openai_error(raw)["param"] == "tools"


@pytest.mark.parametrize("where", ["unknown-field", "content-part"])
async def test_any_field_nested_deeper_than_kvgate_can_encode_is_a_400_not_a_500(
    target: Target, nothing_forwarded: None, where: str
) -> None:
    deep: object = {}
    for _ in range(300):
        deep = {"x": deep}
    if where == "unknown-field":
        body = chat(vendor_extension=deep)
    else:
        body = chat(messages=[{"role": "user", "content": [{"type": "text", "x": deep}]}])
    status, _, raw = await target.post(CHAT, json.dumps(body).encode())
    assert status == 400, raw[:300]
    assert "nested" in openai_error(raw)["message"]


async def test_a_known_field_of_the_wrong_type_is_refused_before_forwarding(
    target: Target, nothing_forwarded: None
) -> None:
    status, _, raw = await target.post(CHAT, chat(temperature="hot"))
    assert status == 400
    assert openai_error(raw)["param"] == "temperature"


async def test_a_configured_max_model_len_above_the_replicas_is_held_to_theirs() -> None:
    """models[].max_model_len 16,384 over replicas that report 4,096: a request of 10,000
    tokens is the client's mistake (400 context_length_exceeded), not a missing replica (a
    503 the openai client would retry)."""
    stub = StubUpstream()  # reports max_model_len 4096
    stub.runner, stub.url = await serve_app(stub.app())
    config = gateway_config([stub.url], models=[{"name": "stub-model", "max_model_len": 16384}])
    app = build_app(config)
    runner, url = await serve_app(app)
    gw = RunningGateway(url, app, runner)
    try:
        await gw.wait_healthy()
        async with aiohttp.ClientSession() as session:
            status, _, raw = await post(f"{gw.url}{CHAT}", chat(max_tokens=10_000), http=session)
            assert status == 400, raw
            assert openai_error(raw)["code"] == "context_length_exceeded"
            assert "4096" in openai_error(raw)["message"]
            status, _, raw = await post(f"{gw.url}{CHAT}", chat(max_tokens=4000), http=session)
            assert status == 200, raw
        assert len(stub.received) == 1  # the refused one was never forwarded
    finally:
        await runner.cleanup()
        await stub.runner.cleanup()
