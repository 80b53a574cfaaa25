"""The OpenAI request parser and response renderer (`chariot.router.openai_api`), without a server.

Every malformed body must become an `InvalidRequestError` naming the field (→ 400), never another
exception (→ 500): checked field by field, then by a hypothesis fuzz over arbitrary JSON and bytes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chariot.contracts.errors import AdmissionRejected, InvalidRequestError, NoReplicaAvailable, UnknownModelError
from chariot.contracts.outputs import TokenLogprobs
from chariot.contracts.proto_codec import DEFAULT_MAX_TOKENS
from chariot.contracts.requests import FinishReason
from chariot.contracts.sampling_params import SamplingParams
from chariot.contracts.tokenizer import Tokenizer
from chariot.router.openai_api import (
    LOGPROB_FLOOR,
    MAX_BODY_BYTES,
    MAX_CHOICES,
    OpenAIRequest,
    check_request_id,
    check_tenant,
    choice,
    echo_text,
    envelope,
    error_payload,
    logprobs_payload,
    parse_chat,
    parse_completion,
    parse_json_object,
    usage,
)
from chariot.router.upstream import ReplicaUnavailable


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def field_of(fn: Any, *args: Any) -> str:
    with pytest.raises(InvalidRequestError) as err:
        fn(*args)
    return err.value.field


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


# ---- completions ------------------------------------------------------------------------------------


def test_minimal_completion_takes_defaults() -> None:
    req = parse_completion(body(prompt="hello"))
    assert req == OpenAIRequest(kind="completion", prompt="hello", params=SamplingParams(max_tokens=DEFAULT_MAX_TOKENS))


def test_every_honoured_field() -> None:
    req = parse_completion(
        body(
            prompt=[1, 2, 3],
            model="tiny",
            max_tokens=7,
            temperature=0,
            top_p=0.5,
            top_k=4,
            seed=9,
            stop=["a", "b"],
            ignore_eos=True,
            stream=True,
            stream_options={"include_usage": True},
            return_token_ids=True,
            user="acme",
            frequency_penalty=0.0,  # accepted and ignored, as OpenAI's own server does with unknown fields
        )
    )
    assert req.prompt == [1, 2, 3] and req.model == "tiny" and req.user == "acme"
    assert (req.stream, req.include_usage, req.return_token_ids) == (True, True, True)
    assert req.params == SamplingParams(
        max_tokens=7, temperature=0.0, top_p=0.5, top_k=4, seed=9, stop=("a", "b"), ignore_eos=True
    )


def test_nulls_mean_not_given_and_a_batch_of_one_is_unwrapped() -> None:
    nulls = {k: None for k in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "user")}
    assert parse_completion(body(prompt=["hi"], **nulls)).prompt == "hi"
    assert parse_completion(body(prompt=[[5, 6]])).prompt == [5, 6]
    assert parse_completion(body(prompt="x", stop="end")).params.stop == ("end",)


BAD_COMPLETIONS: list[tuple[str, dict[str, Any], str]] = [
    ("no prompt", {}, "prompt"),
    ("null prompt", {"prompt": None}, "prompt"),
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("empty ids", {"prompt": []}, "prompt"),
    ("prompt number", {"prompt": 5}, "prompt"),
    ("prompt object", {"prompt": {"a": 1}}, "prompt"),
    ("batch", {"prompt": ["a", "b"]}, "prompt"),
    ("float id", {"prompt": [1, 2.5]}, "prompt"),
    ("bool id", {"prompt": [True]}, "prompt"),
    ("negative id", {"prompt": [-1]}, "prompt"),
    ("huge id", {"prompt": [2**64]}, "prompt"),
    ("max_tokens 0", {"max_tokens": 0}, "max_tokens"),
    ("max_tokens negative", {"max_tokens": -5}, "max_tokens"),
    ("max_tokens huge", {"max_tokens": 2**40}, "max_tokens"),
    ("max_tokens string", {"max_tokens": "10"}, "max_tokens"),
    ("max_tokens float", {"max_tokens": 10.0}, "max_tokens"),
    ("max_tokens bool", {"max_tokens": True}, "max_tokens"),
    ("temperature < 0", {"temperature": -0.1}, "temperature"),
    ("temperature string", {"temperature": "hot"}, "temperature"),
    ("temperature huge", {"temperature": 10**400}, "temperature"),
    ("top_p 0", {"top_p": 0}, "top_p"),
    ("top_p > 1", {"top_p": 1.5}, "top_p"),
    ("top_p list", {"top_p": [0.5]}, "top_p"),
    ("top_k < 0", {"top_k": -1}, "top_k"),
    ("top_k float", {"top_k": 1.5}, "top_k"),
    ("seed < 0", {"seed": -1}, "seed"),
    ("seed string", {"seed": "1"}, "seed"),
    ("stop number", {"stop": 3}, "stop"),
    ("stop mixed", {"stop": ["a", 1]}, "stop"),
    ("stop empty string", {"stop": [""]}, "stop"),
    ("ignore_eos string", {"ignore_eos": "no"}, "ignore_eos"),
    ("stream string", {"stream": "yes"}, "stream"),
    ("stream_options list", {"stream_options": []}, "stream_options"),
    ("include_usage int", {"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ("model number", {"model": 7}, "model"),
    ("user number", {"user": 7}, "user"),
    ("user too long", {"user": "u" * 300}, "user"),
    ("n 0", {"n": 0}, "n"),
    ("n 129", {"n": 129}, "n"),
    ("n negative", {"n": -1}, "n"),
    ("n string", {"n": "x"}, "n"),
    ("n float", {"n": 2.0}, "n"),
    ("n bool", {"n": True}, "n"),
    ("best_of 3", {"best_of": 3}, "best_of"),
    ("echo string", {"echo": "yes"}, "echo"),
    ("logprobs 21", {"logprobs": 21}, "logprobs"),
    ("logprobs negative", {"logprobs": -1}, "logprobs"),
    ("logprobs bool", {"logprobs": True}, "logprobs"),
    ("return_token_ids string", {"return_token_ids": "yes"}, "return_token_ids"),
    ("lone surrogate prompt", {"prompt": "\ud800abc"}, "prompt"),
    ("lone surrogate stop", {"stop": ["ok", "\udc00"]}, "stop[1]"),
    ("lone surrogate user", {"user": "\udfff"}, "user"),
    ("lone surrogate key", {"\ud800": 1}, "body"),
    ("temperature > 2", {"temperature": 2.01}, "temperature"),
    ("top_logprobs", {"top_logprobs": 2}, "top_logprobs"),
    ("presence_penalty range", {"presence_penalty": 2.5}, "presence_penalty"),
    ("frequency_penalty string", {"frequency_penalty": "x"}, "frequency_penalty"),
    ("frequency_penalty range", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("logit_bias key", {"logit_bias": {"x5": 10}}, "logit_bias"),
    ("logit_bias negative key", {"logit_bias": {"-5": 10}}, "logit_bias"),
    ("logit_bias value", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("logit_bias string value", {"logit_bias": {"5": "a"}}, "logit_bias"),
    ("logit_bias list", {"logit_bias": [1]}, "logit_bias"),
    ("min_tokens > max_tokens", {"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ("min_tokens < 0", {"min_tokens": -1}, "min_tokens"),
    ("tools", {"tools": [{"type": "function"}]}, "tools"),
    ("tool_choice", {"tool_choice": "auto"}, "tool_choice"),
    ("response_format json", {"response_format": {"type": "json_object"}}, "response_format"),
]


def test_n_choices_in_range_are_honoured(tokenizer: Tokenizer) -> None:
    assert parse_completion(body(prompt="hi")).n == 1
    assert parse_completion(body(prompt="hi", n=None)).n == 1
    assert parse_completion(body(prompt="hi", n=3, best_of=1)).n == 3  # best_of 1 (neutral) still passes
    assert parse_completion(body(prompt="hi", n=MAX_CHOICES, temperature=0)).n == MAX_CHOICES  # greedy n > 1 too
    chat = parse_chat(body(messages=[{"role": "user", "content": "hi"}], n=2, stream=True), tokenizer)
    assert (chat.n, chat.stream) == (2, True)


@pytest.mark.parametrize("n", [0, MAX_CHOICES + 1])
def test_n_out_of_range_names_the_limit(n: int) -> None:
    with pytest.raises(InvalidRequestError) as err:
        parse_completion(body(prompt="hi", n=n))
    assert err.value.field == "n" and f"[1, {MAX_CHOICES}]" in err.value.message and str(n) in err.value.message


def test_best_of_other_than_one_is_still_refused() -> None:
    with pytest.raises(InvalidRequestError) as err:
        parse_completion(body(prompt="hi", n=2, best_of=2))
    assert err.value.field == "best_of"


def test_echo_puts_the_prompt_text_first(tokenizer: Tokenizer) -> None:
    text = parse_completion(body(prompt="Once upon", echo=True))
    assert text.echo and echo_text(text, None) == "Once upon"
    ids = tokenizer.encode("Once upon a time")
    by_ids = parse_completion(body(prompt=ids, echo=True))
    assert echo_text(by_ids, tokenizer) == tokenizer.decode(ids)
    with pytest.raises(InvalidRequestError) as err:
        echo_text(by_ids, None)  # a router without the model's tokenizer cannot echo token ids
    assert err.value.field == "echo" and "--model" in err.value.message
    assert echo_text(parse_completion(body(prompt="x")), None) == ""


def test_neutral_values_of_unsupported_fields_pass() -> None:
    req = parse_completion(body(prompt="hi", presence_penalty=0, frequency_penalty=0.0, logit_bias={}, min_tokens=0,
                                response_format={"type": "text"}, tools=[], temperature=2))
    assert req.params.temperature == 2 and req.params.logprobs is None


def test_logit_processing_fields_reach_the_sampling_params(tokenizer: Tokenizer) -> None:
    req = parse_completion(body(prompt="hi", max_tokens=8, presence_penalty=0.5, frequency_penalty=-1,
                                logit_bias={"17": 5, "3": -100}, min_tokens=4, logprobs=2))
    p = req.params
    assert (p.presence_penalty, p.frequency_penalty, p.min_tokens, p.logprobs) == (0.5, -1, 4, 2)
    assert p.logit_bias == ((3, -100.0), (17, 5.0))
    assert parse_completion(body(prompt="hi", logprobs=0)).params.logprobs == 0
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat(body(**chat), tokenizer).params.logprobs is None
    assert parse_chat(body(**chat, logprobs=True), tokenizer).params.logprobs == 0
    assert parse_chat(body(**chat, logprobs=True, top_logprobs=20), tokenizer).params.logprobs == 20
    assert parse_chat(body(**chat, logprobs=False), tokenizer).params.logprobs is None
    for bad, name in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                      ({"logprobs": 3}, "logprobs")):
        assert field_of(lambda b: parse_chat(b, tokenizer), json.dumps({**chat, **bad}).encode()) == name


def test_logprobs_render_in_each_endpoints_shape(tokenizer: Tokenizer) -> None:
    lps = [TokenLogprobs(5, -0.5, ((5, -0.5), (9, -1.25))), TokenLogprobs(9, float("-inf"), ((9, -2.0), (5, -3.0)))]
    comp = parse_completion(body(prompt="x", logprobs=2))
    texts = [tokenizer.decode([5]), tokenizer.decode([9])]
    assert logprobs_payload(comp, lps, tokenizer, text_offset=4) == {
        "tokens": texts,
        "token_logprobs": [-0.5, LOGPROB_FLOOR],
        "top_logprobs": [{texts[0]: -0.5, texts[1]: -1.25}, {texts[1]: -2.0, texts[0]: -3.0}],
        "text_offset": [4, 4 + len(texts[0])],
    }
    assert logprobs_payload(comp, lps[:1], None)["tokens"] == ["token_id:5"]  # no tokenizer at the router
    chat = parse_chat(body(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=1), tokenizer)
    first = logprobs_payload(chat, lps[:1], tokenizer)["content"][0]
    assert first == {"token": texts[0], "logprob": -0.5, "bytes": list(texts[0].encode()),
                     "top_logprobs": [{"token": texts[0], "logprob": -0.5, "bytes": list(texts[0].encode())},
                                      {"token": texts[1], "logprob": -1.25, "bytes": list(texts[1].encode())}]}
    assert logprobs_payload(parse_completion(body(prompt="x")), lps, tokenizer) is None


def test_lone_surrogates_in_chat_name_the_message(tokenizer: Tokenizer) -> None:
    raw = b'{"messages": [{"role": "user", "content": "fine"}, {"role": "user", "content": "x\\ud800"}]}'
    assert field_of(parse_chat, raw, tokenizer) == "messages[1].content"
    parts = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}'
    assert field_of(parse_chat, parts, tokenizer) == "messages[0].content[0].text"


@pytest.mark.parametrize(("name", "fields", "field"), BAD_COMPLETIONS, ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completion_names_the_field(name: str, fields: dict[str, Any], field: str) -> None:
    obj = fields if "prompt" in fields or not fields else {"prompt": "hello", **fields}
    assert field_of(parse_completion, json.dumps(obj).encode()) == field


@pytest.mark.parametrize(
    "raw",
    [b"", b"   ", b"{", b"[1, 2]", b'"text"', b"null", b"\xff\xfe\x00garbage", b"[" * 100_000, b"{'a': 1}"],
    ids=["empty", "blank", "truncated", "array", "string", "null", "bad utf-8", "deep nesting", "single quotes"],
)
def test_malformed_body_names_body(raw: bytes) -> None:
    assert field_of(parse_completion, raw) == "body"


def test_oversized_body_and_headers() -> None:
    assert field_of(parse_json_object, b" " * (MAX_BODY_BYTES + 1)) == "body"
    assert field_of(parse_completion, b'{"prompt": 1' + b"0" * 5000 + b"}") == "body"  # int past the digit limit
    assert field_of(check_request_id, "r" * 300) == "request_id"
    assert field_of(check_tenant, "t" * 300) == "user"
    assert check_request_id("abc") == "abc" and check_tenant("acme") == "acme"


def test_nan_and_infinity_are_rejected_by_range() -> None:
    assert field_of(parse_completion, b'{"prompt": "x", "temperature": NaN}') == "temperature"
    assert field_of(parse_completion, b'{"prompt": "x", "top_p": Infinity}') == "top_p"


# ---- chat -------------------------------------------------------------------------------------------


def test_chat_renders_the_template(tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    req = parse_chat(body(messages=messages, max_completion_tokens=5, temperature=0), tokenizer)
    assert req.kind == "chat"
    assert req.prompt == tokenizer.apply_chat_template(messages)
    assert req.params.max_tokens == 5 and req.params.temperature == 0.0


def test_chat_text_parts_are_joined(tokenizer: Tokenizer) -> None:
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    req = parse_chat(body(messages=[{"role": "user", "content": parts}]), tokenizer)
    assert req.prompt == tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])


def test_chat_without_tokenizer_names_messages() -> None:
    err_field = field_of(parse_chat, body(messages=[{"role": "user", "content": "hi"}]), None)
    assert err_field == "messages"


BAD_CHATS: list[tuple[str, Any, str]] = [
    ("no messages", {}, "messages"),
    ("empty messages", {"messages": []}, "messages"),
    ("messages string", {"messages": "hi"}, "messages"),
    ("message not object", {"messages": ["hi"]}, "messages[0]"),
    ("bad role", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("missing content", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("content number", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ("max_completion_tokens 0", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("echo on chat", {"echo": True}, "echo"),
    ("max_tokens too big", {"max_tokens": 2**40}, "max_tokens"),
]


@pytest.mark.parametrize(("name", "fields", "field"), BAD_CHATS, ids=[c[0] for c in BAD_CHATS])
def test_bad_chat_names_the_field(name: str, fields: dict[str, Any], field: str, tokenizer: Tokenizer) -> None:
    obj = fields if "messages" in fields or not fields else {"messages": [{"role": "user", "content": "x"}], **fields}
    assert field_of(parse_chat, json.dumps(obj).encode(), tokenizer) == field


# ---- rendering --------------------------------------------------------------------------------------


def test_completion_and_chat_shapes() -> None:
    comp = parse_completion(body(prompt="x", return_token_ids=True))
    assert envelope(comp, "r1", 5, "tiny", chunk=False) == {
        "id": "cmpl-r1",
        "object": "text_completion",
        "created": 5,
        "model": "tiny",
    }
    assert choice(comp, "hi", FinishReason.LENGTH, [1, 2]) == {
        "index": 0,
        "text": "hi",
        "logprobs": None,
        "token_ids": [1, 2],
        "finish_reason": "length",
    }
    chat = OpenAIRequest(kind="chat", prompt="p", params=SamplingParams())
    assert envelope(chat, "r2", 5, "tiny", chunk=True)["object"] == "chat.completion.chunk"
    assert envelope(chat, "r2", 5, "tiny", chunk=False)["id"] == "chatcmpl-r2"
    assert choice(chat, "a", None, delta=True, first=True)["delta"] == {"role": "assistant", "content": "a"}
    assert choice(chat, "b", FinishReason.STOP, delta=True) == {
        "index": 0,
        "delta": {"content": "b"},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert choice(chat, "c", FinishReason.STOP)["message"] == {"role": "assistant", "content": "c"}
    assert usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                           "prompt_tokens_details": {"cached_tokens": 0}}
    assert usage(40, 4, 32)["prompt_tokens_details"] == {"cached_tokens": 32}


def test_each_choice_carries_its_index() -> None:
    comp = parse_completion(body(prompt="x", n=3))
    assert choice(comp, "hi", FinishReason.LENGTH, index=2) == {
        "index": 2,
        "text": "hi",
        "logprobs": None,
        "finish_reason": "length",
    }
    chat = OpenAIRequest(kind="chat", prompt="p", params=SamplingParams(), n=2)
    assert choice(chat, "a", None, delta=True, first=True, index=1) == {
        "index": 1,
        "delta": {"role": "assistant", "content": "a"},
        "logprobs": None,
        "finish_reason": None,
    }
    assert choice(chat, "c", FinishReason.STOP, index=1)["index"] == 1


@pytest.mark.parametrize(
    ("exc", "status", "kind", "code", "param"),
    [
        (InvalidRequestError("top_p", "bad"), 400, "invalid_request_error", "invalid_argument", "top_p"),
        (UnknownModelError("x", "tiny"), 404, "invalid_request_error", "model_not_found", "model"),
        (AdmissionRejected("slo", 2.2), 429, "rate_limit_error", "resource_exhausted", None),
        (NoReplicaAvailable("none"), 503, "service_unavailable_error", "unavailable", None),
        (ReplicaUnavailable("died"), 503, "service_unavailable_error", "unavailable", None),
        (RuntimeError("bug"), 500, "server_error", "internal", None),
    ],
)
def test_error_payload_follows_error_status(exc: Exception, status: int, kind: str, code: str, param: Any) -> None:
    got_status, payload, headers = error_payload(exc)
    assert got_status == status
    assert payload["error"]["type"] == kind and payload["error"]["code"] == code and payload["error"]["param"] == param
    if isinstance(exc, AdmissionRejected):
        assert headers == {"Retry-After": str(math.ceil(exc.retry_after_s))}
    else:
        assert headers == {}


# ---- fuzz -------------------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
    "ignore_eos", "stream", "stream_options", "model", "user", "n", "best_of", "echo", "logprobs", "return_token_ids",
    "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens", "tools", "response_format",
]  # fmt: skip


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fields=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=8),
    raw=st.none() | st.binary(max_size=64),
)
def test_fuzz_parse_raises_only_invalid_request(
    fields: dict[str, Any], raw: bytes | None, tokenizer: Tokenizer
) -> None:
    data = raw if raw is not None else json.dumps(fields).encode()
    for parse in (parse_completion, lambda b: parse_chat(b, tokenizer), lambda b: parse_chat(b, None)):
        try:
            req = parse(data)
        except InvalidRequestError as exc:
            assert exc.field and isinstance(exc.message, str)
            continue
        assert isinstance(req.params, SamplingParams)
        assert isinstance(req.prompt, str | list) and req.prompt
