"""Scheduling ahead changes no token: with `async_scheduling="on"` the engine builds batch N+1 while
batch N is in flight, its decodes taking N's sampled tokens on the device (`TokenCarry`). On the CPU
nothing overlaps, but the schedule, the carried inputs and the bookkeeping are the ones a GPU runs,
so every output here must equal the engine's without it: greedy under every policy and through the
graph runner's buckets, seeded sampling, penalties (never scheduled ahead), stop tokens, logprobs,
aborts while the batch built ahead holds a request, and the model-length limit. Nothing may leak."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from chariot.contracts.errors import ConfigError
from chariot.contracts.requests import FinishReason
from chariot.worker import LLM, SamplingParams
from chariot.worker.config import EngineConfig
from chariot.worker.engine import Engine, schedules_ahead

POLICIES = ("sarathi", "vllm", "orca", "fastertransformer")
PROMPT_LENS = (1, 5, 14, 17, 30, 41, 9)


def prompts(vocab: int = 500) -> list[list[int]]:
    gen = torch.Generator().manual_seed(23)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def engine_kwargs(policy: str, async_scheduling: str, **extra: Any) -> dict[str, Any]:
    return dict(policy=policy, token_budget=32 if policy == "sarathi" else None, dtype="float32",
                max_model_len=96, kv_cache_tokens=40 * 16, max_batch_size=8, progress=False,
                async_scheduling=async_scheduling, **extra)


def run(model: Path, policy: str, async_scheduling: str, params: list[SamplingParams], **extra: Any
        ) -> tuple[list[Any], int]:
    """The outputs of `prompts()` under `params` (one each), and how many decode inputs were carried
    on the device; every KV block is free again afterwards."""
    with LLM(str(model), **engine_kwargs(policy, async_scheduling, **extra)) as llm:
        outputs = llm.generate(prompts(), params)
        engine = llm.engine
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks, "KV blocks leaked"
        assert (not engine.scheduler.seqs and not engine._in_flight) or all(
            not b.chunks for b in engine._in_flight)
        return outputs, engine.carried_tokens


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.token_ids for o in outputs]


GREEDY = [SamplingParams(max_tokens=10 + i, temperature=0.0, ignore_eos=True) for i in range(len(PROMPT_LENS))]


@pytest.mark.parametrize("policy", POLICIES)
def test_scheduling_ahead_gives_the_same_greedy_tokens(tiny_model_dir: Path, policy: str) -> None:
    want, carried_off = run(tiny_model_dir, policy, "off", GREEDY)
    got, carried = run(tiny_model_dir, policy, "on", GREEDY)
    assert tokens(got) == tokens(want)
    assert carried_off == 0
    assert carried >= sum(p.max_tokens - 2 for p in GREEDY) // 2, "few decodes were scheduled ahead"


def test_scheduling_ahead_through_the_graph_buckets(tiny_model_dir: Path) -> None:
    """The carried tokens reach the graph runner's static buffers (padded decode buckets)."""
    want, _ = run(tiny_model_dir, "sarathi", "off", GREEDY, cuda_graphs="on")
    got, carried = run(tiny_model_dir, "sarathi", "on", GREEDY, cuda_graphs="on")
    assert tokens(got) == tokens(want) and carried > 0


def test_sampling_penalties_stops_and_logprobs_are_unchanged(tiny_model_dir: Path) -> None:
    """Seeded sampling draws by (seed, token index), which a carried decode keeps; penalties and a
    min_tokens ban read output tokens on the host, so those requests wait for each token; a stop
    token ends a request whose next decode is already in flight (that row is dropped)."""
    want_greedy, _ = run(tiny_model_dir, "sarathi", "off", GREEDY)
    stop = want_greedy[1].token_ids[4]  # request 1 stops at its 5th token
    params = [
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, seed=5),
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop], ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=1.3, logit_bias=((7, 2.0),),
                       ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.7, top_k=20, seed=9, logprobs=3),
        SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=0.5, presence_penalty=0.2,
                       ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, min_tokens=6, logprobs=2),
        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
    ]
    want, _ = run(tiny_model_dir, "sarathi", "off", params)
    got, carried = run(tiny_model_dir, "sarathi", "on", params)
    assert tokens(got) == tokens(want)
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert got[1].finish_reason is FinishReason.STOP and len(got[1].token_ids) <= 5
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    assert carried > 0


