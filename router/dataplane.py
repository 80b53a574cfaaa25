"""The router's data plane: one transport-agnostic path from a parsed request to streamed chunks.

Why one module for both fronts (the KServe "data plane" idea): the gRPC front and the OpenAI HTTP
front differ only in how they parse requests and render chunks. Everything that decides what happens
to a request — the model check, prompt-length counting, admission control, the call to the chosen
replica, first-token and finish accounting, router-side TTFT/TBT metrics, traces and cancellation —
lives here once, so both fronts behave identically and are tested through the same code.

`DataPlane.generate(GenerateInput)` is an async generator of the worker's `RequestOutput` deltas:

1. checks the model name (`UnknownModelError`) and counts prompt tokens. With the tokenizer
   (`--model`) a text prompt is tokenised here, once, and its token ids are what the worker gets (it
   does not tokenise again). Without one, a text prompt goes to the worker as text, its length
   estimated as one token per `BYTES_PER_TOKEN_ESTIMATE` UTF-8 bytes and capped so that the estimate
   alone never fails the length check (the worker enforces the exact limit and its INVALID_ARGUMENT
   comes back here);
2. with token ids, looks the prompt up in `prefix_index` (hashed once: how many leading tokens each
   replica holds in its prefix cache) and asks `AdmissionController.decide` (which raises
   `AdmissionRejected`, `NoReplicaAvailable` or `InvalidRequestError`), recording every outcome with
   `Telemetry.record_admission` and the routing with `Telemetry.record_routing`. The router then
   records its own decision in the index (`add_blocks(replica, prompt blocks)`): the replica will
   hold those blocks once it has prefilled them, so a conversation's next turn finds its history
   there before, or without, the worker's KV events. A text prompt without a tokenizer routes by load;
3. streams `Generate` from the chosen replica's stage-0 worker over that replica's shared channel as
   raw bytes, decodes each response into a `RequestOutput` that keeps those bytes (`wire`, so the
   gRPC front relays the worker's message unchanged) and the replica's name, and times it as the
   client feels it (TTFT, one TBT point per token) with `Telemetry.request_timer`;
4. always — finished, failed, or abandoned by the caller — cancels the worker call if it is still
   running (so the worker aborts the request and frees its KV blocks), and calls
   `on_first_token` / `on_finish` on the admission controller exactly once each.

A caller that stops consuming must close the generator (`contextlib.aclosing`) or cancel the task
iterating it; both run step 4 at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from chariot.contracts.autoscaling import OfferedLoad
from chariot.contracts.errors import (
    AdmissionRejected,
    AuthenticationError,
    InvalidRequestError,
    NoReplicaAvailable,
    PermissionDeniedError,
    UnknownModelError,
)
from chariot.contracts.outputs import RequestOutput
from chariot.contracts.proto_codec import output_from_response, request_to_proto
from chariot.contracts.requests import FinishReason, Prompt
from chariot.contracts.sampling_params import SamplingParams
from chariot.contracts.telemetry import RequestSpans, RequestTimer, Telemetry
from chariot.contracts.tokenizer import Tokenizer
from chariot.proto.chariot.v1 import generation_pb2 as pb
from chariot.router.admission import DEFAULT_TENANT, AdmissionController, Decision
from chariot.router.auth import KeyStore, Principal, RequestLimiter
from chariot.router.config import RouterConfig
from chariot.router.kv_events import KVEventSubscriber
from chariot.router.offered_load import LoadMeter, snapshot
from chariot.router.prefix_index import PrefixIndex, PromptHashes
from chariot.router.registry import RegistryChange, ReplicaRegistry, ReplicaView
from chariot.router.state import StateHealth
from chariot.router.upstream import (
    ReplicaChannels,
    ReplicaUnavailable,
    StatsPoller,
    aggregate_stats,
    upstream_error,
)

__all__ = [
    "BYTES_PER_TOKEN_ESTIMATE",
    "DataPlane",
    "GenerateInput",
    "Health",
    "ModelInfo",
    "ReplicaUnavailable",
    "StatsPoller",
    "admission_outcome",
]

log = logging.getLogger(__name__)


# Without a tokenizer, a text prompt is assumed to be one token per this many UTF-8 bytes (typical
# of BPE vocabularies on English). Used for load prediction only, never to reject a request.
BYTES_PER_TOKEN_ESTIMATE = 4
# Texts longer than this are tokenized off the event loop.
INLINE_TOKENIZE_CHARS = 8192
# The key of the offered-load gauges' registration among the per-replica ones (no replica has this name).
OFFERED_GAUGES_KEY = "\0offered-load"
# How often a request held for a first ready replica looks again (scale from zero).
HOLD_POLL_S = 0.05
# Replicas a request may be re-sent to when its replica fails it before the first token.
MAX_RETRIES = 2
# The tenant label of every tenant that is not configured (see `DataPlane.tenant_label`).
OTHER_TENANT = "other"

_SHED_OUTCOMES = {"slo": "shed_slo", "queue": "shed_queue", "rate_limit": "rate_limited"}


@dataclass(frozen=True)
class GenerateInput:
    """One parsed request, whatever front it came from."""

    prompt: Prompt
    params: SamplingParams
    request_id: str = ""  # empty: the router makes one
    tenant: str = ""  # empty: the default tenant
    model: str = ""  # empty: the served model
    trace_parent: Mapping[str, str] | None = None  # W3C trace context of the caller, if any
    session: str = ""  # session-affinity hint (OpenAI `user`, `X-Session-Id`); empty: none
    principal: Principal | None = None  # the API key's tenant and rights (None: no keys configured)
    end_user: str = ""  # with an API key, what the caller named (`user`, `X-Tenant`): a label only


@dataclass(frozen=True)
class ModelInfo:
    """What `/v1/models` lists."""

    id: str
    max_model_len: int
    ready_replicas: int
    replicas: int


@dataclass(frozen=True)
class Health:
    """Serving (readiness) when at least one replica is ready, or when the router holds requests while
    none is (`holds`: a hold queue, i.e. scale from zero): a router scaled to zero must stay in its
    Service's endpoints, or the request that would wake a group never reaches it. `state` tells
    whether shared state is degraded."""

    ready_replicas: int
    replicas: int
    state: StateHealth
    in_flight: int = 0  # requests this router admitted that have not finished
    holds: bool = False  # requests wait for a first ready replica instead of a 503 (`hold_queue` > 0)

    @property
    def serving(self) -> bool:
        return self.ready_replicas > 0 or self.holds


def admission_outcome(exc: BaseException) -> str | None:
    """The `chariot.admission.decisions` outcome of a rejection (None: not an admission outcome)."""
    if isinstance(exc, AdmissionRejected):
        return _SHED_OUTCOMES.get(exc.reason, "shed_queue")
    if isinstance(exc, NoReplicaAvailable):
        return "no_replica"
    if isinstance(exc, InvalidRequestError):
        return "invalid"
    return None


@dataclass
class _Flight:
    """One admitted request's bookkeeping while it streams."""

    decision: Decision
    timer: RequestTimer
    trace: RequestSpans
    prompt: Prompt  # what the worker gets: token ids when the router has the tokenizer
    prompt_tokens: int
    hashes: PromptHashes | None = None  # the prompt's block hashes when the router has its token ids
    completion_tokens: int = 0
    first_token: asyncio.Task[None] | None = None
    error: BaseException | str | None = None
    released: bool = False  # its admission slot was given back (once per decision)
    tenant: str = DEFAULT_TENANT  # its tenant's metrics label (`DataPlane.tenant_label`)


