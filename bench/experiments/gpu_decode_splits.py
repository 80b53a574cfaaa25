"""Split-KV decode on a GPU: eager time and GPU time of each forced split count (the H100 run of 2026-11-24).

    python -m chariot.bench.experiments.gpu_decode_splits OUT_DIR

Eager time is `triton.testing.do_bench` on the call, which on a slow host measures the launches
(three scratch allocations and two Triton launches for the split path); GPU time replays 20 calls
captured in one CUDA graph, so it is the kernels' own. Llama-3-8B heads (32 query, 8 KV, 128), bf16,
shuffled blocks of 16 (`chariot.bench.kernel_bench.make_inputs`). Flash SDPA on contiguous K/V is
the baseline. "(auto)" marks the count `decode_splits` picks.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from chariot.bench.kernel_bench import SCALE, Case, make_inputs, sdpa_method
from chariot.kernels import triton_attention as ta

SHAPES = [(1, 1024), (1, 4096), (1, 8192), (8, 1024), (8, 8192), (32, 4096)]


def graph_ms(fn: Callable[[], object], calls: int = 20) -> float:
    """Milliseconds per call when `calls` calls replay from one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    import triton.testing

    return float(triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median")) / calls


def eager_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median"))


def main(out: Path) -> None:
    device, rows = torch.device("cuda"), []
    for batch, ctx in SHAPES:
        case = Case("decode", batch, 1, ctx)
        inputs = make_inputs(case, device)
        auto = ta.decode_splits(1, batch, 8, ctx, 64)
        sdpa, _ = sdpa_method(case, inputs)
        methods: dict[str, Callable[[], object]] = {"sdpa": sdpa}
        for splits in (1, 2, 4, 8, 16, 32, 64):
            methods[f"triton splits={splits}{' (auto)' if splits == auto else ''}"] = partial(
                ta.paged_attention, inputs.query, inputs.k_cache, inputs.v_cache, inputs.meta, SCALE, splits=splits)
        for name, fn in methods.items():
            rows.append({"b": batch, "ctx": ctx, "method": name, "eager_ms": eager_ms(fn), "graph_ms": graph_ms(fn)})
            print(rows[-1], flush=True)
    (out / "decode_splits_h100.json").write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows},
                                                            indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
