"""The router's frozen, validated configuration.

The process (addresses, ports, the replicas it fronts, the served model, telemetry, shutdown grace),
admission control, rate limiting, the replica registry and the shared state all read their settings
from one `RouterConfig`, validated once here so that a bad flag or ConfigMap value fails at start-up
with a `ConfigError` that names the field, instead of surfacing later as a strange routing decision.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from chariot.contracts.errors import ConfigError

RateLimitUnit = Literal["tokens", "requests"]
RATE_LIMIT_UNITS: tuple[str, ...] = ("tokens", "requests")
Routing = Literal["prefix", "load", "round_robin"]
ROUTING_MODES: tuple[str, ...] = ("prefix", "load", "round_robin")
DEFAULT_HOST = "127.0.0.1"
DEFAULT_HTTP_PORT = 8000
DEFAULT_GRPC_PORT = 50051
DEFAULT_SERVED_MODEL = "default"
DEFAULT_STATS_INTERVAL_S = 0.25
DEFAULT_GRACE_S = 5.0
MAX_PORT = 65535


@dataclass(frozen=True)
class TenantLimit:
    """A token bucket: refills at `rate_per_s` units per second up to `burst` units."""

    rate_per_s: float
    burst: float

    def validate(self, name: str) -> None:
        _positive(f"{name}.rate_per_s", self.rate_per_s)
        _positive(f"{name}.burst", self.burst)

    def scaled(self, share: float) -> TenantLimit:
        """This limit with rate and burst multiplied by `share` (a router's part of a shared limit)."""
        return TenantLimit(rate_per_s=self.rate_per_s * share, burst=self.burst * share)


@dataclass(frozen=True)
class RouterConfig:
    """Every setting of the router.

    The process:
    - `host`, `http_port`, `grpc_port`: where both fronts listen (port 0: a free one).
    - `replicas`: `NAME=HOST:PORT` (or `HOST:PORT`) of each replica's stage 0, unless `replica_file`.
    - `served_model`: the model name clients send; `model_dir`: the tokenizer's model directory
      (exact prompt lengths, chat template; None: estimated).
    - `otlp_endpoint`: OTLP collector for metrics and traces (None: Prometheus only).
    - `stats_interval_s`: how often each replica's load report is polled.
    - `grace_s`: how long in-flight calls may finish at shutdown.
    - `api_keys_file`: the YAML file of API keys bound to tenants (`chariot.router.auth`; None: no
      keys, every caller is trusted and names its own tenant).
    - `tls_cert_file` / `tls_key_file`: PEM certificate chain and private key served on both fronts
      (None: plaintext); both or neither.
    - `secret_poll_s`: how often the key file and the certificate files are checked for changes.

    The decision core:
    - `ttft_slo_ms` / `tbt_slo_ms`: the latency SLOs; a request is shed when its predicted TTFT on the
      best replica exceeds `ttft_slo_ms * (1 + slo_margin)`.
    - `max_queue_per_replica`: the most admitted-but-unfinished requests one replica may hold.
    - `default_rate_limit` / `tenant_rate_limits`: per-tenant token buckets (None = unlimited);
      `rate_limit_unit` says what a request is charged: "tokens" = prompt_tokens + max_tokens, or
      "requests" = 1.
    - `redis_url`: shared state for several routers (None = in-memory, one router).
    - `redis_timeout_s`: socket timeout of every Redis call; past it the router decides locally.
    - `redis_retry_s`: how often a degraded router tries Redis again; it counts as back after
      `redis_recover_after` probes in a row succeed (no flapping on a half-up Redis).
    - `redis_max_connections`: the connection pool's size; calls beyond it wait (within the
      timeout) for a free connection instead of opening more.
    - `lease_s`: TTL of a router's contributions in Redis (renewed by heartbeats), so a crashed
      router's load expires.
    - `degraded_limit_share`: the share of each tenant limit one router enforces on its own while
      Redis is unreachable (1/N with N routers keeps the total at the configured limit).
    - `stats_staleness_s`: a replica whose latest load report is older than this is not ready.
    - `affinity_margin_ms`: a session's previous replica is preferred while its predicted TTFT is
      within this of the best replica's (and meets the SLO); 0 turns session affinity off.
    - `max_sessions`: sessions whose last replica this router remembers (least recently used go).
    - `routing`: how an admitted request picks among the replicas that meet the SLO: "prefix" (the
      lowest predicted TTFT counting each replica's cached prefix, with session affinity), "load"
      (the lowest predicted TTFT as if nothing were cached; no affinity), "round_robin" (in turn).
      Shedding is the same in all three; "load" and "round_robin" exist to measure "prefix" against.
    - `replica_file` / `replica_poll_s`: the JSON replica list (a mounted ConfigMap) and how often its
      modification time is checked.

    The offered load (`chariot.router.offered_load`, read by the autoscaler):
    - `offered_load_window_s`: the sliding window its rates are measured over.
    - `offered_load_publish_s`: how often it is written to Redis (with `redis_url`).
    - `hold_queue`: requests held while no replica is ready (scale from zero: the autoscaler sees
      them in the offered load and starts a group); 0 answers 503 at once. Beyond it, 503 too.
    - `hold_timeout_s`: how long a held request waits for a ready replica before its 503 (with
      `Retry-After`).
    """

    host: str = DEFAULT_HOST
    http_port: int = DEFAULT_HTTP_PORT
    grpc_port: int = DEFAULT_GRPC_PORT
    replicas: tuple[str, ...] = ()
    served_model: str = DEFAULT_SERVED_MODEL
    model_dir: str | None = None
    otlp_endpoint: str | None = None
    stats_interval_s: float = DEFAULT_STATS_INTERVAL_S
    grace_s: float = DEFAULT_GRACE_S
    api_keys_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    secret_poll_s: float = 2.0
    ttft_slo_ms: float = 2000.0
    tbt_slo_ms: float = 200.0
    slo_margin: float = 0.1
    max_queue_per_replica: int = 256
    default_rate_limit: TenantLimit | None = None
    tenant_rate_limits: Mapping[str, TenantLimit] = field(default_factory=dict, hash=False)
    rate_limit_unit: RateLimitUnit = "tokens"
    redis_url: str | None = None
    redis_timeout_s: float = 0.2
    redis_retry_s: float = 2.0
    redis_recover_after: int = 2
    redis_max_connections: int = 64
    redis_key_prefix: str = "chariot"
    lease_s: float = 30.0
    degraded_limit_share: float = 1.0
    stats_staleness_s: float = 5.0
    replica_file: str | None = None
    replica_poll_s: float = 2.0
    queue_retry_after_s: float = 1.0
    max_retry_after_s: float = 60.0
    affinity_margin_ms: float = 50.0
    max_sessions: int = 65536
    routing: Routing = "prefix"
    offered_load_window_s: float = 30.0
    offered_load_publish_s: float = 1.0
    hold_queue: int = 0
    hold_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        self._validate_process()
        _positive("ttft_slo_ms", self.ttft_slo_ms)
        _positive("tbt_slo_ms", self.tbt_slo_ms)
        _non_negative("slo_margin", self.slo_margin)
        if isinstance(self.max_queue_per_replica, bool) or not isinstance(self.max_queue_per_replica, int):
            raise ConfigError("max_queue_per_replica", f"must be an integer, got {self.max_queue_per_replica!r}")
        if self.max_queue_per_replica < 1:
            raise ConfigError("max_queue_per_replica", f"must be >= 1, got {self.max_queue_per_replica}")
        self._validate_limits()
        if self.rate_limit_unit not in RATE_LIMIT_UNITS:
            raise ConfigError("rate_limit_unit", f"must be one of {RATE_LIMIT_UNITS}, got {self.rate_limit_unit!r}")
        self._validate_redis()
        _positive("stats_staleness_s", self.stats_staleness_s)
        _positive("replica_poll_s", self.replica_poll_s)
        _positive("queue_retry_after_s", self.queue_retry_after_s)
        _positive("max_retry_after_s", self.max_retry_after_s)
        _non_negative("affinity_margin_ms", self.affinity_margin_ms)
        _positive("max_sessions", self.max_sessions)
        if self.routing not in ROUTING_MODES:
            raise ConfigError("routing", f"must be one of {ROUTING_MODES}, got {self.routing!r}")
        _positive("offered_load_window_s", self.offered_load_window_s)
        _positive("offered_load_publish_s", self.offered_load_publish_s)
        if isinstance(self.hold_queue, bool) or not isinstance(self.hold_queue, int) or self.hold_queue < 0:
            raise ConfigError("hold_queue", f"must be an integer >= 0, got {self.hold_queue!r}")
        _positive("hold_timeout_s", self.hold_timeout_s)

    def _validate_process(self) -> None:
        for name in ("host", "served_model"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(name, f"must be a non-empty string, got {value!r}")
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= MAX_PORT:
                raise ConfigError(name, f"must be an integer in [0, {MAX_PORT}] (0: a free port), got {port!r}")
        if isinstance(self.replicas, str) or not all(isinstance(r, str) and r for r in self.replicas):
            raise ConfigError("replicas", f"must be a sequence of NAME=HOST:PORT strings, got {self.replicas!r}")
        object.__setattr__(self, "replicas", tuple(self.replicas))
        _positive("stats_interval_s", self.stats_interval_s)
        _positive("grace_s", self.grace_s)
        self._validate_secrets()

    def _validate_secrets(self) -> None:
        for name in ("api_keys_file", "tls_cert_file", "tls_key_file"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(name, f"must be a file path or None, got {value!r}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            missing = "tls_key_file" if self.tls_key_file is None else "tls_cert_file"
            raise ConfigError(missing, "is required with the other TLS file (give both or neither)")
        _positive("secret_poll_s", self.secret_poll_s)

    def _validate_limits(self) -> None:
        if self.default_rate_limit is not None:
            self.default_rate_limit.validate("default_rate_limit")
        for tenant, limit in self.tenant_rate_limits.items():
            if not isinstance(tenant, str) or not tenant:
                raise ConfigError("tenant_rate_limits", f"tenant names must be non-empty strings, got {tenant!r}")
            limit.validate(f"tenant_rate_limits[{tenant!r}]")
        # A read-only copy: the dataclass is frozen, its mapping should be too.
        object.__setattr__(self, "tenant_rate_limits", MappingProxyType(dict(self.tenant_rate_limits)))

    def _validate_redis(self) -> None:
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError("redis_url", f"must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        _positive("redis_timeout_s", self.redis_timeout_s)
        _positive("redis_retry_s", self.redis_retry_s)
        _positive("redis_recover_after", self.redis_recover_after)
        _positive("redis_max_connections", self.redis_max_connections)
        if not self.redis_key_prefix or any(c in self.redis_key_prefix for c in "{} "):
            raise ConfigError(
                "redis_key_prefix", f"must be non-empty without braces or spaces: {self.redis_key_prefix!r}"
            )
        _positive("lease_s", self.lease_s)
        if not 0.0 < self.degraded_limit_share <= 1.0:
            raise ConfigError("degraded_limit_share", f"must be in (0, 1], got {self.degraded_limit_share}")

    @property
    def ttft_slo_s(self) -> float:
        return self.ttft_slo_ms / 1000.0

    @property
    def shed_threshold_s(self) -> float:
        """Predicted TTFT above which a request is shed: the SLO widened by the margin."""
        return self.ttft_slo_s * (1.0 + self.slo_margin)

    def limit_for(self, tenant: str) -> TenantLimit | None:
        """The tenant's own bucket if configured, else the default (None = unlimited)."""
        return self.tenant_rate_limits.get(tenant, self.default_rate_limit)


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(name, f"must be a finite number > 0, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ConfigError(name, f"must be a finite number >= 0, got {value!r}")
