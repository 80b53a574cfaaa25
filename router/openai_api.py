"""OpenAI-compatible request parsing and response rendering, free of any web framework.

Why one hand-written parser instead of a schema library: every malformed body must become a 400
whose message names the offending field (docs/architecture.md §4), through the same `InvalidRequestError` the
gRPC front and `SamplingParams` raise — never a framework's own 422 or a 500. Keeping parsing and
rendering pure (bytes in, dataclasses and dicts out) lets the unit tests cover every field without a
server, and keeps the HTTP front a thin adapter.

Honoured request fields (others are accepted and ignored, like OpenAI's own server ignores unknown
ones): `model`, `prompt` (string or list of token ids; a one-element batch of either is unwrapped) or
`messages` (chat), `max_tokens` (chat also `max_completion_tokens`), `temperature` (0–2), `top_p`
((0, 1]), `top_k`, `seed`, `stop` (string or list of strings), `ignore_eos`, `stream`,
`stream_options {include_usage}`, `user` (the rate-limit tenant), `n` (1–`MAX_CHOICES` choices,
each sampled as its own request; with a `seed`, choice i uses `seed + i`), `echo` (completions: the
prompt's text, decoded with the router's tokenizer when it was given as token ids, precedes the
completion), `presence_penalty` / `frequency_penalty` (−2–2), `logit_bias` (token id → −100–100,
ids checked against the vocabulary by the worker), `min_tokens` (vLLM's: EOS, stop ids and stop
strings cannot end the request earlier), logprobs (completions: `logprobs` = 0–20 alternatives;
chat: `logprobs: true` plus `top_logprobs` 0–20; the model's raw log-probabilities, rendered in
each endpoint's OpenAI shape; token texts are `token_id:N` when the router has no tokenizer), and
the vLLM extension `return_token_ids` (adds `token_ids` to each choice). `null` means "not given".
Refused with a 400 naming the field rather than silently dropped: `best_of` other than 1, `echo` on
chat, `echo` with `logprobs` (that would need prompt logprobs), `tools` / `tool_choice` /
`functions`, and a `response_format` other than text. Text that cannot be encoded (JSON escapes of
lone UTF-16 surrogates, e.g. `"\\ud800"`) is a 400 naming the field where it stands.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from chariot.contracts.errors import (
    AdmissionRejected,
    AuthenticationError,
    InvalidRequestError,
    NoReplicaAvailable,
    PermissionDeniedError,
    UnknownModelError,
    error_status,
)
from chariot.contracts.outputs import TokenLogprobs
from chariot.contracts.proto_codec import DEFAULT_MAX_TOKENS, MAX_REQUEST_ID_CHARS
from chariot.contracts.requests import FinishReason, Prompt
from chariot.contracts.sampling_params import SamplingParams
from chariot.contracts.tokenizer import Tokenizer

Kind = Literal["completion", "chat"]

MAX_BODY_BYTES = 4 << 20
MAX_TENANT_CHARS = 256
MAX_TOKEN_ID = (1 << 63) - 1
MAX_CHOICES = 128  # `n`: each choice is a request of its own on the replicas, so it is bounded like a batch
MAX_TEMPERATURE = 2.0
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

_JSON_TYPES: tuple[tuple[type, str], ...] = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed `/v1/completions` or `/v1/chat/completions` body."""

    kind: Kind
    prompt: Prompt
    params: SamplingParams
    model: str = ""
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    user: str = ""
    echo: bool = False  # completions: the prompt's text comes first in the returned text
    n: int = 1  # choices to generate, each as its own request (1..MAX_CHOICES)


# ---- parsing ------------------------------------------------------------------------------------


