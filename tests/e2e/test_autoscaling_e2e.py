"""`spec.autoscaling` end to end: the operator process, the emulated API server with its test kubelet,
the real kubectl, and a real redis-server holding the routers' offered load.

The routers' side is played by `Routers`, which writes each router's snapshot exactly as
`chariot.router.offered_load.OfferedLoadPublisher` does (same key, same JSON contract, same TTL);
tests/integration/test_offered_load.py shows real routers writing them. Each test applies its own
ModelDeployment and drives the load: rising load scales up within the scale-up window; falling load
drains the chosen group (out of the routers' list, pods kept while requests are in flight) before its
pods go; noisy load keeps the count within bounds and does not flap; an idle deployment with
minReplicas 0 scales to zero and a held request brings one group back; an HPA on the same object is
reported, not fought. Scale from zero with a real router holding a real request, real worker pods and
no snapshot written by the test is one chained test: tests/e2e/test_scale_from_zero_e2e.py.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from chariot.contracts.autoscaling import OfferedLoad, offered_key  # noqa: E402
from tests.e2e.cluster import Cluster, example  # noqa: E402
from tests.redis_server import RedisServer, require_redis_server  # noqa: E402

pytestmark = [pytest.mark.usefixtures("operator"), pytest.mark.slow]
CAPACITY = 1000.0  # tokens/s of one group, as the routers measure it


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    binary = require_redis_server()
    with RedisServer(binary) as server:
        yield server


class Routers:
    """The routers of one deployment, as the operator sees them: snapshots in Redis."""

    def __init__(self, server: RedisServer, cluster: Cluster, name: str, count: int = 2) -> None:
        self.client = redis.Redis.from_url(server.url, decode_responses=True)
        self.cluster, self.name = cluster, name
        self.keys = [offered_key(f"chariot:{cluster.namespace}:{name}", f"router-{i}") for i in range(count)]

    def offer(self, work: float, *, replicas: tuple[str, ...] | None = ("g0",), shed: float = 0.0,
              in_flight: dict[str, int] | None = None, held: int = 0) -> None:
        """Every router reports its share of `work` tokens/s (what a load balancer in front would give),
        routing to `replicas` (None: those the operator lists in the ConfigMap, as real routers do)."""
        if replicas is None:
            replicas = tuple(routed(self.cluster, self.name))
        share = work / len(self.keys)
        for i, key in enumerate(self.keys):
            snapshot = OfferedLoad(window_s=10.0, arrival_rate=share / 100, prompt_token_rate=share * 0.8,
                                   output_token_rate=share * 0.2, shed_rate=shed / len(self.keys),
                                   capacity=dict.fromkeys(replicas, CAPACITY),
                                   in_flight=(in_flight or {}) if i == 0 else {}, replicas=replicas,
                                   held=held if i == 0 else 0)
            self.client.set(key, snapshot.to_json(), px=30_000)

    def close(self) -> None:
        self.client.delete(*self.keys)
        self.client.close()


def autoscaled(name: str, server: RedisServer, replicas: int = 1, **policy: Any) -> dict[str, Any]:
    manifest = example(name, replicas=replicas, router={"replicas": 1, "redis": {"url": server.url}})
    manifest["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 3, "targetUtilization": 0.5,
                                       "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 600,
                                       **policy}
    return manifest


def spec_replicas(cluster: Cluster, name: str) -> int:
    return int(cluster.mdep(name)["spec"]["replicas"])


def stage_pods(cluster: Cluster, name: str) -> list[str]:
    return sorted(p["metadata"]["name"] for p in cluster.list("Pod", f"chariot.dev/deployment={name},"
                                                                      "app.kubernetes.io/component=worker"))


def routed(cluster: Cluster, name: str) -> list[str]:
    data = (cluster.get("ConfigMap", f"{name}-config") or {}).get("data") or {}
    return [r["name"] for r in json.loads(data.get("replicas.json") or '{"replicas": []}')["replicas"]]


def events(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    """The ModelDeployment's Events, read back through the real kubectl."""
    out = cluster.kubectl("get", "events", "-n", cluster.namespace, "-o", "json").stdout
    return [e for e in json.loads(out)["items"] if e.get("involvedObject", {}).get("name") == name]


