"""Beside the engine, as in vLLM v1: turns its token deltas into the text deltas the fronts stream.

Why a module of its own: the engine loop should only schedule, run the model and apply the stop
conditions it can see in token ids. Text is a separate job with state of its own per request: an
`IncrementalDetokenizer` (each token is detokenized once), and the text held back while a stop
string may still be forming. The `OutputProcessor` owns that state, applies stop strings, and
produces the `RequestOutput` deltas (O(1) per token: nothing re-sends the whole text). When a stop
string matches, the request's output is final at once, and the processor names the request in
`ProcessedOutputs.stop_request_ids`: its caller must finish it in the engine
(`engine.finish_requests(ids, FinishReason.STOP)`, which frees its KV blocks) before the next step.
`run_step` does exactly that; every driver of an engine (AsyncEngine, `LLM.generate`, the offline
`chariot generate`) goes through it.

Text rules (those the engine had before this split): EOS and stop token ids are never detokenized;
the text ends before the earliest stop string; when a request finishes by length, the detokenizer
flushes what it held back (a multi-byte character cut short comes out as U+FFFD).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from chariot.contracts.outputs import RequestOutput
from chariot.contracts.requests import FinishReason, RequestTimes
from chariot.contracts.sampling_params import SamplingParams
from chariot.contracts.tokenizer import IncrementalDetokenizer, Tokenizer
from chariot.worker.engine_output import EngineOutput, StepResult


@dataclass(frozen=True)
class ProcessedOutputs:
    """The fronts' outputs of a batch of engine outputs, and the requests a stop string finished
    (the caller must finish those in the engine before its next step)."""

    outputs: tuple[RequestOutput, ...]
    stop_request_ids: tuple[str, ...]


@dataclass
class _RequestState:
    stop: tuple[str, ...]
    detok: IncrementalDetokenizer
    held: str = ""  # detokenized, not yet emitted: a stop string may still be forming in it
    ready: str = ""  # detokenized before min_tokens, not yet emitted: no stop string can cut it
    min_tokens: int = 0  # stop strings end the request only from this many output tokens on


class OutputProcessor:
    """Per-request text state for one engine; not thread-safe (runs on the engine's thread)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, params: SamplingParams) -> None:
        """Start tracking a request the engine has just accepted."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already tracked")
        self._requests[request_id] = _RequestState(params.stop, IncrementalDetokenizer(self._tokenizer),
                                                   min_tokens=params.min_tokens)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def process(self, outputs: Iterable[EngineOutput]) -> ProcessedOutputs:
        """One `RequestOutput` per engine output of a tracked request; outputs of requests this
        processor does not track (never added, or already finished here) are dropped."""
        results: list[RequestOutput] = []
        stops: list[str] = []
        for out in outputs:
            state = self._requests.get(out.request_id)
            if state is None:
                continue
            result = self._process_one(state, out)
            if result.finished:
                del self._requests[out.request_id]
                if not out.finished:  # finished here, by a stop string: the engine must follow
                    stops.append(out.request_id)
            results.append(result)
        return ProcessedOutputs(tuple(results), tuple(stops))

    def _process_one(self, state: _RequestState, out: EngineOutput) -> RequestOutput:
        tokens = list(out.new_token_ids)
        before = out.num_output_tokens - len(tokens)
        stopped = self._detokenize(state, tokens, skip_last=out.stop_token_id is not None, before=before)
        reason = FinishReason.STOP if stopped else out.finish_reason
        if reason is FinishReason.LENGTH:  # stopped mid-character? emit what the detokenizer held back
            state.held += state.detok.flush()
        return RequestOutput(
            request_id=out.request_id,
            new_token_ids=tokens,
            new_text=_release(state, finished=reason is not None),
            num_prompt_tokens=len(out.prompt_token_ids),
            num_output_tokens=out.num_output_tokens - (len(out.new_token_ids) - len(tokens)),
            finish_reason=reason,
            times=_delta_times(out, len(tokens), stopped_here=stopped and not out.finished),
            num_preemptions=out.num_preemptions,
            error=out.error,
            new_logprobs=list(out.new_logprobs[: len(tokens)]),
            num_cached_tokens=out.num_cached_tokens if reason is not None else 0,
        )

    @staticmethod
    def _detokenize(state: _RequestState, tokens: list[int], skip_last: bool, before: int = 0) -> bool:
        """Add `tokens`' text to `state.held` one token at a time; on a stop string (once the request
        has `min_tokens`; `before` tokens preceded these), cut the text before it, drop the tokens
        after the one that completed it, and return True."""
        for i, token in enumerate(tokens[:-1] if skip_last else tokens):
            state.held += state.detok.step(token)
            if before + i + 1 < state.min_tokens:  # stop strings do not count yet: all of it may go
                state.ready, state.held = state.ready + state.held, ""
                continue
            cut = find_stop(state.held, state.stop)
            if cut is not None:
                state.held = state.held[:cut]
                del tokens[i + 1 :]
                return True
        return False


def _delta_times(out: EngineOutput, kept: int, stopped_here: bool) -> RequestTimes:
    """The output's timestamps for the `kept` tokens that survive a stop string; a stop string ends
    the request here, before the engine stamps its end."""
    t = out.times
    finished = time.time() if stopped_here else t.finished
    return RequestTimes(t.arrival, t.first_scheduled, t.first_token, t.token_times[:kept], finished)


def _release(state: _RequestState, finished: bool) -> str:
    """The text that can be emitted now: all of it once finished, else all but a forming stop string."""
    keep = 0 if finished else forming_stop_len(state.held, state.stop)
    cut = len(state.held) - keep
    text, state.held, state.ready = state.ready + state.held[:cut], state.held[cut:], ""
    return text


def find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index of the earliest occurrence of any stop string in `text`, or None."""
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    return min(hits) if hits else None


def forming_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string: text that a
    later token may turn into a stop string, so it must not be streamed yet."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class SteppableEngine(Protocol):
    """What `run_step` needs of an engine."""

    def step(self) -> StepResult: ...

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason) -> tuple[EngineOutput, ...]: ...


def run_step(engine: SteppableEngine, processor: OutputProcessor) -> tuple[StepResult, tuple[RequestOutput, ...]]:
    """One engine step through the processor. Requests a stop string finished are finished in the
    engine (KV blocks freed) before this returns, so the next step never schedules them."""
    result = engine.step()
    processed = processor.process(result.outputs)
    if processed.stop_request_ids:
        engine.finish_requests(processed.stop_request_ids, FinishReason.STOP)
    return result, processed.outputs
