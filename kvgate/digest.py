"""The one hash kvgate keys things by: BLAKE2b over parts joined by NUL bytes.

Three identities are built with it, over different inputs on purpose:

- `normalize.fingerprint`: the model, the tools and the text of every leading system message;
  what vLLM renders first. Routing's prefix affinity and the system-prompt drift tracker.
- `PromptCount.prefix_key`: the first message (role, name, text) and the tools, whose tokens
  the counter knows; the ledger holds that many blocks once per replica.
- `routing.sessions.conversation_digest`: the first messages of a conversation, user turns
  included; a session, not a prefix.

A NUL cannot occur inside a part that is UTF-8 text of JSON or of a chat message's role or
name, so distinct part lists give distinct inputs.
"""

from __future__ import annotations

import hashlib


def digest(*parts: str | bytes, size: int = 16) -> bytes:
    """`size` bytes of BLAKE2b over the parts, NUL between each two."""
    hashed = hashlib.blake2b(digest_size=size)
    for i, part in enumerate(parts):
        if i:
            hashed.update(b"\x00")
        hashed.update(part.encode() if isinstance(part, str) else part)
    return hashed.digest()
