"""`spec.template` and `spec.router.template`: user PodTemplateSpecs merged onto the operator's pods.

The merge follows the documented rules (maps by key, lists by name / mountPath, tolerations and
envFrom appended, the template winning on plain fields); a template that sets an operator-owned field
(command, args, image, ports, probes, rendezvous env, selector labels, the operator's volumes and
mounts, GPU resources) is rejected naming the field, and even an unvalidated one cannot change those
fields in the rendered pods; the rendered pods stay valid Kubernetes objects; a changed stage template
rolls the groups (new config hash), a router template only the router Deployment.
"""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from chariot.operator import podtemplate, render
from chariot.operator.render import Owner
from chariot.operator.spec import InvalidSpec, Spec, parse_spec

OWNER = Owner(name="llama", namespace="prod", uid="0000-1111")
MODEL = {"uri": "preset://tiny"}

TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": {"team": "search"}, "annotations": {"example.com/owner": "search"}},
    "spec": {
        "nodeSelector": {"pool": "h100"},
        "runtimeClassName": "nvidia",
        "priorityClassName": "serving-high",
        "schedulerName": "volcano",
        "serviceAccountName": "llm",
        "imagePullSecrets": [{"name": "registry"}],
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"},
                        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
        "securityContext": {"supplementalGroups": [2000]},
        "volumes": [{"name": "certs", "secret": {"secretName": "ca"}}],
        "containers": [
            {"name": "worker",
             "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "HOME", "value": "/home/chariot"}],
             "envFrom": [{"secretRef": {"name": "tokens"}}],
             "resources": {"requests": {"memory": "16Gi"}, "limits": {"memory": "16Gi", "ephemeral-storage": "20Gi"}},
             "volumeMounts": [{"name": "certs", "mountPath": "/etc/ssl/custom", "readOnly": True}]},
            {"name": "log-shipper", "image": "fluent-bit:3", "args": ["-c", "/etc/fb.conf"]},
        ],
        "initContainers": [{"name": "warmup", "image": "busybox", "command": ["true"]}],
    },
}


def spec_of(template: dict[str, Any] | None = None, router_template: dict[str, Any] | None = None,
            **extra: Any) -> Spec:
    raw: dict[str, Any] = {"model": MODEL, "parallelism": {"pipeline": 2}, **extra}
    if template is not None:
        raw["template"] = template
    if router_template is not None:
        raw["router"] = {"template": router_template}
    return parse_spec(raw, OWNER.name)


def worker(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "worker"]
    return dict(container)


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def router_pod(spec: Spec) -> dict[str, Any]:
    return dict(render.router_deployment(OWNER, spec, "img")["spec"]["template"])


# --- merging -------------------------------------------------------------------------------------

def test_an_empty_template_changes_nothing() -> None:
    plain, empty = spec_of(), spec_of({}, {})
    for stage in (0, 1):
        assert render.stage_pod(OWNER, empty, "img", 0, stage) == render.stage_pod(OWNER, plain, "img", 0, stage)
    assert render.config_hash(OWNER, empty, "img") == render.config_hash(OWNER, plain, "img")
    assert router_pod(empty) == router_pod(plain)
    base = render.stage_pod(OWNER, plain, "img", 0, 0)
    assert podtemplate.merge_pod(base, {}) == base


@pytest.mark.parametrize("stage", [0, 1])
def test_pod_fields_merge_as_documented(stage: int) -> None:
    plain = render.stage_pod(OWNER, spec_of(), "img", 0, stage)
    pod = render.stage_pod(OWNER, spec_of(TEMPLATE), "img", 0, stage)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["labels"] == {"team": "search", **plain["metadata"]["labels"]}
    assert meta["annotations"] == {"example.com/owner": "search", **plain["metadata"]["annotations"]}
    for field in ("nodeSelector", "runtimeClassName", "priorityClassName", "schedulerName", "serviceAccountName",
                  "imagePullSecrets", "affinity"):
        assert spec[field] == TEMPLATE["spec"][field], field
    # tolerations are appended, an identical one is not repeated
    assert spec["tolerations"] == [*plain["spec"]["tolerations"], TEMPLATE["spec"]["tolerations"][0]]
    # maps merge key by key
    assert spec["securityContext"] == {**plain["spec"]["securityContext"], "supplementalGroups": [2000]}
    # lists by name: the operator's entries first, then the template's
    assert spec["volumes"] == [*plain["spec"]["volumes"], {"name": "certs", "secret": {"secretName": "ca"}}]
    assert [c["name"] for c in spec["containers"]] == ["worker", "log-shipper"]
    assert spec["containers"][1] == TEMPLATE["spec"]["containers"][1], "a sidecar is added as written"
    assert [c["name"] for c in spec["initContainers"]] == ["make-model", "warmup"]
    # operator pod fields are untouched
    for field in ("restartPolicy", "hostname", "subdomain", "automountServiceAccountToken"):
        assert spec[field] == plain["spec"][field]


