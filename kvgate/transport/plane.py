"""The data plane one request is served through: the one place proxy mode and Envoy's
external-processing mode differ.

    proxy   kvgate reads the client's request, sends it to the replica over HTTP
            (`HttpTransport`) and relays the answer (`relay`)
    epp     Envoy holds both connections: kvgate's pick goes to Envoy, the answer's chunks come
            through kvgate on their way to the client (`kvgate.epp`)

Every policy stage (parse, identify, normalize, count, bound, charge, route, admit, settle)
is the same code in both; the gateway takes a `Plane` per request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvgate.transport.base import Transport, UpstreamResponse

T = TypeVar("T")

# How the request path hands an answer to its client: (answer, kvgate's response headers,
# whether the client asked for usage) -> what the data plane returns for the request.
Deliver = Callable[[UpstreamResponse, Mapping[str, str], bool], Awaitable[T]]


@dataclass(frozen=True, slots=True)
class Plane(Generic[T]):
    transport: Transport  # sends one attempt to its replica
    deliver: Deliver[T]
    # whether a failed or refused attempt may be sent again, elsewhere: in proxy mode kvgate
    # holds the request; behind Envoy it went with the pick
    retries: bool = True
    # the replicas (host:port) the data plane allows for this request; None: any
    subset: frozenset[str] | None = None
    # the answer's body passes through kvgate: a stream's usage is asked for (and stripped
    # where the client did not ask), its tokens counted; else (Envoy in headers mode) the
    # replica's decode clock tells what it produced
    sees_body: bool = True
