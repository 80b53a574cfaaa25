"""`chariot.contracts.proto_codec`: protobuf ⇄ engine conversions and the field-naming validation."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chariot.contracts.errors import InvalidRequestError, UnknownModelError, error_status
from chariot.contracts.outputs import EngineStats, RequestOutput, TokenLogprobs
from chariot.contracts.proto_codec import (
    BUDGET_TOKENS_PER_S,
    DEFAULT_MAX_TOKENS,
    PREFILL_TOKENS_PER_S,
    finish_reason_from_proto,
    logprobs_from_proto,
    output_from_response,
    params_from_proto,
    params_to_proto,
    request_from_proto,
    request_to_proto,
    response_from_output,
    stats_to_proto,
)
from chariot.contracts.requests import FinishReason, RequestTimes
from chariot.contracts.sampling_params import SamplingParams
from chariot.proto.chariot.v1 import generation_pb2 as pb

MODEL = "served"


def test_defaults_when_sampling_unset() -> None:
    prompt, params, request_id = request_from_proto(pb.GenerateRequest(text="hi"), MODEL)
    assert (prompt, request_id) == ("hi", "")
    assert params == SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)


def test_unset_optional_fields_take_defaults() -> None:
    req = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=0.0))
    _, params, _ = request_from_proto(req, MODEL)
    assert params == SamplingParams(max_tokens=DEFAULT_MAX_TOKENS, temperature=0.0)


def test_explicit_zero_is_not_unset() -> None:
    """`optional` fields keep presence: max_tokens=0 is rejected, not replaced by the default."""
    req = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=0))
    with pytest.raises(InvalidRequestError) as err:
        request_from_proto(req, MODEL)
    assert err.value.field == "max_tokens"


def test_token_ids_prompt_and_request_id() -> None:
    req = pb.GenerateRequest(request_id="r1", token_ids=pb.TokenIds(ids=[1, 2, 3]), model=MODEL)
    assert request_from_proto(req, MODEL)[0::2] == ([1, 2, 3], "r1")


@pytest.mark.parametrize(
    ("req", "field"),
    [
        (pb.GenerateRequest(), "prompt"),
        (pb.GenerateRequest(text=""), "prompt"),
        (pb.GenerateRequest(token_ids=pb.TokenIds()), "prompt"),
        (pb.GenerateRequest(text="x", model="other"), "model"),
        (pb.GenerateRequest(text="x", request_id="r" * 257), "request_id"),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_tokens=-1)), "max_tokens"),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_tokens=2**40)), "max_tokens"),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(temperature=-1.0)), "temperature"),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(temperature=math.inf)), "temperature"),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_p=0.0)), "top_p"),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_p=math.nan)), "top_p"),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_k=-5)), "top_k"),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(seed=-1)), "seed"),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(stop=[""])), "stop"),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(stop_token_ids=[-1])), "stop_token_ids"),
    ],
)
def test_invalid_requests_name_the_field(req: Any, field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        request_from_proto(req, MODEL)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}:")
    expected = ("NOT_FOUND", 404) if field == "model" else ("INVALID_ARGUMENT", 400)  # an unknown model, as OpenAI
    assert error_status(err.value) == expected


def test_unknown_model_is_its_own_error() -> None:
    with pytest.raises(UnknownModelError):
        request_from_proto(pb.GenerateRequest(text="x", model="other"), MODEL)


@given(
    max_tokens=st.integers(1, 1000),
    temperature=st.floats(0.0, 10.0),
    top_p=st.floats(0.01, 1.0),
    top_k=st.integers(0, 1000),
    seed=st.none() | st.integers(0, 2**63 - 1),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=3),
    stop_token_ids=st.lists(st.integers(0, 2**40), max_size=3),
    ignore_eos=st.booleans(),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    logit_bias=st.dictionaries(st.integers(0, 2**40), st.floats(-100, 100), max_size=4),
    min_tokens=st.integers(0, 1),  # max_tokens may be 1
    logprobs=st.none() | st.integers(0, 20),
)
def test_params_round_trip(**kw: Any) -> None:
    params = SamplingParams(**kw)
    assert params_from_proto(params_to_proto(params)) == params


def test_request_round_trip() -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0, seed=7, stop=("x",))
    for prompt in ("text prompt", [4, 5, 6]):
        req = pb.GenerateRequest.FromString(request_to_proto(prompt, params, "id", MODEL).SerializeToString())
        assert request_from_proto(req, MODEL) == (prompt, params, "id")


def _output(**kw: Any) -> RequestOutput:
    times = RequestTimes(arrival=10.0, first_scheduled=10.5, first_token=11.0, token_times=[11.0, 11.2])
    base: dict[str, Any] = dict(
        request_id="r", new_token_ids=[9], new_text="ab", num_prompt_tokens=3, num_output_tokens=2,
        finish_reason=None, times=times,
    )
    return RequestOutput(**{**base, **kw})


def test_response_carries_delta_totals_and_timing() -> None:
    resp = response_from_output(_output())
    assert (resp.request_id, list(resp.token_ids), resp.text) == ("r", [9], "ab")
    assert (resp.prompt_tokens, resp.completion_tokens, resp.error) == (3, 2, "")
    assert resp.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    assert (resp.timing.arrival, resp.timing.first_scheduled, resp.timing.first_token,
            resp.timing.last_token) == (10.0, 10.5, 11.0, 11.2)
    assert list(resp.timing.token_times) == [11.0, 11.2] and resp.timing.finished == 0.0


@pytest.mark.parametrize("reason", [*FinishReason, None])
def test_output_round_trips_through_the_wire(reason: FinishReason | None) -> None:
    """What the worker streams is what the router reads back: field for field, one delta type."""
    lps = [TokenLogprobs(9, -0.5, ((9, -0.5), (4, -2.0)))]
    times = RequestTimes(arrival=10.0, first_scheduled=10.5, first_token=11.0, token_times=[11.2],
                         finished=11.3 if reason else None)
    out = _output(times=times, finish_reason=reason, error="boom" if reason is FinishReason.ERROR else None,
                  new_logprobs=lps, num_cached_tokens=32 if reason else 0)  # reported on the final delta
    raw = response_from_output(out).SerializeToString()
    msg = pb.GenerateResponse.FromString(raw)
    assert msg.cached_prompt_tokens == out.num_cached_tokens
    back = output_from_response(msg, raw, "replica-0")
    assert back == out and (back.wire, back.replica) == (raw, "replica-0")


def test_unset_timing_is_zero() -> None:
    resp = response_from_output(_output(times=RequestTimes(arrival=1.0)))
    assert (resp.timing.first_scheduled, resp.timing.first_token, resp.timing.last_token) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("reason", [*FinishReason, None])
def test_finish_reasons_round_trip(reason: FinishReason | None) -> None:
    error = "boom" if reason is FinishReason.ERROR else None
    resp = response_from_output(_output(finish_reason=reason, error=error))
    assert finish_reason_from_proto(resp.finish_reason) is reason
    assert resp.error == (error or "")


def test_stats_to_proto() -> None:
    stats = EngineStats(
        num_waiting=2, num_running=3, queued_prefill_tokens=100, kv_cache_usage=0.25, num_free_blocks=96,
        num_blocks=128, token_budget=512, max_batch_size=64, num_preemptions=1, last_iteration_s=0.02,
        iterations=7, pipeline_stages=2, bubble_fraction=0.1,
        extra={PREFILL_TOKENS_PER_S: 1234.5, BUDGET_TOKENS_PER_S: 4321.0},
    )
    msg = stats_to_proto(stats, MODEL, 256)
    assert msg.model == MODEL and msg.max_model_len == 256
    assert (msg.num_waiting, msg.num_running, msg.queued_prefill_tokens) == (2, 3, 100)
    assert (msg.num_free_blocks, msg.num_blocks, msg.token_budget, msg.max_batch_size) == (96, 128, 512, 64)
    assert (msg.num_preemptions, msg.iterations, msg.pipeline_stages) == (1, 7, 2)
    assert msg.kv_cache_usage == pytest.approx(0.25) and msg.last_iteration_s == pytest.approx(0.02)
    assert msg.prefill_tokens_per_s == pytest.approx(1234.5) and msg.bubble_fraction == pytest.approx(0.1)
    assert msg.budget_tokens_per_s == pytest.approx(4321.0)
    unmeasured = stats_to_proto(EngineStats(**{**stats.__dict__, "extra": {}}), MODEL, 256)
    assert unmeasured.prefill_tokens_per_s == 0.0 and unmeasured.budget_tokens_per_s == 0.0


def test_logprobs_travel_in_the_response() -> None:
    lps = [TokenLogprobs(7, -0.25, ((7, -0.25), (3, -1.5))), TokenLogprobs(2, -3.0)]
    out = RequestOutput("r", [7, 2], "ab", 1, 2, None, RequestTimes(arrival=0.0), new_logprobs=lps)
    resp = pb.GenerateResponse.FromString(response_from_output(out).SerializeToString())
    assert [logprobs_from_proto(m) for m in resp.logprobs] == lps


def test_negative_logit_bias_keys_are_invalid() -> None:
    msg = pb.SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(InvalidRequestError) as err:
        params_from_proto(msg)
    assert err.value.field == "logit_bias"
