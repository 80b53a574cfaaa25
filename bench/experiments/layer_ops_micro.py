"""Spot check and microbenchmark of the CPU layer kernels against the PyTorch code they replace, on
a 512-token chunk of the `100m` shapes (output: layer_ops_micro.txt; medians of 20 calls).

    .venv/bin/python -m chariot.bench.experiments.layer_ops_micro
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from chariot.kernels import cpu_layer_ops, empty_kv_cache, reference

WIDTH, HIDDEN, KV_HEADS, HEAD_DIM = 2816, 1024, 4, 64


def median_ms(fn: Callable[[], object], calls: int = 20) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    torch.manual_seed(0)
    gate_up = torch.randn(512, 2 * WIDTH) * 4
    x, w = torch.randn(512, HIDDEN), torch.randn(HIDDEN)
    k_cache, v_cache = (empty_kv_cache(64, 16, KV_HEADS, HEAD_DIM, torch.float32) for _ in range(2))
    qkv = torch.randn(512, HIDDEN + 2 * KV_HEADS * HEAD_DIM)
    key = qkv[:, HIDDEN: HIDDEN + KV_HEADS * HEAD_DIM].view(512, KV_HEADS, HEAD_DIM)
    value = qkv[:, HIDDEN + KV_HEADS * HEAD_DIM:].view(512, KV_HEADS, HEAD_DIM)
    slots = torch.randperm(1024)[:512]
    expected = F.silu(gate_up[:, :WIDTH]) * gate_up[:, WIDTH:]
    print(f"silu_and_mul max |diff| {(cpu_layer_ops.silu_and_mul(gate_up) - expected).abs().max().item():.2e}")
    diff = (cpu_layer_ops.rms_norm(x, w, 1e-5) - F.rms_norm(x, (HIDDEN,), eps=1e-5) * w).abs().max().item()
    print(f"rms_norm max |diff| {diff:.2e}")
    cases = {
        "write_kv": (lambda: reference.write_kv(key, value, k_cache, v_cache, slots),
                     lambda: cpu_layer_ops.write_kv(key, value, k_cache, v_cache, slots)),
        "silu_and_mul": (lambda: F.silu(gate_up[:, :WIDTH]).mul_(gate_up[:, WIDTH:]),
                         lambda: cpu_layer_ops.silu_and_mul(gate_up)),
        "rms_norm": (lambda: F.rms_norm(x, (HIDDEN,), eps=1e-5).mul_(w), lambda: cpu_layer_ops.rms_norm(x, w, 1e-5)),
    }
    with torch.inference_mode():
        for name, (torch_fn, kernel_fn) in cases.items():
            print(f"{name}: PyTorch {median_ms(torch_fn):.3f} ms, kernel {median_ms(kernel_fn):.3f} ms")


if __name__ == "__main__":
    main()
