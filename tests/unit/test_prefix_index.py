"""The prefix hash chain shared by the worker and the router (contracts/prefix_hash.py), and the
router's per-replica prefix index (router/prefix_index.py): the same keys as the block manager, the
longest cached prefix per replica, LRU bounds, dropping a replica, memory under many prefixes."""

from __future__ import annotations

import gc
import random
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chariot.contracts.prefix_hash import ROOT, block_hash, block_hashes, iter_block_hashes, max_cached_blocks
from chariot.router.prefix_index import PrefixIndex
from chariot.worker.block_manager import BlockManager

BS = 4


def chained(tokens: list[int], bs: int) -> list[bytes]:
    """The chain block by block, the way the block manager registers computed blocks."""
    out: list[bytes] = []
    for i in range(len(tokens) // bs):
        out.append(block_hash(out[-1] if out else ROOT, tokens[i * bs:(i + 1) * bs]))
    return out


def prefill(bm: BlockManager, seq_id: int, tokens: list[int]) -> None:
    bm.allocate(seq_id, len(tokens), bm.cached_prefix(tokens))
    bm.register_computed(seq_id, lambda a, b: tokens[a:b], len(tokens))


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(16, 50_000) for _ in range(n)]


# ---- the hash chain ------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**40), max_size=80), st.integers(1, 9), st.none() | st.integers(0, 30))
def test_bulk_hashes_equal_the_block_by_block_chain(tokens, bs, limit):
    expected = chained(tokens, bs)[:limit]
    assert block_hashes(tokens, bs, limit) == expected
    assert list(iter_block_hashes(tokens, bs, limit)) == expected


def test_router_hashes_are_the_block_managers_keys():
    """What the router computes from a prompt's token ids is what the worker registers and hits."""
    rng = random.Random(0)
    bm = BlockManager(num_blocks=64, block_size=16, watermark=0.0, prefix_caching=True)
    index = PrefixIndex(block_size=16)
    prompt = toks(rng, 16 * 5 + 3)
    prefill(bm, 1, prompt)
    hit = bm.cached_prefix([*prompt, 7])
    assert hit.num_tokens == 16 * 5
    assert list(hit.hashes) == list(index.hash_prompt(prompt).hashes) == block_hashes(prompt, 16)


def test_max_cached_blocks_leaves_a_token_to_compute():
    assert [max_cached_blocks(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 0, 0, 1, 1, 2]


def test_different_prefixes_give_different_hashes_for_the_same_block():
    a, b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS), block_hashes([0, 2, 3, 4, 5, 6, 7, 8], BS)
    assert a[1] != b[1] and len(a[0]) == 16


def test_bad_block_size():
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)


# ---- the index: longest cached prefix ------------------------------------------------------------
def stored(index: PrefixIndex, replica: str, tokens: list[int]) -> None:
    """The replica prefilled `tokens`: its "stored" events name every full block."""
    index.add_blocks(replica, index.hash_prompt(tokens).hashes)


