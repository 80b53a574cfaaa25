"""Pure decisions of one reconcile pass: which groups to create, delete or roll, and the status to report.

Why separate from the API calls: the gang, backoff and rolling rules are the subtle part of the
operator, and as a function of (spec, observed pods, previous status, now) they are unit-testable for
every case without a cluster; the controller only executes the returned `Plan`.

Rules (docs/architecture.md §6):
- a group is `P` pods sharing one configuration hash; once the group has *started* (all its stage
  pods seen Running at once, recorded in its status), a pod that failed or vanished takes the whole group down: it
  is deleted and recreated after a backoff (`base * 2^(restarts-1)`, capped), as LeaderWorkerSet's
  RecreateGroupAfterStart does; before that, only the failed or missing stage pods are replaced
  (after the same backoff), so a stage that cannot start (an image pull, a node that never comes)
  does not take down stages that are still loading; a group that stays Ready for `reset_after_s`
  forgets its restarts;
- pods are never reused across configurations: a group whose pods carry an old hash is replaced —
  at once if it is not serving anyway; a serving one, with `rollout.maxSurge` S > 0, only after an
  up-to-date group has become Ready in addition to the `replicas` serving ones (at most `replicas + S`
  groups up; capacity never drops), and with S = 0 one at a time while every other group is Ready;
- up-to-date groups beyond `spec.replicas` are deleted (scale down: terminating, then draining, then
  not serving, then highest index first); missing ones are created at the lowest free index (scale
  up). With a `Drain` (spec.autoscaling), a serving group chosen to go is drained first: its phase
  becomes Draining, which takes it out of the routers' replica list (new requests go elsewhere,
  requests in flight finish), and its pods are deleted once `Drain.idle` says no router sends to it
  and nothing is in flight there, or after the grace period;
- a group's index is taken while any of its pods exists (pod names are fixed), and a gang-restarted
  group keeps its index through its backoff.
"""

from __future__ import annotations

import datetime as dt
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from chariot.operator.render import ANNOTATION_CONFIG_HASH, LABEL_GROUP, LABEL_STAGE
from chariot.operator.spec import Spec

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Backoff:
    """Delay before a failed group is recreated: `base_s * 2^(restarts-1)`, at most `max_s`."""

    base_s: float = 5.0
    max_s: float = 300.0
    reset_after_s: float = 300.0

    def delay(self, restarts: int) -> float:
        return float(min(self.base_s * 2 ** max(restarts - 1, 0), self.max_s))


@dataclass(frozen=True)
class PodState:
    """What the planner needs to know about one stage pod."""

    name: str
    group: int
    stage: int
    config_hash: str
    phase: str
    ready: bool
    terminating: bool
    failure: str = ""
    """The worker container's termination message (its last log lines when it exited with an error)."""
    node: str = ""
    """The node it was scheduled to (`spec.nodeName`; empty until then)."""

    @property
    def failed(self) -> bool:
        """With restartPolicy Never a pod whose worker exited (for any reason) never runs again."""
        return self.phase in ("Failed", "Succeeded")

    @classmethod
    def from_manifest(cls, pod: Manifest) -> PodState | None:
        meta, status = pod.get("metadata", {}), pod.get("status") or {}
        labels = meta.get("labels") or {}
        try:
            group, stage = int(labels[LABEL_GROUP]), int(labels[LABEL_STAGE])
        except (KeyError, ValueError):
            return None
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        return cls(name=meta.get("name", ""), group=group, stage=stage,
                   config_hash=(meta.get("annotations") or {}).get(ANNOTATION_CONFIG_HASH, ""),
                   phase=status.get("phase") or "Pending", ready=ready,
                   terminating=bool(meta.get("deletionTimestamp")), failure=_termination_message(status),
                   node=(pod.get("spec") or {}).get("nodeName") or "")


def _termination_message(status: Manifest) -> str:
    """The last non-empty line of the first terminated container's message, at most 300 characters:
    the worker's final error line (`chariot: ...`), short enough for a status field."""
    for container in status.get("containerStatuses") or []:
        message = ((container.get("state") or {}).get("terminated") or {}).get("message") or ""
        lines = [line.strip() for line in message.splitlines() if line.strip()]
        if lines:
            return lines[-1][-300:]
    return ""


