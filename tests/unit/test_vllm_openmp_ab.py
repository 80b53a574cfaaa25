"""The vLLM OpenMP experiment's table: each runtime's medians over rounds and their ratio (no servers)."""

from __future__ import annotations

from chariot.bench.experiments.vllm_openmp_ab import table


def test_table_gives_each_runtimes_median_over_rounds_and_intel_over_gnu() -> None:
    def row(runtime: str, wall: float, ttft: float) -> dict[str, object]:
        load = {"ttft_p50_ms": ttft, "ttft_p99_ms": 4000.0, "tbt_p50_ms": 40.0, "tbt_p99_ms": 500.0}
        return {"runtime": runtime, "round": 0, "offline": {"wall_s": wall, "output_tokens_per_s": 8478 / wall},
                "load": load}

    rows = [row("gnu", 50.0, 1000.0), row("intel", 40.0, 900.0), row("gnu", 60.0, 1400.0),
            row("intel", 44.0, 700.0), row("gnu", 55.0, 1200.0), row("intel", 42.0, 800.0)]
    lines = table(rows).splitlines()
    assert lines[2].startswith("| gnu | 55 | ") and lines[3].startswith("| intel | 42 | ")
    ratio = lines[4].split(" | ")
    assert ratio[0] == "| intel / gnu" and ratio[1] == f"{42 / 55:.3f}×" and ratio[3] == f"{800 / 1200:.3f}×"
