"""Conversion and validation between the `chariot.v1` protobuf messages and engine types.

Why a module of its own: the worker's gRPC server and the router both speak `chariot.v1`, and both must
turn the same wire request into the same engine request and reject the same bad input with the same
field-naming `InvalidRequestError`. Keeping this transport-level (no server or engine state) lets both
fronts share it. Checks that need the model (prompt length, token-id range) stay in
`Engine.validate_prompt`; everything else is checked here or by `SamplingParams` itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from chariot.contracts.errors import InvalidRequestError, UnknownModelError
from chariot.contracts.outputs import EngineStats, RequestOutput, TokenLogprobs
from chariot.contracts.requests import FinishReason, Prompt, RequestTimes
from chariot.contracts.sampling_params import SamplingParams
from chariot.proto.chariot.v1 import generation_pb2 as pb

DEFAULT_MAX_TOKENS = 16
MAX_REQUEST_ID_CHARS = 256

_FINISH_TO_PROTO: dict[FinishReason | None, pb.FinishReason] = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
_FINISH_FROM_PROTO: dict[int, FinishReason | None] = {v: k for k, v in _FINISH_TO_PROTO.items()}


def finish_reason_to_proto(reason: FinishReason | None) -> pb.FinishReason:
    return _FINISH_TO_PROTO[reason]

# Key of `EngineStats.extra` that the Stats RPC reports as `prefill_tokens_per_s` (set by AsyncEngine).
PREFILL_TOKENS_PER_S = "prefill_tokens_per_s"
# Key of `EngineStats.extra` that the Stats RPC reports as `budget_tokens_per_s` (set by AsyncEngine).
BUDGET_TOKENS_PER_S = "budget_tokens_per_s"


# ---- requests ---------------------------------------------------------------------------------
def request_from_proto(req: Any, served_model: str) -> tuple[Prompt, SamplingParams, str]:
    """(prompt, params, request_id) of a `GenerateRequest`; raises InvalidRequestError naming the field.

    An empty `request_id` stays empty (the engine side generates one).
    """
    if req.model and req.model != served_model:
        raise UnknownModelError(req.model, served_model)
    request_id = _request_id(req.request_id)
    prompt = prompt_from_proto(req)
    params = params_from_proto(req.sampling if req.HasField("sampling") else None)
    return prompt, params, request_id


def _request_id(value: str) -> str:
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError("request_id", f"must be at most {MAX_REQUEST_ID_CHARS} characters, got {len(value)}")
    return value


def prompt_from_proto(req: Any) -> Prompt:
    """The prompt oneof: text or token ids, never absent or empty."""
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequestError("prompt", "must be set (text or token_ids)")
    if kind == "text":
        if not req.text:
            raise InvalidRequestError("prompt", "must not be empty")
        return str(req.text)
    ids = [int(t) for t in req.token_ids.ids]
    if not ids:
        raise InvalidRequestError("prompt", "token_ids must contain at least one token")
    return ids


def params_from_proto(msg: Any | None) -> SamplingParams:
    """SamplingParams from the proto message; unset optional fields take the SamplingParams defaults."""
    if msg is None:
        return SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)
    kwargs: dict[str, Any] = {"max_tokens": DEFAULT_MAX_TOKENS}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs"):
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    return SamplingParams(
        stop=tuple(msg.stop),
        stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
        ignore_eos=bool(msg.ignore_eos),
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        logit_bias=tuple(msg.logit_bias.items()),
        min_tokens=int(msg.min_tokens),
        **kwargs,
    )


def params_to_proto(params: SamplingParams) -> Any:
    """The `chariot.v1.SamplingParams` message carrying every field of `params` explicitly."""
    msg = pb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=dict(params.logit_bias),
        min_tokens=params.min_tokens,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


def request_to_proto(
    prompt: str | Sequence[int],
    params: SamplingParams,
    request_id: str = "",
    model: str = "",
    tenant: str = "",
) -> Any:
    """A `GenerateRequest` (what a router or client sends to a worker)."""
    req = pb.GenerateRequest(request_id=request_id, sampling=params_to_proto(params), model=model, tenant=tenant)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)
    return req


# ---- responses --------------------------------------------------------------------------------
def response_from_output(out: RequestOutput) -> Any:
    """One streamed `GenerateResponse`: the delta's new token ids, text, logprobs and token times
    (never the whole output: streaming stays O(1) per token), plus running totals and timing, and on
    the request's final delta its prompt tokens found in the prefix cache."""
    return pb.GenerateResponse(
        request_id=out.request_id,
        token_ids=out.new_token_ids,
        text=out.new_text,
        finish_reason=finish_reason_to_proto(out.finish_reason),
        timing=timing_to_proto(out.times),
        prompt_tokens=out.num_prompt_tokens,
        completion_tokens=out.num_output_tokens,
        error=out.error or "",
        logprobs=[logprobs_to_proto(lp) for lp in out.new_logprobs],
        cached_prompt_tokens=out.num_cached_tokens,
    )


