"""Shared router state against a real redis-server: atomic scripts, joint limits, leases, outages.

Two `AdmissionController`s over two separate Redis clients stand for two router processes.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # `tests.redis_server` imports as a namespace package from the repository root
    sys.path.insert(0, _ROOT)

from chariot.contracts.errors import AdmissionRejected  # noqa: E402
from chariot.router.admission import AdmissionController, Decision  # noqa: E402
from chariot.router.config import RouterConfig, TenantLimit  # noqa: E402
from chariot.router.registry import ReplicaLoad, ReplicaRegistry, ReplicaSpec  # noqa: E402
from chariot.router.state import (  # noqa: E402
    DuplicateRequestError,
    RedisState,
    ResilientState,
    SharedState,
    make_state,
)
from tests.redis_server import RedisServer, free_port, require_redis_server  # noqa: E402

REPLICAS = ("g0", "g1")


@pytest.fixture(scope="module")
def redis_binary() -> str:
    """Debian's redis-server is a declared test dependency: a missing one fails loudly."""
    binary = require_redis_server()
    return binary


@pytest.fixture
def redis_server(redis_binary: str) -> Iterator[RedisServer]:
    with RedisServer(redis_binary) as server:
        yield server


SHARING_TIMEOUT_S = 2.0
"""Redis timeout of the tests about what two routers share (not about a slow Redis): a Redis server
starved of CPU by the other test process on a 2-core machine can answer past the 0.2 s default, and
a router that degrades decides locally, which those tests would read as not sharing."""


class Router:
    """One router process: its own registry, Redis client (with local fallback) and controller."""

    def __init__(self, redis_url: str, **config: Any) -> None:
        defaults: dict[str, Any] = dict(redis_url=redis_url, redis_timeout_s=0.2, redis_retry_s=0.2, ttft_slo_ms=60_000)
        self.config = RouterConfig(**{**defaults, **config})
        self.registry = ReplicaRegistry(
            [ReplicaSpec(n, f"{n}:50051") for n in REPLICAS], staleness_s=self.config.stats_staleness_s
        )
        self.state: SharedState = make_state(self.config)
        self.controller = AdmissionController(self.config, self.registry, self.state)
        self.report()

    def report(self) -> None:
        for name in REPLICAS:
            load = ReplicaLoad(token_budget=512, prefill_tokens_per_s=1000.0, max_model_len=4096)
            self.registry.update_load(name, _at(load, time.monotonic()))

    async def try_decide(self, prompt_tokens: int = 10, tenant: str = "default", **kw: Any) -> Decision | str:
        try:
            return await self.controller.decide(prompt_tokens, tenant, **kw)
        except AdmissionRejected as e:
            return e.reason


def _at(load: ReplicaLoad, t: float) -> ReplicaLoad:
    return ReplicaLoad(**{**load.__dict__, "reported_at": t})


def admitted(outcomes: list[Decision | str]) -> list[Decision]:
    return [o for o in outcomes if isinstance(o, Decision)]


# --- the scripts -------------------------------------------------------------------------------------------


