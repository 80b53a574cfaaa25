"""PyTorch reference backend: paged varlen attention built from batched tensor ops.

Runs on any device (it is the CPU path) and is the oracle for the Triton kernels. No per-sequence
Python loops on the hot path: decodes are one batched SDPA call, prefill chunks another (padded to
the longest chunk). GQA is handled without copying K/V: the query heads that share a KV head are
folded into the query-length dimension. Also the reference RoPE rotation (`rope`), which the CPU
layer kernel (`cpu_layer_ops.rope_`) matches bit for bit and falls back to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chariot.kernels.attention import AttentionBackend, AttentionMetadata, FunctionBackend


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, head_dim] by the per-token angles (cos, sin [T, 1, head_dim]; HF `rotate_half` layout).

    Bit for bit Hugging Face's `x·cos + rotate_half(x)·sin` (negation is exact, and a + (-b) is
    a - b), with one output and one half-size scratch tensor instead of five full-size
    temporaries: on the CPU each fresh buffer costs page faults as well as a pass over memory."""
    half = x.shape[-1] // 2
    out = x * cos
    rotated = x[..., half:] * sin[..., :half]
    out[..., :half].sub_(rotated)
    torch.mul(x[..., :half], sin[..., half:], out=rotated)
    out[..., half:].add_(rotated)
    return out


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter the new tokens' K/V into their cache slots (any cache strides: indexed by block and slot)."""
    block_size = k_cache.shape[1]
    blocks, slots = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, slots] = key.to(k_cache.dtype)
    v_cache[blocks, slots] = value.to(v_cache.dtype)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of every new token over its sequence's cached context (see `attention.py`)."""
    out = torch.empty_like(query)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decode(query[:nd], k_cache, v_cache, meta, scale)
    if nd < meta.num_seqs:
        start = int(meta.query_start_loc[nd])
        out[start:] = _prefill(query[start:], k_cache, v_cache, meta, scale)
    return out


def _gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor, max_len: int
) -> torch.Tensor:
    """[S, max_blocks] tables → [S, kv_heads, max_len, head_dim] context of each sequence.

    Positions past a sequence's length re-read its last token instead of whatever sits in the rest
    of its last block or in a table's padding entries (an earlier owner's data, or `torch.empty`
    garbage): masked attention still multiplies those by a zero weight, so a NaN/inf there would
    poison the output. Gathering slot by slot keeps sequences isolated without an extra pass.
    """
    block_size = cache.shape[1]
    dev = cache.device
    last = (lens.to(device=dev, dtype=torch.long) - 1).clamp_min(0).view(-1, 1)
    pos = torch.minimum(torch.arange(max_len, device=dev).view(1, max_len), last)  # [S, max_len]
    blocks = block_tables.to(device=dev, dtype=torch.long).gather(1, pos // block_size)
    ctx = cache[blocks, pos % block_size]  # [S, max_len, kv_heads, head_dim], whatever the cache's strides
    return ctx.transpose(1, 2)


def _decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    nd = meta.num_decodes
    seq_lens = meta.seq_lens_list[:nd]
    max_len = max(seq_lens)
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    group = query.shape[1] // kvh
    lens = meta.seq_lens[:nd].to(device=query.device, dtype=torch.long)
    k = _gather_context(k_cache, meta.block_tables[:nd], lens, max_len)
    v = _gather_context(v_cache, meta.block_tables[:nd], lens, max_len)
    q = query.view(nd, kvh, group, d)  # the group's heads play the role of query positions
    mask = torch.arange(max_len, device=query.device).view(1, 1, 1, max_len) < lens.view(nd, 1, 1, 1)
    o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)
    return o.reshape(nd, kvh * group, d)


def _prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    nd = meta.num_decodes
    q_lens = meta.query_lens[nd:]
    seq_lens = meta.seq_lens_list[nd:]
    p, max_q, max_len = len(q_lens), max(q_lens), max(seq_lens)
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    group = query.shape[1] // kvh
    dev = query.device

    starts = meta.query_start_loc[nd:-1].to(dev, torch.long) - int(meta.query_start_loc[nd])
    qlen_t = torch.tensor(q_lens, device=dev)
    offs = torch.arange(max_q, device=dev)
    valid = offs.view(1, max_q) < qlen_t.view(p, 1)  # [P, max_q]
    rows = starts.view(p, 1) + torch.minimum(offs.view(1, max_q), (qlen_t - 1).view(p, 1))
    q = query[rows]  # [P, max_q, h, d]
    q = q.view(p, max_q, kvh, group, d).permute(0, 2, 3, 1, 4).reshape(p, kvh, group * max_q, d)

    lens = torch.tensor(seq_lens, device=dev)
    k = _gather_context(k_cache, meta.block_tables[nd:], lens, max_len)
    v = _gather_context(v_cache, meta.block_tables[nd:], lens, max_len)
    ctx_before = lens - qlen_t  # cached tokens before the chunk
    q_pos = ctx_before.view(p, 1) + offs.view(1, max_q)  # absolute position of each query
    mask = torch.arange(max_len, device=dev).view(1, 1, max_len) <= q_pos.view(p, max_q, 1)
    mask = mask.view(p, 1, 1, max_q, max_len).expand(p, 1, group, max_q, max_len)
    mask = mask.reshape(p, 1, group * max_q, max_len)
    o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)
    o = o.view(p, kvh, group, max_q, d).permute(0, 3, 1, 2, 4).reshape(p, max_q, kvh * group, d)
    return o[valid]


BACKEND: AttentionBackend = FunctionBackend("reference", write_kv, paged_attention)
