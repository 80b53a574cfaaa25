"""The engine loop in a process of its own, so it never competes with the gRPC front for the GIL.

Why a module of its own: in one process, the engine thread (scheduling, batch packing, the Python
side of every torch op, output processing) and the server's event loop (protobuf, HTTP/2, one
coroutine per stream) take turns on one GIL; under many streams the engine waits for the front on
every op dispatch and iterations stretch. `EngineCoreClient` has the `AsyncEngine` API the server
uses (`start`, `wait_ready`, `generate`, `abort`, `stats`, `wait_failed`, `shutdown`) but runs the
`AsyncEngine` — engine, output processor, step observer hook — in a child process (vLLM v1's
engine-core split). The front keeps one reader thread that turns the child's messages into the
requests' asyncio queues.

The wire between them is a `multiprocessing` pipe carrying the typed messages below (plain frozen
dataclasses, no method names). What crosses per step is O(1) per token: each request's token and
text delta; its prompt token ids cross once (first output), and of its `RequestTimes` only the token times that
are new (the front keeps a copy and appends them). The step observer runs in the front (so metrics
stay in the process that exports them) on the step's `StepResult` without its `outputs`.

Failure: the child exiting, a load error or an engine failure all make `failed` set and
`wait_failed()` resolve, exactly as for the threaded `AsyncEngine`; streams in flight end with
`EngineDeadError`. The child ignores SIGINT (the parent shuts it down) and exits when the pipe closes,
so it never outlives its front.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import signal
import threading
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from chariot.contracts.errors import EngineDeadError, InvalidRequestError
from chariot.contracts.outputs import EngineStats, RequestOutput, TokenLogprobs
from chariot.contracts.requests import FinishReason, Prompt, RequestTimes
from chariot.contracts.sampling_params import SamplingParams
from chariot.worker.async_engine import AsyncEngine, Channel, Sink, StepObserver
from chariot.worker.engine import Engine
from chariot.worker.engine_output import StepResult

log = logging.getLogger(__name__)

ENGINE_CORES = ("process", "thread")
START_TIMEOUT_S = 60.0  # the child must say hello (not load the model) within this
JOIN_TIMEOUT_S = 30.0


# ---- front → core ------------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    call_id: int
    request_id: str
    prompt: Prompt
    params: SamplingParams


@dataclass(frozen=True)
class AbortRequest:
    """`call_id` None: the consumer left early; abort only the request this front registered."""

    call_id: int | None
    request_id: str


@dataclass(frozen=True)
class ShutdownCore:
    pass


# ---- core → front ------------------------------------------------------------------------------
@dataclass(frozen=True)
class CoreReady:
    max_model_len: int
    stats: EngineStats


@dataclass(frozen=True)
class CoreFailed:
    """The engine died (`load_error` set when it never loaded)."""

    reason: str
    load_error: BaseException | None = None


@dataclass(frozen=True)
class Delta:
    """One `RequestOutput` minus what the front already has.

    `prompt_token_ids` only on a request's first delta; `times` is its `RequestTimes` with only the
    token times that are new since the previous delta (the front appends them to its copy).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_output_tokens: int
    finish_reason: FinishReason | None
    times: RequestTimes
    num_preemptions: int = 0
    error: str | None = None
    prompt_token_ids: list[int] | None = None
    new_logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class StepMessage:
    """Everything one hand-over of the core carries: deltas, stream failures, the step (if one ran)."""

    deltas: tuple[Delta, ...]
    failures: tuple[tuple[str, BaseException], ...] = ()
    step: StepResult | None = None  # without its outputs
    stats: EngineStats | None = None


@dataclass(frozen=True)
class Reply:
    call_id: int
    value: Any = None
    error: BaseException | None = None


