"""16-lane (AVX-512) panel tiles for prefill chunks against the 8-lane tiles and oneDNN, one `100m`
projection at a time, calls interleaved, medians of 11 (GFLOP/s per route).

Each variant is the panel kernel built with macros set through a wrapper source: `NO_ROWSPLIT2=1`
splits the work into units of panels (as the 8-lane tiles do), the default splits the row groups
between the threads, each packing its own; `WD` is the depth block, `WG` the row groups per block.

    .venv/bin/python -m chariot.bench.experiments.panel_wide_tiles [ROWS ...] > OUT.txt
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from chariot.bench.linear_bench import cpu_record
from chariot.kernels import panel_linear as panel
from chariot.kernels.cpu_build import load_ops

SHAPES = ((1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816))  # (out, in): qkv, o, gate_up, down
VARIANTS = {"8-lane": "CHARIOT_VECTOR_256=1", "16-lane units": "NO_ROWSPLIT2=1,WD=128,WG=16",
            "16-lane row split": ""}
REPEATS = 11


def build(name: str, macros: str, directory: Path):  # type: ignore[no-untyped-def]
    defines = "".join(f"#define {kv.split('=')[0]} {kv.split('=')[1]}\n" for kv in macros.split(",") if kv)
    source = directory / f"panel_{abs(hash(macros))}.cpp"
    source.write_text(f"// {name}: {macros}\n{defines}#include \"{panel.SOURCE}\"\n")
    return load_ops(source, f"panel_variant_{abs(hash(macros)) % 100000}", name)("panel_linear")


def main(rows: list[int]) -> None:
    torch.manual_seed(0)
    print({k: v for k, v in cpu_record().items() if k != "all_flags"})
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {name: build(name, macros, Path(tmp)) for name, macros in VARIANTS.items()}
        for m in rows:
            for n, k in SHAPES:
                w, x = torch.randn(n, k) * 0.02, torch.randn(m, k)
                packed, onednn, out = panel.pack(w), torch.ops.mkldnn._reorder_linear_weight(w, None), torch.empty(m, n)
                routes = {name: partial(f, x, packed.panels, None, out) for name, f in kernels.items()}
                routes["oneDNN"] = partial(torch.ops.mkldnn._linear_pointwise, x, onednn, None, "none", [], "")
                times: dict[str, list[float]] = {r: [] for r in routes}
                for call in routes.values():
                    call()
                for _ in range(REPEATS):
                    for route, call in routes.items():
                        t0 = time.perf_counter()
                        call()
                        times[route].append(time.perf_counter() - t0)
                med = {r: statistics.median(ts) for r, ts in times.items()}
                cells = "  ".join(f"{r} {2 * m * n * k / t / 1e9:5.1f}" for r, t in med.items())
                print(f"{m:4d} rows, {n:4d}x{k:4d} (GFLOP/s): {cells}", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [128, 512])
