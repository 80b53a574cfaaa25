"""iteration_cost: both servers' iteration logs (vLLM's log lines, Chariot's JSON lines, gzipped or
not) into one step-cost fit per system, the decode-only bins and the ratios, on synthetic logs whose
costs are known."""

from __future__ import annotations

import gzip
import json
import random
import statistics
from pathlib import Path

import pytest

from chariot.bench.experiments import iteration_cost as exp
from chariot.bench.server_iterations import fit_step_cost


def iterations(constant: float, per_prompt: float, per_decode: float, n: int = 300) -> list[tuple[int, int, float]]:
    rng = random.Random(1)
    out = []
    for _ in range(n):
        prefill, decodes = rng.choice([0, 0, 0, 64, 500]), rng.randint(1, 40)
        out.append((prefill, decodes, constant + per_prompt * prefill + per_decode * decodes))
    return out


def write_logs(tmp_path: Path) -> tuple[Path, Path]:
    vllm = tmp_path / "vllm.log.gz"
    with gzip.open(vllm, "wt") as f:
        f.write("(APIServer pid=1) INFO 11-29 11:25:40 [api_server.py:1] starting\n")
        for i, (p, d, ms) in enumerate(iterations(23.0, 0.28, 0.85)):
            f.write(f"(APIServer pid=1) INFO 11-29 11:25:46 [loggers.py:199] Engine 000: Iteration({i}): "
                    f"{int(p > 0)} context requests, {p} context tokens, {d} generation requests, {d} generation "
                    f"tokens, iteration elapsed time: {ms:.3f} ms, CPU KV cache usage: 0.2%\n")
        f.write("(APIServer pid=1) INFO 11-29 11:25:47 [loggers.py:199] Engine 000: Iteration(999): 0 context "
                "requests, 0 context tokens, 0 generation requests, 0 generation tokens, iteration elapsed time: "
                "900.0 ms (dummy), CPU KV cache usage: 0.2%\n")
    chariot = tmp_path / "chariot.0.jsonl"
    chariot.write_text("".join(json.dumps({"prefill": p, "decodes": d, "tokens": p + d, "exec_ms": ms, "ms": ms + 0.5,
                                           "kv": d / 100, "waiting": 0}) + "\n"
                               for p, d, ms in iterations(16.7, 0.30, 1.22)))
    return vllm, chariot


def test_fit_step_cost_recovers_known_costs_and_never_goes_negative() -> None:
    fit = fit_step_cost([{"prefill": p, "decodes": d, "forward_ms": ms} for p, d, ms in iterations(20, 0.5, 1.5)])
    assert (fit.constant_ms, fit.prompt_token_ms, fit.decode_ms) == pytest.approx((20, 0.5, 1.5), rel=1e-6)
    assert fit.iterations == 300 and fit.r2 == pytest.approx(1.0)
    skewed = fit_step_cost([{"prefill": p, "decodes": d, "forward_ms": ms} for p, d, ms in iterations(20, 0.5, -0.3)])
    assert skewed.decode_ms == 0.0 and skewed.prompt_token_ms > 0
    with pytest.raises(ValueError, match="at least 3 iterations"):
        fit_step_cost([])


def test_both_logs_fit_to_their_own_costs_and_the_ratios_follow(tmp_path: Path) -> None:
    vllm, chariot = write_logs(tmp_path)
    doc = exp.report(exp.load(vllm, [chariot]))
    assert doc["fit"]["vllm"]["iterations"] == 300  # the dummy iteration is left out
    assert doc["fit"]["vllm"]["decode_ms"] == pytest.approx(0.85, rel=1e-3)
    assert doc["fit"]["chariot"]["constant_ms"] == pytest.approx(16.7, rel=1e-3)
    ratio = doc["chariot_over_vllm"]["fit"]
    assert ratio["decode_ms"] == pytest.approx(1.22 / 0.85, rel=1e-3)
    assert ratio["constant_ms"] == pytest.approx(16.7 / 23.0, rel=1e-3)
    ones = doc["decode_only"]["chariot"][0]
    assert ones["decodes"] == [1, 1] and ones["median_ms"] == pytest.approx(16.7 + 1.22)
    assert ones["median_kv_usage"] == pytest.approx(0.01)  # each iteration's own share, `kv`
    in_bin = sorted(d / 100 for p, d, _ in iterations(16.7, 0.30, 1.22) if not p and 16 <= d <= 31)
    assert doc["decode_only"]["chariot"][4]["median_kv_usage"] == pytest.approx(statistics.median(in_bin))
    assert doc["decode_only"]["vllm"][0]["median_kv_usage"] == pytest.approx(0.002)  # "CPU KV cache usage: 0.2%"


def test_a_log_without_kv_usage_leaves_the_bins_without_it(tmp_path: Path) -> None:
    chariot = tmp_path / "old.jsonl"
    chariot.write_text("".join(json.dumps({"prefill": 0, "decodes": 2, "tokens": 2, "exec_ms": 5.0, "ms": 5.5,
                                           "waiting": 0}) + "\n" for _ in range(3)))
    bins = exp.decode_only([r for r in exp.load(write_logs(tmp_path)[0], [chariot])["chariot"]])
    assert bins[1]["iterations"] == 3 and bins[1]["median_kv_usage"] is None


def test_main_writes_the_report_and_the_plot(tmp_path: Path) -> None:
    vllm, chariot = write_logs(tmp_path)
    assert exp.main([str(tmp_path / "out"), str(vllm), str(chariot)]) == 0
    doc = json.loads((tmp_path / "out" / "iteration_cost.json").read_text())
    assert doc["sources"] == ["vllm.log.gz", "chariot.0.jsonl"]
    assert set(doc["fit"]) == {"chariot", "vllm"}
    assert (tmp_path / "out" / "iteration_cost.png").stat().st_size > 10_000
    assert exp.main([]) == 2
