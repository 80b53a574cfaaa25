"""Asyncio front of the (synchronous, not thread-safe) `Engine`: one dedicated thread runs the loop.

Why a module of its own: the gRPC server (and anything else on an event loop) must never block on a
forward pass, and the engine must only ever be touched by one thread. So every engine call —
construction, `add_request`, `abort`, `stats`, `step` — runs on the engine thread. Callers post
commands to a queue; the thread blocks on that queue when there is nothing to do (no busy spin; it
wakes every `HEALTH_POLL_S` to let the engine check its pipeline stages) and, while requests are
live, alternates draining all queued commands with one step: `engine.step()` → the
`OutputProcessor` (text, stop strings; a stop-string finish goes back to the engine before the next
step) → each request's `asyncio.Queue` through `loop.call_soon_threadsafe`. Observers and the Stats
snapshot learn about a step from its `StepResult` alone.

Prefill throughput (for the Stats RPC and the router's TTFT prediction) is measured, not modelled:
each step that completes a batch (`StepResult.batch`) with prompt tokens in it is recorded as
(its prefill tokens, that step's wall time). Over the last `PREFILL_WINDOW` such steps,
rate = their prefill tokens / their wall time, i.e. how fast this replica works through queued
prompts while it has some (decodes sharing those batches included, as they would be). With a
pipeline, `step()` returns once per completed micro-batch, so the ratio is the steady-state rate.
It is 0.0 until the first prompt has been processed; an idle replica keeps its last measured rate.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from typing import Any, TypeAlias, TypeVar

from chariot.contracts.errors import EngineDeadError
from chariot.contracts.outputs import EngineStats, RequestOutput
from chariot.contracts.proto_codec import PREFILL_TOKENS_PER_S
from chariot.contracts.requests import Prompt
from chariot.contracts.sampling_params import SamplingParams
from chariot.worker.engine import Engine
from chariot.worker.engine_output import EngineOutput, StepResult
from chariot.worker.output_processor import OutputProcessor, run_step

log = logging.getLogger(__name__)

T = TypeVar("T")
_Item: TypeAlias = RequestOutput | BaseException  # what a request's queue carries
PREFILL_WINDOW = 64  # steps that took on prompt tokens, averaged for prefill_tokens_per_s
HEALTH_POLL_S = 0.5  # while idle, how often the engine is asked to check its pipeline (`check_health`)


@dataclasses.dataclass
class _Command:
    fn: Callable[[], Any]
    future: concurrent.futures.Future[Any] | None  # None: fire and forget


class Channel:
    """Where a batch of outputs for some sinks goes, in one hand-over per step (see `_send`)."""

    def send(self, batch: list[tuple[Sink, _Item]]) -> None:
        raise NotImplementedError


class _LoopChannel(Channel):
    """An asyncio event loop: items go to their sinks' queues in one callback on that loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _LoopChannel) and other.loop is self.loop

    def __hash__(self) -> int:
        return id(self.loop)

    def send(self, batch: list[tuple[Sink, _Item]]) -> None:
        with contextlib.suppress(RuntimeError):  # the consumer's loop is closed: nobody is listening
            self.loop.call_soon_threadsafe(_put_all, batch)


@dataclasses.dataclass(eq=False)
class Sink:
    """Where one request's outputs go: a channel, and (for an asyncio consumer) its queue."""

    channel: Channel
    queue: asyncio.Queue[_Item] | None = None
    request_id: str = ""


StepObserver: TypeAlias = Callable[[StepResult, Sequence[RequestOutput]], None]
"""Called on the engine thread after each step with its result and the outputs sent to the fronts
(metrics, logging). It must not touch the engine."""

def _send(items: list[tuple[Sink, _Item]]) -> None:
    """Hand items to their consumers: one hand-over per channel (event loop, pipe) per step."""
    by_channel: dict[Channel, list[tuple[Sink, _Item]]] = {}
    for sink, item in items:
        by_channel.setdefault(sink.channel, []).append((sink, item))
    for channel, batch in by_channel.items():
        channel.send(batch)


def _put_all(batch: list[tuple[Sink, _Item]]) -> None:
    for sink, item in batch:
        if sink.queue is not None:
            sink.queue.put_nowait(item)


class PrefillMeter:
    """Prompt tokens per second over the last `window` steps that took on prompt tokens."""

    def __init__(self, window: int = PREFILL_WINDOW) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)

    def record(self, prefill_tokens: int, seconds: float) -> None:
        if prefill_tokens > 0 and seconds > 0:
            self._samples.append((prefill_tokens, seconds))

    @property
    def tokens_per_s(self) -> float:
        seconds = sum(s for _, s in self._samples)
        return sum(n for n, _ in self._samples) / seconds if seconds > 0 else 0.0


