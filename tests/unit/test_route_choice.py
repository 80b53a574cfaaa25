"""Prefix-aware routing on fake replica states: a cache hit is fewer prefill tokens in the TTFT
prediction, never a reason to breach the SLO; ties and unknown prefixes go by load; the session hint
only within the SLO and the margin; the routing reasons."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from chariot.contracts.errors import AdmissionRejected
from chariot.router.admission import AdmissionController, Decision, Prediction, route_order
from chariot.router.config import RouterConfig
from chariot.router.registry import ReplicaLoad, ReplicaRegistry, ReplicaSpec
from chariot.router.state import LocalState


class Router:
    """An admission controller over fake load reports (1000 prefill tokens/s, 50 ms iterations)."""

    def __init__(self, replicas: dict[str, dict[str, Any]], **config: Any) -> None:
        self.now = 1000.0
        self.config = RouterConfig(**config)
        self.registry = ReplicaRegistry([ReplicaSpec(n, f"10.0.0.{i + 1}:50051") for i, n in enumerate(replicas)],
                                        staleness_s=self.config.stats_staleness_s, clock=lambda: self.now)
        self.controller = AdmissionController(self.config, self.registry, LocalState(lambda: self.now),
                                              clock=lambda: self.now)
        for name, fields in replicas.items():
            self.report(name, **fields)

    def report(self, name: str, **fields: Any) -> None:
        load: dict[str, Any] = dict(token_budget=512, prefill_tokens_per_s=1000.0, last_iteration_s=0.05,
                                    max_model_len=8192)
        load.update(fields)
        self.registry.update_load(name, ReplicaLoad(reported_at=self.now, **load))

    def decide(self, prompt_tokens: int, **kw: Any) -> Decision:
        return asyncio.run(self.controller.decide(prompt_tokens, **kw))

    def finish(self, decision: Decision) -> None:
        asyncio.run(self.controller.on_finish(decision))


def pred(replica: str, ttft_s: float, cached: int = 0, depth: int = 0) -> Prediction:
    return Prediction(replica, ttft_s, ttft_s, 0, 1000.0, depth, cached)


# --- the choice function ----------------------------------------------------------------------------


def test_route_order_reasons() -> None:
    a, b = pred("a", 0.2, cached=512), pred("b", 0.6)
    assert [(p.replica, r) for p, r in route_order([a, b], [a, b])] == [("a", "prefix"), ("b", "load")]
    # same cache everywhere (a shared system prompt on both): load decided
    a, b = pred("a", 0.2, cached=64), pred("b", 0.3, cached=64)
    assert [r for _, r in route_order([a, b], [a, b])] == ["load", "load"]
    # the holder of the longest prefix is not admissible: the others are a fallback
    a, b = pred("a", 0.3), pred("b", 2.5, cached=1024)
    assert route_order([a], [a, b]) == [(a, "fallback")]
    # the holder is admissible but slower (its queue outweighs the hit): load
    assert route_order([a, b], [a, b])[0] == (a, "load")


def test_route_order_affinity_within_margin_only() -> None:
    a, b = pred("a", 0.20), pred("b", 0.23)
    assert route_order([a, b], [a, b], affinity="b", affinity_margin_s=0.05) == [(b, "affinity"), (a, "load")]
    assert route_order([a, b], [a, b], affinity="b", affinity_margin_s=0.01) == [(a, "load"), (b, "load")]
    # the session's replica is already the best: its own reason
    c = pred("a", 0.1, cached=256)
    assert route_order([c, b], [c, b], affinity="a", affinity_margin_s=0.05)[0] == (c, "prefix")
    # not a candidate (over the SLO or full): ignored
    assert route_order([a], [a, b], affinity="b", affinity_margin_s=10.0) == [(a, "load")]
    assert route_order([a, b], [a, b], affinity="gone", affinity_margin_s=10.0)[0] == (a, "load")


# --- decisions ----------------------------------------------------------------------------------------


def test_cache_hit_lowers_the_prediction_and_wins_the_replica() -> None:
    r = Router({"a": dict(queued_prefill_tokens=200), "b": {}})
    d = r.decide(1000, cached_tokens={"a": 960})
    assert (d.replica_name, d.reason, d.cached_tokens) == ("a", "prefix", 960)
    assert d.predicted_ttft_s == pytest.approx(0.05 + (200 + 1000 - 960) / 1000.0)
    # the pending prefill it adds is what a computes, not the whole prompt
    assert {v.name: v.unprefilled_tokens for v in r.registry.snapshot()} == {"a": 40, "b": 0}


def test_cache_hit_does_not_outweigh_a_longer_queue() -> None:
    r = Router({"a": dict(queued_prefill_tokens=1500), "b": {}})
    d = r.decide(1000, cached_tokens={"a": 960})
    assert (d.replica_name, d.reason, d.cached_tokens) == ("b", "load", 0)


def test_replica_over_the_slo_is_not_chosen_for_its_cache() -> None:
    # a holds the whole history but its queue alone breaches the 2 s SLO; b has none of it and meets it
    r = Router({"a": dict(queued_prefill_tokens=3000), "b": dict(queued_prefill_tokens=500)})
    d = r.decide(1200, cached_tokens={"a": 1184})
    assert (d.replica_name, d.reason, d.cached_tokens) == ("b", "fallback", 0)
    assert d.predicted_ttft_s == pytest.approx(0.05 + 1.7)


def test_cache_does_not_rescue_a_shed() -> None:
    r = Router({"a": dict(queued_prefill_tokens=3000), "b": dict(queued_prefill_tokens=3000)})
    with pytest.raises(AdmissionRejected) as info:
        r.decide(1200, cached_tokens={"a": 1184, "b": 1184})
    assert info.value.reason == "slo"


def test_unknown_prefix_and_ties_go_by_load() -> None:
    r = Router({"a": {}, "b": {}, "c": {}})
    seen = [r.decide(100, cached_tokens={}) for _ in range(3)]
    # equal predictions: the shorter queue (this router's in-flight count) wins, so they spread
    assert sorted(d.replica_name for d in seen) == ["a", "b", "c"]
    assert {d.reason for d in seen} == {"load"}
    for d in seen:
        r.finish(d)
    # equal hits everywhere: as if none
    assert r.decide(100, cached_tokens={"a": 64, "b": 64, "c": 64}).reason == "load"


def test_session_affinity_within_margin_and_slo() -> None:
    r = Router({"a": {}, "b": {}}, affinity_margin_ms=100.0)
    first = r.decide(100, session="s1")
    r.finish(first)
    other = "b" if first.replica_name == "a" else "a"
    assert r.controller.session_replica("s1") == first.replica_name
    # a little more load on the session's replica: still preferred (within 100 ms)
    r.report(first.replica_name, queued_prefill_tokens=50)
    again = r.decide(100, session="s1")
    assert (again.replica_name, again.reason) == (first.replica_name, "affinity")
    r.finish(again)
    # a much better replica elsewhere (past the margin): the best wins, and the session moves there
    r.report(first.replica_name, queued_prefill_tokens=500)
    moved = r.decide(100, session="s1")
    assert (moved.replica_name, moved.reason) == (other, "load")
    r.finish(moved)
    assert r.controller.session_replica("s1") == other


def test_session_affinity_never_breaches_the_slo() -> None:
    r = Router({"a": {}, "b": {}}, affinity_margin_ms=10_000.0)
    first = r.decide(100, session="s")
    r.finish(first)
    r.report(first.replica_name, queued_prefill_tokens=5000)  # 5 s of queue: over the 2 s SLO
    d = r.decide(100, session="s")
    assert d.replica_name != first.replica_name and d.reason == "load"


def test_sessions_are_bounded_and_can_be_off() -> None:
    r = Router({"a": {}, "b": {}}, max_sessions=2)
    for s in ("s1", "s2", "s3"):
        r.finish(r.decide(10, session=s))
    assert r.controller.session_replica("s1") is None and r.controller.session_replica("s3") is not None
    off = Router({"a": {}}, affinity_margin_ms=0.0)
    off.finish(off.decide(10, session="s"))
    assert off.controller.session_replica("s") is None


# --- the baseline modes -------------------------------------------------------------------------------

def test_load_mode_ignores_cache_and_sessions() -> None:
    r = Router({"a": dict(queued_prefill_tokens=200), "b": {}}, routing="load")
    d = r.decide(1000, cached_tokens={"a": 960}, session="s")
    # as if nothing were cached: b's empty queue wins, and the whole prompt counts as pending on it
    assert (d.replica_name, d.reason, d.cached_tokens) == ("b", "load", 0)
    assert d.predicted_ttft_s == pytest.approx(1000 / 1000.0)  # b is idle: no iteration to wait for
    assert {v.name: v.unprefilled_tokens for v in r.registry.snapshot()} == {"a": 0, "b": 1000}
    assert r.controller.session_replica("s") is None


def test_round_robin_takes_replicas_in_turn_and_skips_inadmissible_ones() -> None:
    r = Router({"a": {}, "b": dict(queued_prefill_tokens=500), "c": {}}, routing="round_robin")
    picks = []
    for _ in range(6):
        d = r.decide(100, cached_tokens={"c": 96})
        picks.append(d.replica_name)
        assert d.reason == "round_robin" and d.cached_tokens in (0, 96)
        r.finish(d)
    assert picks == ["a", "b", "c"] * 2  # neither load nor cache changes the turn
    r.report("b", queued_prefill_tokens=5000)  # b now breaches the SLO: its turn passes to the next one
    assert [r.decide(100).replica_name for _ in range(3)] == ["a", "c", "c"]


def test_round_robin_sheds_like_the_other_modes() -> None:
    r = Router({"a": dict(queued_prefill_tokens=5000), "b": dict(queued_prefill_tokens=5000)}, routing="round_robin")
    with pytest.raises(AdmissionRejected) as info:
        r.decide(100)
    assert info.value.reason == "slo"
