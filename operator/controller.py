"""One reconcile pass for one ModelDeployment: read, plan (pure), act, report.

Why a class between kopf and the pure functions: kopf calls in from several places (spec changes,
a resync timer, events of owned pods and the router Deployment) on a thread pool; passes for one
deployment must not interleave, and every pass must start from fresh state — so each pass takes the
deployment's lock and re-reads the object instead of trusting the (possibly stale) body it was
handed. Nothing here is kopf-specific: `handlers.py` maps the `Outcome` to kopf's retry errors.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from chariot.contracts.autoscaling import OfferedLoad, Recommendation, ScaleDecision, decide
from chariot.contracts.telemetry import Telemetry
from chariot.operator import crd
from chariot.operator.autoscaler import (
    EVENT_REASONS,
    HPA_CONFLICT,
    NO_OFFERED_LOAD,
    SCALING_ACTIVE,
    OfferedLoadSource,
    RedisOfferedLoad,
    autoscaling_status,
    conflicting_hpas,
    event,
)
from chariot.operator.kube import ApiError, Kube, Ref
from chariot.operator.reconcile import (
    Backoff,
    Condition,
    Drain,
    GroupStatus,
    Plan,
    PodState,
    conditions_to_dicts,
    drain_release,
    format_time,
    group_conditions,
    invalid_conditions,
    plan_groups,
)
from chariot.operator.render import (
    ANNOTATION_APPLIED_HASH,
    Owner,
    config_hash,
    disruption_budget_selector,
    disruption_budgets,
    endpoint,
    group_pods,
    group_selector,
    network_policies,
    network_policy_selector,
    redis_key_prefix,
    replica_name,
    router_name,
    scale_selector,
    shared_object_names,
    shared_objects,
    stage_pod,
    with_applied_hash,
)
from chariot.operator.spec import InvalidSpec, Spec, parse_spec

log = logging.getLogger("chariot.operator")
Manifest = dict[str, Any]
DEFAULT_IMAGE = "ghcr.io/chariot-serving/chariot:0.1.0"


@dataclass(frozen=True)
class Settings:
    default_image: str = DEFAULT_IMAGE
    default_redis_url: str | None = None
    backoff: Backoff = field(default_factory=Backoff)
    resync_s: float = 30.0
    autoscale_s: float = 5.0  # how often deployments with spec.autoscaling look at their load


@dataclass(frozen=True)
class Outcome:
    """How a pass ended: `converged` = nothing left to do; otherwise look again after `requeue_after`."""

    converged: bool
    message: str
    requeue_after: float | None = None
    invalid: InvalidSpec | None = None


@dataclass(frozen=True)
class Autoscaled:
    """The autoscaling step's outcome for one pass: the spec to act on (its `replicas` as decided), the
    `status.autoscaling` to write and the `ScalingActive` condition (both None without autoscaling)."""

    spec: Spec
    generation: int
    status: Manifest | None = None
    condition: Condition | None = None


class Controller:
    def __init__(self, kube: Kube, settings: Settings, clock: Callable[[], float] = time.time,
                 offered_load: OfferedLoadSource | None = None, telemetry: Telemetry | None = None) -> None:
        self.kube = kube
        self.settings = settings
        self.clock = clock
        self.offered_load: OfferedLoadSource = offered_load or RedisOfferedLoad()
        self.telemetry = telemetry  # the autoscaler's metrics (`chariot_autoscaler_*`), when served
        self._events = 0
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def _lock(self, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    # --- entry points ----------------------------------------------------------------------------

    def reconcile(self, namespace: str, name: str) -> Outcome:
        """Bring the objects of ModelDeployment `namespace/name` in line with its spec, then write status."""
        with self._lock(namespace, name):
            body = self.kube.get(Ref(crd.KIND, namespace, name))
            if body is None or body["metadata"].get("deletionTimestamp"):
                return Outcome(True, "gone or being deleted")
            return self._reconcile(body)

    def cleanup(self, namespace: str, name: str) -> int:
        """Delete every object the deployment owns (no reliance on garbage collection); returns the stage
        pods still terminating, so the caller keeps the finalizer until they are gone."""
        owner = Owner(name=name, namespace=namespace, uid="")
        with self._lock(namespace, name):
            pods = self.kube.list(Ref("Pod", namespace), group_selector(owner))
            for pod in pods:
                if not pod["metadata"].get("deletionTimestamp"):
                    self.kube.delete(Ref("Pod", namespace, pod["metadata"]["name"]))
            for kind, object_name in shared_object_names(owner):
                self.kube.delete(Ref(kind, namespace, object_name))
            for kind, selector in (("NetworkPolicy", network_policy_selector(owner)),
                                   ("PodDisruptionBudget", disruption_budget_selector(owner))):
                for obj in self.kube.list(Ref(kind, namespace), selector):
                    self.kube.delete(Ref(kind, namespace, obj["metadata"]["name"]))
            remaining = len(self.kube.list(Ref("Pod", namespace), group_selector(owner)))
            log.info("cleanup of %s/%s: %d stage pod(s) still terminating", namespace, name, remaining)
            return remaining

    # --- one pass --------------------------------------------------------------------------------

    def _reconcile(self, body: Manifest) -> Outcome:
        owner = Owner.from_body(body)
        generation = int(body["metadata"].get("generation") or 0)
        old_status = body.get("status") or {}
        try:
            spec = parse_spec(body.get("spec"), owner.name)
        except InvalidSpec as exc:
            self._write_status(owner, old_status, self._invalid_status(old_status, exc, generation))
            return Outcome(False, str(exc), invalid=exc)
        scaled = self._autoscale(owner, self._with_defaults(spec), generation, old_status)
        spec, generation = scaled.spec, scaled.generation
        self._record_autoscaler(owner, spec, scaled)
        image = spec.image or self.settings.default_image
        hash_ = config_hash(owner, spec, image)
        listed = self.kube.list(Ref("Pod", owner.namespace), group_selector(owner))
        pods = [p for p in (PodState.from_manifest(m) for m in listed) if p is not None]
        plan = self._plan(spec, hash_, pods, old_status, self._drain(owner, spec))
        groups = [g.index for g in plan.groups]
        self._apply_pruned(owner, "NetworkPolicy", network_policies(owner, groups),  # before a new group's pods
                           network_policy_selector(owner))
        released = drain_release(plan, pods, functools.cache(self._cordoned))  # each node read once a pass
        if released is not None:
            log.info("%s/%s: group %d has a stage on a cordoned node and every other group is Ready: its "
                     "disruption budget lets the drain evict it", owner.namespace, owner.name, released)
        self._apply_pruned(owner, "PodDisruptionBudget", disruption_budgets(owner, spec, groups, released),
                           disruption_budget_selector(owner))
        self._execute(owner, spec, image, hash_, plan, pods)
        for manifest in shared_objects(owner, spec, image, hash_, plan.ready_groups):
            self._apply(manifest)
        router_ready = self._router_ready(owner, spec)
        conditions = group_conditions(spec, plan, hash_, router_ready)
        if scaled.condition is not None:
            conditions.append(scaled.condition)
        status = self._status(owner, hash_, plan, generation, old_status, conditions)
        self._write_status(owner, old_status, {**status, "endpoint": endpoint(owner, spec),
                                               "autoscaling": scaled.status})
        converged = not plan.waiting and router_ready
        message = "; ".join(plan.waiting) or conditions[0].message
        return Outcome(converged, message, requeue_after=plan.requeue_after)

    # --- autoscaling -----------------------------------------------------------------------------

    def _autoscale(self, owner: Owner, spec: Spec, generation: int, old_status: Manifest) -> Autoscaled:
        """With `spec.autoscaling`: decide the replica count from the routers' offered load and patch
        `spec.replicas` when it changes (an Event records it); a HorizontalPodAutoscaler on the same
        object is reported, never fought."""
        policy = spec.autoscaling
        if policy is None:
            return Autoscaled(spec, generation)
        old = old_status.get("autoscaling") or {}
        now = self.clock()
        hpas = self._hpas(owner)
        if hpas:
            return self._hpa_conflict(owner, spec, generation, old, hpas, now)
        load, problem = self._offered(owner, spec)
        history = [Recommendation.from_dict(r) for r in old.get("recommendations") or []]
        decision = decide(load, spec.replicas, policy, now, history)
        if decision.changed:
            patched = self.kube.merge_patch(Ref(crd.KIND, owner.namespace, owner.name),
                                            {"spec": {"replicas": decision.desired}})
            generation = int((patched.get("metadata") or {}).get("generation") or generation)
            log.info("%s/%s: autoscaler %s: %s", owner.namespace, owner.name, decision.reason, decision.message)
            if decision.reason in EVENT_REASONS:
                self._event(owner, decision.reason, decision.message, now)
            spec = replace(spec, replicas=decision.desired)
        status = autoscaling_status(decision, load, now, old.get("lastScaleTime"))
        return Autoscaled(spec, generation, status, self._scaling_condition(decision, problem, status))

    def _record_autoscaler(self, owner: Owner, spec: Spec, scaled: Autoscaled) -> None:
        if self.telemetry is None:
            return
        name = f"{owner.namespace}/{owner.name}"
        if scaled.status is None:
            self.telemetry.record_autoscaler(name, "", None, spec.replicas)
        else:
            self.telemetry.record_autoscaler(name, scaled.status["reason"], scaled.status["desiredReplicas"],
                                             scaled.status["currentReplicas"])

    @staticmethod
    def _scaling_condition(decision: ScaleDecision, problem: str | None, status: Manifest) -> Condition:
        if problem is not None and decision.reason == "NoCapacity":
            status.update(reason=NO_OFFERED_LOAD, message=problem)
            return Condition(SCALING_ACTIVE, False, NO_OFFERED_LOAD, problem)
        return Condition(SCALING_ACTIVE, True, decision.reason, decision.message)

    def _hpa_conflict(self, owner: Owner, spec: Spec, generation: int, old: Manifest, hpas: list[str],
                      now: float) -> Autoscaled:
        message = (f"HorizontalPodAutoscaler {', '.join(hpas)} also scales this ModelDeployment; spec.autoscaling "
                   "is not applied while it exists (delete the HPA or remove spec.autoscaling)")
        if old.get("reason") != HPA_CONFLICT:
            log.warning("%s/%s: %s", owner.namespace, owner.name, message)
            self._event(owner, HPA_CONFLICT, message, now, warning=True)
        status = {"desiredReplicas": spec.replicas, "currentReplicas": spec.replicas, "reason": HPA_CONFLICT,
                  "message": message, "lastDecisionTime": old.get("lastDecisionTime") or format_time(now)}
        if old.get("lastScaleTime"):
            status["lastScaleTime"] = old["lastScaleTime"]
        return Autoscaled(spec, generation, status, Condition(SCALING_ACTIVE, False, HPA_CONFLICT, message))

    def _hpas(self, owner: Owner) -> list[str]:
        """HPAs targeting this deployment; none when they cannot be listed (RBAC of an older chart)."""
        try:
            listed = self.kube.list(Ref("HorizontalPodAutoscaler", owner.namespace), "")
        except ApiError as exc:
            if exc.status not in (403, 404):
                raise
            log.debug("cannot list HorizontalPodAutoscalers in %s: %s", owner.namespace, exc)
            return []
        return conflicting_hpas(listed, owner.name)

    def _offered(self, owner: Owner, spec: Spec) -> tuple[OfferedLoad | None, str | None]:
        """The routers' offered load, or None and why not."""
        url = spec.router.redis_url
        if url is None:
            return None, ("spec.autoscaling needs the routers' offered load, shared through Redis: set "
                          "spec.router.redis.url (or the operator's --redis-url)")
        try:
            load = self.offered_load(url, redis_key_prefix(owner))
        except Exception as exc:  # redis-py's errors, OSError: reported, the count holds
            return None, f"reading the offered load from Redis failed: {type(exc).__name__}: {exc}"
        if load is None:
            return None, "no router has reported its offered load yet"
        return load, None

    def _drain(self, owner: Owner, spec: Spec) -> Drain | None:
        """With autoscaling and Redis, a scale-down drains its groups first: a group may go once the
        routers' snapshots neither route to it nor hold a request on it (a Redis that cannot be read
        counts as not idle: the grace period still bounds the wait)."""
        if spec.autoscaling is None or spec.router.redis_url is None:
            return None
        url: str = spec.router.redis_url
        prefix = redis_key_prefix(owner)

        def idle(group: int) -> bool:
            try:
                load = self.offered_load(url, prefix)
            except Exception as exc:  # redis-py's errors, OSError
                log.warning("%s/%s: cannot read the routers' load to drain group %d: %s", owner.namespace,
                            owner.name, group, exc)
                return False
            return load is None or load.idle(replica_name(group))

        return Drain(spec.autoscaling.drain_grace_s, idle)

    def _event(self, owner: Owner, reason: str, message: str, now: float, warning: bool = False) -> None:
        self._events += 1
        manifest = event(owner.name, owner.namespace, owner.uid, reason, message, now, self._events, warning)
        try:
            self.kube.create(Ref("Event", owner.namespace), manifest)
        except ApiError as exc:  # an Event is a courtesy: never fail the pass for it
            log.warning("%s/%s: could not record event %s: %s", owner.namespace, owner.name, reason, exc)

    def _cordoned(self, name: str) -> bool:
        """Whether the node is marked unschedulable (what `kubectl drain` and `cordon` do first). Without
        permission to read nodes (an older chart's RBAC) it counts as not: budgets then never release."""
        try:
            node = self.kube.get(Ref("Node", "", name))
        except ApiError as exc:
            if exc.status != 403:
                raise
            log.warning("cannot read node %s (%s): drains wait for the group budgets", name, exc)
            return False
        return bool(node is not None and (node.get("spec") or {}).get("unschedulable"))

    def _with_defaults(self, spec: Spec) -> Spec:
        """Operator-wide defaults (chart values) for what the spec leaves open."""
        if spec.router.redis_url or not self.settings.default_redis_url:
            return spec
        return replace(spec, router=replace(spec.router, redis_url=self.settings.default_redis_url))

    def _plan(self, spec: Spec, hash_: str, pods: list[PodState], old_status: Manifest,
              drain: Drain | None = None) -> Plan:
        previous = {g.index: g for g in (GroupStatus.from_dict(x) for x in old_status.get("groups") or [])}
        return plan_groups(spec, hash_, pods, previous, self.clock(), self.settings.backoff, drain)

    def _execute(self, owner: Owner, spec: Spec, image: str, hash_: str, plan: Plan, pods: list[PodState]) -> None:
        for pod in pods:
            if (pod.group in plan.delete or pod.name in plan.delete_pods) and not pod.terminating:
                log.info("%s/%s: deleting pod %s", owner.namespace, owner.name, pod.name)
                self.kube.delete(Ref("Pod", owner.namespace, pod.name))
        for g, stages in plan.create_stages.items():
            log.info("%s/%s: group %d has not started: recreating stage pod(s) %s", owner.namespace, owner.name, g,
                     ", ".join(map(str, stages)))
            for s in stages:
                self.kube.create(Ref("Pod", owner.namespace), stage_pod(owner, spec, image, g, s, hash_))
        for g in plan.create:
            log.info("%s/%s: creating group %d (%d stages, config %s)", owner.namespace, owner.name, g,
                     spec.pipeline, hash_)
            for manifest in group_pods(owner, spec, image, g, hash_):
                self.kube.create(Ref("Pod", owner.namespace), manifest)

    def _apply_pruned(self, owner: Owner, kind: str, wanted: list[Manifest], selector: str) -> None:
        """Apply per-group objects (NetworkPolicies, PodDisruptionBudgets); those of groups that went
        away, or no longer wanted, are deleted."""
        for manifest in wanted:
            self._apply(manifest)
        names = {m["metadata"]["name"] for m in wanted}
        for live in self.kube.list(Ref(kind, owner.namespace), selector):
            if live["metadata"]["name"] not in names:
                self.kube.delete(Ref(kind, owner.namespace, live["metadata"]["name"]))

    def _apply(self, manifest: Manifest) -> None:
        """Create, or merge-patch when what we rendered last time differs; a no-op when nothing changed."""
        desired = with_applied_hash(manifest)
        meta = desired["metadata"]
        ref = Ref(desired["kind"], meta["namespace"], meta["name"])
        live = self.kube.get(ref)
        if live is None:
            self.kube.create(Ref(desired["kind"], meta["namespace"]), desired)
        elif (live["metadata"].get("annotations") or {}).get(ANNOTATION_APPLIED_HASH) != \
                meta["annotations"][ANNOTATION_APPLIED_HASH]:
            self.kube.merge_patch(ref, desired)

    def _router_ready(self, owner: Owner, spec: Spec) -> bool:
        if spec.router.replicas == 0:
            return True
        deployment = self.kube.get(Ref("Deployment", owner.namespace, router_name(owner))) or {}
        available = (deployment.get("status") or {}).get("availableReplicas") or 0
        return bool(available >= spec.router.replicas)

    # --- status ----------------------------------------------------------------------------------

    def _status(self, owner: Owner, hash_: str, plan: Plan, generation: int, old: Manifest,
                conditions: list[Condition]) -> Manifest:
        existing = [g for g in plan.groups if g.pods]
        return {
            "observedGeneration": generation,
            "replicas": len(existing),
            "readyReplicas": len(plan.ready_groups),
            "updatedReplicas": sum(1 for g in existing if g.config_hash == hash_ and g.phase != "Terminating"),
            "selector": scale_selector(owner),
            "endpoint": endpoint(owner),
            "configHash": hash_,
            "groups": [g.to_dict() for g in plan.groups],
            "conditions": conditions_to_dicts(conditions, old.get("conditions") or [], generation, self.clock()),
        }

    def _invalid_status(self, old: Manifest, exc: InvalidSpec, generation: int) -> Manifest:
        conditions = conditions_to_dicts(invalid_conditions(str(exc)), old.get("conditions") or [], generation,
                                         self.clock())
        return {**old, "observedGeneration": generation, "conditions": conditions}

    def _write_status(self, owner: Owner, old: Manifest, new: Manifest) -> None:
        if all(old.get(k) == v for k, v in new.items()):
            return
        self.kube.merge_patch(Ref(crd.KIND, owner.namespace, owner.name), {"status": new}, subresource="status")