def test_the_worker_container_gets_the_container_fields() -> None:
    plain = worker(render.stage_pod(OWNER, spec_of(), "img", 0, 1))
    container = worker(render.stage_pod(OWNER, spec_of(TEMPLATE), "img", 0, 1))
    # env by name: a default (HOME) replaced in place, new variables appended, the rendezvous kept
    names = [e["name"] for e in container["env"]]
    assert names == [*(e["name"] for e in plain["env"]), "HF_HUB_OFFLINE"]
    assert env_of(container) == {**env_of(plain), "HOME": "/home/chariot", "HF_HUB_OFFLINE": "1"}
    assert container["envFrom"] == [{"secretRef": {"name": "tokens"}}]
    # resources by resource name, the template winning; the GPU from spec.resources stays
    assert container["resources"] == {
        "requests": {"cpu": "2", "memory": "16Gi", "nvidia.com/gpu": 1},
        "limits": {"memory": "16Gi", "nvidia.com/gpu": 1, "ephemeral-storage": "20Gi"}}
    assert container["volumeMounts"] == [*plain["volumeMounts"],
                                         {"name": "certs", "mountPath": "/etc/ssl/custom", "readOnly": True}]
    for field in ("image", "command", "args", "ports", "startupProbe", "readinessProbe", "livenessProbe",
                  "securityContext"):
        assert container[field] == plain[field], field


def test_the_router_template_merges_into_the_router_pods_only() -> None:
    router_template = {"metadata": {"labels": {"tier": "edge"}},
                       "spec": {"nodeSelector": {"pool": "cpu"}, "imagePullSecrets": [{"name": "registry"}],
                                "containers": [{"name": "router", "env": [{"name": "LOG_LEVEL", "value": "debug"}],
                                                "resources": {"limits": {"cpu": "2"}}}]}}
    spec = spec_of(router_template=router_template)
    plain = router_pod(spec_of())
    pod = router_pod(spec)
    assert pod["metadata"]["labels"] == {"tier": "edge", **plain["metadata"]["labels"]}
    assert (pod["spec"]["nodeSelector"], pod["spec"]["imagePullSecrets"]) == ({"pool": "cpu"}, [{"name": "registry"}])
    (container,) = pod["spec"]["containers"]
    assert env_of(container) == {**env_of(plain["spec"]["containers"][0]), "LOG_LEVEL": "debug"}
    assert container["resources"]["limits"] == {"memory": "2Gi", "cpu": "2"}
    assert container["args"] == plain["spec"]["containers"][0]["args"]
    # the stage pods do not see the router's template, nor the router the stages'
    assert render.stage_pod(OWNER, spec, "img", 0, 0) == render.stage_pod(OWNER, spec_of(), "img", 0, 0)
    assert router_pod(spec_of(TEMPLATE)) == plain


def test_a_stage_template_change_rolls_the_groups_and_a_router_template_only_the_router() -> None:
    base = render.config_hash(OWNER, spec_of(), "img")
    assert render.config_hash(OWNER, spec_of({"spec": {"nodeSelector": {"pool": "a"}}}), "img") != base
    assert render.config_hash(OWNER, spec_of({"spec": {"nodeSelector": {"pool": "b"}}}), "img") != \
        render.config_hash(OWNER, spec_of({"spec": {"nodeSelector": {"pool": "a"}}}), "img")
    env = {"spec": {"containers": [{"name": "worker", "env": [{"name": "X", "value": "1"}]}]}}
    assert render.config_hash(OWNER, spec_of(env), "img") != base
    router_only = spec_of(router_template={"spec": {"nodeSelector": {"pool": "cpu"}}})
    assert render.config_hash(OWNER, router_only, "img") == base
    assert render.with_applied_hash(render.router_deployment(OWNER, router_only, "img")) != \
        render.with_applied_hash(render.router_deployment(OWNER, spec_of(), "img"))


def test_merged_pods_are_valid_kubernetes_objects() -> None:
    spec = spec_of(TEMPLATE, router_template={"spec": {"tolerations": [{"operator": "Exists"}]}})
    for stage in (0, 1):
        kubernetes_validate.validate(render.stage_pod(OWNER, spec, "img", 0, stage), "1.32", strict=True)
    kubernetes_validate.validate(render.router_deployment(OWNER, spec, "img"), "1.32", strict=True)


