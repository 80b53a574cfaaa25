"""`chariot bench peer`: the pure parts (flags, SSE → token times, fresh prompts, shared prefix,
capacity bounds and ratios, give-up verdicts, CPU record), and the streaming client against Chariot's
real OpenAI HTTP front on the tiny preset. vLLM is never started here (the test suite does not
install it)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from chariot.bench.capacity import RequestTrace, RunMetrics, search_capacity
from chariot.bench.capacity_cli import add_bench_parser
from chariot.bench.machine_speed import PhaseClock, PhaseSpeed, Speed, measure_speed
from chariot.bench.peer import (
    IDLE_PATHS,
    SERVED_NAME,
    SERVED_PACKAGES,
    SHARED_PREFIX_TOKENS,
    TCMALLOC_LIBS,
    TCMALLOC_PACKAGE,
    Bounds,
    Limits,
    LoadResult,
    OfflineRound,
    PeerConfig,
    Planned,
    Probe,
    Server,
    Turns,
    VariantResult,
    _Stream,
    add_peer_args,
    busy_requests,
    capacity_bounds,
    chariot_command,
    chariot_server,
    check_vllm_head_dim,
    common_load,
    comparison,
    compose_preload,
    config_from_flags,
    find_tcmalloc,
    flag_probes,
    format_capacity,
    format_ratio,
    fresh_prompts,
    grid_note,
    latency_summary,
    machine_comparison,
    machine_note,
    measure_phase,
    median_round,
    parse_cpuinfo,
    phase_order,
    probe_metrics,
    probe_seed,
    probe_verdict,
    request_body,
    resolve_config,
    run_groups,
    run_load,
    served_roots,
    source_digest,
    source_note,
    sse_payload,
    stop_reason,
    summary_table,
    token_times_from_sse,
    variant_json,
    variant_notes,
    variant_prefix,
    variant_summary,
    vllm_command,
    vllm_env,
    wait_idle,
    warm_up,
    with_vllm_allocator,
    with_vllm_openmp,
)
from chariot.bench.traces import TRACES
from chariot.cli.main import parser as chariot_parser
from chariot.contracts.errors import ConfigError
from chariot.contracts.processes import group_members

VOCAB = 512


def args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_peer_args(p)
    return p.parse_args(list(argv))


def sse(obj: object) -> str:
    return "data: " + json.dumps(obj)


def chunk(token_ids: list[int] | None = None, text: str = "x", usage: int | None = None) -> str:
    choice: dict[str, object] = {"index": 0, "text": text, "finish_reason": None}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body: dict[str, object] = {"choices": [choice]}
    if usage is not None:
        body["usage"] = {"prompt_tokens": 3, "completion_tokens": usage, "total_tokens": 3 + usage}
    return sse(body)


# ---- flags ---------------------------------------------------------------------------------------
def test_defaults_resolve_to_the_documented_run() -> None:
    cfg = resolve_config(args())
    assert cfg.model == Path("models/100m") and cfg.dtype == "float32" and cfg.token_budget == 512
    assert cfg.trace == TRACES["chat"] and cfg.scale == 0.25 and cfg.requests == 64
    assert cfg.tbt_slo_ms == 1000 and cfg.ttft_slo_ms == 2000
    assert cfg.systems == ("chariot", "vllm") and cfg.variants == ("fresh", "shared-prefix")
    assert cfg.out == Path("bench/results/peer") and not cfg.quick and cfg.order == "probe"
    quick = resolve_config(args("--quick"))
    assert quick.max_probes < cfg.max_probes and quick.single_output < cfg.single_output
    assert cfg.searches == 3 and quick.searches == 1 and resolve_config(args("--searches", "5")).searches == 5
    assert cfg.vllm_tcmalloc and not resolve_config(args("--no-vllm-tcmalloc")).vllm_tcmalloc
    assert grid_note(cfg) is None and grid_note(quick) is None
    tuned = grid_note(resolve_config(args("--qps-low", "0.3", "--qps-high", "0.4")))
    assert tuned is not None and "0.3 / 0.4 QPS" in tuned and "not the default grid (0.25 / 1 QPS" in tuned


@pytest.mark.parametrize(("argv", "field"), [
    (["--requests", "0"], "requests"),
    (["--systems", "chariot,tgi"], "systems"),
    (["--systems", ""], "systems"),
    (["--variants", "cached"], "variants"),
    (["--qps-low", "2", "--qps-high", "1"], "qps_high"),
    (["--qps-low", "0"], "qps_low"),
    (["--dtype", "int8"], "dtype"),
    (["--trace", "books"], "trace"),
    (["--token-budget", "0"], "token_budget"),
    (["--tbt-slo-ms", "-1"], "tbt_slo_ms"),
    (["--ttft-slo-ms", "0"], "ttft_slo_ms"),
    (["--kv-cache-gib", "0"], "kv_cache_gib"),
    (["--max-len", "300"], "max_len"),
    (["--scale", "0"], "scale"),
    (["--vllm-reserved-cpus", "4096"], "vllm_reserved_cpus"),
    (["--order", "random"], "order"),
    (["--searches", "0"], "searches"),
])
def test_bad_flags_raise_config_error_naming_the_field(argv: list[str], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_config(args(*argv))
    assert err.value.field == field
    assert any(ch.isdigit() for ch in err.value.message) or "," in err.value.message  # names the limit


def test_registered_as_chariot_bench_peer() -> None:
    handed = chariot_parser().parse_args(["bench", "peer", "--quick", "--requests", "8"])
    assert handed.bench_args == ["peer", "--quick", "--requests", "8"]  # `chariot` hands them to chariot.bench
    bench = argparse.ArgumentParser(prog="chariot")
    add_bench_parser(bench.add_subparsers(dest="command", required=True))
    parsed = bench.parse_args(["bench", *handed.bench_args])
    assert parsed.bench_command == "peer" and parsed.requests == 8 and parsed.quick
    assert parsed.handler.__name__ == "run_peer"


def test_vllm_rejects_a_head_dim_its_cpu_attention_lacks(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError) as err:
        check_vllm_head_dim(tiny_model_dir)  # the tiny preset has head_dim 16
    assert err.value.field == "model" and "head_dim 16" in err.value.message and "32" in err.value.message


def test_both_servers_get_the_same_model_dtype_budget_and_kv_bytes(tiny_model_dir: Path) -> None:
    cfg = PeerConfig(model=tiny_model_dir, dtype="float32", token_budget=256, trace=TRACES["chat"], scale=0.25,
                     requests=8, tbt_slo_ms=1000, ttft_slo_ms=2000, qps_low=0.5, qps_high=1.0, tolerance=0.5,
                     max_probes=2, systems=("chariot", "vllm"), variants=("fresh",), quick=True, out=Path("/tmp/x"),
                     max_len=1024, kv_cache_gib=1)
    ours, theirs = chariot_command(cfg), vllm_command(cfg, 12345)

    def flag(cmd: list[str], name: str) -> str:
        return cmd[cmd.index(name) + 1]

    assert flag(ours, "--model") == flag(theirs, "--model") == str(tiny_model_dir.resolve())
    assert flag(ours, "--dtype") == flag(theirs, "--dtype") == "float32"
    assert flag(ours, "--token-budget") == flag(theirs, "--max-num-batched-tokens") == "256"
    assert flag(ours, "--max-model-len") == flag(theirs, "--max-model-len") == "1024"
    assert flag(ours, "--max-batch-size") == flag(theirs, "--max-num-seqs")
    assert flag(ours, "--policy") == "sarathi" and "--enable-chunked-prefill" in theirs
    # tiny preset: 2 layers × K and V × 2 KV heads × 16 dims × 4 bytes = 512 B per token → 1 GiB
    assert int(flag(ours, "--kv-cache-tokens")) == (1 << 30) // 512
    assert vllm_env(cfg)["VLLM_CPU_KVCACHE_SPACE"] == "1" and "PYTHONPATH" not in vllm_env(cfg)
    # vLLM's model workers get every core, as Chariot's engine does; < 0 on the command line keeps vLLM's default
    assert vllm_env(cfg)["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in vllm_env(replace(cfg, vllm_reserved_cpus=None))
    assert resolve_config(args("--vllm-reserved-cpus", "-1")).vllm_reserved_cpus is None
    # Chariot serves prompts in arrival order, as vLLM does, unless the run asks for another order
    assert flag(ours, "--prefill-order") == "fcfs"
    shortest = resolve_config(args("--chariot-prefill-order", "shortest"))
    assert flag(chariot_command(replace(cfg, prefill_order=shortest.prefill_order)), "--prefill-order") == "shortest"
    assert float(flag(ours, "--ttft-slo-ms")) >= 3_600_000 and int(flag(ours, "--max-queue-per-replica")) >= 10**6
    assert flag(theirs, "--port") == "12345" and flag(ours, "--http-port") == "0"
    # both log what each iteration carried
    assert "--enable-logging-iteration-details" in theirs
    logged = chariot_command(cfg, Path("/tmp/i.jsonl"))
    assert "--iteration-log" not in ours and flag(logged, "--iteration-log") == "/tmp/i.jsonl"


# ---- SSE → token times ---------------------------------------------------------------------------
def test_sse_chunks_become_token_times() -> None:
    events = [(1.0, chunk([7])), (1.0, ""), (1.5, chunk([8, 9])), (2.0, chunk([], text="")),
              (2.5, chunk([10])), (3.0, sse({"choices": [], "usage": {"completion_tokens": 4}})),
              (3.0, "data: [DONE]")]
    times, error, done = token_times_from_sse(events)
    assert times == (1.0, 1.5, 1.5, 2.5) and error is None and done  # 2 tokens in one chunk: one zero gap


def test_sse_counts_from_cumulative_usage_when_chunks_carry_no_token_ids() -> None:
    events = [(1.0, chunk(usage=1)), (2.0, chunk(usage=3)), (3.0, chunk(text="", usage=3)),
              (4.0, sse({"choices": [], "usage": {"completion_tokens": 4}}))]
    assert token_times_from_sse(events)[0] == (1.0, 2.0, 2.0, 4.0)


def test_sse_falls_back_to_one_token_per_text_chunk_and_reports_errors() -> None:
    events = [(1.0, chunk(text="a")), (2.0, chunk(text="")), (3.0, chunk(text="b")),
              (4.0, sse({"error": {"message": "engine died", "code": 500}}))]
    times, error, done = token_times_from_sse(events)
    assert times == (1.0, 3.0) and error == "engine died" and not done
    assert sse_payload(": keep-alive") is None and sse_payload("data: not json") is None


def test_request_body_asks_both_servers_for_the_same_stream() -> None:
    body = request_body(SERVED_NAME, [20, 21], 5)
    assert body["prompt"] == [20, 21] and body["max_tokens"] == 5 and body["stream"] is True
    assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["return_token_ids"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


# ---- prompts -------------------------------------------------------------------------------------
def test_probes_get_fresh_contents_with_the_same_lengths() -> None:
    lengths = [5, 40, 300, 1]
    seeds = [probe_seed(0, "vllm", "fresh", 0), probe_seed(0, "vllm", "fresh", 1), probe_seed(0, "chariot", "fresh", 0)]
    assert len(set(seeds)) == 3
    runs = [fresh_prompts(lengths, VOCAB, s) for s in seeds]
    for run in runs:
        assert [len(p) for p in run] == lengths
        assert all(16 <= t < VOCAB for p in run for t in p)
    for a, b in [(0, 1), (0, 2), (1, 2)]:
        assert all(pa != pb for pa, pb in zip(runs[a][:3], runs[b][:3], strict=True))
    assert fresh_prompts(lengths, VOCAB, seeds[0]) == runs[0]  # deterministic per seed


def test_shared_prefix_variant_shares_exactly_the_prefix() -> None:
    assert variant_prefix("fresh", VOCAB, 0) == []
    prefix = variant_prefix("shared-prefix", VOCAB, 0)
    assert len(prefix) == SHARED_PREFIX_TOKENS and prefix == variant_prefix("shared-prefix", VOCAB, 0)
    probes = [fresh_prompts([10, 20, 30], VOCAB, probe_seed(0, "chariot", "shared-prefix", i), prefix) for i in (0, 1)]
    prompts = [p for probe in probes for p in probe]
    assert [len(p) for p in probes[0]] == [SHARED_PREFIX_TOKENS + n for n in (10, 20, 30)]
    assert all(p[:SHARED_PREFIX_TOKENS] == prefix for p in prompts)
    assert len({p[SHARED_PREFIX_TOKENS] for p in prompts}) > 1  # the shared part ends at the prefix
    assert len({tuple(p[SHARED_PREFIX_TOKENS:]) for p in prompts}) == len(prompts)


# ---- capacity bounds and ratios ------------------------------------------------------------------
def test_capacity_bounds_from_probes() -> None:
    assert capacity_bounds([(0.5, True), (1.0, False), (0.75, True)]) == Bounds(0.75, 1.0)
    assert capacity_bounds([(0.5, True), (1.0, True)]) == Bounds(1.0, None)
    assert capacity_bounds([(0.5, False)]) == Bounds(0.0, 0.5)
    assert format_capacity(Bounds(0.75, 1.0)) == "[0.75, 1)"
    assert format_capacity(Bounds(1.0, None)) == "≥ 1"
    assert format_capacity(Bounds(0.0, 0.5)) == "< 0.5"
    assert format_capacity(Bounds(0.90625, 1.375)) == "[0.90625, 1.375)"  # the loads probed, not 0.906 and 1.38


def test_capacity_ratio_at_a_search_bound_renders_as_a_range() -> None:
    bracketed = Bounds(0.5, 0.75)
    # both bracketed: still a range, 1 / 0.75 to 1.5 / 0.5, with the passing probes' ratio beside it
    assert format_ratio(Bounds(1.0, 1.5), bracketed) == "1.33–3.00× (2.00× at the highest passing probes)"
    assert format_ratio(Bounds(2.0, None), bracketed) == "≥ 2.67×"  # ours at the ceiling: 2 / 0.75
    assert format_ratio(Bounds(1.0, 1.5), Bounds(0.0, 0.25)) == "≥ 4.00×"  # theirs under the floor
    assert format_ratio(Bounds(0.0, 0.25), Bounds(1.0, 1.5)) == "< 0.25×"  # ours under the floor
    assert format_ratio(Bounds(1.0, 1.5), Bounds(1.0, None)) == "< 1.50×"  # theirs at the ceiling
    assert format_ratio(Bounds(1.0, None), Bounds(1.0, None)) == "unknown"


def test_common_load_is_the_highest_both_passed() -> None:
    assert common_load([{0.5: True, 1.0: True, 2.0: False}, {0.5: True, 1.0: True, 1.5: True}]) == 1.0
    assert common_load([{0.5: True, 1.0: False}, {0.5: False, 1.0: False}]) == 1.0  # none passed: highest probed
    assert common_load([{0.5: True}, {0.75: True}]) is None


# ---- phase order and drift ----------------------------------------------------------------------
def test_variant_order_puts_the_phases_a_ratio_compares_next_to_each_other() -> None:
    phases = phase_order(("chariot", "vllm"), ("fresh", "shared-prefix"), "variant")
    assert phases == [("chariot", "fresh", 0), ("vllm", "fresh", 0), ("vllm", "shared-prefix", 0),
                      ("chariot", "shared-prefix", 0)]
    by_system = phase_order(("chariot", "vllm"), ("fresh", "shared-prefix"), "system")
    assert by_system == [("chariot", "fresh", 0), ("chariot", "shared-prefix", 0), ("vllm", "fresh", 0),
                         ("vllm", "shared-prefix", 0)]
    assert phase_order(("vllm",), ("fresh", "shared-prefix"), "variant") == [("vllm", "fresh", 0),
                                                                             ("vllm", "shared-prefix", 0)]


def measured(system: str, speed: PhaseSpeed | None, tokens_per_s: float) -> VariantResult:
    return VariantResult(system, "fresh", capacity=Bounds(0.5, 0.75), offline={"output_tokens_per_s": tokens_per_s},
                         single={"tbt_p50_ms": 20.0}, speed=speed)


def test_the_offline_result_is_the_median_round_and_keeps_every_round() -> None:
    def round_(wall_s: float) -> OfflineRound:
        summary = {"wall_s": wall_s, "output_tokens_per_s": 1000 / wall_s, "failed": 0, "output_tokens": 1000}
        return OfflineRound(summary, (RequestTrace(arrival=wall_s, scheduled=None, token_times=()),))

    rounds = [round_(130.0), round_(104.0), round_(110.0)]
    summary = median_round(rounds)
    assert summary["round"] == 2 and summary["wall_s"] == 110.0
    result = VariantResult("chariot", "fresh", offline=summary, offline_rounds=tuple(rounds))
    assert result.offline_traces == rounds[2].traces and VariantResult("vllm", "fresh").offline_traces == ()
    assert [r["wall_s"] for r in summary["rounds"]] == [130.0, 104.0, 110.0]  # run order, all kept
    assert median_round(rounds[:2])["wall_s"] == 130.0  # an even count takes the slower middle round
    assert median_round(rounds[1:2])["round"] == 0
    comp = {"variant": "fresh", "common_qps": None,
            "systems": {"chariot": {"capacity": "-", "at_common_load": None, "offline": summary,
                                    "single": {}, "machine": None}}}
    assert "chariot's offline rounds took 130, 104, 110 s" in summary_table([{"variant": "fresh",
                                                                              "searches": [comp]}])


def test_a_comparison_says_how_much_the_machine_drifted_between_its_phases() -> None:
    from chariot.bench.peer import Limits

    limits = Limits(1.0, 2.0)
    fast = PhaseSpeed(Speed(120.0, 20.0), Speed(118.0, 20.0), steal=0.0)
    same = PhaseSpeed(Speed(119.0, 19.8), Speed(120.0, 20.1), steal=0.0)
    slow = PhaseSpeed(Speed(90.0, 15.0), Speed(92.0, 15.5), steal=0.01)
    calm = comparison([measured("chariot", fast, 80.0), measured("vllm", same, 60.0)], "fresh", limits)
    assert calm is not None and calm["machine"]["trusted"] and calm["machine"]["drift"] <= 0.05
    assert calm["offline_throughput_ratio"] == pytest.approx(80 / 60, abs=1e-3)
    drifted = comparison([measured("chariot", fast, 80.0), measured("vllm", slow, 60.0)], "fresh", limits)
    assert drifted is not None and not drifted["machine"]["trusted"]
    assert drifted["machine"]["speed_ratio"]["matmul"] == pytest.approx(119 / 91, abs=1e-3)
    table = summary_table([{"variant": "fresh", "searches": [drifted]}])
    assert "mix the systems with the machine's drift" in table and "| 119, 20.0 |" in table
    assert drifted["flagged"] and not calm["flagged"] and "FLAGGED" in table
    assert "same machine speed" in summary_table([{"variant": "fresh", "searches": [calm]}])
    missing = comparison([measured("chariot", fast, 80.0), measured("vllm", None, 60.0)], "fresh", limits)
    assert missing is not None and missing["machine"] is None and missing["flagged"]
    assert "no machine calibration" in summary_table([{"variant": "fresh", "searches": [missing]}])


# ---- verdicts and summaries ----------------------------------------------------------------------
def trace(arrival: float, times: list[float], ok: bool = True) -> RequestTrace:
    return RequestTrace(arrival=arrival, scheduled=None, token_times=tuple(times), prompt_tokens=4, ok=ok)


def test_probe_passes_only_within_both_slos_and_without_failures() -> None:
    fast = [trace(0.0, [0.1, 0.2, 0.3]), trace(1.0, [1.2, 1.3, 1.4])]
    assert probe_metrics(1.0, LoadResult(tuple(fast), 2.0), ttft_slo_s=0.5).meets(0.2)
    assert not probe_metrics(1.0, LoadResult(tuple(fast), 2.0), ttft_slo_s=0.05).meets(0.2)  # median TTFT
    assert not probe_metrics(1.0, LoadResult(tuple(fast), 2.0), ttft_slo_s=0.5).meets(0.05)  # P99 TBT
    failed = [*fast, trace(2.0, [2.1], ok=False)]
    m = probe_metrics(1.0, LoadResult(tuple(failed), 3.0), ttft_slo_s=0.5)
    assert m.failed == 1 and not m.meets(0.2)


def test_latency_summary_percentiles_in_ms() -> None:
    s = latency_summary([trace(0.0, [0.1, 0.2, 0.4]), trace(1.0, [1.3, 1.4])], wall_s=2.0)
    assert s["ttft_p50_ms"] == pytest.approx(100.0) and s["ttft_p99_ms"] == pytest.approx(300.0)
    assert s["tbt_p50_ms"] == pytest.approx(100.0) and s["tbt_p99_ms"] == pytest.approx(200.0)
    assert s["output_tokens"] == 5 and s["output_tokens_per_s"] == 2.5 and s["failed"] == 0
    assert latency_summary([])["tbt_p99_ms"] is None


def stream(max_tokens: int, arrival: float | None, times: list[float], done: bool = False) -> _Stream:
    return _Stream(Planned(0.0, [1, 2], max_tokens), arrival=arrival, token_times=times, done=done)


def test_stop_reason_fires_only_when_the_verdict_is_certain() -> None:
    from chariot.bench.peer import Limits

    limits = Limits(tbt_slo_s=0.5, ttft_slo_s=1.0)
    healthy = [stream(3, 0.0, [0.2, 0.4]), stream(3, 0.1, [0.3])]
    assert stop_reason(healthy, 0.5, limits) is None
    waiting = [stream(3, 0.0, []), stream(3, 0.0, []), stream(3, 0.0, [0.1])]
    assert stop_reason(waiting, 1.5, limits) == "median TTFT > 1 s"
    stalled = [stream(200, 0.0, [0.1])]  # 199 gaps: P99 allows one slow gap
    assert stop_reason(stalled, 0.9, limits) is None  # one open slow gap is allowed
    stalled[0].token_times.append(1.0)  # one observed slow gap, and the open one
    assert stop_reason(stalled, 1.7, limits) == "P99 TBT > 500 ms"
    broken = [*healthy, _Stream(Planned(0.0, [1], 3), arrival=0.0, error="HTTP 500", done=True)]
    assert stop_reason(broken, 0.5, limits) == "a request failed (HTTP 500)"


def test_busy_requests_from_either_server() -> None:
    assert busy_requests(json.dumps({"status": "ok", "in_flight": 2})) == 2
    metrics = ('# HELP x\nvllm:num_requests_running{engine="0",model_name="peer"} 1.0\n'
               'vllm:num_requests_waiting{engine="0",model_name="peer"} 3.0\n'
               'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 3.0\n')
    assert busy_requests(metrics) == 4
    # Chariot: the router may be done while the engine still holds aborted requests
    ours = ('chariot_requests_running{component="router",gen_ai_request_model="peer",replica="g0"} 24.0\n'
            'chariot_requests_waiting{component="router",gen_ai_request_model="peer",replica="g0"} 1.0\n'
            'chariot_requests_running_total 7\n')
    assert busy_requests(ours) == 25 and IDLE_PATHS["chariot"] == ("/health", "/metrics")


def test_cpuinfo_model_flags_and_count() -> None:
    text = ("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: sse avx2 fma avx512f\n\n"
            "processor\t: 1\nmodel name\t: AMD EPYC 9R14\nflags\t\t: sse avx2 fma avx512f\n")
    cpu = parse_cpuinfo(text)
    assert cpu.model == "AMD EPYC 9R14" and cpu.flags == ("avx2", "avx512f", "fma", "sse") and cpu.logical_cpus == 2
    assert parse_cpuinfo("").logical_cpus == 0


# ---- tcmalloc for vLLM ---------------------------------------------------------------------------
def fake_library(path: Path, elf_class: int | None = None) -> Path:
    """A file with this interpreter's ELF header (or its class byte changed): what the loader checks."""
    header = bytearray(Path(sys.executable).resolve().read_bytes()[:64])
    if elf_class is not None:
        header[4] = elf_class
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(header))
    return path


