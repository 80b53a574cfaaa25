"""The autoscaler's pure core (`chariot.contracts.autoscaling`): the formula, the bounds, the shed step,
scale from zero, the stabilisation windows (no flapping under noise, property-tested), and the
offered-load snapshot the routers share."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chariot.contracts.autoscaling import (
    AutoscalingPolicy,
    OfferedLoad,
    Recommendation,
    decide,
    merge_offered,
    offered_key,
    recommend,
    replica_capacity,
)
from chariot.contracts.errors import ConfigError

CAP = 1000.0  # tokens/s one group sustains


def load(work: float, *, shed: float = 0.0, held: int = 0, groups: int = 1, cap: float = CAP) -> OfferedLoad:
    return OfferedLoad(window_s=30.0, arrival_rate=work / 100, prompt_token_rate=work * 0.75,
                       output_token_rate=work * 0.25, shed_rate=shed, held=held,
                       capacity={f"g{i}": cap for i in range(groups)})


def policy(**kw: float) -> AutoscalingPolicy:
    base: dict[str, float] = dict(min_replicas=1, max_replicas=8, target_utilization=0.5,
                                  scale_up_stabilization_s=0.0, scale_down_stabilization_s=60.0)
    return AutoscalingPolicy(**{**base, **kw})  # type: ignore[arg-type]


# --- the formula ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("work", "expected"), [(0.0, 1), (400.0, 1), (500.0, 1), (501.0, 2), (1500.0, 3),
                                                (3900.0, 8), (100_000.0, 8)])
def test_desired_groups_are_work_over_capacity_times_target_bounded(work: float, expected: int) -> None:
    assert recommend(load(work), 1, policy())[0] == expected


def test_capacity_is_the_median_of_the_measured_groups() -> None:
    offered = OfferedLoad(prompt_token_rate=2000.0, capacity={"g0": 500.0, "g1": 1000.0, "g2": 5000.0, "g3": 0.0})
    assert offered.group_capacity() == 1000.0
    assert recommend(offered, 1, policy(target_utilization=1.0))[0] == 2


def test_shedding_adds_a_step_over_the_current_count() -> None:
    assert recommend(load(100.0, shed=0.5), 3, policy()) == (4, "shed")
    assert recommend(load(100.0, shed=0.5), 3, policy(shed_step=2)) == (5, "shed")
    assert recommend(load(4000.0, shed=0.5), 3, policy()) == (8, "work")  # the work term already asks more
    assert recommend(load(100.0, shed=0.5), 8, policy()) == (8, "shed")  # bounded


def test_without_a_measured_capacity_the_count_holds_except_for_sheds() -> None:
    unmeasured = load(5000.0, cap=0.0)
    assert recommend(unmeasured, 2, policy()) == (2, "none")
    assert recommend(None, 2, policy()) == (2, "none")
    assert recommend(load(5000.0, cap=0.0, shed=1.0), 2, policy()) == (3, "shed")
    decision = decide(unmeasured, 2, policy(), now=0.0)
    assert (decision.desired, decision.reason) == (2, "NoCapacity")


def test_replica_capacity_is_measured_else_the_budget_model() -> None:
    assert replica_capacity(512, 3000.0, 0.2) == 3000.0
    assert replica_capacity(512, 0.0, 0.2) == pytest.approx(2560.0)
    assert replica_capacity(0, 0.0, 0.2) == 0.0


# --- bounds and scale from zero ------------------------------------------------------------------------


def test_a_count_outside_the_bounds_moves_in_at_once() -> None:
    p = policy(min_replicas=2, max_replicas=4, scale_up_stabilization_s=300.0, scale_down_stabilization_s=300.0)
    high = decide(load(0.0), 7, p, now=0.0)
    assert (high.desired, high.reason) == (4, "Bounded")
    low = decide(load(0.0), 0, p, now=0.0)
    assert (low.desired, low.reason) == (2, "Bounded")


def test_scale_from_zero_when_requests_are_held_skips_the_scale_up_window() -> None:
    p = policy(min_replicas=0, scale_up_stabilization_s=120.0)
    idle = decide(load(0.0), 0, p, now=0.0)
    assert idle.desired == 0
    woken = decide(load(0.0, held=1, groups=0), 0, p, now=1.0, history=idle.history)
    assert (woken.desired, woken.reason) == (1, "ScaleFromZero")


def test_idle_deployment_with_min_zero_scales_to_zero_after_the_window() -> None:
    p = policy(min_replicas=0, scale_down_stabilization_s=60.0)
    d = decide(load(800.0), 2, p, now=0.0)
    history = d.history
    for t in range(10, 61, 10):
        d = decide(load(0.0), 2, p, now=float(t), history=history)
        history = d.history
        assert d.desired == 2, t  # the 2-group recommendation at t=0 is still in the window
    d = decide(load(0.0), 2, p, now=61.0, history=history)
    assert (d.desired, d.reason) == (0, "ScaleDown")


# --- stabilisation --------------------------------------------------------------------------------------


def test_a_rise_must_persist_for_the_scale_up_window() -> None:
    p = policy(scale_up_stabilization_s=30.0)
    history: tuple[Recommendation, ...] = decide(load(100.0), 1, p, now=0.0).history
    for t in (10.0, 20.0, 30.0):
        d = decide(load(1500.0), 1, p, now=t, history=history)
        history = d.history
        assert (d.desired, d.reason) == (1, "Stabilizing"), t
    d = decide(load(1500.0), 1, p, now=40.5, history=history)
    assert (d.desired, d.reason, d.recommended) == (3, "ScaleUp", 3)
    assert "1 -> 3" in d.message


def test_a_fall_waits_for_the_scale_down_window_and_goes_to_its_highest_recommendation() -> None:
    p = policy(scale_down_stabilization_s=60.0)
    history = decide(load(1500.0), 3, p, now=0.0).history
    history = decide(load(900.0), 3, p, now=30.0, history=history).history  # asks 2
    d = decide(load(100.0), 3, p, now=50.0, history=history)
    assert d.desired == 3  # 3 at t=0 is in the window
    d = decide(load(100.0), 3, p, now=61.0, history=d.history)
    assert (d.desired, d.reason) == (2, "ScaleDown")  # the highest left in the window: 2 at t=30
    d = decide(load(100.0), 2, p, now=91.0, history=d.history)
    assert d.desired == 1


def test_history_is_compacted_and_old_entries_drop() -> None:
    p = policy(scale_down_stabilization_s=60.0)
    history: tuple[Recommendation, ...] = ()
    for t in range(1000):
        history = decide(load(100.0), 1, p, now=float(t), history=history).history
    assert len(history) <= 2
    assert all(999 - r.time <= 60 for r in history)


noisy = st.lists(st.tuples(st.floats(0.0, 5000.0), st.floats(0.1, 20.0), st.booleans()), min_size=5, max_size=80)


@settings(max_examples=200, deadline=None)
@given(noisy, st.floats(0.0, 60.0), st.floats(0.0, 300.0), st.integers(0, 3), st.integers(1, 8))
def test_no_flapping_under_noisy_load(samples: list[tuple[float, float, bool]], up_s: float, down_s: float,
                                      low: int, span: int) -> None:
    """Whatever the noise: the count stays in bounds; after a scale-up nothing scales down within the
    scale-down window; after a scale-down nothing scales up within the scale-up window."""
    p = AutoscalingPolicy(min_replicas=low, max_replicas=low + span, target_utilization=0.6,
                          scale_up_stabilization_s=up_s, scale_down_stabilization_s=down_s)
    current, now = p.min_replicas, 0.0
    history: tuple[Recommendation, ...] = ()
    changes: list[tuple[float, int]] = []  # (time, +1 up / -1 down)
    for work, dt, shed in samples:
        now += dt
        d = decide(load(work, shed=1.0 if shed else 0.0), current, p, now, history)
        history = d.history
        assert p.min_replicas <= d.desired <= p.max_replicas
        if d.desired != current:
            changes.append((now, 1 if d.desired > current else -1))
        current = d.desired
    for (t0, a), (t1, b) in itertools.pairwise(changes):
        if a > 0 > b:
            assert t1 - t0 > down_s - 1e-9, (changes, down_s)
        if a < 0 < b:
            assert t1 - t0 > up_s - 1e-9 or up_s == 0.0, (changes, up_s)


@settings(max_examples=100, deadline=None)  # subnormal work rates underflow to no groups; no real load is one
@given(st.floats(0.0, 1e6, allow_subnormal=False), st.floats(1.0, 1e5), st.floats(0.05, 1.0))
def test_steady_load_gets_enough_groups_and_no_more(work: float, cap: float, target: float) -> None:
    p = AutoscalingPolicy(min_replicas=0, max_replicas=10**9, target_utilization=target)
    n, _ = recommend(load(work, cap=cap), 1, p)
    assert n * cap * target >= work * (1 - 1e-9)
    assert n == 0 or (n - 1) * cap * target < work * (1 + 1e-9)


# --- policy validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("kw", "field"), [
    (dict(min_replicas=-1), "autoscaling.minReplicas"),
    (dict(max_replicas=0), "autoscaling.maxReplicas"),
    (dict(min_replicas=3, max_replicas=2), "autoscaling.maxReplicas"),
    (dict(target_utilization=1.5), "autoscaling.targetUtilization"),
    (dict(target_utilization=math.nan), "autoscaling.targetUtilization"),
    (dict(scale_down_stabilization_s=-1.0), "autoscaling.scaleDownStabilizationSeconds"),
    (dict(shed_step=0), "autoscaling.shedStep"),
])
def test_policy_errors_name_the_field(kw: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        AutoscalingPolicy(**kw)  # type: ignore[arg-type]
    assert err.value.field == field


# --- the shared snapshot -----------------------------------------------------------------------------------


def test_offered_load_round_trips_and_merges_over_routers() -> None:
    a = OfferedLoad(10.0, 2.0, 300.0, 100.0, 0.5, 1, {"g0": 900.0}, {"g0": 3})
    b = OfferedLoad(10.0, 1.0, 100.0, 50.0, 0.0, 0, {"g0": 1000.0, "g1": 800.0}, {"g0": 1, "g1": 2})
    assert OfferedLoad.from_json(a.to_json()) == a
    merged = merge_offered([a, b])
    assert merged is not None
    assert (merged.arrival_rate, merged.work_rate, merged.shed_rate, merged.held, merged.routers) == \
        (3.0, 550.0, 0.5, 1, 2)
    assert dict(merged.capacity) == {"g0": 1000.0, "g1": 800.0}
    assert dict(merged.in_flight) == {"g0": 4, "g1": 2}
    assert merge_offered([]) is None
    with pytest.raises(ValueError):
        OfferedLoad.from_json('{"arrivalRate": 1}')
    assert offered_key("chariot", "r1") == "{chariot}:offered:r1"
