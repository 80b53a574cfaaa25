"""The router state that several routers must share, behind one interface.

Admission control needs three things that are only right if every router sees every other router's
decisions: the tenants' token buckets, each replica's admitted-but-unfinished load (in-flight count
and not-yet-prefilled prompt tokens), and the request → replica map. `SharedState` is that interface:

- `LocalState`: in memory, for a single router (and the fallback of the next one);
- `RedisState`: in Redis, every read-modify-write an atomic Lua script that uses Redis' clock (TIME),
  every key with a TTL so a crashed router's contributions expire;
- `ResilientState`: `RedisState` first, `LocalState` when Redis fails or is slow (short timeouts).
  It never raises because Redis is down: it decides locally, reports `health().degraded` with the
  reason, and tries Redis again every `retry_s` (recovering by itself once Redis is back).

Redis key layout (one hash tag, so all keys share a Redis Cluster slot and scripts may touch them
together; `P` is `RouterConfig.redis_key_prefix`):

| key | type | content | TTL |
|---|---|---|---|
| `{P}:bucket:<tenant>` | hash | `tokens`, `ts` (Redis time) | until the bucket would be full again (+1 s) |
| `{P}:inflight:<replica>` | zset | request id → lease expiry (Redis time) | lease + 1 s (renewed by heartbeats) |
| `{P}:pending:<replica>` | zset | not-yet-prefilled request id → admission time | max(lease, retention) + 1 s |
| `{P}:pendtok:<replica>` | hash | request id → prompt tokens | max(lease, retention) + 1 s |
| `{P}:req:<request id>` | hash | `replica`, `tokens` | lease (renewed by heartbeats) |

A request counts as in flight while its lease is in the future; the router that admitted it renews
the lease every `lease_s / 3` (`heartbeat`), so a crashed router's requests drop out after `lease_s`.
Pending entries only matter for windows up to the stats staleness bound (`retention_s`): older
admissions are already in the replica's own report (see `loads`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from chariot.contracts.grpc_server import OncePerInterval
from chariot.router.config import RouterConfig, TenantLimit
from chariot.router.ratelimit import TAKE_SCRIPT, BucketLevel, TakeResult, bucket_ttl_s, take_from_bucket

log = logging.getLogger(__name__)

Clock = Callable[[], float]
T = TypeVar("T")
LAG_LOG_INTERVAL_S = 30.0  # at most one "event loop lagged" warning per this many seconds


class DuplicateRequestError(ValueError):
    """A request id that is already in flight was admitted again."""


@dataclass(frozen=True)
class SharedLoad:
    """What all routers together have put on one replica that its last report may not show yet.

    `in_flight`: admitted and not finished. `pending_prefill_tokens`: prompt tokens of requests
    admitted within the asked window (the age of the replica's last report) whose first token has
    not come back yet.
    """

    in_flight: int = 0
    pending_prefill_tokens: int = 0

    def __add__(self, other: SharedLoad) -> SharedLoad:
        return SharedLoad(self.in_flight + other.in_flight, self.pending_prefill_tokens + other.pending_prefill_tokens)


@dataclass(frozen=True)
class StateHealth:
    """Which backend decides, and whether the router runs degraded (Redis configured but unusable)."""

    backend: str
    degraded: bool = False
    reason: str | None = None
    degraded_since: float | None = None


class SharedState(ABC):
    """Token buckets, per-replica admitted load, and the request → replica map."""

    @abstractmethod
    async def take(self, tenant: str, cost: float, limit: TenantLimit) -> TakeResult:
        """Atomically refill the tenant's bucket and take `cost` if it holds that much (negative refunds)."""

    @abstractmethod
    async def admit(self, request_id: str, replica: str, prompt_tokens: int, max_in_flight: int) -> bool:
        """Atomically count the request on `replica` unless it already holds `max_in_flight`.

        Raises DuplicateRequestError if `request_id` is already in flight there.
        """

    @abstractmethod
    async def first_token(self, request_id: str, replica: str) -> None:
        """The request's prompt is prefilled: stop counting its prompt tokens as pending."""

    @abstractmethod
    async def release(self, request_id: str, replica: str) -> None:
        """The request finished (or failed, or was cancelled): stop counting it. Idempotent."""

    @abstractmethod
    async def loads(self, windows_s: Mapping[str, float]) -> dict[str, SharedLoad]:
        """Per replica: in-flight count, and pending prompt tokens admitted within its window (seconds)."""

    @abstractmethod
    async def replica_of(self, request_id: str) -> str | None:
        """Which replica serves the request (admitted by any router), if it is in flight."""

    async def heartbeat(self) -> None:
        """Renew this router's leases (Redis); nothing to do in memory."""
        return None

    def start(self, interval_s: float) -> asyncio.Task[None] | None:
        """Start background upkeep (lease renewal, Redis probes) if this state needs any."""
        return None

    @abstractmethod
    def health(self) -> StateHealth: ...

    async def aclose(self) -> None:
        """Release connections and background tasks."""
        return None


# --- in memory ------------------------------------------------------------------------------------


@dataclass
class _Admitted:
    replica: str
    tokens: int
    admitted_at: float
    prefilled: bool = False


class LocalState(SharedState):
    """In-memory state: exact for one router, the per-router fallback for several."""

    _MAX_IDLE_BUCKETS = 4096

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, BucketLevel] = {}
        self._requests: dict[str, _Admitted] = {}
        self._in_flight: dict[str, int] = {}

    async def take(self, tenant: str, cost: float, limit: TenantLimit) -> TakeResult:
        now = self._clock()
        level, result = take_from_bucket(self._buckets.get(tenant), cost, limit, now)
        self._buckets[tenant] = level
        if len(self._buckets) > self._MAX_IDLE_BUCKETS:
            self._drop_full_buckets(limit, now)
        return result

    def _drop_full_buckets(self, limit: TenantLimit, now: float) -> None:
        # A bucket idle long enough to be full again means the same as no bucket.
        for tenant, level in list(self._buckets.items()):
            if now - level.updated_at > bucket_ttl_s(level.tokens, limit):
                del self._buckets[tenant]

    async def admit(self, request_id: str, replica: str, prompt_tokens: int, max_in_flight: int) -> bool:
        if request_id in self._requests:
            raise DuplicateRequestError(request_id)
        if self._in_flight.get(replica, 0) >= max_in_flight:
            return False
        self._requests[request_id] = _Admitted(replica, prompt_tokens, self._clock())
        self._in_flight[replica] = self._in_flight.get(replica, 0) + 1
        return True

    async def first_token(self, request_id: str, replica: str) -> None:
        admitted = self._requests.get(request_id)
        if admitted is not None:
            admitted.prefilled = True

    async def release(self, request_id: str, replica: str) -> None:
        admitted = self._requests.pop(request_id, None)
        if admitted is not None:
            self._in_flight[admitted.replica] -= 1
            if not self._in_flight[admitted.replica]:
                del self._in_flight[admitted.replica]

    async def loads(self, windows_s: Mapping[str, float]) -> dict[str, SharedLoad]:
        now = self._clock()
        pending = dict.fromkeys(windows_s, 0)
        for admitted in self._requests.values():
            window = windows_s.get(admitted.replica)
            if window is not None and not admitted.prefilled and admitted.admitted_at >= now - window:
                pending[admitted.replica] += admitted.tokens
        return {name: SharedLoad(self._in_flight.get(name, 0), pending[name]) for name in windows_s}

    async def replica_of(self, request_id: str) -> str | None:
        admitted = self._requests.get(request_id)
        return admitted.replica if admitted else None

    def health(self) -> StateHealth:
        return StateHealth(backend="local")

    def holds(self, request_id: str) -> bool:
        return request_id in self._requests


