"""The engine loop's body, and the engine loop in a process of its own.

Why a module of its own: whoever drives an engine for a server must do the same few things on every
turn — apply the requests that arrived, run one step, turn the step into `RequestOutput` deltas and
hand them over — and must do them on one thread. `EngineCore` is that body (engine, output
processor, prefill-rate meter); it is shared by the two `EngineClient`s:

- `AsyncEngine` (`async_engine.py`) runs it on a thread of the serving process;
- `EngineCoreClient` (here) runs it in a child process with a plain loop, `core_main`: receive the
  front's messages, step, send the step's deltas. In one process the engine and the gRPC front take
  turns on one GIL, so under many streams the engine waits for the front on every op dispatch; in
  its own process it never does (vLLM v1's engine-core split).

The pipe between front and core carries the typed messages below (plain frozen dataclasses, no
method names). What crosses per step is the step's `RequestOutput` deltas, O(1) per token, the
block hashes the step registered or evicted (KV events, O(1) per block; the front numbers and logs
them in its `KVEventLog`, `kv_events.py`), and the step's `StepResult` without its outputs, so the
step observer (metrics) runs in the front, the process that exports them.

Detokenisation and stop strings run in the core, beside the engine: a stop string is then applied
before the next step is scheduled, so the engine never computes tokens past it. docs/architecture.md
("Where detokenisation runs") has the measurement behind this placement.

Prefill throughput (the Stats RPC's `prefill_tokens_per_s`, the router's TTFT prediction) is
measured, not modelled: over the last `PREFILL_WINDOW` steps that took on prompt tokens,
rate = their prompt tokens / their wall time, i.e. how fast this replica works through queued
prompts while it has some (decodes sharing those batches included). It is 0.0 until the first
prompt has been processed; an idle replica keeps its last measured rate.

Capacity at the budget (the Stats RPC's `budget_tokens_per_s`, the autoscaler's per-group capacity)
is what a full `token_budget` batch would sustain: a straight line, step seconds = a + b × batch tokens,
is fitted to the last `STEP_COST_WINDOW` steps (prefill and decode tokens alike: each takes one
budget slot) and read at the budget, rate = budget / (a + b × budget). Unlike the prefill rate, which
counts only the tokens a step happened to get (small at light load, large under a queue), it
does not swing with the load: light load lays down the intercept, heavy load the slope. 0.0 until the
steps span at least two batch sizes.

Stalls: a step far slower than the step-cost line predicts, or a loop turn spending long outside
the step while requests wait, is logged with its parts and the collector's share (`stalls.py`).

Failure: the child exiting, a load error or an engine failure all set `failed` and resolve
`wait_failed()`; streams in flight end with `EngineDeadError`. The child ignores SIGINT and SIGTERM
(the front decides) and exits when told to or when the pipe closes, so it never outlives its front.
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
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TypeAlias

from chariot.contracts.errors import EngineDeadError, InvalidRequestError
from chariot.contracts.outputs import EngineStats, IterationTimes, RequestOutput
from chariot.contracts.proto_codec import BUDGET_TOKENS_PER_S, PREFILL_TOKENS_PER_S
from chariot.contracts.requests import Prompt
from chariot.contracts.sampling_params import SamplingParams
from chariot.worker.engine import Engine
from chariot.worker.engine_output import StepResult
from chariot.worker.kv_events import KVEventLog
from chariot.worker.output_processor import OutputProcessor, run_step
from chariot.worker.scheduler import SchedulerOutput
from chariot.worker.stalls import GcPauses, StallWatch

log = logging.getLogger(__name__)

PREFILL_WINDOW = 64  # steps that took on prompt tokens, averaged for prefill_tokens_per_s
STEP_COST_WINDOW = 256  # steps the step-cost line is fitted to, for budget_tokens_per_s
HEALTH_POLL_S = 0.5  # while idle, how often the engine is asked to check its pipeline (`check_health`)
JOIN_TIMEOUT_S = 30.0

StepObserver: TypeAlias = Callable[[StepResult, Sequence[RequestOutput]], None]
"""Called after each step with its result and the deltas it produced (metrics, logging). It runs on
the thread that delivers the deltas and must not touch the engine."""


# ---- the loop's body ---------------------------------------------------------------------------
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


class StepCostMeter:
    """Step seconds as a line in batch tokens over the last `window` steps, read at a full budget."""

    def __init__(self, window: int = STEP_COST_WINDOW, min_samples: int = 8) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._min_samples = min_samples

    def record(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self._samples.append((tokens, seconds))

    def step_seconds(self, tokens: int) -> float:
        """The fitted seconds of a `tokens` batch (least squares; intercept and slope kept >= 0), or
        0.0 while the samples are too few or all of one batch size."""
        n = len(self._samples)
        if n < self._min_samples:
            return 0.0
        mean_x = sum(x for x, _ in self._samples) / n
        mean_y = sum(y for _, y in self._samples) / n
        var_x = sum((x - mean_x) ** 2 for x, _ in self._samples)
        if var_x <= 0:
            return 0.0
        slope = max(sum((x - mean_x) * (y - mean_y) for x, y in self._samples) / var_x, 0.0)
        intercept = mean_y - slope * mean_x
        if intercept < 0:  # no fixed cost measurable: a line through the origin
            intercept, slope = 0.0, sum(x * y for x, y in self._samples) / sum(x * x for x, _ in self._samples)
        return intercept + slope * tokens

    def expected_seconds(self, tokens: int) -> float:
        """`step_seconds` for a batch no larger than the window's largest, else 0.0 (no prediction):
        a line fitted to decode steps alone, memory-bound and nearly flat in tokens, puts a prompt
        chunk at a decode's cost, and every prompt after a quiet spell would look like a stall."""
        if not self._samples or tokens > max(n for n, _ in self._samples):
            return 0.0
        return self.step_seconds(tokens)

    def tokens_per_s_at(self, budget: int) -> float:
        seconds = self.step_seconds(budget) if budget > 0 else 0.0
        return budget / seconds if seconds > 0 else 0.0


