"""A 512-token chunk after 1,536 cached tokens: the C++ paged kernel against PyTorch SDPA on the
context gathered out of the paged cache (gather included), median of 9 interleaved calls (output:
prefill_chunk_sdpa_vs_kernel.txt).

    .venv/bin/python docs/img/ttft/prefill_chunk_sdpa_vs_kernel.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from chariot.bench.cpu_attention_bench import SCALE, Shape, make_problem
from chariot.kernels import cpu_attention

CHUNK, CONTEXT = 512, 1536


def main() -> None:
    q, k, v, meta = make_problem(Shape("chunk", chunks=1, chunk=CHUNK, chunk_ctx=CONTEXT))
    heads, kv_heads, dim = q.shape[1], k.shape[2], q.shape[2]
    total = CHUNK + CONTEXT
    queries = q.transpose(0, 1).unsqueeze(0)
    lower_right = causal_lower_right(CHUNK, total)
    bool_mask = torch.ones(CHUNK, total, dtype=torch.bool).tril(diagonal=CONTEXT)

    def gather() -> tuple[torch.Tensor, torch.Tensor]:
        table = meta.block_tables[0].long()
        keys = k[table].reshape(-1, kv_heads, dim)[:total].transpose(0, 1).unsqueeze(0)
        values = v[table].reshape(-1, kv_heads, dim)[:total].transpose(0, 1).unsqueeze(0)
        return keys, values

    def sdpa(mask: torch.Tensor | object, repeat: bool = False) -> torch.Tensor:
        keys, values = gather()
        if repeat:
            keys, values = keys.repeat_interleave(heads // kv_heads, 1), values.repeat_interleave(heads // kv_heads, 1)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=SCALE, enable_gqa=not repeat)
        return out[0].transpose(0, 1)

    fns: dict[str, Callable[[], torch.Tensor]] = {
        "kernel": lambda: cpu_attention.paged_attention(q, k, v, meta, SCALE),
        "sdpa lower_right": lambda: sdpa(lower_right),
        "sdpa bool mask": lambda: sdpa(bool_mask),
        "sdpa bool mask, kv repeated": lambda: sdpa(bool_mask, repeat=True),
    }
    with torch.inference_mode():
        expected = fns["kernel"]()
        for name, fn in fns.items():
            print(name, "max diff", (fn() - expected).abs().max().item())
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(9):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    for name, seconds in times.items():
        print(f"{name:32s} {statistics.median(seconds) * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
