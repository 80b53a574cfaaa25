"""The autoscale ramp's verdicts (`bench/autoscale_ramp.py`): which requests count as "after the second
replica was ready" and "at the peak", what counts as failed, and the ramp's arrival rate. The docs'
autoscaling table is read from these fields, so each is checked on hand-built requests."""

from __future__ import annotations

import random

import pytest

from chariot.bench.autoscale_ramp import Ramp, Sent, summarize

RAMP = Ramp(low_qps=0.5, peak_qps=2.0, up_s=10.0, hold_s=10.0, down_s=10.0, tail_s=5.0)


def look(t: float, ready: int, replicas: int | None = None) -> dict[str, float | int]:
    return {"t": t, "ready": ready, "replicas": ready if replicas is None else replicas}


def served(arrival_s: float, ttft_s: float) -> Sent:
    return Sent(arrival_s, 16, 8, status=200, ttft_s=ttft_s, duration_s=ttft_s + 1.0, replica="g0")


def test_after_the_second_replica_and_at_the_peak() -> None:
    sent = [served(2.0, 0.1), served(8.0, 5.0),  # before the second replica: not in "after"
            served(12.0, 0.4), served(15.0, 0.6), served(19.0, 0.8),  # at the peak, after it
            served(25.0, 0.2), Sent(16.0, 16, 8, status=429)]  # ramp down; one shed at the peak
    looks = [look(0.0, 1), look(9.0, 1, replicas=2), look(11.0, 2), look(40.0, 1)]
    out = summarize(sent, looks, ttft_slo_s=2.0, ramp=RAMP)
    assert out["second_replica_ready_at_s"] == 11.0
    assert out["ttft_p99_after_second_ready_s"] == 0.8 and out["ttft_p50_after_second_ready_s"] == 0.4
    assert (out["requests_at_peak"], out["shed_at_peak"]) == (4, 1)
    assert out["ttft_p99_at_peak_s"] == 0.8 and out["ttft_p50_at_peak_s"] == 0.6
    assert (out["ok"], out["shed_429"], out["failed"], out["max_replicas"], out["replicas_at_end"]) == (6, 1, 0, 2, 1)


def test_one_replica_has_no_after_and_errors_count_as_failed() -> None:
    sent = [served(12.0, 3.0), Sent(13.0, 16, 8, status=200, ttft_s=0.5, error="engine died"),
            Sent(14.0, 16, 8, status=503)]
    out = summarize(sent, [look(0.0, 1), look(30.0, 1)], ttft_slo_s=2.0, ramp=RAMP)
    assert out["second_replica_ready_at_s"] is None and out["ttft_p99_after_second_ready_s"] is None
    assert out["failed"] == 2 and out["ok"] == 1
    assert out["ttft_p99_at_peak_s"] == 3.0, "the errored request's TTFT is not a served request's"


def test_the_ramp_rises_holds_and_falls() -> None:
    assert [RAMP.rate(t) for t in (0.0, 5.0, 12.0, 25.0, 31.0)] == pytest.approx([0.5, 1.25, 2.0, 1.25, 0.0])
    arrivals = RAMP.arrivals(random.Random(3))
    assert arrivals == sorted(arrivals) and all(0 <= t < RAMP.load_s for t in arrivals)
    at_peak = sum(RAMP.up_s <= t < RAMP.up_s + RAMP.hold_s for t in arrivals)
    rising = sum(t < RAMP.up_s for t in arrivals)
    assert at_peak > rising, "more arrivals at the peak rate than on the way up"
