"""`make gpu-check`'s CPU-testable parts: argument validation, the refusal without CUDA, the
weight+KV-read floor, the per-layer scaling, the SLO / budget / probe-load derivation, the parsing of
what the parts leave (pytest summary, profiler events and the GPU's busy time in them, greedy tokens),
the summary and report from fake part files (sarathi's capacity searched once per SLO, each with that
SLO's token budget), the part runner's time limit, and the engine part's measurements on a tiny model."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from chariot.bench import gpu_check
from chariot.bench import gpu_check_parts as parts
from chariot.worker.model.loader import load_stage

H, KV, INTER, VOCAB = 4096, 8 * 128, 14336, 128256
LAYER_PARAMS = H * (H + 2 * KV) + H * H + 3 * H * INTER + 2 * H  # qkv, o, gate/up/down, two norms


# ---- arguments and the refusal without CUDA ------------------------------------------------------
@pytest.mark.parametrize(("argv", "flag"), [
    (["--layers", "0"], "--layers"), (["--layers", "33"], "--layers"), (["--budget-s", "0"], "--budget-s"),
    (["--budget-s", "-5"], "--budget-s"), (["--parts", "engine,bogus"], "--parts"), (["--parts", ","], "--parts"),
])
def test_bad_arguments_exit_naming_the_flag(argv: list[str], flag: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args(["--out", str(tmp_path), *argv])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_parts_run_in_their_fixed_order() -> None:
    assert gpu_check.parse_parts("vllm, engine,prepare") == ("prepare", "engine", "vllm")
    assert gpu_check.parse_args(["--out", "x"]).parts == gpu_check.PARTS


def test_without_cuda_it_says_so_and_exits_non_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == gpu_check.NO_CUDA_EXIT
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_command_refuses_a_machine_without_a_visible_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "chariot.bench.gpu_check", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == gpu_check.NO_CUDA_EXIT
    assert "needs a CUDA GPU" in proc.stderr and ("CPU-only build" in proc.stderr or "no CUDA device" in proc.stderr)


# ---- floor and scaling --------------------------------------------------------------------------
def test_llama3_8b_decode_reads_every_weight_but_the_embedding_table_and_the_kv() -> None:
    config = gpu_check.model_config(32)
    weights = 32 * LAYER_PARAMS + H + VOCAB * H  # layers, final norm, LM head
    assert gpu_check.decode_read_bytes(config, batch=1, context=0) == 2 * (weights + H)
    kv = 64 * 512 * 2 * 32 * KV * 2  # K and V of every layer, bf16
    assert gpu_check.decode_read_bytes(config, batch=64, context=512) == 2 * (weights + 64 * H) + kv
    assert 14.9e9 < 2 * weights < 15.1e9  # Llama-3-8B: 8.03 B parameters, 0.53 B of them the embedding


def test_reduced_depth_keeps_the_layer_shapes() -> None:
    four = gpu_check.decode_read_bytes(gpu_check.model_config(4), 1, 100)
    two = gpu_check.decode_read_bytes(gpu_check.model_config(2), 1, 100)
    assert four - two == 2 * (2 * LAYER_PARAMS + 100 * 2 * 2 * KV)


def test_tied_embeddings_count_once() -> None:
    from chariot.worker.model.make_model import build_config

    config = build_config("tiny", "qwen2")
    assert config["tie_word_embeddings"]
    one, eight = (gpu_check.decode_read_bytes(config, batch=b, context=0) for b in (1, 8))
    assert one == eight


def test_floor_is_bytes_over_bandwidth() -> None:
    assert gpu_check.floor_ms(3_350_000_000, 3350.0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        gpu_check.floor_ms(1, 0.0)


def test_per_layer_fit_scales_to_32_layers() -> None:
    assert gpu_check.scale_to_layers(10.0, 8.0, 4, 2) == pytest.approx(38.0)  # 6 ms fixed + 1 ms per layer
    assert gpu_check.scale_to_layers(10.0, 10.5, 4, 2) is None  # noise larger than a layer: no figure
    assert gpu_check.scale_to_layers(30.0, 0.0, 32, 16) == 30.0
    assert gpu_check.half_depth(4) == 2 and gpu_check.half_depth(1) is None and gpu_check.half_depth(32) is None


# ---- SLO, budget, probes ------------------------------------------------------------------------
def test_slos_are_5x_and_25x_the_lone_decode_iteration() -> None:
    assert gpu_check.slos_ms(2.0) == {"strict": 10.0, "relaxed": 50.0}
    with pytest.raises(ValueError):
        gpu_check.slos_ms(0.0)


def test_budget_is_the_largest_chunk_whose_hybrid_iteration_fits_the_strict_slo() -> None:
    prefill = {512: 10.0, 2048: 40.0}  # ~0.0195 ms per token
    assert gpu_check.prefill_ms_at(1024, prefill) == pytest.approx(20.0)
    # 0.8 × 50 ms leaves 35 ms beside a 5 ms decode batch: 1,792 tokens, so 1,024 of the candidates
    assert gpu_check.pick_token_budget(prefill, 5.0, 50.0) == 1024
    assert gpu_check.pick_token_budget(prefill, 5.0, 1.0) == min(gpu_check.BUDGET_CANDIDATES)
    with pytest.raises(ValueError):
        gpu_check.pick_token_budget({}, 5.0, 50.0)


def test_timed_hybrid_iterations_set_the_budget_even_where_a_smaller_chunk_is_no_faster() -> None:
    # host-bound: 128 and 256 take the same, so a strict SLO that 256 fits takes 256, not the smaller one
    hybrid = {128: 19.0, 256: 19.2, 512: 25.0, 2048: 60.0}
    assert gpu_check.measured_token_budget(hybrid, 24.3) == 256  # 0.8 × 24.3 = 19.44 ms
    assert gpu_check.measured_token_budget(hybrid, 121.7) == 2048
    assert gpu_check.measured_token_budget(hybrid, 10.0) == 128  # none fits: the smallest timed
    with pytest.raises(ValueError):
        gpu_check.measured_token_budget({}, 10.0)


def test_each_slo_gets_its_own_token_budget() -> None:
    prefill = {512: 10.0, 2048: 40.0}
    # strict: 0.8 × 20 ms leaves 11 ms beside the decodes (~563 tokens: 512); relaxed: 75 ms (~3,840: 2,048)
    assert gpu_check.token_budgets(prefill, 5.0, {"strict": 20.0, "relaxed": 100.0}) == {"strict": 512,
                                                                                         "relaxed": 2048}
    plan = {"slo_ms": {"strict": 20.0, "relaxed": 100.0}, "token_budgets": {"strict": 512, "relaxed": 2048}}
    assert gpu_check.capacity_search("sarathi-strict", plan) == ("sarathi", 512, (20.0,))
    assert gpu_check.capacity_search("sarathi-relaxed", plan) == ("sarathi", 2048, (100.0,))
    assert gpu_check.capacity_search("vllm", plan) == ("vllm", None, (20.0, 100.0))  # no budget: one search
    with pytest.raises(ValueError, match="unknown capacity search"):
        gpu_check.capacity_search("sarathi", plan)


def test_probe_loads_bracket_the_estimate_within_the_host_limit() -> None:
    low, high = gpu_check.probe_qps_range(decode_batch_ms=12.8, batch=128, prefill_ms_per_token=0.02,
                                   mean_prompt=1000, mean_decode=400)  # 40 + 20 ms per request: ~16.7 QPS
    assert (low, high) == (pytest.approx(1.667, abs=1e-3), pytest.approx(8.333, abs=1e-3))
    assert gpu_check.probe_qps_range(0.1, 128, 0.0, 1, 1)[1] == gpu_check.MAX_PROBE_QPS
    assert gpu_check.probe_qps_range(1e6, 1, 1.0, 1, 1)[0] == gpu_check.MIN_PROBE_QPS


def fake_engine(graphs: bool = True, layers_scale: float = 1.0) -> dict[str, Any]:
    def run(scale: float) -> dict[str, Any]:
        return {"decode": [{"batch": b, "median_ms": scale * (2.0 + b / 32), "mean_context": 524.5}
                           for b in gpu_check.DECODE_BATCHES],
                "prefill": [{"tokens": n, "median_ms": scale * n / 100} for n in gpu_check.PREFILL_TOKENS],
                "greedy": [[1, 2, 3], [4, 5]]}
    runs = {"off": run(3.0), "off_half": run(2.0)}
    if graphs:
        runs.update(on=run(1.0), on_half=run(0.75))
    return {"graphs_available": graphs, "graphs_note": None if graphs else gpu_check.GRAPHS_UNAVAILABLE, "runs": runs,
            "kernels": {"on": {"kernels_per_iteration": 300.0, "launch_calls_per_iteration": 2.0,
                               "graph_launches_per_iteration": 1.0, "device_ms_per_iteration": 3.1,
                               "device_busy_ms_per_iteration": 3.0},
                        "off": {"kernels_per_iteration": 300.0, "launch_calls_per_iteration": 300.0,
                                "graph_launches_per_iteration": 0.0, "device_ms_per_iteration": None,
                                "device_busy_ms_per_iteration": None}}}


def test_capacity_plan_uses_the_graphs_run_and_derives_everything_from_it() -> None:
    plan = gpu_check.capacity_plan(fake_engine())
    assert plan["graphs"] == "on" and plan["lone_decode_ms"] == pytest.approx(2.03125)
    assert plan["slo_ms"] == {"strict": 10.2, "relaxed": 50.8}
    budgets = plan["token_budgets"]
    assert set(budgets) == {"strict", "relaxed"} and set(budgets.values()) <= set(gpu_check.BUDGET_CANDIDATES)
    assert budgets["relaxed"] > budgets["strict"]  # the looser SLO leaves room for a larger chunk
    assert plan["requests"] == gpu_check.CAPACITY_REQUESTS
    assert plan["budgets_from"] == "prefill and decode times"  # fake_engine has no hybrid rows
    timed = fake_engine()
    timed["runs"]["on"]["hybrid"] = [{"budget": b, "decodes": 64, "median_ms": ms}
                                     for b, ms in ((128, 7.0), (256, 9.0), (2048, 30.0))]
    hybrid_plan = gpu_check.capacity_plan(timed)  # 0.8 × 10.2 = 8.16 ms: 128 fits, 256 not; relaxed all
    assert hybrid_plan["token_budgets"] == {"strict": 128, "relaxed": 2048}
    assert hybrid_plan["budgets_from"] == "hybrid iterations"
    dry_run = gpu_check.capacity_plan(fake_engine(), **gpu_check.DRY_RUN_CAPACITY)
    assert {k: dry_run[k] for k in gpu_check.DRY_RUN_CAPACITY} == gpu_check.DRY_RUN_CAPACITY
    assert 0 < plan["qps_low"] < plan["qps_high"] <= gpu_check.MAX_PROBE_QPS
    assert gpu_check.capacity_plan(fake_engine(graphs=False))["graphs"] == "off"
    with pytest.raises(ValueError, match="lone decode"):
        gpu_check.capacity_plan({"runs": {}})


# ---- what the parts leave -----------------------------------------------------------------------
def test_pytest_summary_counts() -> None:
    log = "....\n=== warnings ===\n1 failed, 20 passed, 262 deselected, 2 errors, 1 warning in 50.05s\n"
    counts = {"passed": 20, "failed": 1, "errors": 2, "skipped": 0, "deselected": 262, "partial": False}
    assert gpu_check.parse_pytest_summary(log) == counts
    stopped = "$ python -m pytest -q -m gpu\n....F.s.....   [ 40%]\n.....E\n"
    assert gpu_check.parse_pytest_summary(stopped) == {"passed": 15, "failed": 1, "errors": 1, "skipped": 1,
                                                       "deselected": 0, "partial": True}


def test_gpu_test_files_are_those_with_the_marker(tmp_path: Path) -> None:
    (tmp_path / "unit").mkdir()
    (tmp_path / "unit" / "test_a.py").write_text("import pytest\npytestmark = pytest.mark.gpu\n")
    (tmp_path / "unit" / "test_b.py").write_text("def test_x():\n    pass\n")
    (tmp_path / "test_c.py").write_text("@pytest.mark.gpu\ndef test_y(): ...\n")
    assert gpu_check.gpu_test_files(tmp_path) == [str(tmp_path / "test_c.py"), str(tmp_path / "unit" / "test_a.py")]
    assert any(f.endswith("test_triton_attention.py") for f in gpu_check.gpu_test_files(Path(__file__).parents[1]))


def test_kernel_counts_per_iteration() -> None:
    device = ["ampere_bf16_gemm", "triton_attention", "Memcpy HtoD (Pageable -> Device)", "Memset (Device)"] * 2
    host = ["cudaLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch", "cudaMemcpyAsync", "aten::mm"] * 2
    assert gpu_check.kernel_counts(device, host, 2) == {"kernels_per_iteration": 2.0, "launch_calls_per_iteration": 3.0,
                                                 "graph_launches_per_iteration": 1.0}
    with pytest.raises(ValueError):
        gpu_check.kernel_counts([], [], 0)


def event(name: str, start: float, end: float, device: str = "DeviceType.CUDA", **fields: float) -> SimpleNamespace:
    """A stand-in for torch.profiler's FunctionEvent: name, device type, time range (µs) and the
    device-time field(s) a given torch version has."""
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end), **fields)


def test_gpu_busy_time_sums_kernel_durations_and_unites_their_ranges() -> None:
    events = [event("gemm", 0.0, 100.0, device_time_total=100.0),
              event("attention", 50.0, 150.0, device_time_total=100.0),  # overlaps the gemm by 50 µs
              event("rmsnorm", 300.0, 320.0, device_time_total=20.0),
              event("Memcpy HtoD (Pageable -> Device)", 150.0, 300.0, device_time_total=150.0),  # not a kernel
              event("aten::mm", 0.0, 1000.0, device="DeviceType.CPU", device_time_total=220.0)]  # host op
    busy = gpu_check.kernel_busy(events, iterations=2)
    # summed: (100 + 100 + 20) / 2 µs; busy: the union, (150 + 20) / 2 µs
    assert busy == {"device_ms_per_iteration": pytest.approx(0.11),
                    "device_busy_ms_per_iteration": pytest.approx(0.085)}
    assert gpu_check.union_us([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (2.5, 2.8)]) == pytest.approx(4.0)
    assert gpu_check.union_us([]) == 0.0


def test_gpu_busy_time_reads_the_device_time_field_of_any_torch_version() -> None:
    assert gpu_check.event_device_us(event("k", 0.0, 9.0, device_time_total=7.0)) == 7.0
    assert gpu_check.event_device_us(event("k", 0.0, 9.0, self_device_time_total=6.0)) == 6.0
    assert gpu_check.event_device_us(event("k", 0.0, 9.0, device_time=5.0)) == 5.0
    assert gpu_check.event_device_us(event("k", 0.0, 9.0, cuda_time=4.0)) == 4.0  # an older torch
    assert gpu_check.event_device_us(event("k", 2.0, 9.0)) == 7.0  # no field: the time range
    assert gpu_check.event_device_us(event("k", 2.0, 9.0, device_time_total=0)) == 7.0  # zero: not recorded


def test_gpu_busy_time_is_none_without_cuda_kernels() -> None:
    host_only = [event("aten::mm", 0.0, 10.0, device="DeviceType.CPU"), event("Memset (Device)", 0.0, 1.0)]
    assert gpu_check.kernel_busy(host_only, 5) == {"device_ms_per_iteration": None,
                                                   "device_busy_ms_per_iteration": None}
    no_ranges = [SimpleNamespace(name="gemm", device_type="DeviceType.CUDA", device_time_total=500.0)]
    assert gpu_check.kernel_busy(no_ranges, 1) == {"device_ms_per_iteration": 0.5, "device_busy_ms_per_iteration": None}
    with pytest.raises(ValueError):
        gpu_check.kernel_busy([], 0)


def test_kernel_rows_set_gpu_busy_beside_the_wall_time_of_the_same_batch() -> None:
    decode = [{"graphs": "on", "batch": 64, "median_ms": 4.0}, {"graphs": "on", "batch": 1, "median_ms": 1.0},
              {"graphs": "off", "batch": 64, "median_ms": 12.0}]
    rows = gpu_check.kernel_rows(fake_engine()["kernels"], decode)
    assert rows["on"]["wall_ms"] == 4.0 and rows["on"]["host_bound_share"] == pytest.approx(0.25)  # 1 - 3 / 4
    assert rows["off"]["wall_ms"] == 12.0 and rows["off"]["host_bound_share"] is None  # no GPU figure
    summed_only = {"on": {"device_ms_per_iteration": 2.0, "device_busy_ms_per_iteration": None}}
    assert gpu_check.kernel_rows(summed_only, decode)["on"]["host_bound_share"] == pytest.approx(0.5)
    assert gpu_check.kernel_rows(summed_only, [])["on"]["host_bound_share"] is None  # no wall time


def test_greedy_comparison_names_the_first_difference() -> None:
    assert gpu_check.compare_greedy([[1, 2], [3]], [[1, 2], [3]])["identical"]
    different = gpu_check.compare_greedy([[1, 2, 3], [3]], [[1, 9, 3], [3]])
    assert not different["identical"] and different["differences"] == ["prompt 0: first differs at token 1"]
    assert not gpu_check.compare_greedy([[1]], [[1], [2]])["identical"]


# ---- summary, report, plot ----------------------------------------------------------------------
def write_fake_parts(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    gpu_check.write_json(out / "prepare.json", {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "model": "/m",
                                         "bandwidth": {"copy_gbs": 3000.0, "read_gbs": 3200.0, "floor_gbs": 3200.0}})
    gpu_check.write_json(out / "engine.json", fake_engine())
    gpu_check.write_json(out / "gpu_tests.json", {"passed": 21, "failed": 0, "errors": 0})
    gpu_check.write_json(out / "capacity_plan.json", gpu_check.capacity_plan(fake_engine()))
    for search, budget, capacity in (("sarathi-strict", 256, {"10.2": 2.0}), ("sarathi-relaxed", 2048, {"50.8": 4.0}),
                                     ("vllm", None, {"10.2": 0.0, "50.8": 2.5})):
        policy = search.partition("-")[0]
        label = f"{policy}:{budget}" if budget else policy
        (out / gpu_check.capacity_folder(search)).mkdir()
        gpu_check.write_json(out / gpu_check.capacity_folder(search) / "capacity.json",
                             {"setup": {"qps_low": 0.5}, "policies": [{"label": label, "policy": policy,
                                                                       "token_budget": budget,
                                                                       "capacity_qps": capacity}]})
    gpu_check.write_json(out / "vllm.json", {"skipped": "`import vllm` fails for python3"})


def test_summary_from_part_files(tmp_path: Path) -> None:
    write_fake_parts(tmp_path)
    statuses = {"prepare": {"status": "ok", "seconds": 12.0, "note": ""}}
    summary = gpu_check.summarize(tmp_path, 4, statuses)
    row = next(r for r in summary["decode"] if r["graphs"] == "on" and r["batch"] == 64)
    assert row["median_ms"] == pytest.approx(4.0)
    floor = gpu_check.decode_read_bytes(gpu_check.model_config(4), 64, 524.5) / 3200e9 * 1e3
    assert row["floor_ms"] == pytest.approx(floor) and row["x_floor"] == pytest.approx(4.0 / floor)
    assert row["scaled_32_ms"] == pytest.approx(4.0 + 28 * (4.0 - 3.0) / 2)
    head = summary["headline"]
    assert head["graphs"] == "on" and head["greedy_identical"] is True
    # each SLO's ratio is the sarathi search with that SLO's budget against vllm's
    assert head["capacity_ratio"]["50.8"] == {"value": pytest.approx(1.6), "sarathi": "sarathi:2048"}
    assert head["capacity_ratio"]["10.2"]["at_least"] == pytest.approx(2.0 / summary["capacity"]["plan"]["qps_low"])
    assert head["capacity_ratio"]["10.2"]["sarathi"] == "sarathi:256"
    assert summary["capacity"]["capacity_qps"] == {"sarathi": {"10.2": 2.0, "50.8": 4.0},
                                                   "vllm": {"10.2": 0.0, "50.8": 2.5}}
    assert summary["kernels"]["on"]["wall_ms"] == pytest.approx(4.0)
    assert summary["kernels"]["on"]["host_bound_share"] == pytest.approx(0.25)
    assert head["gpu_tests"] == {"passed": 21, "failed": 0, "errors": 0}
    json.dumps(summary)  # everything in it is JSON


def test_report_renders_headline_sections_and_reasons(tmp_path: Path) -> None:
    write_fake_parts(tmp_path)
    summary = gpu_check.summarize(tmp_path, 4, {"capacity": {"status": "timeout", "seconds": 180.0, "note": "stopped"}})
    report = gpu_check.render_report(summary)
    assert "**4 of 32 layers**" in report and "NVIDIA H100" in report
    assert "| capacity | timeout | 180 | stopped |" in report
    assert "sarathi:2048 / vllm @ 50.8 ms: 1.60×" in report and "sarathi:256 / vllm @ 10.2 ms: ≥ " in report
    assert "| sarathi-strict | sarathi:256 | 2.000 @ 10.2 |" in report
    assert "| sarathi-relaxed | sarathi:2048 | 4.000 @ 50.8 |" in report
    assert "| vllm | vllm | 0.000 @ 10.2, 2.500 @ 50.8 |" in report
    budgets = summary["capacity"]["plan"]["token_budgets"]
    assert f"{budgets['strict']} strict, {budgets['relaxed']} relaxed, each SLO its own sarathi search" in report
    assert "GPU busy ms" in report and "| on | 300.0 | 2.0 | 1.0 | 3.100 | 3.000 | 4.000 | 25% |" in report
    assert "| off | 300.0 | 300.0 | 0.0 | — | — | 12.000 | — |" in report
    assert "Skipped: `import vllm` fails" in report
    assert "`pytest -m gpu`: 21 passed, 0 failed, 0 errors, 0 skipped;" in report
    assert "2 prompts, identical" in report
    assert "`--layers 32`" in report


def test_probes_of_a_search_stopped_at_its_limit_reach_the_report(tmp_path: Path) -> None:
    line = ("            sarathi:64   0.200 QPS  P50 TTFT   32969 ms  P99 TBT     526 ms  median delay   0.00 s  "
            "failed 29/32     86 s  (gave up: P99 TBT > 340.3 ms)")
    (tmp_path / "capacity-sarathi-strict.log").write_text(f"[replica 0 stage 0] loading\n{line}\n")
    summary = gpu_check.summarize(tmp_path, 4, {})
    assert summary["capacity_probes"] == {"sarathi-strict": [line.strip()], "vllm": [], "sarathi-relaxed": []}
    report = gpu_check.render_report(summary)
    assert "No search finished" in report and line.strip() in report


def test_report_without_any_part_output_still_renders(tmp_path: Path) -> None:
    summary = gpu_check.summarize(tmp_path, 4, {})
    report = gpu_check.render_report(summary)
    assert "Not measured" in report and "Not run." in report
    assert summary["headline"]["decode_ms"] is None


def test_report_notes_a_build_without_graphs(tmp_path: Path) -> None:
    write_fake_parts(tmp_path)
    gpu_check.write_json(tmp_path / "engine.json", fake_engine(graphs=False))
    summary = gpu_check.summarize(tmp_path, 4, {})
    assert summary["headline"]["graphs"] == "off"
    assert gpu_check.GRAPHS_UNAVAILABLE in gpu_check.render_report(summary)


def test_plots_are_written(tmp_path: Path) -> None:
    write_fake_parts(tmp_path)
    summary = gpu_check.summarize(tmp_path, 4, {})
    for draw, name in ((gpu_check.plot_decode, "decode.png"), (gpu_check.plot_capacities, "capacity.png")):
        path = draw(summary, tmp_path / name)
        assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert gpu_check.plot_decode({"decode": []}, tmp_path / "none.png") is None
    assert gpu_check.plot_capacities({"capacity": None}, tmp_path / "none.png") is None


def test_capacity_ratio_is_a_value_a_bound_or_a_note() -> None:
    assert gpu_check.capacity_ratio(3.0, 1.5, 0.5) == {"value": 2.0}
    assert gpu_check.capacity_ratio(3.0, 0.0, 0.5)["at_least"] == 6.0
    assert "neither" in gpu_check.capacity_ratio(0.0, 0.0, 0.5)["note"]
    assert gpu_check.capacity_summary({"sarathi-strict": None, "vllm": None}, None) is None


def capacity_doc(policy: str, budget: int | None, capacity: dict[str, float]) -> dict[str, Any]:
    label = f"{policy}:{budget}" if budget else policy
    return {"policies": [{"label": label, "policy": policy, "token_budget": budget, "capacity_qps": capacity}]}


def test_capacity_ratio_per_slo_compares_that_slos_sarathi_search() -> None:
    runs = {"sarathi-strict": capacity_doc("sarathi", 128, {"26.6": 5.665}),
            "vllm": capacity_doc("vllm", None, {"26.6": 1.133, "133.2": 11.328}),
            "sarathi-relaxed": capacity_doc("sarathi", 2048, {"133.2": 22.656})}
    summary = gpu_check.capacity_summary(runs, {"qps_low": 1.133})
    assert summary is not None
    assert summary["ratio"] == {"26.6": {"value": pytest.approx(5.0), "sarathi": "sarathi:128"},
                                "133.2": {"value": pytest.approx(2.0), "sarathi": "sarathi:2048"}}
    assert summary["searches"]["sarathi-relaxed"]["token_budget"] == 2048
    # the relaxed search did not finish: no relaxed ratio, rather than the strict budget's figure
    partial = gpu_check.capacity_summary({**runs, "sarathi-relaxed": None}, {"qps_low": 1.133})
    assert partial is not None and list(partial["ratio"]) == ["26.6"]
    assert (gpu_check.capacity_summary({"vllm": runs["vllm"]}, None) or {})["ratio"] == {}


def test_the_capacity_plot_names_each_slos_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from chariot.bench import plots

    drawn: dict[str, Any] = {}
    original = plots.plot_capacity

    def record(capacity: dict[str, Any], path: Path, title: str = "") -> Path:
        drawn.update(capacity)
        return original(capacity, path, title)

    runs = {"sarathi-strict": capacity_doc("sarathi", 128, {"26.6": 5.0}),
            "vllm": capacity_doc("vllm", None, {"26.6": 1.0, "133.2": 11.0}),
            "sarathi-relaxed": capacity_doc("sarathi", 2048, {"133.2": 22.0})}
    summary = {"capacity": gpu_check.capacity_summary(runs, {}), "layers": 4, "gpu": "H200"}
    monkeypatch.setattr(plots, "plot_capacity", record)
    assert gpu_check.plot_capacities(summary, tmp_path / "capacity.png") is not None
    assert drawn == {"sarathi (token budget 128 @ 26.6 ms, 2048 @ 133.2 ms)": {26.6: 5.0, 133.2: 22.0},
                     "vllm": {26.6: 1.0, 133.2: 11.0}}


# ---- running parts ------------------------------------------------------------------------------
def test_part_output_goes_to_its_log_and_progress_lines_are_echoed(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code = f"print('noise'); print({gpu_check.PROGRESS!r} + 'step 1'); import sys; sys.exit(3)"
    assert gpu_check.run_logged([sys.executable, "-c", code], tmp_path / "p.log", 60) == 3
    log = (tmp_path / "p.log").read_text()
    assert "noise" in log and "step 1" in log
    echoed = capsys.readouterr().out
    assert "step 1" in echoed and "noise" not in echoed


def test_a_part_past_its_limit_is_killed_and_reported(tmp_path: Path) -> None:
    code = f"import time; print({gpu_check.PROGRESS!r} + 'started', flush=True); time.sleep(60)"
    assert gpu_check.run_logged([sys.executable, "-c", code], tmp_path / "slow.log", 1.0) is None
    assert "started" in (tmp_path / "slow.log").read_text()


def test_the_check_records_failures_timeouts_and_parts_it_had_no_time_for(tmp_path: Path) -> None:
    check = gpu_check.Check(gpu_check.parse_args(["--out", str(tmp_path), "--budget-s", "100"]))
    assert check.run("prepare", [sys.executable, "-c", "raise SystemExit(1)"]).status == "failed"
    check.started -= 90  # 10 s of the budget left: below MIN_PART_S
    assert check.run("engine-on", [sys.executable, "-c", "pass"]).status == "skipped"
    assert check.statuses["engine-on"]["note"].startswith("out of time")
    assert set(gpu_check.PART_LIMITS_S) == {"prepare", "gpu_tests", "vllm",
                                            *(f"engine-{r}" for r in gpu_check.ENGINE_RUNS),
                                            *(f"capacity-{s}" for s in gpu_check.CAPACITY_SEARCHES)}
    # three capacity searches within 60 s more than the two of one search per policy (100 s each)
    assert sum(v for k, v in gpu_check.PART_LIMITS_S.items() if k.startswith("capacity-")) <= 260


def test_the_capacity_part_runs_every_search(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "model").mkdir()
    gpu_check.write_json(tmp_path / "prepare.json", {"model": str(tmp_path / "model")})
    gpu_check.write_json(tmp_path / "engine.json", fake_engine())
    args = gpu_check.parse_args(["--out", str(tmp_path), "--parts", "capacity", "--model-root", str(tmp_path)])
    started: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(gpu_check.Check, "run", lambda self, name, cmd, cwd=None: started.append((name, cmd)))
    gpu_check.run_parts(gpu_check.Check(args))
    assert [name for name, _ in started] == ["capacity-sarathi-strict", "capacity-vllm", "capacity-sarathi-relaxed"]
    assert [cmd[cmd.index("--search") + 1] for _, cmd in started] == list(gpu_check.CAPACITY_SEARCHES)


def test_model_root_prefers_the_first_folder_with_room(tmp_path: Path) -> None:
    shm, build = tmp_path / "shm", tmp_path / "build"
    room = {shm: 10, build: 100}
    assert gpu_check.pick_model_root([shm, build], 50, room.__getitem__) == build
    assert gpu_check.pick_model_root([shm, build], 5, room.__getitem__) == shm
    assert gpu_check.checkpoint_bytes(4) > 3.5e9


# ---- the engine part, on the CPU ----------------------------------------------------------------
def test_half_depth_checkpoint_reads_only_its_layers(tmp_path: Path, small_model_dir: Path) -> None:
    half = parts.link_half_depth(small_model_dir, tmp_path / "half", 2)
    assert json.loads((half / "config.json").read_text())["num_hidden_layers"] == 2
    assert (half / "tokenizer.json").is_symlink()
    import torch

    stage = load_stage(half, (0, 2), torch.float32, progress=False, cpu_linears=False)
    assert len(stage.layers) == 2


def test_engine_part_measures_and_records_on_a_tiny_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    record = parts.EngineRecord(tmp_path / "engine.json", context=16)
    sweep = parts.Sweep(device="cpu", dtype="float32", batches=(1, 3), context=16, prefill_tokens=(8, 32),
                        hybrid_budgets=(8, 16), hybrid_decodes=3, max_model_len=512, kv_cache_tokens=4096)
    parts.measure_engine(record, str(tiny_model_dir), "off", "off", full=True, sweep=sweep)
    saved = json.loads((tmp_path / "engine.json").read_text())
    run = saved["runs"]["off"]
    assert [r["batch"] for r in run["decode"]] == [1, 3] and [r["tokens"] for r in run["prefill"]] == [8, 32]
    assert all(r["median_ms"] > 0 and math.isfinite(r["median_ms"]) for r in run["decode"] + run["prefill"])
    assert [len(t) for t in run["greedy"]] == [parts.GREEDY_TOKENS] * len(parts.GREEDY_PROMPT_LENS)
    assert [(r["budget"], r["decodes"]) for r in run["hybrid"]] == [(8, 3), (16, 3)]
    assert all(r["median_ms"] > 0 and r["reps"] == parts.PREFILL_REPS for r in run["hybrid"])
    rows = gpu_check.hybrid_rows(saved)
    assert [r["decode_only_ms"] for r in rows] == [run["decode"][1]["median_ms"]] * 2  # 3 decodes alone
    assert "| off | 16 | 3 + 13 |" in gpu_check._report_hybrid({"hybrid": rows, "layers": 2})


def test_engine_runs_follow_the_build_and_the_depth() -> None:
    assert gpu_check.engine_runs(True, 4) == ["on", "off", "sync", "on_half", "off_half"]
    assert gpu_check.engine_runs(False, 4) == ["off", "off_half"]
    assert gpu_check.engine_runs(True, 32) == ["on", "off", "sync"]


def test_an_engine_run_replaces_its_own_record_and_keeps_the_others(tmp_path: Path) -> None:
    gpu_check.write_json(tmp_path / "engine.json", {"runs": {"on": {"decode": [1]}, "off": {"decode": [2]}},
                                                    "kernels": {"on": {}}})
    record = parts.EngineRecord(tmp_path / "engine.json")
    record.run("off")["decode"].append(3)
    record.save()
    saved = json.loads((tmp_path / "engine.json").read_text())
    assert saved["runs"] == {"on": {"decode": [1]}, "off": {"decode": [3], "prefill": [], "hybrid": []}}
    assert saved["graphs_available"] == gpu_check.graphs_in_this_build()


def test_kernel_profile_runs_on_the_cpu(tiny_model_dir: Path) -> None:
    from chariot.worker.engine import Engine

    sweep = parts.Sweep(device="cpu", dtype="float32", batches=(2,), context=8, prefill_tokens=(8,),
                        max_model_len=128, kv_cache_tokens=1024)
    engine = Engine(sweep.engine_config(str(tiny_model_dir), "off"), progress=False)
    try:
        row = parts.measure_decode(engine, 2, 8, profile=True)
    finally:
        engine.shutdown()
    assert row["kernels"]["kernels_per_iteration"] == 0.0  # no CUDA: no kernels, and no failure
    assert row["kernels"]["device_ms_per_iteration"] is None and row["kernels"]["device_busy_ms_per_iteration"] is None
    assert not engine.has_unfinished


def test_a_part_without_its_input_is_skipped_with_the_reason(tmp_path: Path) -> None:
    assert gpu_check.missing_input("engine", tmp_path) == "no checkpoint: the prepare part did not finish"
    gpu_check.write_json(tmp_path / "prepare.json", {"model": str(tmp_path / "model")})
    assert "rerun the prepare part" in str(gpu_check.missing_input("engine", tmp_path))  # removed after a check
    (tmp_path / "model").mkdir()
    assert gpu_check.missing_input("engine", tmp_path) is None
    assert gpu_check.missing_input("capacity", tmp_path) == "no engine measurements to derive the SLO from"
    gpu_check.write_json(tmp_path / "engine.json", fake_engine())
    assert gpu_check.missing_input("capacity", tmp_path) is None


def test_exit_code_fails_only_for_what_went_wrong() -> None:
    ok = {"status": "ok", "seconds": 1.0, "note": ""}
    no_vllm = {"status": "skipped", "seconds": 0.0, "note": "`import vllm` fails for python3"}
    assert gpu_check.exit_code({"prepare": ok, "vllm": no_vllm}) == 0
    for bad in ({"status": "timeout", "note": ""}, {"status": "failed", "note": "exit code 1"},
                {"status": "skipped", "note": "out of time (10 s of the budget left)"},
                {"status": "skipped", "note": "no checkpoint: the prepare part did not finish"}):
        assert gpu_check.exit_code({"prepare": ok, "engine-on": bad}) == 1


def test_a_dry_run_report_says_its_figures_mean_nothing(tmp_path: Path) -> None:
    write_fake_parts(tmp_path)
    prepare = json.loads((tmp_path / "prepare.json").read_text())
    gpu_check.write_json(tmp_path / "prepare.json", {**prepare, "preset": "small"})
    summary = gpu_check.summarize(tmp_path, 4, {})
    assert summary["dry_run"] and "A dry run on the CPU" in gpu_check.render_report(summary)
    assert not gpu_check.summarize(tmp_path.parent / "absent", 4, {})["dry_run"]
