"""Token counting: a per-message cache over the model's tokenizer
(`kvgate.request.tokenizers`), the model's chat template when known.

The counter reports what it saw — text tokens, messages, prompts — and `kvgate.request.calibration`
maps that to the `prompt_tokens` vLLM will report: exactly, with the model's own tokenizer and
chat template (`kvgate.request.chat_template`); by an affine fit learned from every response, without.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from kvgate.digest import digest
from kvgate.errors import BadRequest
from kvgate.request.calibration import Features
from kvgate.request.tokenizers import Tokenizer

if TYPE_CHECKING:
    from kvgate.request.chat_template import ChatTemplate

# Texts longer than this are counted in a worker thread so the event loop keeps serving.
OFF_LOOP_CHARS = 32_768


def message_text(content: Any) -> str:
    """The countable text of a message's content (a string, or a list of typed parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "\n".join(parts)
    return orjson.dumps(content, option=orjson.OPT_SORT_KEYS).decode()


def _json(value: Any, field: str) -> str:
    """Canonical JSON of a part of the request, for counting; nesting deeper than the encoder
    can write is the client's error, not kvgate's."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except orjson.JSONEncodeError as exc:
        raise BadRequest(f"'{field}' cannot be encoded: {exc}", param=field.split("[")[0]) from None


def media_parts(content: Any) -> int:
    """Content parts that are not text (images, audio, files): each costs a configured number
    of tokens, since their true cost depends on the model's encoder, not on the bytes sent."""
    if not isinstance(content, list):
        return 0
    return sum(
        1 for part in content
        if isinstance(part, Mapping) and part.get("type") not in (None, "text")
    )


@dataclass(frozen=True, slots=True)
class PromptCount:
    """What the counter saw of one request's prompt; `kvgate.request.calibration` turns `features`
    into the tokens vLLM will count.

    `prefix_*` describe the leading part other requests share (the first message, usually the
    system prompt), `longest` the longest of a completions call's prompts (its context-length
    check is per prompt), `templated` whether the model's own chat template was rendered.
    """

    features: Features
    prefix_text_tokens: int = 0
    prefix_key: bytes | None = None
    longest: Features | None = None
    templated: bool = False
    # Non-text parts at their configured cost: added to the estimate, never calibrated (what
    # an image costs vLLM depends on its size, which would only confuse the text's fit).
    media_tokens: int = 0
    # The prompt's token ids as vLLM will see them, where kvgate knows them exactly: a chat
    # rendered with the model's own template, or one completions prompt. None otherwise.
    # Precise prefix routing keys the replicas' cached blocks by them.
    token_ids: tuple[int, ...] | None = None

    @property
    def prefix(self) -> Features:
        return Features(self.prefix_text_tokens, 1, 0)

    def fit_name(self, endpoint: str) -> str:
        """Which calibration fit the request belongs to: per endpoint (`chat`, `completions`),
        and apart for chats counted with the model's own template (their features mean
        something else)."""
        return f"{endpoint}+template" if self.templated else endpoint


