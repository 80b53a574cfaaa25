"""Per-probe iteration histograms of both peers (`bench/server_iterations.py`): vLLM's is read from a
real Prometheus endpoint served by `prometheus_client`, the library vLLM exports its metrics with,
under vLLM's metric name and labels (vLLM itself is not installed by the test suite); Chariot's from
an iteration log file. Both come out as the same buckets."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, start_http_server

from chariot.bench.server_iterations import (
    ChariotIterations,
    VllmIterations,
    bucket_quantile,
    histogram,
    token_bounds,
    vllm_bucket_flag,
)

BUDGET = 256


def test_bounds_are_per_token_to_64_then_every_16_to_the_budget() -> None:
    bounds = token_bounds(BUDGET)
    assert bounds[:64] == list(range(1, 65)) and bounds[64:] == list(range(80, 257, 16))
    assert token_bounds(100)[-2:] == [96, 100]  # the budget closes the list
    flag, value = vllm_bucket_flag(BUDGET)
    assert flag == "--custom-histogram-buckets"
    assert json.loads(value) == {"iteration_tokens": [float(b) for b in bounds]}


def test_quantiles_read_the_bucket_bound() -> None:
    counts = histogram([1, 1, 3, 70, 256, 300], token_bounds(BUDGET))
    assert counts == {"1": 2, "3": 1, "80": 1, "256": 1, "+Inf": 1}
    assert bucket_quantile(counts, 0.1) == 1 and bucket_quantile(counts, 0.5) == 3
    assert bucket_quantile(counts, 0.8) == 256 and bucket_quantile(counts, 1.0) == math.inf
    assert bucket_quantile({}, 0.5) is None


@pytest.fixture()
def vllm_like_endpoint() -> Iterator[tuple[str, Histogram]]:
    registry = CollectorRegistry()
    hist = Histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                     labelnames=["model_name", "engine"], buckets=token_bounds(BUDGET), registry=registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"http://127.0.0.1:{server.server_port}", hist
    finally:
        server.shutdown()
        thread.join(timeout=5)


def test_vllm_histogram_counts_only_what_came_between_two_takes(vllm_like_endpoint: tuple[str, Histogram]) -> None:
    base, hist = vllm_like_endpoint
    steps = hist.labels("peer", "0")
    for tokens in (512, 7, 7):  # before the probe (warm-up): dropped by the first take
        steps.observe(tokens)
    source = VllmIterations(base, BUDGET)
    source.take()
    probe = [33, 33, 40, 200, 256, 1, 64, 65]
    for tokens in probe:
        steps.observe(tokens)
    got = source.take()
    assert got["histogram"] == histogram(probe, token_bounds(BUDGET))
    assert got["iterations"] == len(probe) and got["tokens"] == sum(probe)
    assert got["tokens_p50"] == 40 and got["share_over_64"] == 3 / 8 and got["share_full"] == 1 / 8
    assert source.take()["iterations"] == 0  # nothing since


def test_a_server_without_the_histogram_is_reported_not_raised() -> None:
    assert "error" in VllmIterations("http://127.0.0.1:9", BUDGET).take()  # nothing listens on the discard port


def test_chariot_log_gives_the_same_buckets_and_its_own_detail(tmp_path: Path) -> None:
    path = tmp_path / "it.0.jsonl"
    source = ChariotIterations(path, BUDGET)
    assert "error" in source.take()  # not written yet

    def line(tokens: int, prefill: int, waiting: int) -> str:
        return json.dumps({"t": 1.0, "ms": 10.0 + tokens, "tokens": tokens, "prefill": prefill,
                           "decodes": tokens - prefill, "chunks": [prefill] if prefill else [], "waiting": waiting})

    path.write_text(line(5, 0, 0) + "\n")
    source.take()  # warm-up: dropped
    with path.open("a") as f:
        f.write("\n".join(line(*x) for x in [(256, 250, 3), (256, 240, 2), (20, 0, 0)]) + "\n")
    got = source.take()
    assert got["histogram"] == {"256": 2, "20": 1} and got["iterations"] == 3 and got["tokens"] == 532
    assert got["prefill"] == {"p50": 245.0, "p90": 250} and got["waiting"]["p50"] == 2
    assert got["share_full"] == 2 / 3 and got["log"] == "it.0.jsonl"
