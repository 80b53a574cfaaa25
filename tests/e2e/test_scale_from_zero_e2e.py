"""Scale from zero as one chain, every link real (slow).

The router's hold queue (tests/integration/test_offered_load.py) and the operator's reaction to a held
request (tests/e2e/test_autoscaling_e2e.py, with the routers' Redis snapshots written by the test) are
each tested on their own; this module checks that they meet: the operator process, the API emulator,
the real `kubectl`, the test kubelet's `LocalRuntime` running the router and worker pods as local
processes (tests/e2e/kubelet.py), and a real redis-server between the router and the operator.

A ModelDeployment of the tiny preset is applied with `spec.replicas: 0` and `minReplicas: 0`: an idle
deployment, its router up and Ready (it holds requests, so it stays in its Service) and no worker pod.
One completion is sent to the router; it is held while the router publishes `held: 1` to Redis, the
operator scales `spec.replicas` to 1 (Event `ScaleFromZero`), the kubelet runs the worker pod, the
operator lists the ready group in the ConfigMap's `replicas.json`, and the router sends the held
request there. The answer is a 200 with tokens, and the router's `chariot_router_hold_time_seconds`
has recorded the wait.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

from tests.e2e.cluster import Cluster, make_cluster, operator_process
from tests.e2e.kubelet import LocalRuntime, TestKubelet
from tests.e2e.test_autoscaling_e2e import events, routed, spec_replicas, stage_pods
from tests.e2e.test_local_e2e import chariot_command, complete
from tests.redis_server import RedisServer, require_redis_server

pytestmark = pytest.mark.slow
T = TypeVar("T")
NAME = "wake"
# How long the router holds the request: a cold start (the worker's init container making the model,
# then the worker loading it) on a slow 2-core machine, with room to spare.
HOLD_TIMEOUT_S = 180


def manifest(redis_url: str) -> dict[str, Any]:
    return {
        "apiVersion": "chariot.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": NAME},
        "spec": {"model": {"uri": "preset://tiny", "dtype": "float32"}, "replicas": 0,
                 "parallelism": {"pipeline": 1},
                 "scheduler": {"policy": "sarathi", "tokenBudget": 64, "maxBatchSize": 8},
                 "slo": {"ttftMs": 60000, "tbtMs": 10000},  # CPU: never shed the test's request
                 "resources": {"gpusPerStage": 0, "cpu": "1", "memory": "2Gi"},
                 "router": {"replicas": 1, "redis": {"url": redis_url}},
                 # the down window outlasts the test: once woken, the group stays
                 "autoscaling": {"minReplicas": 0, "maxReplicas": 1, "holdTimeoutSeconds": HOLD_TIMEOUT_S,
                                 "scaleDownStabilizationSeconds": 600}},
    }


@dataclass
class Stack:
    cluster: Cluster
    runtime: LocalRuntime

    def wait_for(self, what: str, fn: Callable[[], T | None], timeout: float) -> T:
        """`Cluster.wait_for`, with the pods' logs on a timeout."""
        try:
            return self.cluster.wait_for(what, fn, timeout, interval=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- pod logs ---\n{self.runtime.logs()}") from None

    def router_pod(self) -> dict[str, Any] | None:
        pods = self.cluster.list("Pod", f"chariot.dev/deployment={NAME},app.kubernetes.io/component=router")
        return pods[0] if len(pods) == 1 else None

    def router_http(self) -> str:
        pod = self.router_pod()
        assert pod is not None
        return f"127.0.0.1:{self.runtime.port(pod['metadata']['name'], 8000)}"

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://{self.router_http()}{path}", timeout=10) as resp:
            return str(resp.read().decode())


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("scale-from-zero")
    redis_binary = require_redis_server()
    with RedisServer(redis_binary) as redis, make_cluster(tmp, "wake") as cluster:
        # Probes run at a tenth of their declared periods and delays (the counts stay).
        runtime = LocalRuntime(cluster.kube, tmp / "pods", chariot=chariot_command(), probe_time_scale=0.1)
        with TestKubelet(cluster.kube, cluster.namespace, runtime, poll_s=0.2), \
                operator_process(cluster, tmp / "operator.log"):
            cluster.apply(manifest(redis.url))
            yield Stack(cluster, runtime)


def pod_ready(pod: dict[str, Any] | None) -> bool:
    conditions = ((pod or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def hold_waits(metrics: str) -> tuple[float, float]:
    """(count, sum in seconds) of the router's served hold waits, from its Prometheus exposition."""
    def sample(suffix: str) -> float:
        found = re.search(rf'^chariot_router_hold_time_seconds_{suffix}{{[^}}]*outcome="served"[^}}]*}} (\S+)$',
                          metrics, re.MULTILINE)
        return float(found.group(1)) if found else 0.0
    return sample("count"), sample("sum")


def test_a_held_request_wakes_a_deployment_scaled_to_zero(stack: Stack) -> None:
    cluster = stack.cluster
    # Idle: the router up and Ready (it holds requests), no group, the deployment Ready at zero.
    stack.wait_for("the router pod Ready", lambda: pod_ready(stack.router_pod()), timeout=120)
    try:
        cluster.wait_ready(NAME, timeout=30)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- pod logs ---\n{stack.runtime.logs()}") from None
    assert spec_replicas(cluster, NAME) == 0 and stage_pods(cluster, NAME) == [] and routed(cluster, NAME) == []
    assert hold_waits(stack.get("/metrics")) == (0.0, 0.0)

    result: dict[str, Any] = {}

    def send() -> None:
        try:
            result["chunks"] = complete(stack.router_http(), "Wake up and say", max_tokens=6, stream=False,
                                        model=NAME, timeout=HOLD_TIMEOUT_S + 30)
        except Exception as exc:  # an HTTPError (the 503 of a request not held) or a timeout
            result["error"] = exc

    sent = time.monotonic()
    client = threading.Thread(target=send, daemon=True)
    client.start()
    stack.wait_for("the router reports the request held",
                   lambda: json.loads(stack.get("/load"))["held"] == 1 or "error" in result, timeout=30)
    assert "error" not in result, result["error"]
    stack.wait_for("spec.replicas 1", lambda: spec_replicas(cluster, NAME) == 1, timeout=30)
    scaled = time.monotonic() - sent
    assert "chunks" not in result and "error" not in result, "no worker yet: the request is still held"
    client.join(HOLD_TIMEOUT_S + 60)
    answered = time.monotonic() - sent
    assert not client.is_alive(), f"no answer after {answered:.0f} s\n{stack.runtime.logs()}"
    assert "error" not in result, f"{result['error']!r}\n--- pod logs ---\n{stack.runtime.logs()}"

    (response,) = result["chunks"]
    choice = response["choices"][0]
    assert choice["text"] and choice["finish_reason"] in ("length", "stop"), response
    assert response["usage"]["completion_tokens"] > 0, response
    assert spec_replicas(cluster, NAME) == 1
    assert stage_pods(cluster, NAME) == [f"{NAME}-g0-s0"] and routed(cluster, NAME) == ["g0"]
    assert [e["reason"] for e in events(cluster, NAME)] == ["ScaleFromZero"]
    count, waited = hold_waits(stack.get("/metrics"))
    assert count == 1 and 0 < waited <= answered, (count, waited, answered)
    print(f"scaled after {scaled:.1f} s, answered after {answered:.1f} s (held {waited:.1f} s)")
