"""Replica count from offered load and measured capacity: the autoscaler's pure core.

Why in the shared contracts: three parts must agree on it. The router measures the offered load and
publishes it (`OfferedLoad`, JSON in Redis under `offered_key`); the operator sizes a ModelDeployment
from it (`spec.autoscaling`); `chariot up --min-replicas/--max-replicas` sizes its local replica
processes with the very same code. Nothing here does I/O or reads a clock: every function takes `now`
and returns a new value, so the rules are unit-testable for every case (docs/kubernetes.md,
"Autoscaling", documents them for users).

The formula (one recommendation per look at the load):

    work      = prompt tokens/s + output tokens/s offered at the routers (a batch slot per token)
    capacity  = tokens/s one group sustains at the SLO's token budget (median of the measured groups)
    raw       = ceil(work / (capacity * targetUtilization))
    raw       = max(raw, current + shedStep)       while the routers shed requests
    raw       = max(raw, 1)                        while requests wait for a first group (scale from zero)
    raw       = clamp(raw, minReplicas, maxReplicas)

and the stabilisation of Kubernetes' HPA (behavior.scaleUp/scaleDown.stabilizationWindowSeconds):
recommendations are kept for the longer window; the count rises only to the *lowest* recommendation
of the last `scaleUpStabilizationSeconds` and falls only to the *highest* of the last
`scaleDownStabilizationSeconds`. So a rise must persist for the whole scale-up window, and after any
scale-up nothing scales down until that recommendation has left the scale-down window: noise makes
no flapping. With no recommendation in the windows yet (the first look), the running count stands in
for them as if recommended just before, so a fresh autoscaler does not scale down at once (nor up,
unless the scale-up window is 0). A count outside the bounds moves into
them at once (reason `Bounded`).

Without a measured capacity (no group has served a prompt yet) the work term is unknown: the count
holds (reason `NoCapacity`), except for the shed step and scale from zero, which need no capacity.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from chariot.contracts.errors import ConfigError

__all__ = [
    "OFFERED_KEY_KIND",
    "AutoscalingPolicy",
    "OfferedLoad",
    "Recommendation",
    "ScaleDecision",
    "decide",
    "merge_offered",
    "offered_key",
    "offered_pattern",
    "recommend",
    "replica_capacity",
]

OFFERED_KEY_KIND = "offered"
SEED_AGE_S = 1e-3  # how long before a first look the running count is taken to have been recommended
# Reasons of a decision (status.autoscaling.reason, the Events' reason, `chariot up`'s log lines).
REASONS = ("ScaleUp", "ScaleDown", "Stable", "Stabilizing", "Bounded", "NoCapacity", "ScaleFromZero")


def _number(name: str, value: object, low: float, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not low <= value <= high:
        bound = f"in [{low:g}, {high:g}]" if math.isfinite(high) else f">= {low:g}"
        raise ConfigError(name, f"must be a finite number {bound}, got {value!r}")
    return float(value)


def _integer(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(name, f"must be an integer >= {low}, got {value!r}")
    return value


@dataclass(frozen=True)
class AutoscalingPolicy:
    """`spec.autoscaling` (or `chariot up --min-replicas/--max-replicas`), validated once.

    Field names in errors are the CRD's (`minReplicas`, ...), prefixed by `field_prefix`."""

    min_replicas: int = 1
    max_replicas: int = 1
    target_utilization: float = 0.7
    scale_up_stabilization_s: float = 0.0
    scale_down_stabilization_s: float = 300.0
    shed_step: int = 1
    drain_grace_s: float = 120.0
    field_prefix: str = field(default="autoscaling", compare=False)

    def __post_init__(self) -> None:
        p = self.field_prefix
        _integer(f"{p}.minReplicas", self.min_replicas, 0)
        _integer(f"{p}.maxReplicas", self.max_replicas, 1)
        if self.max_replicas < self.min_replicas:
            raise ConfigError(f"{p}.maxReplicas", f"must be >= minReplicas ({self.min_replicas}), "
                                                  f"got {self.max_replicas}")
        _number(f"{p}.targetUtilization", self.target_utilization, 0.01, 1.0)
        _number(f"{p}.scaleUpStabilizationSeconds", self.scale_up_stabilization_s, 0.0, 3600.0)
        _number(f"{p}.scaleDownStabilizationSeconds", self.scale_down_stabilization_s, 0.0, 3600.0)
        _integer(f"{p}.shedStep", self.shed_step, 1)
        _number(f"{p}.drainGracePeriodSeconds", self.drain_grace_s, 0.0, 3600.0)

    @property
    def history_s(self) -> float:
        """How long recommendations must be kept: the longer stabilisation window."""
        return max(self.scale_up_stabilization_s, self.scale_down_stabilization_s)

    def bound(self, replicas: int) -> int:
        return min(max(replicas, self.min_replicas), self.max_replicas)


def replica_capacity(token_budget: int, budget_tokens_per_s: float, tbt_slo_s: float) -> float:
    """Tokens per second one group sustains at its SLO budget.

    Measured once the group has run steps of at least two batch sizes (`budget_tokens_per_s`: its
    step seconds fitted as a line in batch tokens, read at the budget; prefill and decode tokens
    alike, as the offered work counts them); before that, the budget model: a full `token_budget`
    batch per TBT period, which is how the budget was chosen (docs/architecture.md, "Token budget
    from the SLO"). 0.0 when neither is known."""
    if budget_tokens_per_s > 0:
        return float(budget_tokens_per_s)
    if token_budget > 0 and tbt_slo_s > 0:
        return token_budget / tbt_slo_s
    return 0.0


@dataclass(frozen=True)
class OfferedLoad:
    """What the routers saw over their sliding window, summed over routers.

    Rates are per second over `window_s`: `arrival_rate` counts every request that arrived (admitted
    or shed), `prompt_token_rate` their prompt tokens, `output_token_rate` the tokens the replicas
    generated, `shed_rate` the requests refused for load (SLO or queue). `capacity` is each replica's
    measured tokens/s (`replica_capacity`); `in_flight` each replica's admitted, unfinished requests
    (also of replicas no longer routed to); `replicas` the replicas the routers route to (a group
    being drained may go once it is in neither); `held` counts requests waiting for a first ready
    replica (scale from zero); `routers` how many routers contributed.
    """

    window_s: float = 0.0
    arrival_rate: float = 0.0
    prompt_token_rate: float = 0.0
    output_token_rate: float = 0.0
    shed_rate: float = 0.0
    held: int = 0
    capacity: Mapping[str, float] = field(default_factory=dict, hash=False)
    in_flight: Mapping[str, int] = field(default_factory=dict, hash=False)
    routers: int = 1
    replicas: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "capacity", MappingProxyType(dict(self.capacity)))
        object.__setattr__(self, "in_flight", MappingProxyType(dict(self.in_flight)))
        object.__setattr__(self, "replicas", tuple(sorted(set(self.replicas))))

    def idle(self, replica: str) -> bool:
        """No router routes to `replica` any more and none of its requests is in flight: it may go."""
        return replica not in self.replicas and self.in_flight.get(replica, 0) == 0

    @property
    def work_rate(self) -> float:
        """Batch tokens per second asked of the deployment: prompt plus output tokens."""
        return self.prompt_token_rate + self.output_token_rate

    @property
    def shedding(self) -> bool:
        return self.shed_rate > 0

    def group_capacity(self) -> float:
        """The median measured capacity of one group (0.0: none measured)."""
        measured = [c for c in self.capacity.values() if c > 0]
        return float(statistics.median(measured)) if measured else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"windowSeconds": self.window_s, "arrivalRate": self.arrival_rate,
                "promptTokenRate": self.prompt_token_rate, "outputTokenRate": self.output_token_rate,
                "shedRate": self.shed_rate, "held": self.held, "capacity": dict(self.capacity),
                "inFlight": dict(self.in_flight), "routers": self.routers, "replicas": list(self.replicas)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> OfferedLoad:
        """The inverse of `to_dict`; raises ValueError for a malformed snapshot."""
        try:
            return cls(window_s=float(raw["windowSeconds"]), arrival_rate=float(raw["arrivalRate"]),
                       prompt_token_rate=float(raw["promptTokenRate"]),
                       output_token_rate=float(raw["outputTokenRate"]), shed_rate=float(raw["shedRate"]),
                       held=int(raw.get("held", 0)),
                       capacity={str(k): float(v) for k, v in (raw.get("capacity") or {}).items()},
                       in_flight={str(k): int(v) for k, v in (raw.get("inFlight") or {}).items()},
                       routers=int(raw.get("routers", 1)), replicas=tuple(map(str, raw.get("replicas") or ())))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not an offered-load snapshot: {exc!r}") from exc

    @classmethod
    def from_json(cls, text: str) -> OfferedLoad:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("not an offered-load snapshot: expected a JSON object")
        return cls.from_dict(raw)


def merge_offered(snapshots: Iterable[OfferedLoad]) -> OfferedLoad | None:
    """Every router's snapshot as one: rates, held and in-flight counts add up; a replica's capacity is
    the highest any router reports (each measures the same replica). None without snapshots."""
    parts = list(snapshots)
    if not parts:
        return None
    capacity: dict[str, float] = {}
    in_flight: dict[str, int] = {}
    for part in parts:
        for name, value in part.capacity.items():
            capacity[name] = max(capacity.get(name, 0.0), value)
        for name, count in part.in_flight.items():
            in_flight[name] = in_flight.get(name, 0) + count
    return OfferedLoad(window_s=max(p.window_s for p in parts), arrival_rate=sum(p.arrival_rate for p in parts),
                       prompt_token_rate=sum(p.prompt_token_rate for p in parts),
                       output_token_rate=sum(p.output_token_rate for p in parts),
                       shed_rate=sum(p.shed_rate for p in parts), held=sum(p.held for p in parts),
                       capacity=capacity, in_flight=in_flight, routers=sum(p.routers for p in parts),
                       replicas=tuple(name for p in parts for name in p.replicas))