class AsyncEngine:
    """Owns one Engine and runs it on a dedicated thread; the API is for asyncio callers.

    Usage: `ae = AsyncEngine(factory); ae.start(); await ae.wait_ready()`, then `generate`, `abort`,
    `stats`; finally `await ae.shutdown()`. `failed` is set (and `wait_failed()` resolves) when the
    engine dies: it failed to load, its loop crashed, or the engine reported `Engine.failed`
    (pipeline failure).
    """

    def __init__(
        self,
        engine_factory: Callable[[], Engine],
        name: str = "chariot-engine",
        observer: StepObserver | None = None,
        on_snapshot: Callable[[EngineStats], None] | None = None,
    ) -> None:
        self._factory = engine_factory
        self._on_snapshot = on_snapshot  # engine thread: after commands changed the load report
        self._name = name
        self._observer = observer  # called on the engine thread after every step
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _closed against a concurrent final drain
        self._closed = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._engine: Engine | None = None
        self._processor: OutputProcessor | None = None  # engine thread only
        self._sinks: dict[str, Sink] = {}  # engine thread only
        self._meter = PrefillMeter()  # engine thread only
        # Load report refreshed by the engine thread after every step and command batch, so Stats
        # is answered at once even while a long iteration runs (routers poll it with short deadlines).
        self._snapshot: EngineStats | None = None
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._failed: str | None = None
        self._dead: concurrent.futures.Future[str] = concurrent.futures.Future()

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; it builds the engine (loads the model) first."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    async def wait_ready(self) -> None:
        """Return once the engine is loaded; re-raises the load error if loading failed."""
        await asyncio.shield(asyncio.wrap_future(self._ready))

    @property
    def ready(self) -> bool:
        return self._ready.done() and self._ready.exception() is None

    @property
    def engine(self) -> Engine:
        """The engine, for read-only facts (`max_model_len`, `model_config`). Never call it directly."""
        if self._engine is None:
            raise EngineDeadError("engine is not loaded")
        return self._engine

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def failed(self) -> str | None:
        """Why the engine died, or None while it is healthy."""
        return self._failed

    async def wait_failed(self) -> str:
        """Resolve with the failure message when the engine dies (never, if it does not)."""
        return await asyncio.shield(asyncio.wrap_future(self._dead))

    async def shutdown(self) -> None:
        """Stop the loop: live requests end with FinishReason.ABORT; queued commands fail."""
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
        """Stream a request's outputs, one per engine step that changed it; the last is `finished`.

        Validation errors (InvalidRequestError, EngineDeadError) are raised before the first item.
        If the consumer stops early (closes or cancels the iteration), the request is aborted and its
        KV blocks freed.
        """
        rid = request_id or uuid.uuid4().hex
        queue_: asyncio.Queue[_Item] = asyncio.Queue()
        sink = Sink(_LoopChannel(asyncio.get_running_loop()), queue_, rid)
        finished = False
        try:
            await self._call(lambda: self._add(prompt, params, rid, sink))
            while not finished:
                item = await queue_.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # consumer left early (or cancelled mid-add): free the request if it is ours
                self._post(_Command(lambda: self._abort_if_mine(rid, sink), None), strict=False)

    async def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request (its stream ends with FinishReason.ABORT); None if it is not live."""
        return await self._call(lambda: self._abort_now(request_id))

    async def stats(self) -> EngineStats:
        """The engine's load report, with `extra["prefill_tokens_per_s"]` filled in; never waits for
        an iteration to finish (it is the snapshot taken after the latest step or command)."""
        snapshot = self._snapshot
        return snapshot if snapshot is not None else await self._call(self._stats_now)

    # ---- the same for a caller off any event loop (the engine-core process, `engine_core.py`) --
    def submit_add(self, prompt: Prompt, params: SamplingParams, sink: Sink) -> concurrent.futures.Future[None]:
        """Queue a request whose outputs go to `sink` (id `sink.request_id`); the future fails with
        the validation error, if any."""
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._post(_Command(lambda: self._add(prompt, params, sink.request_id, sink), future))
        return future

    def submit_abort(
        self, request_id: str, sink: Sink | None = None
    ) -> concurrent.futures.Future[RequestOutput | None]:
        """Abort `request_id` (only if `sink` registered it, when a sink is given)."""
        future: concurrent.futures.Future[RequestOutput | None] = concurrent.futures.Future()
        fn = (lambda: self._abort_now(request_id)) if sink is None else (lambda: self._abort_if_mine(request_id, sink))
        if not self._post(_Command(fn, future), strict=False):
            future.set_result(None)  # closed: every stream has ended already
        return future

    @property
    def snapshot(self) -> EngineStats | None:
        """The latest load report (see `stats`), or None before the engine loaded."""
        return self._snapshot

    @property
    def ready_future(self) -> concurrent.futures.Future[None]:
        return self._ready

    @property
    def dead_future(self) -> concurrent.futures.Future[str]:
        return self._dead

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
    def _run(self) -> None:
        try:
            engine = self._load()
            if engine is not None:
                try:
                    self._loop(engine)
                finally:
                    self._abort_all()
                    self._shutdown_engine(engine)
        finally:
            self._close()

    def _load(self) -> Engine | None:
        try:
            self._engine = self._factory()
            self._processor = OutputProcessor(self._engine.tokenizer)
        except BaseException as exc:
            self._ready.set_exception(exc)
            self._die(f"engine failed to load: {exc}")
            return None
        self._ready.set_result(None)
        return self._engine

    def _loop(self, engine: Engine) -> None:
        last_health = time.monotonic()
        while not self._stopping:
            ran = self._drain(timeout=0.0 if engine.has_unfinished else HEALTH_POLL_S)
            if self._stopping:
                return
            try:
                if engine.has_unfinished:
                    self._step(engine)
                elif not ran or time.monotonic() - last_health >= HEALTH_POLL_S:
                    last_health = time.monotonic()
                    self._deliver(self._check_health(engine))
            except Exception as exc:
                self._crash(exc)
                return
            if getattr(engine, "failed", None) and self._failed is None:
                self._die(str(engine.failed))

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
            self._execute(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                self._refresh_snapshot()
                return True

    @staticmethod
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

    @property
    def processor(self) -> OutputProcessor:
        if self._processor is None:
            raise EngineDeadError("engine is not loaded")
        return self._processor

    def _step(self, engine: Engine) -> None:
        result, outputs = run_step(engine, self.processor)
        if result.batch is not None:
            self._meter.record(result.batch.num_prefill_tokens, result.times.total)
        self._snapshot = self._with_prefill_rate(result.stats)
        if self._observer is not None:
            self._observer(result, outputs)
        self._deliver(outputs)

    def _process(self, outputs: Iterable[EngineOutput]) -> tuple[RequestOutput, ...]:
        """Outputs that carry no new tokens (aborts, errors): no stop string can match in them."""
        return self.processor.process(outputs).outputs

    def _check_health(self, engine: Engine) -> tuple[RequestOutput, ...]:
        """Let the engine notice a pipeline failure while idle (it fails live requests, sets `failed`)."""
        return self._process(engine.check_health())

    @staticmethod
    def _shutdown_engine(engine: Engine) -> None:
        close = getattr(engine, "shutdown", None)
        if close is None:
            return
        try:
            close()
        except Exception:
            log.exception("engine shutdown failed")

    def _deliver(self, outputs: Iterable[RequestOutput]) -> None:
        items: list[tuple[Sink, _Item]] = []
        for out in outputs:
            sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
            if sink is not None:
                items.append((sink, out))
        _send(items)

    def _add(self, prompt: Prompt, params: SamplingParams, request_id: str, sink: Sink) -> None:
        if self._failed is not None:
            raise EngineDeadError(self._failed)
        self.engine.add_request(prompt, params, request_id=request_id, arrival_time=time.time())
        self.processor.add_request(request_id, params)
        self._sinks[request_id] = sink

    def _abort_if_mine(self, request_id: str, sink: Sink) -> RequestOutput | None:
        """Abort `request_id` only if `sink` registered it (an id reused by another caller is left alone)."""
        return self._abort_now(request_id) if self._sinks.get(request_id) is sink else None

    def _abort_now(self, request_id: str) -> RequestOutput | None:
        out = self.engine.abort(request_id)
        outputs = self._process([] if out is None else [out])
        self._deliver(outputs)
        return outputs[0] if outputs else None

    def _refresh_snapshot(self) -> None:
        if self._engine is not None:
            self._snapshot = self._stats_now()
            if self._on_snapshot is not None:
                self._on_snapshot(self._snapshot)

    def _stats_now(self) -> EngineStats:
        return self._with_prefill_rate(self.engine.stats())

    def _with_prefill_rate(self, stats: EngineStats) -> EngineStats:
        extra = {**stats.extra, PREFILL_TOKENS_PER_S: self._meter.tokens_per_s}
        return dataclasses.replace(stats, extra=extra)

    def _abort_all(self) -> None:
        for request_id in list(self._sinks):
            try:
                self._abort_now(request_id)
            except Exception as exc:  # the engine is going away anyway; end the stream regardless
                log.warning("abort of %s at shutdown failed: %r", request_id, exc)
        self._fail_all(EngineDeadError("engine is shut down"))

    def _fail_all(self, exc: BaseException) -> None:
        _send([(sink, exc) for sink in self._sinks.values()])
        self._sinks.clear()

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