def test_the_spec_is_immutable_and_a_merge_does_not_alter_the_template() -> None:
    raw = copy.deepcopy(TEMPLATE)
    spec = spec_of(raw)
    assert raw == TEMPLATE
    pod = render.stage_pod(OWNER, spec, "img", 0, 0)
    worker(pod)["env"].append({"name": "MUTATED"})
    pod["spec"]["volumes"].append({"name": "mutated"})
    assert spec.template.body() == TEMPLATE and render.stage_pod(OWNER, spec, "img", 0, 0) != pod
    assert hash(spec) == hash(spec_of(copy.deepcopy(TEMPLATE)))


# --- operator-owned fields -----------------------------------------------------------------------

def _worker_template(**fields: Any) -> dict[str, Any]:
    return {"spec": {"containers": [{"name": "worker", **fields}]}}


OWNED_ATTEMPTS: list[tuple[dict[str, Any], str]] = [
    (_worker_template(command=["sh", "-c", "sleep inf"]), "spec.template.spec.containers[worker].command"),
    (_worker_template(args=["--policy", "vllm"]), "spec.template.spec.containers[worker].args"),
    (_worker_template(image="evil:latest"), "spec.template.spec.containers[worker].image"),
    (_worker_template(ports=[{"containerPort": 8080}]), "spec.template.spec.containers[worker].ports"),
    (_worker_template(readinessProbe={"exec": {"command": ["true"]}}),
     "spec.template.spec.containers[worker].readinessProbe"),
    (_worker_template(livenessProbe={"exec": {"command": ["true"]}}),
     "spec.template.spec.containers[worker].livenessProbe"),
    (_worker_template(startupProbe={"exec": {"command": ["true"]}}),
     "spec.template.spec.containers[worker].startupProbe"),
    (_worker_template(env=[{"name": "RANK", "value": "7"}]), "spec.template.spec.containers[worker].env[RANK]"),
    (_worker_template(env=[{"name": "MASTER_ADDR", "value": "x"}]),
     "spec.template.spec.containers[worker].env[MASTER_ADDR]"),
    (_worker_template(volumeMounts=[{"name": "scratch", "mountPath": "/tmp"}]),
     "spec.template.spec.containers[worker].volumeMounts[/tmp]"),
    (_worker_template(volumeMounts=[{"name": "w", "mountPath": "/models/tiny"}]),
     "spec.template.spec.containers[worker].volumeMounts[/models/tiny]"),
    (_worker_template(resources={"limits": {"nvidia.com/gpu": 8}}),
     "spec.template.spec.containers[worker].resources.limits.nvidia.com/gpu"),
    ({"spec": {"initContainers": [{"name": "make-model", "command": ["true"]}]}},
     "spec.template.spec.initContainers[make-model].command"),
    ({"metadata": {"labels": {"chariot.dev/group": "9"}}}, "spec.template.metadata.labels.chariot.dev/group"),
    ({"metadata": {"labels": {"app.kubernetes.io/component": "x"}}},
     "spec.template.metadata.labels.app.kubernetes.io/component"),
    ({"metadata": {"annotations": {"chariot.dev/config-hash": "x"}}},
     "spec.template.metadata.annotations.chariot.dev/config-hash"),
    ({"spec": {"restartPolicy": "Always"}}, "spec.template.spec.restartPolicy"),
    ({"spec": {"hostname": "x"}}, "spec.template.spec.hostname"),
    ({"spec": {"volumes": [{"name": "shm", "emptyDir": {}}]}}, "spec.template.spec.volumes[shm]"),
    (_worker_template(env=[{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]),
     "spec.template.spec.containers[worker].env[A]"),
    ({"spec": {"containers": [{"name": "side"}, {"name": "side"}]}}, "spec.template.spec.containers[side]"),
]


@pytest.mark.parametrize(("template", "field"), OWNED_ATTEMPTS)
def test_a_template_setting_an_operator_owned_field_is_rejected_naming_it(template: dict[str, Any],
                                                                          field: str) -> None:
    with pytest.raises(InvalidSpec) as info:
        spec_of(template)
    assert field in [e.path for e in info.value.errors], str(info.value)
    assert str(info.value).startswith(field)


@pytest.mark.parametrize("field", ["command", "readinessProbe", "ports"])
def test_the_router_template_is_held_to_the_same_rule(field: str) -> None:
    with pytest.raises(InvalidSpec, match=rf"^spec\.router\.template\.spec\.containers\[router\]\.{field}: "
                                          "is operator-owned"):
        spec_of(router_template={"spec": {"containers": [{"name": "router", field: []}]}})


def test_sidecars_may_set_what_the_operator_owns_in_its_own_containers() -> None:
    sidecar = {"name": "proxy", "image": "envoy", "command": ["envoy"], "ports": [{"containerPort": 9901}],
               "env": [{"name": "RANK", "value": "x"}], "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}
    pod = render.stage_pod(OWNER, spec_of({"spec": {"containers": [sidecar]}}), "img", 0, 0)
    assert pod["spec"]["containers"][1] == sidecar


def test_an_unvalidated_template_still_cannot_change_operator_owned_fields() -> None:
    """`merge_pod` keeps the operator's values on its own, whatever reaches it."""
    attempt: dict[str, Any] = {
        "metadata": {"labels": {"chariot.dev/group": "9", "app.kubernetes.io/component": "evil"},
                     "annotations": {"chariot.dev/config-hash": "forged"}},
        "spec": {"restartPolicy": "Always", "hostname": "x", "subdomain": "y",
                 "volumes": [{"name": "shm", "hostPath": {"path": "/"}}],
                 "containers": [{"name": "worker", "image": "evil", "command": ["sh"], "args": ["-c", "x"],
                                 "ports": [], "readinessProbe": {}, "livenessProbe": {}, "startupProbe": {},
                                 "env": [{"name": "RANK", "value": "7"}, {"name": "WORLD_SIZE", "value": "9"}],
                                 "volumeMounts": [{"name": "x", "mountPath": "/dev/shm"}],
                                 "resources": {"limits": {"nvidia.com/gpu": 8}, "requests": {"nvidia.com/gpu": 8}}}]},
    }
    base = render.stage_pod(OWNER, spec_of(), "img", 0, 1, "h")
    merged = podtemplate.merge_pod(base, attempt)
    assert merged["metadata"]["labels"] == base["metadata"]["labels"]
    assert merged["metadata"]["annotations"] == base["metadata"]["annotations"]
    for field in ("restartPolicy", "hostname", "subdomain", "volumes"):
        assert merged["spec"][field] == base["spec"][field], field
    assert worker(merged) == worker(base)


# --- schema --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("template", "field"), [
    ({"spec": {"nodeSelector": {"pool": 1}}}, "spec.template.spec.nodeSelector.pool"),
    ({"spec": {"containers": [{"env": []}]}}, "spec.template.spec.containers[0].name"),
    ({"spec": {"containers": [{"name": "worker", "env": [{"value": "1"}]}]}},
     "spec.template.spec.containers[0].env[0].name"),
    ({"spec": {"containers": [{"name": "worker", "resources": {"limits": {"memory": "lots"}}}]}},
     "spec.template.spec.containers[0].resources.limits.memory"),
    ({"spec": {"tolerations": [{"operator": "Maybe"}]}}, "spec.template.spec.tolerations[0].operator"),
    ({"spec": {"imagePullSecrets": ["registry"]}}, "spec.template.spec.imagePullSecrets[0]"),
    ({"spec": {"runtimeClassName": 3}}, "spec.template.spec.runtimeClassName"),
    ({"metadata": {"labels": {"team": True}}}, "spec.template.metadata.labels.team"),
    ({"spec": []}, "spec.template.spec"),
])
def test_the_schema_types_what_the_merge_relies_on(template: Any, field: str) -> None:
    with pytest.raises(InvalidSpec) as info:
        spec_of(template)
    assert field in [e.path for e in info.value.errors], str(info.value)


