"""Engine iteration benchmark: decode, prefill and Sarathi hybrid iterations on this machine.

Prints a markdown table of median iteration times and the engine's own overhead (scheduling +
input preparation) as a share of each iteration, and writes the raw numbers as JSON.

    python -m chariot.bench.engine_bench --model models/100m
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm

from chariot.worker.config import EngineConfig
from chariot.worker.engine import Engine
from chariot.worker.outputs import IterationTimes
from chariot.worker.sampling_params import SamplingParams

NEVER_STOP = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class Row:
    case: str
    tokens: int
    median_ms: float
    overhead_ms: float
    overhead_pct: float


def make_engine(model: str, policy: str, budget: int | None, max_len: int) -> Engine:
    cfg = EngineConfig(model=model, policy=policy, token_budget=budget, max_model_len=max_len,
                       kv_cache_tokens=96 * 1024, max_batch_size=256)
    return Engine(cfg, progress=False)


def summarize(case: str, tokens: int, times: list[IterationTimes]) -> Row:
    total = statistics.median(t.total for t in times)
    overhead = statistics.median(t.overhead for t in times)
    return Row(case, tokens, total * 1e3, overhead * 1e3, 100 * overhead / total)


def run_steps(engine: Engine, n: int, keep: Callable[[Engine], bool]) -> list[IterationTimes]:
    times = []
    for _ in range(n):
        engine.step()
        if keep(engine):
            times.append(engine.last_times)
    return times


def bench_decode(model: str, batch: int, context: int, iters: int) -> Row:
    engine = make_engine(model, "sarathi", 4096, 4096)
    for _ in range(batch):
        engine.add_request([7] * context, NEVER_STOP)
    while engine.scheduler.num_waiting or any(not s.is_decode for s in engine.scheduler.running):
        engine.step()
    times = run_steps(engine, iters, lambda e: True)
    return summarize(f"decode batch {batch} (ctx {context})", batch, times)


def bench_prefill(model: str, length: int, iters: int) -> Row:
    engine = make_engine(model, "vllm", 4096, 4096)
    times = []
    for _ in range(iters):
        engine.add_request([7] * length, SamplingParams(max_tokens=1, ignore_eos=True))
        engine.step()
        times.append(engine.last_times)
    return summarize(f"prefill {length}", length, times)


def bench_hybrid(model: str, decodes: int, budget: int, context: int, iters: int) -> Row:
    engine = make_engine(model, "sarathi", budget, 8192)
    for _ in range(decodes):
        engine.add_request([7] * context, NEVER_STOP)
    while engine.scheduler.num_waiting or any(not s.is_decode for s in engine.scheduler.running):
        engine.step()
    prompt = 2048
    engine.add_request([9] * prompt, NEVER_STOP)  # chunked over several iterations
    hybrid = run_steps(engine, iters, lambda e: e.scheduler.running[-1].num_computed_tokens < prompt)
    label = f"sarathi hybrid: {decodes} decodes + {budget - decodes}-token chunks of a {prompt}-token prompt"
    return summarize(label, budget, hybrid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--context", type=int, default=512, help="context length of decoding requests")
    parser.add_argument("--out", default="bench/results/engine.json")
    args = parser.parse_args(argv)

    jobs: list[tuple[str, Callable[[], Row]]] = []
    for b in (1, 8, 32):
        jobs.append((f"decode {b}", partial(bench_decode, args.model, b, args.context, args.iters)))
    for n in (128, 512, 1024):
        jobs.append((f"prefill {n}", partial(bench_prefill, args.model, n, args.iters)))
    for budget in (256, 512):
        jobs.append((f"hybrid {budget}", partial(bench_hybrid, args.model, 32, budget, args.context, args.iters)))

    rows = []
    for name, job in tqdm(jobs, desc="engine bench", file=sys.stderr):
        tqdm.write(f"running {name}", file=sys.stderr)
        rows.append(job())

    print(f"threads={torch.get_num_threads()} model={args.model}\n")
    print("| iteration | tokens | median ms | engine overhead ms | overhead % |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.case} | {r.tokens} | {r.median_ms:.1f} | {r.overhead_ms:.2f} | {r.overhead_pct:.1f}% |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
