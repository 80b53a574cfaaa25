"""Tensor parallelism over gloo on CPU (ranks as local processes): greedy outputs identical to
Hugging Face `transformers` with T=2 and with P=2 × T=2 under every policy with preemption, KV heads
replicated when there are fewer of them than ranks, biased q/k/v (Qwen2), and a rank that dies."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from chariot.contracts.errors import ConfigError, PipelineError
from chariot.worker import LLM, SamplingParams
from tests.integration.test_engine import hf_greedy, make_prompts

pytestmark = pytest.mark.slow
POLICIES = ["sarathi", "vllm", "orca", "fastertransformer"]
MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
LENGTHS = (1, 10, 14, 15, 20, 33)


def engine_kwargs(policy: str) -> dict:
    # 8 blocks of 16 tokens for ~93 prompt + 60 output tokens: every policy has to preempt.
    return dict(policy=policy, token_budget=16 if policy == "sarathi" else None, dtype="float32",
                max_model_len=128, kv_cache_tokens=8 * 16, block_size=16, max_batch_size=8, progress=False)


def vocab(model_dir) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    prompts = make_prompts(vocab(tiny_model_dir), LENGTHS)
    return prompts, hf_greedy(tiny_model_dir, prompts, MAX_NEW)


def generate(model_dir, prompts, **kwargs) -> tuple[list[list[int]], int]:
    with LLM(str(model_dir), **kwargs) as llm:
        outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        engine = llm.engine
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks  # no KV block leaked
        stats = engine.stats()
        assert stats.tensor_parallel_size == kwargs.get("tensor_parallel_size", 1)
        assert (stats.collective_s > 0) == (stats.tensor_parallel_size > 1)  # the all-reduces were timed
        return outs, engine.scheduler.num_preemptions


@pytest.mark.parametrize("policy", POLICIES)
def test_two_ranks_match_transformers(reference, tiny_model_dir, policy):
    prompts, expected = reference
    outs, preemptions = generate(tiny_model_dir, prompts, tensor_parallel_size=2, **engine_kwargs(policy))
    assert outs == expected
    assert preemptions > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_two_stages_of_two_ranks_match_transformers(reference, tiny_model_dir, policy):
    prompts, expected = reference
    outs, preemptions = generate(tiny_model_dir, prompts, pipeline_stages=2, tensor_parallel_size=2,
                                 **engine_kwargs(policy))
    assert outs == expected
    assert preemptions > 0


def test_more_ranks_than_kv_heads_replicate_them(reference, tiny_model_dir):
    """tiny has 2 KV heads: with 4 ranks each keeps the one its single query head reads."""
    prompts, expected = reference
    outs, _ = generate(tiny_model_dir, prompts, tensor_parallel_size=4, **engine_kwargs("sarathi"))
    assert outs == expected


def test_biased_qkv_and_untied_head_shard_too(model_factory):
    """Qwen2 has q/k/v biases: each rank loads its heads' slice of them."""
    model_dir = model_factory("tiny", arch="qwen2")
    prompts = make_prompts(vocab(model_dir), LENGTHS[:4])
    outs, _ = generate(model_dir, prompts, tensor_parallel_size=2, **engine_kwargs("sarathi"))
    assert outs == hf_greedy(model_dir, prompts, MAX_NEW)


def test_a_size_that_does_not_divide_the_heads_is_refused_before_any_process_starts(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"tensor_parallel_size.*must divide the attention heads \(4\), got 3"):
        LLM(str(tiny_model_dir), tensor_parallel_size=3, dtype="float32", progress=False)


def test_a_dead_rank_fails_the_group(tiny_model_dir):
    """Killing the follower makes the leader's next collective fail: requests get a PipelineError
    instead of a hang (bounded by the stage timeout)."""
    prompts = make_prompts(vocab(tiny_model_dir), LENGTHS[:2])
    llm = LLM(str(tiny_model_dir), tensor_parallel_size=2, stage_timeout_s=5.0, **engine_kwargs("sarathi"))
    try:
        assert llm.pipeline is not None
        os.kill(llm.pipeline.pids[0], signal.SIGKILL)
        time.sleep(0.5)
        started = time.monotonic()
        with pytest.raises(PipelineError):
            llm.generate(prompts, GREEDY)
        assert time.monotonic() - started < 30
    finally:
        llm.close()
