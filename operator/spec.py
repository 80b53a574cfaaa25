"""The ModelDeployment spec as typed, validated Python values.

Why not trust the API server: it applies the CRD schema's defaults and bounds, but the operator also
runs against servers that did not (an old CRD version, a test emulator), and some rules cannot be
written in OpenAPI (tensor parallelism not implemented yet, a non-chunking policy with a budget below
the model length, names too long for pod hostnames, a pod template setting an operator-owned field).
So `parse_spec` applies the CRD schema itself, then the cross-field rules, and reports every problem
as a `FieldError` naming the field — the text that ends up in the `Ready=False` condition.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from chariot.contracts import engine_settings as settings
from chariot.contracts.autoscaling import AutoscalingPolicy
from chariot.contracts.errors import ConfigError
from chariot.contracts.parallelism import tensor_split_problem
from chariot.contracts.policies import get_policy
from chariot.operator import crd
from chariot.operator.podtemplate import ROUTER, WORKER, PodTemplate, owned_field_problems

MAX_POD_NAME = 63  # pod hostnames are DNS labels


class PresetShape(NamedTuple):
    """What the operator checks a spec against for `preset://` models."""

    layers: int
    max_position_embeddings: int
    heads: int
    kv_heads: int
    intermediate: int


# The shapes of `chariot make-model --preset`; tests check them against the presets (the operator
# image must not need torch to validate a spec).
PRESET_SHAPES: dict[str, PresetShape] = {
    "tiny": PresetShape(2, 2048, 4, 2, 128), "small": PresetShape(4, 4096, 8, 2, 688),
    "100m": PresetShape(8, 8192, 16, 4, 2816), "llama3-8b": PresetShape(32, 8192, 32, 8, 14336)}


@dataclass(frozen=True)
class FieldError:
    """One invalid field: `path` is the JSON path from the object root (e.g. `spec.parallelism.tensor`)."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class InvalidSpec(ValueError):
    """A spec the operator refuses to apply; `errors` name every offending field."""

    def __init__(self, errors: list[FieldError]) -> None:
        super().__init__("; ".join(str(e) for e in errors))
        self.errors = errors


@dataclass(frozen=True)
class ModelSpec:
    uri: str
    name: str | None = None
    dtype: str = settings.DTYPE.crd_default()
    max_model_len: int | None = settings.MAX_MODEL_LEN.crd_default()
    token_secret: tuple[str, str] | None = None  # (Secret name, key) holding HF_TOKEN for hf:// models
    cache_claim: str | None = None  # PersistentVolumeClaim the hf:// download goes to (else an emptyDir)


@dataclass(frozen=True)
class SchedulerSpec:
    policy: str = settings.POLICY.crd_default()
    token_budget: int | None = settings.TOKEN_BUDGET.crd_default()
    max_batch_size: int = settings.MAX_BATCH_SIZE.crd_default()
    block_size: int | None = settings.BLOCK_SIZE.crd_default()
    tune_profile: str | None = None
    prefill_order: str = settings.PREFILL_ORDER.crd_default()


@dataclass(frozen=True)
class ResourceSpec:
    gpus_per_stage: int = 1
    cpu: str = "2"
    memory: str = "8Gi"
    shm_size: str = "1Gi"  # sizeLimit of the stage pods' memory-backed /dev/shm


@dataclass(frozen=True)
class KernelCacheSpec:
    """`spec.kernelCache`: the volume of the CPU kernels' build cache (exactly one of the two)."""

    claim_name: str | None = None
    host_path: str | None = None


@dataclass(frozen=True)
class RouterSpec:
    replicas: int = 1
    redis_url: str | None = None
    template: PodTemplate = field(default_factory=PodTemplate)
    auth_secret: tuple[str, str] | None = None  # (Secret name, its key holding the API key file)
    tls_secret: str | None = None  # a kubernetes.io/tls Secret: tls.crt, tls.key


@dataclass(frozen=True)
class Spec:
    """A defaulted, validated `.spec` (field names follow the CRD, in snake_case); the engine settings'
    defaults come from `chariot.contracts.engine_settings`, as the CRD's do."""

    model: ModelSpec
    replicas: int = 1
    pipeline: int = settings.PIPELINE_STAGES.crd_default()
    tensor: int = settings.TENSOR_PARALLEL_SIZE.crd_default()
    rendezvous_timeout_s: int = settings.RENDEZVOUS_TIMEOUT_S.crd_default()
    max_surge: int = 1
    scheduler: SchedulerSpec = SchedulerSpec()
    ttft_slo_ms: float | None = None
    tbt_slo_ms: float | None = None
    resources: ResourceSpec = ResourceSpec()
    image: str | None = None
    router: RouterSpec = RouterSpec()
    otlp_endpoint: str | None = None
    template: PodTemplate = field(default_factory=PodTemplate)
    runtime_class_name: str | None = None
    kernel_cache: KernelCacheSpec | None = None
    autoscaling: AutoscalingPolicy | None = None
    hold_queue: int = 0  # requests a router holds while no group is ready (spec.autoscaling.holdQueueLength)
    hold_timeout_s: float = 120.0

    @property
    def max_groups(self) -> int:
        """The most groups this spec can run (autoscaling may take `replicas` up to its maximum)."""
        return max(self.replicas, self.autoscaling.max_replicas if self.autoscaling else 0)


