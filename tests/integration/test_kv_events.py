"""KV events from real stage-0 workers into a real router's prefix index (the harness of
`test_router.py`): the index learns a request's blocks from the worker's event stream, forgets a
prefix the worker evicted, is dropped and rebuilt when the worker restarts, and a subscriber that
comes back with a sequence number the worker's log no longer reaches gets a snapshot. One more test
runs the engine loop in its own process (`EngineCoreClient`), whose step messages carry the events.

Requests go to the worker directly, not through the router: the router also records its own routing
decisions in the index, and these tests are about what the events alone tell it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from chariot.contracts.prefix_hash import block_hashes
from chariot.contracts.proto_codec import request_to_proto
from chariot.proto.chariot.v1 import generation_pb2 as pb
from chariot.router import app as router_app
from chariot.router.dataplane import DataPlane
from chariot.worker import SamplingParams
from chariot.worker import kv_events as worker_kv_events
from chariot.worker.config import EngineConfig
from chariot.worker.engine import Engine
from chariot.worker.engine_core import EngineCoreClient
from chariot.worker.kv_events import KVEventBatch, KVSnapshot
from chariot.worker.server import serve
from tests.integration.test_router import (
    ENGINE_KW,
    MAX_MODEL_LEN,
    SERVED,
    TIMEOUT,
    PacedEngine,
    Router,
    Worker,
    wait_for,
)

BS = ENGINE_KW["block_size"]  # the test workers' block size
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TINY_KV_TOKENS = MAX_MODEL_LEN  # the smallest cache the engine accepts: a few prompts evict the oldest


class TinyCacheEngine(PacedEngine):
    def __init__(self, config: EngineConfig, **kw: Any) -> None:
        super().__init__(dataclasses.replace(config, kv_cache_tokens=TINY_KV_TOKENS), **kw)


class PortWorker(Worker):
    """A worker on a chosen port, so that a restarted one is the same replica to the router."""

    def __init__(self, model_dir: Path, name: str, port: int, engine: type[PacedEngine] = PacedEngine) -> None:
        self._want_port = port
        super().__init__(model_dir, name, engine=engine)

    async def _serve(self, stop: Any, ready: Callable[[], None]) -> int:
        def on_port(port: int) -> None:
            self.port = port
            ready()

        return await serve(self._factory, "127.0.0.1", self._want_port, SERVED, ready=on_port, stop=stop,
                           grace_s=1.0, engine_core="thread")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def dataplanes(monkeypatch: pytest.MonkeyPatch) -> list[DataPlane]:
    """Every DataPlane a router started in this test builds (the routers run in this process)."""
    made: list[DataPlane] = []

    class Recording(DataPlane):
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            made.append(self)

    monkeypatch.setattr(router_app, "DataPlane", Recording)
    return made


def prompt_of(seed: int, length: int = 40) -> list[int]:
    return [1 + (seed * 131 + 7 * i) % 500 for i in range(length)]


def generate(worker: Worker, prompt: list[int]) -> list[int]:
    responses = list(worker.stub.Generate(request_to_proto(prompt, PARAMS, model=SERVED), timeout=TIMEOUT))
    return [t for r in responses for t in r.token_ids]


def index_hashes(dp: DataPlane, name: str) -> set[bytes]:
    """The router's hashes for a replica (read from this thread while the router's loop may write)."""
    for _ in range(50):
        try:
            return set(dp.prefix_index.lru_order(name))
        except RuntimeError:  # changed during iteration
            continue
    raise AssertionError("the index never held still")


def worker_snapshot(worker: Worker, last: int = 0, boot: str = "") -> Any:
    """The first message of a fresh KvEvents subscription to the worker."""
    call = worker.stub.KvEvents(pb.KvEventsRequest(last_sequence=last, boot_id=boot), timeout=TIMEOUT)
    try:
        return next(iter(call))
    finally:
        call.cancel()


def computed_blocks(prompt: list[int], completion: list[int]) -> list[bytes]:
    """The blocks the worker registers for a finished request: every token but the last sampled one."""
    return block_hashes((prompt + completion)[:len(prompt) + len(completion) - 1], BS)


@pytest.fixture
def one(tiny_model_dir: Path, dataplanes: list[DataPlane]) -> Iterator[tuple[Worker, Router, DataPlane]]:
    worker = Worker(tiny_model_dir, "k0")
    router = Router([worker.flag], model_dir=tiny_model_dir)
    router.wait_ready(1)
    dp = dataplanes[-1]
    wait_for(lambda: dp.kv_events.connected("k0"), what="KV event stream")
    yield worker, router, dp
    router.stop()
    worker.stop()


def test_a_finished_requests_blocks_reach_the_routers_index(one: tuple[Worker, Router, DataPlane]) -> None:
    worker, _, dp = one
    prompt = prompt_of(1)
    completion = generate(worker, prompt)
    expected = computed_blocks(prompt, completion)
    assert len(expected) >= len(prompt) // BS >= 2
    wait_for(lambda: set(expected) <= index_hashes(dp, "k0"), what="the prompt's blocks in the index")
    assert dp.prefix_index.cached_tokens(dp.prefix_index.hash_prompt([*prompt, *completion, 3]))["k0"] \
        == len(expected) * BS
    snap = worker_snapshot(worker)
    assert snap.snapshot and snap.block_size == BS and set(snap.stored) == index_hashes(dp, "k0")
    assert dp.kv_events.sequences["k0"] == snap.sequence and dp.kv_events.boot_ids["k0"] == snap.boot_id


def test_an_evicted_prefix_leaves_the_index(tiny_model_dir: Path, dataplanes: list[DataPlane]) -> None:
    worker = Worker(tiny_model_dir, "e0", engine=TinyCacheEngine)
    router = Router([worker.flag], model_dir=tiny_model_dir)
    try:
        router.wait_ready(1)
        dp = dataplanes[-1]
        wait_for(lambda: dp.kv_events.connected("e0"), what="KV event stream")
        first = prompt_of(2)
        first_blocks = computed_blocks(first, generate(worker, first))
        wait_for(lambda: set(first_blocks) <= index_hashes(dp, "e0"), what="the first prompt indexed")
        for seed in range(3, 9):  # each takes most of the cache: the first prompt's blocks are evicted
            generate(worker, prompt_of(seed, length=MAX_MODEL_LEN - 2 * BS))
        wait_for(lambda: not set(first_blocks) & index_hashes(dp, "e0"), what="the evicted prefix gone")
        worker.wait_idle()
        snap = worker_snapshot(worker)
        wait_for(lambda: dp.kv_events.sequences.get("e0") == snap.sequence, what="the router caught up")
        assert index_hashes(dp, "e0") == set(snap.stored) and snap.stored
        assert dp.prefix_index.cached_tokens(dp.prefix_index.hash_prompt([*first, 1]))["e0"] == 0
    finally:
        router.stop()
        worker.stop()


def test_a_restarted_workers_index_is_dropped_and_rebuilt(tiny_model_dir: Path,
                                                          dataplanes: list[DataPlane]) -> None:
    port = free_port()
    worker = PortWorker(tiny_model_dir, "r0", port)
    router = Router([worker.flag], model_dir=tiny_model_dir)
    try:
        router.wait_ready(1)
        dp = dataplanes[-1]
        wait_for(lambda: dp.kv_events.connected("r0"), what="KV event stream")
        old_boot = dp.kv_events.boot_ids["r0"]
        before = computed_blocks(prompt_of(10), generate(worker, prompt_of(10)))
        wait_for(lambda: set(before) <= index_hashes(dp, "r0"), what="the blocks indexed")
        worker.stop()
        wait_for(lambda: dp.prefix_index.num_blocks("r0") == 0 and not dp.kv_events.connected("r0"),
                 what="the index dropped when the stream broke")
        worker = PortWorker(tiny_model_dir, "r0", port)
        wait_for(lambda: dp.kv_events.connected("r0") and dp.kv_events.boot_ids["r0"] != old_boot,
                 what="the new boot's stream")
        assert index_hashes(dp, "r0") == set()  # the new worker holds nothing
        after = computed_blocks(prompt_of(11), generate(worker, prompt_of(11)))
        wait_for(lambda: set(after) <= index_hashes(dp, "r0"), what="the new blocks indexed")
        assert not set(before) & index_hashes(dp, "r0")
    finally:
        router.stop()
        worker.stop()


def test_a_stale_sequence_number_gets_a_snapshot(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_kv_events, "DEFAULT_LOG_BATCHES", 2)  # the worker keeps 2 batches
    worker = Worker(tiny_model_dir, "s0")
    try:
        wait_for(lambda: _answers(worker), what="the worker's KV events")
        start = worker_snapshot(worker)
        assert start.snapshot and start.block_size == BS
        for seed in range(20, 24):
            generate(worker, prompt_of(seed))
        now = worker_snapshot(worker)
        assert now.boot_id == start.boot_id and now.sequence >= start.sequence + 3
        resumed = worker_snapshot(worker, now.sequence - 1, now.boot_id)  # within the log: the batch
        assert not resumed.snapshot and resumed.sequence == now.sequence
        stale = worker_snapshot(worker, start.sequence + 1, now.boot_id)  # past the log: a snapshot
        assert stale.snapshot and stale.sequence == now.sequence and set(stale.stored) == set(now.stored)
        other = worker_snapshot(worker, now.sequence - 1, "another-boot")
        assert other.snapshot and other.sequence == now.sequence
    finally:
        worker.stop()


def _answers(worker: Worker) -> bool:
    try:
        worker_snapshot(worker)
    except grpc.RpcError:
        return False
    return True


def test_the_engine_core_process_carries_its_events_to_the_front(tiny_model_dir: Path) -> None:
    """With the engine loop in a child process, the step messages carry the events and the serving
    process's log numbers them: what a snapshot holds is what the child's block manager registered."""
    async def run() -> None:
        config = EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_tokens=2048,
                              max_model_len=MAX_MODEL_LEN, block_size=BS)
        client = EngineCoreClient(functools.partial(Engine, config))
        client.start()
        try:
            await asyncio.wait_for(client.wait_ready(), TIMEOUT)
            events = client.kv_events
            assert events is not None and events.block_size == BS and events.sequence == 0
            sub = events.subscribe(0, "")
            assert await sub.__anext__() == KVSnapshot(0, ())
            prompt = prompt_of(30)
            completion = [t for out in [o async for o in client.generate(prompt, PARAMS)] for t in out.new_token_ids]
            expected = computed_blocks(prompt, completion)
            got: list[bytes] = []
            while not set(expected) <= set(got):
                batch = await asyncio.wait_for(sub.__anext__(), TIMEOUT)
                assert isinstance(batch, KVEventBatch) and not batch.removed
                got += batch.stored
            assert got == expected  # each chain's head first
            assert set(events.snapshot().hashes) == set(expected)
            await sub.aclose()
        finally:
            await client.shutdown()

    asyncio.run(run())


class WideBlockEngine(PacedEngine):
    """An engine with twice the default block size."""

    def __init__(self, config: EngineConfig, **kw: Any) -> None:
        super().__init__(dataclasses.replace(config, block_size=2 * BS), **kw)


def test_the_index_follows_the_workers_block_size_and_kv_capacity(tiny_model_dir: Path,
                                                                  dataplanes: list[DataPlane]) -> None:
    worker = Worker(tiny_model_dir, "w0", engine=WideBlockEngine)
    router = Router([worker.flag], model_dir=tiny_model_dir)
    try:
        router.wait_ready(1)
        dp = dataplanes[-1]
        wait_for(lambda: dp.kv_events.connected("w0"), what="KV event stream")
        assert dp.prefix_index.block_size == 2 * BS
        blocks = worker.stub.Stats(pb.StatsRequest(), timeout=TIMEOUT).num_blocks
        wait_for(lambda: dp.prefix_index.capacity_of("w0") == blocks, what="the capacity from the load report")
        prompt = prompt_of(30, length=5 * BS)
        stored = block_hashes((prompt + generate(worker, prompt))[:-1], 2 * BS)
        wait_for(lambda: set(stored) <= index_hashes(dp, "w0"), what="the wide blocks indexed")
        follow_up = dp.prefix_index.hash_prompt([*prompt, 3, 4])
        assert dp.prefix_index.cached_tokens(follow_up)["w0"] == (len(prompt) // (2 * BS)) * 2 * BS
    finally:
        router.stop()
        worker.stop()


def test_workers_that_disagree_on_block_size_leave_one_unindexed(tiny_model_dir: Path,
                                                                 dataplanes: list[DataPlane]) -> None:
    narrow, wide = Worker(tiny_model_dir, "n0"), Worker(tiny_model_dir, "n1", engine=WideBlockEngine)
    router = Router([narrow.flag, wide.flag], model_dir=tiny_model_dir)
    try:
        router.wait_ready(2)
        dp = dataplanes[-1]
        wait_for(lambda: dp.kv_events.connected("n0") or dp.kv_events.connected("n1"), what="a KV event stream")
        followed = "n0" if dp.kv_events.connected("n0") else "n1"
        other = "n1" if followed == "n0" else "n0"
        assert dp.prefix_index.block_size == (BS if followed == "n0" else 2 * BS)
        generate(narrow if other == "n0" else wide, prompt_of(31, length=4 * BS))
        assert not dp.kv_events.connected(other) and dp.prefix_index.num_blocks(other) == 0
    finally:
        router.stop()
        narrow.stop()
        wide.stop()
