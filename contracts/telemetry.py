"""Chariot's metrics and traces: the one place every instrument is defined, for router and workers alike.

Why one module: dashboards, alerts and the autoscaler query these series by name, so the names, units,
attributes and histogram buckets must not drift between the router and the workers. Everything goes
through the OpenTelemetry SDK (docs/architecture.md §7): one `MeterProvider` per `Telemetry`, read by a Prometheus
reader (pull, for `/metrics`) and, when an endpoint is given, pushed over OTLP. Providers are *not*
installed as the OpenTelemetry globals, and each Prometheus reader writes to its own
`prometheus_client.CollectorRegistry`, so several `Telemetry` objects (a router and two workers in one
test process) coexist without clashing.

Instruments (OpenTelemetry name → Prometheus name as scraped from `/metrics`; the exporter turns dots
into underscores, appends the unit — `s` → `_seconds`, curly-brace units such as `{token}` add
nothing — and `_total` on counters; histograms expose `_bucket`, `_sum` and `_count`):

=====================================  =========  ============  ==========================================
OpenTelemetry name                     kind       unit          Prometheus name
=====================================  =========  ============  ==========================================
gen_ai.server.time_to_first_token      histogram  s             gen_ai_server_time_to_first_token_seconds
gen_ai.server.time_per_output_token    histogram  s             gen_ai_server_time_per_output_token_seconds
gen_ai.server.request.duration         histogram  s             gen_ai_server_request_duration_seconds
gen_ai.client.token.usage              histogram  {token}       gen_ai_client_token_usage
chariot.admission.decisions            counter    {decision}    chariot_admission_decisions_total
chariot.router.retries                 counter    {request}     chariot_router_retries_total
chariot.router.routed                  counter    {request}     chariot_router_routed_total
chariot.router.prefix_hit_tokens       counter    {token}       chariot_router_prefix_hit_tokens_total
chariot.tenant.requests                counter    {request}     chariot_tenant_requests_total
chariot.tenant.rejections              counter    {request}     chariot_tenant_rejections_total
chariot.tenant.tokens                  counter    {token}       chariot_tenant_tokens_total
chariot.queue.delay                    histogram  s             chariot_queue_delay_seconds
chariot.requests.running               gauge      {request}     chariot_requests_running
chariot.requests.waiting               gauge      {request}     chariot_requests_waiting
chariot.kv_cache.usage                 gauge      1             chariot_kv_cache_usage
chariot.kv_cache.blocks_used           gauge      {block}       chariot_kv_cache_blocks_used
chariot.kv_cache.blocks                gauge      {block}       chariot_kv_cache_blocks
chariot.batch.tokens                   histogram  {token}       chariot_batch_tokens
chariot.stage.busy_time                counter    s             chariot_stage_busy_time_seconds_total
chariot.stage.idle_time                counter    s             chariot_stage_idle_time_seconds_total
chariot.pipeline.bubble_fraction       gauge      1             chariot_pipeline_bubble_fraction
chariot.tensor_parallel.collective_time counter   s             chariot_tensor_parallel_collective_time_seconds_total
chariot.prefix_cache.queries           counter    {token}       chariot_prefix_cache_queries_total
chariot.prefix_cache.hits              counter    {token}       chariot_prefix_cache_hits_total
chariot.router.hold_time               histogram  s             chariot_router_hold_time_seconds
chariot.offered_load.requests          gauge      {request}     chariot_offered_load_requests
chariot.offered_load.tokens            gauge      {token}       chariot_offered_load_tokens
chariot.offered_load.shed              gauge      {request}     chariot_offered_load_shed
chariot.offered_load.held              gauge      {request}     chariot_offered_load_held
chariot.replica.capacity               gauge      {token}       chariot_replica_capacity
chariot.autoscaler.desired_replicas    gauge      {group}       chariot_autoscaler_desired_replicas
chariot.autoscaler.current_replicas    gauge      {group}       chariot_autoscaler_current_replicas
chariot.autoscaler.decisions           counter    {decision}    chariot_autoscaler_decisions_total
=====================================  =========  ============  ==========================================

Attributes (Prometheus label in brackets): every point carries `component` (`router` | `worker`), and
`gen_ai.request.model` [`gen_ai_request_model`] when a model is known; `gen_ai.token.type`
[`gen_ai_token_type`] = `input` | `output` on token usage; `outcome` on admissions (see
`ADMISSION_OUTCOMES`); `kind` = `prefill` | `decode` | `total` on batch tokens; `stage` on the stage
counters and the bubble gauge; `stage` and `shard` on the tensor-parallel collective time;
`error.type` [`error_type`] on failed request durations; `replica` and `reason` (`ROUTING_REASONS`:
`prefix` | `load` | `affinity` | `fallback` | `round_robin`) on the router's routed requests and prefix-hit tokens.
`tenant` on the router's per-tenant counters (a configured tenant or `other`: the router bounds it),
with `reason` on rejections and `gen_ai.token.type` on tokens.
Request ids never become attributes (unbounded cardinality) — they go on spans.

Buckets are set with Views. Latency histograms use `LATENCY_BUCKETS_S`: 10 ms steps from 10 ms to
500 ms, so `histogram_quantile` interpolates within a 10 ms bucket and the P99 TBT is resolved to
10 ms (docs/architecture.md §7), then coarser steps up to 60 s. Token counts use powers of two
(`TOKEN_BUCKETS`), with a 0 bucket because `record_batch` records every kind on every iteration
(so `_count` is the iteration count for each kind and batch composition is `sum by (kind)` of `_sum`).

Gauges are *observable* gauges, read when a reader collects (each Prometheus scrape, each OTLP export):
owners either push the latest value (`set_engine_state`) or register a callable polled at collection
time (`observe_engine`). The observable form was chosen over the synchronous Gauge API because the
engine already owns these numbers and a scrape-time read is never stale; `set_engine_state` covers
callers that prefer to push. The bubble fraction is computed here, per stage, from the busy/idle times
reported through `add_stage_time` over the last `bubble_window_s` seconds.

Traces: with an OTLP endpoint (or an injected span exporter) each request gets a root span
`chariot.request` with one child per stage — `chariot.admission` → `chariot.queue` →
`chariot.prefill` → `chariot.decode` — via `Telemetry.request_span`; the router passes
`RequestSpans.carrier()` (W3C `traceparent`) to the worker, which continues the same trace. Without
an endpoint the tracer is a no-op and costs next to nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Literal, get_args

from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.exposition import choose_encoder

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from chariot.contracts.autoscaling import OfferedLoad

__all__ = [
    "ADMISSION_OUTCOMES",
    "BATCH_KINDS",
    "ENGINE_GAUGE_KEYS",
    "ERROR_TYPE_ATTR",
    "LATENCY_BUCKETS_S",
    "METRICS",
    "MODEL_ATTR",
    "PROMETHEUS_CONTENT_TYPE",
    "REQUEST_STAGES",
    "ROUTING_REASONS",
    "TOKEN_BUCKETS",
    "TOKEN_TYPE_ATTR",
    "AdmissionOutcome",
    "Attributes",
    "MetricSpec",
    "RequestSpans",
    "RequestTimer",
    "RoutingReason",
    "Telemetry",
    "iter_prometheus_names",
    "setup_telemetry",
]

log = logging.getLogger(__name__)

Attributes = Mapping[str, AttributeValue]

AdmissionOutcome = Literal["admitted", "shed_slo", "shed_queue", "rate_limited", "no_replica", "invalid"]
ADMISSION_OUTCOMES: tuple[str, ...] = get_args(AdmissionOutcome)
RoutingReason = Literal["prefix", "load", "affinity", "fallback", "round_robin"]
ROUTING_REASONS: tuple[str, ...] = get_args(RoutingReason)
BATCH_KINDS: tuple[str, ...] = ("prefill", "decode", "total")
REQUEST_STAGES: tuple[str, ...] = ("admission", "queue", "prefill", "decode")
ENGINE_GAUGE_KEYS: tuple[str, ...] = ("running", "waiting", "kv_cache_usage", "kv_blocks_used", "kv_blocks_total")

# What `generate_latest` writes: the classic text format (newer prometheus_client labels it 1.0.0, same bytes).
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

MODEL_ATTR = "gen_ai.request.model"
TOKEN_TYPE_ATTR = "gen_ai.token.type"
ERROR_TYPE_ATTR = "error.type"


def _latency_buckets() -> tuple[float, ...]:
    fine = [round(0.01 * i, 3) for i in range(1, 51)]  # 0.01 … 0.50, every 10 ms
    coarse = [0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0]
    return (0.001, 0.0025, 0.005, *fine, *coarse)


LATENCY_BUCKETS_S: tuple[float, ...] = _latency_buckets()
TOKEN_BUCKETS: tuple[float, ...] = (0.0, *(float(2**i) for i in range(18)))  # 0, 1, 2, 4, … 131072


@dataclass(frozen=True)
class MetricSpec:
    """One instrument: its OpenTelemetry identity and the Prometheus family name it is scraped as."""

    name: str
    kind: Literal["histogram", "counter", "gauge"]
    unit: str
    description: str
    prometheus: str
    buckets: tuple[float, ...] | None = None


METRICS: dict[str, MetricSpec] = {
    spec.name: spec
    for spec in (
        MetricSpec("gen_ai.server.time_to_first_token", "histogram", "s",
                   "Time from request arrival to the first output token.",
                   "gen_ai_server_time_to_first_token_seconds", LATENCY_BUCKETS_S),
        MetricSpec("gen_ai.server.time_per_output_token", "histogram", "s",
                   "Time between consecutive streamed output tokens (TBT), one point per token after the first.",
                   "gen_ai_server_time_per_output_token_seconds", LATENCY_BUCKETS_S),
        MetricSpec("gen_ai.server.request.duration", "histogram", "s",
                   "Time from request arrival to its last output token or failure.",
                   "gen_ai_server_request_duration_seconds", LATENCY_BUCKETS_S),
        MetricSpec("gen_ai.client.token.usage", "histogram", "{token}",
                   "Tokens per request, by gen_ai.token.type (input | output).",
                   "gen_ai_client_token_usage", TOKEN_BUCKETS),
        MetricSpec("chariot.admission.decisions", "counter", "{decision}",
                   "Admission decisions by outcome.",
                   "chariot_admission_decisions_total"),
        MetricSpec("chariot.router.retries", "counter", "{request}",
                   "Requests sent again to another replica because theirs failed before the first token.",
                   "chariot_router_retries_total"),
        MetricSpec("chariot.router.routed", "counter", "{request}",
                   "Requests the router sent to a replica, by replica and routing reason.",
                   "chariot_router_routed_total"),
        MetricSpec("chariot.router.prefix_hit_tokens", "counter", "{token}",
                   "Prompt tokens the chosen replica was predicted to serve from its prefix cache, by replica "
                   "and routing reason.",
                   "chariot_router_prefix_hit_tokens_total"),
        MetricSpec("chariot.tenant.requests", "counter", "{request}",
                   "Requests the router admitted, by tenant (a configured tenant or other).",
                   "chariot_tenant_requests_total"),
        MetricSpec("chariot.tenant.rejections", "counter", "{request}",
                   "Requests the router refused, by tenant and reason (unauthenticated, forbidden, rate_limit, "
                   "slo, queue, no_replica, invalid, error).",
                   "chariot_tenant_rejections_total"),
        MetricSpec("chariot.tenant.tokens", "counter", "{token}",
                   "Prompt and completion tokens of the router's finished requests, by tenant and "
                   "gen_ai.token.type.",
                   "chariot_tenant_tokens_total"),
        MetricSpec("chariot.queue.delay", "histogram", "s",
                   "Time from request arrival to its first scheduling.",
                   "chariot_queue_delay_seconds", LATENCY_BUCKETS_S),
        MetricSpec("chariot.requests.running", "gauge", "{request}",
                   "Requests currently scheduled (in the running batch).",
                   "chariot_requests_running"),
        MetricSpec("chariot.requests.waiting", "gauge", "{request}",
                   "Requests admitted but waiting to be scheduled.",
                   "chariot_requests_waiting"),
        MetricSpec("chariot.kv_cache.usage", "gauge", "1",
                   "Fraction of KV-cache blocks in use (0..1).",
                   "chariot_kv_cache_usage"),
        MetricSpec("chariot.kv_cache.blocks_used", "gauge", "{block}",
                   "KV-cache blocks in use (absolute: a leak shows however large the cache).",
                   "chariot_kv_cache_blocks_used"),
        MetricSpec("chariot.kv_cache.blocks", "gauge", "{block}",
                   "KV-cache blocks allocated in total.",
                   "chariot_kv_cache_blocks"),
        MetricSpec("chariot.batch.tokens", "histogram", "{token}",
                   "Tokens per engine iteration, by kind (prefill | decode | total).",
                   "chariot_batch_tokens", TOKEN_BUCKETS),
        MetricSpec("chariot.stage.busy_time", "counter", "s",
                   "Seconds a pipeline stage spent computing.",
                   "chariot_stage_busy_time_seconds_total"),
        MetricSpec("chariot.stage.idle_time", "counter", "s",
                   "Seconds a pipeline stage spent waiting for work (pipeline bubbles).",
                   "chariot_stage_idle_time_seconds_total"),
        MetricSpec("chariot.pipeline.bubble_fraction", "gauge", "1",
                   "Idle share of a stage's time over the recent window: idle / (busy + idle).",
                   "chariot_pipeline_bubble_fraction"),
        MetricSpec("chariot.tensor_parallel.collective_time", "counter", "s",
                   "Seconds a tensor-parallel rank spent in its stage's collectives (the all-reduces after "
                   "o_proj and down_proj, the embedding's, the logits all-gather); its share of an "
                   "iteration is its rate over the stage's busy-time rate.",
                   "chariot_tensor_parallel_collective_time_seconds_total"),
        MetricSpec("chariot.prefix_cache.queries", "counter", "{token}",
                   "Prompt tokens looked up in the prefix cache when a request was admitted.",
                   "chariot_prefix_cache_queries_total"),
        MetricSpec("chariot.prefix_cache.hits", "counter", "{token}",
                   "Of those, tokens whose KV was found cached and not computed (hit rate = hits / queries).",
                   "chariot_prefix_cache_hits_total"),
        MetricSpec("chariot.router.hold_time", "histogram", "s",
                   "Time a request waited at the router for a first ready replica (scale from zero), by "
                   "outcome (served | timeout).",
                   "chariot_router_hold_time_seconds", LATENCY_BUCKETS_S),
        MetricSpec("chariot.offered_load.requests", "gauge", "{request}",
                   "Requests per second arriving at the router over its offered-load window (admitted, or "
                   "refused for load).",
                   "chariot_offered_load_requests"),
        MetricSpec("chariot.offered_load.tokens", "gauge", "{token}",
                   "Tokens per second offered over the window, by gen_ai.token.type (input: prompts of the "
                   "arriving requests; output: tokens generated).",
                   "chariot_offered_load_tokens"),
        MetricSpec("chariot.offered_load.shed", "gauge", "{request}",
                   "Requests per second shed for load (SLO or full queues) over the window.",
                   "chariot_offered_load_shed"),
        MetricSpec("chariot.offered_load.held", "gauge", "{request}",
                   "Requests waiting at the router for a first ready replica.",
                   "chariot_offered_load_held"),
        MetricSpec("chariot.replica.capacity", "gauge", "{token}",
                   "Tokens per second a replica sustains at its SLO token budget (measured from its step "
                   "timings), by replica: the autoscaler's per-group capacity.",
                   "chariot_replica_capacity"),
        MetricSpec("chariot.autoscaler.desired_replicas", "gauge", "{group}",
                   "Groups the operator's autoscaler wants for a ModelDeployment (label modeldeployment = "
                   "namespace/name), after stabilisation and bounds.",
                   "chariot_autoscaler_desired_replicas"),
        MetricSpec("chariot.autoscaler.current_replicas", "gauge", "{group}",
                   "spec.replicas of that ModelDeployment when the autoscaler last looked.",
                   "chariot_autoscaler_current_replicas"),
        MetricSpec("chariot.autoscaler.decisions", "counter", "{decision}",
                   "The autoscaler's looks, by modeldeployment and reason (ScaleUp, ScaleDown, ScaleFromZero, "
                   "Bounded, Stabilizing, Stable, NoCapacity, NoOfferedLoad, HPAConflict).",
                   "chariot_autoscaler_decisions_total"),
    )
}  # fmt: skip

OfferedExtract = Callable[["OfferedLoad"], list[tuple[dict[str, str], float]]]
# What each offered-load gauge reads from a snapshot: (extra attributes, value) points.
OFFERED_GAUGES: dict[str, OfferedExtract] = {
    "chariot.offered_load.requests": lambda o: [({}, o.arrival_rate)],
    "chariot.offered_load.tokens": lambda o: [({TOKEN_TYPE_ATTR: "input"}, o.prompt_token_rate),
                                              ({TOKEN_TYPE_ATTR: "output"}, o.output_token_rate)],
    "chariot.offered_load.shed": lambda o: [({}, o.shed_rate)],
    "chariot.offered_load.held": lambda o: [({}, float(o.held))],
    "chariot.replica.capacity": lambda o: [({"replica": name}, value) for name, value in sorted(o.capacity.items())],
}


def _views() -> list[View]:
    return [
        View(instrument_name=spec.name, aggregation=ExplicitBucketHistogramAggregation(list(spec.buckets)))
        for spec in METRICS.values()
        if spec.buckets is not None
    ]


def _key(attrs: Attributes) -> tuple[tuple[str, AttributeValue], ...]:
    return tuple(sorted(attrs.items()))


class RequestSpans:
    """The spans of one request: a root span and, at most one at a time, a child span per stage.

    Stages are sequential and their boundaries happen in different places (router admission, the
    scheduler loop, the executor), so instead of nested `with` blocks a stage is *entered*: `stage(x)`
    ends the current stage span and opens `chariot.x`. Thread-agnostic: nothing is attached to the
    ambient context. Usable as a context manager, which ends the trace (recording an exception if any).
    """

    def __init__(self, tracer: Tracer, root: Span, attributes: Attributes) -> None:
        self._tracer = tracer
        self._root = root
        self._attributes = dict(attributes)
        self._stage: Span | None = None
        self._stage_name: str | None = None
        self._ended = False

    @property
    def span(self) -> Span:
        return self._root

    @property
    def current_stage(self) -> str | None:
        return self._stage_name

    def stage(self, name: str, attributes: Attributes | None = None, *, timestamp_ns: int | None = None) -> None:
        """End the current stage (if any) and start stage `name` (one of `REQUEST_STAGES`, usually)."""
        if self._ended:
            return
        self._end_stage(timestamp_ns)
        ctx = trace.set_span_in_context(self._root)
        self._stage = self._tracer.start_span(
            f"chariot.{name}",
            context=ctx,
            attributes={**self._attributes, **(attributes or {})},
            start_time=timestamp_ns,
        )
        self._stage_name = name

    def event(self, name: str, attributes: Attributes | None = None, *, timestamp_ns: int | None = None) -> None:
        """Add an event (e.g. `first_token`, `preempted`) to the current stage span, else the root."""
        target = self._stage if self._stage is not None else self._root
        target.add_event(name, attributes=dict(attributes or {}), timestamp=timestamp_ns)

    def set_attributes(self, attributes: Attributes) -> None:
        self._root.set_attributes(dict(attributes))

    def carrier(self) -> dict[str, str]:
        """W3C trace-context headers (`traceparent`) to pass downstream, e.g. as gRPC metadata."""
        out: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(out, context=trace.set_span_in_context(self._root))
        return out

    def end(self, error: BaseException | str | None = None, *, timestamp_ns: int | None = None) -> None:
        """End the open stage and the root span; `error` marks both as failed. Idempotent."""
        if self._ended:
            return
        if error is not None:
            status = Status(StatusCode.ERROR, str(error))
            for span in (self._stage, self._root):
                if span is None:
                    continue
                if isinstance(error, BaseException):
                    span.record_exception(error)
                span.set_status(status)
        self._end_stage(timestamp_ns)
        self._root.end(end_time=timestamp_ns)
        self._ended = True

    def _end_stage(self, timestamp_ns: int | None) -> None:
        if self._stage is not None:
            self._stage.end(end_time=timestamp_ns)
            self._stage = None
            self._stage_name = None

    def __enter__(self) -> RequestSpans:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.end(exc)


class RequestTimer:
    """Turns one request's timeline into TTFT, TBT, queue-delay, duration and token-usage points.

    Callers mark moments (`scheduled`, `tokens`, `finish`) and the definitions stay in one place:
    TTFT = arrival → first token; TBT = gap between consecutive streamed tokens, one point per token
    after the first (a chunk of k tokens arriving after a gap g records g/k k times); queue delay =
    arrival → first scheduling; duration = arrival → finish. `clock` is `time.monotonic` by default
    and must match whatever `arrival` was measured with.
    """

    def __init__(
        self,
        telemetry: Telemetry,
        attributes: Attributes | None = None,
        *,
        arrival: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._telemetry = telemetry
        self._attributes = dict(attributes or {})
        self._clock = clock
        self.arrival = clock() if arrival is None else arrival
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.output_tokens = 0
        self.finished = False

    def scheduled(self, now: float | None = None) -> None:
        """Mark the request scheduled; only the first call records queue delay (preemptions don't)."""
        if self.first_scheduled is not None:
            return
        self.first_scheduled = self._clock() if now is None else now
        self._telemetry.record_queue_delay(self.first_scheduled - self.arrival, self._attributes)

    def tokens(self, n: int = 1, now: float | None = None) -> None:
        """Mark `n` output tokens delivered at `now` (one streamed chunk)."""
        if n <= 0:
            return
        now = self._clock() if now is None else now
        if self.first_token is None:
            self.first_token = now
            self._telemetry.record_ttft(now - self.arrival, self._attributes)
            if n > 1:  # the rest of the first chunk arrived with no gap
                self._telemetry.record_tbt(0.0, self._attributes, count=n - 1)
        else:
            assert self.last_token is not None
            self._telemetry.record_tbt((now - self.last_token) / n, self._attributes, count=n)
        self.last_token = now
        self.output_tokens += n

    def finish(
        self,
        input_tokens: int,
        output_tokens: int | None = None,
        *,
        error_type: str | None = None,
        now: float | None = None,
    ) -> None:
        """Record duration and token usage once; `output_tokens` defaults to the tokens counted so far."""
        if self.finished:
            return
        self.finished = True
        now = self._clock() if now is None else now
        self._telemetry.record_request(
            now - self.arrival,
            input_tokens,
            self.output_tokens if output_tokens is None else output_tokens,
            self._attributes,
            error_type=error_type,
        )


EngineCallback = Callable[[], Mapping[str, float]]


@dataclass
class _StageWindow:
    samples: deque[tuple[float, float, float]] = field(default_factory=deque)  # (t, busy, idle)
    last_fraction: float | None = None


class Telemetry:
    """Metrics and traces for one process component (a router or a worker). Build with `setup_telemetry`."""

    def __init__(
        self,
        service_name: str,
        component: str,
        *,
        model: str | None = None,
        otlp_endpoint: str | None = None,
        resource_attributes: Attributes | None = None,
        metric_exporter: MetricExporter | None = None,
        span_exporter: SpanExporter | None = None,
        export_interval_s: float = 10.0,
        bubble_window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.service_name = service_name
        self.component = component
        self.model = model
        self.base_attributes: dict[str, AttributeValue] = {"component": component}
        if model is not None:
            self.base_attributes[MODEL_ATTR] = model
        self._clock = clock
        self._bubble_window_s = bubble_window_s
        self._lock = threading.Lock()
        self._engine_values: dict[str, dict[tuple[tuple[str, AttributeValue], ...], float]] = {
            k: {} for k in ENGINE_GAUGE_KEYS
        }
        self._engine_callbacks: list[tuple[EngineCallback, dict[str, AttributeValue]]] = []
        self._stage_windows: dict[str, _StageWindow] = {}
        self._servers: list[WSGIServer] = []
        self._closed = False

        resource = Resource.create(
            {"service.name": service_name, "chariot.component": component, **(resource_attributes or {})}
        )

        # Metrics: a private registry per instance, so several Telemetry objects can share a process.
        self.registry = CollectorRegistry(auto_describe=True)
        from opentelemetry.exporter.prometheus import PrometheusMetricReader

        readers: list[MetricReader] = [PrometheusMetricReader(registry=self.registry, scope_info_enabled=False)]
        if metric_exporter is None and otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            metric_exporter = OTLPMetricExporter(endpoint=otlp_endpoint)
        if metric_exporter is not None:
            readers.append(
                PeriodicExportingMetricReader(metric_exporter, export_interval_millis=export_interval_s * 1000)
            )
        self.meter_provider = MeterProvider(
            metric_readers=readers, resource=resource, views=_views(), shutdown_on_exit=False
        )
        meter = self.meter_provider.get_meter("chariot", "0.1.0")
        self._meter = meter

        def hist(name: str) -> Histogram:
            spec = METRICS[name]
            return meter.create_histogram(spec.name, unit=spec.unit, description=spec.description)

        def counter(name: str) -> Counter:
            spec = METRICS[name]
            return meter.create_counter(spec.name, unit=spec.unit, description=spec.description)

        self._ttft = hist("gen_ai.server.time_to_first_token")
        self._tbt = hist("gen_ai.server.time_per_output_token")
        self._duration = hist("gen_ai.server.request.duration")
        self._token_usage = hist("gen_ai.client.token.usage")
        self._queue_delay = hist("chariot.queue.delay")
        self._batch_tokens = hist("chariot.batch.tokens")
        self._admissions = counter("chariot.admission.decisions")
        self._retries = counter("chariot.router.retries")
        self._routed = counter("chariot.router.routed")
        self._prefix_hit_tokens = counter("chariot.router.prefix_hit_tokens")
        self._tenant_requests = counter("chariot.tenant.requests")
        self._tenant_rejections = counter("chariot.tenant.rejections")
        self._tenant_tokens = counter("chariot.tenant.tokens")
        self._busy = counter("chariot.stage.busy_time")
        self._idle = counter("chariot.stage.idle_time")
        self._collectives = counter("chariot.tensor_parallel.collective_time")
        self._prefix_queries = counter("chariot.prefix_cache.queries")
        self._prefix_hits = counter("chariot.prefix_cache.hits")
        for name, key in (
            ("chariot.requests.running", "running"),
            ("chariot.requests.waiting", "waiting"),
            ("chariot.kv_cache.usage", "kv_cache_usage"),
            ("chariot.kv_cache.blocks_used", "kv_blocks_used"),
            ("chariot.kv_cache.blocks", "kv_blocks_total"),
        ):
            spec = METRICS[name]
            meter.create_observable_gauge(
                spec.name, callbacks=[self._engine_gauge_callback(key)], unit=spec.unit, description=spec.description
            )
        spec = METRICS["chariot.pipeline.bubble_fraction"]
        meter.create_observable_gauge(
            spec.name, callbacks=[self._bubble_callback], unit=spec.unit, description=spec.description
        )
        self._hold_time = hist("chariot.router.hold_time")
        self._autoscaler_decisions = counter("chariot.autoscaler.decisions")
        self._autoscaler_state: dict[str, tuple[int, int]] = {}  # modeldeployment -> (desired, current)
        for name, index in (("chariot.autoscaler.desired_replicas", 0), ("chariot.autoscaler.current_replicas", 1)):
            spec = METRICS[name]
            meter.create_observable_gauge(spec.name, callbacks=[self._autoscaler_callback(index)], unit=spec.unit,
                                          description=spec.description)
        self._offered_sources: list[tuple[Callable[[], OfferedLoad], dict[str, AttributeValue]]] = []
        for name, extract in OFFERED_GAUGES.items():
            spec = METRICS[name]
            meter.create_observable_gauge(spec.name, callbacks=[self._offered_callback(extract)], unit=spec.unit,
                                          description=spec.description)
        # Start every outcome at zero so the first decision of a kind shows up in rate()/increase().
        for outcome in ADMISSION_OUTCOMES:
            self._admissions.add(0, {**self.base_attributes, "outcome": outcome})

        # Traces: recorded only where there is somewhere to send them.
        self.tracer_provider: TracerProvider | None = None
        if span_exporter is None and otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            span_exporter = OTLPSpanExporter(endpoint=otlp_endpoint)
        if span_exporter is not None:
            self.tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
            self.tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
            self.tracer: Tracer = self.tracer_provider.get_tracer("chariot", "0.1.0")
        else:
            self.tracer = trace.NoOpTracer()

    # ----------------------------------------------------------------------------------------- recording

    def _attrs(self, attributes: Attributes | None, **extra: AttributeValue) -> dict[str, AttributeValue]:
        return {**self.base_attributes, **(attributes or {}), **extra}

    def record_ttft(self, seconds: float, attributes: Attributes | None = None) -> None:
        self._ttft.record(seconds, self._attrs(attributes))

    def record_tbt(self, seconds: float, attributes: Attributes | None = None, *, count: int = 1) -> None:
        """One time-between-tokens gap per streamed token (`count` equal gaps at once)."""
        attrs = self._attrs(attributes)
        for _ in range(count):
            self._tbt.record(seconds, attrs)

    def record_request(
        self,
        duration: float,
        input_tokens: int,
        output_tokens: int,
        attributes: Attributes | None = None,
        *,
        error_type: str | None = None,
    ) -> None:
        """A finished request: its duration and its input/output token counts."""
        attrs = self._attrs(attributes)
        self._duration.record(duration, {**attrs, ERROR_TYPE_ATTR: error_type} if error_type else attrs)
        self._token_usage.record(input_tokens, {**attrs, TOKEN_TYPE_ATTR: "input"})
        self._token_usage.record(output_tokens, {**attrs, TOKEN_TYPE_ATTR: "output"})

    def record_admission(self, outcome: AdmissionOutcome | str, attributes: Attributes | None = None) -> None:
        if outcome not in ADMISSION_OUTCOMES:
            raise ValueError(f"unknown admission outcome {outcome!r}; expected one of {ADMISSION_OUTCOMES}")
        self._admissions.add(1, self._attrs(attributes, outcome=outcome))

    def record_retry(self, failed_replica: str) -> None:
        """A request re-sent elsewhere after `failed_replica` failed it before its first token."""
        self._retries.add(1, self._attrs(None, replica=failed_replica))

    def record_routing(self, replica: str, reason: str, cached_tokens: int) -> None:
        """A request routed to `replica` for `reason`, predicted to find `cached_tokens` cached there."""
        if reason not in ROUTING_REASONS:
            raise ValueError(f"unknown routing reason {reason!r}; expected one of {ROUTING_REASONS}")
        attrs = self._attrs(None, replica=replica, reason=reason)
        self._routed.add(1, attrs)
        self._prefix_hit_tokens.add(cached_tokens, attrs)

    def record_tenant_request(self, tenant: str) -> None:
        """A request of `tenant` (a bounded label: the router maps unknown tenants to one) was admitted."""
        self._tenant_requests.add(1, self._attrs(None, tenant=tenant))

    def record_tenant_rejection(self, tenant: str, reason: str) -> None:
        """A request of `tenant` was refused for `reason` (a bounded set, see `chariot.tenant.rejections`)."""
        self._tenant_rejections.add(1, self._attrs(None, tenant=tenant, reason=reason))

    def record_tenant_tokens(self, tenant: str, input_tokens: int, output_tokens: int) -> None:
        """A finished request's prompt (`input`) and completion (`output`) tokens, for its tenant."""
        attrs = self._attrs(None, tenant=tenant)
        self._tenant_tokens.add(max(0, input_tokens), {**attrs, TOKEN_TYPE_ATTR: "input"})
        self._tenant_tokens.add(max(0, output_tokens), {**attrs, TOKEN_TYPE_ATTR: "output"})

    def record_queue_delay(self, seconds: float, attributes: Attributes | None = None) -> None:
        self._queue_delay.record(seconds, self._attrs(attributes))

    def record_batch(self, prefill_tokens: int, decode_tokens: int, attributes: Attributes | None = None) -> None:
        """One engine iteration's batch composition: prefill, decode and total tokens (zeros included)."""
        attrs = self._attrs(attributes)
        self._batch_tokens.record(prefill_tokens, {**attrs, "kind": "prefill"})
        self._batch_tokens.record(decode_tokens, {**attrs, "kind": "decode"})
        self._batch_tokens.record(prefill_tokens + decode_tokens, {**attrs, "kind": "total"})

    def record_prefix_cache(self, queried_tokens: int, hit_tokens: int, attributes: Attributes | None = None) -> None:
        """Prompt tokens looked up in the prefix cache at admission, and how many of them hit."""
        attrs = self._attrs(attributes)
        self._prefix_queries.add(queried_tokens, attrs)
        self._prefix_hits.add(hit_tokens, attrs)

    def add_stage_time(
        self, stage: str | int, busy_s: float, idle_s: float, attributes: Attributes | None = None
    ) -> None:
        """Time a pipeline stage spent computing and idle since its last report; feeds the bubble gauge."""
        stage = str(stage)
        attrs = self._attrs(attributes, stage=stage)
        if busy_s > 0:
            self._busy.add(busy_s, attrs)
        if idle_s > 0:
            self._idle.add(idle_s, attrs)
        with self._lock:
            window = self._stage_windows.setdefault(stage, _StageWindow())
            window.samples.append((self._clock(), max(busy_s, 0.0), max(idle_s, 0.0)))

    def add_collective_time(self, stage: str | int, shard: str | int, seconds: float) -> None:
        """Time tensor-parallel rank `shard` of `stage` spent in collectives since its last report."""
        if seconds > 0:
            self._collectives.add(seconds, self._attrs(None, stage=str(stage), shard=str(shard)))

    # ------------------------------------------------------------------------------------------- gauges

    def set_engine_state(
        self,
        *,
        running: float | None = None,
        waiting: float | None = None,
        kv_cache_usage: float | None = None,
        kv_blocks_used: int | None = None,
        kv_blocks_total: int | None = None,
        attributes: Attributes | None = None,
    ) -> None:
        """Push the latest running/waiting/KV values; reported until overwritten."""
        key = _key(self._attrs(attributes))
        values = (("running", running), ("waiting", waiting), ("kv_cache_usage", kv_cache_usage),
                  ("kv_blocks_used", kv_blocks_used), ("kv_blocks_total", kv_blocks_total))
        with self._lock:
            for name, value in values:
                if value is not None:
                    self._engine_values[name][key] = float(value)

    def observe_engine(self, callback: EngineCallback, attributes: Attributes | None = None) -> Callable[[], None]:
        """Poll `callback()` at every collection for any of `ENGINE_GAUGE_KEYS`; returns an unregister function.

        The callback runs on the scraping thread, so it must be cheap and thread-safe (reading a few ints
        is fine). Missing keys are skipped; an exception skips that callback for that collection.
        """
        entry = (callback, self._attrs(attributes))
        with self._lock:
            self._engine_callbacks.append(entry)

        def unregister() -> None:
            with self._lock:
                if entry in self._engine_callbacks:
                    self._engine_callbacks.remove(entry)

        return unregister

    def observe_offered_load(self, source: Callable[[], OfferedLoad],
                             attributes: Attributes | None = None) -> Callable[[], None]:
        """Read `source()` (the router's offered-load snapshot) at every collection for the
        `chariot.offered_load.*` and `chariot.replica.capacity` gauges; returns an unregister function."""
        entry = (source, self._attrs(attributes))
        with self._lock:
            self._offered_sources.append(entry)

        def unregister() -> None:
            with self._lock:
                if entry in self._offered_sources:
                    self._offered_sources.remove(entry)

        return unregister

    def _offered_callback(self, extract: OfferedExtract) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            with self._lock:
                sources = list(self._offered_sources)
            points = []
            for source, attrs in sources:
                try:
                    load = source()
                except Exception:
                    log.exception("offered-load source %r failed", source)
                    continue
                points += [Observation(value, {**attrs, **extra}) for extra, value in extract(load)]
            return points

        return callback

    def record_autoscaler(self, deployment: str, reason: str, desired: int | None, current: int) -> None:
        """One look of the operator's autoscaler at `deployment` (`namespace/name`); `desired` None
        forgets its gauges (autoscaling was turned off)."""
        with self._lock:
            if desired is None:
                self._autoscaler_state.pop(deployment, None)
                return
            self._autoscaler_state[deployment] = (desired, current)
        self._autoscaler_decisions.add(1, self._attrs(None, modeldeployment=deployment, reason=reason))

    def _autoscaler_callback(self, index: int) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            with self._lock:
                state = dict(self._autoscaler_state)
            return [Observation(values[index], self._attrs(None, modeldeployment=name))
                    for name, values in sorted(state.items())]

        return callback

    def record_hold(self, seconds: float, outcome: str) -> None:
        """A request held for a first ready replica was `served` (or timed out) after `seconds`."""
        self._hold_time.record(seconds, self._attrs(None, outcome=outcome))

    def _engine_gauge_callback(self, key: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            with self._lock:
                values = dict(self._engine_values[key])
                callbacks = list(self._engine_callbacks)
            observations = {attrs: Observation(value, dict(attrs)) for attrs, value in values.items()}
            for fn, attrs in callbacks:
                try:
                    snapshot = fn()
                except Exception:
                    log.exception("engine gauge callback %r failed", fn)
                    continue
                if key in snapshot:
                    observations[_key(attrs)] = Observation(float(snapshot[key]), attrs)
            return list(observations.values())

        return callback

    def bubble_fractions(self) -> dict[str, float]:
        """Per stage idle / (busy + idle) over the last `bubble_window_s` (last value if nothing new)."""
        now = self._clock()
        out: dict[str, float] = {}
        with self._lock:
            for stage, window in self._stage_windows.items():
                while window.samples and window.samples[0][0] < now - self._bubble_window_s:
                    window.samples.popleft()
                busy = sum(s[1] for s in window.samples)
                idle = sum(s[2] for s in window.samples)
                if busy + idle > 0:
                    window.last_fraction = idle / (busy + idle)
                if window.last_fraction is not None:
                    out[stage] = window.last_fraction
        return out

    def _bubble_callback(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(v, self._attrs(None, stage=s)) for s, v in self.bubble_fractions().items()]

    # ------------------------------------------------------------------------------------------- tracing

    def request_span(
        self,
        request_id: str,
        attributes: Attributes | None = None,
        *,
        parent: Mapping[str, str] | None = None,
        start_stage: str | None = "admission",
        timestamp_ns: int | None = None,
    ) -> RequestSpans:
        """Open the `chariot.request` root span (child of `parent`, a `RequestSpans.carrier()` dict).

        `start_stage` opens the first stage span right away (`admission` on the router; a worker
        continuing a router's trace would pass `"queue"`); `None` opens none.
        """
        attrs: dict[str, AttributeValue] = {**self._attrs(attributes), "chariot.request.id": request_id}
        ctx = TraceContextTextMapPropagator().extract(dict(parent)) if parent else None
        root = self.tracer.start_span("chariot.request", context=ctx, attributes=attrs, start_time=timestamp_ns)
        rt = RequestSpans(self.tracer, root, {"component": self.component, "chariot.request.id": request_id})
        if start_stage is not None:
            rt.stage(start_stage, timestamp_ns=timestamp_ns)
        return rt

    def request_timer(self, attributes: Attributes | None = None, *, arrival: float | None = None) -> RequestTimer:
        return RequestTimer(self, attributes, arrival=arrival, clock=self._clock)

    # ---------------------------------------------------------------------------------------- exposition

    def prometheus_text(self) -> bytes:
        """The Prometheus text exposition of this instance's metrics (serve with `PROMETHEUS_CONTENT_TYPE`)."""
        return generate_latest(self.registry)

    def prometheus_response(self, accept: str | None = None) -> tuple[bytes, str]:
        """Body and content type for a `/metrics` handler, negotiated on the request's Accept header.

        Prometheus asks for OpenMetrics when it can; without an Accept header this is the plain text format.
        """
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    def start_metrics_server(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve `/metrics` from a daemon thread; returns the bound port (`port=0` picks a free one).

        For processes without an HTTP server of their own (workers speak gRPC). Use host `0.0.0.0` to be
        scraped from other pods; the default is loopback.
        """
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._servers.append(server)
        return int(server.server_port)

    def force_flush(self, timeout_millis: int = 5000) -> None:
        self.meter_provider.force_flush(timeout_millis)
        if self.tracer_provider is not None:
            self.tracer_provider.force_flush(timeout_millis)

    def shutdown(self, timeout_millis: int = 5000) -> None:
        """Stop metrics servers, flush and stop exporters. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers.clear()
        self.meter_provider.shutdown(timeout_millis)
        if self.tracer_provider is not None:
            self.tracer_provider.force_flush(timeout_millis)
            self.tracer_provider.shutdown()

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()


def setup_telemetry(
    service_name: str,
    component: str,
    otlp_endpoint: str | None = None,
    *,
    model: str | None = None,
    resource_attributes: Attributes | None = None,
    metric_exporter: MetricExporter | None = None,
    span_exporter: SpanExporter | None = None,
    export_interval_s: float = 10.0,
    bubble_window_s: float = 10.0,
) -> Telemetry:
    """Build a `Telemetry` for `component` (`router` | `worker`).

    `otlp_endpoint` (gRPC, e.g. `http://otel-collector:4317`; an `http://` scheme means plaintext)
    adds OTLP metric and span export; without it metrics are pull-only and tracing is a no-op.
    `metric_exporter` / `span_exporter` override the OTLP ones (tests pass in-memory exporters).
    `model` is added as `gen_ai.request.model` to every point.
    """
    return Telemetry(
        service_name,
        component,
        model=model,
        otlp_endpoint=otlp_endpoint,
        resource_attributes=resource_attributes,
        metric_exporter=metric_exporter,
        span_exporter=span_exporter,
        export_interval_s=export_interval_s,
        bubble_window_s=bubble_window_s,
    )


def iter_prometheus_names() -> Iterator[str]:
    """Every Prometheus family name Chariot exposes (for docs and dashboard checks)."""
    for spec in METRICS.values():
        yield spec.prometheus
