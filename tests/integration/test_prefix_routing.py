"""Prefix-aware, SLO-aware routing through a real router and two real stage-0 workers (the harness of
`test_router.py`): a conversation's follow-up turns land on the replica holding their history and
report `cached_tokens` covering the earlier turns; a replica whose prediction breaches the SLO is not
chosen for its cache; unknown prefixes spread by load; a session hint is honoured only within the SLO;
with Redis down the router still routes by prefix (decided locally).

A replica is made "loaded" by having its engine report extra queued prefill tokens in its Stats (the
load the router predicts from), so the test controls how far its prediction is from the SLO. The
engines also take `PREFILL_S_PER_TOKEN` more per prompt token they compute, within the step the
engine times, so the prefill rate each worker measures and reports (the router's TTFT prediction)
has it: the tiny model prefills at 10,000-30,000 tokens/s, so a cached 100-token history saves a
few milliseconds, as much as one iteration's jitter on a busy CI machine (the last iteration's time
is part of the prediction), while on a real model the prompt's prefill is what a prediction is made
of; a slower prefill keeps the test in that regime (a cached history saves about 50 ms).
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chariot.contracts.outputs import EngineStats
from chariot.contracts.proto_codec import request_to_proto
from chariot.proto.chariot.v1 import generation_pb2 as pb
from chariot.router.admission import prefill_rate
from chariot.router.registry import ReplicaLoad
from chariot.worker import SamplingParams
from chariot.worker.engine import Engine
from tests.integration.test_router import (
    ENGINE_KW,
    RELAXED,
    REPLICA,
    SERVED,
    STATS_INTERVAL_S,
    TIMEOUT,
    PacedEngine,
    Router,
    Worker,
    wait_for,
)
from tests.redis_server import RedisServer, require_redis_server

BS = ENGINE_KW["block_size"]  # the test workers' block size
TURN = 24
BODY = {"max_tokens": TURN, "temperature": 0, "ignore_eos": True, "return_token_ids": True, "model": SERVED}
PREFILL_S_PER_TOKEN = 0.0005  # a prefill of about 2000 tokens/s (see the module docstring)
AFFINITY = dataclasses.replace(RELAXED, affinity_margin_ms=30_000.0)  # SLO 60 s, prefer the session within 30 s


def loadable_engine() -> type[Engine]:
    """A paced engine class of its own, slower per prompt token, whose Stats adds `extra_queued`
    prefill tokens to its queue."""

    class Loadable(PacedEngine):
        extra_queued = 0

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            schedule = self.scheduler.schedule

            def slower_prefill() -> Any:  # inside the step the engine times, so the measured rate has it
                batch = schedule()
                time.sleep(batch.num_prefill_tokens * PREFILL_S_PER_TOKEN)
                return batch

            self.scheduler.schedule = slower_prefill  # type: ignore[method-assign]

        def stats(self) -> EngineStats:
            s = super().stats()
            return dataclasses.replace(s, queued_prefill_tokens=s.queued_prefill_tokens + type(self).extra_queued)

    return Loadable


@dataclasses.dataclass
class Replica:
    worker: Worker
    engine: type[Any]

    @property
    def name(self) -> str:
        return self.worker.name


@pytest.fixture(scope="module")
def replicas(tiny_model_dir: Path) -> Iterator[dict[str, Replica]]:
    engines = {name: loadable_engine() for name in ("p0", "p1")}
    started = {name: Replica(Worker(tiny_model_dir, name, engine=engine), engine) for name, engine in engines.items()}
    for r in started.values():  # each measures its prefill rate (until then the router assumes an optimistic one)
        list(r.worker.stub.Generate(request_to_proto([2] * 100, SamplingParams(max_tokens=2), model=SERVED),
                                    timeout=TIMEOUT))
        assert 0 < r.worker.stats().prefill_tokens_per_s < 1 / PREFILL_S_PER_TOKEN
    yield started
    for r in started.values():
        r.worker.stop()


@pytest.fixture(scope="module")
def router(replicas: dict[str, Replica], tiny_model_dir: Path) -> Iterator[Router]:
    r = Router([x.worker.flag for x in replicas.values()], config=AFFINITY, model_dir=tiny_model_dir)
    r.wait_ready(2)
    yield r
    r.stop()


@pytest.fixture(autouse=True)
def unloaded(replicas: dict[str, Replica], router: Router) -> Iterator[None]:
    yield
    for r in replicas.values():
        if r.engine.extra_queued:
            load(router, r, 0)


def load(router: Router, replica: Replica, extra: int) -> None:
    """Make `replica` report `extra` more queued prefill tokens, and wait until the router has it."""
    replica.engine.extra_queued = extra
    # one request refreshes the worker's Stats snapshot (it is taken after engine steps)
    list(replica.worker.stub.Generate(request_to_proto([3, 1, 4], SamplingParams(max_tokens=1), model=SERVED),
                                      timeout=TIMEOUT))
    wait_for(lambda: replica.worker.stats().queued_prefill_tokens == extra, what="worker reports its load")
    wait_for(lambda: router.stub.Stats(pb.StatsRequest(), timeout=TIMEOUT).queued_prefill_tokens >= extra,
             what="router sees the load")
    time.sleep(3 * STATS_INTERVAL_S)  # every replica's latest report polled after the change


def seconds_of_prefill(replica: Replica, seconds: float) -> int:
    """Prefill tokens the router predicts `replica` takes `seconds` for."""
    return int(seconds * prefill_rate(ReplicaLoad.from_stats(replica.worker.stats(), 0.0)))


def fresh_prompt(seed: int, length: int = 120) -> list[int]:
    """Token ids no other test's prompt starts with (a distinct first block per seed)."""
    return [1 + (seed * 131 + 7 * i) % 500 for i in range(length)]


