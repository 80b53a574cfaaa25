"""The `ModelDeployment` CustomResourceDefinition, defined once, here.

Why in Python: the operator needs the schema at run time (to apply the same defaults and reject the
same values as the API server, also where the server did not — an old cluster, a test emulator), and
the Helm chart needs it as YAML. Keeping the dict here and *generating* the chart's copy
(`python -m chariot.operator.crd > charts/chariot/files/crds/modeldeployments.chariot.dev.yaml`; a unit
test fails when the file is stale) leaves exactly one hand-maintained definition. The fields that are
engine settings (dtype, policy, token budget, batch and block size, parallelism, rendezvous timeout)
take their type, bounds, default and description from `chariot.contracts.engine_settings`.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from chariot.contracts import engine_settings as settings
from chariot.contracts.engine_settings import Setting
from chariot.operator.podtemplate import KERNEL_CACHE_DIR

GROUP = "chariot.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ModelDeployment"
PLURAL = "modeldeployments"
SINGULAR = "modeldeployment"
SHORT_NAMES = ["mdep"]
CRD_NAME = f"{PLURAL}.{GROUP}"
CHART_CRD_PATH = "charts/chariot/files/crds/modeldeployments.chariot.dev.yaml"

MODEL_URI_PATTERN = (r"^(preset://(tiny|small|100m|llama3-8b)|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?"
                     r"|hf://[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?|file:///.+|/.+)$")
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"  # Secret and PersistentVolumeClaim names
GROUP_PHASES = ["Pending", "Starting", "Ready", "Draining", "Restarting", "BackingOff", "Terminating"]

Schema = dict[str, Any]


def _int(description: str, minimum: int | None = None, default: int | None = None,
         maximum: int | None = None) -> Schema:
    s: Schema = {"type": "integer", "description": description}
    if minimum is not None:
        s["minimum"] = minimum
    if maximum is not None:
        s["maximum"] = maximum
    if default is not None:
        s["default"] = default
    return s


def _str(description: str, **extra: Any) -> Schema:
    return {"type": "string", "description": description, **extra}


def _obj(description: str, properties: dict[str, Schema], required: list[str] | None = None,
         default: dict[str, Any] | None = None) -> Schema:
    s: Schema = {"type": "object", "description": description, "properties": properties}
    if required:
        s["required"] = required
    if default is not None:
        s["default"] = default
    return s


JSON_TYPES: dict[type, str] = {int: "integer", float: "number", str: "string", bool: "boolean"}


def engine_field(setting: Setting[Any]) -> Schema:
    """The schema of an engine setting's CRD field, from its declaration (`contracts/engine_settings.py`):
    type, enum, bounds and default, then the cluster's declared overrides."""
    assert setting.crd is not None, f"{setting.name} has no CRD field"
    declared = {"type": JSON_TYPES[setting.kind], "minimum": setting.minimum, "maximum": setting.maximum,
                "default": setting.default, **setting.crd.overrides}
    s: Schema = {"type": declared["type"], "description": setting.crd.description}
    if setting.choices:
        s["enum"] = list(setting.choices)
    for key in ("minimum", "maximum", "default"):
        if declared[key] is not None:  # bounds of an integer field are written as integers
            s[key] = int(declared[key]) if s["type"] == "integer" and key != "default" else declared[key]
    return s


def _engine(*engine_settings: Setting[Any]) -> dict[str, Schema]:
    """`{field name: schema}` of engine settings exposed in one object of the spec."""
    return {s.crd.path.rsplit(".", 1)[-1]: engine_field(s) for s in engine_settings if s.crd is not None}


QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
                    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")


def _quantity(description: str, default: str) -> Schema:
    """A resource.Quantity, declared the way controller-gen does (int-or-string + pattern)."""
    return {"description": description, "x-kubernetes-int-or-string": True, "default": default,
            "anyOf": [{"type": "integer"}, {"type": "string"}], "pattern": QUANTITY_PATTERN}


