"""Session keys from the configured sources, and bindings: new, hit, rebound with a reason."""

from __future__ import annotations

import orjson

from kvgate.config import SessionsConfig
from kvgate.metrics import Metrics
from kvgate.requests import Endpoint, parse_body
from kvgate.routing.sessions import Sessions, session_key
from kvgate.state.memory import MemoryStore
from tests.routing.fleets import fleet, replica

SYSTEM = {"role": "system", "content": "You are terse."}


def chat(*messages: dict[str, str], user: str | None = None) -> object:
    body: dict[str, object] = {"model": "m", "messages": list(messages)}
    if user is not None:
        body["user"] = user
    return parse_body(orjson.dumps(body), Endpoint.CHAT)


def test_the_header_wins_then_the_user_field_then_the_conversation():
    config = SessionsConfig()
    first = {"role": "user", "content": "plan a trip"}
    parsed = chat(SYSTEM, first, user="alice")
    assert session_key(parsed, {"X-Session-Id": "s-9"}, config) == "h:s-9"
    assert session_key(parsed, {}, config) == "u:alice"
    assert session_key(chat(SYSTEM, first), {}, config).startswith("c:")
    only_header = SessionsConfig(sources=["header"])
    assert session_key(parsed, {}, only_header) is None


def test_every_turn_of_one_chat_has_the_same_key_and_other_chats_another():
    config = SessionsConfig()
    first = {"role": "user", "content": "plan a trip"}
    turn1 = chat(SYSTEM, first)
    turn3 = chat(SYSTEM, first, {"role": "assistant", "content": "Where to?"},
                 {"role": "user", "content": "Lisbon"})
    other = chat(SYSTEM, {"role": "user", "content": "write a poem"})
    assert session_key(turn1, {}, config) == session_key(turn3, {}, config)
    assert session_key(turn1, {}, config) != session_key(other, {}, config)
    # a system prompt alone is no conversation: it would put every chat in one session
    assert session_key(chat(SYSTEM), {}, config) is None


def test_an_unprintable_or_huge_header_is_ignored():
    config = SessionsConfig(sources=["header"])
    parsed = chat({"role": "user", "content": "x"})
    assert session_key(parsed, {"X-Session-Id": "a\x00b"}, config) is None
    assert session_key(parsed, {"X-Session-Id": "x" * 1000}, config) is None


async def test_bindings_are_new_then_hit_then_rebound_with_the_reason():
    store, metrics = MemoryStore(), Metrics()
    sessions = Sessions(store, metrics)
    healthy = fleet(replica("a"), replica("b"))
    await sessions.ran_on("s", "a", healthy, 60)
    await sessions.ran_on("s", "a", healthy, 60)
    drained = fleet(replica("a", drain=True), replica("b"))
    sessions._cache.clear()  # another instance's view: read the store
    await sessions.ran_on("s", "b", drained, 60)
    assert await store.lookup(Sessions.store_key("s")) == "b"
    count = metrics.session_routes.labels
    assert count("new", "unbound")._value.get() == 1
    assert count("hit", "bound")._value.get() == 1
    assert count("rebound", "draining")._value.get() == 1