# --- the CRD schema, applied locally -------------------------------------------------------------

def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Fill `default`s the way the API server does (an absent object with a default becomes it, recursively)."""
    if not isinstance(value, dict) or "properties" not in schema:
        return value
    out = dict(value)
    for key, sub in schema["properties"].items():
        if key not in out and "default" in sub:
            out[key] = _copy(sub["default"])
        if key in out:
            out[key] = apply_defaults(sub, out[key])
    return out


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return list(value) if isinstance(value, list) else value


def schema_errors(schema: dict[str, Any], value: Any, path: str) -> list[FieldError]:
    """What the API server's validation would reject: types, required fields, enums, bounds, patterns."""
    kind_error = _type_error(schema, value)
    if kind_error:
        return [FieldError(path, kind_error)]
    errors = _value_errors(schema, value, path)
    if isinstance(value, dict):
        errors += [FieldError(f"{path}.{k}", "is required") for k in schema.get("required", []) if k not in value]
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                errors += schema_errors(sub, value[key], f"{path}.{key}")
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, item in value.items():
                errors += schema_errors(extra, item, f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += schema_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def _type_error(schema: dict[str, Any], value: Any) -> str | None:
    if schema.get("x-kubernetes-int-or-string"):
        ok = isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))
        return None if ok else f"must be an integer or a string, got {value!r}"
    expected = schema.get("type")
    checks = {
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
    }
    if expected is None or checks[expected](value):
        return None
    return f"must be of type {expected}, got {value!r}"


def _value_errors(schema: dict[str, Any], value: Any, path: str) -> list[FieldError]:
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(FieldError(path, f"must be one of {', '.join(map(str, schema['enum']))}, got {value!r}"))
    if "minimum" in schema and isinstance(value, int | float) and value < schema["minimum"]:
        errors.append(FieldError(path, f"must be >= {schema['minimum']}, got {value}"))
    if "maximum" in schema and isinstance(value, int | float) and value > schema["maximum"]:
        errors.append(FieldError(path, f"must be <= {schema['maximum']}, got {value}"))
    if "pattern" in schema and isinstance(value, str) and not re.search(schema["pattern"], value):
        errors.append(FieldError(path, f"{value!r} does not match {schema['pattern']}"))
    if "maxLength" in schema and isinstance(value, str) and len(value) > schema["maxLength"]:
        errors.append(FieldError(path, f"must be at most {schema['maxLength']} characters"))
    if isinstance(value, dict) and ("minProperties" in schema or "maxProperties" in schema):
        low, high = schema.get("minProperties", 0), schema.get("maxProperties", len(value))
        if not low <= len(value) <= high:
            names = ", ".join(schema.get("properties", {}))
            count = f"exactly {low}" if low == high else f"between {low} and {high}"
            errors.append(FieldError(path, f"must set {count} of {names}, got {len(value)}"))
    return errors


# --- rules OpenAPI cannot express ----------------------------------------------------------------

def semantic_errors(spec: Spec, name: str) -> list[FieldError]:
    """Cross-field and not-yet-supported settings, each naming its field."""
    errors = []
    s = spec.scheduler
    max_len = spec.model.max_model_len
    problem = None if s.token_budget is None or max_len is None else \
        get_policy(s.policy).budget_problem(s.token_budget, max_len)
    if problem is not None:
        errors.append(FieldError("spec.scheduler.tokenBudget",
                                 f"{problem} (spec.model.maxModelLen = {max_len}), got {s.token_budget}"))
    return (errors + tune_profile_errors(spec) + preset_errors(spec) + name_errors(name, spec) + template_errors(spec)
            + hf_errors(spec) + pod_errors(spec))