def test_rising_load_scales_up_within_the_window(cluster: Cluster, redis_server: RedisServer) -> None:
    cluster.apply(autoscaled("rise", redis_server, scaleUpStabilizationSeconds=2))
    routers = Routers(redis_server, cluster, "rise")
    try:
        routers.offer(300.0)
        cluster.wait_for("a Stable decision", lambda: cluster.condition("rise", "ScalingActive").get("reason")
                         == "Stable")
        cluster.wait_ready("rise")
        start = time.monotonic()
        routers.offer(1400.0)  # ceil(1400 / (1000 * 0.5)) = 3 groups
        time.sleep(1.0)
        assert spec_replicas(cluster, "rise") == 1, "a rise must last the 2 s scale-up window"
        cluster.wait_for("spec.replicas 3", lambda: spec_replicas(cluster, "rise") == 3, timeout=15)
        assert time.monotonic() - start < 2.0 + 5.0, "scaled within the window (plus a few resync periods)"
        status = cluster.wait_ready("rise")["status"]
        assert (status["replicas"], status["readyReplicas"]) == (3, 3)
        auto = status["autoscaling"]
        assert auto["desiredReplicas"] == 3 and auto["reason"] in ("ScaleUp", "Stable") and auto["lastScaleTime"]
        assert auto["inputs"]["routers"] == 2 and auto["inputs"]["workRate"] == pytest.approx(1400.0)
        assert auto["inputs"]["groupCapacity"] == CAPACITY
        assert routed(cluster, "rise") == ["g0", "g1", "g2"]
        assert [e["reason"] for e in events(cluster, "rise")] == ["ScaleUp"]
        table = cluster.kubectl("get", "mdep", "rise", "-n", cluster.namespace, "-o", "wide").stdout.split("\n")
        assert "DESIRED" in table[0].split()
    finally:
        routers.close()


def test_falling_load_drains_a_group_before_its_pods_go(cluster: Cluster, redis_server: RedisServer) -> None:
    cluster.apply(autoscaled("fall", redis_server, replicas=2, maxReplicas=2, scaleDownStabilizationSeconds=1))
    routers = Routers(redis_server, cluster, "fall")
    try:
        routers.offer(900.0, replicas=("g0", "g1"))
        cluster.wait_ready("fall")
        routers.offer(200.0, replicas=("g0", "g1"), in_flight={"g1": 2})  # falls; g1 still streams 2 requests
        cluster.wait_for("group 1 draining", lambda: any(
            g["index"] == 1 and g["phase"] == "Draining" for g in cluster.mdep("fall")["status"]["groups"]))
        assert spec_replicas(cluster, "fall") == 1
        cluster.wait_for("g1 out of the routers' list", lambda: routed(cluster, "fall") == ["g0"])
        # The routers reload their list and stop sending to g1; its requests are still in flight.
        routers.offer(200.0, replicas=("g0",), in_flight={"g1": 1})
        time.sleep(2.5)  # > 2 resync periods: the pods must stay while a request is in flight
        assert stage_pods(cluster, "fall") == ["fall-g0-s0", "fall-g0-s1", "fall-g1-s0", "fall-g1-s1"]
        routers.offer(200.0, replicas=("g0",))  # the last request finished
        cluster.wait_for("g1's pods gone", lambda: stage_pods(cluster, "fall") == ["fall-g0-s0", "fall-g0-s1"])
        # the pods go first, the group's status entry with the pass after: wait for both
        cluster.wait_for("g1 gone from the status", lambda: [
            g["index"] for g in cluster.mdep("fall")["status"]["groups"]] == [0])
        status = cluster.wait_ready("fall")["status"]
        assert [g["index"] for g in status["groups"]] == [0]
        assert status["autoscaling"]["reason"] in ("ScaleDown", "Stable")
        assert [e["reason"] for e in events(cluster, "fall")] == ["ScaleDown"]
    finally:
        routers.close()


