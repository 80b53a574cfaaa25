"""The engine-core process (`worker/engine_core.py`) on its own: a real spawned child running the real
engine on a real tiny checkpoint, driven through `EngineCoreClient`.

Covers what the gRPC server tests do not see directly: token parity with the in-thread engine (both
are `EngineClient`s), the observer receiving every delta with its own token times, aborts (by call and by
leaving a stream) freeing every KV block, duplicate ids refused before anything crosses the pipe,
and a killed child failing every live stream and every later call with `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chariot.contracts.engine_client import EngineClient
from chariot.contracts.errors import EngineDeadError, InvalidRequestError
from chariot.contracts.outputs import RequestOutput
from chariot.worker import SamplingParams
from chariot.worker.async_engine import AsyncEngine
from chariot.worker.config import EngineConfig
from chariot.worker.engine import Engine
from chariot.worker.engine_core import EngineCoreClient
from chariot.worker.engine_output import StepResult

ENGINE_KW: dict[str, Any] = {"dtype": "float32", "kv_cache_tokens": 2048, "max_model_len": 256}
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
PROMPTS = [[1, 5, 9, 13], [2, 4, 6, 8, 10, 12], [7] * 20]
TIMEOUT = 60.0


class SlowEngine(Engine):
    """The real engine at 20 ms a step, so that a stream is still live when the test acts on it."""

    def step(self) -> StepResult:
        result = super().step()
        time.sleep(0.02)
        return result


def _factory(model_dir: Path, engine_cls: type[Engine] = Engine) -> Callable[[], Engine]:
    return functools.partial(engine_cls, EngineConfig(model=str(model_dir), **ENGINE_KW))


async def _collect(front: AsyncEngine | EngineCoreClient, prompt: list[int],
                   params: SamplingParams = GREEDY, request_id: str | None = None) -> list[RequestOutput]:
    return [out async for out in front.generate(prompt, params, request_id)]


async def _started(client: EngineCoreClient) -> EngineCoreClient:
    client.start()
    await asyncio.wait_for(client.wait_ready(), TIMEOUT)
    return client


def test_tokens_match_the_in_thread_engine_and_the_observer_sees_whole_requests(tiny_model_dir: Path) -> None:
    async def run(front: AsyncEngine | EngineCoreClient) -> list[list[RequestOutput]]:
        try:
            if isinstance(front, EngineCoreClient):
                await _started(front)
            else:
                front.start()
                await front.wait_ready()
            return list(await asyncio.gather(*(_collect(front, p) for p in PROMPTS)))
        finally:
            await front.shutdown()

    seen: list[RequestOutput] = []

    def observer(result: StepResult, outputs: Any) -> None:
        assert result.outputs == ()  # the step crossed the pipe without its outputs: they come as deltas
        seen.extend(outputs)

    local = asyncio.run(run(AsyncEngine(_factory(tiny_model_dir))))
    remote = asyncio.run(run(EngineCoreClient(_factory(tiny_model_dir), observer=observer)))

    def tokens(streams: list[list[RequestOutput]]) -> list[list[int]]:
        return [[t for out in stream for t in out.new_token_ids] for stream in streams]

    assert tokens(remote) == tokens(local)
    assert all(len(t) == GREEDY.max_tokens for t in tokens(remote))
    assert [s[0].num_prompt_tokens for s in remote] == [len(p) for p in PROMPTS]
    assert sorted(o.request_id for o in seen if o.finished) == sorted(s[-1].request_id for s in remote)
    for stream in remote:  # every delta carries its own tokens' times, which add up to one per token
        times = [t for out in stream for t in out.times.token_times]
        assert all(len(out.times.token_times) == len(out.new_token_ids) for out in stream)
        assert len(times) == GREEDY.max_tokens and times == sorted(times)
        assert [o for o in seen if o.request_id == stream[0].request_id] == stream  # the observer saw each


def test_both_engine_clients_implement_the_protocol(tiny_model_dir: Path) -> None:
    for client in (AsyncEngine(_factory(tiny_model_dir)), EngineCoreClient(_factory(tiny_model_dir))):
        assert isinstance(client, EngineClient)


def test_aborts_free_every_block_and_duplicate_ids_are_refused(tiny_model_dir: Path) -> None:
    async def run() -> None:
        client = await _started(EngineCoreClient(_factory(tiny_model_dir, SlowEngine)))
        try:
            total = (await client.stats()).num_blocks
            long = SamplingParams(max_tokens=200, temperature=0.0)
            stream = client.generate(PROMPTS[0], long, "by-call")
            await stream.__anext__()
            with pytest.raises(InvalidRequestError) as dup:
                await client.generate(PROMPTS[1], long, "by-call").__anext__()
            assert dup.value.field == "request_id"
            aborted = await client.abort("by-call")
            assert aborted is not None and aborted.finished
            await stream.aclose()

            left = client.generate(PROMPTS[1], long, "left-early")
            await left.__anext__()
            await left.aclose()  # leaving the stream aborts the request in the core

            async def all_free() -> None:
                while (await client.stats()).num_free_blocks != total or (await client.stats()).num_running:
                    await asyncio.sleep(0.02)

            await asyncio.wait_for(all_free(), TIMEOUT)
            assert await _collect(client, PROMPTS[2])  # and the core still serves
        finally:
            await client.shutdown()

    asyncio.run(run())


def test_a_killed_core_fails_live_streams_and_later_calls(tiny_model_dir: Path) -> None:
    async def run() -> None:
        client = await _started(EngineCoreClient(_factory(tiny_model_dir, SlowEngine)))
        try:
            stream = client.generate(PROMPTS[0], SamplingParams(max_tokens=200, temperature=0.0))
            await stream.__anext__()
            assert client.pid is not None
            os.kill(client.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            reason = await asyncio.wait_for(client.wait_failed(), TIMEOUT)
            assert "exited" in reason and client.failed == reason
            with pytest.raises(EngineDeadError):
                await _collect(client, PROMPTS[1])
        finally:
            await client.shutdown()

    asyncio.run(run())
