"""The statistics of the calibration-repeatability experiment: neighbouring changes, window spreads
and contended calibrations left out, as the peer benchmark counts them."""

from __future__ import annotations

import pytest

from chariot.bench.experiments.calibration_repeatability import (
    consecutive_changes,
    phase_like_spreads,
    statistics_of,
    summary,
    window_spreads,
)
from chariot.bench.machine_speed import CONTENTION_LIMIT, Speed, spread


def test_spread_and_consecutive_changes() -> None:
    assert spread([100.0, 125.0, 110.0]) == pytest.approx(0.25)
    assert consecutive_changes([100.0, 110.0, 99.0, 99.0]) == pytest.approx([0.10, 110 / 99 - 1, 0.0])
    assert consecutive_changes([100.0]) == []


def test_window_spreads_cover_only_whole_windows() -> None:
    times = [0.0, 30.0, 60.0, 90.0, 120.0]
    values = [100.0, 100.0, 120.0, 100.0, 150.0]
    # windows of 60 s start at 0, 30 and 60 s (the run ends at 120 s): [100,100,120], [100,120,100], [120,100,150]
    assert window_spreads(times, values, 60.0) == pytest.approx([0.2, 0.2, 0.5])
    assert window_spreads(times, values, 121.0) == []  # longer than the run


def test_summary_of_changes() -> None:
    s = summary([0.01 * i for i in range(1, 11)])
    assert s == {"median": 0.055, "p90": 0.1, "max": 0.1, "count": 10}
    assert summary([]) is None


def test_contended_calibrations_are_left_out_of_the_statistics() -> None:
    busy = CONTENTION_LIMIT + 0.1
    speeds = [Speed(100.0, 20.0, 0.0), Speed(10.0, 2.0, busy), Speed(104.0, 20.0, 0.0), Speed(100.0, 21.0, 0.0)]
    stats = statistics_of([0.0, 1.0, 2.0, 3.0], speeds)
    assert stats["calibrations"] == 4 and stats["contended"] == 1
    matmul = stats["matmul_gflops"]
    assert matmul["consecutive"]["max"] == pytest.approx(0.04) and matmul["whole"] == pytest.approx(0.04)
    assert matmul["range"] == [100.0, 104.0]
    assert stats["read_gbps"]["whole"] == pytest.approx(0.05)
    assert all(v is None for v in matmul["windows"].values())  # a 3 s run covers no 1-minute window


def test_phase_like_spreads_pick_evenly_spaced_calibrations() -> None:
    times = [float(t) for t in range(11)]  # one calibration a second for 10 s
    values = [100.0] * 11
    values[5] = 50.0  # a dip at 5 s, between the picks at 4 and 6 s (spaced 2 s over 8 s windows)
    assert phase_like_spreads(times, values, window_s=8.0, count=5) == pytest.approx([0.0, 1.0, 0.0])
    assert phase_like_spreads(times, values, window_s=11.0, count=5) == []  # longer than the run
