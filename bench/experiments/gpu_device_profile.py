"""Iteration times and a torch.profiler table of one model on CUDA (the H100 run of 2026-11-24).

    python -m chariot.bench.experiments.gpu_device_profile MODEL_DIR   # NO_CPROFILE=1 skips the Python profile

Three untimed-then-timed rounds of decode (16 prompts of 16 tokens, 64 greedy tokens) and prefill
(8 prompts of 512 tokens, one token), then one profiled decode round of 16 iterations.
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from chariot.worker import LLM, SamplingParams


def main(model: str) -> None:
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    short = [torch.randint(3, vocab, (16,), generator=gen).tolist() for _ in range(16)]
    long = [torch.randint(3, vocab, (512,), generator=gen).tolist() for _ in range(8)]
    with LLM(model, dtype="bfloat16", device="cuda", token_budget=512, max_model_len=1024,
             kv_cache_tokens=65536, prefix_caching=False, progress=False) as llm:
        engine = llm.engine

        def phase(name: str, prompts: list[list[int]], tokens: int) -> None:
            first = engine.iterations
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
            wall, iterations = time.perf_counter() - start, engine.iterations - first
            print(f"{name}: {iterations} iterations, {1e3 * wall / iterations:.2f} ms/iteration", flush=True)

        for round_ in range(3):
            phase(f"decode run {round_}", short, 64)
            phase(f"prefill run {round_}", long, 1)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            phase("decode profiled", short, 16)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
        if os.environ.get("NO_CPROFILE"):
            return
        python = cProfile.Profile()
        python.enable()
        phase("decode cprofiled", short, 16)
        python.disable()
        pstats.Stats(python).sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main(sys.argv[1])