# --- Redis ----------------------------------------------------------------------------------------

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

# KEYS: inflight, pending, pendtok, req. ARGV: id, tokens, max_in_flight, lease_s, retention_s, replica.
# Returns 1 admitted, 0 replica full, -1 id already in flight.
ADMIT_SCRIPT = (
    _NOW
    + """
local id = ARGV[1]
local tokens = tonumber(ARGV[2])
local lease = tonumber(ARGV[4])
local retention = tonumber(ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], id) then return -1 end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], now + lease, id)
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - retention)
for i = 1, #old do redis.call('HDEL', KEYS[3], old[i]) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - retention)
if tokens > 0 then
  redis.call('ZADD', KEYS[2], now, id)
  redis.call('HSET', KEYS[3], id, tokens)
end
redis.call('HSET', KEYS[4], 'replica', ARGV[6], 'tokens', tokens)
local lease_ms = math.ceil(lease * 1000)
local keep_ms = math.ceil(math.max(lease, retention) * 1000) + 1000
redis.call('PEXPIRE', KEYS[1], lease_ms + 1000)
redis.call('PEXPIRE', KEYS[2], keep_ms)
redis.call('PEXPIRE', KEYS[3], keep_ms)
redis.call('PEXPIRE', KEYS[4], lease_ms)
return 1
"""
)

