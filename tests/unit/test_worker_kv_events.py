"""KV events on the worker: the block manager's stored/removed hashes, and the numbered `KVEventLog`
(catching up from the log versus a snapshot, its bound, subscriptions)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chariot.worker.block_manager import BlockManager
from chariot.worker.kv_events import KVEventBatch, KVEventLog, KVSnapshot
from tests.unit.test_block_manager import caching, run_prefill


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


# ---- the block manager's events ------------------------------------------------------------------
def test_registrations_are_stored_events_in_chain_order_and_evictions_removed_ones():
    bm = caching(num_blocks=4)
    tokens = list(range(9))
    run_prefill(bm, 1, tokens)
    stored, removed = bm.drain_events()
    assert list(stored) == bm.cached_hashes() and len(stored) == 2 and removed == ()
    assert bm.drain_events() == ((), ())  # drained
    bm.free(1)
    assert bm.drain_events() == ((), ())  # freed blocks stay cached: no event
    bm.allocate(2, 12)  # 3 blocks: the 2 unregistered ones, then the tail of the cached chain
    stored2, removed2 = bm.drain_events()
    assert stored2 == () and removed2 == (stored[1],)


def test_a_hash_stored_and_evicted_before_a_drain_is_only_removed():
    bm = caching(num_blocks=2, block_size=4)
    run_prefill(bm, 1, list(range(5)))  # block 0 registered
    bm.free(1)
    bm.allocate(2, 8)  # takes both blocks: evicts it
    stored, removed = bm.drain_events()
    assert stored == () and len(removed) == 1


def test_no_events_without_prefix_caching():
    bm = BlockManager(4, 4, watermark=0.0)
    bm.allocate(1, 9)
    bm.register_computed(1, lambda a, b: list(range(a, b)), 9)
    assert bm.drain_events() == ((), ())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "free"]), st.integers(0, 4),
                          st.lists(st.integers(0, 2), min_size=1, max_size=24))))
def test_events_replayed_into_a_log_add_up_to_the_registry(ops):
    bm = caching(num_blocks=12)
    log = KVEventLog(bm.block_size, max_batches=3)
    live: set[int] = set()
    for op, sid, toks in ops:
        if op == "admit" and sid not in live and bm.can_admit(len(toks), bm.cached_prefix(toks)):
            run_prefill(bm, sid, toks)
            live.add(sid)
        elif op == "free":
            bm.free(sid)
            live.discard(sid)
        log.append(*bm.drain_events())
        assert set(log.snapshot().hashes) == set(bm.cached_hashes())


# ---- the log ---------------------------------------------------------------------------------------
def test_sequence_numbers_count_non_empty_batches_only():
    log = KVEventLog(16)
    assert log.append((), ()) is None and log.sequence == 0
    assert log.append([h(1), h(2)], []) == KVEventBatch(1, (h(1), h(2)), ())
    assert log.append([], [h(1)]) == KVEventBatch(2, (), (h(1),))
    assert log.snapshot() == KVSnapshot(2, (h(2),))


def test_a_gap_within_the_log_is_served_and_one_past_it_is_not():
    log = KVEventLog(16, max_batches=3)
    for i in range(1, 6):
        log.append([h(i)], [])
    assert log.num_batches() == 3  # bounded: batches 3, 4, 5
    assert [b.sequence for b in log.since(2) or []] == [3, 4, 5]
    assert [b.sequence for b in log.since(4) or []] == [5]
    assert log.since(5) == []
    assert log.since(1) is None and log.since(0) is None  # older than the log reaches: snapshot
    assert log.snapshot() == KVSnapshot(5, tuple(h(i) for i in range(1, 6)))


def test_max_batches_must_be_positive():
    with pytest.raises(ValueError):
        KVEventLog(16, max_batches=0)


async def take(log: KVEventLog, n: int, last: int = 0, boot: str = "") -> list[KVSnapshot | KVEventBatch]:
    out: list[KVSnapshot | KVEventBatch] = []
    async for item in log.subscribe(last, boot):
        out.append(item)
        if len(out) == n:
            break
    return out


def test_a_subscriber_resuming_within_the_log_gets_the_missed_batches_then_new_ones():
    async def main() -> None:
        log = KVEventLog(16, max_batches=8)
        for i in range(1, 4):
            log.append([h(i)], [])
        task = asyncio.ensure_future(take(log, 3, last=1, boot=log.boot_id))
        await asyncio.sleep(0.01)
        log.append([], [h(1)])
        got = await asyncio.wait_for(task, 5)
        assert got == [KVEventBatch(2, (h(2),), ()), KVEventBatch(3, (h(3),), ()), KVEventBatch(4, (), (h(1),))]

    asyncio.run(main())


@pytest.mark.parametrize("last, boot", [(0, "own"), (1, "other"), (1, ""), (9, "own")],
                         ids=["nothing-applied", "another-boot", "no-boot", "ahead"])
def test_a_subscriber_that_cannot_resume_gets_a_snapshot(last: int, boot: str):
    async def main() -> None:
        log = KVEventLog(16, max_batches=8)
        log.append([h(1), h(2)], [])
        log.append([], [h(1)])
        got = await asyncio.wait_for(take(log, 1, last, log.boot_id if boot == "own" else boot), 5)
        assert got == [KVSnapshot(2, (h(2),))]

    asyncio.run(main())


def test_a_stale_sequence_past_the_bound_gets_a_snapshot():
    async def main() -> None:
        log = KVEventLog(16, max_batches=2)
        for i in range(1, 6):
            log.append([h(i)], [])
        got = await asyncio.wait_for(take(log, 1, last=1, boot=log.boot_id), 5)
        assert got == [KVSnapshot(5, tuple(h(i) for i in range(1, 6)))]

    asyncio.run(main())


def test_a_subscriber_that_falls_behind_the_bound_is_sent_a_snapshot():
    async def main() -> None:
        log = KVEventLog(16, max_batches=2)
        sub = log.subscribe(0, "")
        first = await sub.__anext__()
        assert first == KVSnapshot(0, ())
        for i in range(1, 6):  # the subscriber is not reading meanwhile
            log.append([h(i)], [])
        assert await asyncio.wait_for(sub.__anext__(), 5) == KVSnapshot(5, tuple(h(i) for i in range(1, 6)))
        log.append([], [h(5)])
        assert await asyncio.wait_for(sub.__anext__(), 5) == KVEventBatch(6, (), (h(5),))
        await sub.aclose()

    asyncio.run(main())


def test_close_ends_subscriptions_and_appends_from_another_thread_wake_them():
    async def main() -> None:
        log = KVEventLog(16)
        got: list[KVSnapshot | KVEventBatch] = []

        async def consume() -> None:
            async for item in log.subscribe(0, ""):
                got.append(item)

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.01)
        await asyncio.to_thread(log.append, [h(1)], [])
        for _ in range(100):
            if len(got) == 2:
                break
            await asyncio.sleep(0.01)
        log.close()
        await asyncio.wait_for(task, 5)
        assert got == [KVSnapshot(0, ()), KVEventBatch(1, (h(1),), ())]

    asyncio.run(main())
