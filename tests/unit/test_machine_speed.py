"""The machine calibration `chariot bench peer` times around its phases (bench/machine_speed.py)."""

from __future__ import annotations

import math
import time

import pytest

from chariot.bench.machine_speed import (
    CHANCE_DRAWS,
    CONTENTION_LIMIT,
    DRIFT_TOLERANCE,
    CpuTimes,
    PhaseClock,
    PhaseSpeed,
    Speed,
    drift,
    drift_chance,
    interleaved_drift,
    measure_speed,
    others_busy,
    steal_share,
)

STAT = ("cpu  100 5 50 800 10 0 5 30 0 0\n"
        "cpu0 50 2 25 400 5 0 3 15 0 0\n"
        "intr 12345\n")


def test_measure_speed_times_the_real_workload() -> None:
    speed = measure_speed(reps=5, shape=(256, 512, 1024), read_bytes=64 << 20)  # long enough for clock ticks
    assert all(math.isfinite(x) and x > 0 for x in speed.values())
    assert speed.others_busy is not None and 0.0 <= speed.others_busy <= 1.0


def test_others_busy_is_the_machine_busy_time_this_process_did_not_use() -> None:
    start, end = CpuTimes(total=1000, steal=0, busy=300), CpuTimes(total=1200, steal=0, busy=450)
    # 2 s of machine time (100 ticks/s), 1.5 s busy, 1.0 s of it ours: others used 25 %
    assert others_busy(start, end, own_cpu_s=1.0, ticks_per_s=100) == 0.25
    assert others_busy(start, end, own_cpu_s=2.0, ticks_per_s=100) == 0.0  # tick rounding never goes negative
    assert others_busy(None, end, own_cpu_s=1.0) is None


def test_contended_calibrations_do_not_count_while_clean_ones_exist() -> None:
    clean, spun = Speed(100.0, 20.0, others_busy=0.02), Speed(50.0, 30.0, others_busy=0.5)
    assert spun.contended and not clean.contended and spun.others_busy > CONTENTION_LIMIT
    phase = PhaseSpeed(clean, Speed(102.0, 20.0, others_busy=0.0), steal=None, during=(spun,))
    assert phase.samples == (clean, Speed(102.0, 20.0, others_busy=0.0))
    assert phase.within() == pytest.approx(0.02) and phase.to_json()["contended"] == 1
    all_spun = PhaseSpeed(spun, spun, steal=None)
    assert all_spun.samples == (spun, spun)  # nothing clean: every calibration counts, to_json says so
    assert all_spun.to_json()["contended"] == 2 and all_spun.to_json()["counted"] == 2


def test_speed_ratio_and_phase_mean() -> None:
    assert Speed(100.0, 20.0).ratio(Speed(50.0, 40.0)) == Speed(2.0, 0.5)
    phase = PhaseSpeed(Speed(100.0, 20.0), Speed(110.0, 18.0), steal=None)
    assert phase.mean() == Speed(105.0, 19.0)
    assert phase.within() == pytest.approx(20 / 18 - 1)  # read moved 20 → 18: the larger of 10 % and 11 %
    dipped = PhaseSpeed(Speed(100.0, 20.0), Speed(100.0, 20.0), steal=None, during=(Speed(70.0, 20.0),))
    assert dipped.mean() == Speed(90.0, 20.0)
    assert dipped.within() == pytest.approx(100 / 70 - 1)  # a slow spell inside the phase counts


def test_drift_is_the_larger_of_between_and_within_the_phases() -> None:
    steady = PhaseSpeed(Speed(100.0, 20.0), Speed(100.0, 20.0), steal=0.0)
    slower = PhaseSpeed(Speed(80.0, 20.0), Speed(80.0, 20.0), steal=0.0)
    assert drift(steady, slower) == pytest.approx(0.25)  # 100 / 80
    assert drift(steady, steady) == 0.0
    wobbly = PhaseSpeed(Speed(100.0, 20.0), Speed(100.0, 24.0), steal=0.0)
    assert drift(steady, wobbly) == pytest.approx(0.20)  # means 10 % apart, but it moved 20 % within
    near = PhaseSpeed(Speed(102.0, 20.0), Speed(102.0, 20.0), steal=0.0)
    assert drift(steady, near) <= DRIFT_TOLERANCE < drift(steady, slower)


def test_cpu_times_from_proc_stat_and_steal_share() -> None:
    start = CpuTimes.parse(STAT)
    assert start == CpuTimes(total=100 + 5 + 50 + 800 + 10 + 0 + 5 + 30, steal=30, busy=100 + 5 + 50 + 0 + 5 + 30)
    end = CpuTimes(start.total + 200, start.steal + 10)
    assert steal_share(start, end) == 0.05
    assert steal_share(start, start) is None and steal_share(None, end) is None
    with pytest.raises(ValueError, match="cpu"):
        CpuTimes.parse("intr 1\n")


