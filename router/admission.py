"""SLO-driven admission control and prefix-aware load balancing (docs/architecture.md §5), free of any
transport.

For each request the controller predicts its time to first token (TTFT) on every ready replica and
sends it to the lowest prediction, or sheds it (`AdmissionRejected`, 429) when that cannot meet the
SLO, when every replica's queue is at its bound, or when the tenant's rate limit is exhausted.

Prediction, for a prompt of `p` tokens on replica r that holds its first `cached(r)` tokens in its
prefix cache (from the router's `PrefixIndex`; 0 when the prompt was not tokenised here):

    ttft(r) = wait(r) + (r.queued_prefill_tokens + pending(r) + p - cached(r)) / rate(r)

A cache hit is simply fewer prefill tokens: it wins a replica the request only while the tokens it
saves outweigh that replica's extra queue, and never past the SLO. Equal predictions (an unknown
prefix on idle replicas) go to the shorter queue, then by name.

- `r.queued_prefill_tokens`: prompt tokens waiting on r at its last report;
- `pending(r)`: prompt tokens to prefill (less their predicted cache hits) admitted to r by any
  router since that report whose first token has not come back yet (from the `SharedState`, so
  other routers' admissions count too);
- `rate(r)`: prefill tokens per second: the reported `prefill_tokens_per_s` when > 0, else
  `token_budget / max(last_iteration_s, 1 ms)` — as if every iteration were full of prefill tokens,
  an optimistic bound used only until the worker has measured a rate;
- `wait(r)`: `r.last_iteration_s` where r is busy (`busy`: its last report shows requests waiting
  or running or prompt tokens queued, or every request admitted to it since has its first token):
  the iteration already running must finish before the prompt is scheduled. 0 where it reported
  itself idle and what was admitted since still awaits its prefill (that is in `pending(r)`): the
  last iteration it ran, however long ago, does not delay the prompt. So idle replicas' predictions
  are equal up to their rates, and a burst of short prompts spreads over them by `pending(r)`
  instead of piling onto the replica whose last iteration happened to be shortest.

Shedding, checked in this order:
1. "queue": every ready replica holds `max_queue_per_replica` requests (the larger of the shared
   in-flight count, this router's own count, and the reported waiting + running); retry after
   `queue_retry_after_s`.
2. "slo": even the best prediction exceeds the target, `ttft_slo * (1 + slo_margin)`. A prompt that
   alone takes longer than the SLO on an idle replica gets `its idle TTFT * (1 + slo_margin)` as its
   target instead, so it is served when the replica is nearly idle instead of never. Retry after
   the backlog has drained to the SLO: queued tokens drain at `rate`, so the prediction falls by one
   second per second, and the hint is `ttft - max(slo, idle TTFT)` on the best replica.
3. "rate_limit": the tenant's token bucket (see `chariot.router.ratelimit`) is short; retry after it
   has refilled enough. Charged only for requests that passed 1 and 2, refunded if the final atomic
   admission finds every candidate full after all.

Session affinity (optional): a request naming a session (the OpenAI `user`, an `X-Session-Id` header)
prefers the replica that last served that session while that replica meets the SLO and its prediction
is within `affinity_margin_ms` of the best; otherwise it goes to the best like any request. Sessions
are remembered per router (LRU, `max_sessions`), not in shared state: a hint, never a constraint.

Routing modes (`RouterConfig.routing`): "prefix" is all of the above; "load" predicts as if no replica
cached anything and ignores sessions; "round_robin" takes the admissible replicas in turn. Shedding
is the same in every mode, decided on the predictions the mode makes; the other two modes are the
baselines the prefix-aware one is measured against (`chariot bench routing`).

Every decision carries a routing reason (`contracts.telemetry.ROUTING_REASONS`, see `route_order`): "prefix" (the chosen
replica holds more of the prompt than the least-cached replica), "load" (no cache difference decided
it), "affinity" (the session hint changed the choice), "fallback" (the replica holding the longest
prefix was passed over because it would breach the SLO or its queue is full), "round_robin" (taken
in turn).
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from chariot.contracts.errors import AdmissionRejected, InvalidRequestError, NoReplicaAvailable
from chariot.contracts.telemetry import RoutingReason
from chariot.router.config import RouterConfig
from chariot.router.ratelimit import Charge, RateLimiter
from chariot.router.registry import ReplicaLoad, ReplicaRegistry, ReplicaView
from chariot.router.state import DuplicateRequestError, SharedLoad, SharedState, StateHealth

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
MIN_ITERATION_S = 1e-3
MIN_RETRY_AFTER_S = 0.05


@dataclass(frozen=True)
class Decision:
    """Where an admitted request goes, and the TTFT predicted for it there."""

    request_id: str
    replica_name: str
    address: str
    predicted_ttft_s: float
    cached_tokens: int = 0  # prompt tokens the replica is expected to serve from its prefix cache
    reason: RoutingReason = "load"


@dataclass(frozen=True)
class Prediction:
    """One replica's prediction for one prompt."""

    replica: str
    ttft_s: float
    idle_ttft_s: float
    queued_tokens: int
    prefill_rate: float
    queue_depth: int
    cached_tokens: int = 0