def json_type(value: object) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if value is None:
        return "null"
    for cls, name in _JSON_TYPES:
        if isinstance(value, cls):
            return name
    return type(value).__name__


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; malformed JSON or another top-level type is a 400 naming `body`."""
    if len(body) > MAX_BODY_BYTES:
        raise InvalidRequestError("body", f"is {len(body)} bytes; the limit is {MAX_BODY_BYTES}")
    if not body.strip():
        raise InvalidRequestError("body", "is empty; expected a JSON object")
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidRequestError("body", f"is not valid JSON ({_short(exc)})") from None
    if not isinstance(value, dict):
        raise InvalidRequestError("body", f"must be a JSON object, got {json_type(value)}")
    check_encodable(value, "")
    return value


def check_encodable(value: object, path: str) -> None:
    """Every string (keys included) must be valid Unicode: JSON may escape a lone UTF-16 surrogate
    (`"\\ud800"`), which no tokenizer or UTF-8 encoder accepts. Raises naming where it stands."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            where = path or "body"
            raise InvalidRequestError(where, f"contains an unpaired UTF-16 surrogate (\\u{ord(value[exc.start]):04x}) "
                                             f"at character {exc.start}; send valid Unicode text") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_encodable(key, path or "body")
            check_encodable(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_encodable(item, f"{path}[{i}]")


def parse_completion(body: bytes) -> OpenAIRequest:
    """A `/v1/completions` request."""
    obj = parse_json_object(body)
    return _request(obj, "completion", _prompt(obj), "max_tokens")


def parse_chat(body: bytes, tokenizer: Tokenizer | None) -> OpenAIRequest:
    """A `/v1/chat/completions` request; the messages are rendered with the model's chat template."""
    obj = parse_json_object(body)
    messages = _messages(obj)
    if tokenizer is None:
        raise InvalidRequestError(
            "messages", "chat completions need the model's chat template: start the router with --model DIR"
        )
    limit_field = "max_completion_tokens" if obj.get("max_completion_tokens") is not None else "max_tokens"
    return _request(obj, "chat", tokenizer.apply_chat_template(messages), limit_field)


def _request(obj: dict[str, Any], kind: Kind, prompt: Prompt, limit_field: str) -> OpenAIRequest:
    _unsupported(obj)
    echo = _bool(obj, "echo") or False
    if echo and kind == "chat":
        raise InvalidRequestError("echo", "is a /v1/completions field; chat completions do not echo")
    if echo and obj.get("logprobs") is not None:
        raise InvalidRequestError("logprobs", "with echo would need the prompt's logprobs, which this server does not "
                                              "compute; leave out one of them")
    stream = _bool(obj, "stream") or False
    options = _object(obj, "stream_options") or {}
    include_usage = _bool(options, "include_usage", "stream_options.include_usage") or False
    return OpenAIRequest(
        kind=kind,
        prompt=prompt,
        params=sampling_params(obj, limit_field, kind),
        model=_str(obj, "model") or "",
        stream=stream,
        include_usage=include_usage,
        return_token_ids=_bool(obj, "return_token_ids") or False,
        user=_tenant(obj),
        echo=echo,
        n=_choices(obj),
    )


def _choices(obj: dict[str, Any]) -> int:
    """`n`: how many choices to generate (null means 1)."""
    n = _int(obj, "n")
    if n is None:
        return 1
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidRequestError("n", f"must be in [1, {MAX_CHOICES}], got {n}")
    return n


def sampling_params(obj: dict[str, Any], limit_field: str = "max_tokens", kind: Kind = "completion") -> SamplingParams:
    """SamplingParams from the body's fields; `SamplingParams` itself checks the ranges."""
    kwargs: dict[str, Any] = {"max_tokens": DEFAULT_MAX_TOKENS}
    given = {
        "max_tokens": _int(obj, limit_field),
        "temperature": _number(obj, "temperature"),
        "top_p": _number(obj, "top_p"),
        "top_k": _int(obj, "top_k"),
        "seed": _int(obj, "seed"),
        "ignore_eos": _bool(obj, "ignore_eos"),
        "presence_penalty": _number(obj, "presence_penalty"),
        "frequency_penalty": _number(obj, "frequency_penalty"),
        "logit_bias": _object(obj, "logit_bias"),
        "min_tokens": _int(obj, "min_tokens"),
        "logprobs": _logprobs(obj, kind),
    }
    kwargs.update({name: value for name, value in given.items() if value is not None})
    temperature = kwargs.get("temperature")
    if temperature is not None and not temperature <= MAX_TEMPERATURE:  # NaN fails too
        raise InvalidRequestError("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {temperature}")
    # SamplingParams names its own fields; the body may have carried them under another name
    body_names = {"max_tokens": limit_field, "logprobs": "top_logprobs" if kind == "chat" else "logprobs"}
    try:
        return SamplingParams(stop=_stop(obj), **kwargs)
    except InvalidRequestError as exc:
        if body_names.get(exc.field, exc.field) != exc.field:
            raise InvalidRequestError(body_names[exc.field], exc.message) from None
        raise


def _prompt(obj: dict[str, Any]) -> Prompt:
    if "prompt" not in obj or obj["prompt"] is None:
        raise InvalidRequestError("prompt", "is required (a string or a list of token ids)")
    value = obj["prompt"]
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise InvalidRequestError("prompt", "must not be empty")
        return value
    if not isinstance(value, list):
        raise InvalidRequestError("prompt", f"must be a string or a list of token ids, got {json_type(value)}")
    if not value:
        raise InvalidRequestError("prompt", "must not be empty")
    if any(isinstance(t, str | list) for t in value):
        raise InvalidRequestError("prompt", "batched prompts are not supported; send one prompt per request")
    for i, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int):
            raise InvalidRequestError("prompt", f"token ids must be integers; item {i} is {json_type(token)}")
        if not 0 <= token <= MAX_TOKEN_ID:
            raise InvalidRequestError("prompt", f"token id {token} at item {i} is out of range")
    return list(value)


