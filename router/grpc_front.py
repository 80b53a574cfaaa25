"""The router's gRPC front: `chariot.v1.Generation` (the workers' own API), gRPC health and reflection.

Why the router speaks the workers' API: a client can talk to one worker or to a whole deployment
with the same stub, and the router relays each response unchanged: the bytes the worker sent are
the bytes the client gets (token ids, text delta, finish reason, the worker's timing). Parsing
reuses `proto_codec.request_from_proto`, so a bad request is rejected with the
very same field-naming INVALID_ARGUMENT as a worker would give; generation goes through the shared
`DataPlane`; every error becomes a status through `error_status()` and nothing else. A shed request
(RESOURCE_EXHAUSTED) carries its retry hint as trailing metadata: `retry-after` (whole seconds,
rounded up, like HTTP's header) and `retry-after-ms`, besides the message.

API keys (`chariot.router.auth`): when the router has a key file, Generate and Stats need
`authorization: Bearer <key>` metadata (UNAUTHENTICATED otherwise; health and reflection stay open),
and the key's tenant replaces the request's `tenant` field, which becomes an end-user label.
TLS: `bind_grpc` with `credentials` (`chariot.router.tls`) serves a secure port instead.

Health: the overall ("") and `chariot.v1.Generation` statuses are SERVING while at least one replica
is ready and NOT_SERVING otherwise (`HealthReporter` re-evaluates them every `interval_s`).
Cancelling a Generate call cancels the worker call, which aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from chariot.contracts.errors import ConfigError
from chariot.contracts.grpc_server import abort_with, bind, generation_server, host_port, set_health
from chariot.contracts.proto_codec import request_from_proto
from chariot.contracts.requests import new_request_id
from chariot.proto.chariot.v1 import generation_pb2_grpc as pb_grpc
from chariot.router.auth import Principal
from chariot.router.dataplane import DataPlane, GenerateInput

log = logging.getLogger(__name__)

TRACE_KEYS = ("traceparent", "tracestate")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def trace_parent(metadata: Any) -> Mapping[str, str] | None:
    """The caller's W3C trace context from the call's metadata, if any."""
    found = {key: value for key, value in (metadata or ()) if key in TRACE_KEYS and isinstance(value, str)}
    return found or None


class RouterGenerationServicer(pb_grpc.GenerationServicer):
    """`chariot.v1.Generation` on the router: every call goes through the shared `DataPlane`."""

    def __init__(self, dataplane: DataPlane) -> None:
        self._dp = dataplane

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """Stream the completion from a replica chosen by admission control."""
        metadata = context.invocation_metadata()
        try:
            principal = self._authenticate(metadata)
            prompt, params, request_id = request_from_proto(request, self._dp.served_model)
        except Exception as exc:
            self._dp.reject(exc)
            await abort_with(context, exc)
        request_id = request_id or new_request_id()
        tenant, end_user = (principal.tenant, request.tenant) if principal is not None else (request.tenant, "")
        req = GenerateInput(prompt, params, request_id, tenant, request.model, trace_parent(metadata),
                            _session(metadata), principal=principal, end_user=end_user)
        try:
            async with contextlib.aclosing(self._dp.generate(req)) as stream:
                async for out in stream:
                    yield out.wire  # the worker's GenerateResponse, as it sent it
        except Exception as exc:
            await abort_with(context, exc, request_id)

    async def Stats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """The deployment's load: the ready replicas' latest reports, aggregated."""
        try:
            self._authenticate(context.invocation_metadata())
        except Exception as exc:
            self._dp.reject(exc)
            await abort_with(context, exc)
        return self._dp.stats()

    def _authenticate(self, metadata: Any) -> Principal | None:
        """The call's `Principal` (None without API keys); `AuthenticationError` for a missing/unknown key."""
        if self._dp.keys is None:
            return None
        return self._dp.keys.authenticate(_metadata_value(metadata, "authorization"))


class HealthReporter:
    """Keeps the gRPC health statuses in step with `DataPlane.health()`."""

    def __init__(self, servicer: Any, dataplane: DataPlane, interval_s: float = 0.5) -> None:
        self._servicer = servicer
        self._dp = dataplane
        self._interval_s = interval_s
        self._status: int | None = None

    async def update(self) -> None:
        status = SERVING if self._dp.health().serving else NOT_SERVING
        if status != self._status:
            self._status = status
            await set_health(self._servicer, status)

    async def run(self) -> None:
        while True:
            await self.update()
            await asyncio.sleep(self._interval_s)


def build_grpc_server(dataplane: DataPlane) -> tuple[grpc.aio.Server, Any]:
    """A grpc.aio server with the router's Generation, health and reflection; not yet bound or started."""
    return generation_server(RouterGenerationServicer(dataplane))


def bind_grpc(server: grpc.aio.Server, host: str, port: int,
              credentials: grpc.ServerCredentials | None = None) -> int:
    """Bind a port (TLS with `credentials`, else insecure); returns the actual port (useful with port 0)."""
    if credentials is None:
        return bind(server, host, port, field="grpc_port")
    address = host_port(host, port)
    try:
        bound = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise ConfigError("grpc_port", f"cannot listen on {address}: {exc}") from exc
    if bound == 0:
        raise ConfigError("grpc_port", f"cannot listen on {address}")
    return bound


def _metadata_value(metadata: Any, key: str) -> str | None:
    """The first text value of `key` in a call's metadata."""
    for name, value in metadata or ():
        if name == key and isinstance(value, str):
            return value
    return None


def _session(metadata: Any) -> str:
    """The `x-session-id` metadata (a session-affinity hint for routing), cut to 256 characters."""
    for key, value in metadata or ():
        if key == "x-session-id" and isinstance(value, str):
            return value[:256]
    return ""
