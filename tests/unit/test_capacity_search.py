"""Capacity search on a synthetic latency model (no servers): converges to the known capacity."""

from __future__ import annotations

import pytest

from chariot.bench.capacity import RequestTrace, RunMetrics, percentile, search_capacity


def synthetic(capacity: float, slo: float):
    """P99 TBT rises linearly with load and crosses the SLO exactly at `capacity`."""
    calls = []

    def evaluate(qps: float) -> RunMetrics:
        calls.append(qps)
        p99 = slo * qps / capacity
        return RunMetrics(qps, 100, 0, 0.1, 0.2, p99 / 2, p99, 0.1, 1000.0)

    return evaluate, calls


@pytest.mark.parametrize("capacity", [0.3, 1.7, 5.0, 40.0])
def test_search_converges_on_synthetic_model(capacity):
    evaluate, calls = synthetic(capacity, slo=0.2)
    result = search_capacity(evaluate, 0.2, low=0.1, high=2.0, tolerance=0.02, max_probes=30)
    assert capacity * 0.97 <= result.capacity_qps <= capacity
    assert len(result.probes) == len(calls)


def test_nothing_meets_the_slo():
    evaluate, _ = synthetic(0.05, slo=0.2)
    assert search_capacity(evaluate, 0.2, low=0.1, high=1.0).capacity_qps == 0.0


def test_scheduling_delay_limit_counts():
    m = RunMetrics(1.0, 10, 0, 0.1, 0.2, 0.01, 0.05, 2.5, 100.0)
    assert not m.meets(0.2) and RunMetrics(1.0, 10, 0, 0.1, 0.2, 0.01, 0.05, 1.9, 100.0).meets(0.2)
    assert not RunMetrics(1.0, 10, 1, 0.1, 0.2, 0.01, 0.05, 0.1, 100.0).meets(0.2)


def test_metrics_from_traces():
    traces = [RequestTrace(0.0, 0.5, (1.0, 1.1, 1.3)), RequestTrace(1.0, 1.0, (2.0, 2.5)),
              RequestTrace(2.0, None, (), ok=False)]
    m = RunMetrics.from_traces(1.0, traces, duration_s=5.0)
    assert m.failed == 1 and m.requests == 3
    assert m.p50_ttft == 1.0 and m.p99_tbt == 0.5
    assert m.median_scheduling_delay == 0.25
    assert percentile([1, 2, 3, 4], 50) == 2 and percentile([1, 2, 3, 4], 100) == 4
