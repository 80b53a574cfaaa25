"""The decode graph runner changes no token: greedy outputs with `cuda_graphs="on"` (padded decode
buckets over static buffers, run eagerly on the CPU) equal those with it off, under every policy and
through a 2-stage pipeline and on two tensor-parallel ranks; on CUDA, with the graphs captured and replayed (`gpu`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from chariot.worker import LLM, SamplingParams
from chariot.worker.executor import ModelRunner
from chariot.worker.graph_runner import DecodeGraphRunner

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPT_LENS = (1, 5, 14, 17, 30, 41, 9)  # 7 sequences: decode batches of 7 down to 1 fill several buckets
POLICIES = ("sarathi", "vllm", "orca", "fastertransformer")


def prompts(vocab: int = 500) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def engine_kwargs(policy: str, **extra: Any) -> dict[str, Any]:
    return dict(policy=policy, token_budget=32 if policy == "sarathi" else None, dtype="float32",
                max_model_len=96, kv_cache_tokens=40 * 16, max_batch_size=8, progress=False, **extra)


def graphs_of(llm: LLM) -> DecodeGraphRunner:
    runner = llm.engine.executor.runner  # type: ignore[union-attr]
    assert isinstance(runner, ModelRunner) and runner.graphs is not None
    return runner.graphs


def generate(model: Path, policy: str, cuda_graphs: str, **extra: Any) -> tuple[list[list[int]], int]:
    """Greedy tokens, and how many decode iterations the graph runner served on stage 0."""
    with LLM(str(model), **engine_kwargs(policy, cuda_graphs=cuda_graphs, **extra)) as llm:
        tokens = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
        served = 0
        if cuda_graphs != "off":
            graphs = graphs_of(llm)
            served = graphs.eager_runs + graphs.replays
    return tokens, served


@pytest.fixture(scope="module")
def eager_tokens(tiny_model_dir: Path) -> dict[str, list[list[int]]]:
    return {policy: generate(tiny_model_dir, policy, "off")[0] for policy in POLICIES}


@pytest.mark.parametrize("policy", POLICIES)
def test_graph_runner_gives_the_eager_greedy_tokens(tiny_model_dir: Path, eager_tokens: dict[str, list[list[int]]],
                                                    policy: str) -> None:
    tokens, served = generate(tiny_model_dir, policy, "on")
    assert tokens == eager_tokens[policy]
    assert served >= GREEDY.max_tokens - 1  # every request's later tokens came from decode-only steps


@pytest.mark.slow
def test_graph_runner_in_a_two_stage_pipeline_gives_the_eager_tokens(
        tiny_model_dir: Path, eager_tokens: dict[str, list[list[int]]]) -> None:
    tokens, served = generate(tiny_model_dir, "sarathi", "on", pipeline_stages=2)
    assert tokens == eager_tokens["sarathi"]
    assert served > 0


@pytest.mark.slow
def test_tensor_parallel_followers_take_the_leaders_path(tiny_model_dir: Path,
                                                         eager_tokens: dict[str, list[list[int]]]) -> None:
    """Leader and follower both pad a decode into its bucket (else their all-reduces would differ in
    shape and the group would fail): same tokens as one eager process."""
    tokens, served = generate(tiny_model_dir, "sarathi", "on", tensor_parallel_size=2)
    assert tokens == eager_tokens["sarathi"]
    assert served > 0


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["sarathi", "vllm"])
def test_captured_graphs_give_the_eager_greedy_tokens_on_cuda(triton_backend: None, tiny_model_dir: Path,
                                                              policy: str) -> None:
    want, _ = generate(tiny_model_dir, policy, "off", device="cuda")
    with LLM(str(tiny_model_dir), **engine_kwargs(policy, cuda_graphs="on", device="cuda")) as llm:
        got = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
        graphs = graphs_of(llm)
        assert graphs.captured == (1, 2, 4, 8)
        assert graphs.replays >= GREEDY.max_tokens - 1
        assert graphs.pool_bytes > 0
    assert got == want