def test_scripts_round_trip_with_ttls(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        state = RedisState.from_url(redis_server.url, lease_s=30.0, retention_s=5.0)
        client = state._client
        try:
            first = await state.take("acme", 3.0, TenantLimit(1.0, 5.0))
            second = await state.take("acme", 3.0, TenantLimit(1.0, 5.0))
            assert first.allowed and first.remaining == pytest.approx(2.0, abs=0.05)
            assert not second.allowed and second.retry_after_s == pytest.approx(1.0, abs=0.05)
            assert 0 < await client.pttl(state.key("bucket", "acme")) <= 4000  # full again after 3 s, + 1 s

            assert await state.admit("r1", "g0", 100, 2)
            assert await state.admit("r2", "g0", 50, 2)
            assert not await state.admit("r3", "g0", 10, 2)  # the bound holds atomically
            with pytest.raises(DuplicateRequestError):
                await state.admit("r1", "g0", 100, 5)
            loads = await state.loads({"g0": 5.0, "g1": 5.0})
            assert (loads["g0"].in_flight, loads["g0"].pending_prefill_tokens) == (2, 150)
            assert (loads["g1"].in_flight, loads["g1"].pending_prefill_tokens) == (0, 0)
            await asyncio.sleep(0.05)
            assert (await state.loads({"g0": 0.01}))["g0"].pending_prefill_tokens == 0  # admitted before the window

            await state.first_token("r1", "g0")
            assert (await state.loads({"g0": 5.0}))["g0"].pending_prefill_tokens == 50
            assert await state.replica_of("r1") == "g0"
            for kind, name in (("inflight", "g0"), ("req", "r1"), ("pending", "g0"), ("pendtok", "g0")):
                assert 0 < await client.pttl(state.key(kind, name)) <= 31_000
            await state.release("r1", "g0")
            await state.release("r1", "g0")  # idempotent
            assert await state.replica_of("r1") is None
            assert (await state.loads({"g0": 5.0}))["g0"].in_flight == 1
        finally:
            await state.aclose()

    asyncio.run(scenario())


def test_a_crashed_routers_requests_expire_with_their_lease(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        state = RedisState.from_url(redis_server.url, lease_s=0.3)
        try:
            assert await state.admit("r1", "g0", 100, 5)
            for _ in range(3):  # a live router renews its lease
                await asyncio.sleep(0.15)
                await state.heartbeat()
            assert (await state.loads({"g0": 5.0}))["g0"].in_flight == 1
            await asyncio.sleep(0.45)  # no heartbeats: the router is gone
            assert (await state.loads({"g0": 5.0}))["g0"].in_flight == 0
            assert await state.replica_of("r1") is None
        finally:
            await state.aclose()

    asyncio.run(scenario())


# --- two routers, one Redis --------------------------------------------------------------------------------


def test_two_routers_enforce_one_tenant_limit_jointly(redis_server: RedisServer) -> None:
    limits = {"acme": TenantLimit(rate_per_s=0.01, burst=10.0)}

    async def scenario() -> None:
        routers = [Router(redis_server.url, rate_limit_unit="requests", tenant_rate_limits=limits,
                          redis_timeout_s=SHARING_TIMEOUT_S) for _ in range(2)]
        try:
            outcomes = await asyncio.gather(*(routers[i % 2].try_decide(tenant="acme") for i in range(40)))
            assert len(admitted(list(outcomes))) == 10  # not 10 per router
            assert {o for o in outcomes if isinstance(o, str)} == {"rate_limit"}
            assert isinstance(await routers[1].try_decide(tenant="other"), Decision)
            assert not any(r.controller.health().degraded for r in routers)
        finally:
            for router in routers:
                await router.state.aclose()

    asyncio.run(scenario())


def test_two_routers_see_each_others_load_and_share_queue_bounds(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        a, b = (Router(redis_server.url, max_queue_per_replica=2, redis_timeout_s=SHARING_TIMEOUT_S) for _ in range(2))
        try:
            first = await a.controller.decide(800)
            second = await b.controller.decide(800)  # b sees a's 800 pending tokens on that replica
            assert second.replica_name != first.replica_name
            more = await asyncio.gather(*(r.try_decide() for r in (a, b, a, b)))
            assert len(admitted(list(more))) == 2  # 2 replicas x bound 2, across both routers
            assert "queue" in more
            await a.controller.on_finish(first)
            assert isinstance(await b.try_decide(), Decision)  # b sees the slot a freed
            assert await b.controller.replica_of(second.request_id) == second.replica_name
            assert await a.controller.replica_of(second.request_id) == second.replica_name  # via Redis
        finally:
            await a.state.aclose()
            await b.state.aclose()

    asyncio.run(scenario())


# --- outages -----------------------------------------------------------------------------------------------


async def _decide_timed(router: Router, **kw: Any) -> tuple[Decision | str, float]:
    start = time.monotonic()
    outcome = await router.try_decide(**kw)
    return outcome, time.monotonic() - start


def test_killing_redis_degrades_to_local_decisions_and_restarting_recovers(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        router = Router(redis_server.url)
        try:
            before = admitted([await router.try_decide() for _ in range(3)])
            assert len(before) == 3 and not router.controller.health().degraded

            redis_server.kill()
            during = [await _decide_timed(router) for _ in range(20)]
            assert all(isinstance(outcome, Decision) for outcome, _ in during)
            assert max(elapsed for _, elapsed in during) < 0.5
            health = router.controller.health()
            assert health.degraded and health.reason and "Error" in health.reason
            await router.controller.on_finish(before[0])  # cannot reach Redis: forgotten, never raised
            await router.controller.on_first_token(cast(Decision, during[0][0]))

            redis_server.start()  # same port, empty
            for _ in range(router.config.redis_recover_after):  # back after that many good probes in a row
                assert router.controller.health().degraded
                await asyncio.sleep(router.config.redis_retry_s)
                await router.state.heartbeat()  # the probe; also re-registers this router's live leases
            assert not router.controller.health().degraded
            assert isinstance(await router.try_decide(), Decision)
            loads = await router.state.loads({n: 5.0 for n in REPLICAS})
            # 2 Redis-admitted before the outage (re-registered) + 20 local leftovers + 1 new.
            assert sum(load.in_flight for load in loads.values()) == 23
        finally:
            await router.state.aclose()

    asyncio.run(scenario())


def test_a_burst_shares_a_bounded_pool_and_never_degrades(redis_server: RedisServer) -> None:
    """500 admissions at once over a pool of 8: calls wait for a connection instead of opening 500
    (Redis' "Too many connections" used to flip the router to local state)."""
    import redis

    async def scenario() -> None:
        router = Router(redis_server.url, redis_max_connections=8, max_queue_per_replica=10_000)
        cast(ResilientState, router.state).start(60.0)  # as the router app does at start-up
        await asyncio.sleep(0.1)
        try:
            outcomes = await asyncio.gather(*(router.try_decide() for _ in range(500)))
            assert len(admitted(list(outcomes))) == 500
            assert not router.controller.health().degraded
            observer = redis.Redis.from_url(redis_server.url)
            try:
                assert int(observer.info("clients")["connected_clients"]) <= 8 + 1  # the pool + this observer
            finally:
                observer.close()
        finally:
            await router.state.aclose()

    asyncio.run(scenario())


def test_a_router_whose_event_loop_lags_decides_locally_without_degrading(redis_server: RedisServer) -> None:
    """A router too busy to read Redis' answer within the timeout (a burst on a small machine) is not
    evidence that Redis is down: those calls decide locally, the shared state stays in use."""

    async def busy(until: float) -> None:
        while time.monotonic() < until:
            spin_end = time.monotonic() + 0.002
            while time.monotonic() < spin_end:  # hold the loop 2 ms, then let the next task run
                pass
            await asyncio.sleep(0)

    async def scenario() -> None:
        # The default timeout leaves a genuine Redis round trip on a loaded 2-core CI machine room
        # (20 ms did not: one answer took longer and degraded the state); each loop turn is 2x longer.
        router = Router(redis_server.url, redis_timeout_s=0.2)
        try:
            assert isinstance(await router.try_decide(), Decision)
            until = time.monotonic() + 1.5
            crowd = [asyncio.create_task(busy(until)) for _ in range(200)]  # ~400 ms per loop turn
            await asyncio.sleep(0.1)
            outcomes = await asyncio.gather(*(router.try_decide() for _ in range(20)))  # new connections
            await asyncio.gather(*crowd)
            assert all(isinstance(o, Decision) for o in outcomes), outcomes
            assert not router.controller.health().degraded
            redis_server.pause()  # a truly hung Redis on an idle loop still degrades
            assert isinstance(await router.try_decide(), Decision)
            assert "Timeout" in (router.controller.health().reason or "")
        finally:
            redis_server.resume()
            await router.state.aclose()

    asyncio.run(scenario())


def test_a_hung_redis_costs_one_timeout_then_local_decisions(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        router = Router(redis_server.url, redis_retry_s=0.5)
        try:
            assert isinstance(await router.try_decide(), Decision)
            redis_server.pause()
            outcomes = [await _decide_timed(router) for _ in range(5)]
            assert all(isinstance(outcome, Decision) for outcome, _ in outcomes)
            assert 0.15 <= outcomes[0][1] < 0.6  # the first call waits out the 0.2 s timeout
            assert max(elapsed for _, elapsed in outcomes[1:]) < 0.15  # then no call waits until the retry
            assert "Timeout" in (router.controller.health().reason or "")
            redis_server.resume()
            for _ in range(router.config.redis_recover_after):
                await asyncio.sleep(0.5)
                assert isinstance(await router.try_decide(), Decision)
            assert not router.controller.health().degraded
        finally:
            redis_server.resume()
            await router.state.aclose()

    asyncio.run(scenario())


def test_redis_down_at_start_and_degraded_limits_use_the_local_share(redis_binary: str) -> None:
    limits = {"acme": TenantLimit(rate_per_s=0.01, burst=10.0)}

    async def scenario() -> None:
        router = Router(
            f"redis://127.0.0.1:{free_port()}/0",
            rate_limit_unit="requests",
            tenant_rate_limits=limits,
            degraded_limit_share=0.5,
        )
        try:
            outcomes = [await router.try_decide(tenant="acme") for _ in range(8)]
            assert len(admitted(outcomes)) == 5  # half of the burst: the other router has the other half
            assert router.controller.health().degraded
        finally:
            await router.state.aclose()

    asyncio.run(scenario())


def test_the_redis_helper_restarts_on_the_same_port(redis_binary: str) -> None:
    with RedisServer(redis_binary) as server:
        port, pid = server.port, server._proc.pid if server._proc else None
        server.kill()
        assert not server.running
        server.start()
        assert server.running and server.port == port and server._proc and server._proc.pid != pid
    assert not server.running


def test_the_upkeep_task_renews_leases_until_closed(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        router = Router(redis_server.url, lease_s=0.3)
        observer = RedisState.from_url(redis_server.url)
        try:
            task = cast(ResilientState, router.state).start(0.05)
            decision = await router.controller.decide(10)
            await asyncio.sleep(0.6)  # twice the lease: alive only because it was renewed
            assert (await observer.loads({decision.replica_name: 5.0}))[decision.replica_name].in_flight == 1
            await router.state.aclose()
            assert task.done()
            await asyncio.sleep(0.45)  # the router is gone: its lease runs out
            assert (await observer.loads({decision.replica_name: 5.0}))[decision.replica_name].in_flight == 0
        finally:
            await observer.aclose()

    asyncio.run(scenario())