def _messages(obj: dict[str, Any]) -> list[dict[str, str]]:
    value = obj.get("messages")
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("messages", f"must be a non-empty array of messages, got {json_type(value)}")
    return [_message(i, m) for i, m in enumerate(value)]


def _message(i: int, message: object) -> dict[str, str]:
    name = f"messages[{i}]"
    if not isinstance(message, dict):
        raise InvalidRequestError(name, f"must be an object with role and content, got {json_type(message)}")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise InvalidRequestError(f"{name}.role", f"must be one of {', '.join(CHAT_ROLES)}, got {role!r:.40}")
    return {"role": str(role), "content": _content(f"{name}.content", message.get("content"))}


def _content(name: str, content: object) -> str:
    """A message's text: a string, or an array of `{"type": "text", "text": ...}` parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(name, f"must be a string or an array of text parts, got {json_type(content)}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{name}[{j}]", 'only {"type": "text", "text": "..."} parts are supported')
        texts.append(part["text"])
    return "".join(texts)


def _unsupported(obj: dict[str, Any]) -> None:
    """Fields a client may rely on that this server does not honour: a 400 naming each, never a
    silent drop. Their neutral values (0, {}, false, text) pass."""
    best_of = _int(obj, "best_of")
    if best_of is not None and best_of != 1:
        raise InvalidRequestError("best_of", f"only 1 is supported (use `n` for several choices), got {best_of}")
    for name in ("tools", "tool_choice", "functions", "function_call"):
        if obj.get(name) not in (None, [], "none"):
            raise InvalidRequestError(name, "tool calling is not supported by this server")
    fmt = _object(obj, "response_format")
    if fmt is not None and fmt.get("type", "text") != "text":
        raise InvalidRequestError("response_format", f"only {{\"type\": \"text\"}} is supported, got "
                                                     f"{str(fmt.get('type'))[:40]!r}")


def _logprobs(obj: dict[str, Any], kind: Kind) -> int | None:
    """How many alternatives per token (None: no logprobs). Completions: `logprobs` is that number;
    chat: `logprobs` is a boolean and `top_logprobs` the number (which needs `logprobs: true`)."""
    if kind == "completion":
        if obj.get("top_logprobs") is not None:
            raise InvalidRequestError("top_logprobs", "is a chat field; on /v1/completions `logprobs` is the number")
        return _int(obj, "logprobs")
    wanted, count = _bool(obj, "logprobs") or False, _int(obj, "top_logprobs")
    if count is not None and not wanted:
        raise InvalidRequestError("top_logprobs", "needs `logprobs: true`")
    return (count or 0) if wanted else None


def _tenant(obj: dict[str, Any]) -> str:
    user = _str(obj, "user") or ""
    if len(user) > MAX_TENANT_CHARS:
        raise InvalidRequestError("user", f"must be at most {MAX_TENANT_CHARS} characters, got {len(user)}")
    return user


def check_request_id(value: str) -> str:
    """A client-chosen request id (the `X-Request-Id` header)."""
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError("request_id", f"must be at most {MAX_REQUEST_ID_CHARS} characters, got {len(value)}")
    return value


def check_tenant(value: str) -> str:
    """A tenant from the `X-Tenant` header."""
    if len(value) > MAX_TENANT_CHARS:
        raise InvalidRequestError("user", f"X-Tenant must be at most {MAX_TENANT_CHARS} characters")
    return value


# typed field readers: None when absent or null, else the value of the right JSON type

Reader = Callable[[object], bool]


def _field(obj: dict[str, Any], key: str, name: str | None, ok: Reader, expected: str) -> Any:
    value = obj.get(key)
    if value is None:
        return None
    if not ok(value):
        raise InvalidRequestError(name or key, f"must be {expected}, got {json_type(value)}")
    return value


def _int(obj: dict[str, Any], key: str, name: str | None = None) -> int | None:
    value: int | None = _field(obj, key, name, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")
    return value


def _number(obj: dict[str, Any], key: str, name: str | None = None) -> float | None:
    value: float | None = _field(
        obj, key, name, lambda v: isinstance(v, int | float) and not isinstance(v, bool), "a number"
    )
    return value


def _bool(obj: dict[str, Any], key: str, name: str | None = None) -> bool | None:
    value: bool | None = _field(obj, key, name, lambda v: isinstance(v, bool), "a boolean")
    return value


def _str(obj: dict[str, Any], key: str, name: str | None = None) -> str | None:
    value: str | None = _field(obj, key, name, lambda v: isinstance(v, str), "a string")
    return value


def _object(obj: dict[str, Any], key: str) -> dict[str, Any] | None:
    value: dict[str, Any] | None = _field(obj, key, None, lambda v: isinstance(v, dict), "an object")
    return value


def _stop(obj: dict[str, Any]) -> tuple[str, ...]:
    value = obj.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InvalidRequestError("stop", f"must be a string or an array of strings, got {json_type(value)}")
    return tuple(value)


def _short(exc: BaseException, limit: int = 120) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---- rendering ----------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's `usage`; `prompt_tokens_details.cached_tokens` counts the prompt tokens the replica
    reused from its prefix cache (always present, 0 without a hit, as OpenAI reports it)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def finish_reason_name(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


def response_id(kind: Kind, request_id: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}"


def echo_text(req: OpenAIRequest, tokenizer: Tokenizer | None) -> str:
    """What `echo` puts before the completion: the prompt's text ("" without echo)."""
    if not req.echo:
        return ""
    if isinstance(req.prompt, str):
        return req.prompt
    if tokenizer is None:
        raise InvalidRequestError("echo", "echoing a token-id prompt needs the model's tokenizer: start the "
                                          "router with --model DIR, or send the prompt as text")
    return tokenizer.decode(list(req.prompt))


