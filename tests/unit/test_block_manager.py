"""Block manager: allocation, growth, watermark, freeing, accounting invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chariot.worker.block_manager import BlockManager


def test_allocate_grow_free():
    bm = BlockManager(num_blocks=10, block_size=4, watermark=0.0)
    bm.allocate(1, 5)
    assert len(bm.block_table(1)) == 2 and bm.num_free_blocks == 8
    bm.grow(1, 8)
    assert len(bm.block_table(1)) == 2
    bm.grow(1, 9)
    assert len(bm.block_table(1)) == 3
    bm.free(1)
    assert bm.num_free_blocks == 10 and not bm.has_blocks(1)
    bm.check_invariants()


def test_freed_blocks_are_reused_before_untouched_ones():
    """Most recently freed first: a cache that never fills keeps to the same blocks (on the CPU, the
    same resident pages) instead of cycling through all of them."""
    bm = BlockManager(num_blocks=100, block_size=4, watermark=0.0)
    bm.allocate(1, 12)
    first = bm.block_table(1)
    assert first == [0, 1, 2]
    bm.allocate(2, 4)
    bm.free(1)
    bm.allocate(3, 12)
    assert bm.block_table(3) == first
    bm.free(3)
    bm.free(2)
    bm.allocate(4, 16)
    assert set(bm.block_table(4)) == {0, 1, 2, 3}
    bm.check_invariants()


def test_watermark_applies_to_admission_only():
    bm = BlockManager(num_blocks=100, block_size=1, watermark=0.1)
    assert bm.can_admit(90) and not bm.can_admit(91)
    bm.allocate(1, 90)
    assert bm.can_grow(1, 100) and not bm.can_grow(1, 101)


def test_out_of_blocks_raises_without_partial_allocation():
    bm = BlockManager(num_blocks=3, block_size=4, watermark=0.0)
    bm.allocate(1, 8)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.grow(1, 20)
    assert len(bm.block_table(1)) == 2 and bm.num_free_blocks == 1


def test_double_allocation_rejected():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate(1, 4)
    with pytest.raises(ValueError):
        bm.allocate(1, 4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "grow", "free"]), st.integers(0, 5), st.integers(1, 30))))
def test_random_operations_keep_accounting(ops):
    bm = BlockManager(num_blocks=20, block_size=4, watermark=0.0)
    for op, sid, n in ops:
        if op == "alloc" and not bm.has_blocks(sid) and bm.can_admit(n):
            bm.allocate(sid, n)
        elif op == "grow" and bm.has_blocks(sid) and bm.can_grow(sid, n):
            bm.grow(sid, n)
        elif op == "free":
            bm.free(sid)
        bm.check_invariants()
        tables = bm.owners()
        assert sum(len(t) for t in tables.values()) + bm.num_free_blocks == 20


# ---- prefix caching ------------------------------------------------------------------------------
def caching(num_blocks: int = 10, block_size: int = 4) -> BlockManager:
    return BlockManager(num_blocks, block_size, watermark=0.0, prefix_caching=True)


def run_prefill(bm: BlockManager, seq_id: int, tokens: list[int]) -> None:
    """Admit `tokens` with whatever prefix is cached and register its blocks as if computed."""
    hit = bm.cached_prefix(tokens)
    bm.allocate(seq_id, len(tokens), hit)
    bm.register_computed(seq_id, lambda a, b: tokens[a:b], len(tokens))


def test_a_second_prompt_shares_the_first_ones_full_blocks():
    bm = caching()
    first = list(range(1, 12))  # 11 tokens: 2 full blocks + 3
    run_prefill(bm, 1, first)
    hit = bm.cached_prefix([*first[:8], 99, 98])
    assert hit.blocks == tuple(bm.block_table(1)[:2]) and hit.num_tokens == 8
    bm.allocate(2, 10, hit)
    assert bm.block_table(2)[:2] == bm.block_table(1)[:2]
    assert bm.block_table(2)[2] not in bm.block_table(1)
    assert bm.num_free_blocks == 10 - 3 - 1  # the shared blocks count once
    bm.check_invariants()
    bm.free(1)
    bm.free(2)
    assert bm.num_free_blocks == 10 and bm.num_cached_blocks == 2
    bm.check_invariants()


def test_hits_follow_the_whole_prefix_not_one_block():
    bm = caching()
    run_prefill(bm, 1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.cached_prefix([0, 0, 0, 0, 5, 6, 7, 8, 9]).num_tokens == 0  # same second block, other first
    assert bm.cached_prefix([1, 2, 3, 4, 5, 6, 7, 0, 9]).num_tokens == 4
    assert bm.cached_prefix([1, 2, 3, 5]).num_tokens == 0


def test_a_hit_leaves_at_least_one_token_to_compute():
    bm = caching()
    tokens = list(range(8))
    run_prefill(bm, 1, [*tokens, 100])
    assert bm.cached_prefix(tokens).num_tokens == 4  # a full hit would leave nothing to sample from
    assert bm.cached_prefix([*tokens, 5]).num_tokens == 8


def test_disabled_caching_never_hits():
    bm = BlockManager(10, 4, watermark=0.0)
    tokens = list(range(9))
    bm.allocate(1, 9)
    bm.register_computed(1, lambda a, b: tokens[a:b], 9)
    bm.free(1)
    assert bm.cached_prefix(tokens).num_tokens == 0 and bm.num_cached_blocks == 0


def test_only_computed_blocks_are_registered():
    bm = caching()
    tokens = list(range(12))
    bm.allocate(1, 12)
    bm.register_computed(1, lambda a, b: tokens[a:b], 5)  # the first chunk of a prefill: 1 full block
    assert bm.cached_prefix(tokens).num_tokens == 4
    bm.register_computed(1, lambda a, b: tokens[a:b], 12)
    assert bm.cached_prefix([*tokens, 1]).num_tokens == 12


def test_fresh_allocations_take_unregistered_blocks_before_evicting_cached_ones():
    bm = caching(num_blocks=4)
    tokens = list(range(9))
    run_prefill(bm, 1, tokens)  # 3 blocks, 2 of them registered
    bm.free(1)
    bm.allocate(2, 8)  # 2 blocks: the unregistered third and the never-used fourth, no eviction
    assert bm.cached_prefix(tokens).num_tokens == 8 and bm.num_cached_blocks == 2
    bm.grow(2, 12)  # one more: evicts a registered block, the sequence's tail before its head
    assert bm.cached_prefix(tokens).num_tokens == 4 and bm.num_cached_blocks == 1
    bm.check_invariants()


def test_admission_counts_revived_cached_blocks_against_the_free_pool():
    bm = caching(num_blocks=3)
    tokens = list(range(9))
    run_prefill(bm, 1, tokens)
    bm.free(1)
    hit = bm.cached_prefix(tokens)
    assert hit.num_tokens == 8 and bm.num_free_blocks == 3
    assert bm.can_admit(9, hit)  # 2 revived + 1 fresh = all 3 blocks
    assert not bm.can_admit(13, hit)
    bm.allocate(2, 9, hit)
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_equal_prompts_in_flight_together_register_one_copy():
    bm = caching()
    tokens = list(range(9))
    for sid in (1, 2):
        bm.allocate(sid, 9)  # both admitted before either was computed: no hit, separate blocks
    for sid in (1, 2):
        bm.register_computed(sid, lambda a, b: tokens[a:b], 9)
    assert bm.num_cached_blocks == 2
    assert bm.cached_prefix(tokens).blocks == tuple(bm.block_table(1)[:2])
    bm.free(1)
    bm.free(2)
    bm.check_invariants()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "grow", "free"]), st.integers(0, 5),
                          st.lists(st.integers(0, 2), min_size=1, max_size=30))))
def test_random_operations_with_prefix_caching_keep_accounting(ops):
    bm = caching(num_blocks=20)
    tokens: dict[int, list[int]] = {}
    for op, sid, toks in ops:
        if op == "admit" and sid not in tokens:
            hit = bm.cached_prefix(toks)
            if bm.can_admit(len(toks), hit):
                bm.allocate(sid, len(toks), hit)
                tokens[sid] = list(toks)
                bm.register_computed(sid, lambda a, b, t=tokens[sid]: t[a:b], len(toks))
        elif op == "grow" and sid in tokens:
            grown = tokens[sid] + toks
            if bm.can_grow(sid, len(grown)):
                bm.grow(sid, len(grown))
                tokens[sid] = grown
                bm.register_computed(sid, lambda a, b, t=grown: t[a:b], len(grown))
        elif op == "free":
            bm.free(sid)
            tokens.pop(sid, None)
        bm.check_invariants()
        where: dict[int, tuple[int, ...]] = {}  # a shared block means the same position and leading tokens
        for sid, toks in tokens.items():
            for i, block in enumerate(bm.block_table(sid)):
                prefix = tuple(toks[:(i + 1) * 4]) if (i + 1) * 4 <= len(toks) else (sid, i)
                assert where.setdefault(block, prefix) == prefix, "a block is shared by different prefixes"
