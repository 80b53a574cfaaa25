"""The simulator replays traces through the real scheduler: same batches as the engine, fast probes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from chariot.bench.simulator import SimConfig, predict_capacity, simulate
from chariot.bench.traces import TRACES, TraceRequest, make_trace
from chariot.contracts.sampling_params import SamplingParams
from chariot.worker.budget import CostModel
from chariot.worker.config import EngineConfig, ModelConfig
from chariot.worker.engine import Engine

COST = CostModel((0.01, 4e-4, 1e-3, 1e-7, 1e-6))  # seconds: 10 ms + 0.4 ms/prefill token + ...
SMALL_TRACE = [TraceRequest(0.0, p, d) for p, d in [(40, 30), (70, 40), (25, 30), (90, 3), (33, 40), (50, 6)]]

Batches = list[list[tuple[int, int]]]


def engine_batches(model: Path, cfg: SimConfig, trace: list[TraceRequest]) -> tuple[Batches, int]:
    engine = Engine(EngineConfig(model=str(model), policy=cfg.policy, token_budget=cfg.token_budget,
                                 max_batch_size=cfg.max_batch_size, dtype="float32", block_size=cfg.block_size,
                                 kv_cache_tokens=cfg.kv_cache_tokens, max_model_len=cfg.max_model_len,
                                 prefill_order=cfg.prefill_order,
                                 prefix_caching=False),  # the simulator knows prompt lengths, not contents
                    progress=False)
    for r in trace:
        engine.add_request([5] * r.prompt_len, SamplingParams(max_tokens=r.decode_len, temperature=0.0,
                                                              ignore_eos=True))
    batches = []
    while engine.has_unfinished and len(batches) < 500:
        batch = engine.step().batch
        assert batch is not None
        batches.append([(c.seq_id, c.num_tokens) for c in batch.chunks])
    return batches, engine.stats().num_preemptions


def sim_batches(cfg: SimConfig, trace: list[TraceRequest]) -> tuple[Batches, int]:
    res = simulate(trace, cfg, COST, record_batches=True)
    return [[(c.seq_id, c.num_tokens) for c in b.chunks] for b in res.batches], res.num_preemptions


@pytest.mark.parametrize("cfg", [
    SimConfig("sarathi", token_budget=32, max_batch_size=4, max_model_len=256, kv_cache_tokens=2048),
    SimConfig("sarathi", token_budget=48, max_batch_size=8, max_model_len=256, kv_cache_tokens=288),  # preempts
    SimConfig("vllm", token_budget=None, max_batch_size=4, max_model_len=256, kv_cache_tokens=2048),
    SimConfig("sarathi", token_budget=32, max_batch_size=4, max_model_len=256, kv_cache_tokens=2048,
              prefill_order="shortest"),
], ids=["sarathi-chunked", "sarathi-preempting", "vllm", "sarathi-shortest"])
def test_simulator_matches_engine_step_for_step(tiny_model_dir: Path, cfg: SimConfig) -> None:
    cfg = dataclasses.replace(cfg, attention_cost=ModelConfig.from_dir(tiny_model_dir).attention_cost)
    real, real_preempt = engine_batches(tiny_model_dir, cfg, SMALL_TRACE)
    sim, sim_preempt = sim_batches(cfg, SMALL_TRACE)
    assert sim == real
    assert sim_preempt == real_preempt
    if cfg.policy == "sarathi":
        assert any(n < r.prompt_len for b in sim for s, n in b if n > 1 for r in [SMALL_TRACE[s]]), "no chunking"
    if cfg.kv_cache_tokens == 288:
        assert sim_preempt > 0


def test_timelines_follow_the_cost_model() -> None:
    res = simulate([TraceRequest(0.0, 10, 3)], SimConfig(token_budget=32), COST)
    prefill = COST.coefficients[0] + 10 * COST.coefficients[1] + 100 * COST.coefficients[3]
    (trace,) = res.traces
    assert trace.scheduled == 0.0 and len(trace.token_times) == 3
    assert trace.token_times[0] == pytest.approx(prefill)
    decode = COST.coefficients[0] + COST.coefficients[2] + 11 * COST.coefficients[4]
    assert trace.tbt[0] == pytest.approx(decode)
    assert res.duration_s == pytest.approx(trace.token_times[-1])


def test_idle_gaps_and_scheduling_delay() -> None:
    res = simulate([TraceRequest(0.0, 10, 2), TraceRequest(5.0, 10, 2)], SimConfig(token_budget=32), COST)
    late = res.traces[1]
    assert late.scheduled == 5.0 and late.token_times[0] > 5.0


def test_rejects_requests_the_engine_would_reject() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        simulate([TraceRequest(0.0, 200, 100)], SimConfig(max_model_len=256), COST)


def test_a_probe_of_a_few_hundred_requests_gives_each_its_whole_output() -> None:
    trace = make_trace(TRACES["chat"], 300, qps=1.0, seed=1, scale=0.25, max_len=4096)
    res = simulate(trace, SimConfig(token_budget=256), COST)
    assert all(len(t.token_times) == r.decode_len for t, r in zip(res.traces, trace, strict=True))


def test_shortest_first_lowers_the_median_ttft_under_load_and_bounds_the_longest_wait() -> None:
    """The chat trace near saturation (TTFT in seconds): serving the fewest prompt tokens left first
    cuts the median time to first token; the ageing keeps the slowest request within a third of
    what arrival order gives it."""
    trace = make_trace(TRACES["chat"], 300, qps=1.6, seed=3, scale=0.25, max_len=2048)
    cfg = SimConfig(token_budget=256, max_model_len=2048)
    ttfts = {}
    for order in ("fcfs", "shortest"):
        res = simulate(trace, dataclasses.replace(cfg, prefill_order=order), COST)
        ttfts[order] = sorted(t.ttft for t in res.traces if t.ttft is not None)
    fcfs, shortest = ttfts["fcfs"], ttfts["shortest"]
    assert fcfs[len(fcfs) // 2] > 0.5, "the load is too light to queue"
    assert shortest[len(shortest) // 2] < 0.92 * fcfs[len(fcfs) // 2]
    assert shortest[-1] < 1.33 * fcfs[-1]


def test_faster_hardware_has_more_capacity() -> None:
    kwargs = dict(num_requests=80, scale=0.25, low=0.05, high=0.5, tolerance=0.1)
    slow = predict_capacity(TRACES["chat"], "sarathi", 256, COST, 0.2, **kwargs)
    fast = predict_capacity(TRACES["chat"], "sarathi", 256, COST.scaled(0.5), 0.2, **kwargs)
    assert 0 < slow.capacity_qps < fast.capacity_qps


def test_cli_predicts_capacity_from_a_profile(tiny_model_dir: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from chariot.bench.simulator import main
    from chariot.worker.tune import Profile

    path = Profile(str(tiny_model_dir), "float32", [], COST).save(tmp_path / "p.json")
    assert main(["--profile", str(path), "--requests", "40", "--policy", "sarathi:256", "vllm"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| sarathi", "| vllm"))]
    assert len(rows) == 2 and all(float(r.split("|")[3]) > 0 for r in rows)
