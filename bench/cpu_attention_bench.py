"""CPU attention benchmark: the C++ paged kernel (`kernels/cpu_attention.py`) against the PyTorch
reference, on the attention shapes of the `100m` preset (16 query heads, 4 KV heads, head_dim 64,
`--block-size`, default the CPU's 128), for what one Sarathi iteration holds: batches of decodes,
prefill chunks with and without cached context, and a hybrid batch (decodes + one chunk, one call).
It decides whether the kernel is the default CPU backend, so both run interleaved in one process
(medians of alternating runs) and the CPU model and flags are recorded with the numbers.

    python -m chariot.bench.cpu_attention_bench --out docs/img/cpu_attention_100m.json

`--baseline-source` adds another revision of the kernel (e.g. `git show REV:kernels/csrc/paged_attention.cpp`),
built beside the current one and timed in the same interleaved loop, with `--baseline-layout
slot-major` for a kernel from before the CPU cache went head-major: a before/after in one run.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from chariot.bench.linear_bench import cpu_record, save_record, time_interleaved
from chariot.contracts.engine_settings import default_block_size
from chariot.kernels import cpu_attention, reference
from chariot.kernels.attention import AttentionMetadata, empty_kv_cache

HEADS, KV_HEADS, HEAD_DIM = 16, 4, 64
BLOCK = default_block_size("cpu")
SCALE = HEAD_DIM**-0.5


@dataclass(frozen=True)
class Shape:
    """One attention call: `decodes` single-token queries over `decode_ctx` tokens each, then
    prefill chunks of `chunk` tokens after `chunk_ctx` cached tokens."""

    name: str
    decodes: int = 0
    decode_ctx: int = 0
    chunks: int = 0
    chunk: int = 0
    chunk_ctx: int = 0

    def lengths(self) -> tuple[list[int], list[int]]:
        """(query lengths, context before each query), decodes first."""
        q = [1] * self.decodes + [self.chunk] * self.chunks
        ctx = [self.decode_ctx] * self.decodes + [self.chunk_ctx] * self.chunks
        return q, ctx


SHAPES = (
    Shape("decode 1 (ctx 512)", decodes=1, decode_ctx=512),
    Shape("decode 32 (ctx 512)", decodes=32, decode_ctx=512),
    Shape("decode 32 (ctx 2048)", decodes=32, decode_ctx=2048),
    Shape("prefill 512 (no ctx)", chunks=1, chunk=512),
    Shape("prefill chunk 512 (ctx 1536)", chunks=1, chunk=512, chunk_ctx=1536),
    Shape("hybrid: 32 decodes (ctx 512) + chunk 480 (ctx 512)", decodes=32, decode_ctx=512, chunks=1, chunk=480,
          chunk_ctx=512),
)


def slot_major(cache: torch.Tensor) -> torch.Tensor:
    """The same cache contents stored contiguously, [num_blocks, block_size, kv_heads, head_dim]."""
    return cache.contiguous()


def make_problem(shape: Shape, dtype: torch.dtype = torch.float32, seed: int = 0, block: int = BLOCK,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A random paged cache of `block`-token blocks holding every sequence's context (blocks shuffled)
    and its new queries."""
    gen = torch.Generator().manual_seed(seed)
    q_lens, ctx = shape.lengths()
    seq_lens = [c + q for c, q in zip(ctx, q_lens, strict=True)]
    widths = [-(-s // block) for s in seq_lens]
    num_blocks = sum(widths)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.zeros(len(q_lens), max(widths), dtype=torch.int32)
    offsets = [0, *torch.tensor(widths).cumsum(0).tolist()]
    for i, w in enumerate(widths):
        tables[i, :w] = perm[offsets[i] : offsets[i] + w]
    k_cache = empty_kv_cache(num_blocks, block, KV_HEADS, HEAD_DIM, dtype)  # the engine's layout
    v_cache = empty_kv_cache(num_blocks, block, KV_HEADS, HEAD_DIM, dtype)
    k_cache.copy_(torch.randn(num_blocks, block, KV_HEADS, HEAD_DIM, generator=gen))
    v_cache.copy_(torch.randn(num_blocks, block, KV_HEADS, HEAD_DIM, generator=gen))
    query = torch.randn(sum(q_lens), HEADS, HEAD_DIM, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(starts, torch.tensor(seq_lens, dtype=torch.int32), tables,
                             torch.zeros(sum(q_lens), dtype=torch.long), tuple(q_lens), tuple(seq_lens),
                             shape.decodes)
    return query, k_cache, v_cache, meta


@dataclass(frozen=True)
class Baseline:
    """Another build of the kernel, run on caches in `layout` ("engine" or "slot-major")."""

    kernel: cpu_attention.KernelFn
    layout: str


def measure(reps: int, baseline: Baseline | None = None, dtype: torch.dtype = torch.float32, block: int = BLOCK,
            ) -> list[dict[str, object]]:
    """Each shape through the reference and the kernel (and the baseline build); in bf16/fp16 also
    through the route that sends prompt chunks to PyTorch's flash SDPA (`sdpa_prefill_ms`), and where
    this build takes them on the AMX tiles, that route (`amx_prefill_ms`)."""
    rows = []
    amx = cpu_attention.amx_prompts(dtype, HEAD_DIM, block)
    with torch.inference_mode():
        for shape in SHAPES:
            q, k, v, meta = make_problem(shape, dtype, block=block)
            fns = [lambda: reference.paged_attention(q, k, v, meta, SCALE),  # noqa: B023
                   lambda: cpu_attention.paged_attention(q, k, v, meta, SCALE, prompts="kernel")]  # noqa: B023
            if dtype != torch.float32:
                fns.append(lambda: cpu_attention.paged_attention(q, k, v, meta, SCALE, prompts="sdpa"))  # noqa: B023
            if amx:
                fns.append(lambda: cpu_attention.paged_attention(q, k, v, meta, SCALE, prompts="amx"))  # noqa: B023
            if baseline:
                bk, bv = (slot_major(k), slot_major(v)) if baseline.layout == "slot-major" else (k, v)
                fns.append(lambda: cpu_attention.paged_attention(q, bk, bv, meta, SCALE,  # noqa: B023
                                                                 kernel=baseline.kernel))
            expected = reference.paged_attention(q, k, v, meta, SCALE)
            errs = [(fn() - expected).abs().max().item() for fn in fns[1:]]
            times = time_interleaved(fns, reps)
            ref_s, cpu_s = times[:2]
            row = {"shape": shape.name, "reference_ms": ref_s * 1e3, "cpu_kernel_ms": cpu_s * 1e3,
                   "speedup": ref_s / cpu_s, "max_abs_diff": errs[0]}
            line = (f"{shape.name:52s} reference {ref_s * 1e3:8.2f} ms  kernel {cpu_s * 1e3:8.2f} ms  "
                    f"{ref_s / cpu_s:5.2f}x  (max |diff| {errs[0]:.1e})")
            if dtype != torch.float32:
                sdpa_s = times[2]
                row.update(sdpa_prefill_ms=sdpa_s * 1e3, kernel_over_sdpa=cpu_s / sdpa_s, sdpa_max_abs_diff=errs[1])
                line += f"  sdpa route {sdpa_s * 1e3:8.2f} ms ({cpu_s / sdpa_s:4.2f}x)"
            if amx:
                amx_s = times[3]
                row.update(amx_prefill_ms=amx_s * 1e3, sdpa_over_amx=times[2] / amx_s, amx_max_abs_diff=errs[2])
                line += f"  amx route {amx_s * 1e3:8.2f} ms (sdpa/amx {times[2] / amx_s:4.2f}x)"
            if baseline:
                b = times[-1]
                row.update(baseline_ms=b * 1e3, speedup_vs_baseline=b / cpu_s, baseline_max_abs_diff=errs[-1])
                line += f"  baseline {b * 1e3:8.2f} ms ({b / cpu_s:4.2f}x)"
            rows.append(row)
            print(line, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default="bench/results/cpu_attention.json")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="query and cache dtype (bf16/fp16 also time the flash-SDPA route for prompt chunks)")
    parser.add_argument("--block-size", type=int, default=BLOCK, help=f"KV-cache block size (default {BLOCK})")
    parser.add_argument("--baseline-source", type=Path, default=None,
                        help="another revision of csrc/paged_attention.cpp to time against the current kernel")
    parser.add_argument("--baseline-layout", choices=("engine", "slot-major"), default="engine",
                        help="the cache layout the baseline runs on (slot-major: kernels before the head-major cache)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print("loading the CPU kernel (compiles on first use) ...", flush=True)
    cpu_attention.load_kernel()
    baseline = None
    if args.baseline_source:
        print(f"loading the baseline kernel {args.baseline_source} ...", flush=True)
        baseline = Baseline(cpu_attention.load_kernel(args.baseline_source.resolve()), args.baseline_layout)
    dtype = getattr(torch, args.dtype)
    record = {"machine": cpu_record(), "reps": args.reps, "dtype": args.dtype,
              "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": args.block_size},
              "cache_layout": "engine (empty_kv_cache)",
              "baseline": None if baseline is None else {"source": str(args.baseline_source),
                                                         "layout": baseline.layout},
              "rows": measure(args.reps, baseline, dtype, args.block_size)}
    save_record(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
