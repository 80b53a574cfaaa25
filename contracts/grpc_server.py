"""Server plumbing shared by the worker and the router: assembling a `chariot.v1.Generation` gRPC
server with health and reflection, binding, health updates, a bounded stop, ending a call with the status
`error_status()` gives an exception (the one error mapping, docs/architecture.md §4), and stopping on signals."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from chariot.contracts.errors import AdmissionRejected, ConfigError, NoReplicaAvailable, error_status
from chariot.proto.chariot.v1 import generation_pb2

log = logging.getLogger(__name__)

SERVICE_NAME: str = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


UNDECODABLE_LOG_INTERVAL_S = 10.0
STOP_MARGIN_S = 5.0
"""How long past its grace `stop_server` waits for grpc's own shutdown to complete."""


@dataclass(frozen=True)
class Undecodable:
    """A request whose bytes are no valid message (say, invalid UTF-8 in a string field)."""

    reason: str


class OncePerInterval:
    """At most one log line per interval, saying how many were held back since the last one."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger = log) -> None:
        self.interval_s, self.clock, self.logger = interval_s, clock, logger
        self._last = -math.inf
        self.suppressed = 0

    def warn(self, message: str) -> bool:
        now = self.clock()
        if now - self._last < self.interval_s:
            self.suppressed += 1
            return False
        held, self.suppressed, self._last = self.suppressed, 0, now
        self.logger.warning("%s%s", message, f" ({held} more like it in the last {self.interval_s:g}s)" if held else "")
        return True


_undecodable_log = OncePerInterval(UNDECODABLE_LOG_INTERVAL_S)


def tolerant_decoder(message_cls: Any) -> Callable[[bytes], Any]:
    """`message_cls.FromString` that turns junk into an `Undecodable` instead of raising (grpc would
    answer UNKNOWN and log a traceback per call)."""

    def decode(data: bytes) -> Any:
        try:
            return message_cls.FromString(data)
        except (DecodeError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
            return Undecodable(str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)

    return decode


async def _reject_undecodable(context: grpc.aio.ServicerContext, method: str, request: Undecodable) -> NoReturn:
    _undecodable_log.warn(f"{method}: undecodable request from {context.peer()}: {request.reason}")
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: cannot be decoded as a {method} request "
                                                          f"({request.reason})")
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


def _guard_stream(method: str, call: Callable[[Any, Any], AsyncIterator[Any]]) -> Callable[[Any, Any], Any]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            await _reject_undecodable(context, method, request)
        async for item in call(request, context):
            yield item

    return handler


def _guard_unary(method: str, call: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await _reject_undecodable(context, method, request)
        return await call(request, context)

    return handler


def _serialize_response(response: Any) -> bytes:
    """A `GenerateResponse`, or one already serialized (a router relaying a worker's bytes unchanged)."""
    return response if isinstance(response, bytes) else bytes(response.SerializeToString())


def add_generation_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """Register `servicer` as chariot.v1.Generation (as the generated helper does), decoding requests
    so that undecodable bytes get INVALID_ARGUMENT and one rate-limited log line."""
    pb = generation_pb2
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            _guard_stream("Generate", servicer.Generate), request_deserializer=tolerant_decoder(pb.GenerateRequest),
            response_serializer=_serialize_response),
        "Stats": grpc.unary_unary_rpc_method_handler(
            _guard_unary("Stats", servicer.Stats), request_deserializer=tolerant_decoder(pb.StatsRequest),
            response_serializer=pb.StatsResponse.SerializeToString),
    }  # fmt: skip
    if hasattr(servicer, "KvEvents"):  # the worker's prefix-cache events (fakes may lack them)
        handlers["KvEvents"] = grpc.unary_stream_rpc_method_handler(
            _guard_stream("KvEvents", servicer.KvEvents), request_deserializer=tolerant_decoder(pb.KvEventsRequest),
            response_serializer=pb.KvEventsResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def generation_server(servicer: Any) -> tuple[grpc.aio.Server, Any]:
    """A grpc.aio server with `servicer` as Generation, plus health and reflection; not yet bound."""
    # so_reuseport=0: a second server on the same port must fail to bind, not silently share it.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    add_generation_servicer(servicer, server)
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


async def stop_server(server: grpc.aio.Server, grace_s: float) -> None:
    """`server.stop(grace_s)`, bounded by `STOP_MARGIN_S` past the grace: grpc's asyncio server can go on
    waiting for a call the grace has already cancelled (its shutdown then never completes), and a
    process's exit must not wait with it."""
    try:
        await asyncio.wait_for(server.stop(grace_s), grace_s + STOP_MARGIN_S)
    except asyncio.TimeoutError:
        log.warning("the gRPC server had not stopped %.0f s after its %.0f s grace; leaving it", STOP_MARGIN_S,
                    grace_s)


async def set_health(health_servicer: Any, status: int) -> None:
    """Set the overall ("") and the Generation service's health status."""
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, status)


def retry_metadata(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """Trailing metadata with the retry hint of a shed request, or of an unavailable one that has a
    hint (empty for other errors)."""
    hint = exc.retry_after_s if isinstance(exc, AdmissionRejected | NoReplicaAvailable) else None
    if hint is None:
        return ()
    seconds = max(0.0, hint)
    return (("retry-after", str(max(1, math.ceil(seconds)))), ("retry-after-ms", str(math.ceil(seconds * 1000))))


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException, request_id: str = "") -> NoReturn:
    """End the call with the status `error_status()` gives `exc` (plus the retry hint when shed); an
    INTERNAL one logs its traceback with the request id, since the client only sees the message."""
    code, _ = error_status(exc)
    if code == "INTERNAL":
        log.error("request %s: internal error", request_id or "-", exc_info=exc)
    await context.abort(grpc.StatusCode[code], str(exc), trailing_metadata=retry_metadata(exc))
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises
