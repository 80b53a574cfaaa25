"""KV-cache sizing (`chariot.worker.kv_cache.KVCache.blocks_that_fit`): explicit token counts are
taken as given; on the CPU a share of RAM is capped at what the configured batch can ever use, so a
small model does not get millions of blocks (and the KV gauges can show a leak)."""

from __future__ import annotations

from pathlib import Path

import pytest

from chariot.contracts.engine_settings import default_block_size
from chariot.contracts.errors import ConfigError
from chariot.worker.config import EngineConfig, ResolvedConfig
from chariot.worker.kv_cache import KVCache


def blocks(model: Path, **knobs: object) -> int:
    resolved = ResolvedConfig.resolve(EngineConfig(model=str(model), dtype="float32", **knobs))  # type: ignore[arg-type]
    return KVCache.blocks_that_fit(resolved, resolved.model.num_layers)


BS = default_block_size("cpu")


@pytest.mark.parametrize("block_size", [16, None])
def test_cpu_share_of_ram_is_capped_by_batch_and_length(tiny_model_dir: Path, block_size: int | None) -> None:
    bs = block_size or BS
    n = blocks(tiny_model_dir, max_batch_size=4, max_model_len=128, watermark=0.0, block_size=block_size)
    assert n == 4 * -(-128 // bs) + 1
    bigger = blocks(tiny_model_dir, max_batch_size=8, max_model_len=256, watermark=0.0, block_size=block_size)
    assert bigger == 8 * -(-256 // bs) + 1


def test_explicit_token_count_is_taken_as_given(tiny_model_dir: Path) -> None:
    assert blocks(tiny_model_dir, max_batch_size=4, max_model_len=128, kv_cache_tokens=100_000) == 100_000 // BS


def test_too_small_a_cache_names_the_knob(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError) as err:
        blocks(tiny_model_dir, max_model_len=256, kv_cache_tokens=64)
    assert err.value.field == "kv_cache_tokens"
