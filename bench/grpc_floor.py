"""The floor of an endpoint picker in Python: Envoy's ext_proc stream served by grpc.aio, as
kvgate's picker serves it (TLS with a self-signed certificate, the reader task and queue of
`kvgate.epp.stream.EnvoyStream`), with no policy at all. Every message gets the smallest
answer that lets it go on; the request body's answer picks the one replica (the header and
`envoy.lb` metadata). What kvgate's picker costs above this is its policy; what this costs is
grpc.aio's, and no change inside kvgate's request path can take it away.

    python bench/grpc_floor.py --port PORT --replica HOST:PORT [--plaintext]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

from kvgate.epp.stream import (
    DESTINATION,
    LB_NAMESPACE,
    EnvoyStream,
    body_reply,
    unchanged,
)
from kvgate.epp.tls import self_signed


class Floor(external_processor_pb2_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, replica: str) -> None:
        self.replica = replica

    async def Process(
        self, requests: AsyncIterator[ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> None:
        stream = EnvoyStream(context)
        try:
            while (message := await stream.next()) is not None:
                if message.WhichOneof("request") == "request_body":
                    await stream.answer(body_reply(
                        "request_body", None, set_headers={DESTINATION: self.replica},
                        metadata={LB_NAMESPACE: {DESTINATION: self.replica}},
                    ))
                else:
                    await stream.answer(unchanged(message))
        finally:
            await stream.close()


async def serve(port: int, replica: str, tls: bool) -> None:
    server = grpc.aio.server()
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(Floor(replica), server)
    listen = f"127.0.0.1:{port}"
    if tls:
        server.add_secure_port(listen, self_signed("127.0.0.1").server_credentials())
    else:
        server.add_insecure_port(listen)
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--replica", required=True, help="host:port of the one replica")
    parser.add_argument("--plaintext", action="store_true")
    args = parser.parse_args()
    with contextlib.suppress(ImportError):  # the event loop kvgate serve runs on
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(serve(args.port, args.replica, not args.plaintext))


if __name__ == "__main__":
    main()
