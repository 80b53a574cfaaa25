"""Worker-side metrics: turns engine steps into the telemetry of DESIGN.md §7.

An `EngineMetrics` instance is the AsyncEngine's step observer (it runs on the engine thread): per
iteration it records batch composition, load gauges and stage-0 busy/idle time; per finished
request its worker-measured TTFT, TBT gaps, queue delay, duration and token usage.
"""

from __future__ import annotations

from chariot.contracts.outputs import RequestOutput
from chariot.contracts.requests import FinishReason
from chariot.contracts.telemetry import Telemetry
from chariot.worker.engine import Engine
from chariot.worker.scheduler import SchedulerOutput


class EngineMetrics:
    """Step observer that records one engine's metrics into `telemetry`."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self._last_batch: SchedulerOutput | None = None

    def __call__(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        tel = self.telemetry
        batch = engine.last_batch
        if batch is not None and batch is not self._last_batch:
            self._last_batch = batch
            tel.record_batch(batch.num_prefill_tokens, batch.num_tokens - batch.num_prefill_tokens)
        tel.set_engine_state(running=engine.scheduler.num_running, waiting=engine.scheduler.num_waiting,
                             kv_cache_usage=engine.blocks.usage)
        clock = getattr(engine.executor, "clock", None)  # pipeline stage 0 keeps busy/idle time
        if clock is not None:
            clock.report(tel)
        for out in outputs:
            if out.finished:
                self._record_request(out)

    def _record_request(self, out: RequestOutput) -> None:
        tel, t = self.telemetry, out.times
        if t.first_scheduled is not None:
            tel.record_queue_delay(t.first_scheduled - t.arrival)
        if t.ttft is not None:
            tel.record_ttft(t.ttft)
        for gap in t.tbt:
            tel.record_tbt(gap)
        end = t.finished if t.finished is not None else t.arrival
        error = None if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) else (
            out.finish_reason.value if out.finish_reason else "unknown")
        tel.record_request(end - t.arrival, len(out.prompt_token_ids), len(out.token_ids), error_type=error)
