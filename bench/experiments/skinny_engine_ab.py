"""Decode steps of the bf16 `100m` model with the skinny kernel's bf16 rows on and off, in one process.

Two `LLM`s on the same weights: one with `CHARIOT_CPU_SKINNY_LINEAR=0` (oneDNN for every row count),
one with the default `auto` (the load-time calibration routes rows to the kernel where it wins).
Each round sends the same fresh batch of 16-token prompts (64 tokens out each) to both, the order
alternating; medians of the rounds after the first. Writes OUT_DIR/engine_ab.json, or with batch
sizes given, OUT_DIR/engine_ab_<sizes>.json (OUT_DIR defaults to the current directory). Run from the
repository root (it loads `models/100m`):

    .venv/bin/python -m chariot.bench.experiments.skinny_engine_ab [--out-dir DIR]
    .venv/bin/python -m chariot.bench.experiments.skinny_engine_ab 12 16 24 32   # the six-rows-per-pass sizes
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch

from chariot.bench.linear_bench import cpu_record

MODEL = Path("models/100m")
BATCHES = (1, 2, 4, 8)
ROUNDS = 9
STEPS = 64


def main(batches: tuple[int, ...] = BATCHES, out_dir: Path = Path()) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from chariot.worker import LLM, SamplingParams

    def load() -> LLM:
        return LLM(str(MODEL), dtype="bfloat16", token_budget=512, max_model_len=2048, kv_cache_tokens=32768,
                   prefix_caching=False, progress=False)

    os.environ["CHARIOT_CPU_SKINNY_LINEAR"] = "0"
    engines = {"onednn": load()}
    os.environ["CHARIOT_CPU_SKINNY_LINEAR"] = "auto"
    engines["skinny"] = load()
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
    (out_dir / name).write_text(json.dumps({"machine": cpu_record(), "rounds": ROUNDS, "steps": STEPS,
                                                     "rows": rows}, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("batches", type=int, nargs="*", help=f"decode batch sizes (default {BATCHES})")
    parser.add_argument("--out-dir", type=Path, default=Path())
    args = parser.parse_args()
    main(tuple(args.batches) or BATCHES, args.out_dir)
