"""Pure functions from a ModelDeployment to the Kubernetes objects that serve it (docs/architecture.md §6).

Why pure: every manifest the operator writes is decided here, from the owner's identity and a
validated `Spec`, with no API calls, clocks or randomness — so unit tests check the objects for any
spec directly, a re-run renders byte-identical objects (idempotent reconciles), and a hash of the
rendered pods tells exactly when a group runs an outdated configuration (rolling updates).

The process contract these manifests follow is docs/cli-contract.md.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from chariot.contracts import environment
from chariot.operator import crd
from chariot.operator.podtemplate import (
    AUTH_DIR,
    AUTH_VOLUME,
    KERNEL_CACHE_DIR,
    KERNEL_CACHE_VOLUME,
    MAKE_MODEL,
    MODELS_DIR,
    ROUTER,
    TLS_DIR,
    TLS_VOLUME,
    WORKER,
    merge_pod,
)
from chariot.operator.spec import Spec

Manifest = dict[str, Any]

LABEL_DEPLOYMENT = "chariot.dev/deployment"
LABEL_GROUP = "chariot.dev/group"
LABEL_STAGE = "chariot.dev/stage"
LABEL_COMPONENT = "app.kubernetes.io/component"
ANNOTATION_CONFIG_HASH = "chariot.dev/config-hash"
ANNOTATION_APPLIED_HASH = "chariot.dev/applied-hash"

GRPC_PORT = 50061
METRICS_PORT = 9400
RENDEZVOUS_PORT = 29500
ROUTER_HTTP_PORT = 8000
ROUTER_GRPC_PORT = 50051
CONFIG_DIR = "/etc/chariot"
REPLICA_FILE = f"{CONFIG_DIR}/replicas.json"
# Secrets the router reads, mounted whole (never with subPath, which would freeze them): the kubelet
# swaps a mounted Secret atomically, and the router reloads the files when they change.
TLS_CERT, TLS_KEY = "tls.crt", "tls.key"  # kubernetes.io/tls Secrets, as cert-manager writes them
SECRET_MODE = 0o440  # readable by the pod's fsGroup (the router's group) only
RUN_AS = 10001  # the image's non-root user (Dockerfile)
ROUTER_RESOURCES = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}


@dataclass(frozen=True)
class Owner:
    """Identity of the ModelDeployment that owns every rendered object."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: Manifest) -> Owner:
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta.get("namespace") or "default", uid=meta.get("uid", ""))


# --- names ---------------------------------------------------------------------------------------

def pod_name(owner: Owner, group: int, stage: int) -> str:
    return f"{owner.name}-g{group}-s{stage}"


def stages_service_name(owner: Owner) -> str:
    return f"{owner.name}-stages"


def router_name(owner: Owner) -> str:
    return f"{owner.name}-router"


def config_map_name(owner: Owner) -> str:
    return f"{owner.name}-config"


def stage_host(owner: Owner, group: int, stage: int) -> str:
    """DNS name of a stage pod through the headless Service (`hostname` + `subdomain`)."""
    return f"{pod_name(owner, group, stage)}.{stages_service_name(owner)}.{owner.namespace}.svc"


def group_address(owner: Owner, group: int) -> str:
    """Where the router reaches a group: stage 0's gRPC server."""
    return f"{stage_host(owner, group, 0)}:{GRPC_PORT}"


def endpoint(owner: Owner, spec: Spec | None = None) -> str:
    """The router Service's HTTP URL (https when `spec.router.tls` is set)."""
    scheme = "https" if spec is not None and spec.router.tls_secret is not None else "http"
    return f"{scheme}://{router_name(owner)}.{owner.namespace}.svc:{ROUTER_HTTP_PORT}"


def served_model_name(owner: Owner, spec: Spec) -> str:
    return spec.model.name or owner.name


# --- metadata ------------------------------------------------------------------------------------

def labels(owner: Owner, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "chariot",
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/part-of": "chariot",
        "app.kubernetes.io/managed-by": "chariot-operator",
        LABEL_COMPONENT: component,
        LABEL_DEPLOYMENT: owner.name,
    }


def owner_references(owner: Owner) -> list[Manifest]:
    return [{"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": owner.name, "uid": owner.uid,
             "controller": True, "blockOwnerDeletion": True}]


