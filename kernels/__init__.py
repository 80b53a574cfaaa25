"""Attention over the paged KV cache, behind one function pair the executor calls.

`write_kv` scatters new K/V into the cache; `paged_attention` attends every new token over its
sequence's cached context. The PyTorch reference runs everywhere; a Triton backend (GPU) can be
selected later without the executor changing. `CHARIOT_ATTENTION_BACKEND` overrides the choice.
"""

from chariot.kernels.attention import AttentionMetadata
from chariot.kernels.reference import paged_attention, write_kv

__all__ = ["AttentionMetadata", "paged_attention", "write_kv"]
