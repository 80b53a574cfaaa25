"""bf16 linear layers on oneDNN in bf16 against float32 arithmetic on a float32 copy of the weights
(`CHARIOT_CPU_BF16_UPCAST`), in one process.

Why: on a CPU with AVX512-BF16 but no AMX tiles the bf16 dot product (VDPBF16PS) can run no faster
than the float32 FMAs (`bench/experiments/cpu_peak.c`), and oneDNN's bf16 GEMM then runs well
below its float32 one; the prefill chunks, where the linear layers are bound by arithmetic, pay for
it. Two measurements:

- per layer shape of the `100m` preset, at 64 and 512 rows: one oneDNN call on the bf16 packed
  weight against the same call on a float32 packed copy (rows taken up to float32 and the result
  back to bf16 included), medians of interleaved calls;
- the peer benchmark's offline trace through two engines in this process, one loaded with the route
  off (`0`) and one with it forced on (`1`), ROUNDS alternating rounds (`offline_ab`); the greedy
  tokens of the warm-up batch are compared.

    .venv/bin/python -m chariot.bench.experiments.bf16_upcast_ab [ROUNDS] [OUT_DIR]   # ~8 min

From the repository root (it loads `models/100m`); writes OUT_DIR/bf16_upcast_ab.json.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from chariot.bench import offline_ab as ab
from chariot.bench.linear_bench import cpu_record
from chariot.contracts import environment as env
from chariot.worker.model.cpu_linear import CpuLinear

SHAPES = {"qkv": (1024, 1536), "o": (1024, 1024), "gate_up": (1024, 5632), "down": (2816, 1024),
          "lm_head": (1024, 8192)}  # (in_features, out_features) of the 100m preset's layers
CALLS = 15


def call_ms(fn: Callable[[], Any], other: Callable[[], Any]) -> tuple[float, float]:
    """Median milliseconds of `fn` and `other`, called in turn after two untimed calls each."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(2):
        fn(), other()
    for _ in range(CALLS):
        for f, out in zip((fn, other), times, strict=True):
            t0 = time.perf_counter()
            f()
            out.append(time.perf_counter() - t0)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def per_shape() -> dict[str, dict[str, float]]:
    rows: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for name, (k, n) in SHAPES.items():
            linear = nn.Linear(k, n, bias=False).to(torch.bfloat16)
            bf16 = CpuLinear(linear, packed=True, plain=False)
            upcast = CpuLinear(linear, packed=True, plain=False, packed_dtype=torch.float32)
            for m in (64, 512):
                x = torch.randn(m, k, dtype=torch.bfloat16)
                a, b = call_ms(partial(bf16.packed, x), partial(upcast.packed, x))
                rows[f"{name} {m}x{k}x{n}"] = {"bf16_ms": round(a, 3), "float32_ms": round(b, 3),
                                               "ratio": round(a / b, 3)}
                print(f"{name} {m} rows: bf16 {a:.2f} ms, float32 {b:.2f} ms ({a / b:.2f}x)", flush=True)
    return rows


def engine(mode: str) -> Any:
    os.environ[env.CPU_BF16_UPCAST.name] = mode
    try:
        return ab.load("bfloat16")
    finally:
        os.environ.pop(env.CPU_BF16_UPCAST.name, None)


def main(rounds: int, out_dir: Path) -> None:
    shapes = per_shape()
    variants = {"bf16": ab.as_is(engine("0")), "float32": ab.as_is(engine("1"))}
    walls, tokens = ab.run_variants(variants, rounds, "bf16-upcast-ab")
    med = ab.medians(walls)
    same = ab.same_tokens(tokens, "bf16", "float32")
    print(f"median wall: bf16 {med['bf16']:.1f} s, float32 {med['float32']:.1f} s "
          f"({med['bf16'] / med['float32']:.2f}x); greedy tokens identical: {same}/8")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bf16_upcast_ab.json").write_text(json.dumps(
        {"machine": cpu_record(), "amx_tiles": bool(torch.cpu._is_amx_tile_supported()), "per_shape": shapes,
         "rounds": rounds, "wall_s": walls, "median_s": med, "greedy_identical": same}, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3, Path(sys.argv[2]) if len(sys.argv) > 2 else Path())
