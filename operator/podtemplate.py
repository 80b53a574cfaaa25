"""User pod templates (`spec.template`, `spec.router.template`) merged onto the pods the operator renders.

Why a module of its own: platform teams need scheduling and plumbing the operator cannot foresee —
node selectors, tolerations, affinity, pull secrets, service accounts, runtime and priority classes,
extra env, volumes and sidecars — while the operator must keep the fields that make a pipeline group
work: the command and its flags, the torch.distributed rendezvous env, ports, probes, the labels its
selectors, Services and NetworkPolicies match, and its own volumes. This module says which fields are
whose, finds a template that sets an operator-owned field (`spec.py` rejects it, naming the field),
and merges the rest. Pure functions on plain dicts, so `render.py` stays a function of the spec and the
rules are unit-tested directly.

Merge rules (docs/kubernetes.md, "Pod templates"):
- maps (nodeSelector, affinity, securityContext, resources.requests / .limits, ...) merge key by key,
  the template's value winning; scalars and other lists are the template's;
- lists merge by key: containers, initContainers, volumes, imagePullSecrets and env by `name`,
  volumeMounts by `mountPath`; tolerations and envFrom are appended; new entries come after the
  operator's, entries with an operator entry's key are merged into it (containers) or replace it (env);
- operator-owned fields are never taken from the template (`merge_pod` keeps the operator's value,
  `owned_field_problems` reports the attempt): the operator containers' `image`, `command`, `args`,
  `ports` and probes, the rendezvous env vars, `nvidia.com/gpu` resources, the operator's volumes and
  mount paths, the pod's `restartPolicy` / `hostname` / `subdomain`, and the labels and annotations
  the operator sets.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

Manifest = dict[str, Any]
Problem = tuple[str, str]  # (field path, message)

WORKER = "worker"  # the stage pods' container, which `spec.template`'s container of that name merges into
ROUTER = "router"  # the router pods' container, for `spec.router.template`
MAKE_MODEL = "make-model"  # the init container writing `preset://` models, in stage and router pods
RENDEZVOUS_ENV = frozenset({"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
OWNED = "is operator-owned and cannot be set in a template"
# field -> why it is the operator's (the error message's tail)
OWNED_CONTAINER_FIELDS: dict[str, str] = {
    "image": "set spec.image instead",
    "command": "the process contract, docs/cli-contract.md",
    "args": "derived from spec.model, .scheduler, .slo and .observability",
    "ports": "Services, probes and NetworkPolicies use them",
    "startupProbe": "it gives model loading its time",
    "readinessProbe": "readiness decides which groups the router uses",
    "livenessProbe": "the operator's health contract",
}
OWNED_POD_FIELDS: dict[str, str] = {
    "restartPolicy": "stage pods never restart in place; the whole group is recreated",
    "hostname": "stage DNS names are the rendezvous addresses",
    "subdomain": "the headless stages Service",
}
OWNED_RESOURCES = frozenset({"nvidia.com/gpu"})
KERNEL_CACHE_VOLUME = "kernel-cache"  # `spec.kernelCache`, in stage pods
KERNEL_CACHE_DIR = "/var/cache/chariot/kernels"  # its mount point, `CHARIOT_KERNEL_CACHE` in the worker
AUTH_VOLUME, AUTH_DIR = "api-keys", "/etc/chariot-auth"  # `spec.router.auth`'s Secret, in router pods
TLS_VOLUME, TLS_DIR = "tls", "/etc/chariot-tls"  # `spec.router.tls`'s Secret, in router pods
OWNED_VOLUMES = frozenset({"model", "tmp", "shm", "config", KERNEL_CACHE_VOLUME, AUTH_VOLUME, TLS_VOLUME})
OWNED_MOUNT_PATHS = frozenset({"/tmp", "/dev/shm", "/etc/chariot", KERNEL_CACHE_DIR, AUTH_DIR, TLS_DIR})
MODELS_DIR = "/models"  # the model volume's mount point (and below it, `pvc://CLAIM` mounts)
OWNED_LABELS = frozenset({"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/part-of",
                          "app.kubernetes.io/managed-by", "app.kubernetes.io/component"})
OWNED_ANNOTATIONS = frozenset({"prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path",
                               "prometheus.io/scheme"})
OWNED_KEY_PREFIX = "chariot.dev/"  # every label and annotation under it (selector labels, config hashes)
KEYED_LISTS: dict[str, str] = {"containers": "name", "initContainers": "name", "volumes": "name",
                               "imagePullSecrets": "name", "env": "name", "volumeMounts": "mountPath"}


@dataclass(frozen=True)
class PodTemplate:
    """A validated PodTemplateSpec, kept as canonical JSON: the `Spec` holding it stays immutable and
    hashable, and every `body()` is a fresh copy that no merge can alter."""

    json_text: str = "{}"

    @classmethod
    def of(cls, raw: Manifest | None) -> PodTemplate:
        return cls(json.dumps(raw or {}, sort_keys=True, separators=(",", ":")))

    def body(self) -> Manifest:
        value: Manifest = json.loads(self.json_text)
        return value


# --- validation ----------------------------------------------------------------------------------

def owned_field_problems(template: Manifest, path: str, main_container: str) -> list[Problem]:
    """Every operator-owned field `template` sets, and every duplicate list key, as (path, message).

    `template` has passed the CRD schema (so lists hold objects with their keys); `main_container` is
    the operator's container the template's same-named container merges into (`worker` or `router`)."""
    meta, spec = template.get("metadata") or {}, template.get("spec") or {}
    problems = [*_key_problems(meta.get("labels") or {}, f"{path}.metadata.labels", OWNED_LABELS),
                *_key_problems(meta.get("annotations") or {}, f"{path}.metadata.annotations", OWNED_ANNOTATIONS),
                *[(f"{path}.spec.{k}", f"{OWNED} ({why})") for k, why in OWNED_POD_FIELDS.items() if k in spec],
                *_duplicate_problems(spec, f"{path}.spec")]
    for volume in spec.get("volumes") or []:
        if volume["name"] in OWNED_VOLUMES:
            problems.append((f"{path}.spec.volumes[{volume['name']}]",
                             f"{OWNED} (the operator's volumes: {', '.join(sorted(OWNED_VOLUMES))})"))
    for field in ("containers", "initContainers"):
        for container in spec.get(field) or []:
            if container["name"] in (main_container, MAKE_MODEL):
                problems += container_problems(container, f"{path}.spec.{field}[{container['name']}]")
            problems += _duplicate_problems(container, f"{path}.spec.{field}[{container['name']}]")
    return problems


def container_problems(container: Manifest, path: str) -> list[Problem]:
    """Operator-owned fields set on a template container that merges into an operator container."""
    problems = [(f"{path}.{k}", f"{OWNED} ({why})")
                for k, why in OWNED_CONTAINER_FIELDS.items() if k in container]
    for env in container.get("env") or []:
        if env["name"] in RENDEZVOUS_ENV:
            problems.append((f"{path}.env[{env['name']}]", f"{OWNED} (the torch.distributed rendezvous: "
                                                          "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"))
    for mount in container.get("volumeMounts") or []:
        if owned_mount_path(mount["mountPath"]):
            problems.append((f"{path}.volumeMounts[{mount['mountPath']}]",
                             f"{OWNED} (the operator's mount paths: {', '.join(sorted(OWNED_MOUNT_PATHS))} and "
                             f"{MODELS_DIR} and below)"))
    resources = container.get("resources") or {}
    for kind in ("requests", "limits"):
        for name in OWNED_RESOURCES & set(resources.get(kind) or {}):
            problems.append((f"{path}.resources.{kind}.{name}", f"{OWNED} (set spec.resources.gpusPerStage)"))
    return problems


def owned_mount_path(mount_path: str) -> bool:
    path = mount_path.rstrip("/") or "/"
    return path in OWNED_MOUNT_PATHS or path == MODELS_DIR or path.startswith(f"{MODELS_DIR}/")


def _key_problems(mapping: Manifest, path: str, owned: frozenset[str]) -> list[Problem]:
    return [(f"{path}.{key}", f"{OWNED} (the operator's selectors and bookkeeping use it)")
            for key in mapping if key in owned or key.startswith(OWNED_KEY_PREFIX)]


def _duplicate_problems(obj: Manifest, path: str) -> list[Problem]:
    """Lists merged by key must not repeat a key (which entry would win?)."""
    problems = []
    for field, key in KEYED_LISTS.items():
        seen: set[str] = set()
        for entry in obj.get(field) or []:
            if not isinstance(entry, dict) or key not in entry:
                continue
            if entry[key] in seen:
                problems.append((f"{path}.{field}[{entry[key]}]", f"duplicate {key}"))
            seen.add(entry[key])
    return problems


# --- merging -------------------------------------------------------------------------------------

def merge_pod(base: Manifest, template: Manifest) -> Manifest:
    """`base` (a Pod, or a Deployment's pod template: `metadata` + `spec`) with `template` merged onto it,
    operator-owned fields kept from `base`. An empty template returns an equal copy of `base`."""
    out = dict(base)
    meta = merge_metadata(base.get("metadata") or {}, template.get("metadata") or {})
    if meta or "metadata" in base:
        out["metadata"] = meta
    out["spec"] = merge_pod_spec(base["spec"], template.get("spec") or {})
    return out


def merge_metadata(base: Manifest, template: Manifest) -> Manifest:
    """Labels and annotations are added; the operator's keys keep the operator's values."""
    out = dict(base)
    for field in ("labels", "annotations"):
        if template.get(field):
            out[field] = {**template[field], **(base.get(field) or {})}
    return out


def merge_pod_spec(base: Manifest, template: Manifest) -> Manifest:
    out = dict(base)
    for key, value in template.items():
        if key in OWNED_POD_FIELDS:
            continue
        if key in ("containers", "initContainers"):
            out[key] = merge_by_key(base.get(key) or [], value, "name", merge_container)
        elif key == "volumes":  # the operator's volumes win
            out[key] = merge_by_key(base.get(key) or [], value, "name", _keep_base)
        elif key == "imagePullSecrets":
            out[key] = merge_by_key(base.get(key) or [], value, "name", _take_template)
        elif key == "tolerations":
            out[key] = append_new(base.get(key) or [], value)
        else:
            out[key] = deep_merge(base.get(key), value)
    return out


def merge_container(base: Manifest, template: Manifest) -> Manifest:
    """An operator container with the same-named template container merged in (owned fields kept)."""
    out = dict(base)
    for key, value in template.items():
        if key == "name" or key in OWNED_CONTAINER_FIELDS:
            continue
        if key == "env":
            out[key] = merge_by_key(base.get(key) or [], value, "name", _merge_env)
        elif key == "envFrom":
            out[key] = [*(base.get(key) or []), *value]
        elif key == "volumeMounts":  # the operator's mount paths win
            out[key] = merge_by_key(base.get(key) or [], value, "mountPath", _keep_base)
        elif key == "resources":
            out[key] = merge_resources(base.get(key) or {}, value)
        else:
            out[key] = deep_merge(base.get(key), value)
    return out


def merge_resources(base: Manifest, template: Manifest) -> Manifest:
    """Requests and limits merge by resource name, the template winning, except `nvidia.com/gpu`."""
    out = deep_merge(base, template)
    for kind in ("requests", "limits"):
        if kind not in out:
            continue
        owned = {r: q for r, q in (base.get(kind) or {}).items() if r in OWNED_RESOURCES}
        out[kind] = {**{r: q for r, q in out[kind].items() if r not in OWNED_RESOURCES}, **owned}
    return out


def merge_by_key(base: list[Manifest], template: Iterable[Manifest], key: str,
                 combine: Callable[[Manifest, Manifest], Manifest]) -> list[Manifest]:
    """`base` entries in order, each combined with the template entry of the same key; then the template's
    new entries, in the template's order."""
    by_key = {t.get(key): t for t in template}
    known = {b.get(key) for b in base}
    merged = [combine(b, by_key[b.get(key)]) if b.get(key) in by_key else b for b in base]
    return merged + [_copy(t) for k, t in by_key.items() if k not in known]


def append_new(base: list[Any], template: Iterable[Any]) -> list[Any]:
    """`base` followed by the template's entries it does not already hold."""
    return [*base, *(_copy(t) for t in template if t not in base)]


def deep_merge(base: Any, template: Any) -> Any:
    """Maps merge key by key (recursively), the template winning; anything else is the template's value."""
    if not isinstance(base, dict) or not isinstance(template, dict):
        return _copy(template)
    out = dict(base)
    for key, value in template.items():
        out[key] = deep_merge(base.get(key), value)
    return out


def _merge_env(base: Manifest, template: Manifest) -> Manifest:
    return base if base["name"] in RENDEZVOUS_ENV else _copy(template)


def _keep_base(base: Manifest, template: Manifest) -> Manifest:
    return base


def _take_template(base: Manifest, template: Manifest) -> Manifest:
    return _copy(template)


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value
