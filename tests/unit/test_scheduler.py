"""Scheduler policies driven with fake model outputs (no tensors): invariants under random load."""

from __future__ import annotations

import itertools
import random
from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chariot.contracts.sampling_params import SamplingParams
from chariot.worker.block_manager import BlockManager
from chariot.worker.scheduler import POLICY_CLASSES, SchedulerConfig, SchedulerOutput, make_scheduler
from chariot.worker.scheduler.base import chunk_tokens
from chariot.worker.sequence import Sequence, SequenceStatus

BLOCK = 4


class FakeRun:
    """Drives a scheduler like the engine does, sampling token 7 for every sampling chunk."""

    def __init__(self, policy: str, budget: int, max_batch: int, num_blocks: int, in_flight: int = 1,
                 attention_cost: float = 0.0, max_len: int = 64, prefix_caching: bool = False,
                 ahead: bool = False, prefill_order: str = "fcfs") -> None:
        budget = budget if policy == "sarathi" else max(budget, max_len)
        self.blocks = BlockManager(num_blocks, BLOCK, watermark=0.0, prefix_caching=prefix_caching)
        self.config = SchedulerConfig(policy, budget, max_batch, max_len, attention_cost, ahead=ahead,
                                      prefill_order=prefill_order)
        self.sched = make_scheduler(self.config, self.blocks)
        self.in_flight: deque[SchedulerOutput] = deque()
        self.depth = in_flight
        self.finished: list[Sequence] = []
        self.admission_order: list[int] = []
        self.all: list[Sequence] = []

    def add(self, seq_id: int, prompt_len: int, max_tokens: int) -> None:
        seq = Sequence(seq_id, str(seq_id), [1] * prompt_len, SamplingParams(max_tokens=max_tokens))
        self.all.append(seq)
        self.sched.add(seq)

    def step(self) -> SchedulerOutput:
        idle_decodes = {s.seq_id for s in self.sched.running if s.is_decode and self.may_join(s)}
        # Scheduling ahead, an in-flight decode whose token needs a new block may wait a step (never preempted).
        may_wait = {s.seq_id for s in self.sched.running
                    if s.in_flight and not self.blocks.covers(s.seq_id, s.num_tokens)}
        before = {s.seq_id: s.num_computed_tokens for s in self.sched.seqs.values()}
        waiting = {s.seq_id for s in self.sched.waiting}
        out = self.sched.schedule()
        self.check_batch(out, idle_decodes, before, waiting, may_wait)
        if not out.is_empty:
            self.in_flight.append(out)
        if self.in_flight and (len(self.in_flight) >= self.depth or out.is_empty):
            self.complete(self.in_flight.popleft())
        return out

    def may_join(self, seq: Sequence) -> bool:
        """Whether the next batch may take `seq` at all: in no batch, or (ahead) in one and allowed to follow."""
        return not seq.in_flight or (self.config.ahead and seq.in_flight == 1 and self.sched.ahead_ok(seq))

    def complete(self, out: SchedulerOutput) -> None:
        self.sched.complete(out)
        for chunk in out.chunks:
            seq = self.sched.seqs.get(chunk.seq_id)
            if seq is None or not chunk.samples:
                continue
            seq.append_sampled(7)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                self.sched.finish(seq)
                self.finished.append(seq)

    def drain(self) -> None:
        while self.in_flight:
            self.complete(self.in_flight.popleft())

    def check_batch(self, out: SchedulerOutput, idle_decodes: set[int], before: dict[int, int],
                    waiting: set[int], may_wait: set[int] = frozenset()) -> None:
        ids = out.seq_ids
        assert len(ids) == len(set(ids)), "a sequence appears twice in one batch"
        assert out.num_tokens <= self.config.token_budget
        assert out.num_seqs <= self.config.max_batch_size
        holders = [{c.seq_id for c in b.chunks} & set(ids) for b in self.in_flight]
        if self.config.ahead:  # at most one batch in flight besides this one holds a sequence of it
            assert all(sum(sid in h for h in holders) <= 1 for sid in ids), "a sequence is in three batches"
        else:
            assert not set().union(*holders), "a sequence is in two in-flight batches"
        for i, chunk in enumerate(out.chunks):
            assert chunk.num_tokens >= 1
            if chunk.seq_id in waiting or chunk.seq_id in out.preempted:  # admitted now: from its cached prefix
                assert chunk.start % BLOCK == 0 and (chunk.start == 0 or self.blocks.prefix_caching)
            else:
                assert chunk.start == before[chunk.seq_id]
            # a decode preempted and re-admitted in the same batch resumes from its cached blocks as a prefill
            assert (i < out.num_decodes) == (chunk.seq_id in idle_decodes and chunk.seq_id not in out.preempted
                                             and chunk.num_tokens == 1 and chunk.start > 0)
        if self.config.policy == "sarathi":
            missing = idle_decodes - set(ids) - set(out.preempted) - may_wait
            assert not missing, f"stall-free violated: decodes {missing} left out"
        self.check_blocks()

    def check_blocks(self) -> None:
        self.blocks.check_invariants()
        owners = set(self.blocks.owners())
        running = {s.seq_id for s in self.sched.running}
        assert owners == running, "blocks owned by sequences that are not running"
        for seq in self.sched.running:
            covered = len(self.blocks.block_table(seq.seq_id)) * BLOCK
            assert covered >= seq.num_computed_tokens


request = st.tuples(st.integers(0, 6), st.integers(1, 40), st.integers(1, 20))  # (arrival step, prompt, out)


@pytest.mark.parametrize("policy", sorted(POLICY_CLASSES))
@settings(max_examples=90, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request, min_size=1, max_size=12),
    budget=st.sampled_from([8, 16, 32, 64]),
    max_batch=st.integers(1, 8),
    num_blocks=st.integers(16, 60),
    in_flight=st.integers(1, 3),
    abort_seed=st.integers(0, 3),
    prefix_caching=st.booleans(),
    ahead=st.booleans(),
    prefill_order=st.sampled_from(["fcfs", "shortest"]),
)
def test_invariants_under_random_load(policy, reqs, budget, max_batch, num_blocks, in_flight, abort_seed,
                                      prefix_caching, ahead, prefill_order):
    """Every batch within budget and batch size, stall-free for sarathi, no starvation, no request past
    its max_tokens, no block leaked, in either prefill order. Scheduling ahead (`SchedulerConfig.ahead`,
    two batches in flight whose sequences may overlap), a decode scheduled ahead only continues a
    sequence whose pending token its batch in flight samples."""
    depth = 2 if ahead else in_flight
    random_load(FakeRun(policy, budget, max_batch, num_blocks, depth, prefix_caching=prefix_caching, ahead=ahead,
                        prefill_order=prefill_order), reqs, abort_seed)


@pytest.mark.parametrize("policy", sorted(POLICY_CLASSES))
def test_scheduling_ahead_decodes_every_step_and_stops_at_max_tokens(policy: str) -> None:
    """One request scheduled ahead: from its last prompt chunk on, each batch continues it while the
    one before is still in flight (its token pending), and no batch decodes past max_tokens."""
    run = FakeRun(policy, 16, 4, 32, 2, ahead=True)
    run.add(0, 6, 5)
    batches = []
    while run.sched.has_unfinished or run.in_flight:
        held = {c.seq_id for b in run.in_flight for c in b.chunks}
        out = run.step()
        if not out.is_empty:
            batches.append((out, 0 in held))
        assert len(batches) < 20
    assert [b.num_tokens for b, _ in batches] == [6, 1, 1, 1, 1]  # the prompt, then one decode a token
    assert all(ahead for _, ahead in batches[1:]), "a decode waited for the batch before it"
    assert [c.start for b, _ in batches[1:] for c in b.chunks] == [6, 7, 8, 9]
    assert run.finished[0].output_token_ids == [7] * 5 and run.finished[0].num_pending == 0


def random_load(run: FakeRun, reqs: list[tuple[int, int, int]], abort_seed: int) -> None:
    pending = sorted(enumerate(reqs), key=lambda r: r[1][0])
    rng = random.Random(abort_seed)
    aborted: set[int] = set()
    step = 0
    limit = 50 + sum(p + o for _, p, o in reqs) * 4
    while (pending or run.sched.has_unfinished or run.in_flight) and step < limit:
        while pending and pending[0][1][0] <= step:
            seq_id, (_, prompt, out) = pending.pop(0)
            run.add(seq_id, prompt, out)
        if abort_seed == 0 and rng.random() < 0.05 and run.sched.seqs:
            victim = rng.choice(list(run.sched.seqs.values()))
            run.sched.finish(victim)
            aborted.add(victim.seq_id)
        run.step()
        step += 1
    run.drain()
    assert step < limit, "some request starved"
    assert not run.sched.has_unfinished
    assert {s.seq_id for s in run.finished} | aborted == set(range(len(reqs)))
    assert run.blocks.num_free_blocks == run.blocks.num_blocks, "blocks leaked after all requests finished"
    for seq in run.finished:
        assert len(seq.output_token_ids) == seq.params.max_tokens


def first_batches(run: FakeRun, n: int) -> list[SchedulerOutput]:
    return [run.step() for _ in range(n)]


def test_sarathi_chunks_prefill_under_budget_and_keeps_decodes():
    run = FakeRun("sarathi", budget=16, max_batch=8, num_blocks=64)
    run.add(0, 5, 10)
    run.step()  # prefill of seq 0 (5 tokens), samples its first token
    run.add(1, 40, 2)
    sizes = [[(c.seq_id, c.num_tokens) for c in run.step().chunks] for _ in range(3)]
    assert sizes == [[(0, 1), (1, 15)], [(0, 1), (1, 15)], [(0, 1), (1, 10)]]


@given(room=st.integers(1, 4096), start=st.integers(0, 65536), cost=st.floats(0.0, 0.05))
def test_chunk_tokens_never_costs_more_than_a_fresh_chunk(room, start, cost):
    c = chunk_tokens(room, start, cost)
    assert 1 <= c <= room
    if start == 0 or cost == 0.0:
        assert c == room
    elif c > 1:  # the largest size within the fresh chunk's cost (at least 1 token always goes)
        limit = room + cost * room * room
        assert c + cost * c * (start + c) <= limit * (1 + 1e-9)
        assert c == room or (c + 1) + cost * (c + 1) * (start + c + 1) > limit


def test_sarathi_shrinks_late_chunks_of_long_prompts_by_their_attention():
    """The same prompt beside a running decode, chunked by tokens alone vs with attention counted
    (100m's ρ ≈ 1.8e-4)."""
    sizes = {}
    for cost in (0.0, 1.8e-4):
        run = FakeRun("sarathi", budget=512, max_batch=8, num_blocks=1024, attention_cost=cost, max_len=4096)
        run.add(1, 8, 100)
        run.step()  # its prompt: from here on it decodes in every iteration
        run.add(0, 2048, 1)
        sizes[cost] = []
        while sum(sizes[cost]) < 2048:
            out = run.step()
            assert out.num_decodes == 1
            sizes[cost] += [c.num_tokens for c in out.chunks[out.num_decodes:]]
    assert sizes[0.0] == [511, 511, 511, 511, 4]
    shrunk = sizes[1.8e-4]
    assert shrunk[0] == 511 and sum(shrunk) == 2048
    assert all(a > b for a, b in itertools.pairwise(shrunk[:-1]))  # later chunks, fewer tokens


def test_prompt_chunks_alone_take_the_whole_budget_whatever_their_attention():
    """No decode in the iteration, no time between tokens to bound: a long prompt alone goes in full
    budget chunks even with attention counted."""
    run = FakeRun("sarathi", budget=512, max_batch=8, num_blocks=1024, attention_cost=1.8e-4, max_len=4096)
    run.add(0, 2048, 1)
    sizes = []
    while sum(sizes) < 2048:
        out = run.step()
        assert out.num_decodes == 0
        sizes += [c.num_tokens for c in out.chunks]
    assert sizes == [512, 512, 512, 512]


def test_attention_cost_of_a_llama_layer():
    from chariot.worker.config import ModelConfig

    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "num_hidden_layers": 8,
                                 "num_attention_heads": 16, "num_key_value_heads": 4, "intermediate_size": 2816,
                                 "vocab_size": 8192})
    # 4·16·64 FLOPs per (query, key) pair over 2 × (2·1024·1024 + 2·1024·256 + 3·1024·2816) per token
    assert cfg.attention_cost == pytest.approx(4096 / (2 * 11_272_192))


def test_vllm_prefill_iteration_pauses_decodes():
    run = FakeRun("vllm", budget=64, max_batch=8, num_blocks=64)
    run.add(0, 5, 10)
    run.step()
    run.add(1, 30, 2)
    out = run.step()
    assert out.seq_ids == (1,) and out.num_decodes == 0  # decode of seq 0 stalls
    out = run.step()
    assert set(out.seq_ids) == {0, 1} and out.num_decodes == 2


def test_orca_mixes_decodes_with_whole_prompts():
    run = FakeRun("orca", budget=64, max_batch=8, num_blocks=64)
    run.add(0, 5, 10)
    run.step()
    run.add(1, 30, 2)
    out = run.step()
    assert [(c.seq_id, c.num_tokens) for c in out.chunks] == [(0, 1), (1, 30)]


def test_fastertransformer_admits_only_when_batch_done():
    run = FakeRun("fastertransformer", budget=64, max_batch=8, num_blocks=64)
    run.add(0, 5, 3)
    run.step()
    run.add(1, 5, 1)
    seen = [run.step().seq_ids for _ in range(3)]
    assert seen == [(0,), (0,), (1,)]


def test_preempts_newest_and_requeues_it_first():
    run = FakeRun("sarathi", budget=64, max_batch=8, num_blocks=4)  # 16 token slots
    run.add(0, 4, 20)
    run.add(1, 4, 20)
    run.step()  # both prefilled: 1 block each, first tokens sampled
    for _ in range(20):
        out = run.step()
        if out.preempted:
            break
    assert out.preempted == (1,)
    assert run.sched.waiting[0].seq_id == 1 and run.sched.waiting[0].status is SequenceStatus.WAITING
    assert run.sched.waiting[0].num_computed_tokens == 0
    assert 0 in out.seq_ids


def test_reported_cached_prompt_tokens_are_the_first_admissions_hit():
    """`cached_prompt_tokens` is the prompt's hit when first admitted (full blocks, never the last
    prompt token); re-admissions after preemption hit the request's own blocks and add only to
    `num_cached_tokens`."""
    run = FakeRun("sarathi", budget=64, max_batch=8, num_blocks=6, prefix_caching=True)
    run.add(0, 9, 20)
    run.step()
    run.drain()
    run.add(1, 9, 20)  # the same 9-token prompt: its 2 full blocks are cached, the 9th token is not
    run.step()
    seq = run.sched.seqs[1]
    assert (seq.cached_prompt_tokens, seq.num_cached_tokens) == (8, 8)
    for _ in range(60):
        run.step()
        if seq.num_preemptions and seq.status is SequenceStatus.RUNNING:
            break
    assert seq.num_preemptions >= 1 and seq.status is SequenceStatus.RUNNING
    assert seq.num_cached_tokens > 8 and seq.cached_prompt_tokens == 8


def test_fcfs_head_of_line_blocks_later_requests():
    run = FakeRun("sarathi", budget=8, max_batch=8, num_blocks=64)
    for i in range(3):
        run.add(i, 20, 1)
    order = []
    for _ in range(10):
        for c in run.step().chunks:
            if c.start == 0:
                order.append(c.seq_id)
    assert order == [0, 1, 2]


def first_token_steps(run: FakeRun, arrivals: dict[int, list[tuple[int, int]]], steps: int) -> dict[int, int]:
    """Drive `run` for `steps` iterations, adding `arrivals[step]` = [(seq_id, prompt_len)] (one output
    token each) before that step; the step at which each request sampled its first token."""
    first: dict[int, int] = {}
    for step in range(steps):
        for seq_id, prompt_len in arrivals.get(step, []):
            run.add(seq_id, prompt_len, 1)
        for chunk in run.step().chunks:
            if chunk.samples:
                first.setdefault(chunk.seq_id, step)
    return first


@pytest.mark.parametrize("policy", ["sarathi", "orca"])
def test_shortest_order_serves_a_short_prompt_before_an_older_long_one(policy: str) -> None:
    """A 6-token prompt queued just behind a 60-token one: arrival order makes it wait for the long
    prefill's chunks (sarathi, budget 8) or for an iteration of its own (orca, where the two do not fit
    one 64-token iteration); shortest-first serves it at once."""
    arrivals = {0: [(0, 60), (1, 6)]}
    fcfs = first_token_steps(FakeRun(policy, 8, 8, 64), arrivals, 16)
    shortest = first_token_steps(FakeRun(policy, 8, 8, 64, prefill_order="shortest"), arrivals, 16)
    assert shortest[1] == 0 and fcfs[1] > 0
    assert shortest[0] <= fcfs[0] + 1  # the long prompt loses at most the short one's iteration


