"""CPU backend: paged varlen attention that reads K/V blocks in place (`csrc/paged_attention.cpp`).

The PyTorch reference gathers every sequence's whole context out of the paged cache in every layer
of every iteration (`index_select`) and then runs SDPA over the copy; on CPU that copy is a quarter
of an offline run. This C++ kernel walks the block table instead: one call for decodes and prefill
chunks, work items of (sequence, query tile, KV head) shared out over torch's threads, GQA without
copies (a K/V row read once serves its whole group of query heads), register-blocked fp32
micro-kernels with an online softmax, and no read at or past a sequence's length. With a bf16 query
and cache on a CPU with AVX512-BF16, both products run on bf16 dot products instead, in tiles of
several query tokens and in decodes of whole GQA groups (`bf16_dot_tiles`), with fp32 accumulation.
On a CPU with AMX tiles, bf16 prompt chunks take the kernel's tile path instead (`csrc/prompt_amx.h`,
`prompt_route`), and fp16 ones PyTorch's flash attention (`sdpa_prefill`).

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
import torch.nn.functional as F

from chariot.kernels import cpu_build
from chariot.kernels.attention import AttentionBackend, AttentionMetadata, FunctionBackend
from chariot.kernels.cpu_build import CACHE_ENV, build_dir, load_ops
from chariot.kernels.cpu_layer_ops import write_kv

__all__ = ["BACKEND", "CACHE_ENV", "PROMPT_ROUTES", "amx_prompts", "amx_tiles", "bf16_dot_tiles", "build_problem",
           "cache_dir", "load_kernel", "load_prompt_kernel", "paged_attention", "prompt_route", "sdpa_prefill",
           "write_kv"]

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
STEM = "cpu_attention"

KernelFn = Callable[..., None]
PROMPT_ROUTES = ("kernel", "sdpa", "amx")
"""Where a batch's prompt chunks can go: this kernel's vector path, PyTorch's flash SDPA, or this
kernel's AMX tile path (`prompt_route` picks one)."""


def cache_dir(source: Path = SOURCE) -> Path:
    """Where this build lives: `$CHARIOT_KERNEL_CACHE` (default ~/.cache/chariot/kernels)/cpu_attention-<hash>."""
    return build_dir(source, STEM)


@cache
def load_kernel(source: Path = SOURCE) -> KernelFn:
    """The compiled op (loaded from the cache, else built first); raises when it cannot be built.

    `source`: another revision of the kernel (the benchmark times one against the current kernel in
    the same process; each build gets its own op namespace)."""
    return load_ops(source, STEM, "CPU attention kernel")("paged_attention")


@cache
def load_prompt_kernel() -> KernelFn:
    """The current build's AMX tile path for prompt chunks (`prompt_attention_amx`)."""
    return load_ops(SOURCE, STEM, "CPU attention kernel")("prompt_attention_amx")


def bf16_dot_tiles(source: Path = SOURCE) -> bool:
    """Whether this build computes bf16 attention on bf16 dot products (AVX512-BF16's VDPBF16PS):
    tiles of several query tokens, and decodes of GQA groups that divide 16 with head_dim a multiple
    of 32. It does when the CPU it was built for has them."""
    return bool(load_ops(source, STEM, "CPU attention kernel")("bf16_dot_tiles")())


@cache
def build_problem() -> str | None:
    """Why the kernel cannot be built or loaded here, or None when it can (decided once per process)."""
    return cpu_build.build_problem(load_kernel, "C++ attention kernel")


