"""The panel kernel against oneDNN's packed GEMM at prefill sizes, one `100m` projection at a time,
calls interleaved, medians of 15 (weights in cache: this is the FMA-bound regime; GFLOP/s per route).

    .venv/bin/python -m chariot.bench.experiments.panel_prefill_shapes [ROWS ...] > OUT.txt
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

from chariot.bench.linear_bench import cpu_record
from chariot.kernels import panel_linear as panel

SHAPES = ((1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816))  # (out, in): qkv, o, gate_up, down
REPEATS = 15


def main(rows: list[int]) -> None:
    torch.manual_seed(0)
    print({k: v for k, v in cpu_record().items() if k != "all_flags"})
    for m in rows:
        for n, k in SHAPES:
            w, x = torch.randn(n, k) * 0.02, torch.randn(m, k)
            panels, onednn = panel.pack(w), torch.ops.mkldnn._reorder_linear_weight(w, None)
            routes: dict[str, Callable[[], object]] = {
                "panel": partial(panel.panel_linear, x, panels),
                "oneDNN": partial(torch.ops.mkldnn._linear_pointwise, x, onednn, None, "none", [], ""),
            }
            times: dict[str, list[float]] = {r: [] for r in routes}
            for call in routes.values():
                call()
            for _ in range(REPEATS):
                for route, call in routes.items():
                    t0 = time.perf_counter()
                    call()
                    times[route].append(time.perf_counter() - t0)
            med = {r: statistics.median(ts) for r, ts in times.items()}
            cells = "  ".join(f"{r} {t * 1e3:6.2f} ms ({2 * m * n * k / t / 1e9:5.1f} GFLOP/s)" for r, t in med.items())
            print(f"{m:4d} rows, {n:4d}x{k:4d}: {cells}  panel {med['oneDNN'] / med['panel']:.3f}x", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [128, 256, 512])
