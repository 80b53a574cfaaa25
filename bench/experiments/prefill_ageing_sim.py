"""What serving the shortest prompts first could buy under the peer SLO, and what the longest pay.

Why: every failing probe of the CPU peer runs fails on median TTFT, with both systems prefilling on
the same GEMM. `--prefill-order shortest` ages a waiting prompt by one token budget per iteration
(`Scheduler.prefill_rank`), which bounds how long any prompt is passed over and measured 13-14 %
off the median TTFT. How much more a weaker ageing would take off, and how much it would add to the
slowest requests, is a question about the queue, not the kernels: this answers it in the simulator
(`bench/simulator.py`: the engine's own scheduler and block manager), with iteration times from a
cost model fitted to a real server's iteration log (`--iteration-log`, the step time `ms` against a
constant, prompt tokens and decodes; the log has no chunk positions, so prompt attention is folded
into the prompt-token coefficient).

Variants: `fcfs` (arrival order, the default), and `shortest` aged by the budget times 1 (the
engine's rule), 1/4, 1/16 and 0 (no ageing: shortest remaining first, the longest prompts waiting
while shorter ones keep arriving). Load: the peer benchmark's, the chat trace x0.25 with Poisson
arrivals, `--requests` per run over `--seeds` seeds at each QPS; per variant and QPS the medians over
seeds of: TTFT p50 / p99 / max, the TTFT p50 of the longest quarter of prompts, TBT p99. Capacity:
the bracket between the highest grid load whose medians meet the peer SLO (median TTFT <= 2 s, P99
TBT <= 1 s), every lower load meeting it too, and the next grid load.

    .venv/bin/python -m chariot.bench.experiments.prefill_ageing_sim ITERATION_LOG[.gz] --out DIR [--qps 0.6,0.8,...]

Writes DIR/prefill_ageing_sim.json (the fitted model, every row, each variant's capacity) and
prefill_ageing_sim.png (median and P99 TTFT against load per variant).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from chariot.bench.capacity import percentile
from chariot.bench.server_iterations import chariot_records, fit_step_cost, read_log_lines
from chariot.bench.simulator import SimConfig, simulate
from chariot.bench.traces import TRACES, make_trace
from chariot.worker.block_manager import BlockManager
from chariot.worker.budget import CostModel
from chariot.worker.scheduler import SchedulerConfig, make_scheduler
from chariot.worker.scheduler.policies import SarathiScheduler
from chariot.worker.sequence import Sequence as Seq

BUDGET = 512
MAX_LEN = 2048  # the peer benchmark's max_model_len
TRACE_SCALE = 0.25  # the peer benchmark's chat trace x0.25
TTFT_SLO_S = 2.0
TBT_SLO_S = 1.0
AGEING = (1.0, 0.25, 1 / 16, 0.0)
"""Ageing of `shortest`, in token budgets per iteration waited (1.0 is the engine's rule)."""
DEFAULT_QPS = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6)