# KEYS: pending, pendtok. ARGV: id.
FIRST_TOKEN_SCRIPT = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
"""

# KEYS: inflight, pending, pendtok, req. ARGV: id.
RELEASE_SCRIPT = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[4])
return 1
"""

# KEYS: (inflight, pending, pendtok) per replica. ARGV: window seconds per replica.
# Returns in_flight, pending tokens per replica, flattened.
LOADS_SCRIPT = (
    _NOW
    + """
local out = {}
for i = 1, #ARGV do
  local base = (i - 1) * 3
  out[#out + 1] = redis.call('ZCOUNT', KEYS[base + 1], '(' .. now, '+inf')
  local ids = redis.call('ZRANGEBYSCORE', KEYS[base + 2], now - tonumber(ARGV[i]), '+inf')
  local sum = 0
  for j = 1, #ids do
    sum = sum + (tonumber(redis.call('HGET', KEYS[base + 3], ids[j])) or 0)
  end
  out[#out + 1] = sum
end
return out
"""
)

# KEYS: inflight, then one req key per id. ARGV: lease_s, replica, then the ids (in KEYS order).
# Upserts, so a Redis that restarted empty learns this router's live requests again.
HEARTBEAT_SCRIPT = (
    _NOW
    + """
local lease = tonumber(ARGV[1])
local lease_ms = math.ceil(lease * 1000)
for i = 3, #ARGV do
  redis.call('ZADD', KEYS[1], now + lease, ARGV[i])
  redis.call('HSET', KEYS[i - 1], 'replica', ARGV[2])
  redis.call('PEXPIRE', KEYS[i - 1], lease_ms)
end
redis.call('PEXPIRE', KEYS[1], lease_ms + 1000)
return #ARGV - 2
"""
)