def output_from_response(msg: Any, wire: bytes = b"", replica: str = "") -> RequestOutput:
    """The `RequestOutput` a `GenerateResponse` carries (the inverse of `response_from_output`);
    `wire` is the message's serialized form when it arrived as bytes, kept for relaying."""
    return RequestOutput(
        request_id=msg.request_id,
        new_token_ids=[int(t) for t in msg.token_ids],
        new_text=msg.text,
        num_prompt_tokens=int(msg.prompt_tokens),
        num_output_tokens=int(msg.completion_tokens),
        finish_reason=finish_reason_from_proto(msg.finish_reason),
        times=timing_from_proto(msg.timing),
        error=msg.error or None,
        new_logprobs=[logprobs_from_proto(m) for m in msg.logprobs],
        num_cached_tokens=int(msg.cached_prompt_tokens),
        replica=replica,
        wire=wire,
    )


def logprobs_to_proto(lp: TokenLogprobs) -> Any:
    return pb.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=[t for t, _ in lp.top],
                            top_logprobs=[v for _, v in lp.top])


def logprobs_from_proto(msg: Any) -> TokenLogprobs:
    return TokenLogprobs(int(msg.token_id), float(msg.logprob),
                         tuple(zip((int(t) for t in msg.top_token_ids), msg.top_logprobs, strict=True)))


def timing_to_proto(times: RequestTimes) -> Any:
    """Wall-clock timestamps; 0 where an event has not happened yet."""
    return pb.Timing(
        arrival=times.arrival,
        first_scheduled=times.first_scheduled or 0.0,
        first_token=times.first_token or 0.0,
        last_token=times.token_times[-1] if times.token_times else 0.0,
        token_times=times.token_times,
        finished=times.finished or 0.0,
    )


def timing_from_proto(msg: Any) -> RequestTimes:
    """The inverse of `timing_to_proto` (0 becomes None)."""
    return RequestTimes(arrival=msg.arrival, first_scheduled=msg.first_scheduled or None,
                        first_token=msg.first_token or None, token_times=list(msg.token_times),
                        finished=msg.finished or None)


def finish_reason_from_proto(value: int) -> FinishReason | None:
    """The engine's FinishReason for a proto enum value (None while generating or if unknown)."""
    return _FINISH_FROM_PROTO.get(value)


# ---- load reports -----------------------------------------------------------------------------
def stats_to_proto(stats: EngineStats, model: str, max_model_len: int) -> Any:
    """The `StatsResponse` load report.

    `prefill_tokens_per_s` and `budget_tokens_per_s` come from `stats.extra` (AsyncEngine measures
    them; 0 when absent).
    """
    return pb.StatsResponse(
        model=model,
        num_waiting=stats.num_waiting,
        num_running=stats.num_running,
        queued_prefill_tokens=stats.queued_prefill_tokens,
        kv_cache_usage=stats.kv_cache_usage,
        num_free_blocks=stats.num_free_blocks,
        num_blocks=stats.num_blocks,
        token_budget=stats.token_budget,
        max_batch_size=stats.max_batch_size,
        max_model_len=max_model_len,
        num_preemptions=stats.num_preemptions,
        last_iteration_s=stats.last_iteration_s,
        prefill_tokens_per_s=float(stats.extra.get(PREFILL_TOKENS_PER_S, 0.0)),
        budget_tokens_per_s=float(stats.extra.get(BUDGET_TOKENS_PER_S, 0.0)),
        pipeline_stages=stats.pipeline_stages,
        bubble_fraction=stats.bubble_fraction,
        iterations=stats.iterations,
    )
