"""The offered load the routers measure and share, end to end: a real stage-0 worker (tiny checkpoint,
CPU), real routers (`run_router`), a real redis-server, and the operator's own reader of it.

What the autoscaler relies on: `GET /load` counts every arrival (admitted or shed for load) with its
prompt tokens, the output tokens streamed, the sheds, each replica's measured capacity, the replicas
routed to and the requests in flight; every router publishes it to Redis under its deployment's
prefix, the operator sums the routers; a router that stops withdraws its snapshot; a Redis outage
never touches serving.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from chariot.contracts.autoscaling import OfferedLoad  # noqa: E402
from chariot.operator.autoscaler import RedisOfferedLoad  # noqa: E402
from chariot.router.config import RouterConfig  # noqa: E402
from tests.integration.test_router import Router, Worker, wait_for  # noqa: E402
from tests.redis_server import RedisServer, require_redis_server  # noqa: E402

pytestmark = pytest.mark.slow
PREFIX = "chariot:serving:tiny"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """Started before the worker: forking redis-server while gRPC threads run can hang the child."""
    binary = require_redis_server()
    with RedisServer(binary) as server:
        yield server


@pytest.fixture(scope="module")
def worker(redis_server: RedisServer, tiny_model_dir: Path) -> Iterator[Worker]:
    w = Worker(tiny_model_dir, "g0")
    yield w
    w.stop()


def load_of(router: Router) -> OfferedLoad:
    resp = router.client.get("/load")
    assert resp.status_code == 200, resp.text
    return OfferedLoad.from_dict(resp.json())


def complete(router: Router, n: int) -> None:
    for i in range(n):
        resp = router.post("/v1/completions", {"prompt": f"offered load {i}", "max_tokens": MAX_TOKENS,
                                               "ignore_eos": True})
        assert resp.status_code == 200, resp.text


def test_routers_measure_and_share_their_offered_load(worker: Worker, redis_server: RedisServer,
                                                      tiny_model_dir: Path) -> None:
    config = RouterConfig(ttft_slo_ms=60_000, redis_url=redis_server.url, redis_key_prefix=PREFIX,
                          offered_load_publish_s=0.2)
    routers = [Router([worker.flag], config, model_dir=tiny_model_dir) for _ in range(2)]
    reader = RedisOfferedLoad()
    try:
        for r in routers:
            r.wait_ready(1)
        complete(routers[0], 4)
        complete(routers[1], 2)
        local = load_of(routers[0])
        assert local.arrival_rate > 0 and local.shed_rate == 0.0
        assert local.output_token_rate / local.arrival_rate == pytest.approx(MAX_TOKENS)  # same window, same span
        assert local.prompt_token_rate > local.arrival_rate  # several prompt tokens per request
        assert worker.stats().budget_tokens_per_s > 0, "the worker fitted its step cost"
        assert local.capacity["g0"] > 0, "the worker's capacity at its budget"
        assert local.replicas == ("g0",) and dict(local.in_flight) == {}

        def shared() -> OfferedLoad | None:  # both routers' snapshots, published after their last request
            merged = reader(redis_server.url, PREFIX)
            caught_up = merged is not None and merged.routers == 2 and merged.arrival_rate > 0 and \
                merged.output_token_rate / merged.arrival_rate == pytest.approx(MAX_TOKENS)
            return merged if caught_up else None

        wait_for(lambda: shared() is not None, what="both routers' snapshots in Redis")
        merged = shared()
        assert merged is not None
        assert merged.replicas == ("g0",) and merged.capacity["g0"] > 0
        assert reader(redis_server.url, "chariot:serving:other") is None, "another deployment's prefix is empty"

        routers.pop().stop()  # a router going away withdraws its snapshot at once
        remaining = reader(redis_server.url, PREFIX)
        assert remaining is not None and remaining.routers == 1

        redis_server.kill()  # serving and GET /load do not depend on Redis
        complete(routers[0], 1)
        assert load_of(routers[0]).arrival_rate > 0
    finally:
        for r in routers:
            r.stop()


def test_shed_requests_count_as_offered_load(worker: Worker, tiny_model_dir: Path) -> None:
    worker.wait_idle()
    router = Router([worker.flag], RouterConfig(ttft_slo_ms=60_000, max_queue_per_replica=1,
                                                queue_retry_after_s=0.5), model_dir=tiny_model_dir)
    statuses: Counter[int] = Counter()
    lock = threading.Lock()

    def client() -> None:
        resp = router.post("/v1/completions", {"prompt": "shed me " * 4, "max_tokens": 32, "ignore_eos": True})
        with lock:
            statuses[resp.status_code] += 1

    try:
        router.wait_ready(1)
        threads = [threading.Thread(target=client) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert statuses[429] > 0 and statuses[200] > 0 and sum(statuses.values()) == 6, statuses
        offered = load_of(router)
        assert offered.shed_rate > 0, "sheds are offered load the replicas did not serve"
        assert offered.output_token_rate / offered.arrival_rate == pytest.approx(32 * statuses[200] / 6)
    finally:
        router.stop()


def test_a_request_is_held_until_a_first_replica_is_ready(worker: Worker, tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    """Scale from zero, the router's half: no replica at all, the request waits (and shows as `held`,
    which is what makes the autoscaler start a group); once a replica is listed and reports, it is
    served; its wait is recorded. Past the hold timeout: 503 with Retry-After."""
    replica_file = tmp_path / "replicas.json"
    replica_file.write_text('{"replicas": []}')
    config = RouterConfig(ttft_slo_ms=60_000, replica_file=str(replica_file), replica_poll_s=0.1, hold_queue=4,
                          hold_timeout_s=30.0)
    router = Router([], config, model_dir=tiny_model_dir)
    result: dict[str, httpx.Response] = {}

    def send() -> None:
        result["held"] = router.post("/v1/completions", {"prompt": "wake up", "max_tokens": 4, "ignore_eos": True})

    try:
        thread = threading.Thread(target=send)
        thread.start()
        wait_for(lambda: load_of(router).held == 1, what="the request held")
        time.sleep(0.5)
        assert "held" not in result, "no replica: still waiting"
        replica_file.write_text(json.dumps({"replicas": [{"name": "g0", "address": worker.address}]}))
        thread.join(30)
        assert result["held"].status_code == 200, result["held"].text
        assert load_of(router).held == 0
        metrics = router.client.get("/metrics").text
        assert re.search(r'chariot_router_hold_time_seconds_count\{[^}]*outcome="served"[^}]*\} 1\.0', metrics), \
            metrics[-2000:]
    finally:
        router.stop()

    replica_file.write_text('{"replicas": []}')
    impatient = Router([], dataclasses.replace(config, hold_timeout_s=0.5, queue_retry_after_s=3.0),
                       model_dir=tiny_model_dir)
    try:
        started = time.monotonic()
        resp = impatient.post("/v1/completions", {"prompt": "nobody home", "max_tokens": 4})
        assert resp.status_code == 503 and resp.headers["retry-after"] == "3", (resp.status_code, resp.headers)
        assert 0.5 <= time.monotonic() - started < 10
    finally:
        impatient.stop()
