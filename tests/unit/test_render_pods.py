"""What each rendered pod fetches and how a stage pod is set up for its devices, from the spec.

Router pods read the tokenizer only, so their init container makes or fetches no weights; each stage
pod's init container fetches its own stage (`--stage S --stages P`: which shards that selects is
tests/unit/test_fetch_plan.py, the download itself tests/integration/test_fetch_model.py). Stage pods
get `/dev/shm` as a memory emptyDir limited by `spec.resources.shmSize`, `spec.runtimeClassName`, and
the CPU-kernel cache volume of `spec.kernelCache` with `CHARIOT_KERNEL_CACHE` pointing at it (and
`CHARIOT_KERNEL_BUILD=native`, so this CPU's builds are made into it); bad values are refused naming
the field.
"""

from __future__ import annotations

from typing import Any

import kopf
import kubernetes_validate
import pytest

from chariot.contracts import environment
from chariot.operator import render
from chariot.operator.controller import Outcome
from chariot.operator.handlers import raise_for
from chariot.operator.podtemplate import KERNEL_CACHE_DIR
from chariot.operator.render import Owner
from chariot.operator.spec import InvalidSpec, Spec, parse_spec

OWNER = Owner(name="llama", namespace="prod", uid="0000-1111")


def spec_of(uri: str = "pvc://models/llama-3", pipeline: int = 2, **extra: Any) -> Spec:
    return parse_spec({"model": {"uri": uri}, "parallelism": {"pipeline": pipeline}, **extra}, OWNER.name)


def stage(spec: Spec, s: int = 0) -> dict[str, Any]:
    return render.stage_pod(OWNER, spec, "img", 0, s)["spec"]


def router(spec: Spec) -> dict[str, Any]:
    return dict(render.router_deployment(OWNER, spec, "img")["spec"]["template"]["spec"])


def volume(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (v,) = [v for v in pod["volumes"] if v["name"] == name]
    return dict(v)


def env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container["env"]}


# --- what each pod fetches -----------------------------------------------------------------------

@pytest.mark.parametrize("model", [{"uri": "hf://meta-llama/Llama-3.1-8B"},
                                   {"uri": "hf://org/m@v1", "cacheClaim": "hf-cache"}])
def test_router_pods_fetch_the_tokenizer_and_config_but_no_weights(model: dict[str, Any]) -> None:
    spec = spec_of(model=model)
    (init,) = router(spec)["initContainers"]
    assert init["command"][:2] == ["chariot", "fetch-model"] and init["command"][-1] == "--no-weights"
    assert "--stage" not in init["command"]
    for s in range(2):
        (stage_init,) = stage(spec, s)["initContainers"]
        assert stage_init["command"][-4:] == ["--stage", str(s), "--stages", "2"]
        assert "--no-weights" not in stage_init["command"]


def test_a_shared_cache_claim_is_the_model_volume_of_stages_and_routers_alike() -> None:
    spec = spec_of(model={"uri": "hf://org/m", "cacheClaim": "hf-cache"})
    for pod in (stage(spec, 0), stage(spec, 1), router(spec)):
        assert volume(pod, "model") == {"name": "model", "persistentVolumeClaim": {"claimName": "hf-cache"}}
        (init,) = pod["initContainers"]
        assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]
        assert init["command"][3] == "/models/hf/org/m"


def test_preset_routers_make_the_tokenizer_only_and_stages_the_whole_preset() -> None:
    spec = spec_of("preset://tiny")
    (init,) = router(spec)["initContainers"]
    assert init["command"] == ["chariot", "make-model", "/models/tiny", "--preset", "tiny", "--no-weights"]
    for s in range(2):
        (stage_init,) = stage(spec, s)["initContainers"]
        assert stage_init["command"] == ["chariot", "make-model", "/models/tiny", "--preset", "tiny"]


@pytest.mark.parametrize("uri", ["pvc://models/llama-3", "/opt/model"])
def test_models_already_on_a_volume_or_in_the_image_are_fetched_by_no_pod(uri: str) -> None:
    spec = spec_of(uri)
    assert router(spec)["initContainers"] == [] and stage(spec)["initContainers"] == []


# --- /dev/shm, runtimeClassName ------------------------------------------------------------------

def test_dev_shm_is_a_memory_emptydir_limited_by_the_spec() -> None:
    assert volume(stage(spec_of()), "shm") == {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}
    for size in ("4Gi", 2147483648):
        pod = stage(spec_of(resources={"shmSize": size}))
        assert volume(pod, "shm")["emptyDir"] == {"medium": "Memory", "sizeLimit": str(size)}
        (worker,) = pod["containers"]
        assert {"name": "shm", "mountPath": "/dev/shm"} in worker["volumeMounts"]
    assert volume(router(spec_of()), "shm")["emptyDir"] == {"medium": "Memory"}  # no NCCL in routers