def metadata(owner: Owner, name: str, component: str, **extra_labels: str) -> Manifest:
    return {"name": name, "namespace": owner.namespace, "labels": {**labels(owner, component), **extra_labels},
            "ownerReferences": owner_references(owner)}


def group_selector(owner: Owner, group: int | None = None) -> str:
    """Label selector of the stage pods (of one group when `group` is given)."""
    sel = f"{LABEL_DEPLOYMENT}={owner.name},{LABEL_COMPONENT}=worker"
    return sel if group is None else f"{sel},{LABEL_GROUP}={group}"


def scale_selector(owner: Owner) -> str:
    """One pod per replica (stage 0), for the scale subresource's `labelSelectorPath`."""
    return f"{LABEL_DEPLOYMENT}={owner.name},{LABEL_COMPONENT}=worker,{LABEL_STAGE}=0"


# --- model volume --------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSource:
    """How a pod gets the model directory: its path in the container plus volumes / an init container."""

    path: str
    volumes: tuple[Manifest, ...] = ()
    mounts: tuple[Manifest, ...] = ()
    preset: str | None = None
    fetch: str | None = None  # an hf:// URI the init container downloads into `path`


def model_source(spec: Spec) -> ModelSource:
    uri = spec.model.uri
    if uri.startswith("preset://"):
        preset = uri.removeprefix("preset://")
        return ModelSource(path=f"{MODELS_DIR}/{preset}", volumes=({"name": "model", "emptyDir": {}},),
                           mounts=({"name": "model", "mountPath": MODELS_DIR},), preset=preset)
    if uri.startswith("hf://"):
        repo = uri.removeprefix("hf://").partition("@")[0]
        claim = spec.model.cache_claim
        volume = ({"name": "model", "persistentVolumeClaim": {"claimName": claim}} if claim
                  else {"name": "model", "emptyDir": {}})
        return ModelSource(path=f"{MODELS_DIR}/hf/{repo}", volumes=(volume,),
                           mounts=({"name": "model", "mountPath": MODELS_DIR},), fetch=uri)
    if uri.startswith("pvc://"):
        claim, _, sub = uri.removeprefix("pvc://").partition("/")
        path = f"{MODELS_DIR}/{claim}" + (f"/{sub.strip('/')}" if sub.strip("/") else "")
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        return ModelSource(path=path, volumes=(volume,),
                           mounts=({"name": "model", "mountPath": f"{MODELS_DIR}/{claim}", "readOnly": True},))
    return ModelSource(path=uri.removeprefix("file://"))


def make_model_container(spec: Spec, image: str, source: ModelSource, stage: int | None = None) -> list[Manifest]:
    """An init container that puts what the pod reads of the model in place: for a stage pod (`stage`
    given) the config, tokenizer and that stage's weights; for a router pod (`stage` None) the config
    and tokenizer only. `chariot make-model` writes a `preset://` model into the pod's emptyDir (same
    seed → same weights and tokenizer in every pod, so all stages and the router agree; routers get
    no weights); `chariot fetch-model` downloads an `hf://` model into the model volume (an emptyDir,
    or the cache claim, where files already fetched are not fetched again) — for a stage only the
    safetensors shards holding its layers (`--stage S --stages P`, split as the worker splits them),
    for a router no weights — with `HF_TOKEN` from `spec.model.tokenSecret`."""
    env = base_env()
    no_weights = ["--no-weights"] if stage is None else []
    if source.preset is not None:
        command = ["chariot", "make-model", source.path, "--preset", source.preset, *no_weights]
    elif source.fetch is not None:
        part = no_weights if stage is None else ["--stage", str(stage), "--stages", str(spec.pipeline)]
        command = ["chariot", "fetch-model", source.fetch, source.path, *part]
        secret = spec.model.token_secret
        if secret is not None:
            env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret[0], "key": secret[1]}}})
    else:
        return []
    return [{"name": MAKE_MODEL, "image": image, "imagePullPolicy": "IfNotPresent", "command": command,
             "env": env, "volumeMounts": [*source.mounts, *scratch_mounts()],
             "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
             "securityContext": container_security()}]


# --- shared pod pieces ---------------------------------------------------------------------------

def pod_security() -> Manifest:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security() -> Manifest:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def base_env() -> list[Manifest]:
    return [{"name": "HOME", "value": "/tmp"}, {"name": "PYTHONUNBUFFERED", "value": "1"}]


