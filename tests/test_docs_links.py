"""Every relative link in README.md, SECURITY.md and docs/*.md leads somewhere: to a file that
exists and, for `#anchor`, to a heading of that file (anchors spelt as GitHub spells them)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "SECURITY.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+).+?\1", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans, where brackets are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to
    hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its label
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a page's headings make; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: Counter[str] = Counter()
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(heading)
        out.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    return out


def links(page: Path) -> list[str]:
    return LINK.findall(prose(page.read_text(encoding="utf-8")))


def broken(page: Path) -> list[str]:
    problems = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.\-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        if not path.exists():
            problems.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            problems.append(f"{target}: no heading #{anchor} in {path.name}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    assert broken(page) == []


def test_the_check_sees_links_and_catches_a_broken_one(tmp_path: Path):
    (tmp_path / "there.md").write_text("# A heading, with `code`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#a-heading-with-code) ![img](there.md) [web](https://example.com)\n"
        "[gone](missing.md) [bad anchor](there.md#nowhere) [self](#title)\n"
        "`[not a link](missing.md)`\n```\n[nor this](missing.md)\n```\n# Title\n"
    )
    assert broken(page) == [
        "missing.md: no such file", "there.md#nowhere: no heading #nowhere in there.md"
    ]


def test_the_front_door_links_into_every_page_of_docs():
    linked = {t.partition("#")[0] for t in links(ROOT / "README.md")}
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set()


SOURCE_PATH = re.compile(r"`((?:kvgate|bench|tests|deploy|scripts|config)/[\w./-]+\.(?:py|yaml|yml|json|md|lua))`")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_source_path_a_page_names_exists(page):
    """A path of the repository in a code span (`kvgate/admission/ledger.py`) names a file
    that is there: modules move, and a page that still sends a reader to the old place is
    wrong."""
    text = page.read_text(encoding="utf-8")
    missing = sorted({p for p in SOURCE_PATH.findall(text) if not (ROOT / p).exists()})
    assert not missing, f"{page.name} names files that do not exist: {missing}"
