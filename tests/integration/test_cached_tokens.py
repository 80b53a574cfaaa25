"""Prompt tokens served from a replica's prefix cache, as clients see them: the gRPC response's
`cached_prompt_tokens` and OpenAI's `usage.prompt_tokens_details.cached_tokens`, through a real router
and real stage-0 workers (the harness of `test_router.py`).

A conversation's follow-up turn resends its history: its prompt starts with the earlier turn's prompt
and completion, whose KV the worker computed and registered block by block (every token but the last
sampled one, whose KV is never written). The follow-up reports exactly those full blocks as cached; a
fresh prompt reports 0, and so does every request on a worker with prefix caching off. Each router
has a single replica so that a follow-up lands where its history is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chariot.contracts.proto_codec import request_to_proto
from chariot.proto.chariot.v1 import generation_pb2 as pb
from chariot.worker import SamplingParams
from chariot.worker.config import EngineConfig
from tests.integration.test_router import ENGINE_KW, SERVED, TIMEOUT, PacedEngine, Router, Worker, stream_completion

BS = ENGINE_KW["block_size"]  # the test workers' block size
COMP, CHAT = "/v1/completions", "/v1/chat/completions"
TURN = 24  # completion tokens of a turn (greedy, EOS ignored: always this many)
PARAMS = SamplingParams(max_tokens=TURN, temperature=0.0, ignore_eos=True)
BODY = {"max_tokens": TURN, "temperature": 0, "ignore_eos": True, "return_token_ids": True, "model": SERVED}


class UncachedEngine(PacedEngine):
    """The paced engine with prefix caching off (`--no-prefix-caching`)."""

    def __init__(self, config: EngineConfig, **kw: Any) -> None:
        super().__init__(dataclasses.replace(config, prefix_caching=False), **kw)


@pytest.fixture(scope="module")
def cached(tiny_model_dir: Path) -> Iterator[Router]:
    worker = Worker(tiny_model_dir, "c0")
    router = Router([worker.flag], model_dir=tiny_model_dir)
    router.wait_ready(1)
    yield router
    router.stop()
    worker.stop()


@pytest.fixture(scope="module")
def uncached(tiny_model_dir: Path) -> Iterator[Router]:
    worker = Worker(tiny_model_dir, "u0", engine=UncachedEngine)
    router = Router([worker.flag], model_dir=tiny_model_dir)
    router.wait_ready(1)
    yield router
    router.stop()
    worker.stop()


def fresh_prompt(seed: int, length: int = 40) -> list[int]:
    """Token ids no other test's prompt starts with (a distinct first block per seed)."""
    return [1 + (seed * 131 + 7 * i) % 500 for i in range(length)]


def history_blocks(prompt: list[int], completion: list[int]) -> int:
    """Cached tokens a follow-up of (prompt, completion) finds: the full blocks of every token of the
    earlier turn whose KV was computed (all but the last sampled one)."""
    return (len(prompt) + len(completion) - 1) // BS * BS


def follow_up(prompt: list[int], completion: list[int]) -> list[int]:
    assert len(completion) == TURN
    return prompt + completion + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


def grpc_turn(router: Router, prompt: list[int]) -> tuple[list[int], Any]:
    """(completion token ids, last response) of one request through the router's gRPC front."""
    responses = list(router.stub.Generate(request_to_proto(prompt, PARAMS, model=SERVED), timeout=TIMEOUT))
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert all(r.cached_prompt_tokens == 0 for r in responses[:-1]), "reported once, on the final response"
    return [t for r in responses for t in r.token_ids], responses[-1]