def test_the_model_length_limit_holds(tiny_model_dir: Path) -> None:
    """A request that reaches max_model_len stops there, with no decode scheduled past it."""
    params = [SamplingParams(max_tokens=96 - n, temperature=0.0, ignore_eos=True) for n in PROMPT_LENS]
    want, _ = run(tiny_model_dir, "sarathi", "off", params)
    got, _ = run(tiny_model_dir, "sarathi", "on", params)
    assert tokens(got) == tokens(want)
    assert all(len(p) + len(o.token_ids) == 96 for p, o in zip(prompts(), got, strict=True))
    assert all(o.finish_reason is FinishReason.LENGTH for o in got)


def test_an_abort_while_a_batch_built_ahead_holds_the_request_frees_everything(tiny_model_dir: Path) -> None:
    """Between steps, scheduling ahead, every running request is in the batch already built for the
    next step, its token pending. Aborting one then: its row is dropped, the others' tokens are those
    of the engine without scheduling ahead, no block leaks."""
    results = {}
    for mode in ("off", "on"):
        engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=96,
                                     kv_cache_tokens=40 * 16, max_batch_size=8, token_budget=32,
                                     async_scheduling=mode), progress=False)
        greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        ids = [engine.add_request(p, greedy) for p in prompts()]
        got: dict[str, list[int]] = {i: [] for i in ids}
        for step in range(60):
            if step == 6:
                victim = engine._by_request[ids[2]]
                held = 1 if mode == "on" else 0
                assert (victim.in_flight, victim.num_pending) == (held, held) and victim.is_decode
                engine.finish_requests([ids[2]], FinishReason.ABORT)
            for out in engine.step().outputs:
                got[out.request_id].extend(out.new_token_ids)
            if not engine.has_unfinished:
                break
        while engine._in_flight:  # the batch built ahead of the last one
            engine.step()
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        results[mode] = [got[i] for i in ids]
        engine.shutdown()
    on, off = results["on"], results["off"]
    assert on[:2] + on[3:] == off[:2] + off[3:]
    assert len(on[2]) < 12 and on[2] == off[2][: len(on[2])]  # aborted part-way, its tokens all greedy


def test_on_needs_a_single_rank() -> None:
    with pytest.raises(ConfigError, match=r"async_scheduling.*single rank"):
        schedules_ahead(EngineConfig(model="m", pipeline_stages=2, async_scheduling="on"), torch.device("cpu"))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert schedules_ahead(EngineConfig(model="m"), cuda) and not schedules_ahead(EngineConfig(model="m"), cpu)
    assert not schedules_ahead(EngineConfig(model="m", tensor_parallel_size=2), cuda)
    assert schedules_ahead(EngineConfig(model="m", async_scheduling="on"), cpu)
    assert not schedules_ahead(EngineConfig(model="m", async_scheduling="off"), cuda)
    with pytest.raises(ConfigError, match="async_scheduling"):
        EngineConfig(model="m", async_scheduling="sometimes")


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", ["on", "off"])
def test_on_cuda_the_carried_tokens_give_the_same_greedy_tokens(triton_backend: None, tiny_model_dir: Path,
                                                                cuda_graphs: str) -> None:
    """On a GPU the carried tokens are read by the device from the batch before (captured graphs or
    eager), and the sampled tokens come back through the prefetched pinned copies."""
    want, _ = run(tiny_model_dir, "sarathi", "off", GREEDY, device="cuda", cuda_graphs=cuda_graphs)
    got, carried = run(tiny_model_dir, "sarathi", "auto", GREEDY, device="cuda", cuda_graphs=cuda_graphs)
    assert tokens(got) == tokens(want)
    assert carried >= sum(p.max_tokens - 2 for p in GREEDY) // 2
