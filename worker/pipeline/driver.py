"""Stage 0's side of the pipeline: an `Executor` that keeps up to P micro-batches in flight.

`submit` decodes the packed micro-batch for stage 0's device, runs stage 0's layers and streams
the packed buffer (as stage 0's `InputBuilder` made it) with the hidden states downstream without
waiting for earlier ones; `wait` returns the oldest micro-batch's sampled tokens (results arrive in submission order).
While nothing is in flight a heartbeat thread pings the pipeline so downstream stages never sit in
an unbounded receive and a dead stage is noticed even when idle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NoReturn, TypeVar

import torch

from chariot.contracts.errors import PipelineError
from chariot.worker.micro_batch import MicroBatch, TokenCarry
from chariot.worker.pipeline import protocol as wire
from chariot.worker.pipeline.stage import StageClock
from chariot.worker.runtime import StageRuntime
from chariot.worker.sampler import SamplerOutput

log = logging.getLogger(__name__)
T = TypeVar("T")


class PipelineExecutor:
    """Executor for stage 0 of a P-stage pipeline (see `chariot.worker.engine.Executor`)."""

    def __init__(self, runtime: StageRuntime, heartbeat_s: float | None = None) -> None:
        self.runtime = runtime
        self.runner = runtime.runner
        self.link = runtime.pipeline_link()
        self.world = runtime.resolved.num_stages
        self.max_in_flight = self.world
        self.clock = StageClock(0)
        self.counters = torch.zeros(2 * wire.MAX_STAGES, dtype=torch.long)  # latest of every stage
        self.failed: str | None = None
        self._pending: deque[int] = deque()
        # (micro-batch id, stage-0 compute start, handed downstream, result back): recent history
        self.timeline: deque[tuple[int, float, float, float]] = deque(maxlen=4096)
        self._submitted: dict[int, tuple[float, float]] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        config = runtime.resolved.engine
        self._result_len = wire.result_len(config.max_batch_size)
        interval = heartbeat_s if heartbeat_s is not None else config.stage_timeout_s / 4
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, args=(interval,), daemon=True,
                                           name="pipeline-heartbeat")
        self._heartbeat.start()

    # ---- Executor --------------------------------------------------------------------------
    def submit(self, mb: MicroBatch, carry: TokenCarry | None = None) -> None:
        if carry is not None:
            raise ValueError("a pipeline does not schedule ahead: every micro-batch's input tokens are on the host")
        with self._lock:
            self._raise_if_failed()
            t0 = time.perf_counter()
            _, hidden = self.runner.run(mb)
            self.clock.busy_s += time.perf_counter() - t0
            header = wire.Header(wire.Kind.BATCH, self._next_id, mb.layout)
            raw = wire.encode_header(header, self.clock.stamp(self.counters))
            self._guard(lambda: self.link.send([raw, mb.payload, hidden], 1))
            self._submitted[self._next_id] = (t0, time.perf_counter())
            self._pending.append(self._next_id)
            self._next_id += 1

    def wait(self) -> SamplerOutput:
        with self._lock:
            self._raise_if_failed()
            if not self._pending:
                raise RuntimeError("wait() with no micro-batch in flight")
            t0 = time.perf_counter()
            raw = self._guard(lambda: self.link.recv((self._result_len,), torch.long, self.world - 1)).cpu()
            extra = wire.logprobs_len(raw)
            lps = self._guard(lambda: self.link.recv((extra,), torch.long, self.world - 1)).cpu() if extra else None
            self.clock.idle_s += time.perf_counter() - t0
            mb_id, tokens, counters = wire.decode_result(raw, lps)
            expected = self._pending.popleft()
            if mb_id != expected:
                self._fail(f"pipeline protocol error: expected micro-batch {expected}, got {mb_id}")
            self._merge(counters)
            self.timeline.append((mb_id, *self._submitted.pop(mb_id), time.perf_counter()))
            return tokens

    # ---- reporting --------------------------------------------------------------------------
    def stage_times(self) -> list[tuple[float, float]]:
        """(busy_s, idle_s) per stage, as last reported through the pipeline."""
        c = self.counters.tolist()
        return [(c[2 * s] / 1e6, c[2 * s + 1] / 1e6) for s in range(self.world)]

    def bubble_fraction(self) -> float:
        times = self.stage_times()
        total = sum(b + i for b, i in times)
        return sum(i for _, i in times) / total if total > 0 else 0.0

    # ---- lifecycle --------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Tell every stage to exit cleanly, then leave the process group."""
        self._stop.set()
        with self._lock:
            if self.failed is None:
                try:
                    self.link.send([wire.encode_header(wire.Header(wire.Kind.SHUTDOWN, 0))], 1)
                except PipelineError as exc:
                    log.warning("shutdown: %s", exc)
            self.runtime.close(release_followers=self.failed is None)

    def _heartbeat_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            with self._lock:
                if self._pending or self.failed is not None or self._stop.is_set():
                    continue
                try:
                    self._ping()
                except PipelineError:
                    return

    def _ping(self) -> None:
        beat = wire.encode_header(wire.Header(wire.Kind.HEARTBEAT, wire.HEARTBEAT_ID))
        self._guard(lambda: self.link.send([beat], 1))
        raw = self._guard(lambda: self.link.recv((self._result_len,), torch.long, self.world - 1))
        if int(raw[0]) != wire.HEARTBEAT_ID:
            self._fail("pipeline protocol error: expected a heartbeat acknowledgement")

    def _guard(self, op: Callable[[], T]) -> T:
        try:
            return op()
        except PipelineError as exc:
            self._fail(str(exc))

    def _fail(self, message: str) -> NoReturn:
        if self.failed is None:
            self.failed = message
            log.error("pipeline failed: %s", message)
        raise PipelineError(self.failed)

    def _raise_if_failed(self) -> None:
        if self.failed is not None:
            raise PipelineError(self.failed)

    def _merge(self, counters: torch.Tensor) -> None:
        self.counters = self.clock.stamp(counters)
