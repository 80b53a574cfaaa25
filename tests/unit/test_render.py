"""The operator's pure parts: spec validation, manifest rendering, planning, and one controller pass.

Rendering is checked for pipelines of 1..4 stages and 0..3 replicas against docs/cli-contract.md
(pod names, labels, owner references, rendezvous env, worker flags, GPU limits, probes); invalid specs
must be rejected with the offending field named; the planner's gang/backoff/rollout rules and a
controller pass against an in-memory API (idempotence: a second pass writes nothing) round it off.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable
from typing import Any

import kopf
import kubernetes_validate
import pytest

from chariot.operator import render
from chariot.operator.cli import add_operator_parser
from chariot.operator.controller import Controller, Outcome, Settings
from chariot.operator.handlers import raise_for
from chariot.operator.kube import ApiError, Kube, Ref, matches
from chariot.operator.reconcile import (
    Backoff,
    GroupStatus,
    Plan,
    PodState,
    drain_release,
    group_conditions,
    plan_groups,
)
from chariot.operator.render import Owner
from chariot.operator.spec import PRESET_SHAPES, InvalidSpec, Spec, parse_spec

OWNER = Owner(name="llama", namespace="prod", uid="0000-1111")


def spec_of(pipeline: int = 2, replicas: int = 1, **extra: Any) -> Spec:
    raw: dict[str, Any] = {"model": {"uri": "pvc://models/llama-3"}, "replicas": replicas,
                           "parallelism": {"pipeline": pipeline}, **extra}
    return parse_spec(raw, OWNER.name)


# --- rendering -----------------------------------------------------------------------------------

@pytest.mark.parametrize("pipeline", [1, 2, 3, 4])
@pytest.mark.parametrize("replicas", [0, 1, 2, 3])
def test_group_pods_follow_the_process_contract(pipeline: int, replicas: int) -> None:
    spec = spec_of(pipeline, replicas)
    pods = [p for g in range(replicas) for p in render.group_pods(OWNER, spec, "img:1", g, "h1")]
    assert [p["metadata"]["name"] for p in pods] == [f"llama-g{g}-s{s}" for g in range(replicas)
                                                      for s in range(pipeline)]
    for pod in pods:
        g, s = (int(x) for x in pod["metadata"]["name"].removeprefix("llama-g").split("-s"))
        meta, pod_spec = pod["metadata"], pod["spec"]
        assert meta["labels"]["chariot.dev/deployment"] == "llama"
        assert (meta["labels"]["chariot.dev/group"], meta["labels"]["chariot.dev/stage"]) == (str(g), str(s))
        assert meta["ownerReferences"] == [{"apiVersion": "chariot.dev/v1alpha1", "kind": "ModelDeployment",
                                            "name": "llama", "uid": "0000-1111", "controller": True,
                                            "blockOwnerDeletion": True}]
        assert meta["annotations"][render.ANNOTATION_CONFIG_HASH] == "h1"
        assert pod_spec["restartPolicy"] == "Never"
        assert (pod_spec["hostname"], pod_spec["subdomain"]) == (meta["name"], "llama-stages")
        (container,) = pod_spec["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["RANK"] == str(s) and env["WORLD_SIZE"] == str(pipeline)
        assert env["MASTER_ADDR"] == f"llama-g{g}-s0.llama-stages.prod.svc"
        assert env["MASTER_PORT"] == "29500"
        assert container["command"] == ["chariot", "worker"]
        args = container["args"]
        assert args[args.index("--stages") + 1] == str(pipeline)
        for flag, value in (("--host", "0.0.0.0"), ("--port", "50061"), ("--metrics-host", "0.0.0.0"),
                            ("--metrics-port", "9400"), ("--model", "/models/models/llama-3")):
            assert args[args.index(flag) + 1] == value
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert pod_spec["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_stage_zero_is_probed_over_grpc_health_and_other_stages_over_metrics() -> None:
    spec = spec_of(3)
    pods = render.group_pods(OWNER, spec, "img", 0, "h")
    stage0, stage2 = pods[0]["spec"]["containers"][0], pods[2]["spec"]["containers"][0]
    assert stage0["readinessProbe"]["grpc"] == {"port": 50061}
    assert stage0["livenessProbe"]["grpc"] == {"port": 50061}
    assert stage2["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": 9400}
    assert "tcpSocket" in stage2["livenessProbe"]
    assert {p["name"] for p in stage0["ports"]} == {"grpc", "rendezvous", "metrics"}
    assert {p["name"] for p in stage2["ports"]} == {"metrics"}


@pytest.mark.parametrize(("tensor", "gpus"), [(2, 1), (4, 1), (2, 2)])
def test_a_stage_pod_gets_a_device_per_tensor_parallel_rank_and_starts_its_ranks(tensor: int, gpus: int) -> None:
    """The pod counts stages in its rendezvous env (RANK = stage, WORLD_SIZE = P) and is told T: the
    worker starts the stage's other T-1 ranks itself (ranks stage × T + k of P × T)."""
    raw = {"model": {"uri": "pvc://models/llama-3"}, "parallelism": {"pipeline": 2, "tensor": tensor},
           "resources": {"gpusPerStage": gpus}}
    spec = parse_spec(raw, OWNER.name)
    for stage, pod in enumerate(render.group_pods(OWNER, spec, "img", 0, "h")):
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["requests"]["nvidia.com/gpu"] == tensor * gpus
        assert container["resources"]["limits"]["nvidia.com/gpu"] == tensor * gpus
        args = container["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == str(tensor)
        assert args[args.index("--stages") + 1] == "2"
        env = {e["name"]: e["value"] for e in container["env"]}
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(stage), "2")


