"""Does `torch.compile` (inductor on the CPU) pay for the non-attention part of a layer?

Times the `100m` preset's per-layer work outside attention (RMSNorms, fused qkv and o projections,
SwiGLU MLP, residual adds) over 8 layers, eager against `torch.compile(dynamic=True)`, at a decode
batch (32 rows) and a prefill chunk (512 rows), after warm-up (compilation excluded), with random
weights. Medians; the result decides whether the engine compiles (docs/BENCHMARKS.md).

    python -m chariot.bench.compile_bench --out docs/img/compile_100m.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from chariot.bench.linear_bench import cpu_record

HIDDEN, INTERMEDIATE, KV, LAYERS = 1024, 2816, 256, 8

Step = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class LayerWithoutAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.Parameter(torch.ones(HIDDEN)), nn.Parameter(torch.ones(HIDDEN))
        self.qkv = nn.Linear(HIDDEN, HIDDEN + 2 * KV, bias=False)
        self.o = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.gate_up = nn.Linear(HIDDEN, 2 * INTERMEDIATE, bias=False)
        self.down = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + residual
        q = self.qkv(self.norm1 * F.rms_norm(x, (HIDDEN,), eps=1e-5))[:, :HIDDEN]  # attention itself excluded
        residual = self.o(q) + x
        gate, up = self.gate_up(self.norm2 * F.rms_norm(residual, (HIDDEN,), eps=1e-5)).chunk(2, -1)
        return self.down(F.silu(gate) * up), residual


def median_ms(steps: list[Step], rows: int, reps: int) -> float:
    x = torch.randn(rows, HIDDEN)
    times = []
    with torch.inference_mode():
        for i in range(reps + 3):
            t0 = time.perf_counter()
            h, res = x, torch.zeros_like(x)
            for step in steps:
                h, res = step(h, res)
            if i >= 3:
                times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default="bench/results/compile.json")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    layers = [LayerWithoutAttention().eval() for _ in range(LAYERS)]
    eager: list[Step] = [layer.forward for layer in layers]
    compiled: list[Step] = [torch.compile(layer, dynamic=True) for layer in layers]
    rows = []
    for n in (32, 512):
        e, c = median_ms(eager, n, args.reps), median_ms(compiled, n, args.reps)
        rows.append({"rows": n, "eager_ms": e, "compiled_ms": c, "speedup": e / c})
        print(f"{n} rows: eager {e:.2f} ms, compiled {c:.2f} ms, {e / c:.3f}x", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": cpu_record(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