# ---- the child ---------------------------------------------------------------------------------
class _PipeChannel(Channel):
    """The core's side of the pipe: one `StepMessage` per hand-over, sent under a lock."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.engine: AsyncEngine | None = None  # whose Stats snapshot goes with every step
        self._lock = threading.Lock()
        self._times_sent: dict[str, int] = {}  # engine thread only: token times already sent per request
        self._step: StepResult | None = None  # engine thread only: set by the observer hook
        self.sinks: dict[str, Sink] = {}  # live requests; set by the pipe reader, dropped when they end

    def observe(self, result: StepResult, outputs: Sequence[RequestOutput]) -> None:
        self._step = dataclasses.replace(result, outputs=())

    def send(self, batch: list[tuple[Sink, RequestOutput | BaseException]]) -> None:
        deltas, failures = [], []
        for sink, item in batch:
            if isinstance(item, BaseException):
                failures.append((sink.request_id, item))
                self._times_sent.pop(sink.request_id, None)
            else:
                deltas.append(self._delta(item))
            if isinstance(item, BaseException) or item.finished:
                self._forget(sink)
        step, self._step = self._step, None
        stats = None if self.engine is None else self.engine.snapshot
        self.put(StepMessage(tuple(deltas), tuple(failures), step, stats))

    def snapshot_changed(self, stats: EngineStats) -> None:
        """After commands ran (adds, aborts) with no step to carry the new load report."""
        self.put(StepMessage((), stats=stats))

    def _delta(self, out: RequestOutput) -> Delta:
        sent = self._times_sent.pop(out.request_id, None)
        t = out.times
        if not out.finished:
            self._times_sent[out.request_id] = len(t.token_times)
        times = RequestTimes(t.arrival, t.first_scheduled, t.first_token, t.token_times[sent or 0:], t.finished)
        return Delta(out.request_id, out.new_token_ids, out.new_text, out.num_output_tokens, out.finish_reason,
                     times, out.num_preemptions, out.error, out.prompt_token_ids if sent is None else None,
                     out.new_logprobs)

    def _forget(self, sink: Sink) -> None:
        if self.sinks.get(sink.request_id) is sink:  # dict ops are atomic; a reused id keeps its new sink
            self.sinks.pop(sink.request_id, None)

    def put(self, message: object) -> None:
        with self._lock, contextlib.suppress(OSError, EOFError):  # the front is gone: nobody listens
            self._conn.send(message)


def core_main(factory: Callable[[], Engine], conn: Connection, log_level: int) -> None:
    """The child process: run an `AsyncEngine` and serve the front's messages until told to stop."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # a signal to the whole process group: the front decides,
        signal.signal(sig, signal.SIG_IGN)       # and the core exits on ShutdownCore or when the pipe closes
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    channel = _PipeChannel(conn)
    engine = AsyncEngine(factory, name="chariot-engine-core", observer=channel.observe,
                         on_snapshot=channel.snapshot_changed)
    channel.engine = engine
    engine.start()
    threading.Thread(target=_announce, args=(engine, channel), daemon=True).start()
    try:
        while True:
            message = conn.recv()
            if isinstance(message, ShutdownCore):
                break
            _handle(message, engine, channel)
    except (EOFError, OSError):
        log.warning("front closed the pipe; engine core exits")
    finally:
        asyncio.run(engine.shutdown())


def _announce(engine: AsyncEngine, channel: _PipeChannel) -> None:
    try:
        engine.ready_future.result()
    except BaseException as exc:
        channel.put(CoreFailed(f"engine failed to load: {exc}", exc))
        return
    channel.put(CoreReady(engine.max_model_len, engine.snapshot or engine.engine.stats()))
    channel.put(CoreFailed(engine.dead_future.result()))  # blocks until (if ever) the engine dies


def _handle(message: object, engine: AsyncEngine, channel: _PipeChannel) -> None:
    if isinstance(message, AddRequest):
        sink = Sink(channel, None, message.request_id)
        channel.sinks[message.request_id] = sink
        future = engine.submit_add(message.prompt, message.params, sink)
        _reply_when_done(future, message.call_id, channel)
    elif isinstance(message, AbortRequest):
        if message.call_id is None:
            live = channel.sinks.pop(message.request_id, None)
            if live is not None:
                engine.submit_abort(message.request_id, live)
        else:
            _reply_when_done(engine.submit_abort(message.request_id), message.call_id, channel)
    else:
        log.error("engine core: unknown message %r ignored", type(message).__name__)


