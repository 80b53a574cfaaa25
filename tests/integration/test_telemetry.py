"""`chariot.contracts.telemetry` end to end: the exposition, the OTLP push, traces, and a real Prometheus.

The Prometheus test is the one that matters for dashboards: it scrapes a running `Telemetry` and checks,
through PromQL, the documented names and labels, that `histogram_quantile` over the TBT buckets lands
within 10 ms of the true P99 of what was recorded (the resolution docs/architecture.md §7 asks for),
and that counters and gauges read back exactly.
"""

from __future__ import annotations

import itertools
import random
import re
import threading
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracer, StatusCode

from chariot.contracts.autoscaling import OfferedLoad
from chariot.contracts.telemetry import (
    ADMISSION_OUTCOMES,
    LATENCY_BUCKETS_S,
    METRICS,
    PROMETHEUS_CONTENT_TYPE,
    TOKEN_BUCKETS,
    Telemetry,
    setup_telemetry,
)
from tests.prometheus import sample_value

ROOT = Path(__file__).resolve().parents[2]
TBT = "gen_ai_server_time_per_output_token_seconds"
TTFT = "gen_ai_server_time_to_first_token_seconds"
W = 'component="worker",gen_ai_request_model="tiny"'  # the labels every point of the `telemetry` fixture has


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    t = setup_telemetry("chariot-worker-test", "worker", model="tiny")
    yield t
    t.shutdown()


def record_everything(t: Telemetry) -> None:
    t.record_ttft(0.123)
    t.record_tbt(0.021)
    t.record_request(1.5, 17, 33)
    t.record_request(0.2, 5, 0, error_type="cancelled")
    t.record_admission("admitted")
    t.record_queue_delay(0.004)
    t.record_batch(512, 7)
    t.add_stage_time("0", 0.8, 0.2)
    t.set_engine_state(running=3, waiting=2, kv_cache_usage=0.5, kv_blocks_used=4, kv_blocks_total=8)
    t.record_retry("g0")
    t.record_routing("g0", "prefix", 48)
    t.record_tenant_request("team-a")
    t.record_tenant_rejection("team-a", "rate_limit")
    t.record_tenant_tokens("team-a", 12, 4)
    t.record_prefix_cache(10, 4)
    t.add_collective_time(0, 1, 0.05)
    t.record_hold(2.5, "served")
    t.record_autoscaler("prod/llama", "ScaleUp", 3, 1)
    t.observe_offered_load(lambda: OfferedLoad(window_s=30.0, arrival_rate=2.0, prompt_token_rate=300.0,
                                               output_token_rate=100.0, shed_rate=0.5, held=1,
                                               capacity={"g0": 900.0}))


def type_lines(text: str) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M))


def le_values(text: str, family: str) -> list[float]:
    les = re.findall(rf'^{family}_bucket\{{[^}}]*le="([^"]+)"', text, flags=re.M)
    return sorted({float(x) for x in les if x != "+Inf"})


# ------------------------------------------------------------------------------ exposition (no Prometheus)


def test_exposition_has_documented_names_and_types(telemetry: Telemetry) -> None:
    record_everything(telemetry)
    types = type_lines(telemetry.prometheus_text().decode())
    for spec in METRICS.values():
        assert types.get(spec.prometheus) == spec.kind, (spec.name, spec.prometheus, types)


def test_exposition_labels(telemetry: Telemetry) -> None:
    record_everything(telemetry)
    text = telemetry.prometheus_text().decode()
    assert f'{TTFT}_count{{component="worker",gen_ai_request_model="tiny"}} 1.0' in text
    assert f'gen_ai_client_token_usage_sum{{{W},gen_ai_token_type="input"}} 22.0' in text
    assert f'gen_ai_client_token_usage_sum{{{W},gen_ai_token_type="output"}} 33.0' in text
    assert 'error_type="cancelled"' in text
    for kind, value in (("prefill", 512), ("decode", 7), ("total", 519)):
        assert f'chariot_batch_tokens_sum{{{W},kind="{kind}"}} {value}.0' in text
    assert f'chariot_router_routed_total{{{W},reason="prefix",replica="g0"}} 1.0' in text
    assert f'chariot_router_prefix_hit_tokens_total{{{W},reason="prefix",replica="g0"}} 48.0' in text
    with pytest.raises(ValueError, match="routing reason"):
        telemetry.record_routing("g0", "luck", 0)
    for outcome in ADMISSION_OUTCOMES:  # every outcome exists from the start, so rate() sees the first one
        value = 1.0 if outcome == "admitted" else 0.0
        assert (
            f'chariot_admission_decisions_total{{component="worker",gen_ai_request_model="tiny",outcome="{outcome}"}} '
            f"{value}" in text
        )
    assert 'chariot_stage_busy_time_seconds_total{component="worker",gen_ai_request_model="tiny",stage="0"} 0.8' in text
    assert 'chariot_pipeline_bubble_fraction{component="worker",gen_ai_request_model="tiny",stage="0"}' in text
    assert 'chariot_kv_cache_usage{component="worker",gen_ai_request_model="tiny"} 0.5' in text
    assert 'service_name="chariot-worker-test"' in text  # target_info carries the resource


def test_latency_buckets_resolve_10ms_and_token_buckets_double(telemetry: Telemetry) -> None:
    record_everything(telemetry)
    text = telemetry.prometheus_text().decode()
    for family in (TTFT, TBT, "gen_ai_server_request_duration_seconds", "chariot_queue_delay_seconds"):
        les = le_values(text, family)
        assert les == list(LATENCY_BUCKETS_S)
        fine = [x for x in les if 0.01 <= x <= 0.5]
        assert fine[0] == 0.01 and fine[-1] == 0.5
        assert max(np.diff(fine)) <= 0.01 + 1e-9
        assert les[-1] == 60.0
    for family in ("gen_ai_client_token_usage", "chariot_batch_tokens"):
        les = le_values(text, family)
        assert les == list(TOKEN_BUCKETS)
        assert all(b == 2 * a for a, b in itertools.pairwise(les[1:]))


def test_prometheus_response_negotiates(telemetry: Telemetry) -> None:
    telemetry.record_ttft(0.1)
    body, ctype = telemetry.prometheus_response(None)
    assert ctype.startswith("text/plain") and body == telemetry.prometheus_text()
    assert PROMETHEUS_CONTENT_TYPE.startswith("text/plain; version=0.0.4")
    body, ctype = telemetry.prometheus_response("application/openmetrics-text; version=1.0.0")
    assert ctype.startswith("application/openmetrics-text") and body.rstrip().endswith(b"# EOF")


def test_invalid_admission_outcome_is_rejected(telemetry: Telemetry) -> None:
    with pytest.raises(ValueError, match="unknown admission outcome"):
        telemetry.record_admission("maybe")


def test_instances_are_isolated() -> None:
    with setup_telemetry("r", "router") as router, setup_telemetry("w", "worker") as worker:
        router.record_admission("shed_slo")
        worker.record_ttft(0.5)
        rtext, wtext = router.prometheus_text().decode(), worker.prometheus_text().decode()
        assert 'component="router",outcome="shed_slo"} 1.0' in rtext and 'component="worker"' not in rtext
        assert f"{TTFT}_count" in wtext and f"{TTFT}_count" not in rtext


def test_gauges_push_pull_unregister_and_faulty_callback(telemetry: Telemetry) -> None:
    state = {"running": 4.0, "waiting": 1.0}
    unregister = telemetry.observe_engine(lambda: state, {"replica": "a"})
    telemetry.observe_engine(lambda: 1 / 0)  # type: ignore[arg-type,return-value]  # must not break scrapes
    telemetry.set_engine_state(kv_cache_usage=0.75, kv_blocks_used=3, kv_blocks_total=4)
    text = telemetry.prometheus_text().decode()
    assert 'chariot_kv_cache_blocks_used{component="worker",gen_ai_request_model="tiny"} 3.0' in text
    assert 'chariot_kv_cache_blocks{component="worker",gen_ai_request_model="tiny"} 4.0' in text
    assert 'chariot_requests_running{component="worker",gen_ai_request_model="tiny",replica="a"} 4.0' in text
    assert 'chariot_kv_cache_usage{component="worker",gen_ai_request_model="tiny"} 0.75' in text
    state["running"] = 9.0
    assert 'replica="a"} 9.0' in telemetry.prometheus_text().decode()
    unregister()
    assert 'replica="a"' not in telemetry.prometheus_text().decode()


def test_bubble_fraction_uses_recent_window() -> None:
    now = [100.0]
    with Telemetry("w", "worker", bubble_window_s=10.0, clock=lambda: now[0]) as t:
        t.add_stage_time(0, busy_s=1.0, idle_s=1.0)
        t.add_stage_time(1, busy_s=3.0, idle_s=1.0)
        assert t.bubble_fractions() == {"0": 0.5, "1": 0.25}
        now[0] += 20.0  # the old samples leave the window
        t.add_stage_time(0, busy_s=9.0, idle_s=1.0)
        assert t.bubble_fractions() == {"0": pytest.approx(0.1), "1": 0.25}  # stage 1: last known value


def test_request_timer_definitions() -> None:
    now = [10.0]
    with Telemetry("w", "worker", clock=lambda: now[0]) as t:
        timer = t.request_timer({"gen_ai.request.model": "m"}, arrival=10.0)
        now[0] = 10.25
        timer.scheduled()
        timer.scheduled(now=99.0)  # re-scheduling after preemption is not queue delay
        timer.tokens(now=10.5)  # TTFT 0.5
        timer.tokens(now=10.52)  # TBT 0.02
        timer.tokens(2, now=10.58)  # two tokens after 0.06: 0.03 each
        timer.finish(input_tokens=11, now=11.0)
        timer.finish(input_tokens=11, now=12.0)  # once only
        text = t.prometheus_text().decode()
    assert re.search(rf"{TTFT}_sum\{{[^}}]*\}} 0\.5\n", text)
    assert re.search(rf"{TBT}_count\{{[^}}]*\}} 3\.0\n", text)
    tbt_sum = float(re.search(rf"{TBT}_sum\{{[^}}]*\}} (\S+)\n", text).group(1))  # type: ignore[union-attr]
    assert tbt_sum == pytest.approx(0.08)
    assert re.search(r"chariot_queue_delay_seconds_sum\{[^}]*\} 0\.25\n", text)
    assert re.search(r"gen_ai_server_request_duration_seconds_sum\{[^}]*\} 1\.0\n", text)
    assert re.search(r'gen_ai_client_token_usage_sum\{[^}]*gen_ai_token_type="output"\} 4\.0\n', text)