class DataPlane:
    """Admission, routing and streaming for both fronts (see the module docstring)."""

    def __init__(
        self,
        config: RouterConfig,
        registry: ReplicaRegistry,
        admission: AdmissionController,
        telemetry: Telemetry,
        tokenizer: Tokenizer | None,
        *,
        keys: KeyStore | None = None,
        request_limiter: RequestLimiter | None = None,
    ) -> None:
        self.config = config
        self.keys = keys  # API keys (`chariot.router.auth`): the fronts authenticate with them
        self.request_limiter = request_limiter
        self.registry = registry
        self.admission = admission
        self.telemetry = telemetry
        self.tokenizer = tokenizer
        self.served_model = config.served_model
        self.channels = ReplicaChannels(registry)
        self.poller = StatsPoller(registry, self.channels, config.stats_interval_s, on_report=self._on_report)
        self.prefix_index = PrefixIndex()
        # Keeps prefix_index current from each replica's KV event stream (`kv_events.py`).
        self.kv_events = KVEventSubscriber(registry, self.channels, self.prefix_index)
        # What arrives here, for the autoscaler (`offered_load.py`; `GET /load`, Redis).
        self.load_meter = LoadMeter(config.offered_load_window_s)
        self.held = 0  # requests waiting for a first ready replica (`_decide_or_hold`)
        self._gauges: dict[str, Any] = {}
        registry.subscribe(self._on_replicas_changed)

    def _on_report(self, name: str, stats: Any) -> None:
        """A replica's load report: its prefix index holds no more hashes than it has KV blocks."""
        if stats.num_blocks > 0:
            self.prefix_index.set_capacity(name, min(int(stats.num_blocks), self.prefix_index.capacity))

    def _on_replicas_changed(self, change: RegistryChange) -> None:
        for name in change.removed + change.changed:
            self.prefix_index.drop_replica(name)
        self._sync_gauges()

    # lifetime ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start polling every replica's Stats and following its KV events (on the serving event loop)."""
        self._sync_gauges()
        self._gauges[OFFERED_GAUGES_KEY] = self.telemetry.observe_offered_load(self.offered_load)
        self.poller.start()
        self.kv_events.start()

    async def aclose(self) -> None:
        await self.poller.aclose()
        await self.kv_events.aclose()
        await self.channels.aclose()
        for unregister in self._gauges.values():
            unregister()
        self._gauges.clear()

    # introspection -------------------------------------------------------------------------------

    def health(self) -> Health:
        ready, known = len(self.registry.ready()), len(self.registry.names())
        return Health(ready, known, self.admission.health(), self.admission.in_flight,
                      holds=self.config.hold_queue > 0)

    def models(self) -> list[ModelInfo]:
        ready = self.registry.ready()
        return [ModelInfo(self.served_model, _max_model_len(ready), len(ready), len(self.registry.names()))]

    def offered_load(self) -> OfferedLoad:
        """This router's offered load, each replica's capacity and in-flight count (`GET /load`)."""
        return snapshot(self.load_meter, self.registry, self.config.tbt_slo_ms / 1000.0,
                        self.admission.in_flight_by_replica(), self.held)

    def stats(self) -> Any:
        """The deployment's load: every ready replica's latest report, aggregated (`StatsResponse`)."""
        ready = {view.name for view in self.registry.ready()}
        reports = [stats for name, stats in self.poller.latest().items() if name in ready]
        return aggregate_stats(reports, self.served_model)

    # requests ------------------------------------------------------------------------------------

    def reject(self, exc: BaseException, tenant: str = "") -> None:
        """Record a request a front rejected before it reached `generate` (e.g. malformed input)."""
        outcome = admission_outcome(exc)
        if outcome is not None:
            self.telemetry.record_admission(outcome)
        self.telemetry.record_tenant_rejection(self.tenant_label(tenant), rejection_reason(exc))

    def tenant_label(self, tenant: str) -> str:
        """`tenant` as a metrics label: a configured tenant (key file, `--rate-limit`) or "other", so
        a caller naming made-up tenants cannot grow the label set."""
        tenant = tenant or DEFAULT_TENANT
        known = tenant == DEFAULT_TENANT or tenant in self.config.tenant_rate_limits
        return tenant if known or (self.keys is not None and tenant in self.keys.tenants) else OTHER_TENANT

    async def tokenize(self, prompt: Prompt) -> Prompt:
        """A text prompt's token ids when the router has the tokenizer; otherwise `prompt` as it is."""
        if not isinstance(prompt, str) or self.tokenizer is None:
            return prompt
        if len(prompt) <= INLINE_TOKENIZE_CHARS:
            return self.tokenizer.encode(prompt)
        return await asyncio.to_thread(self.tokenizer.encode, prompt)

    def count_prompt_tokens(self, prompt: Prompt, max_tokens: int) -> int:
        """Prompt length in tokens: exact for token ids, else (text without a tokenizer) an estimate."""
        if not isinstance(prompt, str):
            return len(prompt)
        estimate = max(1, math.ceil(len(prompt.encode("utf-8", "replace")) / BYTES_PER_TOKEN_ESTIMATE))
        limit = _max_model_len(self.registry.ready())
        return max(1, min(estimate, limit - max_tokens)) if limit > 0 else estimate

    async def generate(self, req: GenerateInput) -> AsyncGenerator[RequestOutput, None]:
        """Admit `req`, stream its chunks from a replica; see the module docstring for the guarantees.

        A replica that fails the request before its first token (unreachable, its stage died) is
        dropped from rotation until its next load report, and the request goes to another replica
        (at most `MAX_RETRIES` times; `chariot.router.retries` counts them). After the first token
        it is never re-sent: the client would see tokens twice."""
        flight = await self._admit(req)
        tried: list[str] = []
        try:
            while True:
                try:
                    # aclosing: when the caller closes this generator, the worker call is cancelled at once.
                    async with contextlib.aclosing(self._relay(req, flight)) as chunks:
                        async for chunk in chunks:
                            yield chunk
                    return
                except ReplicaUnavailable as exc:
                    if flight.first_token is not None or len(tried) >= MAX_RETRIES:
                        raise
                    tried.append(flight.decision.replica_name)
                    await self._resend(req, flight, tried, exc)
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            await self._finish(flight)

    async def _resend(self, req: GenerateInput, flight: _Flight, tried: list[str], failure: Exception) -> None:
        """Move `flight` from its failed replica to another one, or raise `failure` if none admits it."""
        failed = flight.decision.replica_name
        self.registry.clear_load(failed)  # out of rotation until it reports again
        await self._release(flight)
        try:
            flight.decision = await self.admission.decide(
                flight.prompt_tokens, req.tenant or DEFAULT_TENANT, max_tokens=req.params.max_tokens,
                request_id=flight.decision.request_id, exclude=tried, cached_tokens=self._cached(flight.hashes),
                session=req.session)
        except Exception as exc:
            raise failure from exc
        flight.released = False  # the new decision's slot is to be given back
        self._routed(flight.decision, flight.hashes)
        log.warning("replica %s failed request %s before its first token (%s); retrying on %s", failed,
                    flight.decision.request_id, failure, flight.decision.replica_name)
        self.telemetry.record_retry(failed)
        flight.trace.event("retry", {"chariot.failed_replica": failed, "chariot.replica": flight.decision.replica_name})

    async def _admit(self, req: GenerateInput) -> _Flight:
        timer = self.telemetry.request_timer()
        started_ns = time.time_ns()
        prompt_tokens = -1  # unknown until counted: a request refused before then is not offered load
        try:
            if req.model and req.model != self.served_model:
                raise UnknownModelError(req.model, self.served_model)
            if req.principal is not None:
                req.principal.check_model(req.model or self.served_model)
            prompt = await self.tokenize(req.prompt)
            prompt_tokens = self.count_prompt_tokens(prompt, req.params.max_tokens)
            hashes = None if isinstance(prompt, str) else self.prefix_index.hash_prompt(prompt)
            decision = await self._decide_or_hold(req, prompt_tokens, hashes)
        except Exception as exc:
            if prompt_tokens >= 0 and is_load_refusal(exc):
                self.load_meter.arrival(prompt_tokens, shed=isinstance(exc, AdmissionRejected))
            self.reject(exc, req.tenant)
            trace = self.telemetry.request_span(req.request_id, parent=req.trace_parent, timestamp_ns=started_ns)
            trace.end(exc)
            raise
        self.load_meter.arrival(prompt_tokens)
        tenant = self.tenant_label(req.tenant)
        self.telemetry.record_tenant_request(tenant)
        self.telemetry.record_admission("admitted")
        self._routed(decision, hashes)
        attributes: dict[str, Any] = {
            "chariot.replica": decision.replica_name, "chariot.tenant": req.tenant or DEFAULT_TENANT,
            "chariot.routing": decision.reason, "chariot.predicted_cached_tokens": decision.cached_tokens}
        if req.end_user:
            attributes["chariot.end_user"] = req.end_user
        trace = self.telemetry.request_span(decision.request_id, attributes, parent=req.trace_parent,
                                            timestamp_ns=started_ns)
        trace.stage("queue")  # until the first token: queued and prefilled on the replica
        return _Flight(decision, timer, trace, prompt, prompt_tokens, hashes, tenant=tenant)

    async def _decide_or_hold(self, req: GenerateInput, prompt_tokens: int, hashes: PromptHashes | None) -> Decision:
        """Admit; while no replica at all is ready (scaled to zero, or every group restarting), hold the
        request for a first ready replica: at most `hold_queue` requests, each at most `hold_timeout_s`
        (then 503 with `Retry-After`). Held requests show in the offered load (`held`), which is what
        makes the autoscaler start a group; the wait is recorded (`chariot.router.hold_time`)."""
        try:
            return await self._decide(req, prompt_tokens, hashes)
        except NoReplicaAvailable:
            if self.registry.ready() or self.held >= self.config.hold_queue:
                raise
        started = time.monotonic()
        deadline = started + self.config.hold_timeout_s
        self.held += 1
        try:
            while True:
                await asyncio.sleep(HOLD_POLL_S)
                if self.registry.ready():
                    try:
                        decision = await self._decide(req, prompt_tokens, hashes)
                    except NoReplicaAvailable:
                        if time.monotonic() < deadline:
                            continue
                        raise
                    self.telemetry.record_hold(time.monotonic() - started, "served")
                    return decision
                if time.monotonic() >= deadline:
                    self.telemetry.record_hold(time.monotonic() - started, "timeout")
                    raise NoReplicaAvailable(f"no replica became ready within {self.config.hold_timeout_s:g}s",
                                             retry_after_s=self.config.queue_retry_after_s)
        finally:
            self.held -= 1

    async def _decide(self, req: GenerateInput, prompt_tokens: int, hashes: PromptHashes | None) -> Decision:
        """Charge the key's request bucket, then admit; the request is refunded if admission refuses."""
        charged = self.request_limiter is not None and await self.request_limiter.acquire(req.principal)
        try:
            return await self.admission.decide(
                prompt_tokens,
                req.tenant or DEFAULT_TENANT,
                max_tokens=req.params.max_tokens,
                request_id=req.request_id or None,
                cached_tokens=self._cached(hashes),
                session=req.session,
            )
        except BaseException:
            if charged and self.request_limiter is not None and req.principal is not None:
                await self.request_limiter.refund(req.principal)
            raise

    def _cached(self, hashes: PromptHashes | None) -> dict[str, int] | None:
        """Per known replica, the prompt's leading tokens in its prefix cache (None: not tokenised here,
        or hashed before the index changed its block size)."""
        if hashes is None or not self.prefix_index.accepts(hashes):
            return None
        return self.prefix_index.cached_tokens(hashes, self.registry.names())

    def _routed(self, decision: Decision, hashes: PromptHashes | None) -> None:
        """Count the routing, and record that the chosen replica will hold the prompt's blocks."""
        self.telemetry.record_routing(decision.replica_name, decision.reason, decision.cached_tokens)
        if hashes is not None and hashes.hashes and self.prefix_index.accepts(hashes):
            self.prefix_index.add_blocks(decision.replica_name, hashes.hashes)

    async def _relay(self, req: GenerateInput, flight: _Flight) -> AsyncGenerator[RequestOutput, None]:
        decision = flight.decision
        generate = self.channels.generate_call(decision.replica_name)
        wire = request_to_proto(flight.prompt, req.params, request_id=decision.request_id, tenant=req.tenant)
        call = generate(wire, metadata=tuple(flight.trace.carrier().items()))
        finished = False
        try:
            async for raw in call:
                out = output_from_response(pb.GenerateResponse.FromString(raw), raw, decision.replica_name)
                if out.finish_reason == FinishReason.ERROR and flight.first_token is None and not out.new_token_ids:
                    # failed before any token (e.g. a stage of its group died): another replica may serve it
                    raise ReplicaUnavailable(f"replica {decision.replica_name} failed the request: {out.error}")
                self._on_output(flight, out)
                finished = out.finished
                yield out
        except grpc.aio.AioRpcError as err:
            raise upstream_error(decision.replica_name, err, self.config.queue_retry_after_s) from err
        finally:
            call.cancel()  # a no-op once the call ended; otherwise the worker aborts the request
        if not finished:  # e.g. the worker shut down mid-request and closed the stream cleanly
            raise ReplicaUnavailable(f"replica {decision.replica_name} ended the stream before the request finished")

    def _on_output(self, flight: _Flight, out: RequestOutput) -> None:
        n = len(out.new_token_ids)
        if n and flight.first_token is None:
            flight.first_token = asyncio.get_running_loop().create_task(self.admission.on_first_token(flight.decision))
            flight.trace.stage("decode")
            flight.trace.event("first_token")
        flight.timer.tokens(n)
        self.load_meter.output(n)
        flight.prompt_tokens = out.num_prompt_tokens or flight.prompt_tokens
        flight.completion_tokens = out.num_output_tokens
        if out.error:
            flight.error = out.error

    async def _finish(self, flight: _Flight) -> None:
        """Metrics, trace and admission release of one admitted request; runs exactly once."""
        error_type = _error_type(flight.error)
        flight.timer.finish(flight.prompt_tokens, flight.completion_tokens, error_type=error_type)
        self.telemetry.record_tenant_tokens(flight.tenant, flight.prompt_tokens, flight.completion_tokens)
        flight.trace.end("cancelled" if error_type == "cancelled" else flight.error)
        release = asyncio.ensure_future(self._release(flight))
        with contextlib.suppress(asyncio.CancelledError):  # cancelled again: the release still completes
            await asyncio.shield(release)

    async def _release(self, flight: _Flight) -> None:
        if flight.released:
            return
        flight.released = True
        if flight.first_token is not None:
            with contextlib.suppress(Exception):
                await flight.first_token
        try:
            await self.admission.on_finish(flight.decision)
        except Exception:
            log.exception("releasing request %s failed", flight.decision.request_id)

    # replica gauges ------------------------------------------------------------------------------

    def _sync_gauges(self) -> None:
        """One running/waiting/KV-usage gauge series per replica (label `replica`)."""
        names = set(self.registry.names()) | {OFFERED_GAUGES_KEY}
        for gone in set(self._gauges) - names:
            self._gauges.pop(gone)()
        for name in names - set(self._gauges) - {OFFERED_GAUGES_KEY}:
            self._gauges[name] = self.telemetry.observe_engine(
                functools.partial(self._replica_gauges, name), {"replica": name}
            )

    def _replica_gauges(self, name: str) -> dict[str, float]:
        stats = self.poller.latest().get(name)
        if stats is None:
            return {}
        return {"running": stats.num_running, "waiting": stats.num_waiting, "kv_cache_usage": stats.kv_cache_usage,
                "kv_blocks_used": stats.num_blocks - stats.num_free_blocks, "kv_blocks_total": stats.num_blocks}


def rejection_reason(exc: BaseException) -> str:
    """The `reason` label of a refused request on `chariot.tenant.rejections` (a bounded set)."""
    if isinstance(exc, AuthenticationError):
        return "unauthenticated"
    if isinstance(exc, PermissionDeniedError):
        return "forbidden"
    if isinstance(exc, AdmissionRejected):
        return exc.reason if exc.reason in ("slo", "queue", "rate_limit") else "queue"
    return admission_outcome(exc) or "error"


def is_load_refusal(exc: BaseException) -> bool:
    """Refused for lack of capacity (shed for the SLO or full queues, or no ready replica): demand the
    autoscaler must see. Rate limits and bad requests are not."""
    if isinstance(exc, AdmissionRejected):
        return exc.reason in ("slo", "queue")
    return isinstance(exc, NoReplicaAvailable)


def _error_type(error: BaseException | str | None) -> str | None:
    if error is None:
        return None
    if isinstance(error, str):
        return "replica_error"
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return "cancelled"
    return type(error).__name__


def _max_model_len(ready: list[ReplicaView]) -> int:
    """The tightest max_model_len among ready replicas (0 when none reports one)."""
    return min((v.load.max_model_len for v in ready if v.load is not None and v.load.max_model_len > 0), default=0)