LOGPROB_FLOOR = -9999.0  # JSON has no -inf; OpenAI reports impossible tokens like this


def token_text(token_id: int, tokenizer: Tokenizer | None) -> str:
    """One token's text for logprobs (`token_id:N` without the router's tokenizer, as vLLM writes it)."""
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def logprobs_payload(req: OpenAIRequest, lps: Sequence[TokenLogprobs], tokenizer: Tokenizer | None,
                     text_offset: int = 0) -> dict[str, Any] | None:
    """A choice's `logprobs` for these tokens, in the endpoint's shape (None when not asked for).
    Completions give parallel lists; `text_offset` is where the first token's text starts in the
    choice's text (a stream passes the running length)."""
    if req.params.logprobs is None:
        return None
    texts = [token_text(lp.token_id, tokenizer) for lp in lps]
    if req.kind == "chat":
        return {"content": [_chat_logprob(text, lp, tokenizer) for text, lp in zip(texts, lps, strict=True)]}
    offsets = list(itertools.accumulate((len(t) for t in texts[:-1]), initial=text_offset)) if texts else []
    return {
        "tokens": texts,
        "token_logprobs": [_finite(lp.logprob) for lp in lps],
        "top_logprobs": [{token_text(t, tokenizer): _finite(v) for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def _chat_logprob(text: str, lp: TokenLogprobs, tokenizer: Tokenizer | None) -> dict[str, Any]:
    top = [_chat_entry(token_text(t, tokenizer), v) for t, v in lp.top]
    return {**_chat_entry(text, lp.logprob), "top_logprobs": top}


def _chat_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def choice(
    req: OpenAIRequest,
    text: str,
    finish_reason: FinishReason | None,
    token_ids: Sequence[int] = (),
    *,
    delta: bool = False,
    first: bool = False,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """choices[i] of a response (`delta=False`) or of a stream chunk (`delta=True`); `index` is the
    choice's place among the request's `n` (OpenAI clients reassemble interleaved chunks by it);
    `logprobs` as `logprobs_payload` renders it."""
    out: dict[str, Any] = {"index": index}
    if req.kind == "completion":
        out.update(text=text, logprobs=logprobs)
    elif delta:
        out["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        out["logprobs"] = logprobs
    else:
        out["message"] = {"role": "assistant", "content": text}
        out["logprobs"] = logprobs
    if req.return_token_ids:
        out["token_ids"] = list(token_ids)
    out["finish_reason"] = finish_reason_name(finish_reason)
    return out


def envelope(req: OpenAIRequest, request_id: str, created: int, model: str, *, chunk: bool) -> dict[str, Any]:
    """The fields every response and stream chunk share."""
    obj = "text_completion"
    if req.kind == "chat":
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    return {"id": response_id(req.kind, request_id), "object": obj, "created": created, "model": model}


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error"}


def error_payload(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(HTTP status, OpenAI-style error body, headers) for an exception, via `error_status()`."""
    code, status = error_status(exc)
    param = exc.field if isinstance(exc, InvalidRequestError | PermissionDeniedError) else None
    error_code = "model_not_found" if isinstance(exc, UnknownModelError) else code.lower()
    error_code = "invalid_api_key" if isinstance(exc, AuthenticationError) else error_code
    message = str(exc) if status != 500 else f"internal error: {type(exc).__name__}"
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": error_code}}  # fmt: skip
    headers = {}
    if isinstance(exc, AdmissionRejected) or (isinstance(exc, NoReplicaAvailable) and exc.retry_after_s is not None):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s or 0.0)))
    if isinstance(exc, AuthenticationError):
        headers["WWW-Authenticate"] = 'Bearer realm="chariot"'
    return status, body, headers
