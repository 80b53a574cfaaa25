"""SamplingParams validation: every bad value raises InvalidRequestError naming the field and the
limit (the fronts map it to 400 / INVALID_ARGUMENT), and good values are stored normalised.
"""

from __future__ import annotations

from typing import Any

import pytest

from chariot.contracts.errors import InvalidRequestError
from chariot.contracts.sampling_params import MAX_TOKENS_LIMIT, SamplingParams

INVALID: list[tuple[dict[str, Any], str, str]] = [
    # (kwargs, field, fragment of the message naming the limit)
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"max_tokens": -5}, "max_tokens", ">= 1"),
    ({"max_tokens": MAX_TOKENS_LIMIT + 1}, "max_tokens", f"<= {MAX_TOKENS_LIMIT}"),
    ({"max_tokens": 16.0}, "max_tokens", "integer"),
    ({"max_tokens": "16"}, "max_tokens", "integer"),
    ({"max_tokens": None}, "max_tokens", "integer"),
    ({"max_tokens": True}, "max_tokens", "integer"),
    ({"temperature": -0.1}, "temperature", ">= 0"),
    ({"temperature": float("nan")}, "temperature", "finite"),
    ({"temperature": float("inf")}, "temperature", "finite"),
    ({"temperature": -float("inf")}, "temperature", "finite"),
    ({"temperature": 10**400}, "temperature", "finite"),
    ({"temperature": "1.0"}, "temperature", "number"),
    ({"temperature": True}, "temperature", "number"),
    ({"top_p": 0.0}, "top_p", "(0, 1]"),
    ({"top_p": -0.5}, "top_p", "(0, 1]"),
    ({"top_p": 1.0001}, "top_p", "(0, 1]"),
    ({"top_p": float("nan")}, "top_p", "finite"),
    ({"top_p": False}, "top_p", "number"),
    ({"top_k": -1}, "top_k", ">= 0"),
    ({"top_k": 2.5}, "top_k", "integer"),
    ({"top_k": True}, "top_k", "integer"),
    ({"seed": -1}, "seed", ">= 0"),
    ({"seed": 1 << 63}, "seed", f"<= {(1 << 63) - 1}"),
    ({"seed": 1.0}, "seed", "integer"),
    ({"seed": False}, "seed", "integer"),
    ({"stop": ""}, "stop", "non-empty"),
    ({"stop": ["ok", ""]}, "stop", "non-empty"),
    ({"stop": 5}, "stop", "string"),
    ({"stop": [b"x"]}, "stop", "string"),
    ({"stop": ["a", 3]}, "stop", "string"),
    ({"stop": {"a"}}, "stop", "string"),
    ({"stop_token_ids": 5}, "stop_token_ids", "non-negative integers"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "non-negative integers"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids", "non-negative integers"),
    ({"stop_token_ids": [True]}, "stop_token_ids", "non-negative integers"),
    ({"stop_token_ids": "12"}, "stop_token_ids", "non-negative integers"),
    ({"ignore_eos": 1}, "ignore_eos", "boolean"),
    ({"ignore_eos": "yes"}, "ignore_eos", "boolean"),
]


@pytest.mark.parametrize(("kwargs", "field", "limit"), INVALID, ids=[repr(k) for k, _, _ in INVALID])
def test_invalid_values_name_field_and_limit(kwargs: dict[str, Any], field: str, limit: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    err = info.value
    assert err.field == field
    assert limit in err.message
    assert str(err).startswith(f"{field}: ")
    assert isinstance(err, ValueError)  # callers that only know ValueError still catch it


def test_defaults() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p) == (16, 1.0, 0, 1.0)
    assert p.seed is None and p.stop == () and p.stop_token_ids == () and not p.ignore_eos
    assert not p.greedy


def test_greedy_flag() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 1},
        {"max_tokens": MAX_TOKENS_LIMIT},
        {"temperature": 0},
        {"temperature": 2},
        {"top_p": 1e-9},
        {"top_p": 1},
        {"top_k": 0},
        {"top_k": 50_000},
        {"seed": 0},
        {"seed": (1 << 63) - 1},
        {"stop_token_ids": [0, 2]},
        {"ignore_eos": True},
    ],
)
def test_boundary_values_accepted(kwargs: dict[str, Any]) -> None:
    SamplingParams(**kwargs)


def test_lists_become_tuples() -> None:
    p = SamplingParams(stop=["\n", "END"], stop_token_ids=[2, 7])
    assert p.stop == ("\n", "END") and isinstance(p.stop, tuple)
    assert p.stop_token_ids == (2, 7) and isinstance(p.stop_token_ids, tuple)


def test_single_stop_string_becomes_tuple() -> None:
    assert SamplingParams(stop="###").stop == ("###",)


def test_frozen_and_hashable() -> None:
    p = SamplingParams(stop=["a"], stop_token_ids=[1])
    with pytest.raises(AttributeError):
        p.max_tokens = 3  # type: ignore[misc]
    assert hash(p) == hash(SamplingParams(stop=("a",), stop_token_ids=(1,)))
