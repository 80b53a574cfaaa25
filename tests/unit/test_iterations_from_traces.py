"""Iterations rebuilt from streamed token times (`bench/experiments/iterations_from_traces.py`).

The traces are built from a known schedule: a server that runs one iteration every `STEP` seconds and
gives every running request one token per iteration; the rebuilt iterations must be that schedule
(batch sizes, first tokens, the prefill queue, the interval and its line against the batch)."""

from __future__ import annotations

from typing import Any

import pytest

from chariot.bench.experiments.iterations_from_traces import busy, iterations, line, plot_load, probe_report

FIXED, PER_SEQ = 0.020, 0.002  # an iteration of b requests takes 20 ms + 2 ms per request


def schedule(arrivals: list[float], starts: list[int], lengths: list[int],
             jitter: float = 0.0005) -> list[dict[str, Any]]:
    """Request i arrives at arrivals[i], gets its first token in iteration starts[i] and then one token
    per iteration for lengths[i] tokens; iteration k lasts FIXED + PER_SEQ × (requests in it)."""
    last = max(s + n for s, n in zip(starts, lengths, strict=True))
    ends, t = [], 0.0
    for k in range(last):
        t += FIXED + PER_SEQ * sum(s <= k < s + n for s, n in zip(starts, lengths, strict=True))
        ends.append(t)
    return [{"arrival": a, "scheduled": None, "prompt_tokens": 8, "ok": True,
             "token_times": [ends[k] + jitter * (i % 3) / 3 for k in range(s, s + n)]}
            for i, (a, s, n) in enumerate(zip(arrivals, starts, lengths, strict=True))]


def test_the_schedule_is_recovered() -> None:
    traces = schedule(arrivals=[0.0, 0.0, 0.05, 0.3], starts=[0, 1, 3, 10], lengths=[20, 20, 10, 5])
    its = iterations(traces)
    assert len(its) == 20  # 21 iterations; the first has no interval
    assert [it.tokens for it in its[:4]] == [2, 2, 3, 3]  # iterations 1..4: request 3 joins at 3
    assert [it.first for it in its[:4]] == [1, 0, 1, 0]
    assert all(it.interval_s == pytest.approx(FIXED + PER_SEQ * it.tokens, abs=0.001) for it in its)
    assert its[1].waiting == 1, "request 2 had arrived (0.05 s) but not had its first token"
    fitted = line(busy(its))
    assert fitted["fixed_ms"] == pytest.approx(FIXED * 1000, abs=1.0)
    assert fitted["per_seq_ms"] == pytest.approx(PER_SEQ * 1000, abs=0.3)


def test_a_probe_report_counts_busy_iterations() -> None:
    traces = schedule(arrivals=[0.0, 0.0], starts=[0, 0], lengths=[10, 3])
    report = probe_report(traces)
    assert report["iterations"] == 9
    assert report["busy_iterations"] == 2, "after the short request ends the batch is one and nothing waits"
    assert report["batch"]["p50"] == 2 and report["interval_ms"]["p50"] == pytest.approx(24.0, abs=1.0)


def test_failed_requests_and_no_tokens_are_ignored() -> None:
    traces = schedule(arrivals=[0.0], starts=[0], lengths=[4])
    traces.append({"arrival": 0.0, "scheduled": None, "prompt_tokens": 8, "ok": False, "token_times": [0.021]})
    traces.append({"arrival": 0.01, "scheduled": None, "prompt_tokens": 8, "ok": True, "token_times": []})
    its = iterations(traces)
    assert [it.tokens for it in its] == [1, 1, 1]
    assert line(its) == {"fixed_ms": None, "per_seq_ms": None}, "one batch size: no line"


def test_the_plot_shows_the_highest_load_every_system_passed() -> None:
    rows = [{"system": "chariot", "search": 0, "qps": q, "verdict": v} for q, v in ((1.0, "pass"), (1.5, "pass"),
                                                                                     (2.0, "FAIL"))]
    rows += [{"system": "vllm", "search": 0, "qps": q, "verdict": v} for q, v in ((1.0, "pass"), (1.5, "FAIL"),
                                                                                  (2.0, "FAIL"))]
    rows += [{"system": "vllm", "search": 1, "qps": 1.75, "verdict": "pass"},
             {"system": "vllm", "search": 0, "qps": None, "verdict": "offline"}]
    assert plot_load(rows) == 1.0
    failed_everywhere = [{**r, "verdict": "FAIL"} for r in rows if r["qps"] is not None]
    assert plot_load(failed_everywhere) == 2.0, "no common pass: the highest common load"
    assert plot_load(rows, search=3) is None