def turn(router: Router, prompt: list[int], headers: dict[str, str] | None = None,
         **extra: Any) -> tuple[str, list[int], int]:
    """(replica, completion token ids, cached tokens) of one completion request."""
    resp = router.post("/v1/completions", {**BODY, "prompt": prompt, **extra}, headers=headers or {})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    return (resp.headers[REPLICA], body["choices"][0]["token_ids"],
            body["usage"]["prompt_tokens_details"]["cached_tokens"])


def routed(router: Router) -> dict[tuple[str, str], tuple[float, float]]:
    """(replica, reason) -> (requests routed, predicted prefix-hit tokens), from the router's /metrics."""
    text = router.client.get("/metrics").text
    out: dict[tuple[str, str], tuple[float, float]] = {}
    for family, slot in (("chariot_router_routed_total", 0), ("chariot_router_prefix_hit_tokens_total", 1)):
        for labels, value in re.findall(rf"^{family}\{{([^}}]*)\}} (\S+)$", text, flags=re.M):
            attrs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            key = (attrs["replica"], attrs["reason"])
            pair = list(out.get(key, (0.0, 0.0)))
            pair[slot] = float(value)
            out[key] = (pair[0], pair[1])
    return out


def delta(after: dict[Any, tuple[float, float]], before: dict[Any, tuple[float, float]]
          ) -> dict[Any, tuple[float, float]]:
    zero = (0.0, 0.0)
    return {k: (v[0] - before.get(k, zero)[0], v[1] - before.get(k, zero)[1]) for k, v in after.items()
            if v != before.get(k, zero)}


def think() -> None:
    """A user's think time between turns: long enough for the router to poll every replica's load
    after the previous turn finished (a report taken while it was queued would still count it)."""
    time.sleep(3 * STATS_INTERVAL_S)


def conversation(router: Router, seed: int, turns: int = 3) -> list[tuple[str, int, int]]:
    """(replica, prompt tokens, cached tokens) of each turn of a conversation resending its history."""
    prompt = fresh_prompt(seed, 90)
    out = []
    for i in range(turns):
        replica, completion, cached = turn(router, prompt)
        out.append((replica, len(prompt), cached))
        if i + 1 < turns:
            prompt = prompt + completion + [5 + i] * 8
            think()
    return out


# ---- tests ---------------------------------------------------------------------------------------------


def test_follow_up_turns_land_on_the_replica_holding_their_history(router: Router) -> None:
    before = routed(router)
    seen: set[str] = set()
    for seed in (11, 12, 13, 14):
        turns = conversation(router, seed)
        home = turns[0][0]
        seen.add(home)
        assert turns[0][2] == 0
        for (replica, _, cached), (_, prev_len, _) in zip(turns[1:], turns, strict=False):
            assert replica == home, turns
            # the earlier turns: every full block of the previous prompt and its completion (all but the
            # last sampled token, whose KV is never computed)
            assert cached == (prev_len + TURN - 1) // BS * BS, turns
    counts = delta(routed(router), before)
    prefix = sum(v[0] for (_, reason), v in counts.items() if reason == "prefix")
    hits = sum(v[1] for (_, reason), v in counts.items() if reason == "prefix")
    assert prefix == 8, counts  # every follow-up turn, routed for its cache
    assert hits > 0


