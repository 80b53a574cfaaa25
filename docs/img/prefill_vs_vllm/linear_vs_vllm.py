"""The 100m preset's four linear shapes at M rows (default 512): vLLM-CPU's `onednn_mm` (its CPU
linear layers), torch's packed oneDNN `_linear_pointwise` (Chariot's) and `F.linear`, interleaved,
in vLLM's venv (same torch 2.13). Output: linear_vs_vllm.txt.

    build/vllm-venv/bin/python docs/img/prefill_vs_vllm/linear_vs_vllm.py 512
    build/vllm-venv/bin/python docs/img/prefill_vs_vllm/linear_vs_vllm.py 512 bfloat16
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
from vllm import _custom_ops as ops

SHAPES = ((1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816))  # (out, in): qkv, o, gate_up, down


def main() -> None:
    torch.set_num_threads(2)
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    dtype = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.float32
    weights = [torch.randn(n, k, dtype=dtype) for n, k in SHAPES]
    handles = [ops.create_onednn_mm(w.t(), 32) for w in weights]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    inputs = [torch.randn(rows, k, dtype=dtype) for _, k in SHAPES]
    routes: dict[str, Callable[[], None]] = {
        "vllm": lambda: [ops.onednn_mm(h, x, None) for h, x in zip(handles, inputs, strict=True)] and None,
        "torch_packed": lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                 for p, x in zip(packed, inputs, strict=True)] and None,
        "F.linear": lambda: [torch.nn.functional.linear(x, w) for w, x in zip(weights, inputs, strict=True)] and None,
    }
    flops = sum(2 * rows * n * k for n, k in SHAPES)
    times: dict[str, list[float]] = {name: [] for name in routes}
    with torch.inference_mode():
        for fn in routes.values():
            fn()
        for _ in range(15):
            for name, fn in routes.items():
                t0 = time.perf_counter()
                fn()
                fn()
                times[name].append((time.perf_counter() - t0) / 2)
    for name, ts in times.items():
        print(f"{name} {statistics.median(ts) * 1e3:.2f} ms  {flops / statistics.median(ts) / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