def http_turn(router: Router, payload: dict[str, Any], path: str = COMP, stream: bool = False
              ) -> tuple[list[int], str, dict[str, Any]]:
    """(completion token ids, text, usage) of one OpenAI request, streamed (with the usage chunk) or not."""
    if not stream:
        resp = router.post(path, {**BODY, **payload})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        c = body["choices"][0]
        return c["token_ids"], c["text"] if path == COMP else c["message"]["content"], body["usage"]
    events = stream_completion(router, {**BODY, **payload, "stream_options": {"include_usage": True}}, path)
    *chunks, usage_chunk, done = events
    assert done == "[DONE]" and usage_chunk["choices"] == []
    assert all("usage" not in c for c in chunks)
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    text = "".join(c["choices"][0]["text"] if path == COMP else c["choices"][0]["delta"].get("content", "")
                   for c in chunks)
    return ids, text, usage_chunk["usage"]


def cached_tokens(usage: dict[str, Any]) -> int:
    value: int = usage["prompt_tokens_details"]["cached_tokens"]
    return value


def test_grpc_follow_up_reports_the_earlier_turns_blocks(cached: Router) -> None:
    first = fresh_prompt(1)
    completion, last = grpc_turn(cached, first)
    assert (last.prompt_tokens, last.cached_prompt_tokens) == (len(first), 0)
    second = follow_up(first, completion)
    _, last = grpc_turn(cached, second)
    expected = history_blocks(first, completion)
    assert last.prompt_tokens == len(second) and last.cached_prompt_tokens == expected
    assert expected % BS == 0 and len(first) < expected <= len(second) - 1
    _, again = grpc_turn(cached, second)  # the same prompt again: all its full blocks, never its last token
    assert again.cached_prompt_tokens == (len(second) - 1) // BS * BS


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_http_completion_follow_up_reports_cached_tokens(cached: Router, stream: bool) -> None:
    first = fresh_prompt(2 + stream)
    completion, _, usage = http_turn(cached, {"prompt": first}, stream=stream)
    assert usage["prompt_tokens"] == len(first) and cached_tokens(usage) == 0
    second = follow_up(first, completion)
    _, _, usage = http_turn(cached, {"prompt": second}, stream=stream)
    assert usage["prompt_tokens"] == len(second)
    assert cached_tokens(usage) == history_blocks(first, completion)
    assert usage["total_tokens"] == len(second) + TURN


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_follow_up_reports_cached_tokens(cached: Router, stream: bool) -> None:
    """The follow-up's rendering starts with the first turn's (the chat template appends), so at
    least the first prompt's full blocks are cached; the reply's text may tokenise differently when
    resent, so the exact count is not fixed beyond that."""
    messages = [{"role": "system", "content": f"Conversation {int(stream)}: answer in the style of a sea shanty."},
                {"role": "user", "content": "Tell me a long story about a dragon and a lighthouse keeper."}]
    _, reply, usage = http_turn(cached, {"messages": messages}, CHAT, stream)
    first_len = usage["prompt_tokens"]
    assert first_len >= 2 * BS and cached_tokens(usage) == 0
    history = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "Go on"}]
    _, _, usage = http_turn(cached, {"messages": history}, CHAT, stream)
    got = cached_tokens(usage)
    assert got % BS == 0 and first_len // BS * BS <= got <= usage["prompt_tokens"] - 1


def test_n_choices_report_the_cached_prefix_once(cached: Router) -> None:
    first = fresh_prompt(6)
    completion, _, _ = http_turn(cached, {"prompt": first})
    second = follow_up(first, completion)
    resp = cached.post(COMP, {**BODY, "prompt": second, "n": 2, "temperature": 1.0, "seed": 3})
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert usage["prompt_tokens"] == len(second) and cached_tokens(usage) == history_blocks(first, completion)


def test_without_prefix_caching_nothing_is_cached(uncached: Router) -> None:
    first = fresh_prompt(7)
    completion, last = grpc_turn(uncached, first)
    second = follow_up(first, completion)
    for prompt in (first, second, second):
        _, last = grpc_turn(uncached, prompt)
        assert last.cached_prompt_tokens == 0
        for stream in (False, True):
            _, _, usage = http_turn(uncached, {"prompt": prompt}, stream=stream)
            assert cached_tokens(usage) == 0 and usage["prompt_tokens"] == len(prompt)
