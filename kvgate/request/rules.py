"""kvgate's own rules for the request fields it reads, as pydantic validators of `schema`.

Each refusal is a `PydanticCustomError` of type `KVGATE` whose context carries kvgate's words:
the client reads `'<path><suffix>'<text>`, `param` is the path (or `param` when the check spans
fields). The schema answers kvgate's refusals before any other field's, in `FIRST`'s order, and
`late` ones (`n`, `best_of`) after every other check, the body's nesting included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationInfo, ValidatorFunctionWrapHandler
from pydantic_core import PydanticCustomError

KVGATE = "kvgate"
# No model has a context this long; a larger max_tokens is a client bug, not a request.
ABSURD_MAX_TOKENS = 10_000_000
MAX_SEQUENCES = 128
DEFAULT_MAX_MESSAGES = 4096
# The order kvgate reads its fields in: of several refusals, the first here is answered.
FIRST = ("model", "priority", "messages", "prompt", "stream", "stream_options",
         "max_completion_tokens", "max_tokens", "user")


def refuse(
    text: str, *, param: str | None = None, suffix: str = "", code: str | None = None,
    late: bool = False,
) -> PydanticCustomError:
    context: dict[str, Any] = {"text": text, "suffix": suffix, "late": late}
    if param is not None:
        context["param"] = param
    if code is not None:
        context["code"] = code
    return PydanticCustomError(KVGATE, "{text}", context)


def rank(loc: Sequence[int | str]) -> int:
    return FIRST.index(loc[0]) if loc and loc[0] in FIRST else len(FIRST)


def model(value: Any) -> Any:
    if not isinstance(value, str) or not value:
        raise refuse(" is required and must be a non-empty string")
    return value


# A client's own `priority` orders its requests within their tenant's class, below this.
CLIENT_PRIORITY_SPAN = 1 << 20


def priority(value: Any) -> Any:
    """vLLM's `priority` orders its own queue (lower runs earlier, default 0). kvgate's tenant
    classes decide who goes first, so a client may lower its own request, never raise it."""
    if value is not None and (
        not _integer(value) or value < 0 or value >= CLIENT_PRIORITY_SPAN
    ):
        raise refuse(
            f" must be an integer from 0 to {CLIENT_PRIORITY_SPAN - 1}: a client may lower its "
            "request's priority on the replica, never raise it (kvgate's tenant classes decide "
            "who goes first)"
        )
    return value


def of_type(kind: type, text: str, *, required: bool = False) -> Callable[[Any], Any]:
    """A validator refusing, in `text`, a value not of `kind` (None passes unless `required`)."""

    def check(value: Any) -> Any:
        if (value is not None or required) and not isinstance(value, kind):
            raise refuse(text)
        return value

    return check


boolean = of_type(bool, " must be a boolean")
string = of_type(str, " must be a string")
required_string = of_type(str, " must be a string", required=True)
mapping = of_type(dict, " must be an object")
message = of_type(dict, " must be an object", required=True)


def objects(value: Any) -> Any:
    if value is not None and not (isinstance(value, list) and all(isinstance(c, dict) for c in value)):
        raise refuse(" must be an array of objects")
    return value


def token_limit(value: Any) -> Any:
    """`max_tokens` / `max_completion_tokens`: an integer from 1 to beyond any context."""
    if value is None:
        return value
    if not _integer(value):
        raise refuse(" must be an integer")
    if value < 1:
        raise refuse(f" must be at least 1, got {value}")
    if value > ABSURD_MAX_TOKENS:
        raise refuse(f" of {value} is beyond any model's context")
    return value


def content(value: Any) -> Any:
    """A message's content: a string, or an array of parts each with a `type`."""
    if value is not None and not isinstance(value, str | list):
        raise refuse(" must be a string or an array of parts")
    if isinstance(value, list):
        for j, part in enumerate(value):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise refuse(" must be an object with a 'type'", suffix=f"[{j}]")
    return value


def messages(value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
    """A non-empty array, no longer than `max_messages` (the per-message work of one request
    stays bounded); each message is then validated in turn."""
    _check_count(value, info)
    if value is None:
        raise refuse(" is required")
    if not isinstance(value, list) or not value:
        raise refuse(" must be a non-empty array")
    return handler(value)


def prompt(value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
    """A non-empty string, a batch of them (no more than `max_messages`), or token ids."""
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        _check_count(value, info)  # a batch of prompts
    if value is None:
        raise refuse(" is required")
    if not _prompt(value):
        raise refuse(
            " must be a non-empty string, an array of non-empty strings, or an array of token ids"
        )
    return handler(value)


def sequences(value: Any, field: str) -> None:
    """`n` or `best_of`: sequences generated in parallel, each up to the token limit."""
    if value is not None and (not _integer(value) or not 1 <= value <= MAX_SEQUENCES):
        raise refuse(f" must be an integer from 1 to {MAX_SEQUENCES}", param=field, late=True)


def _check_count(value: Any, info: ValidationInfo) -> None:
    limit = (info.context or {}).get("max_messages", DEFAULT_MAX_MESSAGES)
    if isinstance(value, list) and len(value) > limit:
        raise refuse(
            f" has {len(value)} entries; at most {limit} are accepted", code="too_many_messages"
        )


def _prompt(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value)
    if not isinstance(value, list) or not value:
        return False
    return (
        all(isinstance(p, str) and p for p in value)
        or all(_token_id(p) for p in value)
        or all(isinstance(p, list) and p and all(_token_id(t) for t in p) for p in value)
    )


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_id(value: Any) -> bool:
    return _integer(value) and value >= 0