class EngineCore:
    """One engine plus what turns its steps into deltas. Not thread-safe: one loop owns it.

    Every method returns the deltas it produced; the caller hands them to the requests' streams.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.processor = OutputProcessor(engine.tokenizer)
        self._meter = PrefillMeter()
        self._step_cost = StepCostMeter()
        self._live: set[str] = set()
        self.stalls = StallWatch()
        self.gc = GcPauses().install()

    @property
    def has_unfinished(self) -> bool:
        return bool(self.engine.has_unfinished)

    @property
    def failed(self) -> str | None:
        """Why the engine failed (a pipeline stage died), or None."""
        return getattr(self.engine, "failed", None)

    @property
    def live_requests(self) -> frozenset[str]:
        return frozenset(self._live)

    def add(self, prompt: Prompt, params: SamplingParams, request_id: str) -> None:
        """Queue a request; raises the validation error (nothing is queued then)."""
        self.engine.add_request(prompt, params, request_id=request_id, arrival_time=time.time())
        self.processor.add_request(request_id, params)
        self._live.add(request_id)

    def step(self) -> tuple[StepResult, tuple[RequestOutput, ...]]:
        """schedule → execute → postprocess, then text and stop strings."""
        gc_before, cpu_before = self.gc.total_s, time.process_time()
        result, outputs = run_step(self.engine, self.processor)
        batch, times = result.batch, result.times
        if batch is not None:
            self.stalls.step(times.total, lambda: self._step_cost.expected_seconds(batch.num_tokens),
                             self.gc.total_s - gc_before, lambda: _step_parts(batch, times),
                             time.process_time() - cpu_before)
            self._meter.record(batch.num_prefill_tokens, times.total)
            self._step_cost.record(batch.num_tokens, times.total)
        return result, self._track(outputs)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a live request; its final delta, or None if it is not live."""
        out = self.engine.abort(request_id)
        outputs = self._process([] if out is None else [out])
        return outputs[0] if outputs else None

    def abort_all(self) -> tuple[RequestOutput, ...]:
        outputs = []
        for request_id in sorted(self._live):
            try:
                out = self.abort(request_id)
            except Exception as exc:  # the engine is going away anyway; the caller ends the stream regardless
                log.warning("abort of %s failed: %r", request_id, exc)
                continue
            if out is not None:
                outputs.append(out)
        return tuple(outputs)

    def check_health(self) -> tuple[RequestOutput, ...]:
        """Let the engine notice a pipeline failure while idle (it fails live requests, sets `failed`)."""
        return self._process(self.engine.check_health())

    @property
    def kv_block_size(self) -> int:
        """The block size KV event hashes are chained over (0: the engine has no block manager)."""
        blocks = getattr(self.engine, "blocks", None)
        return 0 if blocks is None else int(blocks.block_size)

    def take_kv_events(self) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        """(stored, removed) block hashes since the last call (`BlockManager.drain_events`)."""
        blocks = getattr(self.engine, "blocks", None)
        return ((), ()) if blocks is None else blocks.drain_events()

    def stats(self) -> EngineStats:
        """The engine's load report with the measured prefill rate and capacity at the budget in `extra`."""
        stats = self.engine.stats()
        measured = {PREFILL_TOKENS_PER_S: self._meter.tokens_per_s,
                    BUDGET_TOKENS_PER_S: self._step_cost.tokens_per_s_at(stats.token_budget)}
        return dataclasses.replace(stats, extra={**stats.extra, **measured})

    def shutdown(self) -> None:
        self.gc.uninstall()
        try:
            self.engine.shutdown()
        except Exception:
            log.exception("engine shutdown failed")

    def _process(self, outputs: Sequence[Any]) -> tuple[RequestOutput, ...]:
        """Outputs without new tokens (aborts, errors): no stop string can match in them."""
        return self._track(self.processor.process(outputs).outputs)

    def _track(self, outputs: tuple[RequestOutput, ...]) -> tuple[RequestOutput, ...]:
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
        return outputs