def _model() -> Schema:
    return _obj("The model every stage loads (its own layer range) and the router tokenizes with.", {
        "uri": _str("Where the Hugging Face model directory comes from: `preset://tiny|small|100m|llama3-8b` (a random-"
                    "initialised preset made by an init container), `hf://ORG/NAME[@REVISION]` (downloaded from "
                    "the Hugging Face Hub by an init container in every pod, into an emptyDir or `cacheClaim`), "
                    "`pvc://CLAIM[/PATH]` (a PersistentVolumeClaim mounted read-only by every stage and router "
                    "pod: it needs ReadOnlyMany or ReadWriteMany access across nodes), or an absolute path "
                    "already present in the image (`/models/m` or `file:///models/m`).", pattern=MODEL_URI_PATTERN),
        "tokenSecret": _obj("Secret holding the Hugging Face token for `hf://` models (gated or private).", {
            "name": _str("Secret name in the ModelDeployment's namespace.", pattern=DNS_SUBDOMAIN_PATTERN),
            "key": _str("Key of the token in the Secret.", default="token"),
        }, required=["name"]),
        "cacheClaim": _str("PersistentVolumeClaim that `hf://` downloads go to instead of a per-pod emptyDir; "
                           "a completed download of the same revision is reused (ReadWriteMany for pods on "
                           "several nodes).", pattern=DNS_SUBDOMAIN_PATTERN),
        "name": _str("Model name clients use (OpenAI `model`); default: the ModelDeployment's name.",
                     maxLength=253),
        **_engine(settings.DTYPE, settings.MAX_MODEL_LEN),
    }, required=["uri"])


def _kernel_cache() -> Schema:
    s = _obj(f"A volume the stage pods keep the C++ CPU kernels' builds on, mounted at `{KERNEL_CACHE_DIR}` with "
             "`CHARIOT_KERNEL_CACHE` pointing at it and `CHARIOT_KERNEL_BUILD=native`: the first stage pod on a "
             "node compiles the builds for its CPU into it (about 25 s per kernel), every later one there loads "
             "them. Builds are keyed by the CPU's feature flags and the kernel source, so nodes of different CPUs "
             "can share one volume. Set exactly one of `claimName` and `hostPath`; unset: the image's portable "
             "build, or a build in the pod's /tmp that goes with the pod.", {
                 "claimName": _str("PersistentVolumeClaim holding the cache (ReadWriteMany when stage pods run on "
                                   "several nodes).", pattern=DNS_SUBDOMAIN_PATTERN),
                 "hostPath": _str("Absolute directory on each node (created if missing, as `DirectoryOrCreate`); "
                                  "it must be writable by uid 10001, and Pod Security `baseline`/`restricted` "
                                  "namespaces refuse hostPath volumes.", pattern=r"^/.*$", maxLength=4096),
             })
    s["minProperties"] = 1
    s["maxProperties"] = 1
    return s


def _scheduler() -> Schema:
    return _obj("Batching policy and its knobs (every stage of a group gets the same).", {
        **_engine(settings.POLICY, settings.TOKEN_BUDGET),
        "tuneProfile": _str("Path, inside the stage pods (e.g. in the model volume), of a `chariot tune` profile "
                            "made on the stage's hardware; with `slo.tbtMs` and no tokenBudget the workers derive "
                            "the token budget from it (sarathi only).", maxLength=4096),
        **_engine(settings.MAX_BATCH_SIZE, settings.BLOCK_SIZE, settings.PREFILL_ORDER),
    }, default={})


def _number(description: str, minimum: float, maximum: float, default: float) -> Schema:
    return {"type": "number", "description": description, "minimum": minimum, "maximum": maximum, "default": default}


def _autoscaling() -> Schema:
    """`spec.autoscaling` (docs/kubernetes.md, "Autoscaling"; the rules: `chariot.contracts.autoscaling`)."""
    return _obj("Size the replica groups from the load the routers see: desired = ceil(offered tokens/s / "
                "(a group's measured tokens/s x targetUtilization)), one step more while the routers shed, "
                "within [minReplicas, maxReplicas], stabilised like an HPA. The operator then owns "
                "`spec.replicas` (it patches it); a HorizontalPodAutoscaler on this ModelDeployment is "
                "reported (condition ScalingActive=False, reason HPAConflict), not fought. The routers share "
                "their load through Redis: set `router.redis.url` (or the operator's default Redis).", {
        "minReplicas": _int("Fewest groups; 0 lets an idle deployment scale to zero (its router stays).",
                            minimum=0, maximum=1024, default=1),
        "maxReplicas": _int("Most groups.", minimum=1, maximum=1024),
        "targetUtilization": _number("Share of a group's measured capacity to plan for (headroom for bursts "
                                     "and for the time a new group takes to start).", 0.05, 1.0, 0.7),
        "scaleUpStabilizationSeconds": _int("A rise must be asked for this long before groups are added "
                                            "(the lowest recommendation of the window wins).",
                                            minimum=0, maximum=3600, default=0),
        "scaleDownStabilizationSeconds": _int("Groups are removed only to the highest recommendation of this "
                                              "window, so a dip does not remove a group that is needed again "
                                              "soon.", minimum=0, maximum=3600, default=300),
        "shedStep": _int("Groups added per decision while the routers shed requests for load.",
                         minimum=1, maximum=64, default=1),
        "drainGracePeriodSeconds": _int("A group chosen to go is drained first: taken out of the routers' "
                                        "replica list (phase Draining), its pods deleted once no router sends "
                                        "to it and none of its requests is in flight, or after this long.",
                                        minimum=0, maximum=3600, default=120),
        "holdQueueLength": _int("Requests each router holds while no group is ready (scaled to zero, or every "
                                "group restarting): the autoscaler sees them and starts a group. Beyond it, "
                                "503 at once; 0 turns holding off.", minimum=0, maximum=100000, default=64),
        "holdTimeoutSeconds": _int("How long a held request waits for a ready group before its 503 (with "
                                   "Retry-After).", minimum=1, maximum=3600, default=120),
    }, required=["maxReplicas"])


