"""`chariot bench routing`'s verdicts on synthetic probe rows: capacity under a median-TTFT target is
the highest rung met before the first rung missed; the table says bracket or bound; ratios against
load-only routing; bad run settings name their field."""

from __future__ import annotations

from typing import Any

import pytest

from chariot.bench.routing_bench import RoutingRun, capacities, capacity, capacity_table, comparisons, meets
from chariot.contracts.errors import ConfigError


def row(mode: str, qps: float, ttft_p50: float, passed: bool = True, computed: int = 1000,
        ttft_p99: float | None = None) -> dict[str, Any]:
    return {"trace": "multiturn", "mode": mode, "qps": qps, "ttft_p50_s": ttft_p50,
            "ttft_p99_s": ttft_p99 if ttft_p99 is not None else 4 * ttft_p50, "passed": passed,
            "prefill_tokens_computed": computed}


def test_capacity_is_the_last_rung_met_before_the_first_miss() -> None:
    rows = [row("prefix", 8, 0.1), row("prefix", 16, 0.3), row("prefix", 32, 0.2)]
    assert capacity(rows, 0.25) == 8  # 32 met it again, but after a miss: not counted
    assert capacity(rows, 0.5) == 32
    assert capacity(rows, 0.05) == 0
    served_slowly = [row("load", 8, 0.1, passed=False)]
    assert not meets(served_slowly[0], 10.0) and capacity(served_slowly, 10.0) == 0


def test_the_table_tells_brackets_from_bounds() -> None:
    rows = [row("prefix", 8, 0.1), row("prefix", 16, 0.3), row("load", 8, 0.4), row("load", 16, 0.9)]
    caps = capacities(rows, [250, 2000])
    assert caps == {"multiturn/prefix": {"250": 8, "2000": 16}, "multiturn/load": {"250": 0, "2000": 16}}
    table = capacity_table(caps, rows)
    assert "| multiturn/prefix | [8, 16) | ≥ 16 |" in table
    assert "| multiturn/load | < 8 | ≥ 16 |" in table


def test_comparisons_are_load_only_over_each_mode_at_the_same_load() -> None:
    rows = [row("prefix", 8, 0.1, computed=500), row("load", 8, 0.3, computed=1500), row("round_robin", 8, 0.6),
            row("prefix", 16, 0.2)]  # load-only did not reach 16: nothing to compare there
    out = comparisons(rows)
    assert [(c["mode"], c["qps"]) for c in out] == [("prefix", 8), ("round_robin", 8)]
    prefix = out[0]
    assert prefix["ttft_p50_ratio"] == pytest.approx(3.0) and prefix["computed_ratio"] == pytest.approx(3.0)
    assert out[1]["ttft_p50_ratio"] == pytest.approx(0.5)


@pytest.mark.parametrize(("change", "field"), [
    ({"traces": ("nope",)}, "traces"), ({"modes": ("random",)}, "modes"), ({"loads": (2.0, 1.0)}, "qps"),
    ({"replicas": 0}, "replicas"), ({"ttft_slos_ms": ()}, "ttft_slo_ms"), ({"think_s": 0.0}, "think_s"),
])
def test_bad_settings_name_their_field(change: dict[str, Any], field: str) -> None:
    base: dict[str, Any] = dict(traces=("multiturn",), modes=("prefix", "load"), loads=(1.0, 2.0), replicas=2,
                                requests=8, scale=0.25, max_len=2048, seed=0, tbt_slo_ms=200.0,
                                ttft_slos_ms=(250.0,), drain_s=60.0, threads=1)
    RoutingRun(**base)
    with pytest.raises(ConfigError) as info:
        RoutingRun(**{**base, **change})
    assert info.value.field == field
