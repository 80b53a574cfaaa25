"""Discrete-event simulator of one replica: the real scheduler, iteration times from a cost model.

Why: a capacity search against the real engine takes minutes per QPS probe on a CPU. The paper
(§4.3) picks budgets with a simulator (Vidur) instead. This one replays a trace through the *same*
scheduling code the engine runs (`make_scheduler` + `BlockManager` + `Sequence`; only the forward
pass is replaced by `CostModel.predict` and sampling by a fake token), so the batches it forms are
the engine's own — the tests check that step for step — and a few-hundred-request probe takes a
fraction of a second. Each request's simulated timeline is a `RequestTrace`, so
`RunMetrics.from_traces` and `search_capacity` (`chariot.bench.capacity`) apply unchanged.

Model: one iteration at a time (a single-stage replica); requests that have arrived by the start of
an iteration are queued before it is scheduled; each sampled token is stamped with the iteration's
end time; a request stops after its `decode_len` tokens or at `max_model_len` (as with
`ignore_eos`). Prompts have lengths, not contents, so the simulated engine has no prefix cache (the
benchmarks it stands in for turn prefix caching off too).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from chariot.bench.capacity import CapacityResult, RequestTrace, RunMetrics, search_capacity
from chariot.bench.traces import TRACES, TraceRequest, TraceSpec, make_trace
from chariot.contracts.engine_settings import PREFILL_ORDER
from chariot.contracts.sampling_params import SamplingParams
from chariot.worker.block_manager import BlockManager
from chariot.worker.budget import BatchShape, CostModel, load_profile
from chariot.worker.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, make_scheduler
from chariot.worker.sequence import Sequence as Seq

FAKE_TOKEN = 7
SchedulerFactory = Callable[[SchedulerConfig, BlockManager], Scheduler]
BENCH_MAX_LEN = {"chat": 2048, "arxiv": 4096}  # `chariot bench capacity` defaults (its DEFAULT_MAX_LEN)


@dataclass(frozen=True)
class SimConfig:
    """The engine knobs that shape scheduling (same meaning and defaults as `EngineConfig`)."""

    policy: str = "sarathi"
    token_budget: int | None = None
    max_batch_size: int = 128
    max_model_len: int = 4096
    kv_cache_tokens: int = 64 * 1024
    block_size: int = 16
    watermark: float = 0.01
    attention_cost: float = 0.0  # the model's `ModelConfig.attention_cost`, as the engine's scheduler uses it
    prefill_order: str = "fcfs"

    def scheduler_config(self) -> SchedulerConfig:
        """Validated and resolved exactly as the engine does (policy default budgets included)."""
        from chariot.worker.config import EngineConfig

        cfg = EngineConfig(model="", policy=self.policy, token_budget=self.token_budget,
                           max_batch_size=self.max_batch_size, block_size=self.block_size,
                           kv_cache_tokens=self.kv_cache_tokens, max_model_len=self.max_model_len,
                           watermark=self.watermark, prefill_order=self.prefill_order)
        budget = cfg.resolved_token_budget(self.max_model_len)
        return SchedulerConfig(self.policy, budget, self.max_batch_size, self.max_model_len, self.attention_cost,
                               prefill_order=cfg.prefill_order)

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_tokens // self.block_size


@dataclass
class SimResult:
    traces: list[RequestTrace]  # in trace order
    duration_s: float  # simulated time from t=0 to the last token
    iterations: int
    busy_s: float  # simulated time spent in iterations
    num_preemptions: int
    batches: list[SchedulerOutput] = field(default_factory=list)  # only with record_batches=True

    def metrics(self, qps: float) -> RunMetrics:
        m = RunMetrics.from_traces(qps, self.traces, self.duration_s)
        extra = {"iterations": float(self.iterations), "busy_fraction": self.busy_s / max(self.duration_s, 1e-12),
                 "preemptions": float(self.num_preemptions)}
        return dataclasses.replace(m, extra=extra)


def batch_shape(batch: SchedulerOutput) -> BatchShape:
    return BatchShape.of(((c.start, c.num_tokens) for c in batch.chunks), batch.num_decodes)


class _Replica:
    """The scheduler plus the engine's output handling, with simulated time."""

    def __init__(self, trace: Sequence[TraceRequest], config: SimConfig, cost_model: CostModel,
                 scheduler: SchedulerFactory = make_scheduler) -> None:
        self.sched: Scheduler = scheduler(config.scheduler_config(),
                                          BlockManager(config.num_blocks, config.block_size, config.watermark))
        self.trace = trace
        self.cost_model = cost_model
        self.max_model_len = config.max_model_len
        self.scheduled: list[float | None] = [None] * len(trace)
        self.tokens: list[list[float]] = [[] for _ in trace]
        self.now = 0.0
        self.busy = 0.0

    def add(self, seq_id: int) -> None:
        req = self.trace[seq_id]
        if req.prompt_len + req.decode_len > self.max_model_len:
            raise ValueError(f"request {seq_id}: prompt {req.prompt_len} + decode {req.decode_len} exceeds "
                             f"max_model_len {self.max_model_len} (the engine would reject it)")
        params = SamplingParams(max_tokens=req.decode_len, temperature=0.0, ignore_eos=True)
        self.sched.add(Seq(seq_id, str(seq_id), [FAKE_TOKEN] * req.prompt_len, params, req.arrival_s))

    def iterate(self) -> SchedulerOutput:
        """Schedule one batch, advance time by its predicted cost, append its sampled tokens."""
        batch = self.sched.schedule()
        if batch.is_empty:
            return batch
        for chunk in batch.chunks:
            if self.scheduled[chunk.seq_id] is None:
                self.scheduled[chunk.seq_id] = self.now
        cost = self.cost_model.predict(batch_shape(batch))
        self.now += cost
        self.busy += cost
        self.sched.complete(batch)
        for chunk in batch.chunks:
            if chunk.samples:
                self._sample(self.sched.seqs[chunk.seq_id])
        return batch

    def _sample(self, seq: Seq) -> None:
        seq.append_sampled(FAKE_TOKEN)
        self.tokens[seq.seq_id].append(self.now)
        if len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_known_tokens >= self.max_model_len:
            self.sched.finish(seq)

    def result(self, iterations: int, batches: list[SchedulerOutput]) -> SimResult:
        traces = [RequestTrace(r.arrival_s, self.scheduled[i], tuple(self.tokens[i]), r.prompt_len)
                  for i, r in enumerate(self.trace)]
        return SimResult(traces, self.now, iterations, self.busy, self.sched.num_preemptions, batches)