class PromptCounter:
    """Counts a request's prompt with one tokenizer (and the model's chat template, if known).

    Without a template, each message's text is counted on its own and cached under a hash of
    its role and text (an LRU of `cache_size` entries): system prompts and chat history repeat
    across requests and turns. With a template the whole rendered prompt is counted, as vLLM
    does. Large texts are counted in a worker thread. Safe to call from several coroutines;
    the cache is only touched on the event loop thread.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        template: ChatTemplate | None = None,
        name_tokens: int = 1,
        media_part_tokens: int = 0,
        cache_size: int = 8192,
        token_ids: bool = True,
    ) -> None:
        """`token_ids`: keep each prompt's token ids where they are known exactly (for
        precise prefix routing; off where no pool reads KV events, so that no prompt is
        encoded or held for them)."""
        self.tokenizer = tokenizer
        self.template = template
        self.keep_token_ids = token_ids
        self.name_tokens = name_tokens
        self.media_part_tokens = media_part_tokens
        self._cache: OrderedDict[bytes, int] = OrderedDict()
        self._cache_size = cache_size
        self.cache_hits = 0
        self.cache_misses = 0

    async def count_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Any = None,
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> PromptCount:
        pending: list[tuple[bytes, str, str]] = []  # (key, text, name) not yet counted
        keys: list[bytes] = []
        counts: list[int] = []
        chars = media = 0
        for message in messages:
            content = message.get("content")
            text = message_text(content)
            for call in message.get("tool_calls") or ():
                text += _json(call, "messages[].tool_calls")
            name = str(message.get("name") or "")
            chars += len(text) + len(name)
            # role, name and text: what the template renders of the message
            key = digest(str(message.get("role")), name, text)
            keys.append(key)
            media += self.media_part_tokens * media_parts(content)
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                counts.append(cached)
            else:
                self.cache_misses += 1
                pending.append((key, text, name))
                counts.append(0)
        tools_text = _json(tools, "tools") if tools else ""
        chars += len(tools_text)
        texts = [t for _, text, name in pending for t in (text, name)]
        found = await self._count_many([*texts, tools_text], chars)
        new = {}
        for i, (key, _, name) in enumerate(pending):
            text_tokens, name_tokens = found[2 * i], found[2 * i + 1]
            new[key] = text_tokens + (self.name_tokens + name_tokens if name else 0)
            self._remember(key, new[key])
        counts = [c + new.get(k, 0) for c, k in zip(counts, keys, strict=True)]
        units = len(messages) + (1 if tools else 0)  # a tools block renders as one message
        features = Features(sum(counts) + found[-1], units, 1)
        templated, ids = False, None
        if self.template is not None:
            ids = await self._render_ids(
                messages, tools, add_generation_prompt, template_kwargs, chars
            )
            if ids is not None:
                features, templated = Features(len(ids), units, 1), True
        # The first message (usually the system prompt) is a prefix other requests share:
        # identical bytes give identical tokens, and vLLM caches its full blocks.
        prefix_key = None
        if len(messages) >= 2:
            prefix_key = digest(keys[0], tools_text)
        return PromptCount(
            features, counts[0] if prefix_key else 0, prefix_key, features, templated, media,
            token_ids=ids if self.keep_token_ids else None,
        )

    async def count_prompt(self, prompt: str | Sequence[Any]) -> PromptCount:
        """A completions prompt: a string, a list of token ids, or a list of several prompts
        (strings or token-id lists), which vLLM runs as separate sequences."""
        if isinstance(prompt, str):
            if not self.keep_token_ids:
                n = (await self._count_many([prompt]))[0]
                return PromptCount(Features(n, 0, 1), longest=Features(n, 0, 1))
            n, text_ids = await self._count_prompt_text(prompt)
            return PromptCount(Features(n, 0, 1), longest=Features(n, 0, 1), token_ids=text_ids)
        if prompt and all(isinstance(t, int) for t in prompt):
            n = len(prompt)
            ids = tuple(int(t) for t in prompt) if self.keep_token_ids else None
            return PromptCount(Features(n, 0, 1), longest=Features(n, 0, 1), token_ids=ids)
        texts = [p for p in prompt if isinstance(p, str)]
        found = iter(await self._count_many(texts))
        counts = [next(found) if isinstance(p, str) else len(p) for p in prompt]
        longest = max(counts, default=0)
        return PromptCount(Features(sum(counts), 0, len(counts)), longest=Features(longest, 0, 1))

    async def _count_prompt_text(self, prompt: str) -> tuple[int, tuple[int, ...]]:
        """A completions prompt's text tokens, and its token ids as vLLM will see them."""

        def both() -> tuple[int, tuple[int, ...]]:
            ids = tuple(self.tokenizer.encode_prompt(prompt))
            if not getattr(self.tokenizer, "adds_special_tokens", True):
                return len(ids), ids  # the same ids as its count: one encoding, not two
            return self._count_now(prompt), ids

        if len(prompt) <= OFF_LOOP_CHARS:
            return both()
        return await asyncio.to_thread(both)

    async def _render_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Any,
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None,
        chars: int,
    ) -> tuple[int, ...] | None:
        """Token ids of the rendered template; None (fall back to the affine estimate) when
        the template refuses these messages — vLLM will answer that request's error itself."""
        import jinja2

        assert self.template is not None
        template = self.template

        def count() -> tuple[int, ...]:
            text = template.render(
                messages, tools, add_generation_prompt=add_generation_prompt,
                extra=template_kwargs,
            )
            return tuple(self.tokenizer.encode_rendered(text))

        try:
            if chars <= OFF_LOOP_CHARS:
                return count()
            return await asyncio.to_thread(count)
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, RecursionError,
                LookupError, AttributeError):
            return None

    async def _count_many(self, texts: list[str], chars: int | None = None) -> list[int]:
        if chars is None:
            chars = sum(len(t) for t in texts)
        if not texts or chars <= OFF_LOOP_CHARS:
            return [self._count_now(t) for t in texts]
        return await asyncio.to_thread(lambda: [self._count_now(t) for t in texts])

    def _count_now(self, text: str) -> int:
        return len(self.tokenizer.encode(text)) if text else 0

    def _remember(self, key: bytes, n: int) -> None:
        self._cache[key] = n
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
