"""Clients that behave as real ones do at the edges: hanging up the moment they have enough."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson


async def hang_up_at_done(url: str, body: dict[str, Any]) -> bool:
    """Stream a completion over a raw socket and abort the connection the moment `[DONE]`
    arrives, before kvgate has finished the response (as many clients do)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = orjson.dumps(body)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvgate\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
    )
    seen = b""
    try:
        while b"[DONE]" not in seen:
            chunk = await reader.read(65536)
            if not chunk:
                return False
            seen += chunk
        assert seen.startswith(b"HTTP/1.1 200"), seen[:200]
        return True
    finally:
        writer.transport.abort()
