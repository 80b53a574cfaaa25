"""Tensor-parallel shard arithmetic (`chariot.worker.model.parallel.Shard`): every head, KV head, MLP
column and vocabulary row is held by exactly the ranks that need it, and sizes that cannot split are
refused naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from chariot.contracts.errors import ConfigError
from chariot.worker.config import ModelConfig
from chariot.worker.model.parallel import Shard

BASE = ModelConfig(architecture="LlamaForCausalLM", hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
                   head_dim=8, intermediate_size=96, vocab_size=1001, rms_norm_eps=1e-5, rope_theta=1e4,
                   max_position_embeddings=128, tie_word_embeddings=False, qkv_bias=False, torch_dtype="float32")


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_heads_mlp_and_vocab_partition_exactly(size: int) -> None:
    shards = [Shard(r, size) for r in range(size)]
    for s in shards:
        s.check(BASE)
    assert [h for s in shards for h in s.heads(BASE)] == list(range(BASE.num_heads))
    assert [c for s in shards for c in s.mlp(BASE)] == list(range(BASE.intermediate_size))
    assert [v for s in shards for v in s.vocab(BASE)] == list(range(BASE.vocab_size))
    assert all(len(s.vocab(BASE)) <= s.vocab_rows(BASE) for s in shards)  # the last rank's rows are padded


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_every_query_head_finds_its_kv_head_on_its_own_rank(size: int) -> None:
    group = BASE.num_heads // BASE.num_kv_heads
    for rank in range(size):
        s = Shard(rank, size)
        for head in s.heads(BASE):
            assert head // group in s.kv_heads(BASE)
    if size > BASE.num_kv_heads:  # replicated: one KV head per rank, shared by size / kv ranks
        assert all(len(Shard(r, size).kv_heads(BASE)) == 1 for r in range(size))
    else:
        assert sum(len(Shard(r, size).kv_heads(BASE)) for r in range(size)) == BASE.num_kv_heads


@pytest.mark.parametrize(("changes", "size", "message"), [
    ({}, 3, "must divide the attention heads \\(8\\), got 3"),
    ({"num_heads": 12, "num_kv_heads": 3, "intermediate_size": 96}, 4, "KV heads \\(3\\)"),
    ({"intermediate_size": 90}, 4, "MLP width"),
])
def test_sizes_that_do_not_split_are_refused_naming_the_field(changes: dict, size: int, message: str) -> None:
    model = dataclasses.replace(BASE, **changes)
    with pytest.raises(ConfigError, match=f"tensor_parallel_size.*{message}"):
        Shard(0, size).check(model)


def test_the_cpu_benchmark_gives_each_rank_its_own_cores() -> None:
    from chariot.bench.tensor_parallel_bench import core_sets

    assert core_sets(1, 2) == "0+1"
    assert core_sets(2, 2) == "0,1"
    assert core_sets(2, 8) == "0+1+2+3,4+5+6+7"
    assert core_sets(4, 2) == "0,1,0,1"  # more ranks than cores: they share


def test_collective_time_on_the_cpu_is_the_wall_time_around_the_call() -> None:
    import time

    import torch

    from chariot.worker.model.parallel import Collectives, _Timer

    c = Collectives()
    with _Timer(c, torch.device("cpu")):
        time.sleep(0.05)
    assert 0.05 <= c.collective_s < 1.0


@pytest.mark.gpu
def test_collective_time_on_cuda_is_the_streams_time_not_the_launch() -> None:
    """A CUDA collective returns once enqueued; the timer must count the work on the stream. A
    GPU-side sleep stands in for the collective (NCCL needs one GPU per rank)."""
    import torch

    from chariot.worker.model.parallel import Collectives, _Timer

    c = Collectives()
    torch.cuda.synchronize()
    with _Timer(c, torch.device("cuda")):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles, enqueued at once
    assert c._pending and c.collective_s > 0.02
    assert not c._pending
