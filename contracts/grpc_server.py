"""Server plumbing shared by the worker and the router: assembling a `chariot.v1.Generation` gRPC
server with health and reflection, binding, health updates, ending a call with the status
`error_status()` gives an exception (the one error mapping, DESIGN.md §4), and stopping on signals."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from chariot.contracts.errors import AdmissionRejected, ConfigError, error_status
from chariot.proto.chariot.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME: str = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def generation_server(servicer: Any) -> tuple[grpc.aio.Server, Any]:
    """A grpc.aio server with `servicer` as Generation, plus health and reflection; not yet bound."""
    # so_reuseport=0: a second server on the same port must fail to bind, not silently share it.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return server, health_servicer


def host_port(host: str, port: int) -> str:
    """`host:port`, with IPv6 hosts bracketed."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


@contextlib.contextmanager
def stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    """SIGTERM/SIGINT set `stop` (only possible on the main thread; elsewhere `stop` is the only way)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        yield
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def bind(server: grpc.aio.Server, host: str, port: int, field: str = "port") -> int:
    """Bind an insecure port; returns the actual port (useful with port 0). `field` names the flag."""
    address = host_port(host, port)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise ConfigError(field, f"cannot listen on {address}: {exc}") from exc
    if bound == 0:
        raise ConfigError(field, f"cannot listen on {address}")
    return bound


async def set_health(health_servicer: Any, status: int) -> None:
    """Set the overall ("") and the Generation service's health status."""
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, status)


def retry_metadata(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """Trailing metadata with the retry hint of a shed request (empty for other errors)."""
    if not isinstance(exc, AdmissionRejected):
        return ()
    seconds = max(0.0, exc.retry_after_s)
    return (("retry-after", str(max(1, math.ceil(seconds)))), ("retry-after-ms", str(math.ceil(seconds * 1000))))


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    """End the call with the status `error_status()` gives `exc` (plus the retry hint when shed)."""
    code, _ = error_status(exc)
    if code == "INTERNAL":
        log.error("internal error serving a call", exc_info=exc)
    await context.abort(grpc.StatusCode[code], str(exc), trailing_metadata=retry_metadata(exc))
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises
