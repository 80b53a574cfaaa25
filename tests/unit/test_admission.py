"""Admission control on synthetic load reports: prediction, routing, shedding, queue bounds, buckets."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, cast

import pytest

from chariot.contracts.errors import (
    AdmissionRejected,
    ConfigError,
    InvalidRequestError,
    NoReplicaAvailable,
    error_status,
)
from chariot.router.admission import AdmissionController, Decision, prefill_rate
from chariot.router.config import RouterConfig, TenantLimit
from chariot.router.ratelimit import BucketLevel, take_from_bucket
from chariot.router.registry import ReplicaLoad, ReplicaRegistry, ReplicaSpec
from chariot.router.state import LocalState, ResilientState


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def run(coro: Any) -> Any:
    return asyncio.run(coro)


class Router:
    """A controller over an in-memory state, with helpers to feed load reports."""

    def __init__(self, replicas: dict[str, dict[str, Any]] | list[str], **config: Any) -> None:
        self.clock = FakeClock()
        self.config = RouterConfig(**config)
        names = list(replicas)
        self.registry = ReplicaRegistry(
            [ReplicaSpec(n, f"10.0.0.{i + 1}:50051") for i, n in enumerate(names)],
            staleness_s=self.config.stats_staleness_s,
            clock=self.clock,
        )
        self.state = LocalState(self.clock)
        self.controller = AdmissionController(self.config, self.registry, self.state, clock=self.clock)
        if isinstance(replicas, dict):
            for name, fields in replicas.items():
                self.report(name, **fields)

    def report(self, name: str, **fields: Any) -> None:
        base: dict[str, Any] = dict(
            token_budget=512, prefill_tokens_per_s=1000.0, last_iteration_s=0.05, max_model_len=4096
        )
        base.update(fields)
        self.registry.update_load(name, ReplicaLoad(reported_at=self.clock(), **base))

    def decide(self, prompt_tokens: int = 100, tenant: str = "default", **kw: Any) -> Decision:
        return run(self.controller.decide(prompt_tokens, tenant, **kw))

    def shed(self, prompt_tokens: int = 100, tenant: str = "default", **kw: Any) -> AdmissionRejected:
        with pytest.raises(AdmissionRejected) as info:
            self.decide(prompt_tokens, tenant, **kw)
        return info.value


# --- prediction and routing ------------------------------------------------------------------------


def test_prefill_rate_prefers_the_measured_rate_then_budget_per_iteration() -> None:
    assert prefill_rate(ReplicaLoad(prefill_tokens_per_s=750.0, token_budget=512, last_iteration_s=0.1)) == 750.0
    assert prefill_rate(ReplicaLoad(token_budget=512, last_iteration_s=0.1)) == pytest.approx(5120.0)
    assert prefill_rate(ReplicaLoad(token_budget=512, last_iteration_s=0.0)) == pytest.approx(512_000.0)


def test_prediction_is_iteration_plus_queued_and_prompt_over_rate() -> None:
    r = Router({"a": dict(queued_prefill_tokens=900, prefill_tokens_per_s=1000.0, last_iteration_s=0.05)})
    decision = r.decide(100)
    assert decision.replica_name == "a"
    assert decision.address == "10.0.0.1:50051"
    assert decision.predicted_ttft_s == pytest.approx(0.05 + (900 + 100) / 1000.0)


def test_picks_the_replica_with_the_lowest_predicted_ttft() -> None:
    r = Router(
        {
            "busy": dict(queued_prefill_tokens=1500),
            "idle-but-slow": dict(queued_prefill_tokens=0, prefill_tokens_per_s=100.0),
            "light": dict(queued_prefill_tokens=200),
        }
    )
    # busy: 0.05 + 1.6 = 1.65 s; slow (idle: no iteration to wait for): 1.0 s; light: 0.05 + 0.3 = 0.35 s
    assert r.decide(100).replica_name == "light"


def test_admissions_since_the_last_report_count_until_their_first_token() -> None:
    r = Router({"a": {}, "b": {}})
    first = r.decide(800)
    second = r.decide(800)
    assert {first.replica_name, second.replica_name} == {"a", "b"}  # the first one's prompt is queued on its replica
    assert second.predicted_ttft_s == pytest.approx(first.predicted_ttft_s)
    third = r.decide(100)  # both replicas now hold 800 pending tokens: the tie goes by queue depth, then name
    assert third.predicted_ttft_s == pytest.approx(0.9)  # reported idle: the pending prompt is the wait
    run(r.controller.on_first_token(first))
    assert r.decide(100).replica_name == first.replica_name  # its prompt is prefilled: no longer queued


def test_admissions_older_than_the_report_are_not_counted_twice() -> None:
    r = Router({"a": {}})
    r.decide(1000)
    r.clock.advance(0.5)
    r.report("a", queued_prefill_tokens=1000)  # the worker's report now includes that prompt
    assert r.decide(100).predicted_ttft_s == pytest.approx(0.05 + 1.1)


def test_tie_breaks_by_queue_depth() -> None:
    r = Router({"a": dict(num_running=5), "b": dict(num_running=1)})
    assert r.decide(10).replica_name == "b"


def test_an_idle_replica_waits_for_no_iteration_so_a_burst_spreads() -> None:
    """An idle replica's last iteration, however long it took, is over: its prediction is the prompt's
    own prefill, so idle replicas tie whatever they last ran, and a burst of short prompts alternates
    between them by the prompt tokens admitted to each, instead of piling onto the one whose last
    iteration happened to be shortest."""
    r = Router({"a": dict(last_iteration_s=0.2), "b": dict(last_iteration_s=0.01)})
    first = r.decide(10)
    assert first.predicted_ttft_s == pytest.approx(10 / 1000.0)
    chosen = [first.replica_name] + [r.decide(10).replica_name for _ in range(5)]
    assert chosen.count("a") == 3 and chosen.count("b") == 3, chosen
    busy = Router({"a": dict(num_running=1, last_iteration_s=0.2)})
    assert busy.decide(10).predicted_ttft_s == pytest.approx(0.2 + 10 / 1000.0)  # a running iteration is waited for
    decoding = Router({"a": dict(last_iteration_s=0.2)})
    run(decoding.controller.on_first_token(decoding.decide(10)))  # admitted since the idle report, now decoding
    assert decoding.decide(10).predicted_ttft_s == pytest.approx(0.2 + 10 / 1000.0)


# --- shedding -----------------------------------------------------------------------------------------


def test_sheds_when_the_best_replica_misses_the_slo_and_hints_when_to_retry() -> None:
    r = Router({"a": dict(queued_prefill_tokens=5000), "b": dict(queued_prefill_tokens=6000)}, ttft_slo_ms=2000)
    shed = r.shed(100)  # best: 0.05 + 5.1 = 5.15 s > 2.2 s
    assert shed.reason == "slo"
    assert shed.retry_after_s == pytest.approx(5.15 - 2.0, abs=0.002)
    assert error_status(shed) == ("RESOURCE_EXHAUSTED", 429)
    # After the hinted wait the backlog has drained at the prefill rate, and the request fits.
    r.clock.advance(shed.retry_after_s)
    r.report("a", queued_prefill_tokens=int(5000 - shed.retry_after_s * 1000))
    decision = r.decide(100)
    assert decision.replica_name == "a"
    assert decision.predicted_ttft_s <= 2.0 + 1e-3


def test_slo_margin_widens_the_threshold() -> None:
    r = Router({"a": dict(queued_prefill_tokens=2000)}, ttft_slo_ms=2000, slo_margin=0.1)
    assert r.decide(50).predicted_ttft_s == pytest.approx(2.1)  # over the SLO, within the margin
    assert r.shed(300).reason == "slo"  # 2.1 + ... > 2.2


def test_a_prompt_longer_than_the_slo_is_served_on_an_idle_replica_only() -> None:
    r = Router({"a": {}}, ttft_slo_ms=1000)
    assert r.decide(3000).predicted_ttft_s == pytest.approx(3.0)  # 3 s of prefill alone: can never meet 1 s
    shed = r.shed(3000)  # now 3000 tokens are queued ahead
    assert shed.reason == "slo"
    assert shed.retry_after_s == pytest.approx(3.0, abs=0.01)  # until the backlog ahead has drained


def test_sheds_queue_when_every_replica_is_at_its_bound() -> None:
    r = Router({"a": {}, "b": {}}, max_queue_per_replica=2)
    decisions = [r.decide(10) for _ in range(4)]
    assert sorted(d.replica_name for d in decisions) == ["a", "a", "b", "b"]
    shed = r.shed(10)
    assert shed.reason == "queue"
    assert shed.retry_after_s == r.config.queue_retry_after_s
    run(r.controller.on_finish(decisions[0]))
    assert r.decide(10).replica_name == decisions[0].replica_name


def test_queue_bound_uses_the_reported_queue_too() -> None:
    r = Router({"a": dict(num_waiting=3, num_running=1), "b": dict(queued_prefill_tokens=20_000)}, ttft_slo_ms=60_000)
    r2 = Router({"a": dict(num_waiting=3, num_running=1)}, max_queue_per_replica=4)
    assert r.decide(10).replica_name == "a"
    assert r2.shed(10).reason == "queue"


def test_a_full_replica_is_skipped_even_if_its_prediction_is_best() -> None:
    r = Router({"fast": dict(prefill_tokens_per_s=10_000.0), "slow": {}}, max_queue_per_replica=1)
    assert r.decide(10).replica_name == "fast"
    assert r.decide(10).replica_name == "slow"


# --- readiness -------------------------------------------------------------------------------------------


def test_no_replicas_or_no_reports_means_no_replica_available() -> None:
    with pytest.raises(NoReplicaAvailable):
        Router([]).decide()
    r = Router(["a", "b"])
    with pytest.raises(NoReplicaAvailable, match="2 known"):
        r.decide()
    assert error_status(NoReplicaAvailable("x")) == ("UNAVAILABLE", 503)


def test_stale_reports_make_a_replica_not_ready() -> None:
    r = Router({"a": {}, "b": {}}, stats_staleness_s=2.0)
    r.clock.advance(1.0)
    r.report("b", queued_prefill_tokens=1000)
    r.clock.advance(1.5)  # a's report is 2.5 s old: only b is ready, although it is busier
    assert r.decide(10).replica_name == "b"
    r.clock.advance(1.0)
    with pytest.raises(NoReplicaAvailable):
        r.decide(10)
    r.report("a")
    assert r.decide(10).replica_name == "a"


def test_prompt_that_fits_no_replica_is_invalid() -> None:
    r = Router({"a": dict(max_model_len=1024)})
    with pytest.raises(InvalidRequestError) as info:
        r.decide(1024)
    assert info.value.field == "prompt"
    with pytest.raises(InvalidRequestError) as info:
        r.decide(1000, max_tokens=100)
    assert info.value.field == "max_tokens"


# --- rate limits -----------------------------------------------------------------------------------------


def test_tenant_bucket_charges_prompt_plus_max_tokens() -> None:
    limits = {"acme": TenantLimit(rate_per_s=100.0, burst=1000.0)}
    r = Router({"a": {}}, tenant_rate_limits=limits, ttft_slo_ms=60_000)
    r.decide(300, "acme", max_tokens=100)
    r.decide(300, "acme", max_tokens=100)
    shed = r.shed(300, "acme", max_tokens=100)  # 200 left, 400 needed: 2 s of refill
    assert shed.reason == "rate_limit"
    assert shed.retry_after_s == pytest.approx(2.0)
    r.decide(300, "other", max_tokens=100)  # no default limit: unlimited
    r.clock.advance(2.0)
    r.report("a")
    r.decide(300, "acme", max_tokens=100)


def test_default_limit_per_request_and_overrides() -> None:
    r = Router(
        {"a": {}},
        rate_limit_unit="requests",
        default_rate_limit=TenantLimit(1.0, 2.0),
        tenant_rate_limits={"vip": TenantLimit(1.0, 5.0)},
    )
    assert sum(_admitted(r, "t1") for _ in range(4)) == 2
    assert sum(_admitted(r, "t2") for _ in range(4)) == 2
    assert sum(_admitted(r, "vip") for _ in range(8)) == 5


def _admitted(r: Router, tenant: str) -> bool:
    try:
        r.decide(10, tenant)
    except AdmissionRejected as e:
        assert e.reason == "rate_limit"
        return False
    return True


def test_shed_requests_are_not_charged() -> None:
    limits = {"acme": TenantLimit(rate_per_s=1.0, burst=150.0)}
    r = Router({"a": dict(queued_prefill_tokens=10_000)}, tenant_rate_limits=limits)
    assert r.shed(100, "acme").reason == "slo"
    r.report("a", queued_prefill_tokens=0)
    r.decide(100, "acme")  # the bucket is still full


def test_a_request_larger_than_the_burst_needs_a_full_bucket() -> None:
    r = Router({"a": {}}, tenant_rate_limits={"t": TenantLimit(100.0, 500.0)}, ttft_slo_ms=60_000)
    r.decide(2000, "t")
    shed = r.shed(2000, "t")
    assert shed.retry_after_s == pytest.approx(5.0)  # burst / rate


def test_bucket_arithmetic() -> None:
    limit = TenantLimit(rate_per_s=10.0, burst=100.0)
    level, result = take_from_bucket(None, 30.0, limit, now=5.0)
    assert result.allowed and level == BucketLevel(70.0, 5.0)
    level, result = take_from_bucket(level, 90.0, limit, now=6.0)  # refilled to 80
    assert not result.allowed and result.retry_after_s == pytest.approx(1.0)
    level, result = take_from_bucket(level, -500.0, limit, now=6.0)  # a refund never overfills
    assert result.allowed and level.tokens == 100.0


# --- accounting ----------------------------------------------------------------------------------------


def test_first_token_and_finish_release_accounting_idempotently() -> None:
    r = Router({"a": {}})
    d = r.decide(400)
    view = r.registry.snapshot()[0]
    assert (view.in_flight, view.unprefilled_tokens) == (1, 400)
    loads = run(r.state.loads({"a": 10.0}))["a"]
    assert (loads.in_flight, loads.pending_prefill_tokens) == (1, 400)
    for _ in range(2):
        run(r.controller.on_first_token(d.request_id))
    assert r.registry.snapshot()[0].unprefilled_tokens == 0
    assert run(r.state.loads({"a": 10.0}))["a"].pending_prefill_tokens == 0
    for _ in range(2):
        run(r.controller.on_finish(d))
    assert r.registry.snapshot()[0].in_flight == 0
    assert run(r.state.loads({"a": 10.0}))["a"].in_flight == 0
    run(r.controller.on_finish("never-admitted"))
    assert r.controller.in_flight == 0


def test_finish_without_first_token_releases_pending_tokens() -> None:
    r = Router({"a": {}})
    d = r.decide(400)
    run(r.controller.on_finish(d))
    assert r.registry.snapshot()[0].unprefilled_tokens == 0
    loads = run(r.state.loads({"a": 10.0}))["a"]
    assert (loads.in_flight, loads.pending_prefill_tokens) == (0, 0)


def test_request_ids_are_unique_while_in_flight() -> None:
    r = Router({"a": {}})
    assert r.decide(10, request_id="req-1").request_id == "req-1"
    with pytest.raises(InvalidRequestError) as info:
        r.decide(10, request_id="req-1")
    assert info.value.field == "request_id"
    assert run(r.controller.replica_of("req-1")) == "a"
    run(r.controller.on_finish("req-1"))
    r.decide(10, request_id="req-1")


def test_local_state_health_is_not_degraded() -> None:
    r = Router({"a": {}})
    health = r.controller.health()
    assert (health.backend, health.degraded) == ("local", False)


# --- degraded mode with a stand-in Redis ------------------------------------------------------------------


class FlakyRedis:
    """Quacks like RedisState; raises ConnectionError while `down`."""

    def __init__(self) -> None:
        self.down = False
        self.inner = LocalState()
        self.forgotten: list[str] = []
        self.dropped = 0

    async def drop_connections(self) -> None:
        self.dropped += 1

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            if self.down:
                raise ConnectionError("connection refused")
            return await method(*args, **kwargs)

        return call

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)


def test_resilient_state_degrades_and_recovers() -> None:
    clock = FakeClock()
    primary = FlakyRedis()
    state = ResilientState(cast(Any, primary), LocalState(clock), retry_s=1.0, clock=clock)
    limit = TenantLimit(1.0, 10.0)

    async def scenario() -> None:
        assert await state.admit("r1", "a", 100, 10)
        primary.down = True
        assert (await state.take("t", 1.0, limit)).allowed  # decided locally
        assert state.health().degraded and "ConnectionError" in (state.health().reason or "")
        assert await state.admit("r2", "a", 100, 10)  # local
        await state.release("r1", "a")  # admitted in Redis, which is down: forgotten, its lease expires
        assert primary.forgotten == ["r1"]
        assert primary.dropped == 1  # the pooled connections went with the first failure, once
        clock.advance(1.0)
        primary.down = False
        await state.heartbeat()  # a probe succeeds: one is not enough (hysteresis)
        assert state.health().degraded
        clock.advance(1.0)
        primary.down = True
        await state.heartbeat()  # fails again: the count of good probes starts over
        clock.advance(1.0)
        primary.down = False
        await state.heartbeat()
        assert state.health().degraded
        clock.advance(1.0)
        await state.heartbeat()  # the second good probe in a row
        assert not state.health().degraded
        loads = await state.loads({"a": 5.0})  # local leftovers still count after recovery
        assert loads["a"].in_flight == 2  # r1 in the stand-in (never released there) + r2 locally
        await state.release("r2", "a")
        assert (await state.loads({"a": 5.0}))["a"].in_flight == 1

    run(scenario())


# --- configuration -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(ttft_slo_ms=0), "ttft_slo_ms"),
        (dict(tbt_slo_ms=float("nan")), "tbt_slo_ms"),
        (dict(slo_margin=-0.1), "slo_margin"),
        (dict(max_queue_per_replica=0), "max_queue_per_replica"),
        (dict(max_queue_per_replica=2.5), "max_queue_per_replica"),
        (dict(default_rate_limit=TenantLimit(0.0, 10.0)), "default_rate_limit.rate_per_s"),
        (dict(tenant_rate_limits={"x": TenantLimit(1.0, -1.0)}), "tenant_rate_limits['x'].burst"),
        (dict(rate_limit_unit="bytes"), "rate_limit_unit"),
        (dict(redis_url="localhost:6379"), "redis_url"),
        (dict(redis_timeout_s=0), "redis_timeout_s"),
        (dict(redis_max_connections=0), "redis_max_connections"),
        (dict(redis_recover_after=0), "redis_recover_after"),
        (dict(degraded_limit_share=1.5), "degraded_limit_share"),
        (dict(stats_staleness_s=-1), "stats_staleness_s"),
        (dict(redis_key_prefix="a{b}"), "redis_key_prefix"),
        (dict(routing="random"), "routing"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        RouterConfig(**kwargs)
    assert info.value.field == field


def test_config_is_frozen_and_resolves_limits() -> None:
    config = RouterConfig(
        ttft_slo_ms=1500,
        slo_margin=0.2,
        default_rate_limit=TenantLimit(5, 50),
        tenant_rate_limits={"a": TenantLimit(1, 2)},
    )
    assert config.shed_threshold_s == pytest.approx(1.8)
    assert config.limit_for("a") == TenantLimit(1, 2)
    assert config.limit_for("b") == TenantLimit(5, 50)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.__setattr__("ttft_slo_ms", 1.0)
    with pytest.raises(TypeError):
        cast(dict[str, TenantLimit], config.tenant_rate_limits)["c"] = TenantLimit(1, 1)
