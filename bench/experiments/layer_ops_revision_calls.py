"""The CPU layer kernels of this checkout against another revision's, per call, interleaved in one
process: SiLU·mul, RMSNorm and RoPE on the `100m` shapes, on one thread and on all of them.

Why: a change inside the kernels' inner loop (how a bf16 lane is rounded, say) shows per call before
it can show on an engine (`kernel_revision_ab --library layer_ops` measures that). The rows are few
enough to stay in the core's caches (16 rows of SiLU·mul, 64 of RMSNorm and RoPE), so the timing is
the kernel's arithmetic, not the memory's. ROUNDS rounds alternate the two builds; the report is the
median nanoseconds per element and the ratio.

    .venv/bin/python -m chariot.bench.experiments.layer_ops_revision_calls REV [DTYPE] [OUT]   # ~1 min

From the repository root (git); writes OUT (default `layer_ops_revision_calls_<dtype>.json`).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from chariot.bench.experiments.kernel_revision_ab import revision_source
from chariot.bench.linear_bench import cpu_record
from chariot.kernels import cpu_layer_ops

ROUNDS, CALLS = 15, 40
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 1024, 2816, 16, 4, 64

Ops = Callable[[str], Callable[..., None]]


def ns_per_call(fn: Callable[[], None]) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    return (time.perf_counter() - t0) / CALLS * 1e9


def cases(dtype: torch.dtype) -> dict[str, tuple[int, Callable[[Ops], None]]]:
    """Each op's (elements per call, call on a build)."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    gate_up, out = rand(16, 2 * INTERMEDIATE), torch.empty(16, INTERMEDIATE, dtype=dtype)
    x, weight, normed = rand(64, HIDDEN), rand(HIDDEN), torch.empty(64, HIDDEN, dtype=dtype)
    q, k, cos, sin = rand(64, HEADS, HEAD_DIM), rand(64, KV_HEADS, HEAD_DIM), rand(64, HEAD_DIM), rand(64, HEAD_DIM)
    return {"silu_and_mul": (out.numel(), lambda ops: ops("silu_and_mul")(gate_up, out)),
            "rms_norm": (x.numel(), lambda ops: ops("rms_norm")(x, weight, 1e-5, normed)),
            "rope": (q.numel() + k.numel(), lambda ops: ops("rope")(q, k, cos, sin))}


def main(rev: str, dtype_name: str, out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        builds: dict[str, Ops] = {"current": cpu_layer_ops.load_kernel(),
                                  rev: cpu_layer_ops.load_kernel(revision_source(rev, Path(tmp), cpu_layer_ops))}
    ops_cases = cases(getattr(torch, dtype_name))
    threads = torch.get_num_threads()
    results: dict[str, dict[str, dict[str, float]]] = {}
    for count in sorted({1, threads}):
        torch.set_num_threads(count)
        samples: dict[str, dict[str, list[float]]] = {op: {b: [] for b in builds} for op in ops_cases}
        for r in range(ROUNDS):
            for name in (list(builds) if r % 2 == 0 else list(builds)[::-1]):
                for op, (elements, call) in ops_cases.items():
                    samples[op][name].append(ns_per_call(partial(call, builds[name])) / elements)
        results[f"{count}_threads"] = {op: {b: statistics.median(v) for b, v in per.items()}
                                       for op, per in samples.items()}
        for op, med in results[f"{count}_threads"].items():
            print(f"{count} thread(s) {op}: {rev} {med[rev]:.3f}, current {med['current']:.3f} ns/element "
                  f"({med[rev] / med['current']:.2f}x)", flush=True)
    torch.set_num_threads(threads)
    out.write_text(json.dumps({"machine": cpu_record(), "dtype": dtype_name, "baseline_revision": rev,
                               "rounds": ROUNDS, "ns_per_element": results}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: layer_ops_revision_calls REV [DTYPE] [OUT]")
    dtype = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
    main(sys.argv[1], dtype, Path(sys.argv[3]) if len(sys.argv) > 3 else Path(f"layer_ops_revision_calls_{dtype}.json"))
