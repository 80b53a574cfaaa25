"""Per-request sampling parameters, validated once at construction.

Invalid values raise `InvalidRequestError` naming the field and its limit; the fronts turn that into
400 / INVALID_ARGUMENT.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from chariot.contracts.errors import InvalidRequestError

MAX_TOKENS_LIMIT = 1 << 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature == 0 means greedy decoding (top_k/top_p/seed are then irrelevant).
    top_k == 0 disables top-k; top_p == 1.0 disables nucleus sampling.
    `seed` makes sampling reproducible per request regardless of batch composition.
    Stop strings are excluded from the returned text; stop token ids are excluded from `text`
    but kept in `token_ids` (like EOS).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Accept lists from callers but store immutable tuples.
        object.__setattr__(self, "stop", _as_str_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _as_int_tuple(self.stop_token_ids))
        _check_int("max_tokens", self.max_tokens, low=1, high=MAX_TOKENS_LIMIT)
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