def simulate(trace: Sequence[TraceRequest], config: SimConfig, cost_model: CostModel,
             record_batches: bool = False, scheduler: SchedulerFactory = make_scheduler) -> SimResult:
    """Replay `trace` (request i gets sequence id i) and return every request's timeline.

    `scheduler`: builds the scheduler from the resolved config and block manager (default: the
    engine's `make_scheduler`; an experiment passes a variant of a policy to weigh it first)."""
    rep = _Replica(trace, config, cost_model, scheduler)
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
    nxt, iterations, batches = 0, 0, []
    while nxt < len(order) or rep.sched.has_unfinished:
        while nxt < len(order) and trace[order[nxt]].arrival_s <= rep.now:
            rep.add(order[nxt])
            nxt += 1
        batch = rep.iterate()
        if not batch.is_empty:
            iterations += 1
            if record_batches:
                batches.append(batch)
        elif nxt < len(order):
            rep.now = max(rep.now, trace[order[nxt]].arrival_s)  # idle until the next arrival
        else:
            raise RuntimeError(f"simulation stuck at t={rep.now:.3f}s: {rep.sched.num_waiting} waiting, "
                               f"{rep.sched.num_running} running, nothing schedulable (KV cache too small?)")
    return rep.result(iterations, batches)


def predict_capacity(
    trace_spec: TraceSpec, policy: str, budget: int | None, cost_model: CostModel, tbt_slo_s: float, *,
    num_requests: int = 200, seed: int = 0, scale: float = 1.0, max_len: int | None = None,
    config: SimConfig | None = None, low: float = 0.05, high: float = 1.0, tolerance: float = 0.05,
    max_probes: int = 12,
) -> CapacityResult:
    """Capacity (QPS) of one replica under the SLO, searched with `search_capacity` on simulated runs.

    Traces are `make_trace(trace_spec, num_requests, qps, seed, scale, max_len)`; `max_len` defaults
    to the config's `max_model_len`."""
    cfg = dataclasses.replace(config or SimConfig(), policy=policy, token_budget=budget)
    cap = max_len or cfg.max_model_len

    def evaluate(qps: float) -> RunMetrics:
        trace = make_trace(trace_spec, num_requests, qps, seed=seed, scale=scale, max_len=cap)
        return simulate(trace, cfg, cost_model).metrics(qps)

    return search_capacity(evaluate, tbt_slo_s, low, high, tolerance=tolerance, max_probes=max_probes)


