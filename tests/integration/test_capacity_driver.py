"""The capacity benchmark's load driver against a real stack (router + worker processes on the tiny
preset), `chariot bench capacity` end to end, and the plots on synthetic runs."""

from __future__ import annotations

import argparse
import json
import math

import pytest
from matplotlib.image import imread

from chariot.bench.capacity import RequestTrace, RunMetrics
from chariot.bench.capacity_cli import (
    PolicyConfig,
    add_bench_parser,
    parse_policies,
    parse_slos,
    running_stack,
    warm_up,
)
from chariot.bench.driver import GiveUp, _Live, _metrics, drive
from chariot.bench.plots import load_traces, plot_capacity, plot_tbt_cdf, plot_token_timelines
from chariot.bench.plots import main as plots_main
from chariot.bench.traces import TRACES
from chariot.contracts.errors import ConfigError
from chariot.worker.config import EngineConfig

PNG = b"\x89PNG\r\n\x1a\n"
TINY_VOCAB = 512
LOAD = {"scale": 0.02, "max_len": 256}  # chat trace: prompts ~35, outputs ~8 tokens on the tiny model


def assert_png(path):
    assert path.read_bytes()[:8] == PNG
    h, w, _ = imread(path).shape
    assert h > 100 and w > 100


# ---- the driver against a real router ------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), policy="sarathi", token_budget=64, max_model_len=256,
                          kv_cache_tokens=4096)
    with running_stack(config, timeout_s=120) as s:
        warm_up(s.router, TINY_VOCAB)
        yield s


@pytest.mark.slow
def test_driver_replays_a_trace_through_the_router(stack, tmp_path):
    done = []
    result = drive(stack.router, TRACES["chat"], 4.0, 8, TINY_VOCAB, seed=3, on_done=lambda: done.append(1), **LOAD)
    m = result.metrics
    assert result.gave_up is None and result.errors == () and len(done) == 8
    assert m.requests == 8 and m.failed == 0 and m.qps == 4.0
    for value in (m.p50_ttft, m.p90_ttft, m.p50_tbt, m.p99_tbt, m.median_scheduling_delay, m.throughput_tokens_per_s):
        assert math.isfinite(value)
    assert m.p50_ttft > 0 and m.p50_tbt > 0 and m.p99_tbt >= m.p50_tbt and m.median_scheduling_delay >= 0
    assert m.throughput_tokens_per_s > 0
    for req, trace in zip(result.requests, result.traces, strict=True):
        assert trace.ok and trace.prompt_tokens == req.prompt_len
        assert len(trace.token_times) == req.decode_len  # ignore_eos: exactly max_tokens
        assert trace.scheduled is not None and trace.arrival <= trace.scheduled <= trace.token_times[0] + 1e-3
        assert abs(trace.arrival - req.arrival_s) < 0.5  # sent on time (open loop)
        assert list(trace.token_times) == sorted(trace.token_times)
    written = [plot_tbt_cdf({"sarathi:64": result.traces}, tmp_path / "cdf.png", 4.0, [200, 1000]),
               plot_token_timelines({"sarathi:64": result.traces}, tmp_path / "timelines.png", stall_s=0.2)]
    for path in written:
        assert_png(path)


@pytest.mark.slow
def test_driver_counts_unreachable_router_as_failed():
    result = drive("127.0.0.1:1", TRACES["chat"], 50.0, 3, TINY_VOCAB, **LOAD)
    assert result.metrics.failed == 3 and not result.metrics.meets(10.0)
    assert len(result.errors) == 1 and result.errors[0].startswith("UNAVAILABLE")


@pytest.mark.slow
def test_bench_capacity_command(tiny_model_dir, tmp_path):
    parser = argparse.ArgumentParser(prog="chariot")
    add_bench_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "out"
    args = parser.parse_args(["bench", "capacity", "--model", str(tiny_model_dir), "--scale", "0.02", "--max-len",
                              "256", "--requests", "6", "--policies", "sarathi:64", "--qps-low", "3", "--qps-high",
                              "6", "--max-probes", "1", "--kv-cache-tokens", "4096", "--tbt-slo-ms", "100,30000",
                              "--out", str(out)])  # a 30 s loosest SLO: no early give-up on a busy CI machine
    assert args.handler(args) == 0
    doc = json.loads((out / "capacity.json").read_text())
    assert doc["setup"]["trace"] == "chat" and doc["setup"]["tbt_slo_ms"] == [100.0, 30000.0]
    (policy,) = doc["policies"]
    assert policy["label"] == "sarathi:64" and set(policy["capacity_qps"]) == {"100", "30000"}
    assert [p["qps"] for p in policy["probes"]] == [3.0] and policy["probes"][0]["failed"] == 0
    assert (out / "capacity.csv").read_text().startswith("policy,trace,scale,tbt_slo_ms,capacity_qps")
    assert len((out / "probes.csv").read_text().splitlines()) == 2
    assert len(json.loads((out / "traces.json").read_text())["sarathi:64"]["3"]) == 6
    for name in ("capacity.png", "tbt_cdf.png", "timelines.png"):
        assert_png(out / name)
    # Redrawing at a probed load reads the run back from traces.json; an unprobed load is refused.
    assert plots_main([str(out), "--qps", "3"]) == 0
    for name in ("tbt_cdf-3.png", "timelines-3.png"):
        assert_png(out / name)
    assert {p: len(ts) for p, ts in load_traces(out, 3.0).items()} == {"sarathi:64": 6}
    assert plots_main([str(out), "--qps", "4"]) == 2


