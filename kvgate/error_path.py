"""Where a pydantic error is, written as the user wrote it: `tools[0].function.name`.

One function for both validated inputs, the request body and the config file. pydantic puts
the label of a union's branch into an error's location (`stop.list[str].1` for `["a", 5]`);
those labels are not keys the user wrote and are left out.
"""

from __future__ import annotations

from collections.abc import Sequence

# A union branch is labelled with its validator's name: a builtin type, a model class, or a
# function/constrained validator ("function-after[...]", "list[str]", "literal['auto']").
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})
_LABEL_PREFIXES = ("function-", "function_", "model-", "constrained-", "lax-or-strict")


def error_path(loc: Sequence[int | str], labels: frozenset[str] = frozenset()) -> str:
    """('tools', 0, 'function', 'name') -> 'tools[0].function.name'; `labels` names the
    model classes that may appear as union branches (they read like keys otherwise)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _is_label(part, labels):
            continue
        else:
            out += f".{part}" if out else part
    return out


def _is_label(part: str, labels: frozenset[str]) -> bool:
    return part in _TYPE_NAMES or part in labels or "[" in part or part.startswith(_LABEL_PREFIXES)
