"""The operator's side of `spec.autoscaling`: read the routers' offered load from Redis, spot a
HorizontalPodAutoscaler on the same object, and turn a decision into status.

Why a module of its own: the decision itself is the shared pure function
(`chariot.contracts.autoscaling.decide`, also used by `chariot up`); what is left for the operator
is reading its inputs and reporting its outputs, kept here so `controller.py` only sequences them.

- Offered load: every router of a deployment writes a JSON snapshot to
  `{chariot:<namespace>:<name>}:offered:<router id>` (`chariot.router.offered_load`; the prefix is
  `render.redis_key_prefix`, passed to the routers as `--redis-key-prefix`); `RedisOfferedLoad`
  reads them all (SCAN + MGET) and sums them (`merge_offered`). Snapshots expire on their own when
  a router dies.
- An HPA (autoscaling/v2) whose `scaleTargetRef` is this ModelDeployment also writes
  `spec.replicas` through the scale subresource: two writers would fight, so while one exists the
  operator does not scale, and says so (`ScalingActive=False`, reason `HPAConflict`, and an Event).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from chariot.contracts.autoscaling import OfferedLoad, ScaleDecision, merge_offered, offered_pattern
from chariot.operator import crd
from chariot.operator.reconcile import format_time

log = logging.getLogger("chariot.operator")
Manifest = dict[str, Any]
OfferedLoadSource = Callable[[str, str], OfferedLoad | None]  # (Redis URL, key prefix) -> merged snapshot

HPA_CONFLICT = "HPAConflict"
NO_OFFERED_LOAD = "NoOfferedLoad"
SCALING_ACTIVE = "ScalingActive"
EVENT_REASONS = ("ScaleUp", "ScaleDown", "ScaleFromZero", "Bounded")  # decisions that changed spec.replicas


class RedisOfferedLoad:
    """Reads and merges every router's snapshot; one client per Redis URL, short timeouts (a pass must
    not hang on Redis). Raises what redis-py raises; the controller reports it."""

    def __init__(self, timeout_s: float = 1.0) -> None:
        self._timeout_s = timeout_s
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _client(self, url: str) -> Any:
        import redis

        with self._lock:
            if url not in self._clients:
                self._clients[url] = redis.Redis.from_url(url, socket_timeout=self._timeout_s,
                                                          socket_connect_timeout=self._timeout_s,
                                                          decode_responses=True)
            return self._clients[url]

    def __call__(self, url: str, prefix: str) -> OfferedLoad | None:
        client = self._client(url)
        keys = sorted(client.scan_iter(match=offered_pattern(prefix), count=256))
        values = client.mget(keys) if keys else []
        return merge_offered(_parse(keys, values))


def _parse(keys: Iterable[str], values: Iterable[str | None]) -> list[OfferedLoad]:
    out = []
    for key, value in zip(keys, values, strict=False):
        if value is None:  # expired between SCAN and MGET
            continue
        try:
            out.append(OfferedLoad.from_json(value))
        except ValueError as exc:
            log.warning("ignoring a malformed offered-load snapshot at %s: %s", key, exc)
    return out


def conflicting_hpas(hpas: Iterable[Manifest], name: str) -> list[str]:
    """Names of the HorizontalPodAutoscalers whose target is the ModelDeployment `name`."""
    out = []
    for hpa in hpas:
        target = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
        group = str(target.get("apiVersion", "")).split("/")[0]
        if target.get("kind") == crd.KIND and target.get("name") == name and group in ("", crd.GROUP):
            out.append(hpa["metadata"]["name"])
    return sorted(out)


def autoscaling_status(decision: ScaleDecision, load: OfferedLoad | None, now: float,
                       last_scale: str | None) -> Manifest:
    """`status.autoscaling` for one decision."""
    inputs: Manifest = {"workRate": round(decision.work_rate, 3), "groupCapacity": round(decision.group_capacity, 3)}
    if load is not None:
        inputs.update(arrivalRate=round(load.arrival_rate, 3), promptTokenRate=round(load.prompt_token_rate, 3),
                      outputTokenRate=round(load.output_token_rate, 3), shedRate=round(load.shed_rate, 3),
                      held=load.held, routers=load.routers)
    status: Manifest = {
        "desiredReplicas": decision.desired, "currentReplicas": decision.current,
        "recommendedReplicas": decision.recommended, "reason": decision.reason, "message": decision.message,
        "lastDecisionTime": format_time(now), "inputs": inputs,
        "recommendations": [{"time": round(r.time, 3), "replicas": r.replicas} for r in decision.history]}
    if decision.changed:
        status["lastScaleTime"] = format_time(now)
    elif last_scale:
        status["lastScaleTime"] = last_scale
    return status


def event(owner_name: str, namespace: str, uid: str, reason: str, message: str, now: float,
          sequence: int, warning: bool = False) -> Manifest:
    """A core/v1 Event about the ModelDeployment (what `kubectl describe mdep` and `kubectl events` show)."""
    stamp = format_time(now)
    return {"apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{owner_name}.autoscaler.{int(now * 1000):x}.{sequence}", "namespace": namespace},
            "involvedObject": {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": owner_name,
                               "namespace": namespace, "uid": uid},
            "reason": reason, "message": message[:1024], "type": "Warning" if warning else "Normal",
            "source": {"component": "chariot-operator"}, "reportingComponent": "chariot-operator",
            "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1}
