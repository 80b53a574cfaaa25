"""KV-cache sizing: how many blocks fit, from a token count or a fraction of free device memory."""

from __future__ import annotations

import os

import torch

from chariot.contracts.errors import ConfigError
from chariot.worker.config import EngineConfig, ModelConfig


def bytes_per_token(model: ModelConfig, num_layers: int, dtype: torch.dtype) -> int:
    """K and V for one token across `num_layers` layers."""
    return 2 * num_layers * model.kv_size * torch.empty(0, dtype=dtype).element_size()


def free_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def num_kv_blocks(
    config: EngineConfig, model: ModelConfig, num_layers: int, dtype: torch.dtype, max_model_len: int
) -> int:
    """Blocks for this stage; at least enough for one sequence of `max_model_len` tokens."""
    if config.kv_cache_tokens is not None:
        tokens = config.kv_cache_tokens
        field = "kv_cache_tokens"
    else:
        budget = int(free_device_memory(torch.device(config.device)) * config.kv_cache_memory_fraction)
        tokens = budget // bytes_per_token(model, num_layers, dtype)
        field = "kv_cache_memory_fraction"
    blocks = tokens // config.block_size
    needed = -(-max_model_len // config.block_size)
    reserve = int(config.watermark * blocks)
    if blocks - reserve < needed:
        raise ConfigError(
            field,
            f"KV cache of {blocks} blocks ({tokens} tokens) cannot hold one sequence of max_model_len "
            f"{max_model_len} tokens plus the watermark; raise {field} or lower max_model_len",
        )
    return blocks