def prefill_rate(load: ReplicaLoad) -> float:
    """Prompt tokens per second: the measured rate, else a full token budget per iteration."""
    if load.prefill_tokens_per_s > 0:
        return load.prefill_tokens_per_s
    return load.token_budget / max(load.last_iteration_s, MIN_ITERATION_S)


def busy(load: ReplicaLoad, shared: SharedLoad, in_flight: int) -> bool:
    """Whether the replica is running an iteration the prompt must wait for: its last report shows
    work, or every one of the `in_flight` requests admitted to it has its first token (so it is
    decoding them). Requests still waiting for their prefill are in `pending(r)` instead: a burst of
    them does not add an iteration per request."""
    reported = load.num_waiting + load.num_running > 0 or load.queued_prefill_tokens > 0
    return reported or (in_flight > 0 and shared.pending_prefill_tokens == 0)


def predict(view: ReplicaView, shared: SharedLoad, prompt_tokens: int, cached_tokens: int = 0) -> Prediction:
    """The TTFT of a `prompt_tokens` prompt on `view` (which must have a load report), of which the
    replica holds the first `cached_tokens` in its prefix cache."""
    load = view.load
    assert load is not None
    rate = prefill_rate(load)
    queued = load.queued_prefill_tokens + shared.pending_prefill_tokens
    in_flight = max(shared.in_flight, view.in_flight)
    depth = max(in_flight, load.num_waiting + load.num_running)
    wait = load.last_iteration_s if busy(load, shared, in_flight) else 0.0
    cached = min(max(0, cached_tokens), prompt_tokens)
    computed = prompt_tokens - cached
    return Prediction(
        replica=view.name,
        ttft_s=wait + (queued + computed) / rate,
        idle_ttft_s=wait + computed / rate,
        queued_tokens=queued,
        prefill_rate=rate,
        queue_depth=depth,
        cached_tokens=cached,
    )


def route_order(
    candidates: list[Prediction],
    ranked: list[Prediction],
    *,
    affinity: str | None = None,
    affinity_margin_s: float = 0.0,
) -> list[tuple[Prediction, RoutingReason]]:
    """The order in which to try the admissible `candidates` (best first, as `_admissible` returns
    them), each with its routing reason; `ranked` is every replica considered, admissible or not.

    The session's replica (`affinity`) goes first when it is a candidate (so it meets the SLO and has
    room) and its prediction is within `affinity_margin_s` of the best candidate's.
    """
    order = list(candidates)
    preferred = next((p for p in order if p.replica == affinity), None)
    if preferred is not None and order[0] is not preferred and \
            preferred.ttft_s <= order[0].ttft_s + affinity_margin_s:
        order.remove(preferred)
        order.insert(0, preferred)
    least = min((p.cached_tokens for p in ranked), default=0)
    most = max((p.cached_tokens for p in ranked), default=0)
    admissible = {p.replica for p in candidates}
    holder_passed_over = most > 0 and not any(p.cached_tokens == most for p in ranked if p.replica in admissible)

    def reason(p: Prediction, first: bool) -> RoutingReason:
        if first and p is preferred and p is not candidates[0]:
            return "affinity"
        if holder_passed_over and p.cached_tokens < most:
            return "fallback"
        return "prefix" if p.cached_tokens > least else "load"

    return [(p, reason(p, i == 0)) for i, p in enumerate(order)]


@dataclass
class _Ticket:
    replica: str
    prompt_tokens: int
    prefilled: bool = False


RequestRef = str | Decision