def _string_map(description: str) -> Schema:
    return {"type": "object", "description": description, "additionalProperties": {"type": "string"}}


def _array(description: str, items: Schema) -> Schema:
    return {"type": "array", "description": description, "items": items}


def _open_obj(description: str, properties: dict[str, Schema] | None = None,
              required: list[str] | None = None) -> Schema:
    """An object typed where it matters to the merge, passed through otherwise (a full PodSpec schema
    is impractical; the API server validates the pod the operator creates)."""
    s = _obj(description, properties or {}, required)
    s["x-kubernetes-preserve-unknown-fields"] = True
    return s


def _quantities(description: str) -> Schema:
    return {"type": "object", "description": description, "additionalProperties": {
        "x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": QUANTITY_PATTERN}}


TEMPLATE_OWNED = ("Operator-owned, and rejected with an error naming the field: the labels and annotations the "
                  "operator sets (`app.kubernetes.io/*` of its own, `prometheus.io/*`, anything under "
                  "`chariot.dev/`), `restartPolicy`, `hostname`, `subdomain`, the volume names `model`, `tmp`, "
                  "`shm`, `config`, `kernel-cache`, and in the operator's containers `image` (use `spec.image`), "
                  "`command`, `args`, `ports`, probes, the rendezvous env vars (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, "
                  "`MASTER_PORT`), `nvidia.com/gpu` resources (use `spec.resources.gpusPerStage`) and mount "
                  "paths `/models` (and below), `/tmp`, `/dev/shm`, `/etc/chariot`, `/var/cache/chariot/kernels`.")


def _container(description: str) -> Schema:
    return _open_obj(description, {
        "name": _str("Container name; the operator's container of this name gets the other fields merged in."),
        "env": _array("Merged by `name` (a template entry replaces the operator's default, e.g. `HOME`); the "
                      "rendezvous variables are operator-owned.", _open_obj("An EnvVar.", {
                          "name": _str("Variable name."), "value": _str("Literal value.")}, required=["name"])),
        "envFrom": _array("Appended to the operator's.", _open_obj("An EnvFromSource.")),
        "resources": _obj("Requests and limits merged by resource name, the template winning (over "
                          "`spec.resources`' cpu and memory too); `nvidia.com/gpu` is operator-owned.", {
                              "requests": _quantities("Requests by resource name."),
                              "limits": _quantities("Limits by resource name."),
                          }),
        "volumeMounts": _array("Merged by `mountPath`; the operator's mount paths are operator-owned.", _open_obj(
            "A VolumeMount.", {"name": _str("Volume name."), "mountPath": _str("Path in the container.")},
            required=["name", "mountPath"])),
    }, required=["name"])


def _pod_template(pods: str, container: str) -> Schema:
    """A PodTemplateSpec merged onto the operator's pods (merge rules: operator/podtemplate.py)."""
    named = f"the containers named `{container}` and `make-model` (the operator's)"
    return _obj(f"A PodTemplateSpec merged onto {pods}: maps merge by key, the template winning; lists merge by "
                "key (containers, initContainers, volumes, imagePullSecrets and env by name, volumeMounts by "
                f"mountPath), tolerations and envFrom are appended; {named} receive the container fields, other "
                f"containers are added as sidecars. {TEMPLATE_OWNED} Changing it rolls the pods.", {
        "metadata": _obj("Labels and annotations added to the pods.", {
            "labels": _string_map("Extra pod labels; the operator's keys are operator-owned."),
            "annotations": _string_map("Extra pod annotations; the operator's keys are operator-owned."),
        }),
        "spec": _open_obj("A PodSpec: any field (nodeSelector, tolerations, affinity, imagePullSecrets, "
                          "serviceAccountName, runtimeClassName, priorityClassName, schedulerName, volumes, "
                          "securityContext, ...) except the operator-owned ones.", {
            "containers": _array(f"Merged by name: {named} receive these fields; others are sidecars.",
                                 _container("A Container (partial for the operator's).")),
            "initContainers": _array("Merged by name, after the operator's (`make-model`, which makes or fetches "
                                     "the model for `preset://` and `hf://`).",
                                     _container("A Container (partial for the operator's).")),
            "volumes": _array("Added to the operator's volumes (`model`, `tmp`, `shm`, `config`, `kernel-cache` "
                              "are its own).",
                              _open_obj("A Volume.", {"name": _str("Volume name.")}, required=["name"])),
            "imagePullSecrets": _array("Merged by name.", _obj("A LocalObjectReference.", {
                "name": _str("Secret name.")}, required=["name"])),
            "tolerations": _array("Appended to the operator's (GPU stages tolerate `nvidia.com/gpu`).", _obj(
                "A Toleration.", {
                    "key": _str("Taint key; empty with operator Exists matches every taint."),
                    "operator": _str("Exists or Equal.", enum=["Exists", "Equal"]),
                    "value": _str("Taint value for Equal."),
                    "effect": _str("Taint effect; empty matches all.", enum=["", "NoSchedule", "PreferNoSchedule",
                                                                             "NoExecute"]),
                    "tolerationSeconds": _int("For NoExecute: how long the pod stays bound after the taint."),
                })),
            "nodeSelector": _string_map("Node labels the pods must match."),
            "affinity": _open_obj("Node and pod (anti-)affinity."),
            "serviceAccountName": _str("ServiceAccount the pods run as."),
            "runtimeClassName": _str("RuntimeClass of the pods (e.g. `nvidia`); for the stage pods "
                                     "`spec.runtimeClassName` says the same, and the two must agree."),
            "priorityClassName": _str("PriorityClass of the pods."),
            "schedulerName": _str("Scheduler that places the pods."),
        }),
    })


def spec_schema() -> Schema:
    """OpenAPI v3 schema of `.spec` (structural: every field typed, defaults and bounds declared)."""
    return _obj("Desired state of a served model: R replicas (pipeline groups) of P stage pods plus routers.", {
        "model": _model(),
        "replicas": _int("Pipeline groups (replicas) serving the model; each is `parallelism.pipeline` pods.",
                         minimum=0, default=1),
        "parallelism": _obj("How one replica is split over processes.", {
            **_engine(settings.PIPELINE_STAGES, settings.TENSOR_PARALLEL_SIZE, settings.RENDEZVOUS_TIMEOUT_S),
        }, default={}),
        "rollout": _obj("How a configuration change replaces the groups.", {
            "maxSurge": _int("Extra groups that may run during a rollout: with 1 (the default) an up-to-date "
                             "group is started and Ready before an outdated one is taken down, so capacity never "
                             "drops; 0 replaces one group at a time in place (no extra GPUs, one group down).",
                             minimum=0, maximum=64, default=1),
        }, default={}),
        "scheduler": _scheduler(),
        "autoscaling": _autoscaling(),
        "slo": _obj("Latency targets: the router's admission control and, without tokenBudget, the token budget.", {
            "ttftMs": {"type": "number", "minimum": 1, "description": "Time-to-first-token SLO in milliseconds."},
            "tbtMs": {"type": "number", "minimum": 1, "description": "Time-between-tokens SLO in milliseconds."},
        }, default={}),
        "resources": _obj("Per stage pod.", {
            "gpusPerStage": _int("`nvidia.com/gpu` per tensor-parallel rank: a stage pod requests this × "
                                 "`parallelism.tensor` (the same as per pod without tensor parallelism); 0 runs "
                                 "on CPU.", minimum=0, maximum=16, default=1),
            "cpu": _quantity("CPU request (and limit) per stage pod.", "2"),
            "memory": _quantity("Memory request (and limit) per stage pod.", "8Gi"),
            "shmSize": _quantity("Size limit of `/dev/shm` in each stage pod, a memory-backed emptyDir: NCCL "
                                 "and torch.distributed pass tensors between the processes of a pod (its "
                                 "tensor-parallel ranks) through it, and its pages count against the pod's "
                                 "memory limit. 1Gi is the usual advice for NCCL (a 64 MiB /dev/shm, a container "
                                 "runtime's default, fails NCCL with `failed to extend /dev/shm`).", "1Gi"),
        }, default={}),
        "runtimeClassName": _str("RuntimeClass of the stage pods, e.g. `nvidia` where the NVIDIA container runtime "
                                 "is installed as a RuntimeClass rather than as the nodes' default runtime (the "
                                 "NVIDIA GPU operator's `nvidia` RuntimeClass); unset: the nodes' default runtime.",
                                 pattern=DNS_SUBDOMAIN_PATTERN, maxLength=253),
        "kernelCache": _kernel_cache(),
        "image": _str("Container image for workers and routers; default: the operator's own image."),
        "router": _obj("The request router in front of the replicas.", {
            "replicas": _int("Router pods.", minimum=0, default=1),
            "redis": _obj("Shared router state; needed for consistent limits with more than one router.", {
                "url": _str("Redis URL (`redis://`, `rediss://` or `unix://`).",
                            pattern=r"^(redis|rediss|unix)://.+$"),
            }),
            "template": _pod_template("the router Deployment's pods", "router"),
            "auth": _obj("API keys bound to tenants (docs/api.md): with a Secret, every /v1/ call and gRPC call "
                         "needs `Bearer <key>`; the router reloads the Secret when it changes.", {
                "secretName": _str("Secret holding the key file (YAML `keys: [{key | sha256, tenant, models, "
                                   "requestsPerMinute}]`).", pattern=DNS_SUBDOMAIN_PATTERN, maxLength=253),
                "key": _str("The Secret's key holding the file.", default="keys.yaml",
                            pattern=r"^[-._a-zA-Z0-9]+$", maxLength=253),
            }, required=["secretName"]),
            "tls": _obj("TLS on the router's HTTP and gRPC ports, from a `kubernetes.io/tls` Secret (`tls.crt`, "
                        "`tls.key`; cert-manager's Certificate writes one); reloaded when it is renewed.", {
                "secretName": _str("The TLS Secret.", pattern=DNS_SUBDOMAIN_PATTERN, maxLength=253),
            }, required=["secretName"]),
        }, default={}),
        "observability": _obj("Telemetry export.", {
            "otlpEndpoint": _str("OTLP gRPC collector for metrics and traces (e.g. `http://collector:4317`).",
                                 pattern=r"^https?://.+$"),
        }, default={}),
        "template": _pod_template("every pipeline-stage pod", "worker"),
    }, required=["model"])


def _condition() -> Schema:
    return _obj("A standard condition.", {
        "type": _str("Ready, Progressing, Degraded, or ScalingActive (with spec.autoscaling)."),
        "status": _str("True, False or Unknown.", enum=["True", "False", "Unknown"]),
        "reason": _str("CamelCase reason."),
        "message": _str("Human-readable details; names the spec field when the spec is invalid."),
        "lastTransitionTime": _str("When status last changed.", format="date-time"),
        "observedGeneration": _int("The generation this condition was computed for.", minimum=0),
    }, required=["type", "status"])


def _group_status() -> Schema:
    return _obj("One pipeline group.", {
        "index": _int("Group number g (pods `<name>-g<g>-s<s>`).", minimum=0),
        "phase": _str("Lifecycle phase of the group.", enum=GROUP_PHASES),
        "readyPods": _int("Stage pods that are Ready.", minimum=0),
        "pods": _int("Stage pods that exist.", minimum=0),
        "configHash": _str("Hash of the rendered configuration the group's pods run."),
        "restarts": _int("Gang restarts since the group was last stable.", minimum=0),
        "restartAfter": _str("Earliest time of the next restart (backoff).", format="date-time"),
        "readySince": _str("When the group last became Ready.", format="date-time"),
        "drainingSince": _str("When the autoscaler chose the group to go (it serves no new requests).",
                              format="date-time"),
        "lastFailure": _str("Why the group was last restarted."),
        "message": _str("Why the group is in this phase."),
        "started": {"type": "boolean", "description": "All stage pods of this incarnation of the group were "
                    "Running at once: from then on a failed pod restarts the whole group; before, only that pod."},
    }, required=["index", "phase"])


