"""The full-iteration timeline (`bench/experiments/full_iteration_timeline.py`) on logs in both
servers' formats: vLLM is not installed by the test suite, so its lines are written here in the
format of vLLM 0.32's `--enable-logging-iteration-details`; Chariot's are its iteration log's."""

from __future__ import annotations

import json
import time
from pathlib import Path

from chariot.bench.experiments.full_iteration_timeline import main

T0 = time.mktime((2026, 11, 29, 9, 33, 0, 0, 0, -1))  # local time, as vLLM stamps its lines


def vllm_line(t: float, ctx: int, gen: int, ms: float) -> str:
    stamp = time.strftime("%m-%d %H:%M:%S", time.localtime(t))
    return (f"(APIServer pid=1) INFO {stamp} [loggers.py:199] Engine 000: Iteration(3): 1 context requests, {ctx} "
            f"context tokens, {gen} generation requests, {gen} generation tokens, iteration elapsed time: {ms:.2f} "
            f"ms, CPU KV cache usage: 1.0%")


def test_full_iterations_of_both_by_minute(tmp_path: Path) -> None:
    vllm = tmp_path / "vllm.log"
    vllm.write_text("\n".join([vllm_line(T0 + 1, 500, 12, 200.0), vllm_line(T0 + 2, 0, 12, 20.0),
                               vllm_line(T0 + 65, 510, 2, 100.0)]) + "\n")
    chariot = tmp_path / "chariot.0.jsonl"
    chariot.write_text("\n".join(json.dumps({"t": T0 + dt, "exec_ms": ms, "tokens": n})
                                 for dt, ms, n in [(3, 250.0, 512), (4, 15.0, 9), (70, 80.0, 512)]) + "\n")
    assert main([str(tmp_path / "out"), str(vllm), str(chariot)]) == 0
    doc = json.loads((tmp_path / "out" / "full_iteration_timeline.json").read_text())
    assert doc["budget"] == 512 and doc["full_iterations"] == {"chariot": 2, "vllm": 2}
    assert doc["minutes_both_ran"] == 2
    assert doc["vllm_over_chariot_by_minute"] == {"median": (200 / 250 + 100 / 80) / 2, "min": 0.8, "max": 1.25}
    assert (tmp_path / "out" / "full_iteration_timeline.png").stat().st_size > 10_000
