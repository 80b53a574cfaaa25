"""The worker's gRPC server: `chariot.v1.Generation` (Generate, Stats, KvEvents), gRPC health and
reflection.

Why a module of its own: this is the only place where the engine meets the network. It turns wire
requests into engine requests (`wire`), streams one `GenerateResponse` per engine output, maps every
error through the one `error_status()` table, aborts a request when its call is cancelled (so its KV
blocks are freed), and ties the process lifetime to the engine's: health goes SERVING once the model
is loaded and NOT_SERVING when the engine fails or the server shuts down, and `serve` returns a
non-zero exit code when the engine died so the pod (and its pipeline group) is restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from chariot.contracts.engine_client import EngineClient
from chariot.contracts.engine_settings import ENGINE_CORES
from chariot.contracts.grpc_server import abort_with, bind, generation_server, set_health, stop_on_signals, stop_server
from chariot.contracts.proto_codec import request_from_proto, response_from_output, stats_to_proto
from chariot.proto.chariot.v1 import generation_pb2 as pb
from chariot.proto.chariot.v1 import generation_pb2_grpc
from chariot.worker.async_engine import AsyncEngine
from chariot.worker.engine import Engine
from chariot.worker.engine_core import EngineCoreClient, StepObserver
from chariot.worker.kv_events import KVEventLog, KVSnapshot

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ENGINE_FAILED = 1
DEFAULT_GRACE_S = 5.0
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def engine_client(engine_core: str, factory: Callable[[], Engine],
                  observer: StepObserver | None = None) -> EngineClient:
    """The `EngineClient` for an `engine_core` setting: the loop in a child process, or on a thread here.

    With `"process"`, `factory` must be picklable (the child builds the engine; see `engine_core.py`).
    """
    if engine_core == "process":
        return EngineCoreClient(factory, observer=observer)
    if engine_core == "thread":
        return AsyncEngine(factory, observer=observer)
    raise ValueError(f"engine_core must be one of {ENGINE_CORES}, not {engine_core!r}")


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """`chariot.v1.Generation` backed by one `EngineClient`."""

    def __init__(self, engine: EngineClient, served_model: str) -> None:
        self._engine = engine
        self._model = served_model

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """Stream the request's outputs; a cancelled call aborts the request (its KV blocks are freed)."""
        request_id = ""
        try:
            prompt, params, request_id = request_from_proto(request, self._model)
            stream = self._engine.generate(prompt, params, request_id or None)
            async with contextlib.aclosing(stream):
                async for out in stream:
                    yield response_from_output(out)
        except Exception as exc:
            await abort_with(context, exc, request_id)

    async def Stats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """This replica's load report."""
        try:
            stats = await self._engine.stats()
            return stats_to_proto(stats, self._model, self._engine.max_model_len)
        except Exception as exc:
            await abort_with(context, exc)

    async def KvEvents(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """The prefix cache's changes (`kv_events.py`): a snapshot when the subscriber cannot continue from
        its `last_sequence`, then one message per batch, until the server stops."""
        events: KVEventLog | None = getattr(self._engine, "kv_events", None)
        if events is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is not ready")
            return
        boot, block_size = events.boot_id, events.block_size
        async for item in events.subscribe(request.last_sequence, request.boot_id):
            if isinstance(item, KVSnapshot):
                yield pb.KvEventsResponse(boot_id=boot, block_size=block_size, snapshot=True,
                                          sequence=item.sequence, stored=item.hashes)
            else:
                yield pb.KvEventsResponse(boot_id=boot, block_size=block_size, sequence=item.sequence,
                                          stored=item.stored, removed=item.removed)


# ---- server assembly --------------------------------------------------------------------------
def build_server(engine: EngineClient, served_model: str) -> tuple[grpc.aio.Server, Any]:
    """A grpc.aio server with Generation, health (initially NOT_SERVING) and reflection; not yet bound."""
    return generation_server(GenerationServicer(engine, served_model))


# ---- lifetime ---------------------------------------------------------------------------------
async def serve(
    engine_factory: Callable[[], Engine],
    host: str,
    port: int,
    served_model: str,
    ready: Callable[[int], None] | None = None,
    *,
    engine_core: str,
    stop: asyncio.Event | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    observer: StepObserver | None = None,
    on_ready: Callable[[], None] | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT (or `stop` is set): returns 0, or 1 if the engine failed.

    `engine_core` is the engine-core setting (declared, with its default, in
    `contracts/engine_settings.py`): the engine is built on its own thread (`"thread"`) or in a child
    process (`"process"`: `engine_factory` must then be picklable; see `engine_core.py`) while the server
    already answers health checks (NOT_SERVING until loaded). `ready(port)` is called once the
    server listens, with the bound port.
    A load failure (e.g. ModelLoadError, ConfigError) is re-raised. On shutdown, health goes
    NOT_SERVING, in-flight calls get `grace_s` seconds to finish, then remaining requests are aborted.
    """
    stop = stop or asyncio.Event()
    engine = engine_client(engine_core, engine_factory, observer)
    server, health_servicer = build_server(engine, served_model)
    try:
        await set_health(health_servicer, _NOT_SERVING)
        bound = bind(server, host, port)  # before loading the model: a taken port fails fast
        engine.start()
        await server.start()
        log.info("worker listening on %s:%d (model %s)", host, bound, served_model)
        if ready is not None:
            ready(bound)
        with stop_on_signals(stop):
            return await _run(engine, health_servicer, stop, on_ready)
    finally:
        await health_servicer.enter_graceful_shutdown()
        events: KVEventLog | None = getattr(engine, "kv_events", None)
        if events is not None:
            events.close()  # subscriptions never end on their own: do not hold the grace period
        await stop_server(server, grace_s)
        await engine.shutdown()


async def _run(
    engine: EngineClient, health_servicer: Any, stop: asyncio.Event, on_ready: Callable[[], None] | None
) -> int:
    """Wait for the model to load, serve until stopped or the engine dies; the exit code."""
    if not await _first_or_stop(engine.wait_ready(), stop):
        return EXIT_OK
    await set_health(health_servicer, _SERVING)
    log.info("engine ready; serving")
    if on_ready is not None:
        on_ready()
    if not await _first_or_stop(engine.wait_failed(), stop) and engine.failed is None:
        log.info("shutting down")
        return EXIT_OK
    log.error("engine failed (%s); exiting", engine.failed)
    return EXIT_ENGINE_FAILED


async def _first_or_stop(awaitable: Any, stop: asyncio.Event) -> bool:
    """Await `awaitable` unless `stop` is set first; True if it completed (its exception propagates)."""
    work = asyncio.ensure_future(awaitable)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((work, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, stopped):
            task.cancel()
    if work.done() and not work.cancelled():
        work.result()  # re-raise a failure
        return True
    return False


