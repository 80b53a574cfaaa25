"""The linear benchmark's nominal-peak arithmetic (the yardstick BENCHMARKS.md quotes)."""

from __future__ import annotations

import pytest

from chariot.bench.linear_bench import peak_gflops


def test_peak_counts_two_fma_ports_of_the_widest_simd():
    assert peak_gflops(2, frozenset({"avx2", "fma"}), 2450.0) == pytest.approx(156.8)  # 2 × 2 × 8 × 2 × 2.45
    assert peak_gflops(2, frozenset({"avx2", "avx512f"}), 2450.0) == pytest.approx(313.6)
    assert peak_gflops(1, frozenset(), 1000.0) == pytest.approx(16.0)  # SSE: 4 lanes, 1 × 2 × 4 × 2 × 1 GHz