def scratch_volumes(shm_size: str | None = None) -> list[Manifest]:
    """/tmp for caches (the root filesystem is read-only) and a RAM-backed /dev/shm for torch.distributed
    and NCCL, limited to `shm_size` (stage pods: `spec.resources.shmSize`; its pages count against the
    pod's memory)."""
    shm: Manifest = {"medium": "Memory"}
    if shm_size is not None:
        shm["sizeLimit"] = shm_size
    return [{"name": "tmp", "emptyDir": {}}, {"name": "shm", "emptyDir": shm}]


def scratch_mounts() -> list[Manifest]:
    return [{"name": "tmp", "mountPath": "/tmp"}, {"name": "shm", "mountPath": "/dev/shm"}]


def kernel_cache_volumes(spec: Spec) -> list[Manifest]:
    """`spec.kernelCache`: the volume the C++ CPU kernel builds are cached on, across pod restarts."""
    cache = spec.kernel_cache
    if cache is None:
        return []
    if cache.claim_name is not None:
        return [{"name": KERNEL_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": cache.claim_name}}]
    return [{"name": KERNEL_CACHE_VOLUME, "hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"}}]


def kernel_cache_mounts(spec: Spec) -> list[Manifest]:
    return [{"name": KERNEL_CACHE_VOLUME, "mountPath": KERNEL_CACHE_DIR}] if spec.kernel_cache else []


def kernel_cache_env(spec: Spec) -> list[Manifest]:
    """With `spec.kernelCache`: `CHARIOT_KERNEL_CACHE` pointing at its volume, and `CHARIOT_KERNEL_BUILD=native`,
    so the first start on a node (per CPU model) compiles this CPU's builds into it and every later
    start there loads them — under the default `auto` a worker whose image carries the portable
    baseline build would load that and never fill the volume (docs/kernels.md). Without a cache the
    builds go under `HOME=/tmp`, an emptyDir that goes with the pod, and `auto` applies."""
    if spec.kernel_cache is None:
        return []
    return [{"name": environment.KERNEL_CACHE.name, "value": KERNEL_CACHE_DIR},
            {"name": environment.KERNEL_BUILD.name, "value": "native"}]


# --- stage pods ----------------------------------------------------------------------------------

def engine_args(spec: Spec, source: ModelSource) -> list[str]:
    """`chariot worker` flags shared by every stage of a group (docs/cli-contract.md)."""
    s = spec.scheduler
    args = ["--model", source.path, "--policy", s.policy, "--max-batch-size", str(s.max_batch_size),
            "--prefill-order", s.prefill_order,
            "--dtype", spec.model.dtype, "--stages", str(spec.pipeline),
            "--device", "cuda" if spec.resources.gpus_per_stage > 0 else "cpu"]
    # The TBT SLO always goes to the router (admission). Workers get an explicit budget, or derive it
    # from the SLO with a `chariot tune` profile (validated: only with tbtMs and without tokenBudget),
    # or keep the policy's default.
    if s.block_size is not None:  # unset: the worker picks its device's default
        args += ["--block-size", str(s.block_size)]
    if s.token_budget is not None:
        args += ["--token-budget", str(s.token_budget)]
    elif s.tune_profile is not None and spec.tbt_slo_ms is not None:
        args += ["--tbt-slo-ms", f"{spec.tbt_slo_ms:g}", "--tune-profile", s.tune_profile]
    if spec.model.max_model_len is not None:
        args += ["--max-model-len", str(spec.model.max_model_len)]
    if spec.tensor > 1:
        args += ["--tensor-parallel-size", str(spec.tensor)]  # the pod starts its stage's T ranks
    if spec.pipeline > 1 or spec.tensor > 1:
        args += ["--rendezvous-timeout", str(spec.rendezvous_timeout_s)]
    return args


def worker_args(owner: Owner, spec: Spec, source: ModelSource) -> list[str]:
    args = [*engine_args(spec, source), "--host", "0.0.0.0", "--port", str(GRPC_PORT),
            "--metrics-host", "0.0.0.0", "--metrics-port", str(METRICS_PORT),
            "--served-model-name", served_model_name(owner, spec)]
    if spec.otlp_endpoint:
        args += ["--otlp-endpoint", spec.otlp_endpoint]
    return args


def rendezvous_env(owner: Owner, spec: Spec, group: int, stage: int) -> list[Manifest]:
    """torch.distributed rendezvous: rank = stage, world = pipeline length, master = the group's stage 0."""
    return [{"name": "RANK", "value": str(stage)}, {"name": "WORLD_SIZE", "value": str(spec.pipeline)},
            {"name": "MASTER_ADDR", "value": stage_host(owner, group, 0)},
            {"name": "MASTER_PORT", "value": str(RENDEZVOUS_PORT)}]


def stage_resources(spec: Spec) -> Manifest:
    """A stage pod runs its `parallelism.tensor` ranks, each with `gpusPerStage` GPUs (0: CPU)."""
    r = spec.resources
    requests: dict[str, Any] = {"cpu": r.cpu, "memory": r.memory}
    limits: dict[str, Any] = {"memory": r.memory}
    if r.gpus_per_stage > 0:
        requests["nvidia.com/gpu"] = r.gpus_per_stage * spec.tensor
        limits["nvidia.com/gpu"] = r.gpus_per_stage * spec.tensor
    return {"requests": requests, "limits": limits}


def stage_probes(stage: int) -> Manifest:
    """Stage 0 is ready when its gRPC health says SERVING (model loaded, pipeline joined); the other
    stages serve no gRPC, so their /metrics endpoint shows the process is up. A startup probe gives
    model loading up to 20 minutes before liveness counts."""
    check: Manifest = ({"grpc": {"port": GRPC_PORT}} if stage == 0
                       else {"httpGet": {"path": "/metrics", "port": METRICS_PORT}})
    alive: Manifest = ({"grpc": {"port": GRPC_PORT}} if stage == 0 else {"tcpSocket": {"port": METRICS_PORT}})
    return {
        "startupProbe": {**check, "periodSeconds": 5, "failureThreshold": 240},
        "readinessProbe": {**check, "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3},
        "livenessProbe": {**alive, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
    }


def stage_ports(stage: int) -> list[Manifest]:
    ports = [{"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}]
    if stage == 0:
        ports = [{"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
                 {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"}, *ports]
    return ports


def stage_container(owner: Owner, spec: Spec, image: str, group: int, stage: int) -> Manifest:
    source = model_source(spec)
    return {
        "name": WORKER, "image": image, "imagePullPolicy": "IfNotPresent",
        "command": ["chariot", "worker"], "args": worker_args(owner, spec, source),
        "env": [*rendezvous_env(owner, spec, group, stage), *base_env(), *kernel_cache_env(spec)],
        "ports": stage_ports(stage), "resources": stage_resources(spec), **stage_probes(stage),
        "securityContext": container_security(),
        "volumeMounts": [*source.mounts, *scratch_mounts(), *kernel_cache_mounts(spec)],
        # A worker that exits with an error (a failed warm-up, a bad checkpoint) leaves its last log
        # lines as the termination message; the operator quotes it in status.groups[].lastFailure.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def stage_pod(owner: Owner, spec: Spec, image: str, group: int, stage: int, config_hash: str = "") -> Manifest:
    """The pod of stage `stage` in group `group`, with `spec.template` merged in (operator-owned fields
    kept): never restarted in place (the group restarts as one)."""
    source = model_source(spec)
    name = pod_name(owner, group, stage)
    meta = metadata(owner, name, "worker", **{LABEL_GROUP: str(group), LABEL_STAGE: str(stage)})
    meta["annotations"] = {ANNOTATION_CONFIG_HASH: config_hash, "prometheus.io/scrape": "true",
                           "prometheus.io/port": str(METRICS_PORT), "prometheus.io/path": "/metrics"}
    pod_spec: Manifest = {
        "restartPolicy": "Never", "hostname": name, "subdomain": stages_service_name(owner),
        "automountServiceAccountToken": False, "enableServiceLinks": False, "terminationGracePeriodSeconds": 30,
        "securityContext": pod_security(),
        "initContainers": make_model_container(spec, image, source, stage),
        "containers": [stage_container(owner, spec, image, group, stage)],
        "volumes": [*source.volumes, *scratch_volumes(spec.resources.shm_size), *kernel_cache_volumes(spec)],
    }
    if spec.resources.gpus_per_stage > 0:
        pod_spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    if spec.runtime_class_name is not None:
        pod_spec["runtimeClassName"] = spec.runtime_class_name
    return merge_pod({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}, spec.template.body())


def group_pods(owner: Owner, spec: Spec, image: str, group: int, config_hash: str) -> list[Manifest]:
    return [stage_pod(owner, spec, image, group, s, config_hash) for s in range(spec.pipeline)]


def config_hash(owner: Owner, spec: Spec, image: str) -> str:
    """Hash of everything a group's pods run (group 0 as the reference, `spec.template` included); a group
    whose pods carry another hash is outdated and gets rolled. Replica counts and router settings (its
    template too) do not enter it: the router Deployment rolls its own pods."""
    pods = [stage_pod(owner, spec, image, 0, s) for s in range(spec.pipeline)]
    return _hash(pods)


def _hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# --- services, router, config --------------------------------------------------------------------

def stages_service(owner: Owner) -> Manifest:
    """Headless Service giving each stage pod a DNS name; not-ready pods are published because stage 0
    only becomes ready after the rendezvous that needs its name."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": metadata(owner, stages_service_name(owner), "worker"),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {LABEL_DEPLOYMENT: owner.name, LABEL_COMPONENT: "worker"},
                     "ports": [{"name": "grpc", "port": GRPC_PORT, "targetPort": GRPC_PORT},
                               {"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT},
                               {"name": "metrics", "port": METRICS_PORT, "targetPort": METRICS_PORT}]}}


def router_args(owner: Owner, spec: Spec, source: ModelSource) -> list[str]:
    args = ["--host", "0.0.0.0", "--http-port", str(ROUTER_HTTP_PORT), "--grpc-port", str(ROUTER_GRPC_PORT),
            "--replica-file", REPLICA_FILE, "--model", source.path,
            "--served-model-name", served_model_name(owner, spec)]
    optional = {"--ttft-slo-ms": spec.ttft_slo_ms, "--tbt-slo-ms": spec.tbt_slo_ms,
                "--redis-url": spec.router.redis_url, "--otlp-endpoint": spec.otlp_endpoint}
    for flag, value in optional.items():
        if value is not None:
            args += [flag, _num(value) if isinstance(value, float | int) else value]
    if spec.router.redis_url is not None:
        args += ["--redis-key-prefix", redis_key_prefix(owner)]
    if spec.autoscaling is not None and spec.hold_queue > 0:  # scale from zero: hold until a group is ready
        args += ["--hold-queue", str(spec.hold_queue), "--hold-timeout-seconds", _num(spec.hold_timeout_s)]
    return args + router_secret_args(spec)


def replica_name(group: int) -> str:
    """Group g's name in the routers' replica list (and in their offered-load snapshots)."""
    return f"g{group}"


def redis_key_prefix(owner: Owner) -> str:
    """The prefix of one deployment's keys in Redis (router state, offered load): deployments sharing a
    Redis must not share rate-limit buckets, replica counts (every deployment has a `g0`) or load."""
    return f"chariot:{owner.namespace}:{owner.name}"


def router_secret_args(spec: Spec) -> list[str]:
    """`--api-keys` and `--tls-cert`/`--tls-key` at the mounted Secrets' paths (`router_secret_volumes`)."""
    args: list[str] = []
    if spec.router.auth_secret is not None:
        args += ["--api-keys", f"{AUTH_DIR}/{spec.router.auth_secret[1]}"]
    if spec.router.tls_secret is not None:
        args += ["--tls-cert", f"{TLS_DIR}/{TLS_CERT}", "--tls-key", f"{TLS_DIR}/{TLS_KEY}"]
    return args


def router_secret_volumes(spec: Spec) -> tuple[list[Manifest], list[Manifest]]:
    """(volumes, mounts) of `spec.router.auth` and `spec.router.tls`: each Secret mounted whole, read-only."""
    volumes: list[Manifest] = []
    mounts: list[Manifest] = []
    secrets = ((AUTH_VOLUME, spec.router.auth_secret[0] if spec.router.auth_secret else None, AUTH_DIR),
               (TLS_VOLUME, spec.router.tls_secret, TLS_DIR))
    for name, secret, path in secrets:
        if secret is not None:
            volumes.append({"name": name, "secret": {"secretName": secret, "defaultMode": SECRET_MODE}})
            mounts.append({"name": name, "mountPath": path, "readOnly": True})
    return volumes, mounts


def router_scheme(spec: Spec) -> str:
    """HTTPS when the router serves TLS (probes and scrapes must then speak it), else HTTP."""
    return "HTTPS" if spec.router.tls_secret is not None else "HTTP"


def router_pod_spec(owner: Owner, spec: Spec, image: str) -> Manifest:
    source = model_source(spec)
    scheme = router_scheme(spec)
    secret_volumes, secret_mounts = router_secret_volumes(spec)
    ready = {"httpGet": {"path": "/health", "port": ROUTER_HTTP_PORT, "scheme": scheme}}  # backends, or holding
    alive = {"httpGet": {"path": "/health/live", "port": ROUTER_HTTP_PORT, "scheme": scheme}}  # the process serves
    container = {
        "name": ROUTER, "image": image, "imagePullPolicy": "IfNotPresent",
        "command": ["chariot", "router"], "args": router_args(owner, spec, source), "env": base_env(),
        "ports": [{"name": "http", "containerPort": ROUTER_HTTP_PORT, "protocol": "TCP"},
                  {"name": "grpc", "containerPort": ROUTER_GRPC_PORT, "protocol": "TCP"}],
        "resources": ROUTER_RESOURCES,
        "readinessProbe": {**ready, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**alive, "periodSeconds": 10, "failureThreshold": 6, "initialDelaySeconds": 30},
        "securityContext": container_security(),
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}, *source.mounts,
                         *scratch_mounts(), *secret_mounts],
    }
    return {"automountServiceAccountToken": False, "enableServiceLinks": False, "securityContext": pod_security(),
            "initContainers": make_model_container(spec, image, source), "containers": [container],
            "volumes": [{"name": "config", "configMap": {"name": config_map_name(owner)}}, *source.volumes,
                        *scratch_volumes(), *secret_volumes]}


def router_deployment(owner: Owner, spec: Spec, image: str) -> Manifest:
    selector = {LABEL_DEPLOYMENT: owner.name, LABEL_COMPONENT: "router"}
    template_meta = {"labels": labels(owner, "router"),
                     "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(ROUTER_HTTP_PORT),
                                     "prometheus.io/path": "/metrics",
                                     "prometheus.io/scheme": router_scheme(spec).lower()}}
    template = merge_pod({"metadata": template_meta, "spec": router_pod_spec(owner, spec, image)},
                         spec.router.template.body())
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata(owner, router_name(owner), "router"),
            "spec": {"replicas": spec.router.replicas, "selector": {"matchLabels": selector},
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                     "template": template}}


def router_service(owner: Owner) -> Manifest:
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata(owner, router_name(owner), "router"),
            "spec": {"type": "ClusterIP", "selector": {LABEL_DEPLOYMENT: owner.name, LABEL_COMPONENT: "router"},
                     "ports": [{"name": "http", "port": ROUTER_HTTP_PORT, "targetPort": "http"},
                               {"name": "grpc", "port": ROUTER_GRPC_PORT, "targetPort": "grpc"}]}}


def replicas_json(owner: Owner, ready_groups: list[int]) -> str:
    """The router's `--replica-file`: stage 0 of every ready group."""
    replicas = [{"name": replica_name(g), "address": group_address(owner, g)} for g in sorted(ready_groups)]
    return json.dumps({"replicas": replicas}, indent=2, sort_keys=True) + "\n"


def resolved_config(owner: Owner, spec: Spec, image: str, hash_: str) -> str:
    """What the operator resolved from the spec (defaults applied, flags derived), for humans and tools."""
    source = model_source(spec)
    config = {"deployment": owner.name, "image": image, "configHash": hash_, "replicas": spec.replicas,
              "pipelineStages": spec.pipeline, "modelPath": source.path,
              "servedModelName": served_model_name(owner, spec),
              "workerArgs": worker_args(owner, spec, source), "routerArgs": router_args(owner, spec, source),
              "groups": [[stage_host(owner, g, s) for s in range(spec.pipeline)] for g in range(spec.replicas)],
              "endpoint": endpoint(owner, spec)}
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def config_map(owner: Owner, spec: Spec, image: str, hash_: str, ready_groups: list[int]) -> Manifest:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata(owner, config_map_name(owner), "config"),
            "data": {"replicas.json": replicas_json(owner, ready_groups),
                     "config.json": resolved_config(owner, spec, image, hash_)}}


def shared_objects(owner: Owner, spec: Spec, image: str, hash_: str, ready_groups: list[int]) -> list[Manifest]:
    """Everything but the stage pods, in the order they are applied."""
    return [config_map(owner, spec, image, hash_, ready_groups), stages_service(owner),
            router_deployment(owner, spec, image), router_service(owner)]


def network_policy_name(owner: Owner, group: int) -> str:
    return f"{owner.name}-g{group}-stages"


def network_policy_selector(owner: Owner) -> str:
    """Label selector of every stage NetworkPolicy of the deployment (to prune and clean up)."""
    return f"{LABEL_DEPLOYMENT}={owner.name},{LABEL_COMPONENT}=worker-network"


def group_network_policy(owner: Owner, group: int) -> Manifest:
    """Ingress to one group's stage pods: any port from the group's own pods (the rendezvous store and
    the ephemeral NCCL/gloo ports between stages), stage 0's gRPC port from this deployment's routers,
    and the metrics port from anywhere (Prometheus). Nothing else reaches them; egress stays open
    (weights may be downloaded)."""
    group_pods = {LABEL_DEPLOYMENT: owner.name, LABEL_COMPONENT: "worker", LABEL_GROUP: str(group)}
    routers = {LABEL_DEPLOYMENT: owner.name, LABEL_COMPONENT: "router"}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": metadata(owner, network_policy_name(owner, group), "worker-network",
                                 **{LABEL_GROUP: str(group)}),
            "spec": {"podSelector": {"matchLabels": group_pods}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {"matchLabels": group_pods}}]},
                                 {"from": [{"podSelector": {"matchLabels": routers}}],
                                  "ports": [{"protocol": "TCP", "port": GRPC_PORT}]},
                                 {"ports": [{"protocol": "TCP", "port": METRICS_PORT}]}]}}