def test_shortest_order_continues_the_prompt_with_the_fewest_tokens_left() -> None:
    """Prompts of 24, 16 and 4 tokens arriving together, budget 12: the 4-token one first, then the
    16-token one; once started, that one (8 left) goes on before the untouched 24-token one."""
    run = FakeRun("sarathi", 12, 8, 64, prefill_order="shortest")
    for seq_id, prompt_len in enumerate((24, 16, 4)):
        run.add(seq_id, prompt_len, 1)
    batches = [[(c.seq_id, c.num_tokens) for c in run.step().chunks] for _ in range(3)]
    assert batches == [[(2, 4), (1, 8)], [(1, 8), (0, 4)], [(0, 12)]]


def test_shortest_order_ages_a_long_prompt_past_a_stream_of_short_ones() -> None:
    """Without ageing, a 64-token prompt would wait forever behind one new 8-token prompt per
    iteration (budget 8, so each fills an iteration). Aged by a budget per iteration waited, it ranks
    first once it has waited about its own prefill time, and its prefill ends within twice that."""
    budget, long_len, steps = 8, 64, 40
    arrivals = {step: [(step + 1, budget)] for step in range(steps)}
    arrivals[0].insert(0, (0, long_len))
    first = first_token_steps(FakeRun("sarathi", budget, 64, 512, prefill_order="shortest"), arrivals, steps)
    assert 0 in first and first[0] <= 2 * long_len // budget + 1
    assert first[1] == 0  # short prompts still went first while the long one was young


def test_prefill_order_reaches_the_scheduler_through_flags_and_the_llm_keyword(tiny_model_dir):
    """`--prefill-order shortest` survives the config → argv → config round trip of local stages,
    and an unknown order is refused naming the field and the choices."""
    import argparse

    from chariot.contracts.errors import ConfigError
    from chariot.worker.config import EngineConfig
    from chariot.worker.flags import add_engine_flags, config_from_args, config_to_argv

    cfg = EngineConfig(model=str(tiny_model_dir), prefill_order="shortest")
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert config_from_args(p.parse_args(config_to_argv(cfg))) == cfg
    with pytest.raises(ConfigError, match=r"prefill_order.*fcfs, shortest"):
        EngineConfig(model=str(tiny_model_dir), prefill_order="sjf")


def test_attention_aware_chunks_flag_reaches_child_stages(tiny_model_dir):
    """`--no-attention-aware-chunks` survives the config → argv → config round trip of local stages."""
    import argparse

    from chariot.worker.config import EngineConfig
    from chariot.worker.flags import add_engine_flags, config_from_args, config_to_argv

    for aware in (True, False):
        cfg = EngineConfig(model=str(tiny_model_dir), token_budget=64, attention_aware_chunks=aware)
        p = argparse.ArgumentParser()
        add_engine_flags(p)
        assert config_from_args(p.parse_args(config_to_argv(cfg))) == cfg


def test_prefix_cache_hit_skips_the_cached_blocks_and_a_one_token_rest_is_no_decode():
    run = FakeRun("sarathi", budget=64, max_batch=8, num_blocks=64, prefix_caching=True)
    run.add(0, 17, 4)  # 4 full blocks of 1s + 1 token
    run.step()
    run.drain()
    assert run.sched.prefix_hit_tokens == 0
    run.add(1, 17, 4)  # same prompt: 16 cached tokens, 1 left to compute
    run.add(2, 10, 4)  # 2 cached blocks, 2 tokens left
    out = run.step()
    first, second, third = out.chunks
    assert (first.seq_id, first.num_tokens) == (0, 1) and out.num_decodes == 1  # the real decode only
    assert (second.seq_id, second.start, second.num_tokens, second.samples) == (1, 16, 1, True)
    assert (third.seq_id, third.start, third.num_tokens) == (2, 8, 2)
    assert run.sched.prefix_query_tokens == 17 + 17 + 10 and run.sched.prefix_hit_tokens == 24
    assert run.sched.seqs[1].num_cached_tokens == 16 and run.sched.seqs[1].cached_prompt_tokens == 16
    assert run.sched.seqs[2].cached_prompt_tokens == 8
    shared = run.blocks.block_table(0)[:4]
    assert run.blocks.block_table(1)[:4] == shared and run.blocks.block_table(2)[:2] == shared[:2]
    run.drain()
    while run.sched.has_unfinished:
        run.step()
        run.drain()
    assert run.blocks.num_free_blocks == run.blocks.num_blocks
    run.blocks.check_invariants()
