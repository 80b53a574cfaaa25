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