def _step_parts(batch: SchedulerOutput, times: IterationTimes) -> str:
    """A step's batch and the wall time of its parts, for a stall line."""
    return (f"{batch.num_tokens} tokens ({batch.num_prefill_tokens} prompt, {batch.num_decodes} decodes): "
            f"schedule {times.schedule * 1e3:.0f}, prepare {times.prepare * 1e3:.0f}, execute "
            f"{times.execute * 1e3:.0f}, postprocess {times.postprocess * 1e3:.0f} ms")


# ---- delivery to asyncio consumers -------------------------------------------------------------
Item: TypeAlias = RequestOutput | BaseException  # what a request's stream carries


@dataclass(eq=False)
class Stream:
    """Where one request's deltas go: a queue on its consumer's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Item] = dataclasses.field(default_factory=asyncio.Queue)


def deliver_threadsafe(deliveries: Sequence[tuple[Stream, Item]]) -> None:
    """Put each item on its stream's queue with one wake-up of each event loop, not one per item:
    a step's tokens for every request reach the server's loop in one hand-over."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, Item]]] = {}
    for stream, item in deliveries:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the consumers' loop is closed: nobody is listening
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: Sequence[tuple[Stream, Item]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


async def stream_items(stream: Stream) -> AsyncGenerator[RequestOutput, None]:
    """A stream's deltas until its last one; an exception put on it is raised."""
    while True:
        item = await stream.queue.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.finished:
            return


# ---- front → core ------------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    call_id: int
    request_id: str
    prompt: Prompt
    params: SamplingParams


@dataclass(frozen=True)
class AbortRequest:
    """`call_id` None: the consumer left early, nobody waits for the answer."""

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
    kv_block_size: int = 0


@dataclass(frozen=True)
class CoreFailed:
    """The engine died (`load_error` set when it never loaded)."""

    reason: str
    load_error: BaseException | None = None


@dataclass(frozen=True)
class StepMessage:
    """One turn of the core loop: its deltas, streams that failed, the step (if one ran), the load."""

    outputs: tuple[RequestOutput, ...]
    failures: tuple[tuple[str, BaseException], ...] = ()
    step: StepResult | None = None  # without its outputs
    stats: EngineStats | None = None
    kv_events: tuple[tuple[bytes, ...], tuple[bytes, ...]] = ((), ())  # (stored, removed) block hashes


@dataclass(frozen=True)
class Reply:
    call_id: int
    value: Any = None
    error: BaseException | None = None


# ---- the child ---------------------------------------------------------------------------------
class _CoreLoop:
    """receive → step → send, on the child's only thread."""

    def __init__(self, core: EngineCore, conn: Connection) -> None:
        self.core, self.conn = core, conn
        self.failed: str | None = None
        self._outputs: list[RequestOutput] = []  # produced this turn, sent with the turn's StepMessage

    def run(self) -> None:
        last_health = time.monotonic()
        while True:
            busy = self.core.has_unfinished  # work queued: time outside the step is a gap in its tokens
            started, gc_before = time.perf_counter(), self.core.gc.total_s
            messages = self._receive(0.0 if busy else HEALTH_POLL_S)
            if any(isinstance(m, ShutdownCore) for m in messages):
                return
            for message in messages:
                self._apply(message)
            received, gc_received = time.perf_counter(), self.core.gc.total_s
            step: StepResult | None = None
            if self.core.has_unfinished:
                try:
                    step, outputs = self.core.step()
                except Exception as exc:
                    self._crash(exc)
                    return
                self._outputs.extend(outputs)
            elif not messages or time.monotonic() - last_health >= HEALTH_POLL_S:
                last_health = time.monotonic()
                self._outputs.extend(self.core.check_health())
            stepped, gc_stepped = time.perf_counter(), self.core.gc.total_s
            if messages or step is not None or self._outputs:
                self._send_turn(step)
            self._notice_failure()
            if busy:
                gc_outside = (gc_received - gc_before) + (self.core.gc.total_s - gc_stepped)
                self._watch_gap(received - started, time.perf_counter() - stepped, len(messages), gc_outside)

    def _watch_gap(self, receive_s: float, send_s: float, messages: int, gc_s: float) -> None:
        """The turn's time outside the step, while requests waited for their next token."""
        self.core.stalls.loop_gap(receive_s + send_s, gc_s, lambda: f"receiving and applying {messages} messages "
                                                                    f"{receive_s * 1e3:.0f} ms, sending the step's "
                                                                    f"outputs {send_s * 1e3:.0f} ms")

    def _receive(self, timeout: float) -> list[object]:
        """Every message waiting (after up to `timeout` s for the first); EOFError once the pipe closed."""
        messages: list[object] = []
        while self.conn.poll(timeout if not messages else 0.0):
            messages.append(self.conn.recv())
        return messages

    def _apply(self, message: object) -> None:
        if isinstance(message, AddRequest):
            self._reply(message.call_id, lambda: self._add(message))
        elif isinstance(message, AbortRequest):
            out = self.core.abort(message.request_id)
            if out is not None:
                self._outputs.append(out)
            if message.call_id is not None:
                self.send(Reply(message.call_id, out))
        else:
            log.error("engine core: unknown message %r ignored", type(message).__name__)

    def _add(self, message: AddRequest) -> None:
        if self.failed is not None:
            raise EngineDeadError(self.failed)
        self.core.add(message.prompt, message.params, message.request_id)

    def _reply(self, call_id: int, fn: Callable[[], Any]) -> None:
        try:
            value = fn()
        except Exception as exc:
            self.send(Reply(call_id, None, exc))
        else:
            self.send(Reply(call_id, value))

    def _send_turn(self, step: StepResult | None) -> None:
        outputs, self._outputs = tuple(self._outputs), []
        compact = None if step is None else dataclasses.replace(step, outputs=())
        self.send(StepMessage(outputs, step=compact, stats=self.core.stats(), kv_events=self.core.take_kv_events()))

    def _notice_failure(self) -> None:
        reason = self.core.failed
        if reason is not None and self.failed is None:
            self.failed = str(reason)
            log.error("engine failed: %s", reason)
            self.send(CoreFailed(self.failed))

    def _crash(self, exc: Exception) -> None:
        """An unexpected exception escaped the engine: its state is unknown, so it is dead."""
        log.exception("engine loop crashed")
        self.failed = f"engine loop crashed: {exc!r}"
        self.send(CoreFailed(self.failed))  # first: whoever sees a stream end finds the engine already failed
        dead = EngineDeadError(self.failed)
        self.send(StepMessage((), tuple((rid, dead) for rid in sorted(self.core.live_requests))))

    def close(self) -> None:
        """Live requests end with ABORT, any the abort missed with EngineDeadError."""
        outputs = self.core.abort_all()  # what it could not abort is still live
        dead = EngineDeadError(self.failed or "engine is shut down")
        self.send(StepMessage(outputs, tuple((rid, dead) for rid in sorted(self.core.live_requests))))

    def send(self, message: object) -> None:
        with contextlib.suppress(OSError, EOFError):  # the front is gone: nobody listens
            self.conn.send(message)


def core_main(factory: Callable[[], Engine], conn: Connection, log_level: int) -> None:
    """The child process: build the engine, then run the core loop until told to stop."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # a signal to the whole process group: the front decides,
        signal.signal(sig, signal.SIG_IGN)       # and the core exits on ShutdownCore or when the pipe closes
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    try:
        core = EngineCore(factory())
    except BaseException as exc:
        with contextlib.suppress(OSError, EOFError):
            conn.send(CoreFailed(f"engine failed to load: {exc}", exc))
        return
    loop = _CoreLoop(core, conn)
    loop.send(CoreReady(core.engine.max_model_len, core.stats(), core.kv_block_size))
    try:
        loop.run()
    except (EOFError, OSError):
        log.warning("front closed the pipe; engine core exits")
    finally:
        loop.close()
        core.shutdown()


# ---- the front ---------------------------------------------------------------------------------
class EngineCoreClient:
    """The `EngineClient` whose engine loop runs in a child process (see the module docstring).

    `factory` must be picklable (e.g. `functools.partial(Engine, config, topology=topo)`): the child
    builds the engine itself. One reader thread turns the child's messages into the requests'
    asyncio queues.
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
        self._streams: dict[str, Stream] = {}
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._snapshot: EngineStats | None = None
        self._max_model_len = 0
        self.kv_events: KVEventLog | None = None  # once ready: the KvEvents RPC's source
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
        """As `EngineClient.generate`: validation errors before the first item; leaving early aborts."""
        rid = request_id or uuid.uuid4().hex
        stream = Stream(asyncio.get_running_loop())
        finished = False
        with self._state_lock:
            if rid in self._streams:  # as the engine would say, before anything crosses the pipe
                raise InvalidRequestError("request_id", f"{rid!r} is already in use")
            self._streams[rid] = stream
        try:
            await self._call(lambda call_id: AddRequest(call_id, rid, prompt, params))
            async for out in stream_items(stream):
                finished = out.finished
                yield out
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
            self.kv_events = KVEventLog(message.kv_block_size)
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
            future.set_result(reply.value)

    def _on_step(self, message: StepMessage) -> None:
        if message.stats is not None:
            self._snapshot = message.stats
        if self.kv_events is not None:
            self.kv_events.append(*message.kv_events)
        with self._state_lock:
            deliveries: list[tuple[Stream, Item]] = [
                (stream, out) for out in message.outputs if (stream := self._streams.get(out.request_id)) is not None]
            deliveries += [(stream, exc) for rid, exc in message.failures
                           if (stream := self._streams.get(rid)) is not None]
        deliver_threadsafe(deliveries)
        if self._observer is not None and message.step is not None:
            try:
                self._observer(message.step, message.outputs)
            except Exception:
                log.exception("step observer failed")

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
        deliver_threadsafe([(stream, exc) for stream in streams])
        for future in calls:
            if not future.done():
                future.set_exception(exc)
