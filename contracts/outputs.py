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


@dataclass(frozen=True)
class RequestOutput:
    """One request's delta after one engine step: the one streaming type, from the engine to the fronts.

    The same value is what the output processor makes of an engine step, what crosses the pipe from an
    engine-core process, what `GenerateResponse` carries on the wire (`proto_codec` maps it field for
    field, both ways) and what the router's data plane hands its HTTP and gRPC fronts. Everything in it
    is O(1) per token:
    - `new_token_ids` / `new_text` / `new_logprobs` are only what this step added (one logprob entry
      per new token when the request asked for them). The concatenated `new_text`s never contain a
      stop string or the text of an EOS / stop token; while a stop string might still be forming, its
      prefix is held back and comes in a later delta (or never, if the stop string completes).
    - `times.token_times` holds the times of this delta's new tokens only; the request's other
      timestamps (arrival, first scheduled, first token, finished) are as known at this step.
    - `num_prompt_tokens` and `num_output_tokens` are running totals (every token generated so far).
    - `finish_reason` is set on the request's last delta and only there.
    - `num_cached_tokens` (prompt tokens whose KV the engine reused from its prefix cache, found when
      the request was first scheduled; at most `num_prompt_tokens - 1`) is reported on the last delta
      only, 0 on the others: OpenAI reports it in the final usage, and the wire carries it once.
    - `replica` and `wire` are filled in by the router: the replica that produced the delta and the
      serialized `GenerateResponse` it arrived as, which the router's gRPC front relays unchanged.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: FinishReason | None
    times: RequestTimes
    num_preemptions: int = 0
    error: str | None = None
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
    replica: str = field(default="", compare=False)
    wire: bytes = field(default=b"", repr=False, compare=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """A request's whole result: its deltas added up (what `LLM.generate` returns).

    `token_ids` are the generated tokens (EOS / stop token ids included); `text` is their detokenized
    text without any stop string; `times.token_times` has one entry per generated token.
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
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @classmethod
    def from_deltas(cls, deltas: Sequence[RequestOutput], prompt_token_ids: Sequence[int]) -> CompletionOutput:
        """Concatenate one request's deltas, given in order; the last one supplies the status."""
        if not deltas:
            raise ValueError("from_deltas needs at least one RequestOutput")
        last = deltas[-1]
        t = last.times
        times = RequestTimes(t.arrival, t.first_scheduled, t.first_token,
                             [x for d in deltas for x in d.times.token_times], t.finished)
        return cls(
            request_id=last.request_id,
            prompt_token_ids=list(prompt_token_ids),
            token_ids=[t for d in deltas for t in d.new_token_ids],
            text="".join(d.new_text for d in deltas),
            finished=last.finished,
            finish_reason=last.finish_reason,
            times=times,
            num_preemptions=last.num_preemptions,
            error=last.error,
            logprobs=[lp for d in deltas for lp in d.new_logprobs],
            num_cached_tokens=last.num_cached_tokens,
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
    """Load report used by the router (docs/architecture.md §4 `Stats`)."""

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
