"""The text rules: each a plain `(text, keep_code) -> text` function.

Contract: a rule returns its argument itself — the same object — when it has nothing to change,
so the pipeline tells a no-op by identity, at no cost; it is idempotent; and it never creates
work for a rule listed before it (see `kvgate.normalize.pipeline.RULES`), so the whole chain is
idempotent too. Each rule first looks for a cheap sign that it may have work (an ASCII-only
text cannot hold a zero-width character or a non-NFC sequence; no "\\r" means no CRLF), so
a clean text costs a few substring searches.

`keep_code`: inside ``` fenced code blocks, line ends and trailing whitespace stay as sent (a
fence is a line that starts with optional blanks and three backticks; the next such line
closes it; an unclosed block runs to the end of the text).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable

# Zero-width space, word joiner, BOM / zero-width no-break space. Not ZWJ (U+200D) or ZWNJ
# (U+200C): emoji sequences and Persian and Indic scripts need them to read as written.
INVISIBLE = ("\u200b", "\u2060", "\ufeff")
_INVISIBLE = re.compile("[\u200b\u2060\ufeff]")

# Blanks (any whitespace but a line break) right before a line break or the end of a piece.
_TRAILING = re.compile(r"[^\S\r\n]+(?=[\r\n]|\Z)")
# Whitespace characters other than " " and "\t" that can stand before a line break in ASCII.
_RARE_ASCII_BLANKS = ("\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x1f")
# A fence line: at the start of the text or after a line break, up to (not including) its end.
_FENCE = re.compile(r"(?<![^\r\n])[ \t]*```[^\r\n]*")


def invisible_characters(text: str, keep_code: bool) -> str:
    """Zero-width spaces, word joiners and byte-order marks removed (inside code too: they
    are never part of code anyone meant to write)."""
    if text.isascii() or not any(c in text for c in INVISIBLE):
        return text
    return _INVISIBLE.sub("", text)


def line_endings(text: str, keep_code: bool) -> str:
    """\\r\\n and a lone \\r become \\n."""
    if "\r" not in text:
        return text
    return _outside_code(text, keep_code, _unix)


def unicode_nfc(text: str, keep_code: bool) -> str:
    """Unicode NFC: canonically equivalent sequences (é as one code point or as e + a
    combining accent) become one; compatibility forms (ﬁ, full-width letters) are kept."""
    if text.isascii() or unicodedata.is_normalized("NFC", text):
        return text
    return unicodedata.normalize("NFC", text)


def trailing_whitespace(text: str, keep_code: bool) -> str:
    """Blanks at the end of each line removed, and all whitespace at the end of the text."""
    if not _may_have_trailing(text):
        return text
    if "\n" not in text and "\r" not in text:  # one line: its end is all there is to strip
        return text.rstrip()  # (the regex costs about 13 µs on a 1 KB system prompt)
    if not (keep_code and "```" in text):
        out = _TRAILING.sub("", text).rstrip()
        return text if out == text else out
    pieces = _pieces(text)
    out_pieces = [piece if code else _TRAILING.sub("", piece) for code, piece in pieces]
    if not pieces[-1][0]:  # the text does not end inside a code block
        out_pieces[-1] = out_pieces[-1].rstrip()
    out = "".join(out_pieces)
    return text if out == text else out


def _may_have_trailing(text: str) -> bool:
    if not text:
        return False
    if text[-1].isspace():
        return True
    if text.isascii():
        return (
            " \n" in text or "\t\n" in text or " \r" in text or "\t\r" in text
            or any(c in text for c in _RARE_ASCII_BLANKS)
        )
    return _TRAILING.search(text) is not None


def _unix(piece: str) -> str:
    return piece.replace("\r\n", "\n").replace("\r", "\n")


def _outside_code(text: str, keep_code: bool, change: Callable[[str], str]) -> str:
    """`change` applied to the text, or only to what lies outside fenced code blocks."""
    if keep_code and "```" in text:
        out = "".join(piece if code else change(piece) for code, piece in _pieces(text))
    else:
        out = change(text)
    return text if out == text else out


def _pieces(text: str) -> list[tuple[bool, str]]:
    """The text cut into (inside a code block?, piece), in order. A code piece runs from the
    end of its opening fence line to the start of its closing one, so its line breaks are
    its own, and fence lines belong to the text around them."""
    pieces: list[tuple[bool, str]] = []
    position = 0
    opened: int | None = None
    for fence in _FENCE.finditer(text):
        if opened is None:
            pieces.append((False, text[position:fence.end()]))
            opened = fence.end()
        else:
            pieces.append((True, text[opened:fence.start()]))
            position, opened = fence.start(), None
    if opened is not None:
        pieces.append((True, text[opened:]))
    else:
        pieces.append((False, text[position:]))
    return pieces


def code_blocks(text: str) -> list[str]:
    """The inside of each fenced code block, as the rules see them (for tests and docs)."""
    return [piece for code, piece in _pieces(text) if code] if "```" in text else []