def offered_key(prefix: str, router_id: str) -> str:
    """The Redis key one router publishes its snapshot under (the router state's hash tag, so it
    shares their Redis Cluster slot)."""
    return "{" + prefix + "}:" + OFFERED_KEY_KIND + ":" + router_id


def offered_pattern(prefix: str) -> str:
    """The SCAN pattern of every router's snapshot key (braces escaped for glob matching)."""
    return "\\{" + prefix + "\\}:" + OFFERED_KEY_KIND + ":*"


# --- the decision ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recommendation:
    """One look at the load: at `time` (seconds, the caller's clock) the formula asked for `replicas`."""

    time: float
    replicas: int

    def to_dict(self) -> dict[str, Any]:
        return {"time": self.time, "replicas": self.replicas}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Recommendation:
        return cls(float(raw["time"]), int(raw["replicas"]))


@dataclass(frozen=True)
class ScaleDecision:
    """What to run now, and why. `history` is the recommendations to pass to the next `decide`."""

    desired: int
    current: int
    recommended: int
    reason: str
    message: str
    work_rate: float
    group_capacity: float
    history: tuple[Recommendation, ...] = ()

    @property
    def changed(self) -> bool:
        return self.desired != self.current


def recommend(load: OfferedLoad | None, current: int, policy: AutoscalingPolicy) -> tuple[int, str]:
    """The formula's count (bounded) and what drove it: "work", "shed", "held", "none" (no load known,
    or no capacity measured: the current count is kept)."""
    base, why = current, "none"
    if load is not None:
        capacity = load.group_capacity()
        if capacity > 0:
            base, why = math.ceil(load.work_rate / (capacity * policy.target_utilization) * (1 - 1e-9)), "work"
        if load.shedding and current + policy.shed_step > base:
            base, why = current + policy.shed_step, "shed"
        if load.held > 0 and base < 1:
            base, why = 1, "held"
    return policy.bound(base), why


def decide(load: OfferedLoad | None, current: int, policy: AutoscalingPolicy, now: float,
           history: Iterable[Recommendation] = ()) -> ScaleDecision:
    """The replica count to run at `now`, given the last recommendations (see the module docstring)."""
    raw, why = recommend(load, current, policy)
    kept = tuple(r for r in history if now - r.time <= policy.history_s and r.time <= now)
    if not kept:  # a first look (or one after a long gap): the running count counts as recommended until now
        kept = (Recommendation(now - SEED_AGE_S, current),)
    kept = (*kept, Recommendation(now, raw))
    up = min(r.replicas for r in kept if now - r.time <= policy.scale_up_stabilization_s)
    down = max(r.replicas for r in kept if now - r.time <= policy.scale_down_stabilization_s)
    desired = current
    if desired < up:
        desired = up
    if desired > down:
        desired = down
    if why == "held":
        desired = max(desired, raw)  # a held request waits for no stabilisation window
    desired = policy.bound(desired)
    work = load.work_rate if load is not None else 0.0
    capacity = load.group_capacity() if load is not None else 0.0
    reason, message = _explain(current, desired, raw, why, work, capacity, policy, load)
    return ScaleDecision(desired, current, raw, reason, message, work, capacity, _compact(kept))


def _explain(current: int, desired: int, raw: int, why: str, work: float, capacity: float,
             policy: AutoscalingPolicy, load: OfferedLoad | None) -> tuple[str, str]:
    inputs = f"offered {work:.1f} tokens/s, group capacity {capacity:.1f} tokens/s, target " \
             f"{policy.target_utilization:g}"
    if current != policy.bound(current):
        return "Bounded", f"{current} replicas is outside [{policy.min_replicas}, {policy.max_replicas}]: {desired}"
    if why == "held" and desired > current:
        return "ScaleFromZero", f"{load.held if load else 0} request(s) wait for a replica: scaling from 0 to {desired}"
    if desired > current:
        cause = f"the routers shed {load.shed_rate:.2f} requests/s" if why == "shed" and load else inputs
        return "ScaleUp", f"{current} -> {desired}: {cause}"
    if desired < current:
        return "ScaleDown", f"{current} -> {desired}: {inputs}"
    if why == "none" and raw == current:
        return "NoCapacity", f"holding {current}: no group has measured its capacity yet" if load is not None \
            else f"holding {current}: no offered load reported (routers down or not sharing through Redis)"
    if raw != current:
        window = policy.scale_up_stabilization_s if raw > current else policy.scale_down_stabilization_s
        return "Stabilizing", f"holding {current} (the load asks for {raw}) within the {window:g}s stabilization " \
                              f"window; {inputs}"
    return "Stable", f"{current} replicas: {inputs}"


def _compact(kept: tuple[Recommendation, ...], limit: int = 64) -> tuple[Recommendation, ...]:
    """At most `limit` recommendations, dropping a run's middle entries first (a run of equal counts
    only needs its first and last time for both windows), then the oldest."""
    out: list[Recommendation] = []
    for r in kept:
        if len(out) >= 2 and out[-1].replicas == r.replicas == out[-2].replicas:
            out[-1] = r
        else:
            out.append(r)
    return tuple(out[-limit:])