class RedisState(SharedState):
    """Shared state in Redis; every read-modify-write is one atomic script run on Redis' clock.

    Raises whatever redis-py raises: wrap it in `ResilientState` to survive outages.
    """

    _HEARTBEAT_CHUNK = 256

    def __init__(
        self, client: Any, *, prefix: str = "chariot", lease_s: float = 30.0, retention_s: float = 10.0
    ) -> None:
        self._client = client
        self._prefix = "{" + prefix + "}"
        self._lease_s = lease_s
        self._retention_s = retention_s
        self._own: dict[str, str] = {}  # request id → replica, for heartbeats
        self._take = client.register_script(TAKE_SCRIPT)
        self._admit = client.register_script(ADMIT_SCRIPT)
        self._first_token = client.register_script(FIRST_TOKEN_SCRIPT)
        self._release = client.register_script(RELEASE_SCRIPT)
        self._loads = client.register_script(LOADS_SCRIPT)
        self._heartbeat = client.register_script(HEARTBEAT_SCRIPT)

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 0.2, max_connections: int = 64, **kwargs: Any) -> RedisState:
        """A client with short socket timeouts and no retries (a slow Redis must fail fast) over a
        bounded pool: under a burst, calls wait for a free connection rather than open one each
        (Redis' "Too many connections" would otherwise flip the router to local state)."""
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            decode_responses=True,
        )
        return cls(aioredis.Redis(connection_pool=pool), **kwargs)

    async def drop_connections(self) -> None:
        """Close every idle pooled connection: after an outage they are dead, and each would fail once.
        Connections in use stay: closing one under a call that is still connecting crashes redis-py
        (AttributeError on its cleared writer); those calls fail or finish on their own."""
        await self._client.connection_pool.disconnect(inuse_connections=False)

    def key(self, kind: str, name: str) -> str:
        return f"{self._prefix}:{kind}:{name}"

    def _replica_keys(self, replica: str) -> list[str]:
        return [self.key("inflight", replica), self.key("pending", replica), self.key("pendtok", replica)]

    async def take(self, tenant: str, cost: float, limit: TenantLimit) -> TakeResult:
        allowed, tokens, retry = await self._take(
            keys=[self.key("bucket", tenant)], args=[repr(limit.rate_per_s), repr(limit.burst), repr(cost)]
        )
        return TakeResult(bool(int(allowed)), float(retry), float(tokens))

    async def admit(self, request_id: str, replica: str, prompt_tokens: int, max_in_flight: int) -> bool:
        keys = [*self._replica_keys(replica), self.key("req", request_id)]
        args = [request_id, prompt_tokens, max_in_flight, repr(self._lease_s), repr(self._retention_s), replica]
        outcome = int(await self._admit(keys=keys, args=args))
        if outcome < 0:
            raise DuplicateRequestError(request_id)
        if outcome:
            self._own[request_id] = replica
        return bool(outcome)

    async def first_token(self, request_id: str, replica: str) -> None:
        keys = [self.key("pending", replica), self.key("pendtok", replica)]
        await self._first_token(keys=keys, args=[request_id])

    async def release(self, request_id: str, replica: str) -> None:
        self._own.pop(request_id, None)
        await self._release(keys=[*self._replica_keys(replica), self.key("req", request_id)], args=[request_id])

    def forget(self, request_id: str) -> None:
        """Stop renewing a request's lease (it could not be released in Redis; let it expire)."""
        self._own.pop(request_id, None)

    async def loads(self, windows_s: Mapping[str, float]) -> dict[str, SharedLoad]:
        names = list(windows_s)
        if not names:
            return {}
        keys = [key for name in names for key in self._replica_keys(name)]
        args = [repr(min(max(windows_s[name], 0.0), self._retention_s)) for name in names]
        flat = await self._loads(keys=keys, args=args)
        return {name: SharedLoad(int(flat[2 * i]), int(flat[2 * i + 1])) for i, name in enumerate(names)}

    async def replica_of(self, request_id: str) -> str | None:
        replica = await self._client.hget(self.key("req", request_id), "replica")
        return str(replica) if replica is not None else None

    async def heartbeat(self) -> None:
        """Renew the leases of this router's live requests (PING when there are none)."""
        by_replica: dict[str, list[str]] = {}
        for request_id, replica in list(self._own.items()):
            by_replica.setdefault(replica, []).append(request_id)
        if not by_replica:
            await self._client.ping()
        for replica, ids in by_replica.items():
            for start in range(0, len(ids), self._HEARTBEAT_CHUNK):
                chunk = ids[start : start + self._HEARTBEAT_CHUNK]
                keys = [self.key("inflight", replica), *(self.key("req", i) for i in chunk)]
                await self._heartbeat(keys=keys, args=[repr(self._lease_s), replica, *chunk])

    def health(self) -> StateHealth:
        return StateHealth(backend="redis")

    async def aclose(self) -> None:
        await self._client.aclose()


# --- Redis with a local fallback ---------------------------------------------------------------------


class LoopLagMonitor:
    """When the event loop has been late lately: a task sleeps `interval_s` over and over and records
    each overshoot as the span [when it was due, when it woke]. A Redis call that timed out while the
    loop was late could not have read a timely answer, so its timeout says nothing about Redis."""

    def __init__(self, interval_s: float = 0.05, window_s: float = 5.0) -> None:
        self.interval_s, self.window_s = interval_s, window_s
        self._spans: collections.deque[tuple[float, float]] = collections.deque()
        self._due: float | None = None  # when the sleeping monitor should wake
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="chariot-loop-lag")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            now = loop.time()
            self._spans.append((self._due, now))
            while self._spans and self._spans[0][1] < now - self.window_s:
                self._spans.popleft()

    def late_s(self, start: float, now: float) -> float:
        """The longest time within [start, now] that the loop was overdue (0: on time throughout)."""
        spans = list(self._spans)
        if self._due is not None:
            spans.append((self._due, now))  # the monitor's current sleep, overdue if due < now
        return max((min(woke, now) - max(due, start) for due, woke in spans), default=0.0)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


class _Unavailable(Exception):
    """Redis is not to be used for this call (it just failed, or is in its retry back-off)."""


