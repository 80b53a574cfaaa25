"""Linear layers on the CPU: PyTorch's default (MKL) against oneDNN with pre-packed weights.

The shapes are the `100m` preset's projections (fused qkv, o, fused gate/up, down, LM head) at the
row counts an iteration feeds them: single decodes, decode batches and prefill chunks. Both paths
run interleaved, repetition by repetition, in one process, so drift hits them alike; medians are
reported with the CPU model and flags.

    python -m chariot.bench.linear_bench --out docs/img/linear_100m.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from chariot.worker.cpu_features import cpu_flags
from chariot.worker.model.cpu_linear import PackedLinear

SHAPES = {"qkv": (1536, 1024), "o": (1024, 1024), "gate_up": (5632, 1024), "down": (1024, 2816),
          "lm_head": (8192, 1024)}
ROWS = (1, 8, 32, 128, 512)
FLAG_NAMES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni")


def cpu_record() -> dict[str, object]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    flags = cpu_flags()
    return {"cpu": model, "flags": [f for f in FLAG_NAMES if f in flags], "threads": torch.get_num_threads(),
            "torch": torch.__version__}


def time_pair(a: Callable[[], object], b: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median seconds of `a` and `b`, run alternately."""
    for _ in range(3):
        a(), b()
    ta, tb = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        ta.append(t1 - t0)
        tb.append(time.perf_counter() - t1)
    return statistics.median(ta), statistics.median(tb)


def measure(reps: int) -> list[dict[str, object]]:
    rows = []
    with torch.inference_mode():
        for name, (out_f, in_f) in SHAPES.items():
            linear = nn.Linear(in_f, out_f, bias=False).eval()
            packed = PackedLinear(linear)
            for n in ROWS:
                x = torch.randn(n, in_f)
                default, onednn = time_pair(lambda: linear(x), lambda: packed(x), reps)  # noqa: B023
                rows.append({"layer": name, "shape": [out_f, in_f], "rows": n, "default_ms": default * 1e3,
                             "packed_ms": onednn * 1e3, "speedup": default / onednn})
                print(f"{name:8s} {out_f}x{in_f} rows {n:4d}: default {default * 1e3:7.2f} ms, "
                      f"packed {onednn * 1e3:7.2f} ms, {default / onednn:4.2f}x", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default="bench/results/linear.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    record = {"machine": cpu_record(), "rows": measure(args.reps)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
