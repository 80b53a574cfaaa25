"""The skinny linear kernel against another build of it and oneDNN's packed GEMM, interleaved.

One pass = every linear layer of the `100m` preset (8 layers × qkv, o, gate_up, down: 200 MB of
weights in bf16, 400 MB in fp32, so they stream from memory) for M rows. `time_interleaved`
alternates the order of the three callers every rep. Writes OUT_DIR/kernel_ab_<dtype>[_<tag>].json
(OUT_DIR defaults to the current directory).

    mkdir -p build/base
    git show 483c0ca:kernels/csrc/skinny_linear.cpp > build/base/skinny_linear.cpp   # headers beside it
    git show 483c0ca:kernels/csrc/vec8.h > build/base/vec8.h
    .venv/bin/python -m chariot.bench.experiments.skinny_kernel_ab build/base/skinny_linear.cpp --dtype bfloat16 \
        [--tag six_rows] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from chariot.bench.linear_bench import cpu_record, time_interleaved
from chariot.kernels import skinny_linear as skinny

SHAPES = ((1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816))  # [out, in] of one 100m layer's linears
LAYERS = 8
ROWS = (1, 2, 4, 8, 12, 16, 24, 32)
REPS = 11


def main(other_source: Path, dtype: torch.dtype, tag: str = "", out_dir: Path = Path()) -> None:
    current, other = skinny.load_kernel(), skinny.load_kernel(other_source)
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen) * 0.05).to(dtype) for _ in range(LAYERS) for n, k in SHAPES]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]

    def kernel_pass(kernel: skinny.KernelFn, x: dict[int, torch.Tensor]) -> None:
        for w in weights:
            skinny.skinny_linear(x[w.shape[1]], w, None, kernel=kernel)

    def onednn_pass(x: dict[int, torch.Tensor]) -> None:
        for w, p in zip(weights, packed, strict=True):
            torch.ops.mkldnn._linear_pointwise(x[w.shape[1]], p, None, "none", [], "")

    rows = []
    with torch.inference_mode():
        for m in ROWS:
            x = {k: torch.randn(m, k, generator=gen).to(dtype) for k in {k for _, k in SHAPES}}
            a, b, d = time_interleaved([lambda: kernel_pass(current, x), lambda: kernel_pass(other, x),  # noqa: B023
                                        lambda: onednn_pass(x)], REPS)  # noqa: B023
            rows.append({"rows": m, "current_ms": a * 1e3, "other_ms": b * 1e3, "onednn_ms": d * 1e3})
            print(f"{m:2d} rows: current {a * 1e3:6.2f} ms  other {b * 1e3:6.2f} ms  oneDNN {d * 1e3:6.2f} ms  "
                  f"other/current {b / a:.3f}  oneDNN/current {d / a:.3f}", flush=True)
    name = str(dtype).removeprefix("torch.")
    (out_dir / f"kernel_ab_{name}{'_' + tag if tag else ''}.json").write_text(json.dumps(
        {"machine": cpu_record(), "dtype": name, "other": str(other_source), "reps": REPS, "rows": rows}, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("other_source", type=Path, help="the other build's skinny_linear.cpp, its headers beside it")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tag", default="", help="suffix of the output file's name")
    parser.add_argument("--out-dir", type=Path, default=Path())
    args = parser.parse_args()
    main(args.other_source, getattr(torch, args.dtype), args.tag, args.out_dir)