def peer_cfg(**changes: object) -> PeerConfig:
    cfg = PeerConfig(model=Path("models/100m"), dtype="float32", token_budget=512, trace=TRACES["chat"], scale=0.25,
                     requests=8, tbt_slo_ms=1000, ttft_slo_ms=2000, qps_low=0.25, qps_high=1.0, tolerance=0.1,
                     max_probes=8, systems=("chariot", "vllm"), variants=("fresh",), quick=False, out=Path("/tmp/x"))
    return replace(cfg, **changes)


def test_tcmalloc_is_found_in_a_library_folder_minimal_build_first(tmp_path: Path) -> None:
    full = fake_library(tmp_path / "a" / "libtcmalloc.so.4")
    assert find_tcmalloc(listing="", dirs=[tmp_path / "a"]) == full
    minimal = fake_library(tmp_path / "b" / "libtcmalloc_minimal.so.4")
    assert find_tcmalloc(listing="", dirs=[tmp_path / "a", tmp_path / "b"]) == minimal
    assert find_tcmalloc(listing="", dirs=[tmp_path / "nothing-here"]) is None
    assert TCMALLOC_LIBS[0] == "libtcmalloc_minimal.so.4"


def test_tcmalloc_is_found_from_ldconfig_and_a_foreign_or_broken_library_is_skipped(tmp_path: Path) -> None:
    cached = fake_library(tmp_path / "cache" / "libtcmalloc_minimal.so.4")
    listing = (f"3 libs found in cache `/etc/ld.so.cache'\n"
               f"\tlibtcmalloc_minimal_debug.so.4 (libc6,x86-64) => {tmp_path}/missing.so.4\n"
               f"\tlibtcmalloc_minimal.so.4 (libc6,x86-64) => {cached}\n")
    assert find_tcmalloc(listing=listing, dirs=[]) == cached
    other_class = 1 if Path(sys.executable).resolve().read_bytes()[4] == 2 else 2
    fake_library(tmp_path / "lib32" / "libtcmalloc_minimal.so.4", elf_class=other_class)  # a 32-bit build
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "libtcmalloc.so.4").write_text("not a library")
    assert find_tcmalloc(listing="", dirs=[tmp_path / "lib32", tmp_path / "text"]) is None
    good = fake_library(tmp_path / "lib64" / "libtcmalloc.so.4")
    assert find_tcmalloc(listing="", dirs=[tmp_path / "lib32", tmp_path / "lib64"]) == good