def test_noisy_load_keeps_the_bounds_and_does_not_flap(cluster: Cluster, redis_server: RedisServer) -> None:
    up_s, down_s = 1, 3
    cluster.apply(autoscaled("noisy", redis_server, minReplicas=1, maxReplicas=3,
                             scaleUpStabilizationSeconds=up_s, scaleDownStabilizationSeconds=down_s))
    routers = Routers(redis_server, cluster, "noisy")
    rng = random.Random(41)
    seen: list[tuple[float, int]] = []
    try:
        cluster.wait_ready("noisy")
        end = time.monotonic() + 6.0
        while time.monotonic() < end:
            routers.offer(rng.choice([0.0, 200.0, 2500.0, 6000.0]))  # asks 0..12 groups, at random
            for _ in range(3):
                seen.append((time.monotonic(), spec_replicas(cluster, "noisy")))
                time.sleep(0.1)
    finally:
        routers.close()
    counts = [n for _, n in seen]
    assert all(1 <= n <= 3 for n in counts), counts
    changes = [(t, n - prev) for (_, prev), (t, n) in itertools.pairwise(seen) if n != prev]
    assert changes, "the load asked for changes"
    for (t0, d0), (t1, d1) in itertools.pairwise(changes):
        if d0 > 0 > d1:  # a scale-down after a scale-up waits for the scale-down window (sampling: -0.2 s)
            assert t1 - t0 >= down_s - 0.2, changes


def test_an_hpa_on_the_same_object_is_reported_not_fought(cluster: Cluster, redis_server: RedisServer) -> None:
    cluster.apply(autoscaled("hpa", redis_server))
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": "hpa-hpa", "namespace": cluster.namespace},
           "spec": {"scaleTargetRef": {"apiVersion": "chariot.dev/v1alpha1", "kind": "ModelDeployment",
                                       "name": "hpa"}, "minReplicas": 1, "maxReplicas": 5,
                    "metrics": [{"type": "Resource", "resource": {"name": "cpu",
                                                                  "target": {"type": "Utilization",
                                                                             "averageUtilization": 80}}}]}}
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(hpa))
    routers = Routers(redis_server, cluster, "hpa")
    try:
        routers.offer(5000.0)
        cond = cluster.wait_for("ScalingActive=False", lambda: (c := cluster.condition("hpa", "ScalingActive"))
                                .get("reason") == "HPAConflict" and c)
        assert cond["status"] == "False" and "hpa-hpa" in cond["message"]
        time.sleep(2.0)
        assert spec_replicas(cluster, "hpa") == 1, "the operator leaves spec.replicas to the HPA"
        assert [e["reason"] for e in events(cluster, "hpa")] == ["HPAConflict"]
        cluster.kubectl("delete", "-f", "-", stdin=yaml.safe_dump(hpa))  # by its manifest: autoscaling/v2
        cluster.wait_for("the autoscaler takes over", lambda: spec_replicas(cluster, "hpa") == 3)
    finally:
        routers.close()


def test_scale_to_zero_and_back_for_a_held_request(cluster: Cluster, redis_server: RedisServer) -> None:
    cluster.apply(autoscaled("zero", redis_server, minReplicas=0, scaleDownStabilizationSeconds=1))
    routers = Routers(redis_server, cluster, "zero")
    try:
        routers.offer(200.0)
        cluster.wait_ready("zero")

        def idle_and_gone() -> bool:  # idle: after the 1 s window no group at all (g0 drains first)
            routers.offer(0.0, replicas=None)
            return spec_replicas(cluster, "zero") == 0 and not stage_pods(cluster, "zero")

        cluster.wait_for("scaled to zero", idle_and_gone, interval=0.3)
        # the pods go first, the status with the operator's next pass: wait for that pass
        cluster.wait_for("status.replicas 0", lambda: cluster.mdep("zero")["status"].get("replicas") == 0)
        status = cluster.wait_ready("zero")["status"]
        assert status["replicas"] == 0 and cluster.get("Deployment", "zero-router") is not None
        router_args = cluster.get("Deployment", "zero-router")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert router_args[router_args.index("--hold-queue") + 1] == "64"  # the router holds requests meanwhile
        start = time.monotonic()
        routers.offer(0.0, replicas=(), held=1)  # a request waits at a router
        cluster.wait_for("one group for the held request", lambda: spec_replicas(cluster, "zero") == 1)
        assert time.monotonic() - start < 5.0, "no stabilisation window delays a held request"
        assert [e["reason"] for e in events(cluster, "zero")] == ["ScaleDown", "ScaleFromZero"]
        cluster.wait_ready("zero")
        assert stage_pods(cluster, "zero") == ["zero-g0-s0", "zero-g0-s1"]
        assert routed(cluster, "zero") == ["g0"]
    finally:
        routers.close()
