"""Pipeline bench: bubble fraction and throughput of a P-stage local pipeline per policy.

Runs one chat-like trace (all requests at t=0, greedy, `ignore_eos`) through `LLM(pipeline_stages=P)`
for each policy, pinning stage r to core r, and reports wall time, token throughput and the
pipeline-bubble fraction (idle share of stage time while work was in flight), plus a PNG plot.

    python -m chariot.bench.pipeline_bench --model models/100m
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from chariot.bench.traces import TRACES, make_trace
from chariot.worker import LLM, SamplingParams
from chariot.worker.runtime import STAGE_CPUS_ENV


@dataclass(frozen=True)
class Result:
    policy: str
    token_budget: int | None
    requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float
    bubble_fraction: float
    stage_busy_s: list[float]
    stage_idle_s: list[float]
    iterations: int


def run_policy(args: argparse.Namespace, policy: str, budget: int | None) -> Result:
    trace = make_trace(TRACES[args.trace], args.requests, None, seed=args.seed, scale=args.scale,
                       max_len=args.max_model_len - 1)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, 8000, (r.prompt_len,), generator=gen).tolist() for r in trace]
    params = [SamplingParams(max_tokens=r.decode_len, temperature=0.0, ignore_eos=True) for r in trace]
    with LLM(args.model, policy=policy, token_budget=budget, pipeline_stages=args.stages,
             max_model_len=args.max_model_len, kv_cache_tokens=args.kv_cache_tokens, progress=False) as llm:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=True)
        wall = time.perf_counter() - t0
        executor = llm.engine.executor
        times = executor.stage_times()  # type: ignore[attr-defined]
        stats = llm.engine.stats()
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(o.token_ids) for o in outs)
    return Result(policy, budget, len(prompts), prompt_tokens, output_tokens, wall,
                  (prompt_tokens + output_tokens) / wall, stats.bubble_fraction,
                  [b for b, _ in times], [i for _, i in times], stats.iterations)


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{r.policy}" + (f"\n(budget {r.token_budget})" if r.token_budget else "") for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    a.bar(names, [100 * r.bubble_fraction for r in results], color="#c0504d")
    a.set_ylabel("pipeline bubbles (% of stage time)")
    b.bar(names, [r.tokens_per_s for r in results], color="#4f81bd")
    b.set_ylabel("throughput (prompt + output tokens/s)")
    fig.suptitle("2-stage pipeline, one CPU core per stage, chat trace")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--policies", default="sarathi,vllm,orca")
    p.add_argument("--token-budget", type=int, default=256, help="sarathi's budget")
    p.add_argument("--trace", choices=sorted(TRACES), default="chat")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--scale", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-tokens", type=int, default=64 * 1024)
    p.add_argument("--cpus", default=None, help=f"core set per stage (default 0,1,...; sets {STAGE_CPUS_ENV})")
    p.add_argument("--out", default="bench/results/pipeline")
    args = p.parse_args(argv)
    os.environ[STAGE_CPUS_ENV] = args.cpus or ",".join(str(r % (os.cpu_count() or 1)) for r in range(args.stages))

    results = []
    for policy in args.policies.split(","):
        budget = args.token_budget if policy == "sarathi" else None
        print(f"== {policy}", file=sys.stderr)
        results.append(run_policy(args, policy, budget))

    print(f"\n{args.stages} stages, trace={args.trace} x{args.scale}, {args.requests} requests, model={args.model}\n")
    print("| policy | budget | wall s | tokens/s | bubble % | iterations |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r.policy} | {r.token_budget or '-'} | {r.wall_s:.1f} | {r.tokens_per_s:.0f} | "
              f"{100 * r.bubble_fraction:.1f}% | {r.iterations} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    plot(results, out / "pipeline_bubbles.png")
    print(f"\nwrote {out / 'pipeline.json'} and {out / 'pipeline_bubbles.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
