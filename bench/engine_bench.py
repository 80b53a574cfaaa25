"""Engine iteration benchmark: decode, prefill and Sarathi hybrid iterations on this machine.

Prints a markdown table of median iteration times and the engine's own overhead (scheduling +
input preparation) as a share of each iteration, and writes the raw numbers as JSON. With
`--peak-bw-gbs`, decode rows also show the memory-bandwidth bound: a decode iteration must read
every weight it uses (all but the input embedding, unless tied to the LM head) and the batch's
cached K/V once, so bytes / peak bandwidth is the fastest it can be (the GPU roofline for decode).

    python -m chariot.bench.engine_bench --model models/100m
    chariot make-model /models/llama3-8b --preset llama3-8b     # random Llama-3-8B-shaped weights
    python -m chariot.bench.engine_bench --model /models/llama3-8b --device cuda --peak-bw-gbs 3350
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

from chariot.contracts.outputs import IterationTimes
from chariot.contracts.sampling_params import SamplingParams
from chariot.worker.config import EngineConfig
from chariot.worker.engine import Engine
from chariot.worker.engine_output import StepResult
from chariot.worker.model.cpu_linear import CpuLinear

NEVER_STOP = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class Row:
    case: str
    tokens: int
    median_ms: float
    overhead_ms: float
    overhead_pct: float
    bytes_read: int | None = None  # decode rows: weights + cached K/V an iteration must read

    def bound_ms(self, peak_bw_gbs: float) -> float | None:
        return None if self.bytes_read is None else self.bytes_read / (peak_bw_gbs * 1e9) * 1e3


@dataclass(frozen=True)
class Target:
    """Where the engines run."""

    model: str
    device: str = "cpu"
    dtype: str = "auto"


def make_engine(target: Target, policy: str, budget: int | None, max_len: int) -> Engine:
    cfg = EngineConfig(model=target.model, policy=policy, token_budget=budget, max_model_len=max_len,
                       kv_cache_tokens=96 * 1024, max_batch_size=256, device=target.device, dtype=target.dtype,
                       prefix_caching=False)  # iterations repeat prompts; they measure compute
    return Engine(cfg, progress=False)


def summarize(case: str, tokens: int, times: list[IterationTimes], bytes_read: int | None = None) -> Row:
    if not times:
        raise RuntimeError(f"{case}: no step of this kind was timed")
    total = statistics.median(t.total for t in times)
    overhead = statistics.median(t.overhead for t in times)
    return Row(case, tokens, total * 1e3, overhead * 1e3, 100 * overhead / total, bytes_read)


def decode_bytes(engine: Engine, batch: int, context: int) -> int:
    """Bytes one decode iteration of `batch` sequences at `context` tokens must read from memory."""
    runner = engine.executor.runner  # type: ignore[attr-defined]  # single-process engines only
    stage = runner.stage
    embed = stage.embed_tokens.weight if stage.embed_tokens is not None else None
    lm_head = getattr(stage.lm_head, "weight", None)  # None when absent or packed (counted below)
    weights = sum(p.numel() * p.element_size() for p in stage.parameters()
                  if p is not embed or p is lm_head)  # the embedding is only gathered, unless tied
    weights += sum(m.weight_nbytes for m in stage.modules() if isinstance(m, CpuLinear))
    kv_per_token = sum(k[0, 0].numel() * k.element_size() + v[0, 0].numel() * v.element_size()
                       for k, v in runner.kv_caches)
    return weights + batch * context * kv_per_token


def run_steps(engine: Engine, n: int, keep: Callable[[StepResult], bool],
              max_steps: int | None = None) -> list[IterationTimes]:
    """Times of the next `n` steps that `keep` accepts (it sees each step's result), stepping at most
    `max_steps` times (default `n`)."""
    times: list[IterationTimes] = []
    for _ in range(n if max_steps is None else max_steps):
        result = engine.step()
        if keep(result):
            times.append(result.times)
            if len(times) == n:
                break
    return times


def prefill_all(engine: Engine) -> None:
    """Step until every queued prompt is fully prefilled (only decodes are left)."""
    load = engine.stats()
    while load.num_waiting or load.queued_prefill_tokens:
        load = engine.step().stats


def bench_decode(target: Target, batch: int, context: int, iters: int) -> Row:
    engine = make_engine(target, "sarathi", 4096, max(4096, context + 64))
    for _ in range(batch):
        engine.add_request([7] * context, NEVER_STOP)
    prefill_all(engine)
    times = run_steps(engine, iters, lambda r: True)
    return summarize(f"decode batch {batch} (ctx {context})", batch, times, decode_bytes(engine, batch, context))


def bench_prefill(target: Target, length: int, iters: int) -> Row:
    engine = make_engine(target, "vllm", 4096, 4096)
    times = []
    for _ in range(iters):
        engine.add_request([7] * length, SamplingParams(max_tokens=1, ignore_eos=True))
        times.append(engine.step().times)
    return summarize(f"prefill {length}", length, times)


def hybrid_tokens(result: StepResult, decodes: int) -> int:
    """The tokens of the hybrid iteration the step completed (`decodes` decodes beside a prompt chunk),
    or 0 when it completed no such iteration. Read from the batch the step completed, not from the
    load report: with asynchronous scheduling (CUDA) the report is taken one batch ahead."""
    batch = result.batch
    if batch is None or batch.num_decodes != decodes or batch.num_prefill_tokens == 0:
        return 0
    return batch.num_tokens


def bench_hybrid(target: Target, decodes: int, budget: int, context: int, iters: int, prompt: int = 2048,
                 max_len: int = 8192) -> Row:
    engine = make_engine(target, "sarathi", budget, max_len)
    for _ in range(decodes):
        engine.add_request([7] * context, NEVER_STOP)
    prefill_all(engine)
    # More prompt tokens than `iters` budgets, each prompt done after its first token, so that the
    # decodes stay `decodes`; the chunks shrink as a prompt's cached part grows (attention-aware).
    for _ in range(-(-(iters + 2) * budget // prompt) + 1):
        engine.add_request([9] * prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    sizes: list[int] = []

    def keep(result: StepResult) -> bool:
        tokens = hybrid_tokens(result, decodes)
        if tokens:
            sizes.append(tokens)
        return tokens > 0

    hybrid = run_steps(engine, iters, keep, max_steps=4 * iters + 8)
    label = (f"sarathi hybrid, budget {budget}: {decodes} decodes + prompt chunks"
             f" ({min(sizes, default=0) - decodes}-{max(sizes, default=0) - decodes} tokens) of {prompt}-token prompts")
    return summarize(label, round(statistics.median(sizes)) if sizes else budget, hybrid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--context", type=int, default=512, help="context length of decoding requests")
    parser.add_argument("--decode-batches", default="1,8,32", help="comma-separated decode batch sizes")
    parser.add_argument("--peak-bw-gbs", type=float, default=None,
                        help="memory bandwidth peak (GB/s; H100 SXM 3350, H200 4800) for the decode bound")
    parser.add_argument("--out", default="bench/results/engine.json")
    args = parser.parse_args(argv)
    target = Target(args.model, args.device, args.dtype)

    jobs: list[tuple[str, Callable[[], Row]]] = []
    for b in (int(x) for x in args.decode_batches.split(",")):
        jobs.append((f"decode {b}", partial(bench_decode, target, b, args.context, args.iters)))
    for n in (128, 512, 1024):
        jobs.append((f"prefill {n}", partial(bench_prefill, target, n, args.iters)))
    for budget in (256, 512):
        jobs.append((f"hybrid {budget}", partial(bench_hybrid, target, 32, budget, args.context, args.iters)))

    rows = []
    for name, job in tqdm(jobs, desc="engine bench", file=sys.stderr):
        tqdm.write(f"running {name}", file=sys.stderr)
        rows.append(job())
        tqdm.write(f"{rows[-1].case}: {rows[-1].median_ms:.2f} ms", file=sys.stderr)  # kept should a later case fail

    print(f"device={args.device} threads={torch.get_num_threads()} model={args.model}\n")
    print(markdown_table(rows, args.peak_bw_gbs))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


def markdown_table(rows: list[Row], peak_bw_gbs: float | None) -> str:
    head = "| iteration | tokens | median ms | engine overhead ms | overhead % |"
    rule = "|---|---:|---:|---:|---:|"
    if peak_bw_gbs:
        head, rule = head + " bandwidth bound ms | % of bound |", rule + "---:|---:|"
    lines = [head, rule]
    for r in rows:
        line = f"| {r.case} | {r.tokens} | {r.median_ms:.1f} | {r.overhead_ms:.2f} | {r.overhead_pct:.1f}% |"
        if peak_bw_gbs:
            bound = r.bound_ms(peak_bw_gbs)
            line += " – | – |" if bound is None else f" {bound:.2f} | {100 * bound / r.median_ms:.0f}% |"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
