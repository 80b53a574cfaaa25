"""What the engine streams back per request and step, and its load report."""

from __future__ import annotations

from dataclasses import dataclass, field

from chariot.contracts.requests import FinishReason, RequestTimes


@dataclass
class RequestOutput:
    """A request's state after one engine step.

    `new_token_ids`/`new_text` are this step's delta (what a streaming front sends);
    `token_ids`/`text` are everything generated so far. `text` never contains a stop string or
    the special EOS text; while a stop string might still be forming, its prefix is held back.
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    times: RequestTimes
    num_preemptions: int = 0
    error: str | None = None


@dataclass(frozen=True)
class IterationTimes:
    """Wall time of the parts of one engine step, in seconds."""

    schedule: float
    prepare: float
    execute: float
    postprocess: float

    @property
    def overhead(self) -> float:
        """Engine work that is not the forward pass: scheduling plus input preparation."""
        return self.schedule + self.prepare

    @property
    def total(self) -> float:
        return self.schedule + self.prepare + self.execute + self.postprocess


@dataclass(frozen=True)
class EngineStats:
    """Load report used by the router (DESIGN.md §4 `Stats`)."""

    num_waiting: int
    num_running: int
    queued_prefill_tokens: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    token_budget: int
    max_batch_size: int
    num_preemptions: int
    last_iteration_s: float
    iterations: int
    pipeline_stages: int = 1
    bubble_fraction: float = 0.0  # share of stage time idle while work was in flight (pipeline bubbles)
    extra: dict[str, float] = field(default_factory=dict)
