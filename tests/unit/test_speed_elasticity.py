"""The speed-elasticity fit over peer runs (bench/experiments/speed_elasticity.py): brackets to
midpoints, the within-system fit, the normalised ratios, and a real peer document's machine records."""

from __future__ import annotations

import math

import pytest

from chariot.bench.experiments.speed_elasticity import (
    METRICS,
    Fit,
    PhasePoint,
    centred,
    fit,
    groups_of,
    normalised,
    phase_points,
    slope,
)
from chariot.bench.machine_speed import PhaseSpeed, Speed


def point(system: str, search: int, cap: tuple[float | None, float | None], offline: float | None,
          matmul: float, run: str = "r") -> PhasePoint:
    return PhasePoint(run, system, "fresh", search, cap[0], cap[1], offline, matmul)


def test_capacity_is_the_brackets_geometric_midpoint_and_none_for_a_bound() -> None:
    assert point("chariot", 0, (1.0, 4.0), None, 100.0).capacity == pytest.approx(2.0)
    assert point("chariot", 0, (0.0, 0.25), None, 100.0).capacity is None  # the floor failed: a bound
    assert point("chariot", 0, (2.0, None), None, 100.0).capacity is None  # never failed: unbounded
    assert point("chariot", 0, (2.0, math.inf), None, 100.0).capacity is None


def test_the_fit_compares_each_system_only_with_its_own_searches() -> None:
    """Capacity ∝ speed² within each system, the systems at very different levels: the slope is 2
    (pooled without centring, the levels would swamp it)."""
    points = [point(system, i, (level * (s / 100) ** 2 / 1.01, level * (s / 100) ** 2 * 1.01), None, s)
              for system, level in (("chariot", 10.0), ("vllm", 1.0)) for i, s in enumerate((90.0, 100.0, 120.0))]
    groups = groups_of(points)
    assert len(groups) == 2
    assert slope(centred(groups, METRICS["capacity"])) == pytest.approx(2.0)
    f = fit(groups, METRICS["capacity"])
    assert f.elasticity == pytest.approx(2.0) and f.low == pytest.approx(2.0) and f.correlation == pytest.approx(1.0)


def test_groups_need_two_searches_and_points_without_the_metric_are_left_out() -> None:
    lone = point("chariot", 0, (1.0, 2.0), 10.0, 100.0, run="other")
    pair = [point("vllm", 0, (1.0, 2.0), None, 100.0), point("vllm", 1, (1.0, 2.0), None, 110.0)]
    groups = groups_of([lone, *pair])
    assert groups == [pair]
    assert centred(groups, METRICS["offline"]) == []  # no offline numbers in the only group
    with pytest.raises(ValueError, match="no spread"):
        slope([(0.0, 1.0)])


def test_normalised_ratios_take_out_the_speed_ratio_over_the_elasticity_interval() -> None:
    c = point("chariot", 0, (2.0, 2.5), 150.0, 120.0)
    v = point("vllm", 0, (1.0, 1.25), 100.0, 100.0)
    cap, off = Fit(1.5, 1.0, 2.0, 10, 0.7), Fit(1.0, 1.0, 1.0, 10, 0.7)
    (row,) = normalised([c, v], cap, off)
    assert row["speed_ratio"] == 1.2 and row["capacity_ratio"] == [1.6, 2.5]
    # Chariot's phase 1.2x faster: the low end divided by 1.2^2, the high end by 1.2^1
    assert row["capacity_ratio_normalised"] == [round(1.6 / 1.44, 3), round(2.5 / 1.2, 3)]
    assert row["offline_ratio"] == 1.5 and row["offline_ratio_normalised"] == [1.25, 1.25]
    (unbounded,) = normalised([point("chariot", 0, (2.0, None), None, 100.0), v], cap, off)
    assert unbounded["capacity_ratio"] == [1.6, None] and unbounded["capacity_ratio_normalised"] == [1.6, None]
    assert "offline_ratio" not in unbounded
    assert normalised([c], cap, off) == []  # one system: nothing to compare


def test_phase_points_read_the_machine_record_the_peer_writes() -> None:
    phase = PhaseSpeed(Speed(100.0, 20.0, 0.0), Speed(140.0, 22.0, 0.0), 0.01,
                       (Speed(120.0, 21.0, 0.0), Speed(10.0, 2.0, 0.9)))  # the last one contended: not counted
    assert PhaseSpeed.from_json(phase.to_json()) == phase
    doc = {"runs": [{"system": "chariot", "variant": "fresh", "search": 1, "machine": phase.to_json(),
                     "capacity": {"low_qps": 1.0, "high_qps": 1.125}, "offline": {"output_tokens_per_s": 150.0}},
                    {"system": "vllm", "variant": "fresh", "search": 1, "machine": None,
                     "capacity": {"low_qps": 1.0, "high_qps": 1.125}}]}
    (p,) = phase_points(doc, "run.json")
    assert p == PhasePoint("run.json", "chariot", "fresh", 1, 1.0, 1.125, 150.0, pytest.approx(120.0))
