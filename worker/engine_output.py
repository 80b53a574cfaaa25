"""What one `Engine.step()` hands back: per-request token deltas plus the facts observers need.

Why a module of its own: the engine's consumers — the output processor (text, stop strings), the
AsyncEngine (routing, the Stats snapshot, the prefill-rate meter), worker metrics and the benchmarks —
must learn everything about a step from its result, never by reading the engine's scheduler, block
manager or executor afterwards (state that the next step changes). Like vLLM v1's
`EngineCoreOutput(s)` and `sched/output.py`, these are plain frozen records; the engine builds one
per step and never touches it again.
"""

from __future__ import annotations

from dataclasses import dataclass

from chariot.contracts.outputs import EngineStats, IterationTimes, TokenLogprobs
from chariot.contracts.requests import FinishReason, RequestTimes
from chariot.worker.scheduler import SchedulerOutput

NO_TIMES = IterationTimes(0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class EngineOutput:
    """One request's token delta from one step (or its end: abort, error, a finish asked for).

    Invariants:
    - `new_token_ids` are the tokens sampled for this request in this step, in order (today 0 or 1);
      an output with none is a finish without a new token (abort, error, `finish_requests`).
    - `num_output_tokens` counts every token generated so far, `new_token_ids` included.
    - `finish_reason` is set exactly once per request, on its last output; after it the engine holds
      no state (no KV blocks) for the request and emits nothing more for it.
    - The engine finishes with STOP only on a token: then `stop_token_id` is that EOS / stop token id,
      the last of `new_token_ids`; it belongs to `token_ids` but never to the text.
    - The engine never looks at text: stop strings are the output processor's business.
    - `prompt_token_ids` is the engine's own list, shared, never copied: read only.
    - `times` is the request's timestamps as of this output, with the times of `new_token_ids` only.
    - `new_logprobs` is empty unless the request asked for logprobs; then it has one entry per new
      token.
    - `num_cached_tokens` is `Sequence.cached_prompt_tokens` on every output (0 before the request
      was first scheduled); the output processor reports it on the request's last delta.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    num_output_tokens: int
    finish_reason: FinishReason | None
    prompt_token_ids: list[int]
    times: RequestTimes
    stop_token_id: int | None = None
    num_preemptions: int = 0
    error: str | None = None
    new_logprobs: tuple[TokenLogprobs, ...] = ()
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StageTime:
    """Seconds a pipeline stage computed (`busy_s`) and waited for work it expected (`idle_s`) since the
    previous step result: the increments, so summing them over steps gives the stage's totals."""

    stage: int
    busy_s: float
    idle_s: float


@dataclass(frozen=True)
class StepResult:
    """The outcome of one `Engine.step()`.

    Invariants:
    - `batch` is the scheduler batch this step completed (its tokens are in `outputs`), or None when
      the step completed none (nothing to run, or the pipeline failed: then `outputs` are the error
      finishes of every live request). With a pipeline, a step completes at most one micro-batch.
    - `outputs` has at most one entry per request.
    - `times` are this step's wall times (all zero when `batch` is None).
    - `stats` is the engine's load report taken at the end of the step (what the Stats RPC serves);
      a stop-string finish that the caller applies afterwards shows in the next report.
    - `stage_time` is stage 0's busy/idle increment when the engine drives a pipeline, else None.
    - `ended_at` is the wall-clock time (`time.time()`) the step ended.
    """

    outputs: tuple[EngineOutput, ...]
    batch: SchedulerOutput | None
    times: IterationTimes
    stats: EngineStats
    stage_time: StageTime | None = None
    ended_at: float = 0.0
