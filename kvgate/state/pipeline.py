"""The Redis store's pipeline: every command made in one turn of the event loop goes to Redis
in one round trip, sent by a task of its own (so a caller's first step never enters a
timeout; see kvgate/protect.py). Each command is still its own script, atomic on its own; a
pipeline only saves round trips and syscalls. `round_trips` and `calls` count them.

A script (`Script`) is the Lua function files it uses from lua/lib/ followed by its own body,
run by SHA and loaded again when Redis answers NOSCRIPT (after a restart or SCRIPT FLUSH).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

from redis.asyncio import BlockingConnectionPool, Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError

from kvgate.state.base import StateStoreError

ScriptArg = str | int | float


class Script:
    """A Lua script from kvgate/state/lua, after the function files it `uses` from lua/lib/;
    run by SHA (EVALSHA), loaded again on NOSCRIPT."""

    def __init__(self, name: str, uses: Sequence[str] = ()) -> None:
        self.name = name
        lua = resources.files("kvgate.state").joinpath("lua")
        parts = [lua.joinpath(f"lib/{lib}.lua").read_text() for lib in uses]
        self.source = "".join([*parts, lua.joinpath(f"{name}.lua").read_text()])
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()


@dataclass(slots=True)
class Call:
    """One command waiting for the next pipeline."""

    command: tuple[ScriptArg, ...]
    what: str  # for errors: "lease.lua", "GET", ...
    future: asyncio.Future[object]
    script: Script | None = None  # loaded again if Redis answers NOSCRIPT


class Pipeline:
    """Commands queued in one turn of the loop, sent together on a pooled connection."""

    def __init__(self, pool: BlockingConnectionPool, redis: Redis) -> None:
        self._pool = pool
        self._redis = redis
        self._queue: list[Call] = []
        self._senders: set[asyncio.Task[None]] = set()
        self.round_trips = 0  # pipelines sent
        self.calls = 0  # commands in them

    async def close(self) -> None:
        """Wait for the pipelines in flight."""
        if self._senders:
            await asyncio.gather(*self._senders, return_exceptions=True)


    async def run(self, script: Script, keys: Sequence[str], args: Sequence[ScriptArg]) -> object:
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        return await self.call(command, f"{script.name}.lua", script)

    async def call(
        self, command: tuple[ScriptArg, ...], what: str, script: Script | None = None
    ) -> object:
        """Queue the command for this turn's pipeline and wait for its reply."""
        loop = asyncio.get_running_loop()
        call = Call(command, what, loop.create_future(), script)
        self._queue.append(call)
        if len(self._queue) == 1:
            loop.call_soon(self._flush)
        return await call.future

    def _flush(self) -> None:
        calls, self._queue = self._queue, []
        task = asyncio.get_running_loop().create_task(self._send(calls))
        self._senders.add(task)  # a reference until it ends
        task.add_done_callback(self._senders.discard)

    async def _send(self, calls: list[Call]) -> None:
        """One pipeline for `calls`; a script Redis does not know (NOSCRIPT: it restarted or
        was flushed) is loaded and its calls sent again — they did not run."""
        try:
            replies = await self._pipeline(calls)
            missing = {c.script for c, r in zip(calls, replies, strict=True)
                       if isinstance(r, NoScriptError) and c.script is not None}  # fmt: skip
            if missing:
                for script in missing:
                    await self._redis.script_load(script.source)
                again = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
                for i, reply in zip(again, await self._pipeline([calls[i] for i in again]),
                                    strict=True):  # fmt: skip
                    replies[i] = reply
        except (RedisError, OSError) as exc:
            for call in calls:
                _settle(call, StateStoreError(f"redis {call.what}: {type(exc).__name__}: {exc}"))
            return
        except BaseException as exc:  # cancelled (closing): nobody may wait forever
            for call in calls:
                _settle(call, StateStoreError(f"redis {call.what}: {type(exc).__name__}"))
            raise
        for call, reply in zip(calls, replies, strict=True):
            if isinstance(reply, Exception):
                reply = StateStoreError(f"redis {call.what}: {type(reply).__name__}: {reply}")
            _settle(call, reply)

    async def _pipeline(self, calls: list[Call]) -> list[object]:
        """One round trip: the commands written at once on a pooled connection, then their
        replies read in order, an error reply in its call's place. (redis-py's Pipeline does
        the same with more CPU per round trip.) A connection that breaks
        before any reply came is tried once more on a fresh one: the stale connection a Redis
        restart leaves, which the restarted server never ran anything on. Once a reply came,
        nothing is sent again: the other replies lost to a broken connection (or a timeout)
        may belong to scripts that ran, and a second `charge` or `settle` would count twice.
        (The one case left: a Redis that dies after running the scripts and before answering
        any — whose state, without persistence, died with it.)"""
        self.round_trips += 1
        self.calls += len(calls)
        for attempt in (1, 2):
            connection = await self._pool.get_connection()  # type: ignore[no-untyped-call]
            replies: list[object] = []
            try:
                await connection.send_packed_command(
                    connection.pack_commands([call.command for call in calls]),
                    check_health=False,
                )
                for _ in calls:
                    try:
                        replies.append(await connection.read_response())
                    except ResponseError as exc:
                        replies.append(exc)
                return replies
            except BaseException as exc:
                await connection.disconnect()  # half read: of no use to the next caller
                if replies or attempt == 2 or not isinstance(exc, RedisConnectionError):
                    raise
            finally:
                await self._pool.release(connection)
        raise AssertionError("unreachable")


def _settle(call: Call, reply: object) -> None:
    if call.future.done():  # its caller was cancelled: nobody reads it
        return
    if isinstance(reply, BaseException):
        call.future.set_exception(reply)
    else:
        call.future.set_result(reply)
