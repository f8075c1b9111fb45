"""Each text rule on a table of cases: what it must change, and what it must leave alone."""

from __future__ import annotations

import pytest

from kvgate.normalize.text import (
    code_blocks,
    invisible_characters,
    line_endings,
    trailing_whitespace,
    unicode_nfc,
)

FENCED = "Run:\r\n```sh  \r\nls -l   \r\n\techo hi\t\r\n```\r\nDone.  "


@pytest.mark.parametrize(("text", "expected"), [
    ("a\r\nb\r\nc", "a\nb\nc"),
    ("a\rb", "a\nb"),
    ("a\r\n\r\nb\r", "a\n\nb\n"),
    ("a\n\rb", "a\n\nb"),  # LF then a lone CR: two line ends
    ("already\nunix\n", "already\nunix\n"),
    ("", ""),
])
def test_line_endings_become_lf(text, expected):
    assert line_endings(text, True) == expected


def test_line_endings_inside_fenced_code_are_kept_unless_configured():
    kept = line_endings(FENCED, True)
    assert kept.startswith("Run:\n```sh  ")
    assert "ls -l   \r\n\techo hi\t\r\n" in kept
    assert line_endings(FENCED, False).count("\r") == 0


@pytest.mark.parametrize(("text", "expected"), [
    ("line one  \nline two\t\nend   ", "line one\nline two\nend"),
    ("windows \r\nend", "windows\r\nend"),  # before a CRLF too (line_endings is another rule)
    ("trailing newlines\n\n\n", "trailing newlines"),
    ("no-break space\u00a0\nx", "no-break space\nx"),
    ("  leading blanks stay", "  leading blanks stay"),
    ("inner  double  spaces stay", "inner  double  spaces stay"),
    ("a\n\nb", "a\n\nb"),  # blank lines stay
    ("", ""),
])
def test_trailing_whitespace_is_stripped_per_line_and_at_the_end(text, expected):
    assert trailing_whitespace(text, True) == expected


def test_trailing_whitespace_inside_fenced_code_is_kept_unless_configured():
    kept = trailing_whitespace(FENCED, True)
    assert "```sh\r\n" in kept  # the fence line itself is text around the code
    assert code_blocks(kept) == ["\r\nls -l   \r\n\techo hi\t\r\n"]
    assert kept.endswith("```\r\nDone.")
    assert "ls -l\r\n\techo hi\r\n" in trailing_whitespace(FENCED, False)


def test_an_unclosed_code_block_keeps_its_whitespace_to_the_end():
    text = "Here:\n```\nx = 1   \n"
    assert trailing_whitespace(text, True) == text
    assert trailing_whitespace(text, False) == "Here:\n```\nx = 1"


@pytest.mark.parametrize(("text", "expected"), [
    ("cafe\u0301", "caf\u00e9"),  # e + combining acute → é
    ("\u212b", "\u00c5"),  # ANGSTROM SIGN → Å (a canonical singleton)
    ("\ufb01le", "\ufb01le"),  # the ﬁ ligature is a compatibility form: kept
    ("\uff21", "\uff21"),  # full-width A: kept
    ("caf\u00e9", "caf\u00e9"),
    ("ascii", "ascii"),
])
def test_unicode_nfc_composes_canonical_equivalents_only(text, expected):
    assert unicode_nfc(text, True) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("\ufeffHello", "Hello"),  # a BOM
    ("zero\u200bwidth", "zerowidth"),
    ("word\u2060joiner", "wordjoiner"),
    ("family \U0001f468\u200d\U0001f469\u200d\U0001f467", "family \U0001f468\u200d\U0001f469\u200d\U0001f467"),  # ZWJ kept
    ("\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645", "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645"),  # ZWNJ kept
])
def test_invisible_characters_are_removed_but_joiners_are_kept(text, expected):
    assert invisible_characters(text, True) == expected


@pytest.mark.parametrize("rule", [invisible_characters, line_endings, unicode_nfc,
                                  trailing_whitespace])
@pytest.mark.parametrize("text", [
    "clean ascii\nlines", "caf\u00e9 \u00e0 la carte", "```\nkept   \n```\nafter", "",
])
def test_a_rule_with_nothing_to_change_returns_the_very_same_string(rule, text):
    assert rule(text, True) is text