def test_tensor_parallelism_that_does_not_split_a_preset_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidSpec, match=r"spec\.parallelism\.tensor.*attention heads \(4\), got 3"):
        parse_spec({"model": {"uri": "preset://tiny"}, "parallelism": {"tensor": 3}}, "x")
    assert parse_spec({"model": {"uri": "preset://tiny"}, "parallelism": {"tensor": 4}}, "x").tensor == 4


def test_cpu_stages_get_no_gpu_and_run_on_cpu() -> None:
    spec = spec_of(2, resources={"gpusPerStage": 0, "cpu": 4, "memory": "2Gi"})
    container = render.stage_pod(OWNER, spec, "img", 0, 1)["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert container["resources"]["requests"] == {"cpu": "4", "memory": "2Gi"}
    assert container["args"][container["args"].index("--device") + 1] == "cpu"
    assert "tolerations" not in render.stage_pod(OWNER, spec, "img", 0, 1)["spec"]


def test_disruption_budgets_keep_every_stage_of_a_group_and_all_but_one_router() -> None:
    spec = spec_of(3, 2)
    budgets = {b["metadata"]["name"]: b["spec"] for b in render.disruption_budgets(OWNER, spec, [0, 4])}
    assert set(budgets) == {"llama-g0", "llama-g4"}  # one router: no budget (it would block every drain)
    assert budgets["llama-g4"] == {"minAvailable": 3, "unhealthyPodEvictionPolicy": "AlwaysAllow", "selector": {
        "matchLabels": {"chariot.dev/deployment": "llama", "app.kubernetes.io/component": "worker",
                        "chariot.dev/group": "4"}}}
    routers = render.disruption_budgets(OWNER, spec_of(3, 2, router={"replicas": 3}), [])
    assert [(b["metadata"]["name"], b["spec"]["minAvailable"]) for b in routers] == [("llama-router", 2)]


def test_an_hf_model_is_fetched_by_an_init_container_in_every_pod() -> None:
    """Each stage pod fetches its own stage's weights, a router pod the config and tokenizer only."""
    spec = spec_of(2, model={"uri": "hf://meta-llama/Llama-3.1-8B@v2", "tokenSecret": {"name": "hf-token"}})
    fetch = ["chariot", "fetch-model", "hf://meta-llama/Llama-3.1-8B@v2", "/models/hf/meta-llama/Llama-3.1-8B"]
    pods = [render.stage_pod(OWNER, spec, "img", 0, s) for s in (0, 1)]
    router = render.router_deployment(OWNER, spec, "img")["spec"]["template"]
    for pod, part in [(pods[0], ["--stage", "0", "--stages", "2"]), (pods[1], ["--stage", "1", "--stages", "2"]),
                      (router, ["--no-weights"])]:
        (init,) = pod["spec"]["initContainers"]
        assert init["command"] == [*fetch, *part]
        token = next(e for e in init["env"] if e["name"] == "HF_TOKEN")
        assert token["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
        (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "model"]
        assert volume == {"name": "model", "emptyDir": {}}
    args = render.stage_pod(OWNER, spec, "img", 0, 0)["spec"]["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/models/hf/meta-llama/Llama-3.1-8B"
    cached = spec_of(1, model={"uri": "hf://org/m", "cacheClaim": "hf-cache"})
    pod = render.stage_pod(OWNER, cached, "img", 0, 0)
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "hf-cache"}} in pod["spec"]["volumes"]
    assert all(e["name"] != "HF_TOKEN" for e in pod["spec"]["initContainers"][0]["env"])


@pytest.mark.parametrize("model", [{"uri": "pvc://weights", "tokenSecret": {"name": "hf"}},
                                   {"uri": "preset://tiny", "cacheClaim": "c"}])
def test_hf_settings_without_an_hf_model_are_rejected(model: dict[str, Any]) -> None:
    with pytest.raises(InvalidSpec, match=r"spec\.model\.(tokenSecret|cacheClaim): only applies to hf://"):
        spec_of(1, model=model)


def test_only_pipelined_groups_get_a_rendezvous_timeout() -> None:
    def args(spec: Spec) -> list[str]:
        return list(render.stage_pod(OWNER, spec, "img", 0, 0)["spec"]["containers"][0]["args"])

    assert "--rendezvous-timeout" not in args(spec_of(1))
    slow = args(spec_of(3, parallelism={"pipeline": 3, "rendezvousTimeoutSeconds": 3600}))
    assert slow[slow.index("--rendezvous-timeout") + 1] == "3600"


def test_engine_flags_come_from_the_spec() -> None:
    spec = spec_of(2, scheduler={"policy": "orca", "tokenBudget": 4096, "maxBatchSize": 8, "blockSize": 32,
                                 "prefillOrder": "shortest"},
                   model={"uri": "/opt/m", "dtype": "bfloat16", "maxModelLen": 4096, "name": "m7"},
                   observability={"otlpEndpoint": "http://otel:4317"})
    args = render.stage_pod(OWNER, spec, "img", 0, 0)["spec"]["containers"][0]["args"]
    pairs = dict(zip(args[::2], args[1::2], strict=True))
    assert pairs == {"--model": "/opt/m", "--policy": "orca", "--max-batch-size": "8", "--block-size": "32",
                     "--prefill-order": "shortest",
                     "--dtype": "bfloat16", "--stages": "2", "--device": "cuda", "--token-budget": "4096",
                     "--max-model-len": "4096", "--host": "0.0.0.0", "--port": "50061",
                     "--metrics-host": "0.0.0.0", "--metrics-port": "9400", "--served-model-name": "m7",
                     "--otlp-endpoint": "http://otel:4317", "--rendezvous-timeout": "1200"}


def test_an_unset_block_size_leaves_it_to_the_workers_device() -> None:
    """No `blockSize`: no `--block-size`, so each worker takes its device's default (128 tokens on a
    CPU, 16 on a GPU)."""
    args = render.stage_pod(OWNER, spec_of(1), "img", 0, 0)["spec"]["containers"][0]["args"]
    assert "--block-size" not in args


def test_tbt_slo_without_a_tune_profile_goes_to_the_router_only() -> None:
    spec = spec_of(1, slo={"tbtMs": 150})
    args = render.stage_pod(OWNER, spec, "img", 0, 0)["spec"]["containers"][0]["args"]
    assert "--tbt-slo-ms" not in args and "--token-budget" not in args  # the policy's default budget


@pytest.mark.parametrize("stage", [0, 1])
def test_tbt_slo_with_a_tune_profile_derives_every_stages_budget(stage: int) -> None:
    spec = spec_of(2, slo={"tbtMs": 150}, scheduler={"tuneProfile": "/models/llama-3/tune.json"})
    args = render.stage_pod(OWNER, spec, "img", 0, stage)["spec"]["containers"][0]["args"]
    pairs = dict(zip(args[::2], args[1::2], strict=False))
    assert pairs["--tbt-slo-ms"] == "150" and pairs["--tune-profile"] == "/models/llama-3/tune.json"
    assert "--token-budget" not in args


@pytest.mark.parametrize(("uri", "path", "volume"), [
    ("preset://tiny", "/models/tiny", {"name": "model", "emptyDir": {}}),
    ("pvc://weights/llama/8b", "/models/weights/llama/8b",
     {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}),
    ("pvc://weights", "/models/weights",
     {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}),
    ("file:///srv/m", "/srv/m", None),
    ("/srv/m", "/srv/m", None),
])
def test_model_sources(uri: str, path: str, volume: dict[str, Any] | None) -> None:
    source = render.model_source(spec_of(1, model={"uri": uri}))
    assert source.path == path
    assert list(source.volumes) == ([volume] if volume else [])
    pod = render.stage_pod(OWNER, spec_of(1, model={"uri": uri}), "img", 0, 0)
    init = pod["spec"]["initContainers"]
    assert bool(init) == uri.startswith("preset://")
    if init:
        assert init[0]["command"] == ["chariot", "make-model", "/models/tiny", "--preset", "tiny"]


def test_shared_objects() -> None:
    spec = spec_of(2, 2, slo={"ttftMs": 800, "tbtMs": 100}, router={"replicas": 2, "redis": {"url": "redis://r:6379"}})
    cm, stages, router, router_svc = render.shared_objects(OWNER, spec, "img", "h", [1, 0])
    assert [(o["kind"], o["metadata"]["name"]) for o in (cm, stages, router, router_svc)] == \
        render.shared_object_names(OWNER)
    assert stages["spec"]["clusterIP"] == "None" and stages["spec"]["publishNotReadyAddresses"] is True
    assert json.loads(cm["data"]["replicas.json"]) == {"replicas": [
        {"name": "g0", "address": "llama-g0-s0.llama-stages.prod.svc:50061"},
        {"name": "g1", "address": "llama-g1-s0.llama-stages.prod.svc:50061"}]}
    assert json.loads(cm["data"]["config.json"])["pipelineStages"] == 2
    assert router["spec"]["replicas"] == 2
    container = router["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["chariot", "router"]
    args = container["args"]
    pairs = dict(zip(args[::2], args[1::2], strict=True))
    assert pairs["--replica-file"] == "/etc/chariot/replicas.json" and pairs["--host"] == "0.0.0.0"
    assert (pairs["--ttft-slo-ms"], pairs["--tbt-slo-ms"], pairs["--redis-url"]) == ("800", "100", "redis://r:6379")
    assert router_svc["spec"]["ports"][0] == {"name": "http", "port": 8000, "targetPort": "http"}
    # readiness follows the backends; liveness only asks whether the process serves, so a router with
    # no ready replica is taken out of the Service but never restarted
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    for obj in (cm, stages, router, router_svc):
        assert obj["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid


def test_each_group_gets_a_network_policy_admitting_only_its_own_pods_and_the_routers() -> None:
    spec = spec_of(2, 3)
    policies = render.network_policies(OWNER, [2, 0, 1])
    assert [p["metadata"]["name"] for p in policies] == ["llama-g0-stages", "llama-g1-stages", "llama-g2-stages"]
    g1 = policies[1]["spec"]
    own = {"chariot.dev/deployment": "llama", "app.kubernetes.io/component": "worker", "chariot.dev/group": "1"}
    assert g1["podSelector"] == {"matchLabels": own} and g1["policyTypes"] == ["Ingress"]
    rules = g1["ingress"]
    # any port from the group's own pods: the rendezvous store and NCCL/gloo's ephemeral ports
    assert {"from": [{"podSelector": {"matchLabels": own}}]} in rules
    # the routers of this deployment reach stage 0's gRPC port only
    routers = {"chariot.dev/deployment": "llama", "app.kubernetes.io/component": "router"}
    assert {"from": [{"podSelector": {"matchLabels": routers}}], "ports": [{"protocol": "TCP", "port": 50061}]} in rules
    # metrics from anywhere (Prometheus), and nothing else: every rule names a source or a port
    assert {"ports": [{"protocol": "TCP", "port": 9400}]} in rules and len(rules) == 3
    rendezvous = render.RENDEZVOUS_PORT
    assert all("from" in r or rendezvous not in [p["port"] for p in r["ports"]] for r in rules)
    # the stage pods carry the labels the policy selects
    for pod in render.group_pods(OWNER, spec, "img", 1, "h"):
        assert own.items() <= pod["metadata"]["labels"].items()
    assert render.network_policy_selector(OWNER).split(",") == [
        "chariot.dev/deployment=llama", "app.kubernetes.io/component=worker-network"]


def test_rendering_is_deterministic_and_the_hash_tracks_pod_changes_only() -> None:
    base = spec_of(2, 1)
    assert render.group_pods(OWNER, base, "img", 0, "h") == render.group_pods(OWNER, base, "img", 0, "h")
    h = render.config_hash(OWNER, base, "img")
    assert h == render.config_hash(OWNER, spec_of(2, 3, router={"replicas": 4}), "img")
    assert h != render.config_hash(OWNER, spec_of(2, 1, scheduler={"tokenBudget": 128}), "img")
    assert h != render.config_hash(OWNER, base, "img:2")
    assert h != render.config_hash(OWNER, spec_of(3, 1), "img")


def test_applied_hash_annotation() -> None:
    svc = render.stages_service(OWNER)
    a, b = render.with_applied_hash(svc), render.with_applied_hash(copy.deepcopy(svc))
    assert a == b and render.ANNOTATION_APPLIED_HASH in a["metadata"]["annotations"]
    assert "annotations" not in svc["metadata"], "the input is not modified"


# --- spec validation -----------------------------------------------------------------------------

def test_defaults_match_the_crd() -> None:
    spec = parse_spec({"model": {"uri": "preset://tiny"}}, "x")
    assert (spec.replicas, spec.pipeline, spec.tensor, spec.scheduler.policy, spec.scheduler.max_batch_size,
            spec.scheduler.block_size, spec.resources.gpus_per_stage, spec.router.replicas, spec.model.dtype) == \
        (1, 1, 1, "sarathi", 128, None, 1, 1, "auto")


@pytest.mark.parametrize(("change", "field"), [
    ({"parallelism": {"tensor": 3}}, "spec.parallelism.tensor"),  # preset://tiny has 4 attention heads
    ({"parallelism": {"tensor": 0}}, "spec.parallelism.tensor"),
    ({"parallelism": {"pipeline": 0}}, "spec.parallelism.pipeline"),
    ({"parallelism": {"pipeline": 3}}, "spec.parallelism.pipeline"),  # preset://tiny has 2 layers
    ({"replicas": -1}, "spec.replicas"),
    ({"replicas": "two"}, "spec.replicas"),
    ({"scheduler": {"policy": "fifo"}}, "spec.scheduler.policy"),
    ({"scheduler": {"tokenBudget": 0}}, "spec.scheduler.tokenBudget"),
    ({"scheduler": {"policy": "vllm", "tokenBudget": 512}, "model": {"uri": "preset://tiny", "maxModelLen": 2048}},
     "spec.scheduler.tokenBudget"),
    ({"model": {"uri": "preset://tiny", "maxModelLen": 4096}}, "spec.model.maxModelLen"),
    ({"model": {"uri": "s3://bucket/m"}}, "spec.model.uri"),
    ({"model": {}}, "spec.model.uri"),
    ({"model": {"uri": "preset://tiny", "dtype": "int4"}}, "spec.model.dtype"),
    ({"resources": {"gpusPerStage": -1}}, "spec.resources.gpusPerStage"),
    ({"resources": {"memory": True}}, "spec.resources.memory"),
    ({"router": {"redis": {"url": "http://redis"}}}, "spec.router.redis.url"),
    ({"slo": {"tbtMs": 0}}, "spec.slo.tbtMs"),
    ({"scheduler": {"tuneProfile": "/m/tune.json"}}, "spec.scheduler.tuneProfile"),  # no slo.tbtMs
    ({"scheduler": {"tuneProfile": "/m/t.json", "tokenBudget": 256}, "slo": {"tbtMs": 200}},
     "spec.scheduler.tuneProfile"),
    ({"scheduler": {"tuneProfile": "/m/t.json", "policy": "vllm"}, "slo": {"tbtMs": 200}},
     "spec.scheduler.tuneProfile"),
    ({"observability": {"otlpEndpoint": "collector:4317"}}, "spec.observability.otlpEndpoint"),
])
def test_invalid_specs_name_the_field(change: dict[str, Any], field: str) -> None:
    raw = {"model": {"uri": "preset://tiny"}, **change}
    with pytest.raises(InvalidSpec) as info:
        parse_spec(raw, "ok")
    assert field in [e.path for e in info.value.errors], str(info.value)
    assert str(info.value).startswith(field) or f"; {field}" in str(info.value)


@pytest.mark.parametrize("name", ["Upper", "9lives", "a" * 60])
def test_names_that_cannot_become_pod_hostnames_are_rejected(name: str) -> None:
    with pytest.raises(InvalidSpec, match=r"metadata\.name"):
        parse_spec({"model": {"uri": "preset://tiny"}}, name)


def test_preset_shapes_match_make_model() -> None:
    from chariot.worker.model.make_model import PRESETS

    assert {k: (p.num_layers, p.max_position_embeddings, p.num_heads, p.num_kv_heads, p.intermediate_size)
            for k, p in PRESETS.items()} == PRESET_SHAPES


# --- planning ------------------------------------------------------------------------------------

BACKOFF = Backoff(base_s=5, max_s=40, reset_after_s=100)


def pod_states(spec: Spec, groups: Iterable[int], h: str = "h", ready: bool = True,
               phase: str = "Running") -> list[PodState]:
    return [PodState(f"llama-g{g}-s{s}", g, s, h, phase, ready, False) for g in groups for s in range(spec.pipeline)]


def on_nodes(pods: list[PodState], nodes: dict[int, str]) -> list[PodState]:
    return [PodState(p.name, p.group, p.stage, p.config_hash, p.phase, p.ready, p.terminating, node=nodes[p.group])
            for p in pods]


def test_a_drain_releases_the_lowest_ready_group_on_a_cordoned_node_while_the_others_are_ready() -> None:
    spec = spec_of(2, 3)
    pods = on_nodes(pod_states(spec, range(3)), {0: "a", 1: "b", 2: "b"})
    asked: list[str] = []

    def cordoned(*names: str) -> Callable[[str], bool]:
        def check(node: str) -> bool:
            asked.append(node)
            return node in names
        return check

    ready = Plan(statuses={g: GroupStatus(g, "Ready") for g in range(3)})
    assert drain_release(ready, pods, cordoned()) is None  # nothing cordoned
    assert drain_release(ready, pods, cordoned("b")) == 1 and drain_release(ready, pods, cordoned("a", "b")) == 0
    asked.clear()
    one_down = Plan(statuses={0: GroupStatus(0, "Restarting"), 1: GroupStatus(1, "Ready"), 2: GroupStatus(2, "Ready")})
    assert drain_release(one_down, pods, cordoned("b")) is None  # another group is down: the drain waits
    lone = Plan(statuses={0: GroupStatus(0, "Ready")})
    assert drain_release(lone, pods[:2], cordoned("a")) is None  # one group: releasing it is an outage
    assert asked == []  # no node is read when no group could be released
    leaving = [p if p.group != 1 else PodState(p.name, 1, p.stage, "h", "Running", True, True, node="b") for p in pods]
    assert drain_release(ready, leaving, cordoned("b")) == 2  # group 1's pods are already going


def test_a_released_group_budget_allows_every_eviction() -> None:
    budgets = {b["metadata"]["name"]: b["spec"]["minAvailable"]
               for b in render.disruption_budgets(OWNER, spec_of(3, 2), [0, 1], released=1)}
    assert budgets == {"llama-g0": 3, "llama-g1": 0}


def test_plan_creates_missing_groups_and_reports_them_pending() -> None:
    spec = spec_of(2, 3)
    plan = plan_groups(spec, "h", pod_states(spec, range(1)), {}, 1000.0, BACKOFF)
    assert (plan.create, plan.delete) == ([1, 2], [])
    assert [g.phase for g in plan.groups] == ["Ready", "Pending", "Pending"]


def test_plan_gang_restarts_a_started_group_with_a_failed_or_missing_pod_then_backs_off() -> None:
    spec = spec_of(3, 2)
    pods = pod_states(spec, range(2))
    started = {g: GroupStatus(g, "Ready", started=True) for g in range(2)}
    failed = [p if p.name != "llama-g1-s2" else PodState(p.name, 1, 2, "h", "Failed", False, False) for p in pods]
    plan = plan_groups(spec, "h", failed, started, 1000.0, BACKOFF)
    assert plan.delete == [1] and plan.groups[1].phase == "Restarting" and plan.groups[1].restarts == 1
    assert "llama-g1-s2 failed" in plan.groups[1].message and plan.delete_pods == []
    why = "chariot: stage 2: warm-up forward pass failed"
    told = [p if p.name != "llama-g1-s2" else PodState(p.name, 1, 2, "h", "Failed", False, False, why) for p in pods]
    plan = plan_groups(spec, "h", told, started, 1000.0, BACKOFF)
    assert plan.groups[1].last_failure == "pod llama-g1-s2 failed: chariot: stage 2: warm-up forward pass failed"
    vanished = [p for p in pods if p.name != "llama-g0-s1"]
    plan = plan_groups(spec, "h", vanished, started, 1000.0, BACKOFF)
    assert plan.delete == [0] and "stage 1 vanished" in plan.groups[0].last_failure
    # Pods gone: wait out the backoff (5 s for the first restart), then recreate, not started yet.
    previous = {0: plan.groups[0]}
    later = [p for p in pods if p.group == 1]
    waiting = plan_groups(spec, "h", later, previous, 1003.0, BACKOFF)
    assert waiting.create == [] and waiting.groups[0].phase == "BackingOff"
    assert waiting.requeue_after == pytest.approx(2.0)
    after = plan_groups(spec, "h", later, previous, 1005.5, BACKOFF)
    assert after.create == [0] and after.groups[0].restarts == 1 and not after.groups[0].started


def test_a_group_is_started_once_all_its_pods_run_at_once() -> None:
    spec = spec_of(2, 1)
    loading = [PodState("llama-g0-s0", 0, 0, "h", "Running", False, False),
               PodState("llama-g0-s1", 0, 1, "h", "Pending", False, False)]
    assert not plan_groups(spec, "h", loading, {}, 0.0, BACKOFF).groups[0].started
    running = plan_groups(spec, "h", pod_states(spec, [0], ready=False), {}, 0.0, BACKOFF).groups[0]
    assert running.started and running.to_dict()["started"] is True
    assert GroupStatus.from_dict(running.to_dict()).started


def test_before_the_group_started_only_the_failed_pod_is_replaced_after_backoff() -> None:
    """LeaderWorkerSet's RecreateGroupAfterStart: stage 1 fails while stage 0 is still loading (not
    every pod has run yet): only stage 1 is deleted, and recreated once the backoff has passed; stage
    0 keeps waiting at the rendezvous. A pod that vanishes before the start is replaced the same way."""
    spec = spec_of(2, 1)
    loading = [PodState("llama-g0-s0", 0, 0, "h", "Pending", False, False),
               PodState("llama-g0-s1", 0, 1, "h", "Failed", False, False, "chariot: cannot pull")]
    plan = plan_groups(spec, "h", loading, {}, 1000.0, BACKOFF)
    assert (plan.delete, plan.delete_pods, plan.create_stages) == ([], ["llama-g0-s1"], {})
    status = plan.groups[0]
    assert (status.phase, status.restarts, status.restart_after) == ("Restarting", 1, 1005.0)
    assert "replacing only those pods" in status.message and "cannot pull" in status.last_failure
    alone = [loading[0]]  # the failed pod is gone; stage 0 still loading
    waiting = plan_groups(spec, "h", alone, {0: status}, 1002.0, BACKOFF)
    assert waiting.groups[0].phase == "BackingOff" and not waiting.create_stages and not waiting.delete_pods
    refill = plan_groups(spec, "h", alone, {0: status}, 1006.0, BACKOFF)
    assert refill.create_stages == {0: [1]} and refill.create == [] and refill.delete == []
    assert refill.groups[0].restarts == 1 and refill.groups[0].restart_after is None
    vanished = plan_groups(spec, "h", alone, {0: GroupStatus(0, "Pending")}, 2000.0, BACKOFF)
    assert vanished.delete_pods == [] and vanished.groups[0].restart_after == 2005.0
    assert "stage 1 vanished" in vanished.groups[0].last_failure


def test_backoff_doubles_and_is_capped() -> None:
    assert [BACKOFF.delay(n) for n in range(1, 7)] == [5, 10, 20, 40, 40, 40]


def test_restarts_are_forgotten_after_a_stable_period() -> None:
    spec = spec_of(1, 1)
    prev = {0: GroupStatus(0, "Ready", restarts=3, ready_since=1000.0, last_failure="x")}
    assert plan_groups(spec, "h", pod_states(spec, range(1)), prev, 1050.0, BACKOFF).groups[0].restarts == 3
    stable = plan_groups(spec, "h", pod_states(spec, range(1)), prev, 1100.0, BACKOFF).groups[0]
    assert (stable.restarts, stable.last_failure) == (0, "")


def test_plan_without_surge_rolls_one_serving_group_at_a_time() -> None:
    spec = spec_of(2, 3, rollout={"maxSurge": 0})
    old = pod_states(spec, range(3), h="old")
    plan = plan_groups(spec, "new", old, {}, 0.0, BACKOFF)
    # One old group down, its replacement started at the lowest free index (0 is still terminating):
    # never more than `replicas` groups up, never more than one of them unavailable.
    assert plan.delete == [0] and plan.create == [3] and plan.groups[0].phase == "Terminating"
    assert serving(plan) == 2
    # The replacement is not ready yet: nothing else moves.
    mixed = pod_states(spec, [3], h="new", ready=False) + pod_states(spec, range(1, 3), h="old")
    plan = plan_groups(spec, "new", mixed, {}, 0.0, BACKOFF)
    assert plan.delete == [] and plan.create == []
    # Ready on the new config: now group 1, replaced at the freed index 0.
    mixed = pod_states(spec, [3], h="new") + pod_states(spec, range(1, 3), h="old")
    assert (plan_groups(spec, "new", mixed, {}, 0.0, BACKOFF).delete,
            plan_groups(spec, "new", mixed, {}, 0.0, BACKOFF).create) == ([1], [0])


def serving(plan: Any) -> int:
    return len(plan.ready_groups)


def test_plan_with_surge_starts_an_up_to_date_group_before_taking_an_old_one_down() -> None:
    spec = spec_of(2, 2)  # maxSurge defaults to 1
    assert spec.max_surge == 1
    old = pod_states(spec, range(2), h="old")
    plan = plan_groups(spec, "new", old, {}, 0.0, BACKOFF)
    assert (plan.create, plan.delete, serving(plan)) == ([2], [], 2)
    conditions = {c.type: c for c in group_conditions(spec, plan, "new", router_ready=True)}
    assert (conditions["Ready"].status, conditions["Ready"].reason) == (False, "UpdateInProgress")
    assert conditions["Progressing"].reason == "RollingUpdate"
    starting = old + pod_states(spec, range(2, 3), h="new", ready=False)
    plan = plan_groups(spec, "new", starting, {}, 0.0, BACKOFF)
    assert (plan.create, plan.delete, serving(plan)) == ([], [], 2)  # at most replicas + 1 groups
    # The new group is Ready: one old group goes, and the next new one starts at the lowest free index
    # (group 0's pods still exist while they terminate).
    surged = old + pod_states(spec, range(2, 3), h="new")
    plan = plan_groups(spec, "new", surged, {}, 0.0, BACKOFF)
    assert (plan.delete, plan.create) == ([0], [3])
    assert serving(plan) >= spec.replicas  # capacity never dropped (group 0 is no longer counted)
    # Old group 1 is the last to go, once group 3 is Ready too.
    last = pod_states(spec, range(1, 2), h="old") + pod_states(spec, range(2, 4), h="new")
    plan = plan_groups(spec, "new", last, {}, 0.0, BACKOFF)
    assert (plan.delete, plan.create) == ([1], [])
    done = pod_states(spec, range(2, 4), h="new")
    plan = plan_groups(spec, "new", done, {}, 0.0, BACKOFF)
    assert (plan.delete, plan.create, [g.index for g in plan.groups]) == ([], [], [2, 3])
    conditions = {c.type: c for c in group_conditions(spec, plan, "new", router_ready=True)}
    assert conditions["Ready"].status and not conditions["Progressing"].status


def test_a_surge_group_that_fails_is_gang_restarted_and_old_groups_keep_serving() -> None:
    spec = spec_of(2, 1)
    old = pod_states(spec, range(1), h="old")
    crashed = [PodState("llama-g1-s0", 1, 0, "new", "Failed", False, False, "chariot: boom"),
               PodState("llama-g1-s1", 1, 1, "new", "Running", False, False)]
    started = {1: GroupStatus(1, "Starting", started=True)}  # both its pods had been running
    plan = plan_groups(spec, "new", old + crashed, started, 100.0, BACKOFF)
    assert plan.delete == [1] and plan.create == [] and serving(plan) == 1
    assert plan.groups[1].phase == "Restarting" and "chariot: boom" in plan.groups[1].last_failure
    # Its pods gone, it backs off in its index; no other group is started meanwhile.
    plan = plan_groups(spec, "new", old, {1: plan.groups[1]}, 101.0, BACKOFF)
    assert plan.create == [] and [g.phase for g in plan.groups] == ["Ready", "BackingOff"]
    plan = plan_groups(spec, "new", old, {1: plan.groups[1]}, 106.0, BACKOFF)
    assert plan.create == [1]


def test_scale_down_prefers_groups_that_do_not_serve() -> None:
    spec = spec_of(1, 2)
    pods = pod_states(spec, [0, 2]) + pod_states(spec, [5], ready=False)
    plan = plan_groups(spec, "h", pods, {}, 0.0, BACKOFF)
    assert plan.delete == [5] and [g.index for g in plan.groups] == [0, 2]


def test_outdated_groups_that_do_not_serve_are_replaced_at_once() -> None:
    spec = spec_of(2, 2)
    pods = pod_states(spec, range(2), h="old", ready=False, phase="Pending")
    plan = plan_groups(spec, "new", pods, {}, 0.0, BACKOFF)
    assert plan.delete == [0, 1] and plan.create == [2, 3]


def test_plan_scales_down_whole_groups_and_waits_for_terminating_pods() -> None:
    spec = spec_of(2, 1)
    pods = pod_states(spec, range(3))
    plan = plan_groups(spec, "h", pods, {}, 0.0, BACKOFF)
    assert plan.delete == [1, 2] and len(plan.groups) == 1
    terminating = [PodState(p.name, p.group, p.stage, p.config_hash, p.phase, p.ready, p.group == 0) for p in pods]
    plan = plan_groups(spec_of(2, 1), "h", terminating[:2], {}, 0.0, BACKOFF)
    assert plan.create == [] and plan.groups[0].phase == "Terminating"


def test_conditions() -> None:
    spec = spec_of(2, 2)
    ready = plan_groups(spec, "h", pod_states(spec, range(2)), {}, 0.0, BACKOFF)
    by_type = {c.type: c for c in group_conditions(spec, ready, "h", router_ready=True)}
    assert (by_type["Ready"].status, by_type["Progressing"].status, by_type["Degraded"].status) == (True, False, False)
    assert not {c.type: c for c in group_conditions(spec, ready, "h", router_ready=False)}["Ready"].status
    rolling = plan_groups(spec, "h2", pod_states(spec, range(2)), {}, 0.0, BACKOFF)
    assert {c.type: c for c in group_conditions(spec, rolling, "h2", True)}["Progressing"].reason == "RollingUpdate"


# --- a controller pass against an in-memory API --------------------------------------------------

class MemoryKube(Kube):
    """Objects in a dict; counts writes. Enough API for `Controller`."""

    def __init__(self) -> None:
        super().__init__(api_client=None)
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.writes: list[str] = []

    def get(self, ref: Ref) -> dict[str, Any] | None:
        obj = self.objects.get((ref.kind, ref.namespace, ref.name or ""))
        return copy.deepcopy(obj) if obj else None

    def list(self, ref: Ref, label_selector: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(o) for (k, ns, _), o in self.objects.items() if k == ref.kind and ns == ref.namespace
                and matches(label_selector, o["metadata"].get("labels") or {})]

    def create(self, ref: Ref, body: dict[str, Any]) -> dict[str, Any] | None:
        key = (ref.kind, ref.namespace, body["metadata"]["name"])
        if key in self.objects:
            return None
        self.writes.append(f"create {key}")
        self.objects[key] = copy.deepcopy(body)
        return body

    def merge_patch(self, ref: Ref, body: dict[str, Any], subresource: str | None = None) -> dict[str, Any]:
        key = (ref.kind, ref.namespace, ref.name or "")
        if key not in self.objects:
            raise ApiError(404, "not found")
        self.writes.append(f"patch {key} {subresource or ''}")
        self.objects[key] = {**self.objects[key], **copy.deepcopy(body)}
        return self.objects[key]

    def delete(self, ref: Ref, propagation: str = "Background") -> bool:
        self.writes.append(f"delete {ref}")
        return self.objects.pop((ref.kind, ref.namespace, ref.name or ""), None) is not None


def mdep(raw_spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "chariot.dev/v1alpha1", "kind": "ModelDeployment",
            "metadata": {"name": "llama", "namespace": "prod", "uid": "0000-1111", "generation": 1},
            "spec": raw_spec}


def test_a_second_pass_changes_nothing() -> None:
    kube = MemoryKube()
    kube.objects[("ModelDeployment", "prod", "llama")] = mdep({"model": {"uri": "preset://tiny"},
                                                               "parallelism": {"pipeline": 2}})
    controller = Controller(kube, Settings(default_image="img"), clock=lambda: 1000.0)
    first = controller.reconcile("prod", "llama")
    assert not first.converged
    assert sorted(n for k, _, n in kube.objects if k == "Pod") == ["llama-g0-s0", "llama-g0-s1"]
    for (kind, _, _), obj in list(kube.objects.items()):  # a kubelet makes the pods ready, a controller the router
        if kind == "Pod":
            obj["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
        if kind == "Deployment":
            obj["status"] = {"availableReplicas": 1}
    assert controller.reconcile("prod", "llama").converged
    kube.writes.clear()
    assert controller.reconcile("prod", "llama") == Outcome(True, "1/1 replicas and the router are ready")
    assert kube.writes == [], "an idempotent pass writes nothing"


def test_an_invalid_spec_writes_only_status() -> None:
    kube = MemoryKube()
    kube.objects[("ModelDeployment", "prod", "llama")] = mdep({"model": {"uri": "preset://tiny"},
                                                               "parallelism": {"tensor": 3}})
    outcome = Controller(kube, Settings(), clock=lambda: 0.0).reconcile("prod", "llama")
    assert outcome.invalid is not None and "spec.parallelism.tensor" in outcome.message
    assert [k for k, _, _ in kube.objects] == ["ModelDeployment"]
    ready = kube.objects[("ModelDeployment", "prod", "llama")]["status"]["conditions"][0]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "False", "InvalidSpec")


def test_outcomes_map_to_kopf_errors() -> None:
    raise_for(Outcome(True, "fine"))
    with pytest.raises(kopf.TemporaryError) as temporary:
        raise_for(Outcome(False, "group 0 is Pending", requeue_after=3.0))
    assert temporary.value.delay == 3.0
    with pytest.raises(kopf.PermanentError, match=r"spec\.parallelism\.tensor"):
        try:
            parse_spec({"model": {"uri": "preset://tiny"}, "parallelism": {"tensor": 3}}, "x")
        except InvalidSpec as exc:
            raise_for(Outcome(False, str(exc), invalid=exc))


def test_operator_subcommand_registers() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="chariot")
    add_operator_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["operator", "-n", "a", "--namespace", "b", "--resync-seconds", "5"])
    assert (args.namespace, args.resync_seconds, callable(args.handler)) == (["a", "b"], 5.0, True)
    assert parser.parse_args(["operator"]).namespace is None


def test_a_failed_workers_last_log_line_becomes_the_failure() -> None:
    pod = {"metadata": {"name": "llama-g0-s1", "labels": {render.LABEL_GROUP: "0", render.LABEL_STAGE: "1"}},
           "status": {"phase": "Failed", "containerStatuses": [{"name": "worker", "state": {"terminated": {
               "exitCode": 2, "message": "loading weights\nchariot: stage 1: warm-up forward pass failed\n\n"}}}]}}
    state = PodState.from_manifest(pod)
    assert state is not None and state.failed
    assert state.failure == "chariot: stage 1: warm-up forward pass failed"
    spec = spec_of(1, 2)
    container = render.stage_pod(OWNER, spec, "img", 0, 1)["spec"]["containers"][0]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"


@pytest.mark.parametrize("extra", [
    {},
    {"model": {"uri": "hf://org/model@v1", "tokenSecret": {"name": "hf"}, "cacheClaim": "cache"},
     "router": {"replicas": 3}},
    {"model": {"uri": "pvc://weights/llama"}, "resources": {"gpusPerStage": 0, "cpu": "2", "memory": "4Gi"},
     "template": {"spec": {"nodeSelector": {"pool": "gpu"}, "runtimeClassName": "nvidia",
                           "imagePullSecrets": [{"name": "registry"}],
                           "containers": [{"name": "worker", "env": [{"name": "NCCL_DEBUG", "value": "INFO"}]}]}}},
])
def test_every_object_the_operator_renders_is_a_valid_kubernetes_1_32_object(extra: dict[str, Any]) -> None:
    spec = spec_of(2, 2, **extra)
    objects = [*render.group_pods(OWNER, spec, "img", 0, "h"), *render.group_pods(OWNER, spec, "img", 3, "h"),
               *render.shared_objects(OWNER, spec, "img", "h", [0, 3]),
               *render.network_policies(OWNER, [0, 3]), *render.disruption_budgets(OWNER, spec, [0, 3])]
    for obj in objects:
        kubernetes_validate.validate(obj, "1.32", strict=True)