def test_runtime_class_name_reaches_the_stage_pods_only_when_set() -> None:
    assert "runtimeClassName" not in stage(spec_of())
    spec = spec_of(runtimeClassName="nvidia")
    assert [stage(spec, s)["runtimeClassName"] for s in range(2)] == ["nvidia", "nvidia"]
    assert "runtimeClassName" not in router(spec)
    same = spec_of(runtimeClassName="nvidia", template={"spec": {"runtimeClassName": "nvidia"}})
    assert stage(same)["runtimeClassName"] == "nvidia"
    templated = spec_of(template={"spec": {"runtimeClassName": "nvidia-cdi"}})  # the template alone still works
    assert stage(templated)["runtimeClassName"] == "nvidia-cdi"


def test_the_new_fields_change_the_config_hash_so_groups_roll() -> None:
    base = render.config_hash(OWNER, spec_of(), "img")
    assert render.config_hash(OWNER, spec_of(resources={"shmSize": "2Gi"}), "img") != base
    assert render.config_hash(OWNER, spec_of(runtimeClassName="nvidia"), "img") != base
    assert render.config_hash(OWNER, spec_of(kernelCache={"claimName": "k"}), "img") != base


# --- the CPU-kernel cache ------------------------------------------------------------------------

@pytest.mark.parametrize(("cache", "source"), [
    ({"claimName": "kernels"}, {"persistentVolumeClaim": {"claimName": "kernels"}}),
    ({"hostPath": "/var/lib/chariot/kernels"}, {"hostPath": {"path": "/var/lib/chariot/kernels",
                                                             "type": "DirectoryOrCreate"}}),
])
def test_the_kernel_cache_volume_is_mounted_with_the_env_var_pointing_at_it(cache: dict[str, str],
                                                                             source: dict[str, Any]) -> None:
    for s in range(2):
        pod = stage(spec_of(kernelCache=cache), s)
        assert volume(pod, "kernel-cache") == {"name": "kernel-cache", **source}
        (worker,) = pod["containers"]
        assert {"name": "kernel-cache", "mountPath": KERNEL_CACHE_DIR} in worker["volumeMounts"]
        assert env(worker)[environment.KERNEL_CACHE.name] == KERNEL_CACHE_DIR == "/var/cache/chariot/kernels"
        assert env(worker)[environment.KERNEL_BUILD.name] == "native"  # fills the volume with this CPU's builds
    assert (environment.KERNEL_CACHE.name, environment.KERNEL_BUILD.name) == ("CHARIOT_KERNEL_CACHE",
                                                                             "CHARIOT_KERNEL_BUILD")
    assert "native" in environment.KERNEL_BUILD.choices
    assert all(v["name"] != "kernel-cache" for v in router(spec_of(kernelCache=cache))["volumes"])


def test_without_a_kernel_cache_the_worker_keeps_the_default_under_home() -> None:
    pod = stage(spec_of())
    (worker,) = pod["containers"]
    assert environment.KERNEL_CACHE.name not in env(worker) and env(worker)["HOME"] == "/tmp"
    assert environment.KERNEL_BUILD.name not in env(worker)  # `auto`: the image's baseline, else a compile
    assert all(v["name"] != "kernel-cache" for v in pod["volumes"])


# --- bad values ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("extra", "field", "text"), [
    ({"resources": {"shmSize": "plenty"}}, "spec.resources.shmSize", "does not match"),
    ({"resources": {"shmSize": "0"}}, "spec.resources.shmSize", "must be a positive size"),
    ({"resources": {"shmSize": 0}}, "spec.resources.shmSize", "must be a positive size"),
    ({"runtimeClassName": "NVIDIA runtime"}, "spec.runtimeClassName", "does not match"),
    ({"runtimeClassName": "nvidia", "template": {"spec": {"runtimeClassName": "kata"}}},
     "spec.template.spec.runtimeClassName", "set one of them"),
    ({"kernelCache": {}}, "spec.kernelCache", "exactly 1 of claimName, hostPath, got 0"),
    ({"kernelCache": {"claimName": "k", "hostPath": "/k"}}, "spec.kernelCache", "exactly 1 of claimName, hostPath"),
    ({"kernelCache": {"claimName": "Kernels_Cache"}}, "spec.kernelCache.claimName", "does not match"),
    ({"kernelCache": {"hostPath": "var/cache"}}, "spec.kernelCache.hostPath", "does not match"),
    ({"kernelCache": {"hostPath": "/var/../etc"}}, "spec.kernelCache.hostPath", r"must not contain '\.\.'"),
    ({"template": {"spec": {"volumes": [{"name": "kernel-cache", "emptyDir": {}}]}}},
     r"spec.template.spec.volumes\[kernel-cache\]", "operator-owned"),
    ({"template": {"spec": {"containers": [{"name": "worker", "volumeMounts": [
        {"name": "x", "mountPath": "/var/cache/chariot/kernels"}]}]}}},
     r"spec.template.spec.containers\[worker\].volumeMounts", "operator-owned"),
])
def test_bad_pod_settings_are_refused_naming_the_field(extra: dict[str, Any], field: str, text: str) -> None:
    with pytest.raises(InvalidSpec, match=f"{field}.*{text}") as caught:
        spec_of(**extra)
    with pytest.raises(kopf.PermanentError, match=field):  # what the handler makes of it: no retries
        raise_for(Outcome(False, str(caught.value), invalid=caught.value))


