"""The linear benchmark's nominal-peak arithmetic (the yardstick BENCHMARKS.md quotes)."""

from __future__ import annotations

import pytest

from chariot.bench.linear_bench import peak_gflops, time_interleaved


def test_peak_counts_two_fma_ports_of_the_widest_simd():
    assert peak_gflops(2, frozenset({"avx2", "fma"}), 2450.0) == pytest.approx(156.8)  # 2 × 2 × 8 × 2 × 2.45
    assert peak_gflops(2, frozenset({"avx2", "avx512f"}), 2450.0) == pytest.approx(313.6)
    assert peak_gflops(1, frozenset(), 1000.0) == pytest.approx(16.0)  # SSE: 4 lanes, 1 × 2 × 4 × 2 × 1 GHz


def test_interleaved_timing_runs_each_function_in_turn_and_reports_each_median():
    calls: list[str] = []
    fns = [lambda: calls.append("a"), lambda: calls.append("b"), lambda: calls.append("c")]
    times = time_interleaved(fns, reps=4)
    assert calls == ["a", "b", "c"] * 7  # 3 warm-up rounds, then 4 timed ones, never two in a row
    assert len(times) == 3 and all(t >= 0 for t in times)


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
