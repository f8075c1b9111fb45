"""Request bodies for the OpenAI API, built one way for the whole suite.

    chat()                                      # the stub's model, the user says "hi", max_tokens 5
    chat(f"Question {i}", model=SIM_MODEL, max_tokens=2000, ignore_eos=True, stream=True)
    chat("hi", system_prompt="You are terse.")  # a system prompt before the user's turn
    chat(messages=[...], max_tokens=OMIT)       # messages as given, no max_tokens at all
    completion("Once upon a time", max_tokens=16)

Every other keyword is a field of the body as given, so a test can send a field of any type,
a bad one included (`chat(max_tokens="5")`, `chat(messages=None)`); a field given as `OMIT`
is left out (`chat(model=OMIT)`).
"""

from __future__ import annotations

from typing import Any

STUB_MODEL = "stub-model"  # what tests.plugins.gateway.StubUpstream serves
SIM_MODEL = "sim-model"  # what kvgate.sim serves by default
OMIT: Any = object()  # a field given as OMIT is left out of the body
FROM_TEXT: Any = object()  # chat()'s default messages: built from its text


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def system(text: str) -> dict[str, str]:
    return {"role": "system", "content": text}


def chat(
    text: str = "hi", *, model: Any = STUB_MODEL, max_tokens: Any = 5,
    system_prompt: str | None = None, messages: Any = FROM_TEXT, **fields: Any,
) -> dict[str, Any]:
    """A chat-completions body: `messages` as given, else the user's `text` after an optional
    system prompt; every other keyword a field as given; no field that is `OMIT`."""
    if messages is FROM_TEXT:
        messages = [user(text)] if system_prompt is None else [system(system_prompt), user(text)]
    return without_omitted({"model": model, "messages": messages, "max_tokens": max_tokens,
                            **fields})


def completion(
    prompt: Any = "hi", *, model: Any = STUB_MODEL, max_tokens: Any = 5, **fields: Any
) -> dict[str, Any]:
    """A completions body: `prompt` as given; no field that is `OMIT`."""
    return without_omitted({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            **fields})


def without_omitted(body: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in body.items() if value is not OMIT}
