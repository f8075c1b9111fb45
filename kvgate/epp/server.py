"""The gRPC listener Envoy calls: the external processor and gRPC health.

Health follows the endpoint picker protocol's names and meaning: `liveness` is SERVING while
the picker runs; `readiness`, the processor's own service
(`envoy.service.ext_proc.v3.ExternalProcessor`) and the whole server ("") are SERVING while
kvgate can pick — what /ready says (every configured model has a healthy replica), followed
once a second — so a gateway's health check sends no request to a picker that would refuse
it. Every service is NOT_SERVING from the start of shutdown, so that checks move on before
the listener goes. The port serves TLS by default (`kvgate.epp.tls`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kvgate.config import EppConfig
from kvgate.epp.processor import Processor
from kvgate.epp.tls import Certificate
from kvgate.gateway import Gateway

PROCESSOR = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS, READINESS = "liveness", "readiness"
READY_SERVICES = ("", PROCESSOR, READINESS)  # SERVING while kvgate can pick
SERVICES = (LIVENESS, *READY_SERVICES)
READINESS_EVERY_S = 1.0


class EppServer:
    def __init__(
        self, gateway: Gateway, config: EppConfig, tls: Certificate | None = None
    ) -> None:
        """`tls`: the certificate it serves TLS with (None: plaintext)."""
        self.gateway = gateway
        self.watch: asyncio.Task[None] | None = None
        self.server = grpc.aio.server(options=[
            ("grpc.so_reuseport", 0),  # a port in use is an error, not a second listener
            # a request body in one message, with its headers around it
            ("grpc.max_receive_message_length", gateway.runtime.config.server.max_body_bytes
             + (1 << 20)),
        ])
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
            Processor(gateway), self.server
        )
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        listen = f"{config.host}:{config.port or 0}"
        self.certificate = tls  # for the clients that check it
        if tls is None:
            self.port = self.server.add_insecure_port(listen)
        else:
            self.port = self.server.add_secure_port(listen, tls.server_credentials())
        self.address = f"{config.host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        await self.health.set(LIVENESS, _status(True))
        await self.set_ready(self.ready())
        self.watch = asyncio.create_task(self.follow_readiness())

    async def set_ready(self, ready: bool) -> None:
        for service in READY_SERVICES:
            await self.health.set(service, _status(ready))

    def ready(self) -> bool:
        config = self.gateway.runtime.config
        return bool(self.gateway.registry.readiness(m.name for m in config.models)["ready"])

    async def follow_readiness(self) -> None:
        was = self.ready()
        while True:
            await asyncio.sleep(READINESS_EVERY_S)
            now = self.ready()
            if now != was:
                await self.set_ready(now)
                was = now

    async def stop(self, grace_s: float) -> None:
        """NOT_SERVING, then the streams under way get `grace_s` to finish."""
        if self.watch is not None:
            self.watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.watch
        await self.health.enter_graceful_shutdown()  # every service NOT_SERVING
        await self.server.stop(grace_s)
        # grpc.aio shuts its machinery down (joining its poller thread) when its last server
        # goes, and that server sits in reference cycles: collected later, the shutdown would
        # run on whatever loop then runs (another app's, in one test process) and fail. Now,
        # on this loop, while it still runs.
        del self.server
        gc.collect()


def _status(ok: bool) -> int:
    return int(
        health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
    )
