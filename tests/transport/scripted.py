"""A Transport that answers from a script, per replica: the seam the transport decorators and
the attempts stage are tested through (a real implementation of the protocol, no kvgate part
replaced)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import aiohttp
import orjson

from kvgate.config import ReplicaConfig
from kvgate.errors import KvgateError, ServerError
from kvgate.fleet.replicas import Replica
from kvgate.sim.admission import MESSAGES
from kvgate.transport.base import UpstreamRequest, UpstreamResponse

OK = orjson.dumps({"choices": [{"message": {"content": "hi"}}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
FAILED = orjson.dumps({"error": {"message": "engine died", "type": "InternalServerError"}})
BUSY = orjson.dumps({"error": {"message": MESSAGES["max_num_queued_reqs"],
                               "type": "Service Unavailable", "param": None, "code": 503}})


@dataclass
class Answer:
    status: int
    chunks: list[bytes] = field(default_factory=list)
    breaks: bool = False  # the body breaks after its chunks


def replica(name: str) -> Replica:
    return Replica(ReplicaConfig(url=f"http://{name}:8000", name=name), "default")


class ScriptedTransport:
    """Answers each replica's request with its `Answer`, or raises its error as a replica that
    could not be reached would. Records where it sent and how often a response was closed."""

    def __init__(self, script: dict[str, Answer | KvgateError]) -> None:
        self.script = script
        self.sent: list[str] = []
        self.closed = 0

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        self.sent.append(request.replica.id)
        attempt = request.attempt
        attempt.sent_at = time.monotonic()
        answer = self.script[request.replica.id]
        if isinstance(answer, ServerError):  # recorded as the transport records its failures
            raise attempt.fail(answer)
        if isinstance(answer, KvgateError):
            raise answer
        attempt.status = answer.status
        chunks = list(answer.chunks)

        async def readany() -> bytes:
            if chunks:
                return chunks.pop(0)
            if answer.breaks:
                raise aiohttp.ClientPayloadError("connection reset mid-body")
            return b""

        async def read() -> bytes:
            if answer.breaks:
                raise aiohttp.ClientPayloadError("connection reset mid-body")
            return b"".join(chunks)

        async def aclose() -> None:
            self.closed += 1

        return UpstreamResponse(
            request, answer.status, time.monotonic() + 30, read, readany, aclose
        )