class AdmissionController:
    """Decides, per request, a replica or a shed; keeps the accounting of admitted requests."""

    def __init__(
        self,
        config: RouterConfig,
        registry: ReplicaRegistry,
        state: SharedState,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._registry = registry
        self._state = state
        self._limiter = RateLimiter(config, state)
        self._clock = clock
        self._tickets: dict[str, _Ticket] = {}
        self._deciding: set[str] = set()
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session -> replica that last served it
        self._turn = 0  # round robin: how many decisions have been made

    # decisions -----------------------------------------------------------------------------------

    async def decide(
        self,
        prompt_tokens: int,
        tenant: str = DEFAULT_TENANT,
        now: float | None = None,
        *,
        max_tokens: int = 0,
        request_id: str | None = None,
        exclude: Collection[str] = (),
        cached_tokens: Mapping[str, int] | None = None,
        session: str = "",
    ) -> Decision:
        """Admit the request to a replica (none of `exclude`), or raise AdmissionRejected /
        NoReplicaAvailable.

        `cached_tokens`: per replica, the leading prompt tokens it holds in its prefix cache (absent:
        none). `session`: a session id whose previous replica is preferred (see the module docstring).
        `now` is on the monotonic clock of the load reports (default: now). Every Decision must
        be followed by `on_finish` (and `on_first_token` when the first token arrives).
        """
        t = self._clock() if now is None else now
        if prompt_tokens < 0 or max_tokens < 0:
            raise InvalidRequestError("prompt" if prompt_tokens < 0 else "max_tokens", "must not be negative")
        if self._config.routing != "prefix":
            cached_tokens, session = None, ""
        request_id = self._new_id(request_id)
        self._deciding.add(request_id)
        try:
            return await self._decide(request_id, prompt_tokens, tenant, t, max_tokens, exclude,
                                      cached_tokens or {}, session)
        finally:
            self._deciding.discard(request_id)

    async def _decide(self, request_id: str, prompt_tokens: int, tenant: str, t: float, max_tokens: int,
                      exclude: Collection[str], cached_tokens: Mapping[str, int], session: str) -> Decision:
        predictions = await self.predictions(prompt_tokens, t, max_tokens=max_tokens, cached_tokens=cached_tokens)
        ranked = [p for p in predictions if p.replica not in exclude]
        if not ranked:
            raise NoReplicaAvailable(f"no ready replica besides {', '.join(sorted(exclude))}")
        candidates = self._admissible(ranked)
        order = self._order(candidates, ranked, session)
        charge = await self._limiter.acquire(tenant or DEFAULT_TENANT, prompt_tokens, max_tokens)
        for prediction, reason in order:
            computed = prompt_tokens - prediction.cached_tokens
            if await self._try_admit(request_id, prediction, computed, charge):
                self._remember_session(session, prediction.replica)
                return self._admitted(request_id, prediction, computed, reason)
        await self._limiter.refund(charge)
        raise AdmissionRejected("queue", self._config.queue_retry_after_s)

    def _order(self, candidates: list[Prediction], ranked: list[Prediction],
               session: str) -> list[tuple[Prediction, RoutingReason]]:
        """The admissible replicas in the order to try them, by the configured routing mode."""
        if self._config.routing == "round_robin":  # every replica in turn, skipping inadmissible ones
            names = sorted(p.replica for p in ranked)
            start = self._turn % len(names)
            self._turn += 1
            admissible = {p.replica: p for p in candidates}
            return [(admissible[n], "round_robin") for n in names[start:] + names[:start] if n in admissible]
        return route_order(candidates, ranked, affinity=self._sessions.get(session) if session else None,
                           affinity_margin_s=self._config.affinity_margin_ms / 1000.0)

    def _remember_session(self, session: str, replica: str) -> None:
        if not session or self._config.affinity_margin_ms <= 0:
            return
        self._sessions[session] = replica
        self._sessions.move_to_end(session)
        while len(self._sessions) > self._config.max_sessions:
            self._sessions.popitem(last=False)

    def session_replica(self, session: str) -> str | None:
        """The replica that last served `session` through this router, if remembered."""
        return self._sessions.get(session)

    async def predictions(
        self, prompt_tokens: int, now: float | None = None, *, max_tokens: int = 0,
        cached_tokens: Mapping[str, int] | None = None,
    ) -> list[Prediction]:
        """Every ready replica that can hold the request, best (lowest TTFT) first; ties go to the
        shorter queue."""
        t = self._clock() if now is None else now
        views = self._fitting(self._ready(t), prompt_tokens, max_tokens)
        windows = {v.name: max(0.0, t - v.load.reported_at) for v in views if v.load is not None}
        shared = await self._state.loads(windows)
        cached = cached_tokens or {}
        ranked = [predict(v, shared.get(v.name, SharedLoad()), prompt_tokens, cached.get(v.name, 0)) for v in views]
        return sorted(ranked, key=lambda p: (p.ttft_s, p.queue_depth, p.replica))

    def _ready(self, now: float) -> list[ReplicaView]:
        ready = self._registry.ready(now)
        if not ready:
            known = len(self._registry.names())
            raise NoReplicaAvailable(
                f"no ready replica: {known} known, none with a load report from the last "
                f"{self._config.stats_staleness_s:g}s"
            )
        return ready

    @staticmethod
    def _fitting(views: list[ReplicaView], prompt_tokens: int, max_tokens: int) -> list[ReplicaView]:
        def fits(load: ReplicaLoad | None) -> bool:
            limit = load.max_model_len if load else 0
            return limit <= 0 or (prompt_tokens < limit and prompt_tokens + max_tokens <= limit)

        fitting = [v for v in views if fits(v.load)]
        if not fitting:
            limit = max(v.load.max_model_len for v in views if v.load is not None)
            if prompt_tokens >= limit:
                raise InvalidRequestError(
                    "prompt", f"is {prompt_tokens} tokens; max_model_len is {limit} (must leave room for output)"
                )
            raise InvalidRequestError(
                "max_tokens", f"prompt ({prompt_tokens}) + max_tokens ({max_tokens}) exceeds max_model_len ({limit})"
            )
        return fitting

    def _admissible(self, ranked: list[Prediction]) -> list[Prediction]:
        """Replicas under their queue bound that meet the SLO target, best first; else shed."""
        open_ = [p for p in ranked if p.queue_depth < self._config.max_queue_per_replica]
        if not open_:
            raise AdmissionRejected("queue", self._config.queue_retry_after_s)
        meeting = [p for p in open_ if p.ttft_s <= self._target_s(p)]
        if not meeting:
            raise AdmissionRejected("slo", self._slo_retry_after_s(open_))
        return meeting

    def _target_s(self, prediction: Prediction) -> float:
        return max(self._config.shed_threshold_s, prediction.idle_ttft_s * (1.0 + self._config.slo_margin))

    def _slo_retry_after_s(self, open_: list[Prediction]) -> float:
        """Seconds until the best replica's backlog has drained enough for the request to meet the SLO."""
        wait = min(p.ttft_s - max(self._config.ttft_slo_s, p.idle_ttft_s) for p in open_)
        wait = min(self._config.max_retry_after_s, max(MIN_RETRY_AFTER_S, wait))
        return math.ceil(wait * 1000.0) / 1000.0

    async def _try_admit(
        self, request_id: str, prediction: Prediction, prompt_tokens: int, charge: Charge | None
    ) -> bool:
        try:
            return await self._state.admit(
                request_id, prediction.replica, prompt_tokens, self._config.max_queue_per_replica
            )
        except DuplicateRequestError:
            await self._limiter.refund(charge)
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight") from None

    def _admitted(self, request_id: str, prediction: Prediction, prefill_tokens: int,
                  reason: RoutingReason) -> Decision:
        self._tickets[request_id] = _Ticket(prediction.replica, prefill_tokens)
        self._registry.note_admitted(prediction.replica, prefill_tokens)
        address = self._registry.address(prediction.replica) or ""
        return Decision(request_id, prediction.replica, address, prediction.ttft_s, prediction.cached_tokens, reason)

    def _new_id(self, request_id: str | None) -> str:
        if request_id is None:
            return uuid.uuid4().hex
        if not request_id:
            raise InvalidRequestError("request_id", "must not be empty")
        if request_id in self._tickets or request_id in self._deciding:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        return request_id

    # accounting ----------------------------------------------------------------------------------

    async def on_first_token(self, request: RequestRef) -> None:
        """The request's first token arrived: its prompt no longer counts as queued prefill work."""
        ticket = self._tickets.get(_request_id(request))
        if ticket is None or ticket.prefilled:
            return
        ticket.prefilled = True
        self._registry.note_first_token(ticket.replica, ticket.prompt_tokens)
        await self._state.first_token(_request_id(request), ticket.replica)

    async def on_finish(self, request: RequestRef) -> None:
        """The request ended (finished, failed or cancelled): release everything it held. Idempotent."""
        request_id = _request_id(request)
        ticket = self._tickets.pop(request_id, None)
        if ticket is None:
            return
        self._registry.note_finished(ticket.replica, 0 if ticket.prefilled else ticket.prompt_tokens)
        await self._state.release(request_id, ticket.replica)

    # introspection -------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Requests this router admitted that have not finished."""
        return len(self._tickets)

    def in_flight_by_replica(self) -> dict[str, int]:
        """This router's admitted, unfinished requests per replica (also of replicas no longer in the set)."""
        counts: dict[str, int] = {}
        for ticket in self._tickets.values():
            counts[ticket.replica] = counts.get(ticket.replica, 0) + 1
        return counts

    async def replica_of(self, request_id: str) -> str | None:
        """The replica serving `request_id`, admitted by this router or another one (cancellation)."""
        ticket = self._tickets.get(request_id)
        return ticket.replica if ticket else await self._state.replica_of(request_id)

    def health(self) -> StateHealth:
        """Whether shared state is in use or the router decides locally (degraded), and why."""
        return self._state.health()


def _request_id(request: RequestRef) -> str:
    return request.request_id if isinstance(request, Decision) else request