def load_cost_model(profile_path: str | Path) -> CostModel:
    """The fitted cost model of a `chariot tune` profile."""
    return CostModel.from_dict(load_profile(profile_path)["cost_model"])


def profile_attention_cost(profile_path: str | Path) -> float:
    """The profiled model's attention cost per (query, key) pair (0 if the profile lacks its shape)."""
    from chariot.worker.config import ModelConfig

    shape = load_profile(profile_path).get("model", {}).get("shape")
    if not shape or any(v is None for v in shape.values()):
        return 0.0
    return ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **shape}).attention_cost


def main(argv: list[str] | None = None) -> int:
    """`python -m chariot.bench.simulator --profile P --trace chat --tbt-slo-ms 200 --policy sarathi:256 vllm`"""
    p = argparse.ArgumentParser(prog="python -m chariot.bench.simulator", description=__doc__.splitlines()[0])
    p.add_argument("--profile", required=True, help="profile JSON written by `chariot tune`")
    p.add_argument("--trace", choices=sorted(TRACES), default="chat")
    p.add_argument("--scale", type=float, default=0.25)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tbt-slo-ms", type=float, default=200.0)
    p.add_argument("--policy", nargs="+", default=["sarathi", "vllm"],
                   help="policies, optionally with a budget: sarathi:256 (default budget otherwise)")
    p.add_argument("--max-len", type=int, default=None,
                   help="max_model_len and trace length cap (default: chat 2048, arxiv 4096)")
    p.add_argument("--kv-cache-tokens", type=int, default=64 * 1024)
    p.add_argument("--max-batch-size", type=int, default=128)
    p.add_argument("--prefill-order", choices=PREFILL_ORDER.choices, default=PREFILL_ORDER.default,
                   help="the engine's --prefill-order")
    args = p.parse_args(argv)
    model = load_cost_model(args.profile)
    cfg = SimConfig(max_model_len=args.max_len or BENCH_MAX_LEN[args.trace], kv_cache_tokens=args.kv_cache_tokens,
                    max_batch_size=args.max_batch_size, attention_cost=profile_attention_cost(args.profile),
                    prefill_order=args.prefill_order)
    print(f"{args.trace} trace ×{args.scale}, {args.requests} requests, P99 TBT ≤ {args.tbt_slo_ms:g} ms\n")
    print("| policy | budget | predicted capacity (QPS) | search |")
    print("|---|---:|---:|---|")
    for item in args.policy:
        policy, _, budget = item.partition(":")
        started = time.perf_counter()
        res = predict_capacity(TRACES[args.trace], policy, int(budget) if budget else None, model,
                               args.tbt_slo_ms / 1e3, num_requests=args.requests, seed=args.seed, scale=args.scale,
                               config=cfg)
        took = time.perf_counter() - started
        print(f"| {policy} | {budget or 'default'} | {res.capacity_qps:.3f} | {len(res.probes)} probes, {took:.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
