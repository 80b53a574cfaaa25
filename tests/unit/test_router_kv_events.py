"""The router's KV event subscriber applying stream messages to its `PrefixIndex` (no network: the
messages are built here; `tests/integration/test_kv_events.py` runs it against real workers)."""

from __future__ import annotations

from collections.abc import Sequence

from chariot.proto.chariot.v1 import generation_pb2 as pb
from chariot.router.kv_events import KVEventSubscriber
from chariot.router.prefix_index import PrefixIndex
from chariot.router.registry import ReplicaRegistry, ReplicaSpec
from chariot.router.upstream import ReplicaChannels

BS = 16


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def subscriber() -> KVEventSubscriber:
    registry = ReplicaRegistry([ReplicaSpec("a", "127.0.0.1:1"), ReplicaSpec("b", "127.0.0.1:2")])
    return KVEventSubscriber(registry, ReplicaChannels(registry), PrefixIndex(BS))


def msg(seq: int, stored: Sequence[int] = (), removed: Sequence[int] = (), snapshot: bool = False,
        boot: str = "b1", block_size: int = BS) -> pb.KvEventsResponse:
    return pb.KvEventsResponse(boot_id=boot, block_size=block_size, snapshot=snapshot, sequence=seq,
                               stored=[h(i) for i in stored], removed=[h(i) for i in removed])


def test_a_snapshot_replaces_and_batches_add_and_remove():
    sub = subscriber()
    sub.index.add_blocks("a", [h(99)])  # e.g. a routing decision's guess
    assert sub._apply("a", msg(5, [1, 2], snapshot=True))
    assert set(sub.index.lru_order("a")) == {h(1), h(2)} and sub.sequences["a"] == 5
    assert sub._apply("a", msg(6, [3], [1]))
    assert set(sub.index.lru_order("a")) == {h(2), h(3)} and sub.connected("a")


def test_a_batch_that_does_not_follow_asks_for_a_new_subscription():
    sub = subscriber()
    assert not sub._apply("a", msg(1, [1]))  # a batch before any snapshot
    assert sub._apply("a", msg(1, [1], snapshot=True))
    assert not sub._apply("a", msg(3, [2]))  # 2 is missing
    assert sub.index.holds("a", h(1)) and not sub.index.holds("a", h(2))


def test_a_new_boot_drops_the_replica_first():
    sub = subscriber()
    assert sub._apply("a", msg(4, [1, 2], snapshot=True, boot="b1"))
    assert sub._apply("a", msg(1, [7], snapshot=True, boot="b2"))
    assert sub.index.lru_order("a") == [h(7)] and sub.boot_ids["a"] == "b2" and sub.resets["a"] == 2


def test_the_first_replica_followed_sets_the_block_size():
    sub = subscriber()
    sub.index.add_blocks("b", [h(99)])  # a routing decision's guess, hashed at the old size
    assert sub._apply("a", msg(1, [1], snapshot=True, block_size=BS * 2))
    assert sub.index.block_size == BS * 2 and sub.index.lru_order("a") == [h(1)]
    assert sub.index.num_blocks("b") == 0  # hashes of the old size name nothing now


def test_a_replica_with_another_block_size_than_those_followed_is_not_indexed():
    sub = subscriber()
    assert sub._apply("a", msg(1, [1], snapshot=True))
    assert not sub._apply("b", msg(1, [2], snapshot=True, block_size=BS * 2))
    assert sub.index.block_size == BS and sub.index.num_blocks("b") == 0 and not sub.connected("b")
    assert sub.index.lru_order("a") == [h(1)]
