"""Prompt text to token ids (a ChatML template over tiktoken), and the filler output text.

The template is a ChatML model's (Qwen and others), where `<|im_start|>` and `<|im_end|>` are
single special tokens (cl100k_im's ids 100264 and 100265):

    [IM_START] + encode(f"{role}\\n{content}") + [IM_END] + encode("\\n")     each message
    [IM_START] + encode("assistant\\n")                                     the generation prompt

A request's `tools` come first, as one system message whose content is "# Tools" and one
compact JSON line per tool, as sent. Marker-like text inside content stays ordinary text: it
is user input, never a special token.

Each message's ids are cached under its rendered text, so a repeated system prompt costs one
dictionary look-up; a prompt's ids are the concatenation of its messages' ids. A trailing
space or a changed timestamp in a message therefore changes that message's ids and every
block after it, as it would on a real replica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import orjson

from kvgate.request.tokenizers import Tokenizer
from kvgate.request.tokens import message_text

IM_START = 100264  # <|im_start|> in cl100k_im
IM_END = 100265  # <|im_end|> in cl100k_im
MARKERS: dict[int, str] = {IM_START: "<|im_start|>", IM_END: "<|im_end|>"}

TEMPLATE_HELP = (
    "Prompts are rendered with a ChatML template over cl100k_base: each message is "
    "<|im_start|>{role}\\n{content}<|im_end|>\\n with the two markers as single special tokens "
    "(ids 100264 and 100265), a request's tools first as one '# Tools' system message, and "
    "<|im_start|>assistant\\n as the generation prompt."
)

# What the simulated model "generates": these words cycled, one cl100k token each.
FILLER: tuple[tuple[str, int], ...] = (
    (" the", 279),
    (" model", 1646),
    (" served", 10434),
    (" a", 264),
    (" request", 1715),
    (" from", 505),
    (" the", 279),
    (" pool", 7463),
    (" of", 315),
    (" tokens", 11460),
    (" in", 304),
    (" each", 1855),
    (" step", 3094),
    (" with", 449),
    (" data", 828),
    (" for", 369),
    (" the", 279),
    (" cache", 6636),
    (" block", 2565),
    (".", 13),
)
FILLER_TOKEN_IDS: tuple[int, ...] = tuple(token_id for _, token_id in FILLER)
FILLER_WORDS: tuple[str, ...] = tuple(word for word, _ in FILLER)


def filler_text(start: int, count: int) -> str:
    """The text of output tokens start .. start+count-1."""
    n = len(FILLER_WORDS)
    return "".join(FILLER_WORDS[i % n] for i in range(start, start + count))


def tools_text(tools: Sequence[Any]) -> str:
    """The content of the system message that lists a request's tools."""
    return "# Tools\n" + "\n".join(orjson.dumps(tool).decode() for tool in tools)


class PromptError(ValueError):
    """The request's messages or prompt are malformed (the server answers 400)."""


class _Lru:
    """A bounded map from rendered text to token ids, least recently used out first."""

    def __init__(self, size: int) -> None:
        self._items: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._size = size

    def get(self, key: str, compute: Callable[[str], Sequence[int]]) -> tuple[int, ...]:
        found = self._items.get(key)
        if found is None:
            found = self._items[key] = tuple(compute(key))
            if len(self._items) > self._size:
                self._items.popitem(last=False)
        else:
            self._items.move_to_end(key)
        return found


class TextTokenizer(Tokenizer, Protocol):
    """A tokenizer that also turns ids back into text (the simulator writes answers)."""

    def decode(self, ids: Sequence[int]) -> str: ...


class PromptEncoder:
    """Encodes chat messages and plain prompts with one tokenizer and per-text LRU caches."""

    def __init__(self, tokenizer: TextTokenizer, cache_size: int = 4096) -> None:
        self.tokenizer = tokenizer
        self._texts = _Lru(cache_size)
        self._messages = _Lru(cache_size)
        self._newline = tuple(tokenizer.encode("\n"))
        self._generation_prompt = (IM_START, *tokenizer.encode("assistant\n"))
        self._decode = tokenizer.decode

    def encode_chat(
        self, messages: Any, add_generation_prompt: bool = True, tools: Any = None
    ) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise PromptError("'messages' must be a non-empty list")
        ids: list[int] = []
        if tools:
            if not isinstance(tools, list):
                raise PromptError("'tools' must be a list of tool objects")
            ids.extend(self._messages.get(f"system\n{tools_text(tools)}", self._render))
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise PromptError(f"messages[{index}] must be an object with a string 'role'")
            body = f"{message['role']}\n{message_text(message.get('content'))}"
            ids.extend(self._messages.get(body, self._render))
        if add_generation_prompt:
            ids.extend(self._generation_prompt)
        return ids

    def _render(self, body: str) -> list[int]:
        """One message's ids: its "role\\ncontent" text between the two special markers."""
        return [IM_START, *self.tokenizer.encode(body), IM_END, *self._newline]

    def encode_prompt(self, prompt: Any) -> list[int]:
        """One prompt: a string, a list of token ids, or a one-element list of either."""
        prompts = self.encode_prompts(prompt)
        if len(prompts) != 1:
            raise PromptError("'prompt' must be one prompt here, not a list of prompts")
        return prompts[0]

    def encode_prompts(self, prompt: Any) -> list[list[int]]:
        """A completions prompt, as vLLM batches it: a string, a list of token ids, or a list
        of either (one engine request per element)."""
        if isinstance(prompt, str) or _is_token_ids(prompt):
            return [self._one_prompt(prompt)]
        if isinstance(prompt, list) and prompt:
            if len({type(p) for p in prompt}) > 1:
                raise PromptError("a list of prompts must be all strings or all token-id lists")
            return [self._one_prompt(p) for p in prompt]
        raise PromptError(
            "'prompt' must be a non-empty string, a list of token ids, or a list of either"
        )

    def _one_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str) and prompt:
            return self.encode_text(prompt)
        if _is_token_ids(prompt):
            return list(prompt)
        raise PromptError(
            "each prompt must be a non-empty string or a non-empty list of token ids"
        )

    def encode_text(self, text: str) -> list[int]:
        return list(self._texts.get(text, self.tokenizer.encode))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of the ids; the two ChatML markers come back as their marker strings."""
        pieces: list[str] = []
        run: list[int] = []
        for token_id in token_ids:
            marker = MARKERS.get(token_id)
            if marker is None:
                run.append(token_id)
                continue
            if run:
                pieces.append(str(self._decode(run)))
                run = []
            pieces.append(marker)
        if run:
            pieces.append(str(self._decode(run)))
        return "".join(pieces)


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )
