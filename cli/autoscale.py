"""`chariot up --max-replicas M`: the operator's autoscaler over local replica processes.

Why the same code as the operator: the decision (`chariot.contracts.autoscaling.decide`: the formula,
bounds, shed step, stabilisation windows) is what users configure in `spec.autoscaling`; running it
over local processes makes it visible and testable on one machine. Only the plumbing differs:

- the offered load comes from the router's `GET /load` (one router, no Redis needed);
- the router learns the replica set from a JSON file it watches (`--replica-file`), which this
  module rewrites atomically when groups come and go;
- scale up starts a group's processes (`GroupSupervisor.add`) and lists it once its stage 0 serves
  and has named the port it bound; the router routes to it once its first load report arrives;
- scale down drains first, as the operator does: the group (the highest index) leaves the file, so
  the router stops sending to it; its processes stop once the router's snapshot neither routes to it
  nor holds a request on it, or after the drain grace period.

Each look can be appended to a JSON-lines file (`--autoscale-log`): time, offered load, capacity,
the counts and the reason, for plots (docs/kubernetes.md, "Autoscaling").
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from chariot.cli.groups import GroupSupervisor, LocalGroup
from chariot.contracts.autoscaling import AutoscalingPolicy, OfferedLoad, Recommendation, ScaleDecision, decide

Clock = Callable[[], float]
LoadFetcher = Callable[[], OfferedLoad | None]


def fetch_load(url: str, timeout_s: float = 2.0, context: ssl.SSLContext | None = None) -> OfferedLoad | None:
    """The router's `GET /load`, or None when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as resp:
            return OfferedLoad.from_dict(json.load(resp))
    except (OSError, ValueError, urllib.error.URLError):
        return None


def write_replica_file(path: Path, groups: list[LocalGroup]) -> None:
    """The router's replica list (`router/registry.py`'s file format), replaced atomically; groups
    still starting (no port learned yet) are left out until their stage 0 serves."""
    listed = sorted((g for g in groups if g.addressable), key=lambda g: g.index)
    body = {"replicas": [{"name": group_name(g), "address": g.address} for g in listed]}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)


def group_name(group: LocalGroup) -> str:
    return f"g{group.index}"


@dataclass
class _Drain:
    group: LocalGroup
    since: float


class LocalAutoscaler:
    """One look every `interval_s` (`step` is called from `chariot up`'s supervising loop)."""

    def __init__(self, policy: AutoscalingPolicy, supervisor: GroupSupervisor, replica_file: Path,
                 fetch: LoadFetcher, interval_s: float = 1.0, log: TextIO | None = None,
                 clock: Clock = time.monotonic) -> None:
        self.policy, self.supervisor, self.replica_file = policy, supervisor, replica_file
        self._fetch, self._interval_s, self._log, self._clock = fetch, interval_s, log, clock
        self._history: tuple[Recommendation, ...] = ()
        self._draining: list[_Drain] = []
        self._next = 0.0
        self._started = clock()

    def serving(self) -> list[LocalGroup]:
        draining = {id(d.group) for d in self._draining}
        return [g for g in self.supervisor.groups if id(g) not in draining]

    def publish(self) -> None:
        write_replica_file(self.replica_file, self.serving())

    def step(self) -> ScaleDecision | None:
        now = self._clock()
        if now < self._next:
            return None
        self._next = now + self._interval_s
        if self.supervisor.learn_ports():  # a new group serves: the router may route to it now
            self.publish()
        load = self._fetch()
        serving = self.serving()
        decision = decide(load, len(serving), self.policy, now, self._history)
        self._history = decision.history
        if decision.desired > len(serving):
            self._scale_up(decision.desired - len(serving))
        elif decision.desired < len(serving):
            self._scale_down(len(serving) - decision.desired, now)
        if decision.changed:
            print(f"chariot up: autoscaler {decision.reason}: {decision.message}", file=sys.stderr, flush=True)
        self._finish_drains(load, now)
        self._record(now, load, decision)
        return decision

    def _scale_up(self, count: int) -> None:
        while count > 0 and self._draining:  # a draining group serves again before a new one starts
            self._draining.pop()
            count -= 1
        for _ in range(count):
            group = self.supervisor.add()
            print(f"chariot up: replica {group.index} starting", file=sys.stderr, flush=True)
        self.publish()

    def _scale_down(self, count: int, now: float) -> None:
        for group in sorted(self.serving(), key=lambda g: -g.index)[:count]:
            self._draining.append(_Drain(group, now))
            print(f"chariot up: replica {group.index} draining (the router stops sending to it)",
                  file=sys.stderr, flush=True)
        self.publish()

    def _finish_drains(self, load: OfferedLoad | None, now: float) -> None:
        for drain in list(self._draining):
            idle = load is not None and now > drain.since and load.idle(group_name(drain.group))
            if idle or now - drain.since >= self.policy.drain_grace_s:
                self._draining.remove(drain)
                self.supervisor.remove(drain.group)
                how = "drained" if idle else f"drain grace of {self.policy.drain_grace_s:g}s over"
                print(f"chariot up: replica {drain.group.index} stopped ({how})", file=sys.stderr, flush=True)

    def _record(self, now: float, load: OfferedLoad | None, decision: ScaleDecision) -> None:
        if self._log is None:
            return
        row: dict[str, Any] = {"t": round(now - self._started, 3), "wall": round(time.time(), 3),
                               "replicas": len(self.supervisor.groups),
                               "serving": len(self.serving()), "ready": 0, "desired": decision.desired,
                               "recommended": decision.recommended, "reason": decision.reason,
                               "work_rate": round(decision.work_rate, 2),
                               "group_capacity": round(decision.group_capacity, 2)}
        if load is not None:
            row.update(arrival_rate=round(load.arrival_rate, 3), shed_rate=round(load.shed_rate, 3),
                       ready=len(load.capacity))
        self._log.write(json.dumps(row) + "\n")
        self._log.flush()