@pytest.mark.parametrize("uri", ["preset://tiny", "pvc://weights/llama", "/srv/m", "hf://org/model@v1"])
def test_the_owned_tables_cover_what_the_operator_renders(uri: str) -> None:
    """The static tables the validation uses agree with the pods `render.py` makes."""
    model = {"uri": uri, **({"tokenSecret": {"name": "hf"}} if uri.startswith("hf://") else {})}
    spec = spec_of(model=model)
    pods = [render.stage_pod(OWNER, spec, "img", 0, s, "h") for s in (0, 1)] + [router_pod(spec)]
    for pod in pods:
        meta = pod["metadata"]
        keys = [*meta["labels"], *meta.get("annotations", {})]
        assert all(k in podtemplate.OWNED_LABELS | podtemplate.OWNED_ANNOTATIONS
                   or k.startswith(podtemplate.OWNED_KEY_PREFIX) for k in keys), keys
        assert {v["name"] for v in pod["spec"]["volumes"]} <= podtemplate.OWNED_VOLUMES
        for container in [*pod["spec"]["containers"], *pod["spec"]["initContainers"]]:
            assert container["name"] in (podtemplate.WORKER, podtemplate.ROUTER, podtemplate.MAKE_MODEL)
            assert all(podtemplate.owned_mount_path(m["mountPath"]) for m in container["volumeMounts"])
            rendezvous = {e["name"] for e in container["env"]} - {"HOME", "PYTHONUNBUFFERED", "HF_TOKEN"}
            assert rendezvous <= podtemplate.RENDEZVOUS_ENV
