"""`kvgate top --url URL [--once]`: a live terminal view of a running kvgate.

Reads the gateway's `/admin/replicas` and `/metrics` every `--interval` seconds and redraws in
place (plain ANSI, so it works over SSH); `--once` prints one frame and exits, for scripts.
Colour only on a terminal: piped or redirected, the frame is plain text. Needs `rich`
(`pip install 'kvgate[top]'`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import TYPE_CHECKING

import aiohttp
import orjson

if TYPE_CHECKING:
    from kvgate.tools.topview import Snapshot


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8080",
                        help="the kvgate to watch (default: %(default)s)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between frames")
    parser.add_argument("--admin-key", default=os.environ.get("KVGATE_ADMIN_KEY"),
                        help="Bearer token for the admin endpoints, if they need one "
                             "(default: $KVGATE_ADMIN_KEY)")


def run(args: argparse.Namespace) -> int:
    try:
        from kvgate.tools import topview  # noqa: F401  (rich is an optional dependency)
    except ImportError:
        print("kvgate top needs rich: pip install 'kvgate[top]'", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_main(args))
    except KeyboardInterrupt:
        return 0


async def fetch(session: aiohttp.ClientSession, url: str, key: str | None) -> Snapshot:
    from kvgate.tools.topview import Snapshot

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    timeout = aiohttp.ClientTimeout(total=5)
    async with session.get(f"{url}/admin/replicas", headers=headers, timeout=timeout) as r:
        r.raise_for_status()
        replicas = orjson.loads(await r.read())
    async with session.get(f"{url}/metrics", headers=headers, timeout=timeout) as r:
        r.raise_for_status()
        metrics = await r.text()
    return Snapshot.parse(url, replicas, metrics, time.monotonic())


async def _main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    from kvgate.tools.topview import frame

    url = args.url.rstrip("/")
    key = args.admin_key or None
    # Colour and cursor movement only when stdout is a terminal; piped, a frame is plain text
    # as wide as it needs (truncated replica names would break scripts), unless $COLUMNS says.
    piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    console = Console(width=200 if piped else None)
    async with aiohttp.ClientSession() as session:
        if args.once:
            try:
                snap = await fetch(session, url, key)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                print(f"kvgate top: cannot read {url}: {exc or type(exc).__name__}",
                      file=sys.stderr)
                return 1
            console.print(frame(snap))
            return 0
        before: Snapshot | None = None
        with Live(Text(f"connecting to {url} ..."), console=console, auto_refresh=False,
                  screen=False) as live:
            while True:
                try:
                    snap = await fetch(session, url, key)
                    live.update(frame(snap, before), refresh=True)
                    before = snap
                except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                    live.update(Text(f"cannot read {url}: {exc or type(exc).__name__}; "
                                     "retrying", style="red"), refresh=True)
                await asyncio.sleep(args.interval)