class AgedShortest(SarathiScheduler):
    """Sarathi with `shortest` prefill order, its ageing `ageing` token budgets per iteration waited
    instead of the engine's one."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, ageing: float) -> None:
        super().__init__(config, block_manager)
        self.ageing = ageing

    def prefill_rank(self, seq: Seq) -> tuple[int, int, int]:
        base_rank = super().prefill_rank(seq)
        credit = round(self.iterations_waited(seq) * self.config.token_budget * self.ageing)
        return seq.num_remaining - credit, base_rank[1], base_rank[2]


def fit_cost_model(records: Iterable[Mapping[str, Any]]) -> CostModel:
    """The simulator's cost model from a log's step times (`ms`: the whole step, host work included):
    a constant, prompt tokens and decodes (`fit_step_cost`), its R² kept."""
    fit = fit_step_cost(records, time_key="ms")
    # features: constant, prefill_tokens, decode_tokens, prefill_attention, decode_context
    return CostModel((fit.constant_ms / 1e3, fit.prompt_token_ms / 1e3, fit.decode_ms / 1e3, 0.0, 0.0), fit.r2)


def variants() -> list[tuple[str, float | None]]:
    """(name, ageing): ageing None is arrival order."""
    return [("fcfs", None), *((f"shortest, ageing {a:g}", a) for a in AGEING)]


def run_load(cost_model: CostModel, ageing: float | None, qps: float, seeds: Sequence[int],
             requests: int) -> dict[str, float]:
    """One variant at one load: per seed a simulated run; the medians over seeds (ms)."""
    config = SimConfig(token_budget=BUDGET, max_model_len=MAX_LEN,
                       prefill_order="fcfs" if ageing is None else "shortest")
    scheduler = make_scheduler if ageing is None else partial(AgedShortest, ageing=ageing)
    per_seed: list[dict[str, float]] = []
    for seed in seeds:
        trace = make_trace(TRACES["chat"], requests, qps, seed=seed, scale=TRACE_SCALE, max_len=MAX_LEN)
        result = simulate(trace, config, cost_model, scheduler=scheduler)
        per_seed.append(latencies(trace_lengths=[r.prompt_len for r in trace],
                                  ttfts=[t.ttft for t in result.traces],
                                  tbts=[g for t in result.traces for g in t.tbt]))
    return {k: statistics.median(s[k] for s in per_seed) for k in per_seed[0]}


def latencies(trace_lengths: Sequence[int], ttfts: Sequence[float | None], tbts: Sequence[float]) -> dict[str, float]:
    """TTFT p50 / p99 / max, the longest quarter's TTFT p50, TBT p99, in ms."""
    done = [(n, t) for n, t in zip(trace_lengths, ttfts, strict=True) if t is not None]
    values = [t for _, t in done]
    longest = sorted(done, key=lambda nt: -nt[0])[: max(1, len(done) // 4)]
    return {"ttft_p50": 1e3 * percentile(values, 50), "ttft_p99": 1e3 * percentile(values, 99),
            "ttft_max": 1e3 * max(values), "long_ttft_p50": 1e3 * statistics.median(t for _, t in longest),
            "tbt_p99": 1e3 * percentile(list(tbts), 99)}


def capacity(rows: Sequence[Mapping[str, Any]]) -> list[float | None]:
    """[highest passing load, next load] of one variant's rows in load order (None: no such load)."""
    low: float | None = None
    for row in sorted(rows, key=lambda r: r["qps"]):
        if row["ttft_p50"] > TTFT_SLO_S * 1e3 or row["tbt_p99"] > TBT_SLO_S * 1e3:
            return [low, row["qps"]]
        low = row["qps"]
    return [low, None]


def plot(rows: Sequence[Mapping[str, Any]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    for name, _ in variants():
        mine = sorted((r for r in rows if r["variant"] == name), key=lambda r: r["qps"])
        qps = [r["qps"] for r in mine]
        left.plot(qps, [r["ttft_p50"] / 1e3 for r in mine], marker="o", label=name)
        right.plot(qps, [r["ttft_p99"] / 1e3 for r in mine], marker="o", label=name)
    left.axhline(TTFT_SLO_S, color="grey", linestyle="--", linewidth=1)
    left.set_title("median TTFT (the peer SLO: 2 s)")
    right.set_title("P99 TTFT: what the longest prompts pay")
    for ax in (left, right):
        ax.set_xlabel("offered load (QPS)")
        ax.set_ylabel("seconds")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle("prefill order and ageing, simulated with a cost model fitted to a server's iteration log")
    fig.tight_layout()
    path = out / "prefill_ageing_sim.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="a Chariot iteration log (--iteration-log), .jsonl or .jsonl.gz")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--qps", default=",".join(f"{q:g}" for q in DEFAULT_QPS))
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args(argv)
    cost_model = fit_cost_model(chariot_records(read_log_lines(Path(args.log))))
    qps_grid = [float(q) for q in args.qps.split(",")]
    rows = []
    for name, ageing in variants():
        for qps in qps_grid:
            row = {"variant": name, "ageing": ageing, "qps": qps,
                   **run_load(cost_model, ageing, qps, range(args.seeds), args.requests)}
            rows.append(row)
            print(f"{name:22} {qps:5.2f} QPS  TTFT p50 {row['ttft_p50']:7.0f}  p99 {row['ttft_p99']:7.0f}  "
                  f"max {row['ttft_max']:7.0f}  longest quarter p50 {row['long_ttft_p50']:7.0f}  "
                  f"TBT p99 {row['tbt_p99']:5.0f} ms", flush=True)
    caps = {name: capacity([r for r in rows if r["variant"] == name]) for name, _ in variants()}
    for name, bracket in caps.items():
        print(f"capacity, {name}: {bracket}")
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"source": Path(args.log).name, "cost_model": cost_model.to_dict(),
           "budget": BUDGET, "trace": f"chat x{TRACE_SCALE:g}", "seeds": args.seeds, "requests": args.requests,
           "slo": {"ttft_p50_s": TTFT_SLO_S, "tbt_p99_s": TBT_SLO_S}, "capacity": caps, "rows": rows}
    (args.out / "prefill_ageing_sim.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(plot(rows, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
