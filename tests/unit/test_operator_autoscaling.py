"""`spec.autoscaling` in the operator: validation naming the field, and controller passes against an
in-memory API (`MemoryKube`, as in test_render.py) that scale `spec.replicas` from the offered load,
record Events, report status and conditions, and leave an HPA's object alone.

The offered load comes from a function standing in for Redis here (these are unit tests of the
decision plumbing); tests/e2e/test_autoscaling_e2e.py reads it from a real redis-server, written by
the routers' own publisher, with the real operator process and kubectl.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from typing import Any

import pytest

from chariot.contracts.autoscaling import OfferedLoad
from chariot.contracts.telemetry import Telemetry
from chariot.operator import render
from chariot.operator.controller import Controller, Settings
from chariot.operator.kube import ApiError, Ref
from chariot.operator.render import Owner
from chariot.operator.spec import InvalidSpec, parse_spec
from tests.unit.test_render import MemoryKube, mdep

KEY = ("ModelDeployment", "prod", "llama")
REDIS = "redis://redis:6379"


def merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (what the API server does with `application/merge-patch+json`)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge(out.get(key), value)
    return out


class MergingKube(MemoryKube):
    """MemoryKube with a real merge patch, and `generation` bumped on spec changes (as the API server)."""

    def merge_patch(self, ref: Ref, body: dict[str, Any], subresource: str | None = None) -> dict[str, Any]:
        key = (ref.kind, ref.namespace, ref.name or "")
        if key not in self.objects:
            raise ApiError(404, "not found")
        self.writes.append(f"patch {key} {subresource or ''}")
        old = self.objects[key]
        new = merge(old, body)
        if "spec" in body and new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] = int(old["metadata"].get("generation") or 0) + 1
        self.objects[key] = new
        return copy.deepcopy(new)

    def spec(self) -> dict[str, Any]:
        return dict(self.objects[KEY]["spec"])

    def status(self) -> dict[str, Any]:
        return dict(self.objects[KEY].get("status") or {})

    def condition(self, kind: str) -> dict[str, Any]:
        return next(c for c in self.status()["conditions"] if c["type"] == kind)

    def events(self) -> list[dict[str, Any]]:
        return [o for (k, _, _), o in self.objects.items() if k == "Event"]


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def offered(work: float, *, shed: float = 0.0, cap: float = 1000.0) -> OfferedLoad:
    return OfferedLoad(window_s=30.0, arrival_rate=work / 100, prompt_token_rate=work, shed_rate=shed,
                       capacity={"g0": cap})


def deployment(replicas: int = 1, **autoscaling: Any) -> dict[str, Any]:
    policy = {"minReplicas": 1, "maxReplicas": 4, "targetUtilization": 0.5, "scaleUpStabilizationSeconds": 10,
              "scaleDownStabilizationSeconds": 60, **autoscaling}
    return mdep({"model": {"uri": "preset://tiny"}, "replicas": replicas, "router": {"redis": {"url": REDIS}},
                 "autoscaling": policy})


def setup(body: dict[str, Any]) -> tuple[MergingKube, Clock, dict[str, OfferedLoad | None]]:
    kube = MergingKube()
    kube.objects[KEY] = body
    return kube, Clock(), {"load": None}


def controller(kube: MergingKube, clock: Clock, source: dict[str, OfferedLoad | None]) -> Controller:
    def read(url: str, prefix: str) -> OfferedLoad | None:
        assert (url, prefix) == (REDIS, "chariot:prod:llama")  # the routers' --redis-key-prefix
        return source["load"]
    return Controller(kube, Settings(default_image="img"), clock=clock, offered_load=read)


# --- validation --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("autoscaling", "field"), [
    ({"minReplicas": 1}, "spec.autoscaling.maxReplicas"),  # required
    ({"minReplicas": 3, "maxReplicas": 2}, "spec.autoscaling.maxReplicas"),
    ({"maxReplicas": 0}, "spec.autoscaling.maxReplicas"),
    ({"maxReplicas": 2, "minReplicas": -1}, "spec.autoscaling.minReplicas"),
    ({"maxReplicas": 2, "targetUtilization": 1.5}, "spec.autoscaling.targetUtilization"),
    ({"maxReplicas": 2, "scaleDownStabilizationSeconds": -5}, "spec.autoscaling.scaleDownStabilizationSeconds"),
    ({"maxReplicas": 2, "shedStep": 0}, "spec.autoscaling.shedStep"),
])
def test_invalid_autoscaling_names_the_field(autoscaling: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSpec) as info:
        parse_spec({"model": {"uri": "preset://tiny"}, "autoscaling": autoscaling}, "ok")
    assert field in [e.path for e in info.value.errors], str(info.value)


def test_autoscaling_defaults_and_pod_names_sized_for_the_maximum() -> None:
    spec = parse_spec({"model": {"uri": "preset://tiny"}, "autoscaling": {"maxReplicas": 3}}, "x")
    assert spec.autoscaling is not None
    assert (spec.autoscaling.min_replicas, spec.autoscaling.target_utilization,
            spec.autoscaling.scale_up_stabilization_s, spec.autoscaling.scale_down_stabilization_s) == \
        (1, 0.7, 0.0, 300.0)
    parse_spec({"model": {"uri": "preset://tiny"}}, "a" * 57)  # llama-g0-s0 fits a pod hostname
    with pytest.raises(InvalidSpec, match=r"metadata\.name"):  # ...-g99-s0 would not
        parse_spec({"model": {"uri": "preset://tiny"}, "autoscaling": {"maxReplicas": 100}}, "a" * 57)


# --- controller passes -------------------------------------------------------------------------------


def test_rising_load_scales_up_after_the_window_and_records_it() -> None:
    kube, clock, source = setup(deployment())
    c = controller(kube, clock, source)
    source["load"] = offered(200.0)
    c.reconcile("prod", "llama")
    assert kube.spec()["replicas"] == 1
    assert kube.condition("ScalingActive")["reason"] == "Stable"
    source["load"] = offered(1400.0)  # asks ceil(1400 / (1000 * 0.5)) = 3
    for _ in range(2):
        clock.t += 5.0
        c.reconcile("prod", "llama")
        assert kube.spec()["replicas"] == 1, "within the 10 s scale-up window"
    assert kube.status()["autoscaling"]["reason"] == "Stabilizing"
    clock.t += 5.5
    c.reconcile("prod", "llama")
    assert kube.spec()["replicas"] == 3
    status = kube.status()
    auto = status["autoscaling"]
    assert (auto["desiredReplicas"], auto["currentReplicas"], auto["recommendedReplicas"], auto["reason"]) == \
        (3, 1, 3, "ScaleUp")
    assert auto["inputs"]["workRate"] == 1400.0 and auto["inputs"]["groupCapacity"] == 1000.0
    assert "lastScaleTime" in auto
    assert sorted(n for k, _, n in kube.objects if k == "Pod") == \
        [f"llama-g{g}-s0" for g in range(3)], "the same pass created the new groups"
    (ev,) = kube.events()
    assert (ev["reason"], ev["involvedObject"]["name"], ev["type"]) == ("ScaleUp", "llama", "Normal")
    assert "1 -> 3" in ev["message"]
    assert status["observedGeneration"] == kube.objects[KEY]["metadata"]["generation"] == 2


def test_bounds_are_applied_at_once() -> None:
    kube, clock, source = setup(deployment(replicas=7, maxReplicas=3))
    source["load"] = offered(100.0)
    controller(kube, clock, source).reconcile("prod", "llama")
    assert kube.spec()["replicas"] == 3
    assert [e["reason"] for e in kube.events()] == ["Bounded"]


def test_shedding_steps_up_even_without_a_measured_capacity() -> None:
    kube, clock, source = setup(deployment(scaleUpStabilizationSeconds=0))
    source["load"] = offered(100.0, shed=2.0, cap=0.0)
    controller(kube, clock, source).reconcile("prod", "llama")
    assert kube.spec()["replicas"] == 2
    assert "shed" in kube.status()["autoscaling"]["message"]


def test_an_hpa_on_the_same_object_is_reported_not_fought() -> None:
    kube, clock, source = setup(deployment())
    kube.objects[("HorizontalPodAutoscaler", "prod", "llama-hpa")] = {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "llama-hpa", "namespace": "prod"},
        "spec": {"scaleTargetRef": {"apiVersion": "chariot.dev/v1alpha1", "kind": "ModelDeployment", "name": "llama"},
                 "minReplicas": 1, "maxReplicas": 10}}
    source["load"] = offered(5000.0)
    c = controller(kube, clock, source)
    for _ in range(3):
        clock.t += 30.0
        c.reconcile("prod", "llama")
    assert kube.spec()["replicas"] == 1, "the HPA's count stands"
    cond = kube.condition("ScalingActive")
    assert (cond["status"], cond["reason"]) == ("False", "HPAConflict")
    assert "llama-hpa" in cond["message"]
    assert [e["reason"] for e in kube.events()] == ["HPAConflict"], "reported once, not every pass"
    del kube.objects[("HorizontalPodAutoscaler", "prod", "llama-hpa")]
    clock.t += 30.0
    c.reconcile("prod", "llama")
    assert kube.spec()["replicas"] == 1 and kube.condition("ScalingActive")["reason"] == "Stabilizing"
    clock.t += 10.5
    c.reconcile("prod", "llama")
    assert kube.spec()["replicas"] == 4 and kube.condition("ScalingActive")["reason"] == "ScaleUp"


def test_an_hpa_on_another_object_is_no_conflict() -> None:
    kube, clock, source = setup(deployment())
    kube.objects[("HorizontalPodAutoscaler", "prod", "other")] = {
        "metadata": {"name": "other", "namespace": "prod"},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llama"}}}
    source["load"] = offered(100.0)
    controller(kube, clock, source).reconcile("prod", "llama")
    assert kube.condition("ScalingActive")["status"] == "True"


def test_without_redis_or_reports_the_count_holds_and_says_why() -> None:
    body = deployment(replicas=2)
    del body["spec"]["router"]
    kube, clock, source = setup(body)
    controller(kube, clock, source).reconcile("prod", "llama")
    cond = kube.condition("ScalingActive")
    assert (cond["status"], cond["reason"]) == ("False", "NoOfferedLoad")
    assert "spec.router.redis.url" in cond["message"]
    assert kube.spec()["replicas"] == 2

    kube, clock, source = setup(deployment(replicas=2))  # Redis set, but no router has written yet
    controller(kube, clock, source).reconcile("prod", "llama")
    assert kube.condition("ScalingActive")["message"] == "no router has reported its offered load yet"
    assert kube.spec()["replicas"] == 2


def test_removing_autoscaling_clears_its_status() -> None:
    kube, clock, source = setup(deployment())
    source["load"] = offered(100.0)
    c = controller(kube, clock, source)
    c.reconcile("prod", "llama")
    assert "autoscaling" in kube.status()
    del kube.objects[KEY]["spec"]["autoscaling"]
    clock.t += 1.0
    c.reconcile("prod", "llama")
    assert "autoscaling" not in kube.status()
    assert all(c["type"] != "ScalingActive" for c in kube.status()["conditions"])


# --- scale-down drains the group first -----------------------------------------------------------------


def ready_everything(kube: MergingKube) -> None:
    """What a kubelet and the Deployment controller would do: every pod Ready, the router available."""
    for (kind, _, _), obj in kube.objects.items():
        if kind == "Pod" and not obj["metadata"].get("deletionTimestamp"):
            obj["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
        if kind == "Deployment":
            obj["status"] = {"availableReplicas": 1}


def groups(kube: MergingKube) -> dict[int, str]:
    return {g["index"]: g["phase"] for g in kube.status()["groups"]}


def routed(kube: MergingKube) -> list[str]:
    data = kube.objects[("ConfigMap", "prod", "llama-config")]["data"]["replicas.json"]
    return [r["name"] for r in json.loads(data)["replicas"]]


def test_falling_load_drains_the_chosen_group_before_its_pods_go() -> None:
    kube, clock, source = setup(deployment(replicas=3, scaleDownStabilizationSeconds=0, drainGracePeriodSeconds=300))
    c = controller(kube, clock, source)
    source["load"] = dataclasses.replace(offered(1400.0), replicas=("g0", "g1", "g2"))
    c.reconcile("prod", "llama")
    ready_everything(kube)
    clock.t += 1.0
    c.reconcile("prod", "llama")
    assert groups(kube) == {0: "Ready", 1: "Ready", 2: "Ready"} and routed(kube) == ["g0", "g1", "g2"]

    source["load"] = dataclasses.replace(offered(600.0), replicas=("g0", "g1", "g2"), in_flight={"g2": 2})
    clock.t += 1.0
    outcome = c.reconcile("prod", "llama")
    assert kube.spec()["replicas"] == 2
    assert groups(kube) == {0: "Ready", 1: "Ready", 2: "Draining"}
    assert routed(kube) == ["g0", "g1"], "the routers stop sending to the draining group"
    assert "llama-g2-s0" in {n for k, _, n in kube.objects if k == "Pod"}, "its pods stay while it drains"
    assert not outcome.converged and outcome.requeue_after is not None and outcome.requeue_after <= 2.0

    for snapshot in (dataclasses.replace(offered(600.0), replicas=("g0", "g1", "g2"), in_flight={"g2": 2}),
                     dataclasses.replace(offered(600.0), replicas=("g0", "g1"), in_flight={"g2": 1})):
        source["load"] = snapshot  # a router still lists it; then none does, but a request is in flight
        clock.t += 1.0
        c.reconcile("prod", "llama")
        assert groups(kube)[2] == "Draining" and "llama-g2-s0" in {n for k, _, n in kube.objects if k == "Pod"}

    source["load"] = dataclasses.replace(offered(600.0), replicas=("g0", "g1"))  # drained
    clock.t += 1.0
    c.reconcile("prod", "llama")
    assert sorted(n for k, _, n in kube.objects if k == "Pod") == ["llama-g0-s0", "llama-g1-s0"]
    assert set(groups(kube)) == {0, 1}
    assert [e["reason"] for e in kube.events()] == ["ScaleDown"]


def test_a_drain_ends_after_its_grace_period() -> None:
    kube, clock, source = setup(deployment(replicas=2, scaleDownStabilizationSeconds=0, drainGracePeriodSeconds=30))
    c = controller(kube, clock, source)
    source["load"] = dataclasses.replace(offered(600.0), replicas=("g0", "g1"))
    c.reconcile("prod", "llama")
    ready_everything(kube)
    source["load"] = dataclasses.replace(offered(100.0), replicas=("g0", "g1"), in_flight={"g1": 5})
    clock.t += 1.0
    c.reconcile("prod", "llama")
    assert groups(kube)[1] == "Draining"
    clock.t += 29.0
    c.reconcile("prod", "llama")
    assert groups(kube)[1] == "Draining"
    clock.t += 1.5
    c.reconcile("prod", "llama")
    assert sorted(n for k, _, n in kube.objects if k == "Pod") == ["llama-g0-s0"]


def test_load_rising_again_puts_a_draining_group_back_in_service() -> None:
    kube, clock, source = setup(deployment(replicas=2, scaleUpStabilizationSeconds=0, scaleDownStabilizationSeconds=0))
    c = controller(kube, clock, source)
    source["load"] = dataclasses.replace(offered(600.0), replicas=("g0", "g1"))
    c.reconcile("prod", "llama")
    ready_everything(kube)
    source["load"] = dataclasses.replace(offered(100.0), replicas=("g0", "g1"), in_flight={"g1": 1})
    clock.t += 1.0
    c.reconcile("prod", "llama")
    assert groups(kube)[1] == "Draining"
    source["load"] = dataclasses.replace(offered(900.0), replicas=("g0",), in_flight={"g1": 1})
    clock.t += 1.0
    c.reconcile("prod", "llama")
    assert kube.spec()["replicas"] == 2
    assert groups(kube) == {0: "Ready", 1: "Ready"} and routed(kube) == ["g0", "g1"]
    assert "drainingSince" not in kube.status()["groups"][1]


def test_routers_get_the_deployments_key_prefix_and_hold_requests_when_autoscaled() -> None:
    owner = Owner("llama", "prod", "uid")
    spec = parse_spec(deployment(minReplicas=0)["spec"], "llama")
    args = render.router_args(owner, spec, render.model_source(spec))
    pairs = dict(zip(args[::2], args[1::2], strict=True))
    assert (pairs["--redis-key-prefix"], pairs["--hold-queue"], pairs["--hold-timeout-seconds"]) == \
        ("chariot:prod:llama", "64", "120")
    plain = parse_spec({"model": {"uri": "preset://tiny"}}, "llama")
    assert "--hold-queue" not in render.router_args(owner, plain, render.model_source(plain))
    assert "--redis-key-prefix" not in render.router_args(owner, plain, render.model_source(plain))


def test_the_autoscalers_decisions_are_metrics() -> None:
    kube, clock, source = setup(deployment(scaleUpStabilizationSeconds=0))
    telemetry = Telemetry("chariot-operator", "operator")
    c = Controller(kube, Settings(default_image="img"), clock=clock, offered_load=lambda url, prefix: source["load"],
                   telemetry=telemetry)
    source["load"] = offered(1400.0)
    c.reconcile("prod", "llama")
    text = telemetry.prometheus_text().decode()
    assert 'chariot_autoscaler_desired_replicas{component="operator",modeldeployment="prod/llama"} 3.0' in text
    assert 'chariot_autoscaler_current_replicas{component="operator",modeldeployment="prod/llama"} 1.0' in text
    assert re.search(r'chariot_autoscaler_decisions_total\{[^}]*reason="ScaleUp"[^}]*\} 1\.0', text), text
    del kube.objects[KEY]["spec"]["autoscaling"]
    c.reconcile("prod", "llama")
    lines = telemetry.prometheus_text().decode().splitlines()
    assert not [line for line in lines if line.startswith("chariot_autoscaler_desired_replicas{")], \
        "autoscaling off: its gauges are gone"
