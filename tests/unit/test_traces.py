"""Workload traces (bench/traces.py): deterministic per seed, the paper's medians × scale, Poisson
arrivals at the requested rate, and the length cap."""

from __future__ import annotations

import itertools
import statistics

import pytest

from chariot.bench.traces import TRACES, make_trace

N = 20_000


def test_same_seed_same_trace_other_seed_other_trace():
    a = make_trace(TRACES["chat"], 200, 2.0, seed=7, scale=0.25, max_len=2048)
    assert a == make_trace(TRACES["chat"], 200, 2.0, seed=7, scale=0.25, max_len=2048)
    assert a != make_trace(TRACES["chat"], 200, 2.0, seed=8, scale=0.25, max_len=2048)


@pytest.mark.parametrize("name", ["chat", "arxiv"])
@pytest.mark.parametrize("scale", [0.25, 1.0])
def test_medians_match_the_target_times_scale(name, scale):
    spec = TRACES[name]
    trace = make_trace(spec, N, 1.0, seed=1, scale=scale)
    prompt = statistics.median(r.prompt_len for r in trace)
    decode = statistics.median(r.decode_len for r in trace)
    assert prompt == pytest.approx(spec.median_prompt * scale, rel=0.03)
    assert decode == pytest.approx(spec.median_decode * scale, rel=0.03)


def test_paper_medians():
    """openchat_sharegpt4 (prompt 1730 / decode 415) and arxiv_summarization (7059 / ~200), §5."""
    assert (TRACES["chat"].median_prompt, TRACES["chat"].median_decode) == (1730, 415)
    assert (TRACES["arxiv"].median_prompt, TRACES["arxiv"].median_decode) == (7059, 200)


@pytest.mark.parametrize("qps", [0.3, 4.0])
def test_poisson_arrivals_at_the_requested_rate(qps):
    trace = make_trace(TRACES["chat"], N, qps, seed=2)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(trace)]
    assert min(gaps) >= 0
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / qps, rel=0.03)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, abs=0.05)  # exponential: CV = 1


def test_arrivals_scale_with_qps_for_the_same_seed():
    """Common random numbers: probes at different loads replay the same requests, arrivals ∝ 1/QPS."""
    slow = make_trace(TRACES["chat"], 50, 1.0, seed=3, scale=0.25)
    fast = make_trace(TRACES["chat"], 50, 4.0, seed=3, scale=0.25)
    assert [(r.prompt_len, r.decode_len) for r in slow] == [(r.prompt_len, r.decode_len) for r in fast]
    assert [r.arrival_s / 4 for r in slow] == pytest.approx([r.arrival_s for r in fast])


def test_all_at_once_without_qps():
    assert {r.arrival_s for r in make_trace(TRACES["arxiv"], 20, None)} == {0.0}


@pytest.mark.parametrize("name", ["chat", "arxiv"])
def test_length_cap_holds(name):
    trace = make_trace(TRACES[name], 5_000, 1.0, seed=4, scale=1.0, max_len=512)
    assert all(r.prompt_len + r.decode_len <= 512 for r in trace)
    assert all(r.prompt_len >= 1 and r.decode_len >= 1 for r in trace)
    assert any(r.prompt_len + r.decode_len == 512 for r in trace)  # the cap was exercised


def test_bad_arguments():
    with pytest.raises(ValueError):
        make_trace(TRACES["chat"], 10, 0.0)
    with pytest.raises(ValueError):
        make_trace(TRACES["chat"], 10, 1.0, scale=0.0)
