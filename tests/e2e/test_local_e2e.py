"""Full local end to end (slow): `kubectl apply` → operator → pods run as processes → a streamed completion.

The same path as on a cluster, with the kubelet replaced by `LocalRuntime` (tests/e2e/kubelet.py):
`kubectl apply` of a 2-stage ModelDeployment of the tiny preset; the operator renders the stage pods,
the headless Service, the router Deployment and the ConfigMap; the test kubelet runs each pod's init
container (`chariot make-model ... --preset tiny`, i.e. `make_model`) and container as local
processes — env and flags remapped to loopback and free ports, the ConfigMap projected into files
(the mapping table is in kubelet.py) — and reports readiness from the pods' own probes; the operator
turns the ready group into `replicas.json`, the router picks it up, and a completion streams
through the router's OpenAI endpoint. Then a real Prometheus scrapes the router, both stages and the
operator (its autoscaler looks at the deployment: `spec.autoscaling` pinned to one group, the load
shared through a real redis-server), and every panel query of the Grafana dashboard must return data.

`$CHARIOT_E2E_COMMAND` (shell words) replaces the `chariot` entry point the pods run, if needed.
"""

from __future__ import annotations

import json
import shlex
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import chariot.contracts.environment as env
from chariot.operator import crd
from tests.e2e.cluster import Cluster, make_cluster, operator_process
from tests.e2e.kubelet import LocalRuntime, TestKubelet, which_chariot
from tests.prometheus import PrometheusServer, PrometheusUnavailable, find_prometheus
from tests.redis_server import RedisServer, free_port, require_redis_server

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
NAME = "local"
MANIFEST: dict[str, Any] = {
    "apiVersion": "chariot.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": NAME},
    "spec": {"model": {"uri": "preset://tiny", "dtype": "float32"}, "replicas": 1,
             "parallelism": {"pipeline": 2},
             "scheduler": {"policy": "sarathi", "tokenBudget": 64, "maxBatchSize": 8},
             "slo": {"ttftMs": 60000, "tbtMs": 10000},  # CPU: never shed the test's requests
             "resources": {"gpusPerStage": 0, "cpu": "1", "memory": "2Gi"}, "router": {"replicas": 1}},
}


def chariot_command() -> list[str]:
    override = env.read(env.E2E_COMMAND)
    return shlex.split(override) if override else which_chariot()