# ---- pieces without servers ----------------------------------------------------------------------
def test_parse_policies_and_slos():
    assert parse_policies("sarathi:256, vllm,orca,fastertransformer") == [
        PolicyConfig("sarathi", 256), PolicyConfig("vllm"), PolicyConfig("orca"), PolicyConfig("fastertransformer")]
    assert PolicyConfig("sarathi", 256).label == "sarathi:256" and PolicyConfig("vllm").label == "vllm"
    assert parse_slos("1000,200") == [200.0, 1000.0]
    for bad in ("nope", "sarathi:x", ""):
        with pytest.raises(ConfigError):
            parse_policies(bad)
    with pytest.raises(ConfigError):
        parse_slos("0")


def live(arrival, scheduled=None, tokens=(), max_tokens=3, done=False, error=None):
    return _Live(arrival, max_tokens, 10, arrival, scheduled, list(tokens), done, error)


def test_give_up_only_when_the_verdict_is_certain():
    rule = GiveUp(tbt_slo_s=1.0, max_delay_s=2.0)
    ok = [live(0.0, 0.1, (0.5, 0.6, 0.7), done=True) for _ in range(4)]
    assert rule.reason(ok, now=10.0) is None
    failed = [*ok[:3], live(0.0, error="RESOURCE_EXHAUSTED: shed")]
    assert rule.reason(failed, now=1.0) == "a request failed (RESOURCE_EXHAUSTED: shed)"
    # 2 of 4 still waiting 3 s after arrival: the median may still be ≤ 2 s; 3 of 4 decide it.
    waiting = [live(0.0), live(0.0), *ok[:2]]
    assert rule.reason(waiting, now=3.0) is None
    assert "scheduling delay" in rule.reason([live(0.0), *waiting[:2], ok[0]], now=3.0)
    # 200 gaps: the nearest-rank P99 tolerates 2 slow ones; a third (here still open) decides it.
    long = [live(0.0, 0.0, [float(i) / 10 for i in range(101)], max_tokens=101, done=True) for _ in range(2)]
    long[0].token_times[50:] = [t + 5 for t in long[0].token_times[50:]]
    long[1].token_times[50:] = [t + 5 for t in long[1].token_times[50:]]
    assert rule.reason(long, now=100.0) is None
    open_gap = live(0.0, 0.0, (0.0,), max_tokens=2)
    assert rule.reason([*long, open_gap], now=0.5) is None
    assert "P99 TBT" in rule.reason([*long, open_gap], now=5.0)


def test_cut_short_run_reports_what_it_saw_and_fails():
    done = RequestTrace(0.0, 0.1, (0.5, 0.6))
    cut = RequestTrace(1.0, 1.1, (1.5, 4.5), ok=False)  # its 3 s stall is why the run was cut
    unsent = RequestTrace(9.0, None, (), ok=False)
    m = _metrics(1.0, [done, cut, unsent], 5.0, cut_short=True)
    assert m.failed == 2 and m.p99_tbt == pytest.approx(3.0) and not m.meets(10.0)
    assert m.extra == {"gave_up": 1.0}
    assert _metrics(1.0, [done, cut, unsent], 5.0, cut_short=False).p99_tbt == pytest.approx(0.1)


def synthetic_traces(stall_at: float | None) -> list[RequestTrace]:
    traces = []
    for i in range(6):
        start = i * 0.5
        times = [start + 0.3 + 0.05 * k for k in range(40)]
        if stall_at is not None:
            times = [t + 1.5 if t > stall_at else t for t in times]
        traces.append(RequestTrace(start, start + 0.1, tuple(times), prompt_tokens=100))
    return [*traces, RequestTrace(3.0, None, (), ok=False)]


def test_plots_on_synthetic_runs(tmp_path):
    capacity = {"sarathi:128": {200.0: 0.9, 1000.0: 1.4}, "vllm": {200.0: 0.3, 1000.0: 1.1},
                "fastertransformer": {200.0: 0.0, 1000.0: 0.2}}
    traces = {"sarathi:128": synthetic_traces(None), "vllm": synthetic_traces(2.0)}
    metrics = RunMetrics.from_traces(1.0, traces["vllm"], 10.0)
    assert metrics.failed == 1 and metrics.p99_tbt == pytest.approx(1.55)
    written = [
        plot_capacity(capacity, tmp_path / "capacity.png", "synthetic"),
        plot_tbt_cdf(traces, tmp_path / "sub" / "cdf.png", qps=1.0, slos_ms=[200, 1000]),
        plot_token_timelines(traces, tmp_path / "timelines.png", max_requests=4, stall_s=0.2, qps=1.0),
        plot_token_timelines({}, tmp_path / "empty.png"),
        plot_tbt_cdf({"none": []}, tmp_path / "empty_cdf.png"),
    ]
    for path in written:
        assert_png(path)
