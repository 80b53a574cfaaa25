"""The worker's capacity at its token budget (`StepCostMeter`, the Stats RPC's `budget_tokens_per_s`).

The autoscaler divides the offered work by this figure, so it must not swing with the load the way the
prefill rate does: at light load a replica's steps are small (a few decodes, one short prompt) and
tokens per second of wall time are low; under a queue every step is full and the same replica looks
several times faster. The meter fits step seconds as a line in batch tokens and reads it at the
budget, so light and heavy load of one machine give one answer. Samples here are drawn from a known
line with noise; the fit is checked against that line, not against itself.
"""

from __future__ import annotations

import random

import pytest

from chariot.worker.engine_core import PrefillMeter, StepCostMeter
from chariot.worker.stalls import StallWatch

FIXED_S, PER_TOKEN_S, BUDGET = 0.004, 20e-6, 512  # a step: 4 ms of fixed cost plus 20 µs per token


def true_seconds(tokens: int) -> float:
    return FIXED_S + PER_TOKEN_S * tokens


def light_load(rng: random.Random, steps: int = 256) -> list[tuple[int, int]]:
    """(batch tokens, of which prefill) per step: one or two decodes, now and then a short prompt."""
    out = []
    for _ in range(steps):
        decodes = rng.randint(1, 2)
        prefill = rng.choice([0, 0, 0, 0, rng.randint(20, 120)])
        out.append((decodes + prefill, prefill))
    return out


def heavy_load(rng: random.Random, steps: int = 256) -> list[tuple[int, int]]:
    """Full or nearly full budgets: many decodes and a prefill chunk filling the rest."""
    out = []
    for _ in range(steps):
        decodes = rng.randint(20, 60)
        prefill = rng.randint(BUDGET - decodes - 64, BUDGET - decodes)
        out.append((decodes + prefill, prefill))
    return out


def measured(steps: list[tuple[int, int]], rng: random.Random, noise: float = 0.05) -> tuple[float, float]:
    """(capacity at the budget, prefill rate) of a replica that ran `steps` with ±`noise` timing jitter."""
    cost, prefill = StepCostMeter(), PrefillMeter()
    for tokens, prompt_tokens in steps:
        seconds = true_seconds(tokens) * (1 + rng.uniform(-noise, noise))
        cost.record(tokens, seconds)
        prefill.record(prompt_tokens, seconds)
    return cost.tokens_per_s_at(BUDGET), prefill.tokens_per_s


def test_the_fitted_line_is_the_machine_s_line() -> None:
    meter = StepCostMeter()
    for tokens in (1, 3, 64, 200, 512, 2, 90, 300):
        meter.record(tokens, true_seconds(tokens))
    assert meter.step_seconds(BUDGET) == pytest.approx(true_seconds(BUDGET))
    assert meter.tokens_per_s_at(BUDGET) == pytest.approx(BUDGET / true_seconds(BUDGET))


def test_light_and_heavy_load_give_one_capacity_where_the_prefill_rate_swings() -> None:
    rng = random.Random(7)
    light_cap, light_prefill = measured(light_load(rng), rng)
    heavy_cap, heavy_prefill = measured(heavy_load(rng), rng)
    truth = BUDGET / true_seconds(BUDGET)
    assert light_cap == pytest.approx(truth, rel=0.10)
    assert heavy_cap == pytest.approx(truth, rel=0.10)
    assert heavy_prefill > 2 * light_prefill, "the prefill rate depends on the load; the capacity must not"


def test_nothing_is_claimed_before_two_batch_sizes_are_seen() -> None:
    meter = StepCostMeter(min_samples=8)
    assert meter.tokens_per_s_at(BUDGET) == 0.0
    for _ in range(7):
        meter.record(100, 0.01)
    meter.record(5, 0.005)
    assert meter.tokens_per_s_at(BUDGET) > 0  # eight samples, two sizes
    same_size = StepCostMeter(min_samples=8)
    for _ in range(20):
        same_size.record(1, 0.003)
    assert same_size.tokens_per_s_at(BUDGET) == 0.0, "decodes of one size say nothing about a full budget"
    assert meter.tokens_per_s_at(0) == 0.0
    meter.record(0, 0.01)  # an empty step or a zero time is not a sample
    meter.record(10, 0.0)


def test_a_line_with_no_fixed_cost_goes_through_the_origin() -> None:
    meter = StepCostMeter(min_samples=2)
    for tokens, seconds in ((10, 0.0001), (100, 0.002), (200, 0.004)):  # least squares would cross below zero
        meter.record(tokens, seconds)
    slope = sum(t * s for t, s in ((10, 0.0001), (100, 0.002), (200, 0.004))) / (10**2 + 100**2 + 200**2)
    assert meter.step_seconds(BUDGET) == pytest.approx(slope * BUDGET)


def test_the_window_follows_a_machine_that_slowed_down() -> None:
    meter = StepCostMeter(window=32)
    for i in range(64):
        tokens = 1 + (i % 8) * 60
        meter.record(tokens, true_seconds(tokens) * (1 if i < 32 else 3))  # the last 32 steps at a third of the speed
    assert meter.step_seconds(BUDGET) == pytest.approx(3 * true_seconds(BUDGET))


def test_no_prediction_past_the_largest_batch_in_the_window() -> None:
    """A quiet spell leaves decode steps alone in the window, memory-bound: about 30 ms whatever their
    size. The line through them puts a 453-token prompt chunk at about a decode's cost; the stall
    watch must not take that as the chunk's expected time (it did, and logged every prompt after a
    quiet spell as a stall)."""
    meter = StepCostMeter()
    rng = random.Random(3)
    for _ in range(256):
        decodes = rng.randint(1, 24)
        meter.record(decodes, 0.030 + 0.0002 * decodes + rng.uniform(-0.002, 0.002))
    assert meter.step_seconds(453) < 0.2  # the extrapolation: far below a real 453-token step's ~0.4 s
    assert meter.expected_seconds(453) == 0.0
    assert meter.expected_seconds(12) == pytest.approx(meter.step_seconds(12))
    assert StepCostMeter().expected_seconds(1) == 0.0
    watch = StallWatch()
    assert watch.step(0.409, lambda: meter.expected_seconds(453), 0.0, str) is None
    assert watch.step(0.825, lambda: meter.expected_seconds(453), 0.0, str) is not None  # past 3 x the floor
    assert watch.step(0.300, lambda: meter.expected_seconds(24), 0.0, str) is not None  # 10 x a 24-decode step