def test_metrics_server_on_port_zero() -> None:
    with setup_telemetry("a", "worker") as a, setup_telemetry("b", "worker") as b:
        pa, pb = a.start_metrics_server("127.0.0.1", 0), b.start_metrics_server("127.0.0.1", 0)
        assert pa > 0 and pb > 0 and pa != pb
        a.record_ttft(0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{pa}/metrics", timeout=5) as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            assert f"{TTFT}_count" in r.read().decode()


# ------------------------------------------------------------------------------------------------ tracing


def test_request_spans_router_to_worker() -> None:
    router_spans, worker_spans = InMemorySpanExporter(), InMemorySpanExporter()
    with (
        setup_telemetry("router", "router", span_exporter=router_spans) as router,
        setup_telemetry("worker", "worker", span_exporter=worker_spans) as worker,
    ):
        with router.request_span("req-1", {"gen_ai.request.model": "tiny"}) as rt:
            carrier = rt.carrier()
            assert "traceparent" in carrier
            wt = worker.request_span("req-1", parent=carrier, start_stage="queue")
            wt.stage("prefill")
            wt.event("first_token")
            wt.stage("decode")
            wt.end()
            rt.stage("queue")
        with pytest.raises(RuntimeError), router.request_span("req-2") as failing:
            raise RuntimeError("boom")
        assert failing.current_stage is None
        router.force_flush()
        worker.force_flush()

    r = {s.name: s for s in router_spans.get_finished_spans() if s.attributes["chariot.request.id"] == "req-1"}
    w = {s.name: s for s in worker_spans.get_finished_spans()}
    assert set(r) == {"chariot.request", "chariot.admission", "chariot.queue"}
    assert set(w) == {"chariot.request", "chariot.queue", "chariot.prefill", "chariot.decode"}
    root = r["chariot.request"]
    assert root.attributes["gen_ai.request.model"] == "tiny" and root.attributes["component"] == "router"
    trace_id = root.context.trace_id
    assert all(s.context.trace_id == trace_id for s in [*r.values(), *w.values()])
    assert w["chariot.request"].parent.span_id == root.context.span_id  # worker continues the router's trace
    for name in ("chariot.queue", "chariot.prefill", "chariot.decode"):
        assert w[name].parent.span_id == w["chariot.request"].context.span_id
    assert [e.name for e in w["chariot.prefill"].events] == ["first_token"]
    assert w["chariot.prefill"].end_time <= w["chariot.decode"].start_time
    failed = [s for s in router_spans.get_finished_spans() if s.attributes["chariot.request.id"] == "req-2"]
    assert failed and all(s.status.status_code is StatusCode.ERROR for s in failed)


def test_tracing_is_noop_without_endpoint(telemetry: Telemetry) -> None:
    assert isinstance(telemetry.tracer, NoOpTracer) and telemetry.tracer_provider is None
    with telemetry.request_span("r") as rt:
        rt.stage("queue")
        rt.event("x")
        assert rt.carrier() == {}


# --------------------------------------------------------------------------------------------------- OTLP


class _Collector(metrics_service_pb2_grpc.MetricsServiceServicer, trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal in-process OTLP/gRPC receiver."""

    def __init__(self) -> None:
        self.metric_names: set[str] = set()
        self.span_names: set[str] = set()
        self.lock = threading.Lock()

    def Export(self, request, context):  # the gRPC method name
        with self.lock:
            if isinstance(request, metrics_service_pb2.ExportMetricsServiceRequest):
                for rm in request.resource_metrics:
                    for sm in rm.scope_metrics:
                        self.metric_names.update(m.name for m in sm.metrics)
                return metrics_service_pb2.ExportMetricsServiceResponse()
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    self.span_names.update(s.name for s in ss.spans)
            return trace_service_pb2.ExportTraceServiceResponse()


def test_otlp_export_of_metrics_and_spans() -> None:
    collector = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(collector, server)
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with setup_telemetry("w", "worker", otlp_endpoint=f"http://127.0.0.1:{port}") as t:
            record_everything(t)
            with t.request_span("r") as rt:
                rt.stage("decode")
            t.force_flush()
        assert {spec.name for spec in METRICS.values()} <= collector.metric_names
        assert {"chariot.request", "chariot.admission", "chariot.decode"} <= collector.span_names
    finally:
        server.stop(0)


# ---------------------------------------------------------------------------------------------- docs table


def test_docs_table_lists_every_metric() -> None:
    doc = (ROOT / "docs" / "observability.md").read_text()
    for spec in METRICS.values():
        assert re.search(rf"`{re.escape(spec.name)}`.*`{re.escape(spec.prometheus)}`", doc), spec.name


# ----------------------------------------------------------------------------------------- real Prometheus


def true_quantile(values: list[float], q: float) -> float:
    return float(np.quantile(np.asarray(values), q, method="inverted_cdf"))


@pytest.mark.slow
def test_real_prometheus_scrape(prometheus) -> None:
    rng = random.Random(7)
    with setup_telemetry("worker", "worker", model="tiny") as worker, setup_telemetry("router", "router") as router:
        targets = [f"127.0.0.1:{worker.start_metrics_server('127.0.0.1', 0)}",
                   f"127.0.0.1:{router.start_metrics_server('127.0.0.1', 0)}"]  # fmt: skip
        state = {"running": 3.0, "waiting": 5.0, "kv_cache_usage": 0.42, "kv_blocks_used": 42.0,
                 "kv_blocks_total": 100.0}
        worker.observe_engine(lambda: state)
        # One warm-up point so the histogram series exist before the measured data: rate() only counts
        # increases between samples, so the real values must arrive after Prometheus's first scrape.
        worker.record_tbt(0.5)
        worker.record_ttft(0.5)

        prom = prometheus(targets, scrape_interval_s=0.5)
        prom.wait_for_targets_up()
        prom.wait_for(f"{TBT}_count", lambda r: len(r) == 1 and sample_value(r[0]) == 1)

        # TBTs spread over 10-300 ms: a decode-speed bulk plus a long tail (prefill interference).
        tbts = [rng.uniform(0.010, 0.045) for _ in range(2700)] + [rng.uniform(0.045, 0.300) for _ in range(300)]
        rng.shuffle(tbts)
        ttfts = [rng.uniform(0.020, 0.300) for _ in range(500)]
        for v in tbts:
            worker.record_tbt(v)
        for v in ttfts:
            worker.record_ttft(v)
        admissions = {"admitted": 40, "shed_slo": 5, "shed_queue": 3, "rate_limited": 2, "no_replica": 1, "invalid": 4}
        for outcome, n in admissions.items():
            for _ in range(n):
                router.record_admission(outcome)
        batches = [(rng.choice([0, 0, 256, 512]), rng.randint(1, 64)) for _ in range(100)]
        for prefill, decode in batches:
            worker.record_batch(prefill, decode)
        worker.record_queue_delay(0.003)
        worker.record_request(2.0, 100, 50)
        worker.record_request(1.0, 20, 10)
        worker.add_stage_time(0, busy_s=0.9, idle_s=0.1)
        worker.add_stage_time(1, busy_s=0.6, idle_s=0.4)
        router.record_retry("g1")
        router.record_routing("g1", "prefix", 64)
        router.record_tenant_request("team-a")
        router.record_tenant_rejection("other", "unauthenticated")
        router.record_tenant_tokens("team-a", 100, 50)
        worker.record_prefix_cache(600, 256)
        worker.add_collective_time(0, 0, 0.02)
        router.record_hold(1.5, "served")
        router.record_autoscaler("prod/llama", "ScaleUp", 3, 1)  # the operator's; any Telemetry records it
        router.observe_offered_load(lambda: OfferedLoad(window_s=30.0, arrival_rate=2.0, prompt_token_rate=300.0,
                                                        output_token_rate=100.0, capacity={"g0": 900.0, "g1": 800.0}))

        prom.wait_for_scrape()  # both targets scraped after the last point was recorded
        assert prom.value(f"{TBT}_count") == 1 + len(tbts)
        assert prom.value(f"{TTFT}_count") == 1 + len(ttfts)

        # Every documented family is there, with the labels dashboards group by.
        for spec in METRICS.values():
            series = spec.prometheus + ("_count" if spec.kind == "histogram" else "")
            assert prom.query(series), series
        tokens = 'sum by (tenant, gen_ai_token_type) (chariot_tenant_tokens_total{component="router"})'
        assert {(r["metric"]["tenant"], r["metric"]["gen_ai_token_type"]) for r in prom.query(tokens)} == {
            ("team-a", "input"), ("team-a", "output")}  # what the dashboard's tenant panel groups by
        # The autoscaling panel: offered tokens/s against the serving replicas' capacity.
        assert prom.value('sum(chariot_offered_load_tokens{component="router"})') == 400.0
        assert prom.value('sum(max by (replica) (chariot_replica_capacity{component="router"}))') == 1700.0
        assert prom.value("chariot_prefix_cache_hits_total") / prom.value("chariot_prefix_cache_queries_total") == \
            pytest.approx(256 / 600)  # the hit rate a dashboard plots
        assert {r["metric"]["component"] for r in prom.query("chariot_admission_decisions_total")} == {
            "router",
            "worker",
        }

        # P99 (and P50) TBT at 10 ms resolution, via the dashboard query.
        for q in (0.99, 0.5):
            got = prom.value(f"histogram_quantile({q}, sum(rate({TBT}_bucket[1m])) by (le))")
            assert got is not None and abs(got - true_quantile(tbts, q)) <= 0.010, (q, got, true_quantile(tbts, q))
        got = prom.value(f'histogram_quantile(0.9, sum(rate({TTFT}_bucket{{component="worker"}}[1m])) by (le))')
        assert got is not None and abs(got - true_quantile(ttfts, 0.9)) <= 0.010

        # Admission counters per outcome.
        result = prom.query('sum by (outcome) (chariot_admission_decisions_total{component="router"})')
        assert {r["metric"]["outcome"]: sample_value(r) for r in result} == {k: float(v) for k, v in admissions.items()}

        # Batch composition and token usage.
        result = prom.query("sum by (kind) (chariot_batch_tokens_sum)")
        expected = {
            "prefill": sum(p for p, _ in batches),
            "decode": sum(d for _, d in batches),
            "total": sum(p + d for p, d in batches),
        }
        assert {r["metric"]["kind"]: sample_value(r) for r in result} == expected
        assert prom.value('sum(chariot_batch_tokens_count{kind="total"})') == len(batches)
        result = prom.query("sum by (gen_ai_token_type) (gen_ai_client_token_usage_sum)")
        assert {r["metric"]["gen_ai_token_type"]: sample_value(r) for r in result} == {"input": 120, "output": 60}

        # Gauges follow the owner's callback; bubbles match the busy/idle counters.
        assert prom.value('chariot_requests_running{component="worker"}') == 3
        assert prom.value('chariot_requests_waiting{component="worker"}') == 5
        assert prom.value("chariot_kv_cache_usage") == pytest.approx(0.42)
        assert prom.value("chariot_kv_cache_blocks_used") == 42.0 and prom.value("chariot_kv_cache_blocks") == 100.0
        state["running"] = 7.0
        prom.wait_for_scrape()
        assert prom.value('chariot_requests_running{component="worker"}') == 7
        bubbles = {r["metric"]["stage"]: sample_value(r) for r in prom.query("chariot_pipeline_bubble_fraction")}
        assert bubbles == {"0": pytest.approx(0.1), "1": pytest.approx(0.4)}
        ratio = prom.query(
            "sum by (stage) (chariot_stage_idle_time_seconds_total) / (sum by (stage) "
            "(chariot_stage_busy_time_seconds_total) + sum by (stage) (chariot_stage_idle_time_seconds_total))"
        )
        assert {r["metric"]["stage"]: sample_value(r) for r in ratio} == bubbles