def _autoscaling_status() -> Schema:
    rate = {"type": "number", "minimum": 0}
    return _obj("The autoscaler's last look (present while spec.autoscaling is set).", {
        "desiredReplicas": _int("Groups the autoscaler wants now (after stabilisation and bounds).", minimum=0),
        "currentReplicas": _int("spec.replicas when it looked.", minimum=0),
        "recommendedReplicas": _int("What the formula asked for at that moment (before stabilisation).", minimum=0),
        "reason": _str("ScaleUp, ScaleDown, ScaleFromZero, Bounded, Stabilizing, Stable, NoCapacity, HPAConflict or "
                       "NoOfferedLoad."),
        "message": _str("The decision with its inputs, in words."),
        "lastDecisionTime": _str("When it last looked.", format="date-time"),
        "lastScaleTime": _str("When it last changed spec.replicas.", format="date-time"),
        "inputs": _obj("The offered load summed over the routers (per second over their window).", {
            "arrivalRate": {**rate, "description": "Requests arriving (admitted or shed for load)."},
            "promptTokenRate": {**rate, "description": "Their prompt tokens."},
            "outputTokenRate": {**rate, "description": "Output tokens generated."},
            "workRate": {**rate, "description": "Prompt plus output tokens: the work asked of the groups."},
            "shedRate": {**rate, "description": "Requests shed for load (SLO or full queues)."},
            "held": _int("Requests waiting for a first ready group.", minimum=0),
            "groupCapacity": {**rate, "description": "Tokens/s one group sustains at its SLO budget (median of "
                                                     "the measured groups)."},
            "routers": _int("Routers that reported.", minimum=0),
        }),
        "recommendations": {"type": "array", "description": "Recent recommendations (the stabilisation windows).",
                            "items": _obj("One look.", {"time": {"type": "number", "description": "Epoch seconds."},
                                                        "replicas": _int("Groups asked for.", minimum=0)})},
    })


def status_schema() -> Schema:
    return _obj("Observed state, written by the operator.", {
        "observedGeneration": _int("The spec generation the operator last acted on.", minimum=0),
        "replicas": _int("Groups whose pods exist (the scale subresource's status).", minimum=0),
        "readyReplicas": _int("Groups whose every stage pod is Ready.", minimum=0),
        "updatedReplicas": _int("Groups running the current configuration.", minimum=0),
        "selector": _str("Label selector of the stage-0 pods (for autoscalers)."),
        "endpoint": _str("The router Service's in-cluster HTTP URL."),
        "configHash": _str("Hash of the current configuration."),
        "groups": {"type": "array", "description": "Per-group state.", "items": _group_status()},
        "autoscaling": _autoscaling_status(),
        "conditions": {"type": "array", "description": "Ready, Progressing, Degraded (and ScalingActive).",
                       "items": _condition(),
                       "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    })


def printer_columns() -> list[dict[str, Any]]:
    return [
        {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
         "description": "Whether every replica and the router are ready."},
        {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas", "description": "Desired groups."},
        {"name": "Available", "type": "integer", "jsonPath": ".status.readyReplicas",
         "description": "Ready groups.", "priority": 1},
        {"name": "Desired", "type": "integer", "jsonPath": ".status.autoscaling.desiredReplicas",
         "description": "Groups the autoscaler wants.", "priority": 1},
        {"name": "Stages", "type": "integer", "jsonPath": ".spec.parallelism.pipeline",
         "description": "Pipeline stages per replica."},
        {"name": "Policy", "type": "string", "jsonPath": ".spec.scheduler.policy", "description": "Scheduler."},
        {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "priority": 1,
         "description": "Router URL."},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition object (apiextensions.k8s.io/v1)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/part-of": "chariot"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": SINGULAR, "shortNames": SHORT_NAMES,
                      "listKind": f"{KIND}List", "categories": ["chariot"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "A served LLM: pipeline-parallel stage pods per replica, routers, config.",
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec_schema(),
                        "status": status_schema(),
                    },
                    "required": ["spec"],
                }},
                "subresources": {
                    "status": {},
                    "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                              "labelSelectorPath": ".status.selector"},
                },
                "additionalPrinterColumns": printer_columns(),
            }],
        },
    }


def crd_yaml() -> str:
    header = ("# Generated by `python -m chariot.operator.crd` from operator/crd.py (the single source of truth);\n"
              "# do not edit by hand. tests/unit/test_crd.py fails when this file is stale.\n")
    return header + yaml.safe_dump(crd_manifest(), sort_keys=False, width=120)


if __name__ == "__main__":
    sys.stdout.write(crd_yaml())