def pod_errors(spec: Spec) -> list[FieldError]:
    """Stage pod settings the schema cannot check: a `/dev/shm` of no size, a `..` in a hostPath
    (the API server refuses it only when the pod is created), and a RuntimeClass set twice with
    different values (which one would the pods get?)."""
    errors = []
    shm = spec.resources.shm_size
    if quantity_bytes(shm) <= 0:
        errors.append(FieldError("spec.resources.shmSize", f"must be a positive size (e.g. 1Gi), got {shm!r}"))
    cache = spec.kernel_cache
    if cache is not None and cache.host_path is not None and ".." in cache.host_path.split("/"):
        errors.append(FieldError("spec.kernelCache.hostPath", f"must not contain '..', got {cache.host_path!r}"))
    templated = (spec.template.body().get("spec") or {}).get("runtimeClassName")
    if spec.runtime_class_name is not None and templated is not None and templated != spec.runtime_class_name:
        errors.append(FieldError("spec.template.spec.runtimeClassName",
                                 f"is {templated!r} but spec.runtimeClassName is {spec.runtime_class_name!r}; "
                                 "set one of them"))
    return errors


QUANTITY_SUFFIXES = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
                     "n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}


def quantity_bytes(quantity: str) -> float:
    """The value of a resource.Quantity that has passed the CRD's pattern (`1Gi`, `512M`, `1e9`, `0`)."""
    match = re.fullmatch(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))([eE][+-]?\d+|[KMGTPE]i|[numkMGTPE])?", quantity.strip())
    if match is None:
        raise ValueError(f"not a quantity: {quantity!r}")
    number, suffix = float(match[1]), match[2] or ""
    if suffix[:1] in ("e", "E"):
        return number * 10 ** int(suffix[1:])
    return number * QUANTITY_SUFFIXES[suffix]


def hf_errors(spec: Spec) -> list[FieldError]:
    """`tokenSecret` and `cacheClaim` only mean something for an `hf://` model: set with another source
    they would be silently ignored, so they are rejected."""
    if spec.model.uri.startswith("hf://"):
        return []
    return [FieldError(f"spec.model.{field}", f"only applies to hf:// models; spec.model.uri is {spec.model.uri!r}")
            for field, value in (("tokenSecret", spec.model.token_secret), ("cacheClaim", spec.model.cache_claim))
            if value is not None]


def template_errors(spec: Spec) -> list[FieldError]:
    """A pod template may not set what the operator owns (operator/podtemplate.py): rejected, not ignored,
    so a platform engineer learns at once that (and why) a field cannot take effect."""
    problems = [*owned_field_problems(spec.template.body(), "spec.template", WORKER),
                *owned_field_problems(spec.router.template.body(), "spec.router.template", ROUTER)]
    return [FieldError(path, message) for path, message in problems]


def tune_profile_errors(spec: Spec) -> list[FieldError]:
    """`tuneProfile` only makes sense where the workers derive the budget from the TBT SLO."""
    s, field = spec.scheduler, "spec.scheduler.tuneProfile"
    if s.tune_profile is None:
        return []
    if s.token_budget is not None:
        return [FieldError(field, "set either tokenBudget or tuneProfile (with slo.tbtMs), not both")]
    if spec.tbt_slo_ms is None:
        return [FieldError(field, "derives the token budget from spec.slo.tbtMs, which is not set")]
    problem = get_policy(s.policy).slo_budget_problem()
    return [] if problem is None else [FieldError(field, problem)]


def preset_errors(spec: Spec) -> list[FieldError]:
    """For `preset://` models the shape is known here, so a pipeline longer than the model or a tensor
    parallelism that does not split it is caught early (other models: the worker refuses it at start,
    and its message reaches `status.groups[].lastFailure`)."""
    if not spec.model.uri.startswith("preset://"):
        return []
    preset = spec.model.uri.removeprefix("preset://")
    shape = PRESET_SHAPES[preset]
    layers, max_len = shape.layers, shape.max_position_embeddings
    errors = []
    split = tensor_split_problem(spec.tensor, shape.heads, shape.kv_heads, shape.intermediate)
    if split is not None:
        errors.append(FieldError("spec.parallelism.tensor", f"{split} ({spec.model.uri})"))
    if spec.pipeline > layers:
        errors.append(FieldError("spec.parallelism.pipeline", f"must be <= the {layers} layers of {spec.model.uri} "
                                                               f"(every stage needs a layer), got {spec.pipeline}"))
    if spec.model.max_model_len is not None and spec.model.max_model_len > max_len:
        errors.append(FieldError("spec.model.maxModelLen", f"must be <= {max_len} (max_position_embeddings of "
                                                            f"{spec.model.uri}), got {spec.model.max_model_len}"))
    return errors


