"""Prompt text to token ids (a ChatML-like template over tiktoken), and the filler output text.

Each rendered message is encoded on its own and cached under its role and text, so a repeated
system prompt costs one dictionary look-up; the ids of a prompt are the concatenation of its
messages' ids. A trailing space or a changed timestamp in a message therefore changes that
message's ids and every block after it, as it would on a real replica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from kvgate.tokens import Tokenizer, message_text

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

GENERATION_PROMPT = "<|im_start|>assistant\n"


def filler_text(start: int, count: int) -> str:
    """The text of output tokens start .. start+count-1."""
    n = len(FILLER_WORDS)
    return "".join(FILLER_WORDS[i % n] for i in range(start, start + count))


class PromptError(ValueError):
    """The request's messages or prompt are malformed (the server answers 400)."""


class PromptEncoder:
    """Encodes chat messages and plain prompts with one tokenizer and a per-text LRU cache."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = 4096) -> None:
        self.tokenizer = tokenizer
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._cache_size = cache_size
        self._generation_prompt = tuple(tokenizer.encode(GENERATION_PROMPT))
        decode = getattr(tokenizer, "decode", None)
        if decode is None:  # kvgate.tokens.TiktokenTokenizer only exposes encode
            decode = tokenizer._encoding.decode  # type: ignore[attr-defined]
        self._decode = decode

    def encode_chat(
        self, messages: Any, add_generation_prompt: bool = True
    ) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise PromptError("'messages' must be a non-empty list")
        ids: list[int] = []
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise PromptError(f"messages[{index}] must be an object with a string 'role'")
            rendered = f"<|im_start|>{message['role']}\n{message_text(message.get('content'))}"
            ids.extend(self.encode_text(rendered + "<|im_end|>\n"))
        if add_generation_prompt:
            ids.extend(self._generation_prompt)
        return ids

    def encode_prompt(self, prompt: Any) -> list[int]:
        """A completions prompt: a string, a list of token ids, or a one-element list of either."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError("'prompt' must not be empty")
            return self.encode_text(prompt)
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            return list(prompt)
        raise PromptError(
            "'prompt' must be a non-empty string or list of token ids (one prompt per request)"
        )

    def encode_text(self, text: str) -> list[int]:
        cached = self._cache.get(text)
        if cached is None:
            cached = tuple(self.tokenizer.encode(text))
            self._cache[text] = cached
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(text)
        return list(cached)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._decode(list(token_ids)))