@pytest.mark.parametrize("extra", [
    {"model": {"uri": "hf://org/m@v1", "cacheClaim": "cache"}, "runtimeClassName": "nvidia",
     "resources": {"shmSize": "2Gi"}, "kernelCache": {"claimName": "kernels"}},
    {"model": {"uri": "preset://tiny"}, "kernelCache": {"hostPath": "/var/cache/chariot"},
     "resources": {"gpusPerStage": 0, "shmSize": "256Mi"}},
])
def test_pods_with_the_new_fields_are_valid_kubernetes_1_32_objects(extra: dict[str, Any]) -> None:
    spec = parse_spec({"parallelism": {"pipeline": 2}, **extra}, OWNER.name)
    for obj in [*render.group_pods(OWNER, spec, "img", 0, "h"), *render.shared_objects(OWNER, spec, "img", "h", [0])]:
        kubernetes_validate.validate(obj, "1.32", strict=True)


# --- the router's Secrets: API keys and TLS ------------------------------------------------------

def test_router_secrets_are_mounted_whole_and_passed_as_flags() -> None:
    spec = spec_of(router={"auth": {"secretName": "llama-keys"}, "tls": {"secretName": "llama-tls"}})
    pod = router(spec)
    (container,) = pod["containers"]
    args = container["args"]
    assert args[args.index("--api-keys") + 1] == "/etc/chariot-auth/keys.yaml"
    assert args[args.index("--tls-cert") + 1] == "/etc/chariot-tls/tls.crt"
    assert args[args.index("--tls-key") + 1] == "/etc/chariot-tls/tls.key"
    assert volume(pod, "api-keys") == {"name": "api-keys", "secret": {"secretName": "llama-keys", "defaultMode": 0o440}}
    assert volume(pod, "tls")["secret"]["secretName"] == "llama-tls"
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    for path in ("/etc/chariot-auth", "/etc/chariot-tls"):
        assert mounts[path]["readOnly"] and "subPath" not in mounts[path]  # a subPath would never update
    # The probes and Prometheus speak TLS to a TLS router; the status endpoint is https.
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert container["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    template = render.router_deployment(OWNER, spec, "img")["spec"]["template"]
    assert template["metadata"]["annotations"]["prometheus.io/scheme"] == "https"
    assert render.endpoint(OWNER, spec).startswith("https://")
    kubernetes_validate.validate(render.router_deployment(OWNER, spec, "img"), "1.32", strict=True)


def test_a_custom_key_name_and_no_secrets() -> None:
    spec = spec_of(router={"auth": {"secretName": "keys", "key": "tenants.yaml"}})
    args = router(spec)["containers"][0]["args"]
    assert args[args.index("--api-keys") + 1] == "/etc/chariot-auth/tenants.yaml" and "--tls-cert" not in args
    plain = router(spec_of())
    assert not {"--api-keys", "--tls-cert"} & set(plain["containers"][0]["args"])
    assert plain["containers"][0]["readinessProbe"]["httpGet"]["scheme"] == "HTTP"
    assert not [v for v in plain["volumes"] if v["name"] in ("api-keys", "tls")]


@pytest.mark.parametrize(("router_spec", "field"), [
    ({"auth": {}}, "spec.router.auth.secretName"),
    ({"auth": {"secretName": "Not_A_Name"}}, "spec.router.auth.secretName"),
    ({"tls": {"secretName": ""}}, "spec.router.tls.secretName"),
    ({"auth": {"secretName": "k", "key": "../x y"}}, "spec.router.auth.key"),
])
def test_bad_router_secrets_are_refused_naming_the_field(router_spec: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSpec) as info:
        spec_of(router=router_spec)
    assert field in [e.path for e in info.value.errors], str(info.value)
