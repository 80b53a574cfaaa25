"""The linear benchmark's nominal-peak arithmetic (the yardstick BENCHMARKS.md quotes)."""

from __future__ import annotations

import itertools

import pytest

from chariot.bench.linear_bench import peak_gflops, time_interleaved, turn_order


def test_peak_counts_two_fma_ports_of_the_widest_simd():
    assert peak_gflops(2, frozenset({"avx2", "fma"}), 2450.0) == pytest.approx(156.8)  # 2 × 2 × 8 × 2 × 2.45
    assert peak_gflops(2, frozenset({"avx2", "avx512f"}), 2450.0) == pytest.approx(313.6)
    assert peak_gflops(1, frozenset(), 1000.0) == pytest.approx(16.0)  # SSE: 4 lanes, 1 × 2 × 4 × 2 × 1 GHz


def test_interleaved_timing_runs_each_function_once_per_rep_and_varies_who_goes_after_whom():
    """A fixed order lets one function always inherit what another left behind (an A/A of two
    identical attention builds measured 0.85-0.99x that way); every ordered pair must occur."""
    calls: list[str] = []
    fns = [lambda: calls.append("a"), lambda: calls.append("b"), lambda: calls.append("c")]
    times = time_interleaved(fns, reps=6)
    assert calls[:9] == ["a", "b", "c"] * 3  # warm-up
    timed = calls[9:]
    assert all(sorted(timed[i : i + 3]) == ["a", "b", "c"] for i in range(0, 18, 3))
    followers = set(itertools.pairwise(timed))
    assert {(x, y) for x in "abc" for y in "abc" if x != y} <= followers
    assert len(times) == 3 and all(t >= 0 for t in times)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_turn_order_is_a_permutation_alternating_rotations_and_reversed_rotations(n: int) -> None:
    orders = [turn_order(n, rep) for rep in range(2 * n)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert orders[0] == list(range(n)) and orders[n] == list(range(n - 1, -1, -1))


def test_the_attention_benchmark_can_hand_a_baseline_the_old_slot_major_cache():
    """`--baseline-layout slot-major`: the same contents, stored contiguously, for kernels from
    before the head-major CPU cache."""
    import torch

    from chariot.bench.cpu_attention_bench import SHAPES, make_problem, slot_major

    _, k, _, _ = make_problem(SHAPES[0])
    flat = slot_major(k)
    assert flat.is_contiguous() and not k.is_contiguous()
    assert k.stride(2) > k.stride(1)  # head-major in memory: one KV head's rows of a block are adjacent
    assert torch.equal(flat, k)
