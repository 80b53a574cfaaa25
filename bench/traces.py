"""Workload traces as in the Sarathi-Serve paper (§5): Poisson arrivals, request lengths drawn to
match a dataset's medians, scaled down so CPU runs finish.

Lengths are lognormal around the published medians (openchat_sharegpt4: prompt 1730 / decode
415 tokens; arxiv_summarization: prompt 7059 / decode ~200), clipped to [min, cap]. Everything is
deterministic per seed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class TraceSpec:
    name: str
    median_prompt: int
    median_decode: int
    sigma_prompt: float
    sigma_decode: float


TRACES = {
    "chat": TraceSpec("chat", 1730, 415, 0.9, 0.9),
    "arxiv": TraceSpec("arxiv", 7059, 200, 0.5, 0.5),
}


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_len: int
    decode_len: int


def make_trace(
    spec: TraceSpec, num_requests: int, qps: float | None, seed: int = 0, scale: float = 1.0,
    max_len: int | None = None,
) -> list[TraceRequest]:
    """`num_requests` requests; arrivals Poisson at `qps` (all at t=0 when qps is None).

    Lengths are multiplied by `scale`; prompt + decode is capped at `max_len` by shortening the
    prompt first (keeping at least one prompt token)."""
    if num_requests < 0 or (qps is not None and qps <= 0) or scale <= 0:
        raise ValueError("num_requests must be >= 0, qps and scale > 0")
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(num_requests):
        if qps is not None:
            t += rng.expovariate(qps)
        prompt = _draw(rng, spec.median_prompt * scale, spec.sigma_prompt)
        decode = _draw(rng, spec.median_decode * scale, spec.sigma_decode)
        if max_len is not None and prompt + decode > max_len:
            decode = min(decode, max_len - 1)
            prompt = max(1, max_len - decode)
        out.append(TraceRequest(t, prompt, decode))
    return out


def _draw(rng: random.Random, median: float, sigma: float) -> int:
    return max(1, round(math.exp(rng.gauss(math.log(median), sigma))))
