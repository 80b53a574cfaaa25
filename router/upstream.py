"""The router's connections to its replicas: one gRPC channel each, and the Stats poller.

Why a module of its own: the data plane (`chariot.router.dataplane`) must not care how a replica is
reached, and the registry (`chariot.router.registry`) must not touch the network. This module is the
seam between them:

- `ReplicaChannels` keeps one `grpc.aio` channel per replica (every Generate and Stats call to that
  replica shares it), created on first use and closed when the replica leaves the registry or
  changes address — after a grace period, so requests still streaming from it can finish.
- `StatsPoller` calls every replica's `Stats` RPC every `interval_s` and feeds the reports to the
  registry (`update_load`). A replica is ready from its first answered Stats. When a poll fails
  because the replica is unreachable its report is dropped at once (`clear_load`); when it merely
  times out (a long iteration) the last report stands until it is `stats_staleness_s` old.
- `upstream_error` turns a worker's gRPC status into the router's own exception, so both fronts map
  it through the one `error_status()` table: a worker's INVALID_ARGUMENT stays an
  `InvalidRequestError` naming the same field; anything else means the replica could not serve the
  request (`ReplicaUnavailable`, UNAVAILABLE / 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from chariot.contracts.errors import AdmissionRejected, InvalidRequestError, NoReplicaAvailable, UnknownModelError
from chariot.proto.chariot.v1 import generation_pb2 as pb
from chariot.proto.chariot.v1 import generation_pb2_grpc as pb_grpc
from chariot.router.config import DEFAULT_STATS_INTERVAL_S
from chariot.router.registry import RegistryChange, ReplicaLoad, ReplicaRegistry

log = logging.getLogger(__name__)

GENERATE_METHOD = "/chariot.v1.Generation/Generate"
CHANNEL_CLOSE_GRACE_S = 60.0
# Reconnect quickly after a worker restarts (gRPC's default back-off grows to two minutes).
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
)


class ReplicaUnavailable(NoReplicaAvailable):
    """The chosen replica could not serve the request (unreachable, failed, or it failed the request)."""


def upstream_error(replica: str, err: grpc.aio.AioRpcError, retry_after_s: float = 1.0) -> Exception:
    """The router's exception for a worker call that ended with a non-OK status."""
    code, details = err.code(), err.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, sep, message = details.partition(": ")
        return InvalidRequestError(field, message) if sep and field else InvalidRequestError("request", details)
    if code == grpc.StatusCode.NOT_FOUND:  # the worker's UnknownModelError
        named = re.search(r"unknown model '(.*)'; this server serves '(.*)'", details)
        return UnknownModelError(*named.groups()) if named else InvalidRequestError("model", details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return AdmissionRejected(f"replica {replica} is full", retry_after_s)
    return ReplicaUnavailable(f"replica {replica} failed the request ({code.name}: {details})")


@dataclass(frozen=True)
class _Channel:
    """One replica's channel and the calls made on it."""

    address: str
    channel: grpc.aio.Channel
    stub: Any
    raw_generate: Any

    @classmethod
    def open(cls, address: str) -> _Channel:
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        raw = channel.unary_stream(GENERATE_METHOD, request_serializer=pb.GenerateRequest.SerializeToString,
                                   response_deserializer=None)
        return cls(address, channel, pb_grpc.GenerationStub(channel), raw)


class ReplicaChannels:
    """One `grpc.aio` channel per replica name, following the registry's replica set."""

    def __init__(self, registry: ReplicaRegistry, close_grace_s: float = CHANNEL_CLOSE_GRACE_S) -> None:
        self._registry = registry
        self._grace_s = close_grace_s
        self._channels: dict[str, _Channel] = {}
        self._closing: set[asyncio.Task[None]] = set()
        registry.subscribe(self._on_change)

    def stub(self, name: str) -> Any:
        """A `GenerationStub` on the replica's channel (created on first use)."""
        return self._entry(name).stub

    def generate_call(self, name: str) -> Any:
        """The replica's `Generate` returning each response as the bytes the worker sent, so the router
        can relay them unchanged (and decode them once, for its own accounting)."""
        return self._entry(name).raw_generate

    def _entry(self, name: str) -> _Channel:
        address = self._registry.address(name)
        if address is None:
            raise ReplicaUnavailable(f"replica {name!r} is no longer known")
        entry = self._channels.get(name)
        if entry is None or entry.address != address:
            if entry is not None:
                self._retire(entry.channel)
            entry = _Channel.open(address)
            self._channels[name] = entry
        return entry

    def _on_change(self, change: RegistryChange) -> None:
        for name in (*change.removed, *change.changed):
            entry = self._channels.pop(name, None)
            if entry is not None:
                self._retire(entry.channel)

    def _retire(self, channel: grpc.aio.Channel) -> None:
        """Close in the background, letting calls still streaming on it finish within the grace period."""
        task = asyncio.get_running_loop().create_task(channel.close(self._grace_s), name="close-replica-channel")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        channels = [entry.channel for entry in self._channels.values()]
        self._channels.clear()
        await asyncio.gather(*(c.close(None) for c in channels), return_exceptions=True)
        for task in list(self._closing):
            task.cancel()
        await asyncio.gather(*self._closing, return_exceptions=True)


class StatsPoller:
    """Polls every replica's Stats RPC; the registry learns each replica's load (and readiness) from it."""

    def __init__(
        self,
        registry: ReplicaRegistry,
        channels: ReplicaChannels,
        interval_s: float = DEFAULT_STATS_INTERVAL_S,
        *,
        timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_report: Callable[[str, Any], None] | None = None,
    ) -> None:
        self._registry = registry
        self._channels = channels
        self._on_report = on_report  # called with each accepted report
        self.interval_s = interval_s
        self._timeout_s = timeout_s if timeout_s is not None else max(1.0, 4 * interval_s)
        self._clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._latest: dict[str, Any] = {}
        self._running = False
        registry.subscribe(self._on_change)

    def start(self) -> None:
        """Start one polling task per known replica (and per replica added later)."""
        self._running = True
        self._sync(self._registry.names())

    def latest(self) -> dict[str, Any]:
        """The last `StatsResponse` of each replica whose latest poll succeeded."""
        return dict(self._latest)

    async def poll_once(self, name: str) -> bool:
        """One Stats call to `name`; True if it answered (its load was recorded)."""
        try:
            stats = await self._channels.stub(name).Stats(pb.StatsRequest(), timeout=self._timeout_s)
        except (grpc.aio.AioRpcError, ReplicaUnavailable) as exc:
            self._failed(name, exc)
            return False
        if self._registry.update_load(name, ReplicaLoad.from_stats(stats, self._clock())):
            if name not in self._latest:
                log.info("replica %s is reporting load (model %r)", name, stats.model)
            self._latest[name] = stats
            if self._on_report is not None:
                self._on_report(name, stats)
        return True

    def _failed(self, name: str, exc: Exception) -> None:
        if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return  # busy, not gone: the registry's staleness limit decides readiness
        self._registry.clear_load(name)
        if self._latest.pop(name, None) is not None:
            detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            log.warning("replica %s stopped answering Stats (%s); not ready", name, detail)

    async def _poll_forever(self, name: str) -> None:
        while True:
            await self.poll_once(name)
            await asyncio.sleep(self.interval_s)

    def _on_change(self, change: RegistryChange) -> None:
        if not self._running:
            return
        for name in (*change.removed, *change.changed):
            self._stop(name)
        self._sync(self._registry.names())

    def _sync(self, names: Iterable[str]) -> None:
        loop = asyncio.get_running_loop()
        for name in names:
            if name not in self._tasks:
                self._tasks[name] = loop.create_task(self._poll_forever(name), name=f"stats-poll-{name}")

    def _stop(self, name: str) -> None:
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()
        self._latest.pop(name, None)

    async def aclose(self) -> None:
        self._running = False
        await cancel_tasks(self._tasks)


async def cancel_tasks(tasks: dict[str, asyncio.Task[None]]) -> None:
    """Cancel a per-replica task set (emptied at once) and wait for every task to end."""
    pending = list(tasks.values())
    tasks.clear()
    for task in pending:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(*pending, return_exceptions=True)


def aggregate_stats(reports: Iterable[Any], model: str) -> Any:
    """One `StatsResponse` for the whole deployment: sums of counts, the tightest limits, mean usage."""
    items = list(reports)
    out = pb.StatsResponse(model=model)
    if not items:
        return out
    for field in (
        "num_waiting",
        "num_running",
        "queued_prefill_tokens",
        "num_free_blocks",
        "num_blocks",
        "token_budget",
        "max_batch_size",
        "num_preemptions",
        "iterations",
    ):
        setattr(out, field, sum(int(getattr(s, field)) for s in items))
    out.prefill_tokens_per_s = sum(float(s.prefill_tokens_per_s) for s in items)
    out.budget_tokens_per_s = sum(float(s.budget_tokens_per_s) for s in items)
    out.kv_cache_usage = sum(float(s.kv_cache_usage) for s in items) / len(items)
    out.bubble_fraction = sum(float(s.bubble_fraction) for s in items) / len(items)
    out.last_iteration_s = max(float(s.last_iteration_s) for s in items)
    out.max_model_len = min((int(s.max_model_len) for s in items if s.max_model_len > 0), default=0)
    out.pipeline_stages = max(int(s.pipeline_stages) for s in items)
    return out