def test_shared_system_prompts_and_diverging_turns():
    rng = random.Random(1)
    index = PrefixIndex(block_size=BS)
    system = toks(rng, 10 * BS + 2)  # ends mid-block: the shared part is its 10 full blocks
    turn1 = [*system, *toks(rng, 9)]
    turn2 = [*turn1, *toks(rng, 7), *toks(rng, 6)]  # the answer to turn 1, then the next question
    other = [*system, *toks(rng, 12)]  # another conversation of the same tenant
    stored(index, "a", turn1)
    stored(index, "b", other)

    prompt, cached = index.lookup(turn2)
    assert cached == {"a": len(turn1) // BS * BS, "b": 10 * BS}
    assert prompt.hashes[:len(turn1) // BS] == index.hash_prompt(turn1).hashes
    assert index.cached_tokens(prompt, ["a", "b", "c"]) == {**cached, "c": 0}  # an unknown replica holds nothing

    fresh = [*system[:3 * BS], *toks(rng, 20)]  # shares 3 blocks, then diverges
    assert index.lookup(fresh)[1] == {"a": 3 * BS, "b": 3 * BS}
    stranger = toks(rng, 50)
    assert index.lookup(stranger)[1] == {"a": 0, "b": 0}


def test_a_whole_cached_prompt_still_leaves_a_token_to_compute():
    index = PrefixIndex(block_size=BS)
    tokens = list(range(100, 100 + 3 * BS))
    stored(index, "a", tokens)
    assert index.lookup(tokens)[1] == {"a": 2 * BS}
    assert index.lookup([*tokens, 1])[1] == {"a": 3 * BS}


def test_an_evicted_block_cuts_the_chain_there():
    index = PrefixIndex(block_size=BS)
    tokens = list(range(6 * BS + 1))
    hashes = index.hash_prompt(tokens).hashes
    index.add_blocks("a", hashes)
    index.remove_blocks("a", [hashes[2], b"unknown"])
    assert index.lookup(tokens)[1] == {"a": 2 * BS}  # blocks 3.. are still held but serve nothing
    index.remove_blocks("nobody", hashes)  # events of an unknown replica are harmless
    assert index.replicas() == ["a"]


def test_the_index_agrees_with_the_block_manager():
    """Fed the blocks a worker registered, the index predicts the worker's own hits."""
    rng = random.Random(2)
    bm = BlockManager(num_blocks=4096, block_size=BS, watermark=0.0, prefix_caching=True)
    index = PrefixIndex(block_size=BS)
    prompts: list[list[int]] = [toks(rng, 20)]
    for seq_id in range(60):
        base = rng.choice(prompts)
        prompt = [*base[:rng.randrange(len(base) + 1)], *toks(rng, rng.randrange(1, 15))]
        prefill(bm, seq_id, prompt)
        stored(index, "w", prompt)
        prompts.append(prompt)
    for _ in range(200):
        base = rng.choice(prompts)
        query = [*base[:rng.randrange(len(base) + 1)], *toks(rng, rng.randrange(0, 6))]
        assert index.lookup(query)[1] == {"w": bm.cached_prefix(query).num_tokens}


def test_block_size_mismatch_is_refused():
    prompt = PrefixIndex(block_size=8).hash_prompt(list(range(40)))
    with pytest.raises(ValueError, match="block size"):
        PrefixIndex(block_size=BS).cached_tokens(prompt)


# ---- the index: bounds, eviction, dropping -------------------------------------------------------
def test_lru_eviction_order_tail_before_head():
    index = PrefixIndex(block_size=BS, capacity=5)
    a = index.hash_prompt(list(range(3 * BS))).hashes  # a chain of 3
    b = index.hash_prompt(list(range(1000, 1000 + 3 * BS))).hashes
    index.add_blocks("r", a)
    assert index.lru_order("r") == [a[2], a[1], a[0]]  # within a call the head is most recent
    index.add_blocks("r", b)  # 6 > 5: the least recently used, a's tail, goes
    assert index.lru_order("r") == [a[1], a[0], b[2], b[1], b[0]]
    assert index.num_evicted("r") == 1
    index.add_blocks("r", a[:2])  # a's prefix reused: most recent again
    index.add_blocks("r", [b"x" * 16])  # b's tail, now the least recently used, goes
    assert index.lru_order("r") == [b[1], b[0], a[1], a[0], b"x" * 16]
    assert index.num_blocks("r") == 5
    assert index.lookup(list(range(3 * BS)))[1] == {"r": 2 * BS}
    assert index.lookup([*range(1000, 1000 + 3 * BS), 0])[1] == {"r": 2 * BS}  # b's tail is gone


def test_capacity_per_replica():
    index = PrefixIndex(block_size=BS, capacity=100)
    index.set_capacity("small", 2)
    hashes = index.hash_prompt(list(range(10 * BS))).hashes
    index.add_blocks("small", hashes)
    index.add_blocks("big", hashes)
    assert (index.num_blocks("small"), index.num_blocks("big"), index.num_blocks()) == (2, 10, 12)
    index.set_capacity("big", 4)  # shrinking forgets the least recently used now
    assert index.lru_order("big") == list(reversed(hashes[:4]))
    with pytest.raises(ValueError):
        index.set_capacity("big", 0)


def test_dropping_a_replica_and_resetting_from_a_snapshot():
    index = PrefixIndex(block_size=BS)
    tokens = list(range(5 * BS + 1))
    stored(index, "a", tokens)
    stored(index, "b", tokens)
    index.drop_replica("a")  # its stream reset: a restarted worker holds nothing
    assert index.lookup(tokens)[1] == {"b": 5 * BS}
    assert index.cached_tokens(index.hash_prompt(tokens), ["a", "b"]) == {"a": 0, "b": 5 * BS}
    assert index.num_blocks("a") == 0 and not index.holds("a", index.hash_prompt(tokens).hashes[0])
    index.drop_replica("a")  # twice is harmless
    snapshot = index.hash_prompt(tokens).hashes[:2]
    index.reset_replica("b", snapshot)
    assert index.lookup(tokens)[1] == {"b": 2 * BS} and index.num_blocks("b") == 2


def test_memory_stays_bounded_under_10000_distinct_prefixes():
    capacity, replicas, blocks_per_prompt = 2000, ("a", "b"), 8
    index = PrefixIndex(block_size=16, capacity=capacity)

    def feed(start: int, stop: int) -> None:
        for i in range(start, stop):
            prompt = [i * 7919 + j for j in range(16 * blocks_per_prompt)]  # distinct from the first block
            index.add_blocks(replicas[i % 2], index.hash_prompt(prompt).hashes)

    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        feed(0, 1000)  # 4000 blocks each: both replicas full
        full = tracemalloc.get_traced_memory()[0] - base
        feed(1000, 10_000)
        gc.collect()
        end = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert [index.num_blocks(r) for r in replicas] == [capacity, capacity]
    assert index.num_evicted("a") + index.num_evicted("b") == 10_000 * blocks_per_prompt - 2 * capacity
    per_entry = end / (2 * capacity)
    assert per_entry < 300, f"{per_entry:.0f} bytes per remembered block"  # a 16-byte hash + its LRU links
    assert end < 1.25 * full, f"grew from {full} to {end} bytes after the capacity was reached"


def test_a_new_block_size_forgets_every_hash_and_keeps_capacities():
    index = PrefixIndex(block_size=4, capacity=100)
    index.add_blocks("a", [b"x", b"y"])
    index.set_capacity("a", 10)
    prompt = index.hash_prompt(list(range(20)))
    index.use_block_size(8)
    assert index.block_size == 8 and index.num_blocks("a") == 0 and index.capacity_of("a") == 10
    assert not index.accepts(prompt) and index.accepts(index.hash_prompt(list(range(20))))
    assert index.capacity_of("unseen") == 100
    with pytest.raises(ValueError):
        index.use_block_size(0)