def autoscaled(redis_url: str) -> dict[str, Any]:
    """MANIFEST with its routers sharing their load through Redis and `spec.autoscaling` pinned to one
    group: the operator's autoscaler looks at it (and exports its metrics) without changing it."""
    manifest = json.loads(json.dumps(MANIFEST))
    manifest["spec"]["router"]["redis"] = {"url": redis_url}
    manifest["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 1}
    return manifest


class Deployment:
    def __init__(self, cluster: Cluster, runtime: LocalRuntime, operator_metrics: str = "") -> None:
        self.cluster, self.runtime = cluster, runtime
        self.operator_metrics = operator_metrics  # host:port of the operator's /metrics

    def pod_names(self, component: str) -> list[str]:
        return sorted(p["metadata"]["name"] for p in self.cluster.list(
            "Pod", f"chariot.dev/deployment={NAME},app.kubernetes.io/component={component}"))

    def router_http(self) -> str:
        (router,) = self.pod_names("router")
        return f"127.0.0.1:{self.runtime.port(router, 8000)}"

    def stage_metrics(self) -> list[str]:
        return [f"127.0.0.1:{self.runtime.port(p, 9400)}" for p in self.pod_names("worker")]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("local-e2e")
    redis_binary = require_redis_server()
    metrics_port = free_port()
    with RedisServer(redis_binary) as redis, make_cluster(tmp, "local") as cluster:
        # Probes run at a tenth of their declared periods and delays (the counts stay).
        runtime = LocalRuntime(cluster.kube, tmp / "pods", chariot=chariot_command(), probe_time_scale=0.1)
        with TestKubelet(cluster.kube, cluster.namespace, runtime, poll_s=0.2), \
                operator_process(cluster, tmp / "operator.log", "--metrics-port", str(metrics_port)):
            cluster.apply(autoscaled(redis.url))
            try:
                cluster.wait_ready(NAME, timeout=240)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n--- pod logs ---\n{runtime.logs()}") from None
            yield Deployment(cluster, runtime, f"127.0.0.1:{metrics_port}")
            # --wait=false + polling: kubectl's own wait can miss the emulator's DELETED event when
            # the operator's cleanup finishes before kubectl starts watching.
            cluster.kubectl("delete", "mdep", NAME, "-n", cluster.namespace, "--wait=false")
            cluster.wait_for(f"{NAME} deleted", lambda: cluster.get(crd.KIND, NAME) is None, timeout=60)
            cluster.wait_for("stage pods gone", lambda: not cluster.list("Pod", f"chariot.dev/deployment={NAME}"))


def complete(router: str, prompt: str, max_tokens: int = 8, stream: bool = True, model: str = NAME,
             timeout: float = 120.0) -> list[dict[str, Any]]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "stream": stream}).encode()
    request = urllib.request.Request(f"http://{router}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        if not stream:
            return [json.loads(resp.read())]
        events = [line.decode().removeprefix("data: ").strip() for line in resp if line.startswith(b"data: ")]
    assert events and events[-1] == "[DONE]", events
    return [json.loads(e) for e in events[:-1]]


def refused(router: str) -> None:
    """A request for a model the router does not serve: 404, counted as a rejection (reason invalid)."""
    body = json.dumps({"model": "not-served", "prompt": "hello", "max_tokens": 2}).encode()
    request = urllib.request.Request(f"http://{router}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 404


def test_a_completion_streams_through_the_router(deployment: Deployment) -> None:
    status = deployment.cluster.mdep(NAME)["status"]
    assert (status["readyReplicas"], status["groups"][0]["phase"]) == (1, "Ready")
    chunks = complete(deployment.router_http(), "The quick brown fox", max_tokens=8)
    text = "".join(c["choices"][0].get("text", "") for c in chunks if c.get("choices"))
    finish = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
    assert len(chunks) >= 2 and text, chunks
    assert finish[-1] in ("length", "stop")


def test_every_dashboard_panel_returns_data_from_prometheus(deployment: Deployment) -> None:
    try:
        binary = find_prometheus()
    except PrometheusUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    dashboard = json.loads((ROOT / "charts/chariot/dashboards/chariot-serving.json").read_text())
    targets = {"router": [deployment.router_http()], "stages": deployment.stage_metrics(),
               "operator": [deployment.operator_metrics]}  # the autoscaler's panel
    with PrometheusServer(targets, scrape_interval_s=0.5, binary=binary) as prom:
        prom.wait_for("up", lambda r: len(r) == 4 and all(s["value"][1] == "1" for s in r), timeout=30)
        router = deployment.router_http()
        for i in range(6):  # traffic across two scrapes, so rate() over the window sees it
            complete(router, f"Request number {i} says", max_tokens=12, stream=i % 2 == 0)
            refused(router)  # the tenants' rejections panel needs a refused request
            time.sleep(0.3)
        prom.wait_for_scrape()
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                for component in (["router", "worker"] if "$component" in target["expr"] else ["-"]):
                    expr = (target["expr"].replace("$__rate_interval", "1m").replace("$component", component)
                            .replace("$model", ".*"))
                    prom.wait_for(expr, bool, timeout=20)


def test_a_worker_that_cannot_start_says_why_and_the_router_stays_alive(deployment: Deployment) -> None:
    """A stage whose attention backend cannot run here (Triton asked for through `spec.template`, on a
    machine without CUDA) exits before it is ready; its last log line reaches `lastFailure` through the
    termination message, and the group gang-restarts with backoff instead of reporting Ready. Its
    router meanwhile passes its liveness probe (the kubelet runs it: a liveness probe that followed
    the backends would get the router killed and restarted) and answers 503 with an OpenAI error."""
    cluster, runtime, name = deployment.cluster, deployment.runtime, "broken"
    broken = json.loads(json.dumps(MANIFEST))
    broken["metadata"]["name"] = name
    broken["spec"]["parallelism"]["pipeline"] = 1
    broken["spec"]["template"] = {"spec": {"containers": [
        {"name": "worker", "env": [{"name": "CHARIOT_ATTENTION_BACKEND", "value": "triton"},
                                   {"name": "TRITON_INTERPRET", "value": "0"}]}]}}  # the suite's own is 1
    cluster.apply(broken)
    try:
        def failure() -> str:
            groups = (cluster.mdep(name).get("status") or {}).get("groups") or [{}]
            return str(groups[0].get("lastFailure", ""))

        cluster.wait_for("lastFailure names the backend", lambda: "triton" in failure(), timeout=120)
        assert "failed: " in failure() and "CUDA is not available" in failure(), failure()
        assert cluster.mdep(name)["status"].get("readyReplicas", 0) == 0

        def router_pod() -> dict[str, Any] | None:
            pods = cluster.list("Pod", f"chariot.dev/deployment={name},app.kubernetes.io/component=router")
            running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
            return running[0] if running else None

        router = cluster.wait_for("router running", router_pod, timeout=120)
        # Liveness: 30 s initial delay, every 10 s, 6 failures (at a tenth: ~9 s). Wait past it.
        time.sleep(12)
        router = router_pod()
        assert router is not None, runtime.logs(f"{name}-router")
        assert router["status"]["containerStatuses"][0]["restartCount"] == 0, runtime.logs(f"{name}-router")
        address = f"127.0.0.1:{runtime.port(router['metadata']['name'], 8000)}"
        assert urllib.request.urlopen(f"http://{address}/health/live", timeout=5).status == 200
        body = json.dumps({"model": name, "prompt": "hello", "max_tokens": 4}).encode()
        request = urllib.request.Request(f"http://{address}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as unavailable:
            urllib.request.urlopen(request, timeout=30)
        assert unavailable.value.code == 503
        assert "error" in json.loads(unavailable.value.read())
    finally:
        cluster.kubectl("delete", "mdep", name, "-n", cluster.namespace, "--wait=false")
        cluster.wait_for(f"{name} deleted", lambda: cluster.get(crd.KIND, name) is None, timeout=60)


def test_two_stages_of_two_tensor_parallel_ranks_serve_tokens(deployment: Deployment) -> None:
    """`parallelism: {pipeline: 2, tensor: 2}`: 2 stage pods per group, each told to run 2 ranks (the
    worker in the pod starts its stage's second rank itself: 4 processes, gloo on loopback), and a
    completion streams through the router. (CPU pods: `gpusPerStage: 0`; the GPU requests of such a
    pod are checked in tests/unit/test_render.py and the operator e2e.)"""
    cluster, runtime, name = deployment.cluster, deployment.runtime, "tp"
    manifest = json.loads(json.dumps(MANIFEST))
    manifest["metadata"]["name"] = name
    manifest["spec"]["parallelism"] = {"pipeline": 2, "tensor": 2}
    cluster.apply(manifest)
    try:
        try:
            cluster.wait_ready(name, timeout=240)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- pod logs ---\n{runtime.logs()}") from None
        stages = sorted(p["metadata"]["name"] for p in cluster.list(
            "Pod", f"chariot.dev/deployment={name},app.kubernetes.io/component=worker"))
        assert stages == [f"{name}-g0-s0", f"{name}-g0-s1"]
        for pod in stages:
            args = cluster.get("Pod", pod)["spec"]["containers"][0]["args"]
            assert args[args.index("--tensor-parallel-size") + 1] == "2"
        (router,) = [p["metadata"]["name"] for p in cluster.list(
            "Pod", f"chariot.dev/deployment={name},app.kubernetes.io/component=router")]
        body = json.dumps({"model": name, "prompt": "The quick brown fox", "max_tokens": 6,
                           "temperature": 0.0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{runtime.port(router, 8000)}/v1/completions",
                                         data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as resp:
            choice = json.loads(resp.read())["choices"][0]
        assert choice["text"] and choice["finish_reason"] in ("length", "stop"), choice
    finally:
        cluster.kubectl("delete", "mdep", name, "-n", cluster.namespace, "--wait=false")
        cluster.wait_for(f"{name} deleted", lambda: cluster.get(crd.KIND, name) is None, timeout=60)