def test_phase_clock_brackets_a_phase() -> None:
    speeds = iter([Speed(100.0, 20.0), Speed(95.0, 20.0), Speed(90.0, 21.0)])
    times = iter([CpuTimes(1000, 10), CpuTimes(1400, 30)])
    clock = PhaseClock(measure=lambda: next(speeds), read_times=lambda: next(times), settle_s=0.05)
    with pytest.raises(RuntimeError, match="start"):
        clock.stop()
    with pytest.raises(RuntimeError, match="start"):
        clock.mark()
    assert clock.start() == Speed(100.0, 20.0)
    t0 = time.monotonic()
    assert clock.mark() == Speed(95.0, 20.0)
    assert time.monotonic() - t0 >= 0.05  # a mark lets the idle server settle first
    phase = clock.stop()
    assert phase.before == Speed(100.0, 20.0) and phase.after == Speed(90.0, 21.0) and phase.steal == 0.05
    assert phase.during == (Speed(95.0, 20.0),)
    assert phase.to_json()["within_change"] == pytest.approx(100 / 90 - 1, abs=1e-4)


def test_a_phase_clock_gives_each_interleaved_system_its_own_calibrations() -> None:
    speeds = iter([Speed(100.0, 20.0), Speed(98.0, 20.0), Speed(96.0, 20.0), Speed(94.0, 20.0), Speed(90.0, 21.0),
                   Speed(100.0, 20.0), Speed(90.0, 21.0)])
    times = iter([CpuTimes(1000, 10), CpuTimes(1400, 30), CpuTimes(1500, 30), CpuTimes(1600, 30)])
    clock = PhaseClock(measure=lambda: next(speeds), read_times=lambda: next(times))
    clock.start()
    clock.mark("vllm")  # before vLLM's first measurement (Chariot's came right after the start)
    clock.mark("chariot")
    clock.mark("vllm")
    phases = clock.stop_tracks(["chariot", "vllm"])
    chariot, vllm = phases["chariot"], phases["vllm"]
    assert chariot.before == Speed(100.0, 20.0) and chariot.during == (Speed(96.0, 20.0),)
    assert vllm.before == Speed(98.0, 20.0) and vllm.during == (Speed(94.0, 20.0),)
    assert chariot.after == vllm.after == Speed(90.0, 21.0) and chariot.steal == vllm.steal == 0.05
    # the closing calibration, which both share, is not one of either's own
    assert chariot.leading == (Speed(100.0, 20.0), Speed(96.0, 20.0))
    assert chariot.median() == Speed(98.0, 20.0) and interleaved_drift(chariot, vllm) == pytest.approx(98 / 96 - 1)
    clock.start()
    with pytest.raises(RuntimeError, match="no calibration of its own"):
        clock.stop_tracks(["chariot", "vllm"])  # vLLM never measured: its phase would borrow Chariot's start


def _phase(matmuls: list[float]) -> PhaseSpeed:
    """A phase whose leading calibrations read these matmul rates (read rates all equal)."""
    speeds = [Speed(m, 20.0) for m in matmuls]
    return PhaseSpeed(speeds[0], Speed(100.0, 20.0), 0.0, tuple(speeds[1:]))


def test_drift_chance_tells_a_noisy_machine_from_a_slower_system() -> None:
    # the same noisy machine under both systems: the medians differ by more than 5 % (flagged), and
    # random splits of the calibrations drift that far as often
    noisy_a, noisy_b = _phase([170, 120, 175, 118, 172, 125, 168]), _phase([121, 171, 119, 169, 116, 165, 124])
    assert interleaved_drift(noisy_a, noisy_b) > DRIFT_TOLERANCE
    noise = drift_chance(noisy_a, noisy_b)
    assert noise.draws == CHANCE_DRAWS and noise.beyond_tolerance > 0.5 and noise.at_least_observed > 0.1
    # a quiet machine, one system's calibrations all slower: few random splits drift as far
    quiet_a, quiet_b = _phase([101, 100, 102, 99, 100, 101, 100]), _phase([90, 91, 89, 90, 92, 90, 91])
    lean = drift_chance(quiet_a, quiet_b)
    assert interleaved_drift(quiet_a, quiet_b) > DRIFT_TOLERANCE
    assert lean.at_least_observed < 0.05 < noise.at_least_observed
    assert drift_chance(noisy_a, noisy_b) == noise  # seeded: a record reads the same every time
