"""A/B of the one-pass CPU layer kernels (`kernels/csrc/layer_ops.cpp`: SiLU·mul, RMSNorm, write_kv)
against the PyTorch code they replace, toggled with `CHARIOT_CPU_LAYER_OPS` inside one process, on
whole `LLM.generate` calls: 9 interleaved rounds (order alternating, the first dropped). Also
compares both paths' greedy tokens.

    .venv/bin/python -m chariot.bench.experiments.layer_ops_ab [DTYPE] [OUT_DIR]

Writes OUT_DIR/layer_ops_ab.json (`layer_ops_ab_<dtype>.json` for another DTYPE than float32; OUT_DIR
defaults to the current directory).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from chariot.bench.linear_bench import cpu_record
from chariot.kernels import cpu_layer_ops
from chariot.worker import LLM, SamplingParams

CASES = ("prefill 1536 tokens", "32 x 16-token prompts, 64 tokens each")
PATHS = {"torch": "0", "kernels": "1"}


def use(name: str) -> None:
    os.environ[cpu_layer_ops.ENV] = PATHS[name]


def main(dtype: str, out_dir: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    llm = LLM("models/100m", dtype=dtype, token_budget=512, max_model_len=2048, kv_cache_tokens=32768,
              prefix_caching=False, progress=False)
    check = [torch.randint(3, 8000, (n,), generator=gen).tolist() for n in (5, 300, 900)]
    tokens = []
    for name in PATHS:
        use(name)
        tokens.append([o.token_ids for o in llm.generate(check, SamplingParams(max_tokens=24, temperature=0.0,
                                                                              ignore_eos=True))])
    same = tokens[0] == tokens[1]
    print("greedy tokens identical torch/kernels:", same)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    decode = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    seconds: dict[tuple[str, str], list[float]] = {(n, c): [] for n in PATHS for c in CASES}
    for rep in range(9):
        long = torch.randint(3, 8000, (1536,), generator=gen).tolist()
        short = [torch.randint(3, 8000, (16,), generator=gen).tolist() for _ in range(32)]
        for name in ("torch", "kernels") if rep % 2 == 0 else ("kernels", "torch"):
            use(name)
            for case, prompts, params in ((CASES[0], [long], first), (CASES[1], short, decode)):
                start = time.perf_counter()
                llm.generate(prompts, params)
                if rep:
                    seconds[(name, case)].append(time.perf_counter() - start)
    rows = []
    for case in CASES:
        old, new = (statistics.median(seconds[(n, case)]) for n in PATHS)
        rows.append({"case": case, "torch_ms": old * 1e3, "kernels_ms": new * 1e3, "speedup": old / new,
                     "torch_all_s": seconds[("torch", case)], "kernels_all_s": seconds[("kernels", case)]})
        print(f"{case}: torch {old * 1e3:.0f} ms, kernels {new * 1e3:.0f} ms, {old / new:.3f}x")
    out = out_dir / ("layer_ops_ab.json" if dtype == "float32" else f"layer_ops_ab_{dtype}.json")
    out.write_text(json.dumps({"machine": cpu_record(), "dtype": dtype, "greedy_identical": same, "rows": rows},
                              indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "float32", Path(sys.argv[2]) if len(sys.argv) > 2 else Path())
