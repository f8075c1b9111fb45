"""Summarize py-spy's collapsed stacks (`bench/proxy_overhead.py --profile DIR`): the share of
the proxy's busy samples spent in each function, inclusive (with what it calls) and self.

    .venv/bin/python bench/profile_summary.py DIR/kvgate-all-memory.txt [--top 30] [--match kvgate]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^:()]*)(?::\d+)?\)$")


def frames(stack: str) -> list[str]:
    """`func (file)` per frame, line numbers dropped."""
    out = []
    for raw in stack.split(";"):
        m = FRAME.match(raw.strip())
        out.append(f"{m['func']} ({m['file']})" if m else raw.strip())
    return out


def summarize(path: Path) -> tuple[int, Counter[str], Counter[str]]:
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        names = frames(stack)
        for name in set(names):
            inclusive[name] += n
        own[names[-1]] += n
    return total, inclusive, own


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--match", default="", help="only functions whose file contains this")
    args = parser.parse_args()
    total, inclusive, own = summarize(args.path)
    print(f"{args.path.name}: {total} busy samples\n")
    print("| function | inclusive | self |\n|---|---|---|")
    shown = 0
    for name, n in inclusive.most_common():
        if args.match not in name or name.startswith("<module>") or "runpy" in name:
            continue
        print(f"| `{name}` | {100 * n / total:.1f}% | {100 * own[name] / total:.1f}% |")
        shown += 1
        if shown >= args.top:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
