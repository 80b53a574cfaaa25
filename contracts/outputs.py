"""What the worker streams back per request and step, the whole result built from it, and the load report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from chariot.contracts.requests import FinishReason, RequestTimes


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability under the model (its raw logits, before penalties, bias,
    temperature or top-k/top-p) and the `SamplingParams.logprobs` most likely tokens with theirs,
    most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """One request's delta after one engine step: what a streaming front sends, O(1) per token.

    `new_token_ids`/`new_text` are only what this step added; nothing carries the whole output (a
    consumer that needs it adds the deltas up: `CompletionOutput.from_deltas`). The concatenated
    `new_text`s never contain a stop string or the text of an EOS / stop token; while a stop string
    might still be forming, its prefix is held back and comes in a later delta (or never, if the
    stop string completes). `num_output_tokens` counts every token generated so far.
    `prompt_token_ids` and `times` are shared with the engine, not copied: read only.
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    num_output_tokens: int
    finished: bool
    finish_reason: FinishReason | None
    times: RequestTimes
    num_preemptions: int = 0
    error: str | None = None
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per new token when asked


@dataclass
class CompletionOutput:
    """A request's whole result: its deltas added up (what `LLM.generate` returns).

    `token_ids` are the generated tokens (EOS / stop token ids included); `text` is their detokenized
    text without any stop string.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    times: RequestTimes
    num_preemptions: int = 0
    error: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    @classmethod
    def from_deltas(cls, deltas: Sequence[RequestOutput]) -> CompletionOutput:
        """Concatenate one request's deltas, given in order; the last one supplies the status."""
        if not deltas:
            raise ValueError("from_deltas needs at least one RequestOutput")
        last = deltas[-1]
        return cls(
            request_id=last.request_id,
            prompt_token_ids=last.prompt_token_ids,
            token_ids=[t for d in deltas for t in d.new_token_ids],
            text="".join(d.new_text for d in deltas),
            finished=last.finished,
            finish_reason=last.finish_reason,
            times=last.times,
            num_preemptions=last.num_preemptions,
            error=last.error,
            logprobs=[lp for d in deltas for lp in d.new_logprobs],
        )


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
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since the engine started
    prefix_cache_hits: int = 0  # of those, tokens found cached
    tensor_parallel_size: int = 1
    collective_s: float = 0.0  # seconds stage 0's leader spent in tensor-parallel collectives, since start
    extra: dict[str, float] = field(default_factory=dict)