@dataclass(frozen=True)
class GroupStatus:
    """One entry of `status.groups` (times are epoch seconds here, RFC 3339 in the object)."""

    index: int
    phase: str = "Pending"
    pods: int = 0
    ready_pods: int = 0
    config_hash: str = ""
    restarts: int = 0
    restart_after: float | None = None
    ready_since: float | None = None
    last_failure: str = ""
    message: str = ""
    started: bool = False
    """All stage pods of this incarnation of the group have been seen Running at once."""
    draining_since: float | None = None
    """When the group was chosen to go (scale down with a drain); None while it is not draining."""

    def to_dict(self) -> Manifest:
        out: Manifest = {"index": self.index, "phase": self.phase, "pods": self.pods, "readyPods": self.ready_pods,
                         "configHash": self.config_hash, "restarts": self.restarts, "message": self.message,
                         "started": self.started}
        if self.restart_after is not None:
            out["restartAfter"] = format_time(self.restart_after)
        if self.ready_since is not None:
            out["readySince"] = format_time(self.ready_since)
        if self.last_failure:
            out["lastFailure"] = self.last_failure
        if self.draining_since is not None:
            out["drainingSince"] = format_time(self.draining_since)
        return out

    @classmethod
    def from_dict(cls, raw: Manifest) -> GroupStatus:
        return cls(index=int(raw["index"]), phase=raw.get("phase", "Pending"), pods=raw.get("pods", 0),
                   ready_pods=raw.get("readyPods", 0), config_hash=raw.get("configHash", ""),
                   restarts=raw.get("restarts", 0), restart_after=parse_time(raw.get("restartAfter")),
                   ready_since=parse_time(raw.get("readySince")), last_failure=raw.get("lastFailure", ""),
                   message=raw.get("message", ""), started=bool(raw.get("started", False)),
                   draining_since=parse_time(raw.get("drainingSince")))


@dataclass
class Plan:
    """What one pass does: `delete` groups (all their pods), then `create` groups; `groups` is the status
    (the groups that stay, by index; groups scaled away are deleted and not reported)."""

    create: list[int] = field(default_factory=list)
    delete: list[int] = field(default_factory=list)
    delete_pods: list[str] = field(default_factory=list)  # single pods of groups that have not started
    create_stages: dict[int, list[int]] = field(default_factory=dict)  # group -> the stage pods to (re)create
    statuses: dict[int, GroupStatus] = field(default_factory=dict)  # by group index
    removed: set[int] = field(default_factory=set)  # groups scaled away: deleted, not reported
    requeue_after: float | None = None
    waiting: list[str] = field(default_factory=list)
    draining: dict[int, GroupStatus] = field(default_factory=dict)  # groups drained before they are deleted

    @property
    def groups(self) -> list[GroupStatus]:
        return [self.statuses[g] for g in sorted(self.statuses)]

    @property
    def ready_groups(self) -> list[int]:
        return [g.index for g in self.groups if g.phase == "Ready"]

    def wait(self, reason: str, after: float | None = None) -> None:
        self.waiting.append(reason)
        if after is not None:
            self.requeue_after = after if self.requeue_after is None else min(self.requeue_after, after)


@dataclass(frozen=True)
class Drain:
    """How a scale-down drains a group: `idle(g)` answers whether no router sends to group g any more and
    none of its requests is in flight; after `grace_s` the group goes anyway. `poll_s`: how soon to look
    again while a group drains."""

    grace_s: float
    idle: Callable[[int], bool]
    poll_s: float = 2.0

    def done(self, group: int, since: float, now: float) -> bool:
        return now - since >= self.grace_s or (now > since and self.idle(group))


def drain_release(plan: Plan, pods: Iterable[PodState], cordoned: Callable[[str], bool]) -> int | None:
    """The one group whose disruption budget is released so a node drain can go on, or None.

    `kubectl drain` cordons a node, then evicts its pods; a Ready group's budget (all P stage pods)
    refuses every eviction. So while a Ready group has a stage pod on a cordoned node, and every
    other group is Ready too (at least two groups: the drain may cost one group's worth of capacity,
    never more), the lowest-index such group is released. Its eviction takes it down; it
    gang-restarts elsewhere, and until it is Ready again no other group is released. `cordoned(node)`
    is asked only once the groups allow a release, lowest group first, until one answers True."""
    groups = plan.groups
    if len(groups) < 2 or any(g.phase != "Ready" for g in groups):
        return None
    nodes: dict[int, set[str]] = defaultdict(set)
    for p in pods:
        if p.node and not p.terminating:
            nodes[p.group].add(p.node)
    for g in sorted(g.index for g in groups):
        if any(cordoned(node) for node in sorted(nodes[g])):
            return g
    return None


def format_time(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> float | None:
    if not value:
        return None
    return dt.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc).timestamp()


# --- planning ------------------------------------------------------------------------------------