def network_policies(owner: Owner, groups: Iterable[int]) -> list[Manifest]:
    """One stage NetworkPolicy per group (by index: during a surge rollout there are more groups than
    replicas, and indexes need not be contiguous)."""
    return [group_network_policy(owner, g) for g in sorted(groups)]


def disruption_budget_selector(owner: Owner) -> str:
    """Label selector of every PodDisruptionBudget of the deployment (to prune and clean up)."""
    return f"{LABEL_DEPLOYMENT}={owner.name},{LABEL_COMPONENT}=disruption-budget"


def _budget(owner: Owner, name: str, pods: dict[str, str], min_available: int, **extra_labels: str) -> Manifest:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": metadata(owner, name, "disruption-budget", **extra_labels),
            "spec": {"minAvailable": min_available, "selector": {"matchLabels": pods},
                     # Pods that are not Ready anyway (a group starting or failing) never block a drain.
                     "unhealthyPodEvictionPolicy": "AlwaysAllow"}}


def disruption_budgets(owner: Owner, spec: Spec, groups: Iterable[int], released: int | None = None) -> list[Manifest]:
    """PodDisruptionBudgets: per group, all P stage pods must stay (evicting any one stage takes the
    whole group down, so allowing one pod would allow a whole replica; an integer `minAvailable` is
    what Kubernetes supports for pods of a custom controller), except the `released` group, whose
    budget allows every eviction while a node of it drains (`reconcile.drain_release`); for the
    routers, all but one once there are two or more (with one router a budget would either block
    every drain or protect nothing)."""
    out = [_budget(owner, f"{owner.name}-g{g}", {LABEL_DEPLOYMENT: owner.name, LABEL_COMPONENT: "worker",
                                                  LABEL_GROUP: str(g)}, 0 if g == released else spec.pipeline,
                   **{LABEL_GROUP: str(g)})
           for g in sorted(groups)]
    if spec.router.replicas >= 2:
        out.append(_budget(owner, router_name(owner), {LABEL_DEPLOYMENT: owner.name, LABEL_COMPONENT: "router"},
                           spec.router.replicas - 1))
    return out


def shared_object_names(owner: Owner) -> list[tuple[str, str]]:
    """(kind, name) of every owned object but the stage pods: what `shared_objects` renders, for cleanup."""
    return [("ConfigMap", config_map_name(owner)), ("Service", stages_service_name(owner)),
            ("Deployment", router_name(owner)), ("Service", router_name(owner))]


def with_applied_hash(manifest: Manifest) -> Manifest:
    """The manifest annotated with a hash of itself, so a reconcile can tell "already applied" without
    diffing against server-side defaults."""
    annotations = dict(manifest["metadata"].get("annotations", {}))
    annotations[ANNOTATION_APPLIED_HASH] = _hash(manifest)
    return {**manifest, "metadata": {**manifest["metadata"], "annotations": annotations}}
