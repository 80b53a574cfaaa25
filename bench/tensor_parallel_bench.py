"""Tensor-parallel bench: engine iteration times at T = 1, 2, 4 … and the share spent in collectives.

On the CPU the T ranks share one machine's cores, so tensor parallelism cannot make anything faster
here; what can be measured is its overhead: the share of an iteration each rank spends in the
all-reduces (and the logits all-gather) over gloo, and how iteration times change when the same
cores are split between ranks (each rank pinned to its share of the cores with
`CHARIOT_STAGE_CPUS`). With `--device cuda` the same runs measure what tensor parallelism is for —
decode and prefill iteration times of TP 1/2/4 on a GPU machine (e.g. `--model` a `make-model
--preset llama3-8b` directory, Llama-3-8B's shape) over NCCL; it needs as many GPUs as the largest T.

Two phases per T, each through `LLM(tensor_parallel_size=T).generate` (greedy, `ignore_eos`):
prefill (prompts of `--prompt-len` tokens, one output token each: chunked prefill iterations) and
decode (`--decode-batch` short prompts, `--decode-tokens` outputs each: decode iterations), each
run once untimed first (the first batch of a shape compiles the Triton kernels on CUDA). An
iteration's time is the phase's wall time over its engine iterations; the collective share is stage
0 leader's collective seconds (`EngineStats.collective_s`) over the phase's wall time.

    python -m chariot.bench.tensor_parallel_bench --model models/100m --out docs/img/tensor_parallel_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from chariot.bench.linear_bench import cpu_record, save_record
from chariot.worker import LLM, SamplingParams
from chariot.worker.runtime import STAGE_CPUS_ENV


@dataclass(frozen=True)
class Phase:
    """One phase of one T: engine iterations, wall time, collective seconds of stage 0's leader."""

    name: str
    iterations: int
    wall_s: float
    collective_s: float

    @property
    def iteration_ms(self) -> float:
        return 1e3 * self.wall_s / max(self.iterations, 1)

    @property
    def collective_share(self) -> float:
        return self.collective_s / self.wall_s if self.wall_s > 0 else 0.0


def core_sets(tensor: int, cores: int) -> str:
    """`CHARIOT_STAGE_CPUS` giving rank k of T its contiguous share of `cores` (at least one core)."""
    per = max(1, cores // tensor)
    return ",".join("+".join(str((k * per + c) % cores) for c in range(per)) for k in range(tensor))


def run_phase(llm: LLM, name: str, prompts: list[list[int]], max_tokens: int) -> Phase:
    engine = llm.engine
    before_iters, before_coll = engine.iterations, engine.stats().collective_s
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    return Phase(name, engine.iterations - before_iters, wall, engine.stats().collective_s - before_coll)


def run_tensor(args: argparse.Namespace, tensor: int) -> list[Phase]:
    gen = torch.Generator().manual_seed(args.seed)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    long_prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prefills)]
    short_prompts = [torch.randint(3, vocab, (16,), generator=gen).tolist() for _ in range(args.decode_batch)]
    if args.device == "cpu" and tensor > 1:
        os.environ[STAGE_CPUS_ENV] = core_sets(tensor, os.cpu_count() or 1)
    else:
        os.environ.pop(STAGE_CPUS_ENV, None)
    print(f"T={tensor}: loading ({args.model}, {args.device}) ...", flush=True)
    with LLM(args.model, tensor_parallel_size=tensor, dtype=args.dtype, device=args.device,
             token_budget=args.token_budget, max_model_len=args.prompt_len + args.decode_tokens + 16,
             kv_cache_tokens=args.kv_cache_tokens, prefix_caching=False, progress=False) as llm:
        # Each phase once untimed: on CUDA the first batch of a shape compiles Triton kernels.
        run_phase(llm, "warm-up prefill", long_prompts, 1)
        run_phase(llm, "warm-up decode", short_prompts, args.decode_tokens)
        phases = [run_phase(llm, "prefill", long_prompts, 1),
                  run_phase(llm, "decode", short_prompts, args.decode_tokens)]
    for p in phases:
        print(f"T={tensor} {p.name:8s} {p.iterations:4d} iterations  {p.iteration_ms:8.2f} ms/iteration  "
              f"collectives {100 * p.collective_share:5.1f} % of the wall time", flush=True)
    return phases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="models/100m")
    parser.add_argument("--tensor", default="1,2", help="tensor-parallel sizes to run, comma separated")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--token-budget", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--prefills", type=int, default=8)
    parser.add_argument("--decode-batch", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-tokens", type=int, default=65536)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/tensor_parallel.json")
    args = parser.parse_args(argv)
    sizes = [int(t) for t in args.tensor.split(",")]
    if args.device.startswith("cuda") and torch.cuda.device_count() < max(sizes):
        parser.error(f"--tensor {args.tensor} needs {max(sizes)} GPUs; this machine has {torch.cuda.device_count()}")
    rows = []
    for tensor in sizes:
        for phase in run_tensor(args, tensor):
            rows.append({"tensor": tensor, **asdict(phase), "iteration_ms": phase.iteration_ms,
                         "collective_share": phase.collective_share})
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None
    record = {"machine": cpu_record(), "gpu": device, "args": vars(args), "rows": rows}
    save_record(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
