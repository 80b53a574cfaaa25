"""Supervision of `chariot up`'s pipeline groups with the operator's semantics.

A stage that exits fails its own group only, as a dead pod does on Kubernetes: the rest of that
group is stopped, and the group is recreated after the operator's gang-restart backoff
(`chariot.operator.reconcile.Backoff`: base × 2^(restarts-1), capped, reset after a long healthy
run) on the same stage-0 gRPC address. That address is the one stage 0 bound itself (port 0) and
named in its ready line: a port merely found free here could be taken by another socket (another
group's gloo connections, a server binding port 0) in the seconds before stage 0 binds it. The
router drops the group from rotation as soon as its load reports stop (and re-sends requests that
had not got a token yet), and takes it back once it reports again. Other groups and the router keep
serving throughout.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from chariot.contracts.engine_settings import ENGINE_CORE, ITERATION_LOG
from chariot.contracts.processes import Child, ready_field, shutdown, wait_ready
from chariot.operator.reconcile import Backoff
from chariot.worker.config import EngineConfig
from chariot.worker.pipeline.launcher import start_group

Clock = Callable[[], float]


@dataclass
class LocalGroup:
    """One pipeline group's processes and its restart bookkeeping."""

    index: int
    port: int  # stage 0's gRPC port, 0 until its first ready line names it; kept across restarts
    children: list[Child]
    started_at: float
    restarts: int = 0
    restart_at: float | None = None  # set while the group is down, waiting out its backoff

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def stage0(self) -> Child:
        return self.children[0]

    @property
    def addressable(self) -> bool:
        return self.port != 0

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def learn_port(self) -> bool:
        """Take stage 0's bound port from its ready line once it has printed it; True when learned now."""
        line = self.stage0.ready_line
        if self.port or line is None:
            return False
        self.port = bound_grpc_port(line)
        return True


def bound_grpc_port(ready_line: str) -> int:
    """The port in a worker's ready line (`chariot worker ready grpc=HOST:PORT ...`)."""
    port = (ready_field(ready_line, "grpc") or "").rpartition(":")[2]
    if not port.isdigit():
        raise RuntimeError(f"a worker's ready line names no gRPC port: {ready_line!r}")
    return int(port)


class GroupSupervisor:
    """Starts R local groups and keeps them up; `check()` is called from the supervising loop."""

    def __init__(self, config: EngineConfig, served: str, engine_core: str = ENGINE_CORE.default,
                 backoff: Backoff | None = None, clock: Clock = time.monotonic,
                 iteration_log: str | None = ITERATION_LOG.default) -> None:
        self.config, self.served, self.engine_core = config, served, engine_core
        self.iteration_log = iteration_log
        self.backoff = backoff or Backoff()
        self.clock = clock
        self.groups: list[LocalGroup] = []

    def start(self, replicas: int) -> list[LocalGroup]:
        for index in range(replicas):
            self.groups.append(LocalGroup(index, 0, self._start(index, 0), self.clock()))
        return self.groups

    def wait_ready(self, group: LocalGroup, timeout_s: float) -> None:
        """Until the group's stage 0 serves (RuntimeError if any stage exits first); learns its port."""
        wait_ready(group.stage0, self.children(), timeout_s)
        group.learn_port()

    def learn_ports(self) -> bool:
        """Learn the ports of groups whose stage 0 has become ready since; True when any was learned."""
        return any([g.learn_port() for g in self.groups if g.restart_at is None])

    def add(self) -> LocalGroup:
        """Start one more group at the lowest free index (the autoscaler's scale up)."""
        taken = {g.index for g in self.groups}
        index = next(i for i in itertools.count() if i not in taken)
        group = LocalGroup(index, 0, self._start(index, 0), self.clock())
        self.groups.append(group)
        return group

    def _start(self, index: int, port: int) -> list[Child]:
        children, _ = start_group(index, self.config, self.served, self.engine_core, port, self.iteration_log)
        return children

    def remove(self, group: LocalGroup) -> None:
        """Stop a group for good (the autoscaler's scale down, once the group is drained)."""
        self.groups.remove(group)
        shutdown(group.children, grace_s=5.0)

    def children(self) -> list[Child]:
        return [c for g in self.groups for c in g.children]

    def check(self) -> None:
        """Fail groups with a dead stage; recreate those whose backoff has passed."""
        now = self.clock()
        for group in self.groups:
            if group.restart_at is None:
                dead = group.dead_child()
                if dead is not None:
                    self._fail(group, dead, now)
            elif now >= group.restart_at:
                group.children = self._start(group.index, group.port)
                group.started_at, group.restart_at = now, None
                where = f"on {group.address}" if group.addressable else "(its port is learned once it serves)"
                print(f"chariot up: replica {group.index} recreated {where} (restart {group.restarts})",
                      file=sys.stderr, flush=True)

    def _fail(self, group: LocalGroup, dead: Child, now: float) -> None:
        code = dead.proc.returncode
        shutdown(group.children, grace_s=5.0)
        if now - group.started_at >= self.backoff.reset_after_s:
            group.restarts = 0  # it ran long enough: this failure starts a fresh backoff series
        group.restarts += 1
        delay = self.backoff.delay(group.restarts)
        group.restart_at = now + delay
        print(f"chariot up: {dead.name} exited with code {code}; replica {group.index} fails alone and is "
              f"recreated in {delay:g}s (restart {group.restarts}); the other replicas keep serving",
              file=sys.stderr, flush=True)
