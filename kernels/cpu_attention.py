"""CPU backend: paged varlen attention that reads K/V blocks in place (`csrc/paged_attention.cpp`).

The PyTorch reference gathers every sequence's whole context out of the paged cache in every layer
of every iteration (`index_select`) and then runs SDPA over the copy; on CPU that copy is a quarter
of an offline run. This C++ kernel walks the block table instead: one call for decodes and prefill
chunks, work items of (sequence, query tile, KV head) shared out over torch's threads, GQA without
copies (a K/V row read once serves its whole group of query heads), register-blocked fp32
micro-kernels with an online softmax, and no read at or past a sequence's length. With a bf16 query
and cache on a CPU with AVX512-BF16, both products run on bf16 dot products instead, in tiles of
several query tokens and in decodes of whole GQA groups (`bf16_dot_tiles`), with fp32 accumulation.

It is compiled on first use against the installed torch and cached (`cpu_build.py`: keyed by the
source, flags, torch and this CPU; later processes load it without a compiler), or loaded from the
portable build an image carries where the cache has none for this CPU. `write_kv` is the
one-pass copy of `cpu_layer_ops.py` (the reference's `index_put_` by block and slot took 1 ms per
layer for a 512-token chunk, single-threaded). It is the default attention backend on a machine
without CUDA whenever it builds (`kernels/__init__.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from chariot.kernels import cpu_build
from chariot.kernels.attention import AttentionBackend, AttentionMetadata, FunctionBackend
from chariot.kernels.cpu_build import CACHE_ENV, build_dir, load_ops
from chariot.kernels.cpu_layer_ops import write_kv

__all__ = ["BACKEND", "CACHE_ENV", "bf16_dot_tiles", "build_problem", "cache_dir", "load_kernel", "paged_attention",
           "write_kv"]

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
STEM = "cpu_attention"

KernelFn = Callable[..., None]


def cache_dir(source: Path = SOURCE) -> Path:
    """Where this build lives: `$CHARIOT_KERNEL_CACHE` (default ~/.cache/chariot/kernels)/cpu_attention-<hash>."""
    return build_dir(source, STEM)


@cache
def load_kernel(source: Path = SOURCE) -> KernelFn:
    """The compiled op (loaded from the cache, else built first); raises when it cannot be built.

    `source`: another revision of the kernel (the benchmark times one against the current kernel in
    the same process; each build gets its own op namespace)."""
    return load_ops(source, STEM, "CPU attention kernel")("paged_attention")


def bf16_dot_tiles(source: Path = SOURCE) -> bool:
    """Whether this build computes bf16 attention on bf16 dot products (AVX512-BF16's VDPBF16PS):
    tiles of several query tokens, and decodes of GQA groups that divide 16 with head_dim a multiple
    of 32. It does when the CPU it was built for has them."""
    return bool(load_ops(source, STEM, "CPU attention kernel")("bf16_dot_tiles")())


@cache
def build_problem() -> str | None:
    """Why the kernel cannot be built or loaded here, or None when it can (decided once per process)."""
    return cpu_build.build_problem(load_kernel, "C++ attention kernel")


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kernel: KernelFn | None = None,
) -> torch.Tensor:
    """Attention of every new token over its sequence's cached context (see `attention.py`).

    Output is contiguous, in the query's dtype; K/V may be fp32, bf16 or fp16 (computed in fp32).
    `kernel`: a `load_kernel(source)` build to run instead of the current one.
    """
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0] == 0:
        return out
    (kernel or load_kernel())(
        _unit_stride(query),
        _unit_stride(k_cache),
        _unit_stride(v_cache),
        _int32(meta.query_start_loc),
        _int32(meta.seq_lens),
        _int32(meta.block_tables),
        float(scale),
        out,
    )
    return out


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _int32(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int32 and t.is_contiguous():
        return t  # as it is: `to` and `contiguous` would each still dispatch an op
    return t.to(torch.int32).contiguous()


BACKEND: AttentionBackend = FunctionBackend("cpu", write_kv, paged_attention)