def plan_groups(spec: Spec, current_hash: str, pods: Iterable[PodState], previous: dict[int, GroupStatus],
                now: float, backoff: Backoff, drain: Drain | None = None) -> Plan:
    by_group: dict[int, list[PodState]] = defaultdict(list)
    for pod in pods:
        by_group[pod.group].append(pod)
    # Groups that exist: those with pods, and those gang-restarted whose pods are gone (backing off).
    indexes = sorted(set(by_group) | {g for g, st in previous.items()
                                      if g not in by_group and st.restart_after is not None})
    planned = {g: _plan_group(spec, current_hash, by_group.get(g, []), previous.get(g, GroupStatus(g)), now,
                              backoff) for g in indexes}
    outdated = {g for g in indexes if any(p.config_hash != current_hash for p in by_group.get(g, []))}
    plan = Plan()
    members = _scale_down(plan, [g for g in indexes if g not in outdated], planned, by_group, spec.replicas, now,
                          drain)
    for g in indexes:
        if g in plan.removed:
            continue
        if g in plan.draining:
            plan.statuses[g] = plan.draining[g]
            continue
        status, action = planned[g]
        plan.statuses[g] = replace(status, draining_since=None)  # no longer chosen to go: it serves again
        if action == "create":
            plan.create.append(g)
        elif action == "delete":
            plan.delete.append(g)
        elif action == "replace":
            plan.delete_pods += [p.name for p in by_group[g] if p.failed]
        elif action == "fill":
            present = {p.stage for p in by_group[g]}
            plan.create_stages[g] = [s for s in range(spec.pipeline) if s not in present]
    rolling = [g for g in indexes if g in outdated and planned[g][1] == "roll"]
    _roll(plan, spec, members, rolling, current_hash)
    _surge(plan, spec, members, rolling, set(indexes), current_hash)
    _collect_waits(plan, now)
    return plan


def _scale_down(plan: Plan, members: list[int], planned: dict[int, tuple[GroupStatus, str | None]],
                by_group: dict[int, list[PodState]], replicas: int, now: float,
                drain: Drain | None = None) -> list[int]:
    """Remove up-to-date groups beyond `replicas` (terminating ones first, then draining ones, then
    groups that do not serve, then the highest index); with a `drain`, a serving victim drains before
    it is deleted. Returns the members that stay."""
    surplus = len(members) - replicas
    if surplus <= 0:
        return members

    def keep_last(g: int) -> tuple[bool, bool, bool, int]:
        status = planned[g][0]
        return (status.phase != "Terminating", status.draining_since is None, status.phase == "Ready", -g)

    victims = set(sorted(members, key=keep_last)[:surplus])
    for g in sorted(victims):
        if drain is not None and _draining(plan, g, planned[g][0], now, drain):
            continue
        plan.removed.add(g)
        if any(not p.terminating for p in by_group.get(g, [])):
            plan.delete.append(g)
        if by_group.get(g):
            plan.wait(f"group {g} is being removed (scale down)")
    return [g for g in members if g not in victims]


def _draining(plan: Plan, g: int, status: GroupStatus, now: float, drain: Drain) -> bool:
    """Whether victim `g` keeps draining this pass (recorded in `plan.draining`): a serving group, or one
    already draining, until it is idle or its grace period is over."""
    if status.phase != "Ready":
        return False  # it serves nothing (or failed while draining): nothing to wait for
    since = status.draining_since if status.draining_since is not None else now
    if drain.done(g, since, now):
        return False
    left = max(0.0, since + drain.grace_s - now)
    plan.draining[g] = replace(status, phase="Draining", draining_since=since, ready_since=None,
                               message=f"draining: the routers stop sending to it and its requests finish "
                                       f"(deleted at the latest in {left:.0f}s)")
    plan.wait(f"group {g} is draining (scale down)", after=min(drain.poll_s, left) if left > 0 else drain.poll_s)
    return True


def _roll(plan: Plan, spec: Spec, members: list[int], rolling: list[int], current_hash: str) -> None:
    """Take outdated serving groups down while at least `replicas - max_unavailable` groups serve: with
    a surge only once an up-to-date group has taken over (none unavailable); without one, one at a
    time while every other group is Ready."""
    if not rolling:
        return
    max_unavailable = 0 if spec.max_surge > 0 else 1
    serving = sum(1 for g in members if plan.statuses[g].phase == "Ready") + len(rolling)
    budget = max(0, serving - (spec.replicas - max_unavailable))
    for g in rolling[:budget]:
        plan.delete.append(g)
        plan.statuses[g] = replace(plan.statuses[g], phase="Terminating", ready_since=None,
                                   message=f"rolling to configuration {current_hash}")
    if rolling[budget:]:
        plan.wait(f"rollout: group(s) {', '.join(map(str, rolling[budget:]))} keep serving until an "
                  "up-to-date group is Ready")