def name_errors(name: str, spec: Spec) -> list[FieldError]:
    """Names derived from metadata.name must be valid: `<name>-stages` is a Service (DNS-1035 label),
    `<name>-g<g>-s<s>` a pod hostname (DNS label, at most 63 characters)."""
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name):
        return [FieldError("metadata.name", f"{name!r} must start with a letter and contain only lower-case "
                                            "letters, digits and '-' (it names Services and pod hostnames)")]
    longest = f"{name}-g{max(spec.max_groups - 1, 0)}-s{spec.pipeline - 1}"
    if len(longest) > MAX_POD_NAME:
        return [FieldError("metadata.name", f"is too long: pod hostname {longest!r} would exceed "
                                            f"{MAX_POD_NAME} characters")]
    return []


# --- parse ---------------------------------------------------------------------------------------

def parse_spec(raw: Any, name: str) -> Spec:
    """Defaulted and validated spec of the ModelDeployment `name`; raises `InvalidSpec` naming every bad field."""
    schema = crd.spec_schema()
    value = apply_defaults(schema, raw if raw is not None else {})
    errors = schema_errors(schema, value, "spec")
    if errors:
        raise InvalidSpec(errors)
    try:
        spec = _from_dict(value)
    except ConfigError as exc:  # a cross-field rule of a contracts dataclass (e.g. maxReplicas < minReplicas)
        raise InvalidSpec([FieldError(exc.field, exc.message)]) from exc
    errors = semantic_errors(spec, name)
    if errors:
        raise InvalidSpec(errors)
    return spec


def _from_dict(v: dict[str, Any]) -> Spec:
    m, p, s, slo, r = v["model"], v["parallelism"], v["scheduler"], v["slo"], v["resources"]
    router = v["router"]
    return Spec(
        model=ModelSpec(uri=m["uri"], name=m.get("name"), dtype=m["dtype"], max_model_len=m.get("maxModelLen"),
                        token_secret=(m["tokenSecret"]["name"], m["tokenSecret"]["key"]) if m.get("tokenSecret")
                        else None, cache_claim=m.get("cacheClaim")),
        replicas=v["replicas"], pipeline=p["pipeline"], tensor=p["tensor"],
        rendezvous_timeout_s=p["rendezvousTimeoutSeconds"], max_surge=v["rollout"]["maxSurge"],
        scheduler=SchedulerSpec(policy=s["policy"], token_budget=s.get("tokenBudget"),
                                max_batch_size=s["maxBatchSize"], block_size=s.get("blockSize"),
                                tune_profile=s.get("tuneProfile"), prefill_order=s["prefillOrder"]),
        ttft_slo_ms=slo.get("ttftMs"), tbt_slo_ms=slo.get("tbtMs"),
        resources=ResourceSpec(gpus_per_stage=r["gpusPerStage"], cpu=str(r["cpu"]), memory=str(r["memory"]),
                               shm_size=str(r["shmSize"])),
        image=v.get("image"),
        router=RouterSpec(replicas=router["replicas"], redis_url=(router.get("redis") or {}).get("url"),
                          template=PodTemplate.of(router.get("template")),
                          auth_secret=(router["auth"]["secretName"], router["auth"].get("key", "keys.yaml"))
                          if router.get("auth") else None,
                          tls_secret=(router.get("tls") or {}).get("secretName")),
        otlp_endpoint=v["observability"].get("otlpEndpoint"),
        template=PodTemplate.of(v.get("template")),
        runtime_class_name=v.get("runtimeClassName"),
        kernel_cache=KernelCacheSpec(claim_name=v["kernelCache"].get("claimName"),
                                     host_path=v["kernelCache"].get("hostPath")) if v.get("kernelCache") else None,
        autoscaling=_autoscaling(v.get("autoscaling")),
        hold_queue=(v.get("autoscaling") or {}).get("holdQueueLength", 0),
        hold_timeout_s=float((v.get("autoscaling") or {}).get("holdTimeoutSeconds", 120)),
    )


def _autoscaling(raw: dict[str, Any] | None) -> AutoscalingPolicy | None:
    """`spec.autoscaling` (already checked against the schema); `ConfigError` names a cross-field problem."""
    if raw is None:
        return None
    return AutoscalingPolicy(min_replicas=raw["minReplicas"], max_replicas=raw["maxReplicas"],
                             target_utilization=float(raw["targetUtilization"]),
                             scale_up_stabilization_s=float(raw["scaleUpStabilizationSeconds"]),
                             scale_down_stabilization_s=float(raw["scaleDownStabilizationSeconds"]),
                             shed_step=raw["shedStep"], drain_grace_s=float(raw["drainGracePeriodSeconds"]),
                             field_prefix="spec.autoscaling")