def _is_timeout(exc: BaseException) -> bool:
    """asyncio's timeout, or redis-py's (its TimeoutError is not the builtin one)."""
    return isinstance(exc, TimeoutError) or type(exc).__name__ == "TimeoutError"


def _redis_errors() -> tuple[type[BaseException], ...]:
    try:
        from redis.exceptions import RedisError
    except ImportError:  # pragma: no cover - redis is installed wherever RedisState is used
        return (OSError, TimeoutError)
    return (RedisError, OSError, TimeoutError)


class ResilientState(SharedState):
    """Redis while it answers within `timeout_s`; local decisions (degraded) while it does not.

    Requests are released where they were admitted. A Redis-admitted request that cannot be released
    (Redis down) is forgotten and its lease expires. While degraded, each tenant's local bucket gets
    `degraded_limit_share` of the configured limit. Loads add the local leftovers to Redis' counts
    after recovery, so requests admitted during an outage still count until they finish.
    """

    def __init__(
        self,
        primary: RedisState,
        fallback: LocalState | None = None,
        *,
        timeout_s: float = 0.2,
        retry_s: float = 2.0,
        degraded_limit_share: float = 1.0,
        recover_after: int = 2,
        max_connections: int = 64,
        clock: Clock = time.monotonic,
    ) -> None:
        self._redis = primary
        # Calls queue here for one of the pool's connections, outside the Redis timeout: waiting in a
        # burst is the router's own back-pressure, not Redis failing (it must not degrade the state).
        self._slots = asyncio.Semaphore(max_connections)
        self._lag_log = OncePerInterval(LAG_LOG_INTERVAL_S, logger=log)
        self._lag = LoopLagMonitor()
        self._local = fallback if fallback is not None else LocalState(clock)
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._share = degraded_limit_share
        self._clock = clock
        self._errors = _redis_errors()
        self._reason: str | None = None
        self._since: float | None = None
        self._retry_at = 0.0
        self._recover_after = recover_after
        self._good_probes = 0
        self._task: asyncio.Task[None] | None = None

    # the breaker ---------------------------------------------------------------------------------

    @property
    def degraded(self) -> bool:
        return self._reason is not None

    def health(self) -> StateHealth:
        return StateHealth("redis", self.degraded, self._reason, self._since)

    async def _on_redis(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run `call` on Redis within the timeout, or raise _Unavailable (and degrade).

        While degraded, one call per `retry_s` probes Redis; concurrent calls stay local meanwhile.
        At most `max_connections` calls run at once; the others wait for a slot before their timeout
        starts, and see a degradation that happened while they waited.
        """
        if self.degraded and self._clock() < self._retry_at:
            raise _Unavailable  # fast path: no slot needed to decide locally
        async with self._slots:
            self._check_probe()
            return await self._timed(call)

    def _check_probe(self) -> None:
        """Raise _Unavailable while degraded, except for one probe per `retry_s`."""
        if not self.degraded:
            return
        now = self._clock()
        if now < self._retry_at:
            raise _Unavailable
        self._retry_at = now + self._retry_s  # this call is the probe

    async def _timed(self, call: Callable[[], Awaitable[T]]) -> T:
        loop = asyncio.get_running_loop()
        self._lag.start()
        start = loop.time()
        try:
            result = await asyncio.wait_for(call(), self._timeout_s)
        except self._errors as exc:
            now = loop.time()  # late: the timeout fired late, or the loop was overdue during the call
            late = max(now - start - self._timeout_s, self._lag.late_s(start, now))
            if _is_timeout(exc) and not self.degraded and late > self._timeout_s / 2:
                # The router's own event loop was too busy (a burst on a small machine) to read an
                # answer in time: this call decides locally, but that is no evidence against Redis.
                self._lag_log.warn(f"a Redis call timed out while this router's event loop lagged {late * 1e3:.0f} "
                                   "ms; decided locally, shared state kept")
                raise _Unavailable from exc
            first = not self.degraded
            self._degrade(exc)
            if first:
                with contextlib.suppress(*self._errors):
                    await asyncio.wait_for(self._redis.drop_connections(), self._timeout_s)
            raise _Unavailable from exc
        if self.degraded:
            self._good_probes += 1
            if self._good_probes >= self._recover_after:  # hysteresis: one lucky call is not recovery
                log.warning("Redis is back after %.1fs; shared router state restored",
                            self._clock() - (self._since or 0.0))
                self._reason = self._since = None
        return result

    def _degrade(self, exc: BaseException) -> None:
        now = self._clock()
        self._retry_at = now + self._retry_s
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self._good_probes = 0
        if not self.degraded:
            log.error("Redis unusable (%s); deciding locally, retrying every %.1fs", reason, self._retry_s)
            self._since = now
        self._reason = reason

    # the interface -------------------------------------------------------------------------------

    async def take(self, tenant: str, cost: float, limit: TenantLimit) -> TakeResult:
        try:
            return await self._on_redis(lambda: self._redis.take(tenant, cost, limit))
        except _Unavailable:
            return await self._local.take(tenant, cost, limit.scaled(self._share))

    async def admit(self, request_id: str, replica: str, prompt_tokens: int, max_in_flight: int) -> bool:
        if self._local.holds(request_id):
            raise DuplicateRequestError(request_id)
        try:
            return await self._on_redis(lambda: self._redis.admit(request_id, replica, prompt_tokens, max_in_flight))
        except _Unavailable:
            return await self._local.admit(request_id, replica, prompt_tokens, max_in_flight)

    async def first_token(self, request_id: str, replica: str) -> None:
        if self._local.holds(request_id):
            await self._local.first_token(request_id, replica)
            return
        # If Redis is unusable, its pending entry ages out of every window within the retention time.
        with contextlib.suppress(_Unavailable):
            await self._on_redis(lambda: self._redis.first_token(request_id, replica))

    async def release(self, request_id: str, replica: str) -> None:
        if self._local.holds(request_id):
            await self._local.release(request_id, replica)
            return
        try:
            await self._on_redis(lambda: self._redis.release(request_id, replica))
        except _Unavailable:
            self._redis.forget(request_id)

    async def loads(self, windows_s: Mapping[str, float]) -> dict[str, SharedLoad]:
        local = await self._local.loads(windows_s)
        try:
            shared = await self._on_redis(lambda: self._redis.loads(windows_s))
        except _Unavailable:
            return local
        return {name: shared[name] + local[name] for name in windows_s}

    async def replica_of(self, request_id: str) -> str | None:
        local = await self._local.replica_of(request_id)
        if local is not None:
            return local
        try:
            return await self._on_redis(lambda: self._redis.replica_of(request_id))
        except _Unavailable:
            return None

    async def heartbeat(self) -> None:
        """Renew leases; while degraded this is also the probe that notices Redis is back."""
        with contextlib.suppress(_Unavailable):
            await self._on_redis(self._redis.heartbeat)

    # background upkeep ---------------------------------------------------------------------------

    def start(self, interval_s: float) -> asyncio.Task[None]:
        """Run `heartbeat` every `interval_s` (use min(lease_s / 3, retry_s)) until `aclose`, and watch
        the event loop's lateness from now on."""
        self._lag.start()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._upkeep(interval_s), name="router-state-upkeep")
        return self._task

    async def _upkeep(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.heartbeat()

    async def aclose(self) -> None:
        await self._lag.stop()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        with contextlib.suppress(*self._errors):
            await self._redis.aclose()


def make_state(config: RouterConfig, clock: Clock = time.monotonic) -> SharedState:
    """In memory without `redis_url`; Redis with a local fallback with it."""
    if config.redis_url is None:
        return LocalState(clock)
    redis_state = RedisState.from_url(
        config.redis_url,
        timeout_s=config.redis_timeout_s,
        max_connections=config.redis_max_connections,
        prefix=config.redis_key_prefix,
        lease_s=config.lease_s,
        retention_s=config.stats_staleness_s,
    )
    return ResilientState(
        redis_state,
        LocalState(clock),
        timeout_s=config.redis_timeout_s,
        retry_s=config.redis_retry_s,
        degraded_limit_share=config.degraded_limit_share,
        recover_after=config.redis_recover_after,
        max_connections=config.redis_max_connections,
        clock=clock,
    )


def upkeep_interval_s(config: RouterConfig) -> float:
    """How often `ResilientState.start` should renew leases and probe a failed Redis."""
    return min(config.lease_s / 3.0, config.redis_retry_s)
