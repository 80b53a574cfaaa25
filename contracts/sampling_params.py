"""Per-request sampling parameters, validated once at construction.

Invalid values raise `InvalidRequestError` naming the field and its limit; the fronts turn that into
400 / INVALID_ARGUMENT.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from chariot.contracts.errors import InvalidRequestError

MAX_TOKENS_LIMIT = 1 << 20
PENALTY_LIMIT = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI's range)
LOGIT_BIAS_LIMIT = 100.0  # each logit_bias value lies in [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGPROBS = 20  # most likely alternatives returned per token


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature == 0 means greedy decoding (top_k/top_p/seed are then irrelevant).
    top_k == 0 disables top-k; top_p == 1.0 disables nucleus sampling.
    `seed` makes sampling reproducible per request regardless of batch composition.
    Stop strings are excluded from the returned text; stop token ids are excluded from `text`
    but kept in `token_ids` (like EOS).

    Logit processing (before temperature, top-k/top-p or greedy argmax): `logit_bias` adds its value
    to its token's logit; `frequency_penalty` subtracts penalty × (times the token was generated so
    far) and `presence_penalty` subtracts penalty once from every token generated so far (prompt
    tokens do not count); while fewer than `min_tokens` tokens are generated, EOS and
    `stop_token_ids` cannot be sampled and stop strings do not end the request.
    `logprobs` (None: off) returns, per generated token, its log-probability and the `logprobs` most
    likely alternatives under the model's distribution (the raw logits, before that processing).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending and unique
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers but store immutable tuples.
        object.__setattr__(self, "stop", _as_str_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _as_int_tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _as_logit_bias(self.logit_bias))
        _check_int("max_tokens", self.max_tokens, low=1, high=MAX_TOKENS_LIMIT)
        _check_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_range(name, getattr(self, name), PENALTY_LIMIT)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        _check_int("top_k", self.top_k, low=0, high=None)
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=(1 << 63) - 1)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos", f"must be a boolean, got {type(self.ignore_eos).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the tokens generated so far change the next token's logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _check_int(name: str, value: object, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(name, f"must be an integer, got {type(value).__name__}")
    if value < low:
        raise InvalidRequestError(name, f"must be >= {low}, got {value}")
    if high is not None and value > high:
        raise InvalidRequestError(name, f"must be <= {high}, got {value}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(name, f"must be a number, got {type(value).__name__}")
    # Also rejects ints too large for a float (10**400 would pass an inf check, then overflow later).
    if value != value or not -sys.float_info.max <= value <= sys.float_info.max:
        raise InvalidRequestError(name, f"must be finite, got {value}")


def _check_range(name: str, value: object, limit: float) -> None:
    _check_number(name, value)
    if not -limit <= value <= limit:  # type: ignore[operator]
        raise InvalidRequestError(name, f"must be in [{-limit:g}, {limit:g}], got {value}")


def _as_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """A mapping or pairs of token id -> bias (JSON object keys arrive as strings of digits)."""
    items = value.items() if isinstance(value, Mapping) else value
    if not isinstance(items, Iterable) or isinstance(items, str | bytes):
        raise InvalidRequestError("logit_bias", "must map token ids to numbers")
    pairs: dict[int, float] = {}
    for item in items:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise InvalidRequestError("logit_bias", "must map token ids to numbers")
        token, bias = _bias_token(item[0]), item[1]
        try:
            _check_range("logit_bias", bias, LOGIT_BIAS_LIMIT)
        except InvalidRequestError as exc:
            raise InvalidRequestError("logit_bias", f"the bias of token {token} {exc.message}") from None
        pairs[token] = float(bias)
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError("logit_bias", f"has {len(pairs)} entries; the limit is {MAX_LOGIT_BIAS_ENTRIES}")
    return tuple(sorted(pairs.items()))


def _bias_token(key: object) -> int:
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 18:
        return int(key)
    if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < 1 << 62:
        return key
    raise InvalidRequestError("logit_bias", f"keys must be token ids (non-negative integers), got {str(key)[:40]!r}")


def _as_str_tuple(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, list | tuple) or not all(isinstance(s, str) for s in value):
        raise InvalidRequestError("stop", "must be a string or a list of strings")
    if any(s == "" for s in value):
        raise InvalidRequestError("stop", "stop strings must be non-empty")
    return tuple(value)


def _as_int_tuple(value: object) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise InvalidRequestError("stop_token_ids", "must be a list of non-negative integers")
    return tuple(value)


