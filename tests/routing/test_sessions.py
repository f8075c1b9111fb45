"""Session keys from the configured sources, and bindings: new, hit, rebound with a reason."""

from __future__ import annotations

import orjson

from kvgate.config import SessionsConfig
from kvgate.metrics import Metrics
from kvgate.request.parsed import Endpoint, parse_body
from kvgate.routing.sessions import Sessions, session_key
from kvgate.state.memory import MemoryStore
from tests.plugins.metrics import sample_value
from tests.routing.fleets import fleet, replica

SYSTEM = {"role": "system", "content": "You are terse."}


def chat(*messages: dict[str, str], user: str | None = None) -> object:
    body: dict[str, object] = {"model": "m", "messages": list(messages)}
    if user is not None:
        body["user"] = user
    return parse_body(orjson.dumps(body), Endpoint.CHAT)


def key(parsed: object, headers: dict[str, str], config: SessionsConfig,
        tenant: str = "t") -> str | None:
    return session_key(parsed, headers, config, tenant)  # type: ignore[arg-type]


def test_the_header_wins_then_the_user_field_then_the_conversation():
    config = SessionsConfig()
    first = {"role": "user", "content": "plan a trip"}
    parsed = chat(SYSTEM, first, user="alice")
    assert key(parsed, {"X-Session-Id": "s-9"}, config).startswith("h:")
    assert key(parsed, {}, config).startswith("u:")
    assert key(chat(SYSTEM, first), {}, config).startswith("c:")
    only_header = SessionsConfig(sources=["header"])
    assert key(parsed, {}, only_header) is None


def test_keys_are_scoped_by_tenant_and_model_and_never_client_sized():
    config = SessionsConfig()
    parsed = chat({"role": "user", "content": "x"}, user="u" * 100_000)
    mine = key(parsed, {}, config, "acme")
    assert mine is not None and len(mine) < 40
    assert key(parsed, {}, config, "globex") != mine  # another tenant: another session
    other_model = parse_body(orjson.dumps({"model": "m2", "user": "u" * 100_000,
                                           "messages": [{"role": "user", "content": "x"}]}),
                             Endpoint.CHAT)
    assert key(other_model, {}, config, "acme") != mine


def test_every_turn_of_one_chat_has_the_same_key_and_other_chats_another():
    config = SessionsConfig()
    first = {"role": "user", "content": "plan a trip"}
    turn1 = chat(SYSTEM, first)
    turn3 = chat(SYSTEM, first, {"role": "assistant", "content": "Where to?"},
                 {"role": "user", "content": "Lisbon"})
    other = chat(SYSTEM, {"role": "user", "content": "write a poem"})
    assert key(turn1, {}, config) == key(turn3, {}, config)
    assert key(turn1, {}, config) != key(other, {}, config)
    # a system prompt alone is no conversation: it would put every chat in one session
    assert key(chat(SYSTEM), {}, config) is None


def test_an_unprintable_or_huge_header_is_ignored():
    config = SessionsConfig(sources=["header"])
    parsed = chat({"role": "user", "content": "x"})
    assert key(parsed, {"X-Session-Id": "a\x00b"}, config) is None
    assert key(parsed, {"X-Session-Id": "x" * 1000}, config) is None


async def test_bindings_are_new_then_hit_then_rebound_with_the_reason():
    store, metrics = MemoryStore(), Metrics()
    sessions = Sessions(store, metrics)
    healthy = fleet(replica("a"), replica("b"))
    config = SessionsConfig(ttl_s=60)
    await sessions.ran_on("s", "a", healthy, config.ttl_s)
    await sessions.ran_on("s", "a", healthy, config.ttl_s)
    drained = fleet(replica("a", drain=True), replica("b"))
    sessions.forget_reads()  # another instance's view: read the store
    await sessions.ran_on("s", "b", drained, config.ttl_s)
    assert await store.lookup(Sessions.store_key("s")) == "b"
    routes = metrics.session_routes
    assert sample_value(routes, "new", "unbound") == 1
    assert sample_value(routes, "hit", "bound") == 1
    assert sample_value(routes, "rebound", "draining") == 1