def test_a_replica_over_the_slo_is_not_chosen_for_its_cache(router: Router, replicas: dict[str, Replica]) -> None:
    prompt = fresh_prompt(21)
    home, completion, _ = turn(router, prompt)
    other = next(name for name in replicas if name != home)
    follow = prompt + completion + [9] * 8
    think()
    load(router, replicas[home], seconds_of_prefill(replicas[home], 600.0))  # ten times the 60 s SLO
    before = routed(router)
    replica, _, cached = turn(router, follow)
    assert (replica, cached) == (other, 0)
    assert delta(routed(router), before) == {(other, "fallback"): (1.0, 0.0)}


def test_a_cache_hit_that_would_breach_the_slo_on_every_replica_is_shed(
        router: Router, replicas: dict[str, Replica]) -> None:
    prompt = fresh_prompt(22)
    _, completion, _ = turn(router, prompt)
    for r in replicas.values():
        load(router, r, seconds_of_prefill(r, 600.0))
    resp = router.post("/v1/completions", {**BODY, "prompt": prompt + completion})
    assert resp.status_code == 429 and float(resp.headers["retry-after"]) > 0


def test_unknown_prefixes_spread_by_load(router: Router) -> None:
    before = routed(router)
    replicas: list[str] = []

    def one(seed: int) -> None:
        replicas.append(turn(router, fresh_prompt(seed, 100))[0])

    threads = [threading.Thread(target=one, args=(100 + i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert len(replicas) == 8 and set(replicas) == {"p0", "p1"}, replicas
    counts = delta(routed(router), before)
    assert {reason for _, reason in counts} == {"load"} and sum(v[0] for v in counts.values()) == 8, counts


def test_session_hint_is_honoured_only_within_the_slo(router: Router, replicas: dict[str, Replica]) -> None:
    session = {"X-Session-Id": "conversation-7"}
    home, _, _ = turn(router, fresh_prompt(31), session)
    other = next(name for name in replicas if name != home)
    # the session's replica 5 s behind: within the SLO (60 s) and the margin (30 s)
    load(router, replicas[home], seconds_of_prefill(replicas[home], 5.0))
    assert turn(router, fresh_prompt(32))[0] == other  # no session: the least loaded
    before = routed(router)
    assert turn(router, fresh_prompt(33), session)[0] == home
    assert turn(router, fresh_prompt(34), user="conversation-7")[0] == home  # OpenAI `user` is a hint too
    assert delta(routed(router), before) == {(home, "affinity"): (2.0, 0.0)}
    # over the SLO: the hint gives way, and the session follows the replica that served it
    load(router, replicas[home], seconds_of_prefill(replicas[home], 600.0))
    assert turn(router, fresh_prompt(35), session)[0] == other
    load(router, replicas[home], 0)
    assert turn(router, fresh_prompt(36), session)[0] == other


def test_redis_down_still_routes_by_prefix(replicas: dict[str, Replica], tiny_model_dir: Path) -> None:
    """A router sharing its load through Redis: when Redis dies it decides locally, and a
    conversation's turns still find their history (the prefix index is the router's, never in Redis)."""
    binary = require_redis_server()
    with RedisServer(binary) as redis:
        config = dataclasses.replace(RELAXED, redis_url=redis.url, redis_timeout_s=0.1)
        r = Router([x.worker.flag for x in replicas.values()], config=config, model_dir=tiny_model_dir)
        try:
            r.wait_ready(2)
            prompt = fresh_prompt(41, 90)
            home, completion, _ = turn(r, prompt)
            assert not r.health()["state"]["degraded"]
            redis.kill()
            for i in range(2):
                think()
                history = (len(prompt) + TURN - 1) // BS * BS
                prompt = prompt + completion + [7 + i] * 8
                replica, completion, cached = turn(r, prompt)
                assert (replica, cached) == (home, history)
                assert r.health()["state"]["degraded"]
        finally:
            r.stop()


def test_without_a_tokenizer_text_routes_by_load(replicas: dict[str, Replica]) -> None:
    """A text prompt the router cannot tokenise has no hashes: every turn routes by load, hits unknown
    to the router (the worker still reports what it found)."""
    r = Router([x.worker.flag for x in replicas.values()])  # no model_dir: no tokenizer
    try:
        r.wait_ready(2)
        text = "Once upon a time, in a lighthouse at the edge of the sea, " * 4
        for _ in range(3):
            resp = r.post("/v1/completions", {**BODY, "prompt": text, "return_token_ids": False})
            assert resp.status_code == 200, resp.text
            think()
        counts = routed(r)
        assert {reason for _, reason in counts} == {"load"} and sum(v[0] for v in counts.values()) == 3
        assert sum(v[1] for v in counts.values()) == 0
    finally:
        r.stop()
