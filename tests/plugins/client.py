"""A client's POST, one way for the whole suite: the answer read whole, as a `Reply`.

    status, headers, raw = await post(f"{gw.url}/v1/chat/completions", chat())
    reply = await post(url, body, http=session, headers={"X-Tenant-Id": "team-a"})
    assert reply.status == 200, reply          # the repr shows the body's start
    reply.json()["choices"]

A body that is bytes goes as given (aiohttp's `data`: no Content-Type of JSON unless a header
says so), so a test can send what no encoder makes; anything else is encoded as JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import aiohttp
import orjson
from multidict import CIMultiDictProxy


class Reply(NamedTuple):
    """An answer, read to its end: unpacks as (status, headers, body). `headers` are
    case-insensitive."""

    status: int
    headers: CIMultiDictProxy[str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)

    def __repr__(self) -> str:
        return f"Reply({self.status}, {self.body[:300]!r})"


async def post(
    url: str, body: Any, *, http: aiohttp.ClientSession | None = None,
    headers: Mapping[str, str] | None = None, timeout_s: float | None = None,
) -> Reply:
    """POST `body` to `url` on `http` (else on a session of its own) and read the answer
    whole; `timeout_s` bounds the request, else the session's timeout does."""
    if http is None:
        async with aiohttp.ClientSession() as own:
            return await post(url, body, http=own, headers=headers, timeout_s=timeout_s)
    options: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
    if timeout_s is not None:  # else the session's (aiohttp reads None as no timeout at all)
        options["timeout"] = aiohttp.ClientTimeout(total=timeout_s)
    async with http.post(url, headers=headers, **options) as response:
        return Reply(response.status, response.headers, await response.read())
