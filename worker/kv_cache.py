"""The paged KV cache of one stage: how many blocks fit, agreeing on that across a pipeline, and
the per-layer cache tensors.

Why a module of its own: the single-process engine and every pipeline stage own a KV cache the
same way — sized from a token count or a fraction of free device memory, shrunk to the smallest
capacity in the group (stage 0's block tables index every stage's cache), then allocated.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from chariot.contracts.errors import ConfigError
from chariot.worker.config import ModelConfig, ResolvedConfig
from chariot.worker.model.llama import KVCache as LayerCache
from chariot.worker.model.llama import allocate_kv_caches
from chariot.worker.model.parallel import NO_SHARD, Shard


def bytes_per_token(model: ModelConfig, num_layers: int, dtype: torch.dtype, shard: Shard = NO_SHARD) -> int:
    """K and V for one token across `num_layers` layers, of the KV heads tensor-parallel `shard` stores."""
    kv_size = len(shard.kv_heads(model)) * model.head_dim
    return 2 * num_layers * kv_size * torch.empty(0, dtype=dtype).element_size()


def free_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class KVCache:
    """One stage's KV cache: a (k_cache, v_cache) pair per layer of the stage, each
    [num_blocks, block_size, kv_heads, head_dim], plus with the decode graph runner one scratch block
    (index `num_blocks`, never handed out by the block manager) that padded rows write into. Size it
    with `blocks_that_fit` (and, in a pipeline, `agree`) before loading weights; then `allocate`."""

    def __init__(self, layers: list[LayerCache], num_blocks: int, block_size: int,
                 scratch_block: int | None = None) -> None:
        self.layers = layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = scratch_block

    @staticmethod
    def blocks_that_fit(resolved: ResolvedConfig, num_layers: int, shard: Shard = NO_SHARD,
                        reserved_bytes: int = 0) -> int:
        """Blocks for a stage of `num_layers` layers; raises ConfigError (naming the knob) unless
        they hold at least one sequence of `max_model_len` tokens plus the watermark. Sized from free
        memory, the cache leaves `reserved_bytes` (the CUDA-graph pool, `graph_runner.graph_pool_bytes`)
        out of the memory its fraction is taken of."""
        config = resolved.engine
        if config.kv_cache_tokens is not None:
            tokens, field = config.kv_cache_tokens, "kv_cache_tokens"
        else:
            free = max(0, free_device_memory(resolved.device) - reserved_bytes)
            budget = int(free * config.kv_cache_memory_fraction)
            if resolved.device.type == "cpu":
                budget //= shard.size  # the ranks of a stage share one machine's memory
            tokens = budget // bytes_per_token(resolved.model, num_layers, resolved.dtype, shard)
            field = "kv_cache_memory_fraction"
        blocks = tokens // config.block_tokens
        needed = -(-resolved.max_model_len // config.block_tokens)
        if config.kv_cache_tokens is None and resolved.device.type == "cpu":
            # On the CPU the share of RAM is no device reserved for the cache: hold no more than the
            # batch can ever use (every sequence at max_model_len, plus the watermark's share).
            usable = config.max_batch_size * needed
            blocks = min(blocks, usable + int(config.watermark * usable) + 1)
        if blocks - int(config.watermark * blocks) < needed:
            raise ConfigError(
                field,
                f"KV cache of {blocks} blocks ({tokens} tokens) cannot hold one sequence of max_model_len "
                f"{resolved.max_model_len} tokens plus the watermark; raise {field} or lower max_model_len",
            )
        return blocks

    @staticmethod
    def agree(local_blocks: int, device: torch.device) -> int:
        """Pipeline: every stage must index the same blocks, so take the smallest capacity over the
        group (a collective over the default process group: every stage calls it)."""
        t = torch.tensor([local_blocks], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    @classmethod
    def allocate(cls, resolved: ResolvedConfig, num_layers: int, num_blocks: int, shard: Shard = NO_SHARD,
                 scratch_block: bool = False) -> KVCache:
        """`num_blocks` blocks per layer, and one more past them as the scratch block if `scratch_block`."""
        block_size = resolved.engine.block_tokens
        layers = allocate_kv_caches(resolved.model, num_layers, num_blocks + int(scratch_block), block_size,
                                    resolved.dtype, resolved.device, shard)
        return cls(layers, num_blocks, block_size, num_blocks if scratch_block else None)