def test_missing_tcmalloc_fails_naming_the_library_and_the_install_command(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        with_vllm_allocator(peer_cfg(), listing="", dirs=[tmp_path])
    assert err.value.field == "vllm_tcmalloc"
    message = err.value.message
    assert "libtcmalloc_minimal.so.4" in message and f"apt-get install -y {TCMALLOC_PACKAGE}" in message
    assert "--no-vllm-tcmalloc" in message
    assert with_vllm_allocator(peer_cfg(vllm_tcmalloc=False), listing="", dirs=[tmp_path]).vllm_allocator is None
    assert with_vllm_allocator(peer_cfg(systems=("chariot",)), listing="", dirs=[tmp_path]).vllm_allocator is None
    lib = fake_library(tmp_path / "libtcmalloc_minimal.so.4")
    assert with_vllm_allocator(peer_cfg(), listing="", dirs=[tmp_path]).vllm_allocator == lib


def test_ld_preload_puts_tcmalloc_first_and_keeps_what_was_there(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    assert compose_preload(None, lib) == str(lib) and compose_preload("", None) == ""
    assert compose_preload("/opt/a.so /opt/b.so", lib) == f"{lib}:/opt/a.so:/opt/b.so"  # spaces or colons
    assert compose_preload(f"/opt/a.so:{lib}", lib) == f"{lib}:/opt/a.so"  # not twice
    assert compose_preload("/opt/a.so", None) == "/opt/a.so"
    monkeypatch.setenv("LD_PRELOAD", "/opt/trace.so")
    assert vllm_env(peer_cfg(vllm_allocator=lib))["LD_PRELOAD"] == f"{lib}:/opt/trace.so"
    assert vllm_env(peer_cfg())["LD_PRELOAD"] == "/opt/trace.so"
    monkeypatch.delenv("LD_PRELOAD")
    assert "LD_PRELOAD" not in vllm_env(peer_cfg())


def test_intel_openmp_comes_from_vllms_venv_after_tcmalloc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--vllm-openmp intel` preloads the venv's libiomp5 behind tcmalloc (the allocator must come
    first); a venv without it fails naming the setting and the pip command; `gnu` preloads nothing."""
    venv = tmp_path / "venv"
    intel = peer_cfg(vllm_openmp="intel")
    with pytest.raises(ConfigError) as err:
        with_vllm_openmp(intel, venv)
    assert err.value.field == "vllm_openmp" and "pip install intel-openmp" in err.value.message
    iomp = fake_library(venv / "lib" / "libiomp5.so")
    assert with_vllm_openmp(intel, venv).vllm_openmp_lib == iomp.resolve()
    assert with_vllm_openmp(peer_cfg(), venv).vllm_openmp_lib is None
    assert with_vllm_openmp(replace(intel, systems=("chariot",)), venv).vllm_openmp_lib is None
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    tcmalloc = tmp_path / "libtcmalloc_minimal.so.4"
    env = vllm_env(replace(intel, vllm_allocator=tcmalloc, vllm_openmp_lib=iomp))
    assert env["LD_PRELOAD"] == f"{tcmalloc}:{iomp}"
    assert config_from_flags(["--vllm-openmp", "intel"]).vllm_openmp == "intel"
    assert config_from_flags([]).vllm_openmp == "gnu"


# ---- repeated searches ---------------------------------------------------------------------------
def test_searches_alternate_the_systems_so_each_comparison_is_adjacent() -> None:
    phases = phase_order(("chariot", "vllm"), ("fresh",), "variant", searches=3)
    assert phases == [("chariot", "fresh", 0), ("vllm", "fresh", 0), ("vllm", "fresh", 1), ("chariot", "fresh", 1),
                      ("chariot", "fresh", 2), ("vllm", "fresh", 2)]
    two = phase_order(("chariot", "vllm"), ("fresh", "shared-prefix"), "variant", searches=2)
    firsts = [two[i][0] for i in range(0, len(two), 2)]
    assert firsts == ["chariot", "vllm", "chariot", "vllm"]  # the alternation runs on across variants
    assert all(a[1:] == b[1:] and a[0] != b[0] for a, b in zip(two[::2], two[1::2], strict=True))
    by_system = phase_order(("chariot", "vllm"), ("fresh",), "system", searches=2)
    assert by_system == [("chariot", "fresh", 0), ("vllm", "fresh", 0), ("vllm", "fresh", 1), ("chariot", "fresh", 1)]
    together = run_groups(("chariot", "vllm"), ("fresh", "shared-prefix"), "probe", searches=2)
    assert together == [(("chariot", "vllm"), "fresh", 0), (("vllm", "chariot"), "fresh", 1),
                        (("chariot", "vllm"), "shared-prefix", 0), (("vllm", "chariot"), "shared-prefix", 1)]
    assert run_groups(("chariot", "vllm"), ("fresh",), "variant", searches=2) == [
        (("chariot",), "fresh", 0), (("vllm",), "fresh", 0), (("vllm",), "fresh", 1), (("chariot",), "fresh", 1)]
    assert len({probe_seed(0, "vllm", "fresh", 0, search) for search in range(3)}) == 3  # fresh prompts per search


def test_a_system_under_the_floor_is_searched_down_with_as_many_probes() -> None:
    def system(capacity: float) -> Callable[[float], RunMetrics]:
        def evaluate(qps: float) -> RunMetrics:
            return RunMetrics(qps, 8, 0, 0.1, 0.1, 0.05, 0.5 if qps <= capacity else 2.0, 0.0, 100.0)
        return evaluate

    above = search_capacity(system(0.6), 1.0, 0.25, 1.0, 0.1, 8, descend=True)
    below = search_capacity(system(0.1), 1.0, 0.25, 1.0, 0.1, 8, descend=True)
    assert [round(m.qps, 4) for m in above.probes] == [0.25, 1.0, 0.625, 0.4375, 0.5312, 0.5781]
    assert [round(m.qps, 4) for m in below.probes] == [0.25, 0.125, 0.0625, 0.0938, 0.1094, 0.1016]
    assert above.capacity_qps == 0.578125 and below.capacity_qps == 0.09375  # both bracketed to the tolerance
    assert len(search_capacity(system(0.1), 1.0, 0.25, 1.0, 0.1, 8).probes) == 1  # without descend: one probe
    assert search_capacity(system(0.001), 1.0, 0.25, 1.0, 0.1, 3, descend=True).capacity_qps == 0.0


def test_the_default_grid_brackets_each_capacity_within_five_percent() -> None:
    """With the default grid a capacity anywhere from the floor to 8 QPS ends in a bracket narrower than
    5 % of its top, within the probes allowed: two such brackets put a ratio within about 10 %."""
    cfg = resolve_config(args())
    for capacity in (0.3, 0.7, 1.3, 1.7, 2.3, 2.4, 3.1, 5.9, 7.9):
        def evaluate(qps: float, capacity: float = capacity) -> RunMetrics:
            return RunMetrics(qps, 8, 0, 0.1, 0.1, 0.05, 0.5 if qps <= capacity else 2.0, 0.0, 100.0)
        res = search_capacity(evaluate, 1.0, cfg.qps_low, cfg.qps_high, cfg.tolerance, cfg.max_probes, descend=True)
        failed = min(m.qps for m in res.probes if m.qps > res.capacity_qps)
        assert res.capacity_qps <= capacity < failed, capacity
        assert failed - res.capacity_qps <= cfg.tolerance * failed, (capacity, res.capacity_qps, failed)


def test_the_source_digest_follows_the_served_sources(tmp_path: Path) -> None:
    """A C++ or Python file edited between two servers changes the digest; other files do not. The real
    packages are found and read too (the digest of this checkout is stable between two calls)."""
    (tmp_path / "kernels" / "csrc").mkdir(parents=True)
    kernel, notes = tmp_path / "kernels" / "csrc" / "a.cpp", tmp_path / "kernels" / "README.txt"
    kernel.write_text("int a;")
    notes.write_text("x")
    roots = {"kernels": tmp_path / "kernels"}
    first = source_digest(roots)
    notes.write_text("y")
    assert source_digest(roots) == first
    kernel.write_text("int b;")
    assert source_digest(roots) != first
    assert set(served_roots()) == set(SERVED_PACKAGES) and source_digest() == source_digest()


def test_a_run_whose_source_changed_says_which_searches_ran_what() -> None:
    assert source_note({1: "aaaa", 2: "aaaa", 3: "aaaa"}) is None
    note = source_note({1: "aaaa", 2: "bbbb", 3: "bbbb"})
    assert note is not None and "search 1 ran aaaa; searches 2, 3 ran bbbb" in note
    summary = {"variant": "fresh", "chariot_sources": {1: "aaaa", 2: "bbbb"}}
    assert any("SOURCE CHANGED" in n and n.startswith("fresh: ") for n in variant_notes(summary))
    assert not any("SOURCE" in n for n in variant_notes({"variant": "fresh", "chariot_sources": {1: "aaaa"}}))


def probe(qps: float, passed: bool) -> Probe:
    tr = trace(0.0, [0.1, 0.2, 0.3], ok=passed)
    return Probe(qps, probe_metrics(qps, LoadResult((tr,), 1.0), ttft_slo_s=2.0), LoadResult((tr,), 1.0), "seed")


def searched(system: str, search: int, probes: dict[float, bool], speed: PhaseSpeed | None,
             tokens_per_s: float) -> VariantResult:
    res = VariantResult(system, "fresh", {q: probe(q, ok) for q, ok in probes.items()}, search=search, speed=speed,
                        offline={"output_tokens_per_s": tokens_per_s}, single={"tbt_p50_ms": 30.0})
    flag_probes(res, LIMITS)
    return res


LIMITS = Limits(1.0, 2.0)
CALM = PhaseSpeed(Speed(120.0, 20.0), Speed(121.0, 20.1), steal=0.0)
SLOW = PhaseSpeed(Speed(90.0, 15.0), Speed(91.0, 15.2), steal=0.0)


def three_searches() -> list[VariantResult]:
    """Chariot and vLLM over three searches in the alternating order; the third one drifted."""
    return [
        searched("chariot", 0, {0.25: True, 1.0: False, 0.625: True, 0.8125: False}, CALM, 110.0),
        searched("vllm", 0, {0.25: True, 1.0: False, 0.625: False, 0.4375: True}, CALM, 100.0),
        searched("vllm", 1, {0.25: True, 1.0: False, 0.625: False}, CALM, 104.0),
        searched("chariot", 1, {0.25: True, 1.0: True, 2.0: False}, CALM, 106.0),
        searched("chariot", 2, {0.25: False, 0.125: True}, CALM, 130.0),
        searched("vllm", 2, {0.25: False, 0.125: True}, SLOW, 90.0),
    ]


def test_the_report_gives_the_ratio_range_over_searches_and_leaves_flagged_ones_out() -> None:
    summary = variant_summary(three_searches(), "fresh", LIMITS)
    assert summary is not None
    per_search = [c["capacity_ratio_range"] for c in summary["searches"]]
    assert per_search == [[pytest.approx(0.625 / 0.625), pytest.approx(0.8125 / 0.4375)],
                          [pytest.approx(1.0 / 0.625), pytest.approx(2.0 / 0.25)],
                          [pytest.approx(0.125 / 0.25), pytest.approx(0.25 / 0.125)]]
    assert [c["order"] for c in summary["searches"]] == [["chariot", "vllm"], ["vllm", "chariot"],
                                                         ["chariot", "vllm"]]
    assert [c["flagged"] for c in summary["searches"]] == [False, False, True]
    cap = summary["capacity_ratio"]
    # lowest low to highest high of the unflagged searches (not the best one); the flagged one apart
    assert cap["range"] == [pytest.approx(1.0), pytest.approx(8.0)] and cap["flagged"] == 1
    assert cap["range_all"] == [pytest.approx(0.5), pytest.approx(8.0)]
    off = summary["offline_throughput_ratio"]
    assert off["range"] == [pytest.approx(1.019, abs=1e-3), pytest.approx(1.1)]
    assert off["range_all"][1] == pytest.approx(130 / 90, abs=1e-3)
    table = summary_table([summary])
    assert "fresh search 3 (chariot, vllm) FLAGGED" in table
    assert "fresh: Chariot/vLLM over 3 searches (the 2 unflagged; 1 flagged left out): capacity 1.00–8.00×, " \
           "offline throughput 1.019–1.100× (with the flagged: capacity 0.50–8.00×, offline throughput " \
           "1.019–1.444×)" in table


def test_the_report_counts_each_systems_probes_per_search_and_in_all() -> None:
    summary = variant_summary(three_searches(), "fresh", LIMITS)
    assert summary is not None
    assert summary["probes"] == {"chariot": {"per_search": [4, 3, 2], "total": 9},
                                 "vllm": {"per_search": [4, 3, 2], "total": 9}}
    assert "fresh: probes per search: chariot 4, 3, 2 (9 in all); vllm 4, 3, 2 (9 in all)" in summary_table([summary])
    assert "| fresh | 2 | vllm | [0.25, 0.625) | 3 |" in summary_table([summary])
    one_sided = variant_summary([r for r in three_searches() if r.system == "chariot"], "fresh", LIMITS)
    assert one_sided is not None and "capacity_ratio" not in one_sided


def test_every_search_flagged_claims_no_ratio() -> None:
    results = [searched("chariot", 0, {0.25: True, 1.0: False}, CALM, 110.0),
               searched("vllm", 0, {0.25: True, 1.0: False}, SLOW, 100.0)]
    summary = variant_summary(results, "fresh", LIMITS)
    assert summary is not None and summary["capacity_ratio"]["range"] is None
    assert "every search flagged by the drift check, no ratio claimed" in summary_table([summary])


def test_turns_let_two_searches_probe_one_at_a_time_in_alternation() -> None:
    turns = Turns(("chariot", "vllm"))
    log: list[str] = []
    inside = threading.Semaphore(1)

    def search(system: str, probes: int) -> None:
        try:
            for i in range(probes):
                with turns.turn(system):
                    assert inside.acquire(blocking=False), "two probes at once"
                    log.append(f"{system}{i}")
                    time.sleep(0.01)
                    inside.release()
        finally:
            turns.leave(system)

    threads = [threading.Thread(target=search, args=("vllm", 4)), threading.Thread(target=search, args=("chariot", 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    # chariot goes first; once it is done, vLLM's search goes on alone
    assert log == ["chariot0", "vllm0", "chariot1", "vllm1", "vllm2", "vllm3"]


def test_interleaved_searches_drift_by_their_calibrations_medians_not_the_spread_they_share() -> None:
    dip = Speed(75.0, 12.5)  # a calibration that landed on a short slow spell
    chariot = PhaseSpeed(Speed(120.0, 20.0), Speed(121.0, 20.0), 0.0, (dip, Speed(119.0, 20.0), Speed(120.0, 20.1)))
    vllm = PhaseSpeed(Speed(121.0, 20.0), Speed(121.0, 20.0), 0.0, (Speed(120.0, 20.0), Speed(118.0, 19.9)))
    apart = machine_comparison(chariot, vllm)
    together = machine_comparison(chariot, vllm, interleaved=True)
    assert apart is not None and together is not None
    assert not apart["trusted"] and apart["drift"] == pytest.approx(121 / 75 - 1, abs=1e-3)  # the dip's spread
    assert together["trusted"] and together["drift"] < 0.02 and together["within"] == apart["drift"]
    assert together["speed_ratio"]["matmul"] < 0.95  # the mean still shows the dip; the check reads the medians
    note = machine_note("fresh search 1 (chariot, vllm)", together)
    assert "probes interleaved" in note and "the systems' probes ran on the same machine speed" in note
    assert together["chance"]["draws"] > 0 and "random splits of the same calibrations drift past 5%" in note
    assert "chance" not in apart  # phases one after the other: no random split to compare with
    slower = PhaseSpeed(Speed(100.0, 17.0), Speed(101.0, 17.0), 0.0, (Speed(99.0, 17.0), Speed(100.0, 17.0)))
    tilted = machine_comparison(chariot, slower, interleaved=True)
    assert tilted is not None and not tilted["trusted"]  # one system's probes ran on a slower machine: flagged
    res = [searched("chariot", 0, {0.25: True, 1.0: False}, chariot, 110.0),
           searched("vllm", 0, {0.25: True, 1.0: False}, vllm, 100.0)]
    for r in res:
        r.interleaved = True
    comp = comparison(res, "fresh", LIMITS)
    assert comp is not None and comp["flagged"] is False and comp["machine"]["interleaved"] is True
    assert variant_json(res[0], LIMITS)["interleaved"] is True


def test_a_probe_next_to_a_contended_calibration_is_flagged_not_passed() -> None:
    busy = Speed(60.0, 10.0, others_busy=0.5)
    quiet = Speed(120.0, 20.0, others_busy=0.01)
    # calibrations: before probe 1, before probe 2 (contended), before probe 3, before the offline round
    speed = PhaseSpeed(quiet, quiet, steal=0.0, during=(busy, quiet, quiet))
    res = searched("chariot", 0, {0.25: True, 1.0: True, 2.0: False}, speed, 100.0)
    assert res.flagged == {0.25, 1.0}  # probe 1 ends next to it, probe 2 starts after it
    assert [probe_verdict(res, q, LIMITS) for q in res.probes] == ["flagged", "flagged", "FAIL"]
    assert res.capacity == Bounds(0.0, 2.0)  # the flagged passes do not count towards the capacity
    raw = variant_json(res, LIMITS)
    assert [(p["passed"], p["flagged"], p["verdict"]) for p in raw["probes"]] == [
        (True, True, "flagged"), (True, True, "flagged"), (False, False, "FAIL")]  # kept in the record
    assert raw["capacity"]["flagged_probes_left_out"] == 2
    row = summary_table([{"variant": "fresh", "searches": [comparison([res], "fresh", LIMITS)]}])
    assert "< 2 (2 flagged left out)" in row
    calm = searched("chariot", 0, {0.25: True, 1.0: True, 2.0: False}, CALM, 100.0)
    assert calm.flagged == frozenset() and calm.capacity == Bounds(1.0, 2.0)


# ---- the client against Chariot's real HTTP front ------------------------------------------------
@pytest.mark.slow
def test_streaming_client_against_chariot_http_front(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = PeerConfig(model=tiny_model_dir, dtype="float32", token_budget=64, trace=TRACES["chat"], scale=0.02,
                     requests=4, tbt_slo_ms=1000, ttft_slo_ms=2000, qps_low=0.5, qps_high=1.0, tolerance=0.5,
                     max_probes=2, systems=("chariot",), variants=("fresh",), quick=True, out=tmp_path, max_len=256,
                     kv_cache_gib=1, ready_timeout_s=180)
    prompts = fresh_prompts([12, 30, 5, 60], VOCAB, probe_seed(0, "chariot", "fresh", 0))
    planned = [Planned(0.1 * i, p, n) for i, (p, n) in enumerate(zip(prompts, [6, 1, 9, 4], strict=True))]
    with chariot_server(cfg) as server:
        group = next(pid for pid, cmd in _children() if "chariot.cli" in cmd and "up" in cmd)
        assert len(group_members(group)) > 1  # `chariot up` and the processes it started, in its own group
        warm_up(server, VOCAB)
        result = asyncio.run(run_load(server.base_url, SERVED_NAME, planned, drain_s=60))
        wait_idle(server, timeout_s=30)
    assert group_members(group) == []  # the server's exit is over before the harness goes on
    assert result.gave_up is None and result.errors == ()
    for p, t in zip(planned, result.traces, strict=True):
        assert t.ok and len(t.token_times) == p.max_tokens and t.prompt_tokens == len(p.prompt)
        assert list(t.token_times) == sorted(t.token_times) and t.token_times[0] > t.arrival >= p.arrival_s - 1e-3
    m = probe_metrics(1.0, result, ttft_slo_s=cfg.ttft_slo_ms / 1e3)
    assert m.failed == 0 and math.isfinite(m.p99_tbt) and m.meets(cfg.tbt_slo_ms / 1e3)


@pytest.mark.slow
def test_a_phase_calibrates_the_machine_around_and_between_its_measurements(tiny_model_dir: Path,
                                                                            tmp_path: Path) -> None:
    cfg = PeerConfig(model=tiny_model_dir, dtype="float32", token_budget=64, trace=TRACES["chat"], scale=0.02,
                     requests=4, tbt_slo_ms=1000, ttft_slo_ms=2000, qps_low=0.5, qps_high=1.0, tolerance=0.5,
                     max_probes=2, systems=("chariot",), variants=("fresh",), quick=True, out=tmp_path, max_len=512,
                     kv_cache_gib=1, ready_timeout_s=180, single_output=8, offline_rounds=2)
    calibrations: list[Speed] = []
    server_up: list[bool] = []

    def measure() -> Speed:  # the real workload, small enough for a test
        server_up.append(any("chariot.cli" in c and "up" in c for c in _children_commands()))
        calibrations.append(measure_speed(reps=3, shape=(32, 64, 128), read_bytes=1 << 20))
        return calibrations[-1]

    [res] = measure_phase(cfg, ("chariot",), "fresh", PhaseClock(measure=measure))
    assert res.system == "chariot" and res.variant == "fresh" and res.speed is not None and not res.interleaved
    probes = list(res.probes.values())
    # before the phase, before every probe after the first, before each offline round and the single run, after
    assert len(calibrations) == 1 + (len(probes) - 1) + cfg.offline_rounds + 1 + 1
    assert res.speed.to_json()["counted"] == len(res.speed.samples) <= len(calibrations)
    assert res.speed.before is calibrations[0] and res.speed.after is calibrations[-1]
    assert sum(p.machine is None for p in probes) == 1  # only the first probe: the phase's start measured it
    assert server_up[0] is False and server_up[-1] is False and all(server_up[1:-1])  # no server around the phase
    assert all(s.others_busy is None or 0.0 <= s.others_busy <= 1.0 for s in calibrations)  # None: < 1 tick
    assert res.offline["output_tokens"] > 0 and res.single["output_tokens"] == 8
    assert len(res.offline_rounds) == len(res.offline["rounds"]) == 2 and res.offline["round"] in (0, 1)
    assert res.offline_traces == res.offline_rounds[res.offline["round"]].traces
    # Chariot's iteration log, sliced per probe and round: every prompt token and decode of that load alone
    for traces, it in [*((p.result.traces, p.iterations) for p in probes),
                       *((o.traces, o.iterations) for o in res.offline_rounds)]:
        assert it is not None and it["source"] == "chariot --iteration-log" and all(t.ok for t in traces)
        assert it["tokens"] == sum(t.prompt_tokens + len(t.token_times) - 1 for t in traces)
        assert sum(it["histogram"].values()) == it["iterations"] > 0


@pytest.mark.slow
def test_interleaved_searches_take_turns_on_two_servers_up_together(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`--order probe` end to end on two real Chariot servers: vLLM cannot run here (the suite does not
    install it), so a second Chariot server stands in for it under the name `vllm`."""
    cfg = PeerConfig(model=tiny_model_dir, dtype="float32", token_budget=64, trace=TRACES["chat"], scale=0.02,
                     requests=4, tbt_slo_ms=1000, ttft_slo_ms=2000, qps_low=2.0, qps_high=4.0, tolerance=0.5,
                     max_probes=2, systems=("chariot", "vllm"), variants=("fresh",), quick=True, out=tmp_path,
                     max_len=512, kv_cache_gib=1, ready_timeout_s=180, single_output=8, offline_rounds=2)
    events: list[tuple[str, str]] = []  # (what, servers up) in time order

    @contextlib.contextmanager
    def stand_in(c: PeerConfig) -> Iterator[Server]:
        with chariot_server(c) as server:
            yield Server("vllm", server.base_url)

    def measure() -> Speed:
        events.append(("calibration", str(sum("chariot.cli" in " ".join(c) for c in _children_commands()))))
        return measure_speed(reps=3, shape=(32, 64, 128), read_bytes=1 << 20)

    class TrackedClock(PhaseClock):
        def mark(self, track: str = "") -> Speed:
            events.append(("mark", track))
            return super().mark(track)

    clock = TrackedClock(measure=measure)
    results = measure_phase(cfg, ("vllm", "chariot"), "fresh", clock, search=1,
                            starters={"chariot": chariot_server, "vllm": stand_in})
    assert [r.system for r in results] == ["vllm", "chariot"] and all(r.interleaved for r in results)
    # in turn: vLLM's first probe right after the span's start, then chariot's, vLLM's second, …; then the
    # offline rounds and single runs in the same turns
    assert [track for what, track in events if what == "mark"] == ["chariot", "vllm"] * 4 + ["chariot"]
    calibrations = [up for what, up in events if what == "calibration"]
    assert calibrations[0] == "0" and calibrations[-1] == "0"  # no server around the span
    assert all(up == "2" for up in calibrations[1:-1])  # both servers up for every calibration inside it
    for r in results:
        assert r.search == 1 and r.speed is not None and len(r.probes) == 2
        seeds = [p.prompt_seed for p in r.probes.values()]
        assert all(f":{r.system}:fresh:1:" in seed for seed in seeds)
        assert len(r.offline_rounds) == 2 and r.single["output_tokens"] == 8
        # its own calibrations: one before each probe, offline round and the single run, then the span's end
        assert len(r.speed.calibrations) == len(r.probes) + cfg.offline_rounds + 1 + 1
    first, second = results
    assert first.speed is not None and second.speed is not None
    assert first.speed.after is second.speed.after  # the span's end, shared
    assert sum(p.machine is None for p in first.probes.values()) == 1  # the span's start calibrated before it
    assert all(p.machine is not None for p in second.probes.values())  # it went second: its own calibration
    # 1 before the span + each system's probes, rounds and single run + 1 after, none shared but the ends
    assert len(calibrations) == 1 + sum(len(r.probes) + cfg.offline_rounds + 1 for r in results) - 1 + 1
    comp = comparison(results, "fresh", Limits(1.0, 2.0), search=1)
    assert comp is not None and comp["machine"]["interleaved"] is True and comp["order"] == ["vllm", "chariot"]


def _children_commands() -> list[list[str]]:
    """The command lines of this process's children (from /proc): a server the phase started."""
    return [cmd for _, cmd in _children()]


def _children() -> list[tuple[int, list[str]]]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == os.getpid():
                cmd = (stat.parent / "cmdline").read_bytes().decode(errors="replace").split("\0")
                out.append((int(stat.parent.name), cmd))
        except (OSError, ValueError, IndexError):
            continue
    return out
