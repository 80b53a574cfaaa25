"""The prefill-ageing experiment: its cost-model fit, its scheduler variant against the engine's own
`shortest` order, what the ageing trades, and the files it writes. Everything runs in the simulator
(the engine's scheduler and block manager with iteration times from a cost model), on synthetic
iteration logs."""

from __future__ import annotations

import gzip
import json
import random
from functools import partial
from pathlib import Path

import pytest

from chariot.bench.experiments import prefill_ageing_sim as exp
from chariot.bench.simulator import SimConfig, simulate
from chariot.bench.traces import TRACES, make_trace
from chariot.worker.budget import CostModel

# A server like the Xeon AMX in float32: 26 ms an iteration, 0.95 ms a prompt token, 2.3 ms a decode.
COST = CostModel((0.026, 0.00095, 0.0023, 0.0, 0.0))


def synthetic_log(constant: float, per_prompt: float, per_decode: float, n: int = 200) -> list[dict[str, float]]:
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        prefill, decodes = rng.choice([0, 0, 32, 200, 512]), rng.randint(0, 20)
        rows.append({"prefill": prefill, "decodes": decodes,
                     "ms": 1e3 * (constant + per_prompt * prefill + per_decode * decodes)})
    return rows


def test_the_simulators_model_is_the_logs_step_time_in_seconds() -> None:
    model = exp.fit_cost_model(synthetic_log(0.03, 0.001, 0.002))
    assert model.coefficients[:3] == pytest.approx((0.03, 0.001, 0.002), rel=1e-6)
    assert model.coefficients[3:] == (0.0, 0.0)
    assert model.r2 == pytest.approx(1.0)


def test_ageing_one_budget_is_the_engines_shortest_order() -> None:
    trace = make_trace(TRACES["chat"], 80, 1.3, seed=3, scale=0.25, max_len=exp.MAX_LEN)
    config = SimConfig(token_budget=exp.BUDGET, max_model_len=exp.MAX_LEN, prefill_order="shortest")
    engine = simulate(trace, config, COST)
    variant = simulate(trace, config, COST, scheduler=partial(exp.AgedShortest, ageing=1.0))
    fcfs = simulate(trace, SimConfig(token_budget=exp.BUDGET, max_model_len=exp.MAX_LEN), COST)
    times = [t.token_times for t in engine.traces]
    assert [t.token_times for t in variant.traces] == times
    assert [t.token_times for t in fcfs.traces] != times  # the load is high enough for the order to matter


def test_weaker_ageing_lowers_the_median_and_the_longest_prompts_pay() -> None:
    fcfs = exp.run_load(COST, None, 1.3, seeds=range(2), requests=100)
    unaged = exp.run_load(COST, 0.0, 1.3, seeds=range(2), requests=100)
    assert unaged["ttft_p50"] < 0.7 * fcfs["ttft_p50"]
    assert unaged["ttft_max"] > 1.2 * fcfs["ttft_max"]


def test_capacity_is_the_bracket_below_the_first_load_that_misses_the_slo() -> None:
    rows = [{"qps": 1.0, "ttft_p50": 1500.0, "tbt_p99": 500.0}, {"qps": 1.2, "ttft_p50": 2100.0, "tbt_p99": 500.0},
            {"qps": 1.1, "ttft_p50": 1900.0, "tbt_p99": 500.0}, {"qps": 1.3, "ttft_p50": 1800.0, "tbt_p99": 500.0}]
    assert exp.capacity(rows) == [1.1, 1.2]
    assert exp.capacity([{"qps": 1.0, "ttft_p50": 100.0, "tbt_p99": 1100.0}]) == [None, 1.0]
    assert exp.capacity([{"qps": 1.0, "ttft_p50": 100.0, "tbt_p99": 100.0}]) == [1.0, None]


def test_main_writes_every_variant_at_every_load(tmp_path: Path) -> None:
    log = tmp_path / "iterations.jsonl.gz"
    with gzip.open(log, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in synthetic_log(0.026, 0.00095, 0.0023))
    assert exp.main([str(log), "--out", str(tmp_path / "out"), "--qps", "0.5,1.5", "--seeds", "1",
                     "--requests", "40"]) == 0
    doc = json.loads((tmp_path / "out" / "prefill_ageing_sim.json").read_text())
    names = [name for name, _ in exp.variants()]
    assert sorted((r["variant"], r["qps"]) for r in doc["rows"]) == sorted((n, q) for n in names for q in (0.5, 1.5))
    assert set(doc["capacity"]) == set(names)
    assert doc["cost_model"]["coefficients"][:3] == pytest.approx([0.026, 0.00095, 0.0023], rel=1e-6)
    assert (tmp_path / "out" / "prefill_ageing_sim.png").stat().st_size > 10_000
