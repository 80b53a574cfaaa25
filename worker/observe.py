"""Worker-side metrics: turns engine steps into the telemetry of docs/architecture.md §7.

An `EngineMetrics` instance is the AsyncEngine's step observer (it runs on the engine thread) and
reads only what a step hands it — the `StepResult` and the outputs sent to the fronts, never the
engine: per iteration it records batch composition, load gauges, prefix-cache lookups, stage-0
busy/idle time and tensor-parallel collective time; per token its worker-measured TBT gap; per
finished request its TTFT, queue delay, duration and token usage.
"""

from __future__ import annotations

from collections.abc import Sequence

from chariot.contracts.outputs import RequestOutput
from chariot.contracts.requests import FinishReason
from chariot.contracts.telemetry import Telemetry
from chariot.worker.engine_output import StepResult


class EngineMetrics:
    """Step observer that records one engine's metrics into `telemetry`."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self._prefix_seen = (0, 0)  # the engine's cumulative prefix-cache (queries, hits) last recorded
        self._collective_seen = 0.0  # stage 0 leader's cumulative collective seconds last recorded
        self._last_token_time: dict[str, float] = {}  # live requests: when their latest token came

    def __call__(self, result: StepResult, outputs: Sequence[RequestOutput]) -> None:
        tel = self.telemetry
        batch = result.batch
        if batch is not None:
            tel.record_batch(batch.num_prefill_tokens, batch.num_tokens - batch.num_prefill_tokens)
        load = result.stats
        tel.set_engine_state(running=load.num_running, waiting=load.num_waiting, kv_cache_usage=load.kv_cache_usage,
                             kv_blocks_used=load.num_blocks - load.num_free_blocks, kv_blocks_total=load.num_blocks)
        self._record_prefix_cache(load.prefix_cache_queries, load.prefix_cache_hits)
        if load.collective_s > self._collective_seen:
            tel.add_collective_time(0, 0, load.collective_s - self._collective_seen)
            self._collective_seen = load.collective_s
        stage = result.stage_time
        if stage is not None and (stage.busy_s > 0 or stage.idle_s > 0):
            tel.add_stage_time(stage.stage, stage.busy_s, stage.idle_s)
        for out in outputs:
            self._record_token_gaps(out)
            if out.finished:
                self._record_request(out)

    def _record_prefix_cache(self, queries: int, hits: int) -> None:
        seen_queries, seen_hits = self._prefix_seen
        if queries > seen_queries:
            self.telemetry.record_prefix_cache(queries - seen_queries, hits - seen_hits)
            self._prefix_seen = (queries, hits)

    def _record_token_gaps(self, out: RequestOutput) -> None:
        """TBT points as tokens arrive: a delta carries only its own tokens' times."""
        times = out.times.token_times
        previous = self._last_token_time.pop(out.request_id, None)
        for t in times:
            if previous is not None:
                self.telemetry.record_tbt(t - previous)
            previous = t
        if previous is not None and not out.finished:
            self._last_token_time[out.request_id] = previous

    def _record_request(self, out: RequestOutput) -> None:
        tel, t = self.telemetry, out.times
        if t.first_scheduled is not None:
            tel.record_queue_delay(t.first_scheduled - t.arrival)
        if t.ttft is not None:
            tel.record_ttft(t.ttft)
        end = t.finished if t.finished is not None else t.arrival
        error = None if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) else (
            out.finish_reason.value if out.finish_reason else "unknown")
        tel.record_request(end - t.arrival, out.num_prompt_tokens, out.num_output_tokens, error_type=error)
