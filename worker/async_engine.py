"""The `EngineClient` whose engine loop runs on a thread of the serving process.

Why a module of its own: the gRPC server (and anything else on an event loop) must never block on a
forward pass, and the engine must only ever be touched by one thread. So every engine call —
construction, adding and aborting requests, stepping — runs on the engine thread, through the same
`EngineCore` the engine-core process runs (`engine_core.py`). Callers post commands to a queue; the
thread blocks on that queue when there is nothing to do (no busy spin; it wakes every
`HEALTH_POLL_S` to let the engine check its pipeline stages) and, while requests are live,
alternates draining all queued commands with one `EngineCore.step()`, whose deltas go to each
request's `asyncio.Queue` in one hand-over per event loop. The Stats snapshot is refreshed after
every step and command batch, so Stats is answered at once even while a long iteration runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Any, TypeVar

from chariot.contracts.errors import EngineDeadError
from chariot.contracts.outputs import EngineStats, RequestOutput
from chariot.contracts.requests import Prompt
from chariot.contracts.sampling_params import SamplingParams
from chariot.worker.engine import Engine
from chariot.worker.engine_core import (
    HEALTH_POLL_S,
    EngineCore,
    Item,
    StepObserver,
    Stream,
    deliver_threadsafe,
    stream_items,
)
from chariot.worker.kv_events import KVEventLog

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclasses.dataclass
class _Command:
    fn: Callable[[], Any]
    future: concurrent.futures.Future[Any] | None  # None: fire and forget


class AsyncEngine:
    """Owns one Engine and runs it on a dedicated thread; see `EngineClient` for the API."""

    def __init__(self, engine_factory: Callable[[], Engine], name: str = "chariot-engine",
                 observer: StepObserver | None = None) -> None:
        self._factory = engine_factory
        self._name = name
        self._observer = observer  # called on the engine thread after every step
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _closed against a concurrent final drain
        self._closed = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._core: EngineCore | None = None  # engine thread only, after loading
        self._streams: dict[str, Stream] = {}  # engine thread only
        self._snapshot: EngineStats | None = None
        self._max_model_len = 0
        self.kv_events: KVEventLog | None = None  # once ready: the KvEvents RPC's source
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._failed: str | None = None
        self._dead: concurrent.futures.Future[str] = concurrent.futures.Future()

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    async def wait_ready(self) -> None:
        await asyncio.shield(asyncio.wrap_future(self._ready))

    @property
    def ready(self) -> bool:
        return self._ready.done() and self._ready.exception() is None

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def failed(self) -> str | None:
        return self._failed

    async def wait_failed(self) -> str:
        return await asyncio.shield(asyncio.wrap_future(self._dead))

    async def shutdown(self) -> None:
        self._stopping = True
        self._post(_Command(lambda: None, None), strict=False)  # wake the thread up
        if self._thread is None:
            self._close()
        else:
            await asyncio.to_thread(self._thread.join)

    # ---- requests ----------------------------------------------------------------------------
    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        rid = request_id or uuid.uuid4().hex
        stream = Stream(asyncio.get_running_loop())
        finished = False
        try:
            await self._call(lambda: self._add(prompt, params, rid, stream))
            async for out in stream_items(stream):
                finished = out.finished
                yield out
        finally:
            if not finished:  # consumer left early (or cancelled mid-add): free the request if it is ours
                self._post(_Command(lambda: self._abort_if_mine(rid, stream), None), strict=False)

    async def abort(self, request_id: str) -> RequestOutput | None:
        return await self._call(lambda: self._abort_now(request_id))

    async def stats(self) -> EngineStats:
        snapshot = self._snapshot
        return snapshot if snapshot is not None else await self._call(lambda: self.core.stats())

    # ---- command plumbing (any thread) -------------------------------------------------------
    async def _call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread and await its result (or exception)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._post(_Command(fn, future))
        return await asyncio.wrap_future(future)

    def _post(self, cmd: _Command, strict: bool = True) -> bool:
        """Queue `cmd`; False (or EngineDeadError, if `strict`) once the engine is closed."""
        with self._lock:
            if not self._closed:
                self._commands.put(cmd)
                return True
        if strict:
            raise EngineDeadError(self._failed or "engine is shut down")
        return False

    # ---- the engine thread -------------------------------------------------------------------
    @property
    def core(self) -> EngineCore:
        if self._core is None:
            raise EngineDeadError("engine is not loaded")
        return self._core

    def _run(self) -> None:
        try:
            core = self._load()
            if core is not None:
                try:
                    self._loop(core)
                finally:
                    self._deliver(core.abort_all())
                    self._fail_all(EngineDeadError("engine is shut down"))
                    core.shutdown()
        finally:
            self._close()

    def _load(self) -> EngineCore | None:
        try:
            self._core = EngineCore(self._factory())
            self._max_model_len = self._core.engine.max_model_len
            self._snapshot = self._core.stats()
            self.kv_events = KVEventLog(self._core.kv_block_size)
        except BaseException as exc:
            self._ready.set_exception(exc)
            self._die(f"engine failed to load: {exc}")
            return None
        self._ready.set_result(None)
        return self._core

    def _loop(self, core: EngineCore) -> None:
        last_health = time.monotonic()
        while not self._stopping:
            ran = self._drain(timeout=0.0 if core.has_unfinished else HEALTH_POLL_S)
            if self._stopping:
                return
            try:
                if core.has_unfinished:
                    self._step(core)
                elif not ran or time.monotonic() - last_health >= HEALTH_POLL_S:
                    last_health = time.monotonic()
                    self._deliver(core.check_health())
            except Exception as exc:
                self._crash(exc)
                return
            if core.failed and self._failed is None:
                self._die(str(core.failed))

    def _step(self, core: EngineCore) -> None:
        result, outputs = core.step()
        self._snapshot = core.stats()
        if self.kv_events is not None:
            self.kv_events.append(*core.take_kv_events())
        if self._observer is not None:
            self._observer(result, outputs)
        self._deliver(outputs)

    def _crash(self, exc: Exception) -> None:
        """An unexpected exception escaped the engine: its state is unknown, so it is dead."""
        log.exception("engine loop crashed")
        reason = f"engine loop crashed: {exc!r}"
        self._die(reason)  # first: whoever sees a stream end with the error finds the engine already failed
        self._fail_all(EngineDeadError(reason))

    def _drain(self, timeout: float) -> bool:
        """Run queued commands, waiting up to `timeout` s for the first; True if any ran."""
        try:
            cmd = self._commands.get(timeout=timeout) if timeout > 0 else self._commands.get_nowait()
        except queue.Empty:
            return False
        while True:
            _execute(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                if self._core is not None:
                    self._snapshot = self._core.stats()
                return True

    def _deliver(self, outputs: Iterable[RequestOutput]) -> None:
        items: list[tuple[Stream, Item]] = []
        for out in outputs:
            stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                items.append((stream, out))
        deliver_threadsafe(items)

    def _add(self, prompt: Prompt, params: SamplingParams, request_id: str, stream: Stream) -> None:
        if self._failed is not None:
            raise EngineDeadError(self._failed)
        self.core.add(prompt, params, request_id)
        self._streams[request_id] = stream

    def _abort_if_mine(self, request_id: str, stream: Stream) -> None:
        """Abort `request_id` only if `stream` registered it (an id reused by another caller is left alone)."""
        if self._streams.get(request_id) is stream:
            self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> RequestOutput | None:
        out = self.core.abort(request_id)
        if out is not None:
            self._deliver([out])
        return out

    def _fail_all(self, exc: BaseException) -> None:
        deliver_threadsafe([(stream, exc) for stream in self._streams.values()])
        self._streams.clear()

    def _die(self, reason: str) -> None:
        log.error("engine failed: %s", reason)
        self._failed = reason
        if not self._dead.done():
            self._dead.set_result(reason)

    def _close(self) -> None:
        """Refuse new commands and fail those still queued, so no caller waits forever."""
        with self._lock:
            self._closed = True
        dead = EngineDeadError(self._failed or "engine is shut down")
        self._fail_all(dead)
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd.future is not None:
                cmd.future.set_exception(dead)


def _execute(cmd: _Command) -> None:
    if cmd.future is not None and not cmd.future.set_running_or_notify_cancel():
        return  # the caller gave up before the command ran: do not run it
    try:
        result = cmd.fn()
    except Exception as exc:
        if cmd.future is not None:
            cmd.future.set_exception(exc)
        else:
            log.warning("engine command failed: %r", exc)
    else:
        if cmd.future is not None:
            cmd.future.set_result(result)
