"""Attention over the paged KV cache: the contract every backend implements.

One flattened varlen batch per iteration. Sequences are ordered decodes first (query length 1),
then prefill chunks. Each new token's K/V is first written into the cache at its slot
(`write_kv`), then `paged_attention` reads each sequence's whole context from the cache through its
block table: a prefill chunk attends causally to its own tokens and fully to the sequence's earlier
cached tokens; a decode attends to its whole context.

Layouts:
- query: [num_tokens, num_heads, head_dim]
- key/value (new tokens): [num_tokens, num_kv_heads, head_dim]
- k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim], indexed logically so; any
  strides with head_dim contiguous. `empty_kv_cache` stores a CPU cache head-major
  ([num_blocks, num_kv_heads, block_size, head_dim] in memory, a permuted view): each block's rows of
  one KV head are then one contiguous run (4 KiB at 16 × 64 fp32), which is what a decode reads.
  The slot-major order interleaved the KV heads, so a decode used a quarter of every cache line run
  it touched and its rows aliased into a few L1 sets. GPU caches stay slot-major.
- slot = block_table[pos // block_size] * block_size + pos % block_size

Every backend module exposes that function pair as `BACKEND`, an `AttentionBackend`, so
`chariot.kernels` can select one by name and the executor never imports a backend itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Describes one iteration's flattened batch.

    Invariants: `query_start_loc[0] == 0`, `query_start_loc[-1] == num_tokens`; for every sequence
    `query_len <= seq_len`; the first `num_decodes` sequences have query length 1;
    `block_tables` rows are padded with 0 past each sequence's blocks.
    `query_lens`/`seq_lens_list` are host copies so CPU code needs no device syncs.

    `split_horizon` (decode-only batches; 0 = the batch's own longest context) is the context length
    a split-KV backend lays its splits out for. A CUDA graph fixes it at `max_model_len`; eager
    decodes of an engine set the same value, so a decode sums its context in the same order, and
    gives the same bits, whether it is replayed or run eagerly.
    """

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: cached + new tokens after this iteration
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_lens: tuple[int, ...]
    seq_lens_list: tuple[int, ...]
    num_decodes: int
    split_horizon: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list, default=0)


def empty_kv_cache(
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """An uninitialised cache, shaped [num_blocks, block_size, kv_heads, head_dim] (see Layouts)."""
    if torch.device(device).type == "cpu":
        return torch.empty(num_blocks, kv_heads, block_size, head_dim, dtype=dtype).permute(0, 2, 1, 3)
    return torch.empty(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)


@runtime_checkable
class AttentionBackend(Protocol):
    """One implementation of the contract above (`chariot.kernels` selects and dispatches to one)."""

    @property
    def name(self) -> str:
        """The name `CHARIOT_ATTENTION_BACKEND` selects it by."""
        ...

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Scatter the new tokens' K/V ([num_tokens, kv_heads, head_dim]) into their cache slots."""
        ...

    def paged_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention of every new token over its sequence's cached context; output shaped and typed like query."""
        ...


WriteKv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
PagedAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]


@dataclass(frozen=True)
class FunctionBackend:
    """An `AttentionBackend` made of a backend module's two module-level functions."""

    name: str
    write_kv: WriteKv
    paged_attention: PagedAttention
