"""The router's offered-load meter (`chariot.router.offered_load.LoadMeter`): per-second buckets over a
sliding window, rates over the window or the router's age, and the snapshot it publishes."""

from __future__ import annotations

import pytest

from chariot.router.offered_load import LoadMeter, snapshot
from chariot.router.registry import ReplicaLoad, ReplicaRegistry, ReplicaSpec


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_rates_cover_the_window_and_forget_what_left_it() -> None:
    clock = Clock()
    meter = LoadMeter(window_s=10.0, clock=clock)
    for _ in range(5):
        meter.arrival(100)
        meter.output(20)
        clock.t += 1.0
    meter.arrival(50, shed=True)
    arrivals, prompt, output, shed = meter.rates()
    assert (arrivals, prompt, output, shed) == pytest.approx((6 / 5, 550 / 5, 100 / 5, 1 / 5))  # 5 s old
    clock.t += 6.0
    arrivals, _, _, shed = meter.rates()
    assert arrivals == pytest.approx(4 / 10) and shed == 0.0, "seconds 102-105 in the window; sheds: 5 s only"
    clock.t += 20.0
    assert meter.rates() == (0.0, 0.0, 0.0, 0.0)
    clock.t += 100.0
    for _ in range(100):
        meter.arrival(10)
    assert meter.rates()[0] == pytest.approx(10.0)  # over the full 10 s window now
    assert len(meter._buckets) <= 11


def test_a_fresh_meter_divides_by_at_least_a_second() -> None:
    clock = Clock()
    meter = LoadMeter(window_s=30.0, clock=clock)
    meter.arrival(10)
    clock.t += 0.01
    assert meter.rates()[0] == pytest.approx(1.0)


def test_snapshot_has_capacity_of_ready_replicas_and_in_flight_of_any() -> None:
    clock = Clock()
    registry = ReplicaRegistry([ReplicaSpec("g0", "h:1"), ReplicaSpec("g1", "h:2")], clock=clock)
    registry.update_load("g0", ReplicaLoad(token_budget=256, prefill_tokens_per_s=400.0, budget_tokens_per_s=900.0,
                                           reported_at=clock.t))
    registry.update_load("g1", ReplicaLoad(token_budget=256, prefill_tokens_per_s=400.0, reported_at=clock.t))
    meter = LoadMeter(clock=clock)
    offered = snapshot(meter, registry, tbt_slo_s=0.2, in_flight={"g0": 2, "g9": 1, "g1": 0})
    # measured at the budget; else the budget model (the prefill rate is the router's, not a capacity)
    assert dict(offered.capacity) == {"g0": 900.0, "g1": pytest.approx(1280.0)}
    assert dict(offered.in_flight) == {"g0": 2, "g9": 1}  # g9: a replica no longer routed to, still streaming
    assert offered.replicas == ("g0", "g1")
    assert not offered.idle("g9") and not offered.idle("g1") and offered.idle("g7")


def test_a_young_meter_counts_sheds_of_its_first_seconds() -> None:
    clock = Clock()
    clock.t = 100.9
    meter = LoadMeter(window_s=30.0, clock=clock)
    meter.arrival(10, shed=True)  # in the bucket of second 100
    clock.t = 101.5  # the next second, 0.6 s after the start
    assert meter.rates()[3] == pytest.approx(1.0)
