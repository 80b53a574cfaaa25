"""OpenAI `n` (several choices per request) through a real router and real stage-0 workers.

The HTTP front fans an `n` > 1 request out as n independent requests `{id}-{i}` (with a seed, choice
i samples with `seed + i`); these tests check what a client sees — indexes, reproducibility, that
choice i is exactly the `n` = 1 request with seed `seed + i`, interleaved streams, usage totals,
errors — and that no choice is left running or holding KV blocks afterwards (every worker idle,
nothing in flight at the router). The worker and router fixtures and the helpers are those of
`test_router.py` (this module gets its own instances).
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from chariot.contracts.proto_codec import MAX_REQUEST_ID_CHARS
from chariot.router.config import RouterConfig
from tests.integration import test_router as harness
from tests.integration.test_router import (
    MAX_MODEL_LEN,
    REPLICA,
    SERVED,
    TIMEOUT,
    CrashingEngine,
    Router,
    Worker,
    all_idle,
    iterations,
    sse_events,
    stream_completion,
    wait_for,
)

COMP, CHAT = "/v1/completions", "/v1/chat/completions"
SEED = 1234
SAMPLED = {"max_tokens": 16, "temperature": 1.0, "ignore_eos": True, "return_token_ids": True, "model": SERVED}
MESSAGES = [{"role": "user", "content": "Tell me a story"}]
workers, router = harness.workers, harness.router  # the same fixtures, instantiated for this module


def ok(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def by_index(events: list[Any], part: str) -> tuple[dict[int, str], dict[int, list[int]], Counter[int]]:
    """Per choice index: its streamed text (`text` or `delta.content`), token ids and finish reasons."""
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    finishes: Counter[int] = Counter()
    for event in events:
        if event == "[DONE]" or not event.get("choices"):
            continue
        (c,) = event["choices"]
        i = c["index"]
        texts[i] = texts.get(i, "") + (c["text"] if part == "text" else c["delta"]["content"])
        ids.setdefault(i, []).extend(c.get("token_ids", []))
        finishes[i] += c["finish_reason"] is not None
    return texts, ids, finishes


def test_n_seeded_choices_are_reproducible_and_each_is_the_single_request_with_seed_plus_i(
    router: Router, workers: list[Worker]
) -> None:
    payload = {"prompt": "Once upon a time", **SAMPLED, "seed": SEED, "n": 3}
    first, again = ok(router.post(COMP, payload)), ok(router.post(COMP, payload))
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert first["choices"] == again["choices"], "same seed, same choices"
    assert len({tuple(c["token_ids"]) for c in first["choices"]}) >= 2, "seed + i: the choices differ"
    for i, got in enumerate(first["choices"]):
        single = ok(router.post(COMP, {**payload, "n": 1, "seed": SEED + i}))
        assert got == {**single["choices"][0], "index": i}
    assert first["usage"] == {"prompt_tokens": single["usage"]["prompt_tokens"], "completion_tokens": 3 * 16,
                              "total_tokens": single["usage"]["prompt_tokens"] + 3 * 16,
                              "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip  (prompt < 1 block)
    all_idle(workers, router)


def test_n_response_shape_ids_and_headers(router: Router, workers: list[Worker]) -> None:
    resp = router.post(COMP, {"prompt": "hi", **SAMPLED, "n": 2}, headers={"X-Request-Id": "client-id"})
    body = ok(resp)
    assert body["id"] == "cmpl-client-id" and resp.headers["x-request-id"] == "client-id"
    assert set(resp.headers[REPLICA].split(",")) <= {"g0", "g1"}
    assert [c["index"] for c in body["choices"]] == [0, 1]  # unseeded: sampled independently
    chat = ok(router.post(CHAT, {"messages": MESSAGES, **SAMPLED, "seed": SEED, "n": 2}))
    assert chat["object"] == "chat.completion" and [c["index"] for c in chat["choices"]] == [0, 1]
    assert all(c["message"]["role"] == "assistant" for c in chat["choices"])
    echoed = ok(router.post(COMP, {"prompt": "Echo me", **SAMPLED, "seed": SEED, "n": 2, "echo": True}))
    assert all(c["text"].startswith("Echo me") for c in echoed["choices"])
    all_idle(workers, router)


def test_greedy_n_gives_identical_choices(router: Router, workers: list[Worker]) -> None:
    body = ok(router.post(COMP, {"prompt": "The quick brown fox", **SAMPLED, "temperature": 0, "n": 2}))
    assert body["choices"][0] == {**body["choices"][1], "index": 0}
    all_idle(workers, router)


def test_streamed_n_interleaves_choices_that_match_the_non_streamed_ones(
    router: Router, workers: list[Worker]
) -> None:
    payload = {"prompt": "Once upon a time", **SAMPLED, "seed": SEED, "n": 2}
    whole = ok(router.post(COMP, payload))
    events = stream_completion(router, {**payload, "stream_options": {"include_usage": True}})
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    *chunks, usage_chunk, _ = events
    texts, ids, finishes = by_index(chunks, "text")
    assert texts == {i: c["text"] for i, c in enumerate(whole["choices"])}
    assert ids == {i: c["token_ids"] for i, c in enumerate(whole["choices"])}
    assert finishes == {0: 1, 1: 1}, "one finish chunk per choice"
    order = [c["choices"][0]["index"] for c in chunks]
    assert order.index(1) < len(order) - 1 - order[::-1].index(0), f"choices streamed one after the other: {order}"
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "text_completion" for c in chunks)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    all_idle(workers, router)


def test_streamed_chat_n_gives_each_choice_its_role_and_finish(router: Router, workers: list[Worker]) -> None:
    payload = {"messages": MESSAGES, **SAMPLED, "seed": SEED, "n": 2}
    whole = ok(router.post(CHAT, payload))
    events = stream_completion(router, {**payload, "stream_options": {"include_usage": True}}, CHAT)
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    *chunks, usage_chunk, _ = events
    texts, _, finishes = by_index(chunks, "delta")
    assert texts == {i: c["message"]["content"] for i, c in enumerate(whole["choices"])}
    assert finishes == {0: 1, 1: 1}
    for i in (0, 1):
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == i]
        assert deltas[0]["role"] == "assistant" and not any("role" in d for d in deltas[1:])
    assert usage_chunk["usage"] == whole["usage"]
    all_idle(workers, router)


def test_bad_n_and_ids_that_cannot_take_a_suffix_are_400s(router: Router, workers: list[Worker]) -> None:
    for path, base in ((COMP, {"prompt": "hi"}), (CHAT, {"messages": MESSAGES})):
        for n, limit in ((0, "[1, 128]"), (129, "[1, 128]"), ("x", "integer")):
            for stream in (False, True):
                resp = router.post(path, {**base, "n": n, "stream": stream})
                assert resp.status_code == 400, (path, n, resp.text)
                error = resp.json()["error"]
                assert error["param"] == "n" and limit in error["message"], error
    best_of = router.post(COMP, {"prompt": "hi", "n": 2, "best_of": 2})
    assert best_of.status_code == 400 and best_of.json()["error"]["param"] == "best_of"
    seed = router.post(COMP, {"prompt": "hi", "n": 2, "seed": (1 << 63) - 1})
    assert seed.status_code == 400 and seed.json()["error"]["param"] == "seed", seed.text
    longest = "r" * (MAX_REQUEST_ID_CHARS - 2)  # "-1" still fits
    short = {"prompt": "hi", "n": 2, "max_tokens": 2}
    assert router.post(COMP, short, headers={"X-Request-Id": longest}).status_code == 200
    resp = router.post(COMP, short, headers={"X-Request-Id": longest + "r"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "request_id"
    assert str(MAX_REQUEST_ID_CHARS - 2) in resp.json()["error"]["message"]
    all_idle(workers, router)


def test_a_choice_refused_at_admission_fails_the_request_and_frees_the_others(
    workers: list[Worker], tiny_model_dir: Path
) -> None:
    """One replica taking one request at a time: of n = 2 choices one is always shed (429), so the
    whole request is a 429 and the admitted choice is cancelled, whatever it had reached."""
    worker = workers[0]
    r = Router([worker.flag], RouterConfig(ttft_slo_ms=60_000, max_queue_per_replica=1), model_dir=tiny_model_dir)
    try:
        r.wait_ready(1)
        payload = {"prompt": "one at a time", **SAMPLED, "max_tokens": 64}
        for stream in (False, True):
            resp = r.post(COMP, {**payload, "n": 2, "stream": stream})
            assert resp.status_code == 429 and resp.json()["error"]["type"] == "rate_limit_error", resp.text
            assert "retry-after" in resp.headers
            all_idle([worker], r)
        def admitted() -> bool:  # the router sees the cancelled choice leave the queue at the next load report
            nonlocal resp
            resp = r.post(COMP, {**payload, "n": 1})
            return resp.status_code != 429

        wait_for(admitted, what="the replica's queue slot free again at the router")
        assert ok(resp)["usage"]["completion_tokens"] == 64
        all_idle([worker], r)
    finally:
        r.stop()


def test_a_choice_failing_mid_stream_ends_the_stream_with_an_error_event(tiny_model_dir: Path) -> None:
    worker = Worker(tiny_model_dir, "doomed", engine=CrashingEngine)
    r = Router([worker.flag])
    try:
        r.wait_ready(1)
        payload = {"prompt": "crash", "max_tokens": 100, "ignore_eos": True, "n": 2, "stream": True}
        events = stream_completion(r, payload)
        assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["code"] == "unavailable" and "replica doomed failed" in error["message"], error
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2]), "no choice finished"
        worker.stop(expected_exit=1)
        assert r.health()["in_flight"] == 0
    finally:
        r.stop()


def test_disconnect_mid_stream_closes_every_choice(router: Router, workers: list[Worker]) -> None:
    all_idle(workers)
    before = iterations(workers)
    payload = {"prompt": "abandon us", "max_tokens": MAX_MODEL_LEN - 20, "ignore_eos": True, "n": 3, "stream": True}
    seen: set[int] = set()
    with (
        httpx.Client(base_url=router.url, timeout=TIMEOUT) as client,
        client.stream("POST", COMP, json=payload) as resp,
    ):
        events = sse_events(resp)  # held: a generator dropped at `break` is closed, and the connection with it
        for _, event in events:
            seen.add(event["choices"][0]["index"])
            if seen == {0, 1, 2}:
                break
        # the load report can trail the stream by a step: wait for it rather than read it once
        wait_for(lambda: sum(w.stats().num_running for w in workers) == 3, what="three choices running")
    all_idle(workers, router)
    assert iterations(workers) - before < (MAX_MODEL_LEN - 20) // 2, "aborted, not run to completion"


def test_disconnect_while_waiting_for_a_non_streamed_n_response(router: Router, workers: list[Worker]) -> None:
    all_idle(workers)
    before = iterations(workers)
    payload = {"prompt": "never read", "max_tokens": MAX_MODEL_LEN - 20, "ignore_eos": True, "n": 2}
    timeout = httpx.Timeout(TIMEOUT, read=0.3)
    with httpx.Client(base_url=router.url, timeout=timeout) as client, pytest.raises(httpx.ReadTimeout):
        client.post(COMP, json=payload)
    all_idle(workers, router)
    assert iterations(workers) - before < (MAX_MODEL_LEN - 20) // 2, "aborted, not run to completion"


def test_concurrent_n_requests_with_the_same_seed_agree(router: Router, workers: list[Worker]) -> None:
    """Choices of concurrent requests share batches on the replicas; seeded sampling does not care."""
    payload = {"prompt": "Together", **SAMPLED, "seed": SEED, "n": 2}
    results: list[dict[str, Any]] = []

    def one() -> None:
        results.append(ok(router.post(COMP, payload)))

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert len(results) == 3 and all(r["choices"] == results[0]["choices"] for r in results)
    all_idle(workers, router)