def _reply_when_done(future: concurrent.futures.Future[Any], call_id: int, channel: _PipeChannel) -> None:
    def done(f: concurrent.futures.Future[Any]) -> None:
        error = f.exception()
        channel.put(Reply(call_id, None if error is not None else f.result(), error))

    future.add_done_callback(done)


# ---- the front ---------------------------------------------------------------------------------
@dataclass(eq=False)
class _Stream:
    """The front's state of one live request."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
    times: RequestTimes | None = None


class EngineCoreClient:
    """`AsyncEngine`'s API over an engine running in a child process (see the module docstring).

    `factory` must be picklable (e.g. `functools.partial(Engine, config, topology=topo)`): the child
    builds the engine itself.
    """

    def __init__(self, factory: Callable[[], Engine], observer: StepObserver | None = None,
                 name: str = "chariot-engine-core") -> None:
        self._factory = factory
        self._observer = observer
        self._name = name
        self._conn: Connection | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._reader: threading.Thread | None = None
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._snapshot: EngineStats | None = None
        self._max_model_len = 0
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._dead: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._failed: str | None = None
        self._stopping = False

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._process is not None:
            raise RuntimeError("EngineCoreClient already started")
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds threads and torch
        ours, theirs = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=core_main, name=self._name, daemon=True,
                                    args=(self._factory, theirs, logging.getLogger().getEffectiveLevel()))
        self._process.start()
        theirs.close()
        self._conn = ours
        self._reader = threading.Thread(target=self._read, args=(ours,), name=f"{self._name}-reader", daemon=True)
        self._reader.start()

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

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    async def wait_failed(self) -> str:
        return await asyncio.shield(asyncio.wrap_future(self._dead))

    async def shutdown(self) -> None:
        """Stop the core: live requests end with FinishReason.ABORT; then the child exits."""
        self._stopping = True
        self._send(ShutdownCore(), strict=False)
        await asyncio.to_thread(self._join)

    def _join(self) -> None:
        if self._process is not None:
            self._process.join(JOIN_TIMEOUT_S)
            if self._process.is_alive():
                log.error("engine core did not exit within %.0f s; killing it", JOIN_TIMEOUT_S)
                self._process.kill()
                self._process.join()
        if self._reader is not None:
            self._reader.join(JOIN_TIMEOUT_S)
        self._end_all(EngineDeadError(self._failed or "engine is shut down"))

    # ---- requests ----------------------------------------------------------------------------
    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """As `AsyncEngine.generate`: validation errors before the first item; leaving early aborts."""
        rid = request_id or uuid.uuid4().hex
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        finished = False
        with self._state_lock:
            if rid in self._streams:  # as the engine would say, before anything crosses the pipe
                raise InvalidRequestError("request_id", f"{rid!r} is already in use")
            self._streams[rid] = stream
        try:
            await self._call(lambda call_id: AddRequest(call_id, rid, prompt, params))
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._state_lock:
                if self._streams.get(rid) is stream:
                    del self._streams[rid]
            if not finished:
                self._send(AbortRequest(None, rid), strict=False)

    async def abort(self, request_id: str) -> RequestOutput | None:
        value: RequestOutput | None = await self._call(lambda call_id: AbortRequest(call_id, request_id))
        return value

    async def stats(self) -> EngineStats:
        if self._snapshot is None:
            raise EngineDeadError(self._failed or "engine is not loaded")
        return self._snapshot

    # ---- plumbing ----------------------------------------------------------------------------
    async def _call(self, make: Callable[[int], object]) -> Any:
        call_id = next(self._call_ids)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._state_lock:
            self._calls[call_id] = future
        try:
            self._send(make(call_id))
            return await asyncio.wrap_future(future)
        finally:
            with self._state_lock:
                self._calls.pop(call_id, None)

    def _send(self, message: object, strict: bool = True) -> None:
        problem = self._failed
        if problem is None and self._stopping and isinstance(message, AddRequest):
            problem = "engine is shut down"
        if problem is None and self._conn is not None:
            try:
                with self._send_lock:
                    self._conn.send(message)
                return
            except (OSError, EOFError, ValueError) as exc:
                problem = f"engine core is gone ({exc!r})"
        if strict:
            raise EngineDeadError(problem or "engine is not started")

    def _read(self, conn: Connection) -> None:
        """The reader thread: every message from the core, until the pipe closes."""
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._dispatch(message)
            except Exception:
                log.exception("engine core message %s could not be handled", type(message).__name__)
        code = None if self._process is None else self._process.exitcode
        if not self._stopping:
            self._die(f"engine core process exited (code {code})")
        self._end_all(EngineDeadError(self._failed or "engine is shut down"))

    def _dispatch(self, message: object) -> None:
        if isinstance(message, StepMessage):
            self._on_step(message)
        elif isinstance(message, Reply):
            self._on_reply(message)
        elif isinstance(message, CoreReady):
            self._max_model_len, self._snapshot = message.max_model_len, message.stats
            self._ready.set_result(None)
        elif isinstance(message, CoreFailed):
            if message.load_error is not None and not self._ready.done():
                self._ready.set_exception(message.load_error)
            self._die(message.reason)

    def _on_reply(self, reply: Reply) -> None:
        with self._state_lock:
            future = self._calls.get(reply.call_id)
        if future is None or future.done():
            return
        if reply.error is not None:
            future.set_exception(reply.error)
        else:
            future.set_result(reply.value)  # an abort's answer crosses as a whole RequestOutput

    def _on_step(self, message: StepMessage) -> None:
        if message.stats is not None:
            self._snapshot = message.stats
        with self._state_lock:
            streams = [self._streams.get(delta.request_id) for delta in message.deltas]
        deliveries = [(stream, self._output(stream, delta))
                      for stream, delta in zip(streams, message.deltas, strict=True) if stream is not None]
        _deliver_threadsafe(deliveries)
        if self._observer is not None and message.step is not None:
            try:
                self._observer(message.step, [out for _, out in deliveries])
            except Exception:
                log.exception("step observer failed")
        for request_id, exc in message.failures:
            self._put(request_id, exc)

    @staticmethod
    def _output(stream: _Stream, delta: Delta) -> RequestOutput:
        """The request's `RequestOutput` for `delta`, with the front's copies of its prompt and times
        brought up to date."""
        if delta.prompt_token_ids is not None:
            stream.prompt_token_ids = delta.prompt_token_ids
        t, new = stream.times, delta.times
        if t is None:
            stream.times = t = dataclasses.replace(new, token_times=list(new.token_times))
        else:
            t.first_scheduled, t.first_token, t.finished = new.first_scheduled, new.first_token, new.finished
            t.token_times.extend(new.token_times)
        return RequestOutput(delta.request_id, stream.prompt_token_ids, delta.new_token_ids, delta.new_text,
                             delta.num_output_tokens, delta.finish_reason is not None, delta.finish_reason, t,
                             delta.num_preemptions, delta.error, delta.new_logprobs)

    def _put(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._state_lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            _put_threadsafe(stream, item)

    def _die(self, reason: str) -> None:
        if self._failed is None:
            log.error("engine failed: %s", reason)
            self._failed = reason
        if not self._dead.done():
            self._dead.set_result(reason)
        if not self._ready.done():
            self._ready.set_exception(EngineDeadError(reason))

    def _end_all(self, exc: BaseException) -> None:
        with self._state_lock:
            streams, self._streams = list(self._streams.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for stream in streams:
            _put_threadsafe(stream, exc)
        for future in calls:
            if not future.done():
                future.set_exception(exc)


def _put_threadsafe(stream: _Stream, item: RequestOutput | BaseException) -> None:
    _deliver_threadsafe([(stream, item)])


def _deliver_threadsafe(deliveries: Sequence[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    """Put each item on its stream's queue with one wake-up of each event loop, not one per item:
    a step's tokens for every request reach the server's loop in one hand-over."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput | BaseException]]] = {}
    for stream, out in deliveries:
        by_loop.setdefault(stream.loop, []).append((stream, out))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the consumers' loop is closed: nobody is listening
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: Sequence[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)
