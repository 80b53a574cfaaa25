"""Decode steps of the bf16 `100m` model with the skinny kernel's bf16 rows on and off, in one process.

Two `LLM`s on the same weights: one with `CHARIOT_CPU_SKINNY_LINEAR=0` (oneDNN for every row count),
one with the default `auto` (the load-time calibration routes rows to the kernel where it wins).
Each round sends the same fresh batch of 16-token prompts (64 tokens out each) to both, the order
alternating; medians of the rounds after the first. Writes `engine_ab.json` here, or with batch
sizes given, `engine_ab_<sizes>.json`.

    .venv/bin/python docs/img/skinny_bf16/engine_ab.py      # run from any directory
    .venv/bin/python docs/img/skinny_bf16/engine_ab.py 12 16 24 32   # session 12: six rows per pass
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from chariot.bench.linear_bench import cpu_record

HERE = Path(__file__).resolve().parent
MODEL = HERE.parents[2] / "models" / "100m"
BATCHES = (1, 2, 4, 8)
ROUNDS = 9
STEPS = 64


def main(batches: tuple[int, ...] = BATCHES) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from chariot.worker import LLM, SamplingParams

    kw = dict(dtype="bfloat16", token_budget=512, max_model_len=2048, kv_cache_tokens=32768, prefix_caching=False,
              progress=False)
    os.environ["CHARIOT_CPU_SKINNY_LINEAR"] = "0"
    engines = {"onednn": LLM(str(MODEL), **kw)}
    os.environ["CHARIOT_CPU_SKINNY_LINEAR"] = "auto"
    engines["skinny"] = LLM(str(MODEL), **kw)
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for batch in batches:
        times: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(ROUNDS):
            prompts = [torch.randint(3, 8000, (16,), generator=gen).tolist() for _ in range(batch)]
            for name in (("onednn", "skinny") if r % 2 == 0 else ("skinny", "onednn")):
                t0 = time.perf_counter()
                engines[name].generate(prompts, params)
                times[name].append((time.perf_counter() - t0) / STEPS)
        med = {name: statistics.median(t[1:]) for name, t in times.items()}
        rows.append({"batch": batch, "ms_per_step": {k: v * 1e3 for k, v in med.items()},
                     "speedup": med["onednn"] / med["skinny"], "raw_s": times})
        print(f"batch {batch}: oneDNN {med['onednn'] * 1e3:.2f} ms/step  skinny route {med['skinny'] * 1e3:.2f} "
              f"ms/step  speed-up {med['onednn'] / med['skinny']:.3f}", flush=True)
    name = "engine_ab.json" if batches == BATCHES else f"engine_ab_{'_'.join(map(str, batches))}.json"
    (HERE / name).write_text(json.dumps({"machine": cpu_record(), "rounds": ROUNDS, "steps": STEPS,
                                                     "rows": rows}, indent=1))


if __name__ == "__main__":
    main(tuple(int(a) for a in sys.argv[1:]) or BATCHES)
