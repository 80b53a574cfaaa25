"""bf16 decode rows per call: the AMX tile path against the VDPBF16PS skinny kernel and oneDNN's packed
route, interleaved in one process.

The `100m` model's 33 linear layers (8 layers of fused qkv, o, gate-up and down, and the LM head)
with random bf16 weights, 1 to 64 rows, each pass over all of them (about 190 MB of weights: a decode
step's stream from memory), the routes alternating pass by pass, ROUNDS passes each after a warm-up.
Above the tile path's 32 rows it runs as `CpuLinear` would run it there, in calls of up to 32 rows
(each streaming the weights again), against oneDNN on all the rows at once: whether splitting alone
would let the tiles take the 33-64-row decode batches that the engine now sends to oneDNN. Medians
and the weights' streaming rate. On a CPU with AMX tiles:

    .venv/bin/python -m chariot.bench.experiments.amx_linear_calls [ROUNDS] [OUT]   # ~1 min

Writes OUT (default amx_linear_calls.json in the current directory).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from chariot.bench.linear_bench import cpu_record
from chariot.kernels import skinny_linear as skinny

SHAPES = [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816)] * 8 + [(8192, 1024)]  # (out, in)
ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def routes(weights: list[torch.Tensor]) -> dict[str, Callable[[list[torch.Tensor]], object]]:
    tiles = [skinny.amx_pack(w) for w in weights]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    def onednn(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

    return {
        "tiles": lambda xs: [torch.cat([skinny.amx_linear(part, t, None, w.shape[0])
                                        for part in x.split(skinny.AMX_MAX_ROWS)])
                             for x, t, w in zip(xs, tiles, weights, strict=True)],
        "dots": lambda xs: [skinny.skinny_linear(x, w) for x, w in zip(xs, weights, strict=True)],
        "onednn": lambda xs: [onednn(x, p) for x, p in zip(xs, packed, strict=True)],
    }


def main(rounds: int, out: Path) -> None:
    if not skinny.amx_rows(torch.zeros(1024, 1024, dtype=torch.bfloat16)):
        raise SystemExit("no AMX tile path for bf16 weights here: run it on a CPU with AMX tiles")
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(o, i, generator=gen) * 0.02).bfloat16() for o, i in SHAPES]
    nbytes = sum(w.numel() * 2 for w in weights)
    fns, rows_out = routes(weights), []
    for rows in ROWS:
        xs = [torch.randn(rows, w.shape[1], generator=gen).bfloat16() for w in weights]
        names = [n for n in fns if n != "dots" or rows <= skinny.MAX_ROWS]
        times: dict[str, list[float]] = {n: [] for n in names}
        for n in names:
            fns[n](xs)  # warm-up (oneDNN builds its primitive)
        for r in range(rounds):
            for n in names[r % len(names):] + names[: r % len(names)]:
                t0 = time.perf_counter()
                fns[n](xs)
                times[n].append(time.perf_counter() - t0)
        med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        rows_out.append({"rows": rows, "median_ms": med, "gb_per_s": {n: nbytes / m / 1e6 for n, m in med.items()}})
        print(f"{rows:3d} rows: " + ", ".join(f"{n} {m:6.2f} ms ({nbytes / m / 1e6:4.1f} GB/s)"
                                          for n, m in med.items()), flush=True)
    out.write_text(json.dumps({"machine": cpu_record(), "rounds": rounds, "weight_bytes": nbytes, "rows": rows_out},
                              indent=1))


if __name__ == "__main__":
    argv = sys.argv[1:]
    main(int(argv[0]) if argv else 21, Path(argv[1]) if len(argv) > 1 else Path("amx_linear_calls.json"))
