"""The prefill-order experiment's per-probe statistics and its side-by-side table (no servers)."""

from __future__ import annotations

import pytest

from chariot.bench.capacity import RequestTrace
from chariot.bench.experiments.prefill_order_ab import probe_stats, table


def trace(arrival: float, first: float, prompt: int, gap: float = 0.05) -> RequestTrace:
    return RequestTrace(arrival, arrival, (first, first + gap, first + 2 * gap), prompt_tokens=prompt)


def test_probe_stats_in_ms_with_the_longest_quarter_apart() -> None:
    # TTFTs 0.1..0.8 s; the two longest prompts (the top quarter of 8) waited 0.7 and 0.8 s
    traces = [trace(0.0, 0.1 * (i + 1), 100 * (i + 1)) for i in range(8)]
    traces.append(RequestTrace(0.0, None, (), prompt_tokens=50, ok=False))
    stats = probe_stats(traces)
    assert stats["failed"] == 1
    assert stats["ttft_p50"] == pytest.approx(400.0) and stats["ttft_max"] == pytest.approx(800.0)
    assert stats["long_ttft_p50"] == pytest.approx(700.0)
    assert stats["tbt_p50"] == pytest.approx(50.0) and stats["tbt_p99"] == pytest.approx(50.0)


def test_table_gives_each_orders_median_over_rounds_and_their_ratio() -> None:
    def row(order: str, rnd: int, ttft: float) -> dict[str, float | int | str]:
        stats = dict.fromkeys(("ttft_p50", "ttft_p90", "ttft_p99", "ttft_max", "long_ttft_p50", "tbt_p50",
                               "tbt_p99"), 100.0)
        return {"order": order, "round": rnd, "qps": 1.5, **stats, "ttft_p50": ttft, "failed": 0}

    rows = [row("fcfs", 0, 2000.0), row("shortest", 0, 1000.0), row("fcfs", 1, 3000.0), row("shortest", 1, 1400.0),
            row("fcfs", 2, 2600.0), row("shortest", 2, 1300.0)]
    lines = table(rows, [1.5]).splitlines()
    fcfs, shortest, ratio = lines[2:5]
    assert fcfs.startswith("| 1.5 | fcfs | 2600 |") and shortest.startswith("| 1.5 | shortest | 1300 |")
    assert ratio.startswith("| 1.5 | shortest / fcfs | 0.50× | 1.00× |")
