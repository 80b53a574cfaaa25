"""The router's view of the replicas it balances over.

A replica (pipeline group) is known by a name and the gRPC address of its stage-0 worker. The set
comes from flags or from a JSON file that the operator writes into a mounted ConfigMap:

    {"replicas": [{"name": "llama-g0", "address": "llama-g0-s0.llama:50051"}, ...]}

The file is polled for changes (`watch`); a change is applied atomically, and a file that cannot be
read or parsed keeps the previous set (and logs why). For each replica the registry keeps the latest
load report (`ReplicaLoad`, from the worker's Stats RPC; a replica without a fresh report is not
ready) and this router's own count of in-flight requests and their not-yet-prefilled prompt tokens,
for metrics and as a floor under the shared counts. Nothing here talks to the network.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chariot.contracts.errors import ConfigError
from chariot.router.config import RouterConfig

log = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclass(frozen=True)
class ReplicaLoad:
    """One load report of a replica (the worker's StatsResponse), stamped with when it arrived.

    `reported_at` is on the router's monotonic clock (`time.monotonic()`), never the worker's.
    """

    num_waiting: int = 0
    num_running: int = 0
    queued_prefill_tokens: int = 0
    kv_cache_usage: float = 0.0
    token_budget: int = 0
    max_batch_size: int = 0
    max_model_len: int = 0
    last_iteration_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    budget_tokens_per_s: float = 0.0
    pipeline_stages: int = 1
    reported_at: float = 0.0

    @classmethod
    def from_stats(cls, stats: Any, reported_at: float) -> ReplicaLoad:
        """From a `chariot.v1.StatsResponse` (or anything with the same attributes)."""
        return cls(
            num_waiting=int(stats.num_waiting),
            num_running=int(stats.num_running),
            queued_prefill_tokens=int(stats.queued_prefill_tokens),
            kv_cache_usage=float(stats.kv_cache_usage),
            token_budget=int(stats.token_budget),
            max_batch_size=int(stats.max_batch_size),
            max_model_len=int(stats.max_model_len),
            last_iteration_s=float(stats.last_iteration_s),
            prefill_tokens_per_s=float(stats.prefill_tokens_per_s),
            budget_tokens_per_s=float(stats.budget_tokens_per_s),
            pipeline_stages=int(stats.pipeline_stages) or 1,
            reported_at=reported_at,
        )


@dataclass(frozen=True)
class ReplicaSpec:
    """A replica's identity: its name and the host:port of its stage-0 worker."""

    name: str
    address: str


@dataclass(frozen=True)
class RegistryChange:
    """Names added, removed, or whose address changed in one update of the replica set."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)


@dataclass(frozen=True)
class ReplicaView:
    """A snapshot of one replica for the admission controller and metrics."""

    name: str
    address: str
    ready: bool
    load: ReplicaLoad | None
    in_flight: int
    unprefilled_tokens: int


@dataclass
class _Replica:
    spec: ReplicaSpec
    load: ReplicaLoad | None = None
    in_flight: int = 0
    unprefilled_tokens: int = 0

    def is_ready(self, now: float, staleness_s: float) -> bool:
        if self.load is None or now - self.load.reported_at > staleness_s:
            return False
        return self.load.prefill_tokens_per_s > 0 or self.load.token_budget > 0

    def view(self, now: float, staleness_s: float) -> ReplicaView:
        return ReplicaView(
            name=self.spec.name,
            address=self.spec.address,
            ready=self.is_ready(now, staleness_s),
            load=self.load,
            in_flight=self.in_flight,
            unprefilled_tokens=self.unprefilled_tokens,
        )


# --- parsing -------------------------------------------------------------------------------------


def parse_address(field_name: str, value: object) -> str:
    """Validate "host:port" (IPv6 as "[::1]:port"); returns it unchanged."""
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(field_name, f"must be 'host:port', got {value!r}")
    host, _, port = value.rpartition(":")
    if not host or host in ("[]",) or " " in host:
        raise ConfigError(field_name, f"missing host in {value!r}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(field_name, f"port must be 1..65535 in {value!r}")
    return value


def parse_replica_flags(values: Sequence[str]) -> list[ReplicaSpec]:
    """From `--replica` flags: "name=host:port", or "host:port" (the address is the name)."""
    specs = []
    for i, value in enumerate(values):
        name, sep, address = value.partition("=")
        if not sep:
            name, address = value, value
        specs.append(ReplicaSpec(_name(f"replicas[{i}].name", name), parse_address(f"replicas[{i}].address", address)))
    _check_unique(specs)
    return specs


def parse_replica_file(text: str) -> list[ReplicaSpec]:
    """From the replica file's JSON text: {"replicas": [{"name": ..., "address": "host:port"}, ...]}."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError("replicas", f"not valid JSON: {exc}") from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("replicas"), list):
        raise ConfigError("replicas", 'the file must be a JSON object {"replicas": [...]}')
    specs = []
    for i, entry in enumerate(raw["replicas"]):
        if not isinstance(entry, dict):
            raise ConfigError(f"replicas[{i}]", f"must be an object with name and address, got {entry!r}")
        name = _name(f"replicas[{i}].name", entry.get("name"))
        specs.append(ReplicaSpec(name, parse_address(f"replicas[{i}].address", entry.get("address"))))
    _check_unique(specs)
    return specs


def _name(field_name: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(field_name, f"must be a non-empty string, got {value!r}")
    return value.strip()


def _check_unique(specs: Sequence[ReplicaSpec]) -> None:
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ConfigError("replicas", f"duplicate replica name {spec.name!r}")
        seen.add(spec.name)


# --- the registry --------------------------------------------------------------------------------


@dataclass
class _FileWatch:
    path: Path
    signature: tuple[int, int, int] | None = None
    failed_signature: tuple[int, int, int] | None = None


class ReplicaRegistry:
    """Replica set + latest load reports + this router's own per-replica request accounting."""

    def __init__(
        self,
        replicas: Iterable[ReplicaSpec] = (),
        *,
        staleness_s: float = 5.0,
        path: str | os.PathLike[str] | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self._staleness_s = staleness_s
        self._clock = clock
        self._replicas: dict[str, _Replica] = {}
        self._listeners: list[Callable[[RegistryChange], None]] = []
        self._watch = _FileWatch(Path(path)) if path is not None else None
        self.set_replicas(replicas)
        if self._watch is not None:
            self._load_file(strict=True)

    @classmethod
    def from_config(
        cls, config: RouterConfig, flags: Sequence[str] = (), clock: Clock = time.monotonic
    ) -> ReplicaRegistry:
        """The file (if `config.replica_file`) wins over `--replica` flags."""
        specs = [] if config.replica_file else parse_replica_flags(flags)
        return cls(specs, staleness_s=config.stats_staleness_s, path=config.replica_file, clock=clock)

    # replica set ---------------------------------------------------------------------------------

    def set_replicas(self, specs: Iterable[ReplicaSpec]) -> RegistryChange:
        """Replace the set in one step; replicas that stay keep their load and counters."""
        old = self._replicas
        new: dict[str, _Replica] = {}
        changed = []
        for spec in specs:
            kept = old.get(spec.name)
            if kept is not None and kept.spec == spec:
                new[spec.name] = kept
            elif kept is not None:  # same name, new address: a different endpoint, so its load is unknown
                new[spec.name] = _Replica(spec, None, kept.in_flight, kept.unprefilled_tokens)
                changed.append(spec.name)
            else:
                new[spec.name] = _Replica(spec)
        self._replicas = new
        change = RegistryChange(
            added=tuple(n for n in new if n not in old),
            removed=tuple(n for n in old if n not in new),
            changed=tuple(changed),
        )
        if change:
            log.info("replica set: %s (added %s, removed %s, changed %s)", sorted(new), *map(list, _parts(change)))
            for listener in list(self._listeners):
                listener(change)
        return change

    def subscribe(self, listener: Callable[[RegistryChange], None]) -> None:
        """Call `listener` after every change of the set (e.g. to start/stop Stats pollers)."""
        self._listeners.append(listener)

    def names(self) -> list[str]:
        return list(self._replicas)

    def specs(self) -> list[ReplicaSpec]:
        return [r.spec for r in self._replicas.values()]

    def address(self, name: str) -> str | None:
        replica = self._replicas.get(name)
        return replica.spec.address if replica else None

    # load reports --------------------------------------------------------------------------------

    def update_load(self, name: str, load: ReplicaLoad) -> bool:
        """Record a report; False (ignored) for a replica no longer in the set."""
        replica = self._replicas.get(name)
        if replica is None:
            return False
        replica.load = load
        return True

    def clear_load(self, name: str) -> None:
        """Forget the latest report (its Stats call failed): the replica is not ready until the next one."""
        replica = self._replicas.get(name)
        if replica is not None:
            replica.load = None

    def snapshot(self, now: float | None = None) -> list[ReplicaView]:
        t = self._clock() if now is None else now
        return [r.view(t, self._staleness_s) for r in self._replicas.values()]

    def ready(self, now: float | None = None) -> list[ReplicaView]:
        """Replicas with a fresh (not older than the staleness bound) and usable report."""
        return [view for view in self.snapshot(now) if view.ready]

    # this router's accounting --------------------------------------------------------------------

    def note_admitted(self, name: str, prompt_tokens: int) -> None:
        replica = self._replicas.get(name)
        if replica is not None:
            replica.in_flight += 1
            replica.unprefilled_tokens += prompt_tokens

    def note_first_token(self, name: str, prompt_tokens: int) -> None:
        replica = self._replicas.get(name)
        if replica is not None:
            replica.unprefilled_tokens = max(0, replica.unprefilled_tokens - prompt_tokens)

    def note_finished(self, name: str, unprefilled_tokens: int) -> None:
        replica = self._replicas.get(name)
        if replica is not None:
            replica.in_flight = max(0, replica.in_flight - 1)
            replica.unprefilled_tokens = max(0, replica.unprefilled_tokens - unprefilled_tokens)

    # the replica file ----------------------------------------------------------------------------

    def reload_if_changed(self) -> bool:
        """Re-read the file if its stat changed; True if the set was replaced. Never raises."""
        if self._watch is None:
            return False
        if _signature(self._watch.path) in (self._watch.signature, self._watch.failed_signature):
            return False
        return self._load_file(strict=False)

    async def watch(self, poll_s: float) -> None:
        """Poll the file every `poll_s` seconds until cancelled."""
        while True:
            await asyncio.sleep(poll_s)
            self.reload_if_changed()

    def start_watching(self, poll_s: float) -> asyncio.Task[None]:
        """Start `watch` as a task of the running loop (cancel it to stop)."""
        return asyncio.get_running_loop().create_task(self.watch(poll_s), name="replica-file-watch")

    def _load_file(self, *, strict: bool) -> bool:
        assert self._watch is not None
        path = self._watch.path
        signature = _signature(path)
        try:
            specs = parse_replica_file(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ConfigError) as exc:
            if strict:
                raise ConfigError("replica_file", f"{path}: {exc}") from exc
            if signature != self._watch.failed_signature:  # log once per bad version of the file
                log.error("replica file %s rejected, keeping %d replicas: %s", path, len(self._replicas), exc)
            self._watch.failed_signature = signature
            return False
        self._watch.signature = signature
        self._watch.failed_signature = None
        self.set_replicas(specs)
        return True


_MISSING = (-1, -1, -1)


def _signature(path: Path) -> tuple[int, int, int]:
    """What changes when the file does, including a ConfigMap's atomic symlink swap (new inode)."""
    try:
        st = path.stat()
    except OSError:
        return _MISSING
    return st.st_mtime_ns, st.st_size, st.st_ino


def _parts(change: RegistryChange) -> tuple[tuple[str, ...], ...]:
    return change.added, change.removed, change.changed
