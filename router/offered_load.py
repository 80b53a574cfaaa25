"""The load offered to this router, over a sliding window, and its publication for the autoscaler.

Why the router measures it: only the routers see demand. A replica's own counters show what it
served, which is capped by its capacity; the routers also see what they shed. The autoscaler (the
operator for `spec.autoscaling`, `chariot up --max-replicas` locally) sizes the replica groups from
this (`chariot.contracts.autoscaling`).

What is counted (`LoadMeter`, one-second buckets, so memory is bounded by the window):
- an *arrival* for every request that reached admission with a known prompt length and was either
  admitted or refused for load (shed for the SLO or full queues, or no ready replica): its prompt
  tokens are offered work. Rate-limited and malformed requests are not load;
- *output tokens* as the replicas stream them back;
- a *shed* for every request refused for load (SLO, queue).
Rates divide by the window, or by the time since the router started while that is shorter (at
least one second), so a fresh router does not report a fraction of its real load. The shed rate
alone is over the last `SHED_WINDOW_S`: a shed asks the autoscaler for one more group *now*, and
should stop asking soon after the sheds stop (a 30 s memory would keep adding groups long after).

Each replica's measured capacity (`contracts.autoscaling.replica_capacity`, from its load reports),
the replicas this router routes to, and its in-flight requests per replica (a group being drained
may go once no router routes to it and none of its requests is in flight) go into the same
`OfferedLoad` snapshot.

Publication (`OfferedLoadPublisher`): with a Redis URL, every `offered_load_publish_s` the snapshot
is written as JSON to `{prefix}:offered:<router id>` with a TTL of three periods, so a router that
died drops out on its own; the operator sums the routers' snapshots. Redis failing never affects
serving: the publisher logs (at most every 30 s) and tries again next period; `GET /load` on the
router serves the same snapshot locally either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from chariot.contracts.autoscaling import OfferedLoad, offered_key, replica_capacity
from chariot.contracts.grpc_server import OncePerInterval
from chariot.router.registry import ReplicaRegistry

log = logging.getLogger(__name__)

Clock = Callable[[], float]
MIN_SPAN_S = 1.0
ERROR_LOG_INTERVAL_S = 30.0
TTL_PERIODS = 3
SHED_WINDOW_S = 5.0


@dataclass
class _Bucket:
    second: int
    arrivals: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    shed: int = 0


class LoadMeter:
    """Arrivals, prompt and output tokens, sheds: per-second buckets over the last `window_s`."""

    def __init__(self, window_s: float = 30.0, clock: Clock = time.monotonic,
                 shed_window_s: float = SHED_WINDOW_S) -> None:
        self.window_s = window_s
        self.shed_window_s = shed_window_s
        self._clock = clock
        self._started = clock()
        self._buckets: deque[_Bucket] = deque()

    def _bucket(self) -> _Bucket:
        second = int(self._clock())
        if not self._buckets or self._buckets[-1].second != second:
            self._buckets.append(_Bucket(second))
            self._trim(second)
        return self._buckets[-1]

    def _trim(self, second: int) -> None:
        while self._buckets and self._buckets[0].second <= second - self.window_s:
            self._buckets.popleft()

    def arrival(self, prompt_tokens: int, *, shed: bool = False) -> None:
        bucket = self._bucket()
        bucket.arrivals += 1
        bucket.prompt_tokens += max(0, prompt_tokens)
        bucket.shed += int(shed)

    def output(self, tokens: int) -> None:
        if tokens > 0:
            self._bucket().output_tokens += tokens

    def rates(self) -> tuple[float, float, float, float]:
        """(arrivals, prompt tokens, output tokens) per second over the window, and sheds per second
        over the last `SHED_WINDOW_S`."""
        now = self._clock()
        self._trim(int(now))
        age = max(now - self._started, MIN_SPAN_S)
        shed_window = min(self.shed_window_s, self.window_s)
        span, shed_span = min(self.window_s, age), min(shed_window, age)
        arrivals = prompt = output = shed = 0
        for b in self._buckets:
            if b.second > now - self.window_s:
                arrivals += b.arrivals
                prompt += b.prompt_tokens
                output += b.output_tokens
            if b.second > now - shed_window:
                shed += b.shed
        return arrivals / span, prompt / span, output / span, shed / shed_span


def snapshot(meter: LoadMeter, registry: ReplicaRegistry, tbt_slo_s: float, in_flight: Mapping[str, int],
             held: int = 0) -> OfferedLoad:
    """This router's `OfferedLoad`: the meter's rates, each ready replica's capacity, the replicas it
    routes to, and `in_flight` (its admitted, unfinished requests per replica, including replicas it no
    longer routes to: a draining group's last requests)."""
    arrivals, prompt, output, shed = meter.rates()
    capacity = {view.name: replica_capacity(view.load.token_budget, view.load.budget_tokens_per_s, tbt_slo_s)
                for view in registry.snapshot() if view.ready and view.load is not None}
    return OfferedLoad(window_s=meter.window_s, arrival_rate=arrivals, prompt_token_rate=prompt,
                       output_token_rate=output, shed_rate=shed, held=held, capacity=capacity,
                       in_flight={name: count for name, count in in_flight.items() if count > 0},
                       replicas=tuple(registry.names()))


def router_id() -> str:
    """This router process's name in Redis: host, pid and a random suffix (pods may share a pid)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class OfferedLoadPublisher:
    """Writes the snapshot to Redis every `period_s` (see the module docstring)."""

    def __init__(self, client: Any, prefix: str, take: Callable[[], OfferedLoad], period_s: float,
                 name: str | None = None) -> None:
        self._client = client
        self.key = offered_key(prefix, name or router_id())
        self._take = take
        self._period_s = period_s
        self._errors = OncePerInterval(ERROR_LOG_INTERVAL_S, logger=log)
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def from_url(cls, url: str, prefix: str, take: Callable[[], OfferedLoad], period_s: float,
                 timeout_s: float = 0.5) -> OfferedLoadPublisher:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                         decode_responses=True)
        return cls(client, prefix, take, period_s)

    async def publish(self) -> bool:
        """One write; False (logged) when Redis did not take it."""
        ttl_ms = max(1, round(self._period_s * TTL_PERIODS * 1000))
        try:
            await self._client.set(self.key, self._take().to_json(), px=ttl_ms)
        except Exception as exc:  # redis errors, OSError, timeouts: never the router's problem
            self._errors.warn(f"publishing the offered load to Redis failed ({type(exc).__name__}: {exc}); "
                              "the autoscaler does not see this router until it works again")
            return False
        return True

    def start(self) -> asyncio.Task[None]:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="router-offered-load")
        return self._task

    async def _run(self) -> None:
        while True:
            await self.publish()
            await asyncio.sleep(self._period_s)

    async def aclose(self) -> None:
        """Stop, and withdraw this router's snapshot (a router going away offers nothing)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._client.delete(self.key), self._period_s)
        with contextlib.suppress(Exception):
            await self._client.aclose()
