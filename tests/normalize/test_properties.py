"""Properties of the whole pipeline, on requests hypothesis makes up from the characters that
trip normalizers (CR, blanks, fences, zero-width characters, combining marks, timestamps).

    idempotent: normalizing the normalized request changes nothing (and returns it as is)
    pass-through: when no rule fires, the very same request comes back, its body unmodified
"""

from __future__ import annotations

import copy
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.normalize.config import RelocationConfig, RuleName
from kvgate.normalize.pipeline import RULES, CleanTexts, Settings, normalize
from kvgate.normalize.relocate import compile_patterns
from kvgate.request.parsed import Endpoint, parse_body

FRAGMENTS = [
    " ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0", "\x0b", "```", "```py\n", "\n```\n",
    "\u200b", "\ufeff", "\u2060", "\u200d", "e\u0301", "\u0301", "\u212b", "caf\u00e9",
    "2026-11-29T10:03Z", "2026-11-29", "Nov 29, 2026", "User: Ada", "request id: ab12",
    "[moved from the system prompt]", "[date]", "word", "Hello.", "x",
]
texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=4)), max_size=12).map(
    "".join
)
parts = st.lists(st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, texts),
    st.just({"type": "image_url", "image_url": {"url": "data:,x  "}}),
), min_size=1, max_size=3)
messages = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "system", "developer", "user", "assistant", "tool"]),
    "content": st.one_of(texts, parts),
}), min_size=1, max_size=6)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 5), texts),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.sampled_from("abcdef"), inner, max_size=4)),
    max_leaves=10,
)
json_objects = st.dictionaries(st.sampled_from("abcdef"), json_values, max_size=4)
# Tools as the OpenAI API shapes them (kvgate refuses others before normalizing), with
# arbitrary JSON where the API allows it.
tools = st.lists(st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["f", "g"])},
        optional={"parameters": json_objects, "description": texts})},
    optional={"x": json_values},
), max_size=3)
rule_names: list[RuleName] = [r.name for r in RULES]
pipelines = st.builds(
    lambda rules, keep, target: Settings.of(
        rules, keep_code=keep, target=target,
        patterns=compile_patterns(RelocationConfig(
            patterns=["timestamp", "date", "request_id", "user_name"])),
    ),
    st.sets(st.sampled_from(rule_names)), st.booleans(), st.sampled_from(["last_user", "system_note"]),
)


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    body: dict[str, Any] = {"model": "m"}
    if draw(st.booleans()):
        body["messages"] = draw(messages)
        if draw(st.booleans()):
            body["tools"] = draw(tools)
        if draw(st.booleans()):
            body["response_format"] = {"type": "json_schema", "json_schema": draw(json_objects)}
        return orjson.dumps({"endpoint": "chat", "body": body})
    prompts = texts.filter(bool)  # an empty prompt is refused before normalizing
    body["prompt"] = draw(st.one_of(prompts, st.lists(prompts, min_size=1, max_size=3),
                                    st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    return orjson.dumps({"endpoint": "completions", "body": body})


def parse(raw: bytes) -> Any:
    data = orjson.loads(raw)
    endpoint = Endpoint.CHAT if data["endpoint"] == "chat" else Endpoint.COMPLETIONS
    return parse_body(orjson.dumps(data["body"]), endpoint)


PROPERTY = settings(max_examples=400, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(requests(), pipelines)
def test_normalizing_twice_changes_nothing_more_than_normalizing_once(raw, pipeline):
    once = normalize(parse(raw), pipeline)
    twice = normalize(once.request, pipeline)
    assert not twice.changed, twice.tally
    assert twice.request is once.request


@PROPERTY
@given(requests(), pipelines)
def test_a_request_no_rule_changes_passes_through_byte_for_byte(raw, pipeline):
    parsed = parse(raw)
    before = orjson.dumps(parsed.body)
    original = copy.deepcopy(parsed.body)
    result = normalize(parsed, pipeline)
    assert parsed.body == original  # the client's body is never edited in place
    if not result.changed:
        assert result.request is parsed
        assert orjson.dumps(result.request.body) == before
    else:
        assert result.request is not parsed


@PROPERTY
@given(requests(), pipelines)
def test_the_cache_of_clean_texts_never_changes_the_outcome(raw, pipeline):
    clean = CleanTexts(min_chars=0)
    for _ in range(2):
        cached = normalize(parse(raw), pipeline, clean)
        fresh = normalize(parse(raw), pipeline)
        assert orjson.dumps(cached.request.body) == orjson.dumps(fresh.request.body)


def test_merged_system_messages_are_cleaned_as_one_text_so_a_second_pass_changes_nothing():
    """Found by the property above: "```" then "```py\\n" as two system messages. Alone, the
    second one's newline is inside a code block and kept; merged after the first one's open
    fence, it is outside one, and a second pass stripped it."""
    raw = orjson.dumps({"endpoint": "chat", "body": {"model": "m", "messages": [
        {"role": "system", "content": "```"}, {"role": "system", "content": "```py\n"},
        {"role": "user", "content": "hi"},
    ]}})  # fmt: skip
    pipeline = Settings.of(["trailing_whitespace", "merge_system"])
    once = normalize(parse(raw), pipeline)
    assert once.request.body["messages"][0]["content"] == "```\n\n```py"
    assert not normalize(once.request, pipeline).changed
