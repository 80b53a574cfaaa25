"""The three CPU routes of a float32 linear layer for decode-sized row counts, interleaved in one
process: the skinny kernel on the plain weight, the panel kernel on panels, oneDNN on its packed
weight. The `100m` preset's four projections over six layers (264 MB of distinct weights, so they
come from memory as in a decode step), medians of 7 passes per route and row count; weight bytes
read per second and GFLOP/s per route.

    .venv/bin/python -m chariot.bench.experiments.panel_routes [ROWS ...] > docs/img/panel_linear/routes.txt   # ~2 min
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch

from chariot.bench.linear_bench import cpu_record
from chariot.kernels import panel_linear as panel
from chariot.kernels import skinny_linear as skinny

SHAPES = ((1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816))  # (out, in): qkv, o, gate_up, down
LAYERS = 6
PASSES = 7


def main(rows: list[int]) -> None:
    torch.manual_seed(0)
    plain = [[torch.randn(n, k) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    panels = [[panel.pack(w) for w in layer] for layer in plain]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in layer] for layer in plain]
    routes: dict[str, Callable[[torch.Tensor, int, int], object]] = {
        "skinny": lambda x, i, j: skinny.skinny_linear(x, plain[i][j]),
        "panel": lambda x, i, j: panel.panel_linear(x, panels[i][j]),
        "oneDNN": lambda x, i, j: torch.ops.mkldnn._linear_pointwise(x, onednn[i][j], None, "none", [], ""),
    }
    weight_gb = sum(n * k for n, k in SHAPES) * LAYERS * 4 / 1e9
    print({k: v for k, v in cpu_record().items() if k != "all_flags"})
    print(f"{LAYERS} layers x {len(SHAPES)} projections, {weight_gb * 1e3:.0f} MB of weights; medians of {PASSES}")
    for m in rows:
        inputs = [torch.randn(m, k) for _, k in SHAPES]

        def one_pass(route: str, inputs: list[torch.Tensor] = inputs) -> float:
            t0 = time.perf_counter()
            for i in range(LAYERS):
                for j in range(len(SHAPES)):
                    routes[route](inputs[j], i, j)
            return time.perf_counter() - t0

        times: dict[str, list[float]] = {r: [] for r in routes}
        for route in routes:
            one_pass(route)
        for _ in range(PASSES):
            for route in routes:
                times[route].append(one_pass(route))
        gflop = 2 * m * weight_gb / 4
        cells = []
        for route, ts in times.items():
            t = statistics.median(ts)
            cells.append(f"{route} {t * 1e3:6.1f} ms ({weight_gb / t:4.1f} GB/s, {gflop / t:5.1f} GFLOP/s)")
        print(f"{m:3d} rows: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 2, 4, 8, 12, 16, 24, 32, 48, 64])
