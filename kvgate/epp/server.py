"""The gRPC listener Envoy calls: the external processor and gRPC health.

Health answers for the whole server (""), for `envoy.service.ext_proc.v3.ExternalProcessor`
and for `kvgate.readiness`: SERVING once the first discovery round is over (the same moment
the HTTP listener starts serving), NOT_SERVING from the start of shutdown, so that Envoy's
health checks move on before the listener goes.
"""

from __future__ import annotations

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kvgate.config import EppConfig
from kvgate.epp.processor import Processor
from kvgate.gateway import Gateway

PROCESSOR = "envoy.service.ext_proc.v3.ExternalProcessor"
READINESS = "kvgate.readiness"
SERVICES = ("", PROCESSOR, READINESS)


class EppServer:
    def __init__(self, gateway: Gateway, config: EppConfig) -> None:
        self.server = grpc.aio.server(options=[
            ("grpc.so_reuseport", 0),  # a port in use is an error, not a second listener
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ])
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
            Processor(gateway), self.server
        )
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"{config.host}:{config.port or 0}")
        self.address = f"{config.host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        await self.serving(True)

    async def serving(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else (
            health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in SERVICES:
            await self.health.set(service, status)

    async def stop(self, grace_s: float) -> None:
        """NOT_SERVING, then the streams under way get `grace_s` to finish."""
        await self.serving(False)
        await self.server.stop(grace_s)