@cache
def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (`amx_bf16`), which oneDNN's bf16 GEMMs, and so PyTorch's flash
    attention, run on."""
    return bool(torch.cpu._is_amx_tile_supported())


@cache
def amx_prompts(dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """Whether this build runs prompt chunks of these shapes on the AMX tiles (`csrc/prompt_amx.h`):
    bf16, a CPU with AMX tiles and a build for it, head_dim a multiple of 32 up to 256, block_size a
    multiple of 64 (the CPU's default is 128)."""
    if dtype != torch.bfloat16 or not amx_tiles() or build_problem() is not None:
        return False
    return bool(load_ops(SOURCE, STEM, "CPU attention kernel")("prompt_amx")(head_dim, block_size))


def prompt_route(dtype: torch.dtype, head_dim: int, block_size: int) -> str:
    """Where prompt chunks go (decodes, bound by reading the cache, always take the kernel's vector path).

    On a CPU with AMX tiles, bf16 chunks take the kernel's tile path (`amx`), 1.4–1.5× PyTorch's flash
    attention on 512-token chunks (docs/kernels.md), where the shapes allow; bf16 chunks of other
    shapes and fp16 chunks take the flash attention (`sdpa`), whose GEMMs run on the tiles too, 2.6–3.5×
    the kernel's VDPBF16PS dot products. Everything else takes the kernel (`kernel`)."""
    if amx_prompts(dtype, head_dim, block_size):
        return "amx"
    return "sdpa" if dtype in (torch.bfloat16, torch.float16) and amx_tiles() else "kernel"


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kernel: KernelFn | None = None,
    prompts: str | None = None,
) -> torch.Tensor:
    """Attention of every new token over its sequence's cached context (see `attention.py`).

    Output is contiguous, in the query's dtype; K/V may be fp32, bf16 or fp16 (computed in fp32).
    `kernel`: a `load_kernel(source)` build to run instead of the current one. `prompts`: where prompt
    chunks go, one of `PROMPT_ROUTES` (None: `prompt_route` decides, and only for the current build).
    """
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0] == 0:
        return out
    if prompts is None:
        prompts = "kernel" if kernel is not None else prompt_route(query.dtype, query.shape[2], k_cache.shape[1])
    elif prompts not in PROMPT_ROUTES:
        raise ValueError(f"prompts must be one of {', '.join(PROMPT_ROUTES)}, got {prompts!r}")
    nd = meta.num_decodes
    if prompts == "kernel" or nd == meta.num_seqs:
        _run_kernel(kernel, query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                    scale, out)
        return out
    if nd:
        _run_kernel(kernel, query[:nd], k_cache, v_cache, meta.query_start_loc[: nd + 1], meta.seq_lens[:nd],
                    meta.block_tables[:nd], scale, out[:nd])
    if prompts == "amx":
        load_prompt_kernel()(
            _unit_stride(query), _unit_stride(k_cache), _unit_stride(v_cache), _int32(meta.query_start_loc),
            _int32(meta.seq_lens), _int32(meta.block_tables), float(scale), nd, out)
    else:
        sdpa_prefill(query, k_cache, v_cache, meta, scale, out)
    return out


def sdpa_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, out: torch.Tensor) -> None:
    """The prompt chunks of a batch (sequences `num_decodes` onwards) through PyTorch's SDPA, one
    sequence at a time: its context gathered out of the paged cache (a copy of K and V, small next to
    the attention), GQA by `enable_gqa`, causal from the chunk's first position. Writes `out`'s rows."""
    block = k_cache.shape[1]
    for i in range(meta.num_decodes, meta.num_seqs):
        q_len, s_len = meta.query_lens[i], meta.seq_lens_list[i]
        start = int(meta.query_start_loc[i])
        blocks = meta.block_tables[i, : -(-s_len // block)].long()
        k = k_cache[blocks].flatten(0, 1)[:s_len].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, s_len, d]
        v = v_cache[blocks].flatten(0, 1)[:s_len].transpose(0, 1).unsqueeze(0)
        q = query[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, d]
        context = s_len - q_len
        mask = None
        if context:  # the chunk's i-th token sees the context and the chunk up to itself
            mask = torch.arange(s_len).view(1, -1) <= torch.arange(context, s_len).view(-1, 1)
        attended = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                                  is_causal=not context, scale=scale, enable_gqa=True)
        out[start : start + q_len] = attended[0].transpose(0, 1)


def _run_kernel(kernel: KernelFn | None, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                out: torch.Tensor) -> None:
    (kernel or load_kernel())(
        _unit_stride(query),
        _unit_stride(k_cache),
        _unit_stride(v_cache),
        _int32(query_start_loc),
        _int32(seq_lens),
        _int32(block_tables),
        float(scale),
        out,
    )


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _int32(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int32 and t.is_contiguous():
        return t  # as it is: `to` and `contiguous` would each still dispatch an op
    return t.to(torch.int32).contiguous()


BACKEND: AttentionBackend = FunctionBackend("cpu", write_kv, paged_attention)