def _surge(plan: Plan, spec: Spec, members: list[int], rolling: list[int], occupied: set[int],
           current_hash: str) -> None:
    """Create up-to-date groups until there are `replicas` of them, with at most `replicas + max_surge`
    groups up at a time (outdated serving ones included); a new group takes the lowest free index
    (pod names are fixed per index, so a terminating group's index is not free)."""
    still_serving = [g for g in rolling if g not in plan.delete]
    room = spec.replicas + spec.max_surge - len(members) - len(still_serving)
    count = max(0, min(spec.replicas - len(members), room))
    free = (g for g in itertools.count() if g not in occupied)
    for g in itertools.islice(free, count):
        plan.create.append(g)
        plan.statuses[g] = GroupStatus(g, phase="Pending", config_hash=current_hash,
                                       message="creating the group's pods")


def _plan_group(spec: Spec, current_hash: str, pods: list[PodState], prev: GroupStatus, now: float,
                backoff: Backoff) -> tuple[GroupStatus, str | None]:
    base = replace(prev, pods=len(pods), ready_pods=sum(p.ready for p in pods),
                   config_hash=pods[0].config_hash if pods else prev.config_hash)
    if len(pods) == spec.pipeline and all(p.phase == "Running" for p in pods):
        base = replace(base, started=True)  # recorded in status: a pod failing later finds it set
    if any(p.terminating for p in pods):
        return replace(base, phase="Terminating", message="waiting for the old pods to terminate"), None
    if not pods:
        if prev.restart_after is not None and now < prev.restart_after:
            return replace(base, phase="BackingOff", message=f"{prev.last_failure}; restart {prev.restarts} backing "
                                                             f"off until {format_time(prev.restart_after)}"), None
        return replace(base, phase="Pending", config_hash=current_hash, restart_after=None, ready_since=None,
                       started=False, message="creating the group's pods"), "create"
    stale = any(p.config_hash != current_hash for p in pods)
    complete = sorted(p.stage for p in pods) == list(range(spec.pipeline)) or stale
    ready = complete and all(p.ready for p in pods) and not any(p.failed for p in pods)
    if stale:
        if ready:
            return _ready(base, now, backoff), "roll"
        return replace(base, phase="Terminating", ready_since=None,
                       message=f"replacing the group with configuration {current_hash}"), "delete"
    if not complete or any(p.failed for p in pods):
        if base.started:
            return _gang_restart(base, spec, pods, now, backoff), "delete"
        return _replace_stages(base, spec, pods, now, backoff)
    if ready:
        return _ready(base, now, backoff), None
    running = all(p.phase == "Running" for p in pods)
    return replace(base, phase="Starting" if running else "Pending", ready_since=None,
                   message=f"{base.ready_pods}/{spec.pipeline} stage pods ready"), None


def _ready(base: GroupStatus, now: float, backoff: Backoff) -> GroupStatus:
    since = base.ready_since if base.ready_since is not None else now
    stable = now - since >= backoff.reset_after_s
    return replace(base, phase="Ready", ready_since=since, restarts=0 if stable else base.restarts,
                   last_failure="" if stable else base.last_failure, restart_after=None,
                   message="all stage pods ready")


def _gang_restart(base: GroupStatus, spec: Spec, pods: list[PodState], now: float, backoff: Backoff) -> GroupStatus:
    failed = [p.name for p in pods if p.failed]
    present = {p.stage for p in pods}
    missing = [s for s in range(spec.pipeline) if s not in present]
    why = f"pod {', '.join(failed)} failed" if failed else f"stage {', '.join(map(str, missing))} vanished"
    cause = next((p.failure for p in pods if p.failed and p.failure), "")
    if cause:
        why = f"{why}: {cause}"
    restarts = base.restarts + 1
    after = now + backoff.delay(restarts)
    return replace(base, phase="Restarting", restarts=restarts, restart_after=after, ready_since=None, last_failure=why,
                   message=f"{why}; recreating the whole group (restart {restarts}) after "
                           f"{backoff.delay(restarts):g}s")


