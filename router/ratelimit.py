"""Per-tenant token-bucket rate limits.

A tenant's bucket holds up to `burst` units and refills at `rate_per_s` units per second. What a
request costs is chosen by `RouterConfig.rate_limit_unit`:

- "tokens" (default): `prompt_tokens + max_tokens` — the most work the request can cause, known at
  admission time (the real output length is not), so a tenant cannot dodge its limit with few, huge
  requests;
- "requests": 1 per request.

A cost above the bucket's burst is charged as the whole burst (the request waits for a full bucket
instead of being unservable forever). A request charged and then shed for another reason is refunded.

The bucket arithmetic lives here twice, once in Python (`take_from_bucket`, used by the in-memory
state) and once in Lua (`TAKE_SCRIPT`, run atomically inside Redis with Redis' own clock), so that
several routers share one bucket per tenant. The buckets themselves are stored by a `SharedState`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chariot.contracts.errors import AdmissionRejected
from chariot.router.config import RouterConfig, TenantLimit

if TYPE_CHECKING:
    from chariot.router.state import SharedState


@dataclass(frozen=True)
class TakeResult:
    """Outcome of one take: whether it was allowed, the wait before it would be, what is left."""

    allowed: bool
    retry_after_s: float
    remaining: float


@dataclass
class BucketLevel:
    """A bucket's stored state: its level at `updated_at` (refill is computed lazily)."""

    tokens: float
    updated_at: float


def take_from_bucket(
    level: BucketLevel | None, cost: float, limit: TenantLimit, now: float
) -> tuple[BucketLevel, TakeResult]:
    """Refill `level` up to `now`, then take `cost` (clamped to the burst; a negative cost refunds).

    Pure: returns the new level and the result. `None` is a bucket never used (or expired): full.
    """
    cost = min(cost, limit.burst)
    tokens = limit.burst if level is None else level.tokens
    elapsed = 0.0 if level is None else max(0.0, now - level.updated_at)
    tokens = min(limit.burst, tokens + elapsed * limit.rate_per_s)
    if tokens >= cost:
        tokens = min(limit.burst, tokens - cost)
        return BucketLevel(tokens, now), TakeResult(True, 0.0, tokens)
    return BucketLevel(tokens, now), TakeResult(False, (cost - tokens) / limit.rate_per_s, tokens)


def bucket_ttl_s(tokens: float, limit: TenantLimit) -> float:
    """Time until the bucket is full again; after it, a missing bucket means the same as a stored one."""
    return max(0.0, limit.burst - tokens) / limit.rate_per_s


# KEYS[1] = bucket hash; ARGV = rate_per_s, burst, cost. Same arithmetic as `take_from_bucket`, with
# Redis' clock (TIME), never a router's, so routers with skewed clocks share one bucket correctly.
# The key expires once the bucket would be full again (then "absent" and "full" mean the same).
TAKE_SCRIPT = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local cost = math.min(tonumber(ARGV[3]), burst)
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local stored = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(stored[1])
local ts = tonumber(stored[2])
if tokens == nil or ts == nil then
  tokens = burst
  ts = now
end
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local allowed = 0
local retry = 0
if tokens >= cost then
  tokens = math.min(burst, tokens - cost)
  allowed = 1
else
  retry = (cost - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(math.max(0, burst - tokens) / rate * 1000) + 1000)
return {allowed, tostring(tokens), tostring(retry)}
"""


@dataclass(frozen=True)
class Charge:
    """What one admitted request took from its tenant's bucket (kept to refund it)."""

    tenant: str
    cost: float
    limit: TenantLimit


class RateLimiter:
    """Charges requests to their tenant's bucket in a `SharedState`; raises when the bucket is short."""

    def __init__(self, config: RouterConfig, state: SharedState) -> None:
        self._config = config
        self._state = state

    def cost(self, prompt_tokens: int, max_tokens: int) -> float:
        if self._config.rate_limit_unit == "requests":
            return 1.0
        return float(max(0, prompt_tokens) + max(0, max_tokens))

    async def acquire(self, tenant: str, prompt_tokens: int, max_tokens: int) -> Charge | None:
        """Take the request's cost; None for an unlimited tenant. Raises AdmissionRejected("rate_limit")."""
        limit = self._config.limit_for(tenant)
        if limit is None:
            return None
        cost = self.cost(prompt_tokens, max_tokens)
        result = await self._state.take(tenant, cost, limit)
        if not result.allowed:
            retry = min(self._config.max_retry_after_s, max(result.retry_after_s, 0.001))
            raise AdmissionRejected("rate_limit", _round_up(retry))
        return Charge(tenant, cost, limit)

    async def refund(self, charge: Charge | None) -> None:
        """Give a charge back (the request was shed after it was charged)."""
        if charge is not None:
            await self._state.take(charge.tenant, -charge.cost, charge.limit)


def _round_up(seconds: float) -> float:
    """Retry hints in milliseconds, rounded up so a client retrying on time is not refused by rounding."""
    return math.ceil(seconds * 1000.0) / 1000.0