def _replace_stages(base: GroupStatus, spec: Spec, pods: list[PodState], now: float, backoff: Backoff,
                    ) -> tuple[GroupStatus, str | None]:
    """A group that has not started: delete its failed pods at once (counted as one restart, with
    backoff), and recreate the missing stages once the backoff has passed; the other pods keep
    waiting for them at the rendezvous."""
    if any(p.failed for p in pods) or base.restart_after is None:
        status = _gang_restart(base, spec, pods, now, backoff)
        message = status.message.replace("recreating the whole group", "replacing only those pods (the group "
                                                                       "has not started)")
        return replace(status, message=message), "replace"
    if now < base.restart_after:
        return replace(base, phase="BackingOff", message=f"{base.last_failure}; replacing the pod(s) after "
                                                         f"{format_time(base.restart_after)}"), None
    return replace(base, phase="Pending", restart_after=None, message="recreating the missing stage pods"), "fill"


def _collect_waits(plan: Plan, now: float) -> None:
    for g in plan.groups:
        if g.phase == "BackingOff" and g.restart_after is not None:
            plan.wait(f"group {g.index} backing off", after=max(g.restart_after - now, 0.0))
        elif g.phase not in ("Ready", "Draining"):  # a draining group has asked for its own look
            plan.wait(f"group {g.index} is {g.phase}")
    if plan.create or plan.delete or plan.delete_pods or plan.create_stages:
        plan.wait("pods changed")


# --- status --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str

    def to_dict(self, previous: list[Manifest], generation: int, now: float) -> Manifest:
        status = "True" if self.status else "False"
        old = next((c for c in previous if c.get("type") == self.type), None)
        since = old.get("lastTransitionTime") if old and old.get("status") == status else None
        return {"type": self.type, "status": status, "reason": self.reason, "message": self.message,
                "lastTransitionTime": since or format_time(now), "observedGeneration": generation}


def group_conditions(spec: Spec, plan: Plan, current_hash: str, router_ready: bool) -> list[Condition]:
    """Ready means done, not merely serving: `replicas` up-to-date groups Ready, no outdated group left
    and the router available; during a rollout Ready is False (`UpdateInProgress`) while the old
    groups still serve, so `kubectl wait --for=condition=Ready` returns once the rollout finished
    (conditions carry `observedGeneration`: a client compares it with `metadata.generation`)."""
    updated = [g for g in plan.groups if g.phase == "Ready" and g.config_hash == current_hash]
    serving = len(plan.ready_groups)
    stale = [g.index for g in plan.groups if g.pods and g.config_hash != current_hash]
    failing = [g for g in plan.groups if g.phase in ("Restarting", "BackingOff")]
    all_ready = len(updated) >= spec.replicas and not stale and router_ready
    if all_ready:
        ready_c = Condition("Ready", True, "AllReplicasReady", f"{len(updated)}/{spec.replicas} replicas and the "
                                                               "router are ready")
    elif stale and serving >= spec.replicas:
        ready_c = Condition("Ready", False, "UpdateInProgress", f"{len(updated)}/{spec.replicas} replicas updated; "
                                                                f"{serving} serving meanwhile")
    elif len(updated) < spec.replicas:
        ready_c = Condition("Ready", False, "ReplicasNotReady", f"{len(updated)}/{spec.replicas} up-to-date "
                                                                f"replicas ready ({serving} serving)")
    else:
        ready_c = Condition("Ready", False, "RouterNotReady", "the router Deployment is not available yet")
    if stale:
        how = f"up to {spec.max_surge} extra group(s) at a time" if spec.max_surge else "one group at a time"
        progressing = Condition("Progressing", True, "RollingUpdate",
                                f"group(s) {', '.join(map(str, stale))} run an old configuration; rolling to "
                                f"{current_hash}, {how}")
    elif plan.waiting or not all_ready:
        progressing = Condition("Progressing", True, "Reconciling", "; ".join(plan.waiting) or ready_c.message)
    else:
        progressing = Condition("Progressing", False, "Complete", f"{spec.replicas} replicas up to date")
    if failing:
        degraded = Condition("Degraded", True, "GroupRestarting",
                             "; ".join(f"group {g.index}: {g.message}" for g in failing))
    else:
        degraded = Condition("Degraded", False, "AsExpected", "no group is failing")
    return [ready_c, progressing, degraded]


def invalid_conditions(message: str) -> list[Condition]:
    return [Condition("Ready", False, "InvalidSpec", message),
            Condition("Progressing", False, "InvalidSpec", "nothing applied until the spec is fixed"),
            Condition("Degraded", True, "InvalidSpec", message)]


def conditions_to_dicts(conditions: list[Condition], previous: list[Manifest], generation: int,
                        now: float) -> list[Manifest]:
    return [c.to_dict(previous, generation, now) for c in conditions]
