"""A Kubernetes API server good enough for the real `kubectl` and the operator: kmock's emulator, fixed.

Why: no kube-apiserver (nor kind/k3s/Docker) can be installed here (docs/architecture.md §8), but the operator
must be exercised through a real API — `kubectl apply` of the real CRD and example, kopf's watches,
finalizers, status and scale subresources. kmock 0.8's `KubernetesEmulator` supplies the server
harness, API discovery (with its bundled built-in resource list) and error rendering; this subclass
serves every object request itself, because stock 0.8 cannot:

- register CRDs when they are created (and drop them when deleted);
- assign `uid`, `resourceVersion` (one cluster-wide counter), `creationTimestamp`, `generation`
  (bumped only when something outside metadata/status changes), `generateName`;
- give list responses `kind`/`apiVersion`/`metadata.resourceVersion`; fix the core group's
  `groupVersion` (`v1`, not `/v1`); parse `/api/v1/namespaces[/NAME]`;
- serve watches as `application/json` event streams, resuming from `resourceVersion` (or sending the
  current objects first), honouring `timeoutSeconds` and label/field selectors;
- isolate the `status` subresource (a main-resource write keeps the old status; a `/status` write
  changes only status) and serve `scale` as `autoscaling/v1` `Scale` objects;
- filter by label selectors (`=`, `==`, `!=`, `in`, `notin`, exists, `!`) and by
  `metadata.name` / `metadata.namespace` field selectors;
- accept JSON patches, merge patches and strategic merge patches (treated as merge patches, `$`-
  directives dropped), and PUT (with the resourceVersion precondition);
- finalizers: a DELETE marks `deletionTimestamp`; the object goes when the last finalizer does.

For tests, `slow_lists` makes label-selected (non-watch) list requests of a resource take that long
and `lists_in_flight` counts them while they are served: a slow API server on demand, for the
operator's lists only (the test kubelet lists without a selector).

Still missing, on purpose (the operator must not rely on them): garbage collection via
ownerReferences, controllers (a Deployment makes no pods: the test kubelet plays that part), graceful
pod termination (pods go at once), server-side apply, CRD schema defaulting/validation/pruning,
admission. Pods get `status.phase: Pending` on creation, as the real server does.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import datetime as dt
import json
import random
import re
import string
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Target:
    """What an object URL addresses."""

    group: str
    version: str
    plural: str
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


def parse_target(path: str) -> Target | None:
    """Object/collection URLs only; discovery URLs (`/api`, `/apis/g/v`, ...) give None."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 3 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    return Target(group, version, rest[0], namespace, rest[1] if len(rest) > 1 else None,
                  "/".join(rest[2:]) or None)


# --- selectors -----------------------------------------------------------------------------------

def _split_terms(selector: str) -> list[str]:
    terms, depth, cur = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [t for t in [*terms, cur.strip()] if t]


def label_match(selector: str | None, labels: dict[str, str]) -> bool:
    for term in _split_terms(selector or ""):
        m = re.fullmatch(r"([\w./-]+)\s+(in|notin)\s+\((.*)\)", term)
        if m:
            values = {v.strip() for v in m.group(3).split(",")}
            if (labels.get(m.group(1)) in values) != (m.group(2) == "in"):
                return False
        elif "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def field_match(selector: str | None, obj: Manifest) -> bool:
    meta = obj.get("metadata", {})
    fields = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace")}
    for term in _split_terms(selector or ""):
        negate = "!=" in term
        key, value = re.split(r"!=|==|=", term, maxsplit=1)
        if key.strip() not in fields:
            continue  # other fields: not filtered (a documented gap)
        if (fields[key.strip()] == value.strip()) == negate:
            return False
    return True


# --- helpers -------------------------------------------------------------------------------------

def now_rfc3339() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, ignoring strategic-merge `$` directives."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    return aiohttp.web.json_response({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                                      "code": code, "reason": reason, "message": message}, status=code)


class ApiProblem(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    """kmock's emulator with the fixes listed in the module docstring. Objects live in kmock's
    `objects` array (with their full history, handy in assertions)."""

    _rv: int = attrs.field(default=0, init=False)
    _events: list[tuple[int, kmock.resource, Manifest]] = attrs.field(factory=list, init=False)
    _changed: asyncio.Condition | None = attrs.field(default=None, init=False)
    slow_lists: dict[str, float] = attrs.field(factory=dict, init=False)  # plural -> seconds
    lists_in_flight: collections.Counter[str] = attrs.field(factory=collections.Counter, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources.load_bundled()
        self.fallback["get /openapi/v2"] << (lambda: _status(404, "NotFound", "no OpenAPI here"))
        self.fallback["get /openapi/v3"] << (lambda: _status(404, "NotFound", "no OpenAPI here"))

    # --- entry -----------------------------------------------------------------------------------

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        target = parse_target(raw.path)
        if target is None:
            return await super().__call__(raw)
        if self._changed is None:
            self._changed = asyncio.Condition()
        try:
            return await self._serve(raw, target)
        except ApiProblem as p:
            return _status(p.code, p.reason, p.message)

    async def _serve(self, raw: aiohttp.web.BaseRequest, t: Target) -> aiohttp.web.StreamResponse:
        info = self._info(t)
        q = raw.query
        if raw.method == "GET" and q.get("watch") in ("true", "1"):
            return await self._watch(raw, t, info)
        body = await self._body(raw)
        if raw.method == "GET":
            result = await self._slow_list(t, info, q) if t.name is None else self._read(t)
            if "as=Table" in raw.headers.get("Accept", "") and t.subresource is None:
                result = self._table(result)
        elif raw.method == "POST" and t.name is None:
            result = await self._create(t, info, body or {})
        elif raw.method in ("PATCH", "PUT") and t.name is not None:
            result = await self._write(t, info, body, raw.method, raw.headers.get("Content-Type", ""))
        elif raw.method == "DELETE" and t.name is not None:
            result = await self._delete(t)
        else:
            raise ApiProblem(405, "MethodNotAllowed", f"{raw.method} {raw.path} is not supported here")
        return aiohttp.web.json_response(result, status=201 if raw.method == "POST" else 200)

    @staticmethod
    async def _body(raw: aiohttp.web.BaseRequest) -> Any:
        if not raw.can_read_body:
            return None
        data = await raw.read()
        if not data.strip():
            return None
        try:
            return json.loads(data)
        except ValueError as exc:
            raise ApiProblem(415, "UnsupportedMediaType",
                             f"only JSON bodies are emulated, got {raw.headers.get('Content-Type')}") from exc

    def _info(self, t: Target) -> kmock.ResourceInfo:
        res = kmock.resource(t.group, t.version, t.plural)
        if res not in self.resources:
            raise ApiProblem(404, "NotFound", f"the server could not find the requested resource {t.plural}")
        return self.resources[res]

    # --- storage ---------------------------------------------------------------------------------

    def _key(self, t: Target, name: str | None = None) -> tuple[kmock.resource, str | None, str]:
        return (kmock.resource(t.group, t.version, t.plural), t.namespace, name or t.name or "")

    def _get(self, t: Target) -> Manifest | None:
        key = self._key(t)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    def _must_get(self, t: Target) -> Manifest:
        obj = self._get(t)
        if obj is None:
            raise ApiProblem(404, "NotFound", f'{t.plural} "{t.name}" not found')
        return obj

    async def _store(self, t: Target, obj: Manifest, event: str) -> Manifest:
        key = self._key(t, obj["metadata"]["name"])
        res = key[0]
        if event == "DELETED":
            self.objects[key].delete()
        elif key in self.objects:
            self.objects[key].create(obj)
        else:
            self.objects[key] = obj
        self._events.append((self._rv, res, {"type": event, "object": copy.deepcopy(obj)}))
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()
        return obj

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    # --- verbs -----------------------------------------------------------------------------------

    def _list(self, t: Target, info: kmock.ResourceInfo, q: Any) -> Manifest:
        items = [copy.deepcopy(obj.raw) for key, obj in self.objects.items()
                 if key[0] == kmock.resource(t.group, t.version, t.plural) and not obj.deleted
                 and (t.namespace is None or key[1] == t.namespace)]
        items = [i for i in items if label_match(q.get("labelSelector"), i["metadata"].get("labels") or {})
                 and field_match(q.get("fieldSelector"), i)]
        return {"apiVersion": t.api_version, "kind": f"{info.kind}List",
                "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    async def _slow_list(self, t: Target, info: kmock.ResourceInfo, q: Any) -> Manifest:
        if not q.get("labelSelector"):
            return self._list(t, info, q)
        self.lists_in_flight[t.plural] += 1
        try:
            await asyncio.sleep(self.slow_lists.get(t.plural, 0.0))
            return self._list(t, info, q)
        finally:
            self.lists_in_flight[t.plural] -= 1

    def _read(self, t: Target) -> Manifest:
        obj = self._must_get(Target(t.group, t.version, t.plural, t.namespace, t.name))
        return self._scale_of(t, obj) if t.subresource == "scale" else obj

    async def _create(self, t: Target, info: kmock.ResourceInfo, body: Manifest) -> Manifest:
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        if not meta.get("name"):
            raise ApiProblem(422, "Invalid", "metadata.name: Required value")
        if info.namespaced:
            t = Target(t.group, t.version, t.plural, t.namespace or meta.get("namespace") or "default")
            meta["namespace"] = t.namespace
        if self._get(Target(t.group, t.version, t.plural, t.namespace, meta["name"])) is not None:
            raise ApiProblem(409, "AlreadyExists", f'{t.plural} "{meta["name"]}" already exists')
        meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(), creationTimestamp=now_rfc3339(),
                    generation=1)
        body.setdefault("apiVersion", t.api_version)
        body.setdefault("kind", info.kind)
        if t.plural == "pods":
            body.setdefault("status", {"phase": "Pending"})
        if t.plural == "customresourcedefinitions":
            self._register_crd(body)
        return await self._store(t, body, "ADDED")

    async def _write(self, t: Target, info: kmock.ResourceInfo, body: Any, method: str, ctype: str) -> Manifest:
        base = Target(t.group, t.version, t.plural, t.namespace, t.name)
        old = self._must_get(base)
        if t.subresource == "scale":
            new = self._apply_scale(old, body, method, ctype)
        else:
            new = self._patched(old, body, method, ctype)
            new = self._isolate_status(old, new, info, t.subresource)
        new["metadata"].update({k: old["metadata"][k] for k in ("uid", "creationTimestamp", "name")})
        if t.namespace:
            new["metadata"]["namespace"] = t.namespace
        if new == old:
            return self._scale_of(t, old) if t.subresource == "scale" else old
        if _spec_part(new) != _spec_part(old):
            new["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
        new["metadata"]["resourceVersion"] = self._next_rv()
        done = new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers")
        await self._store(base, new, "DELETED" if done else "MODIFIED")
        if done and t.plural == "customresourcedefinitions":
            self._unregister_crd(new)
        return self._scale_of(t, new) if t.subresource == "scale" else new

    def _patched(self, old: Manifest, body: Any, method: str, ctype: str) -> Manifest:
        if method == "PUT":
            rv = (body.get("metadata") or {}).get("resourceVersion")
            if rv and rv != old["metadata"].get("resourceVersion"):
                raise ApiProblem(409, "Conflict", "the object has been modified; please apply your changes to the "
                                                  "latest version and try again")
            return copy.deepcopy(body)
        if "apply-patch" in ctype:
            raise ApiProblem(415, "UnsupportedMediaType", "server-side apply is not emulated")
        if "json-patch" in ctype or isinstance(body, list):
            return jsonpatch.apply_patch(copy.deepcopy(old), body)
        return merge_patch(old, body)

    @staticmethod
    def _isolate_status(old: Manifest, new: Manifest, info: kmock.ResourceInfo, sub: str | None) -> Manifest:
        """With a status subresource, main writes keep the old status and /status writes change only status."""
        if "status" not in info.subresources:
            return new
        if sub == "status":
            out = copy.deepcopy(old)
            out["status"] = new.get("status")
            if out["status"] is None:
                out.pop("status")
            return out
        out = dict(new)
        if "status" in old:
            out["status"] = copy.deepcopy(old["status"])
        else:
            out.pop("status", None)
        return out

    def _apply_scale(self, old: Manifest, body: Any, method: str, ctype: str) -> Manifest:
        paths = self._scale_paths(old)
        replicas = self._patched(self._scale_of(None, old, paths), body, method, ctype)["spec"]["replicas"]
        new = copy.deepcopy(old)
        _set_path(new, paths["specReplicasPath"], replicas)
        return new

    def _scale_paths(self, obj: Manifest) -> dict[str, str]:
        if obj.get("kind") == "Deployment":
            return {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas"}
        crd = self._crd_for(obj)
        for version in (crd or {}).get("spec", {}).get("versions", []):
            scale = (version.get("subresources") or {}).get("scale")
            if scale:
                return dict(scale)
        raise ApiProblem(404, "NotFound", "no scale subresource")

    def _scale_of(self, t: Target | None, obj: Manifest, paths: dict[str, str] | None = None) -> Manifest:
        paths = paths or self._scale_paths(obj)
        meta = obj["metadata"]
        status = {"replicas": _get_path(obj, paths["statusReplicasPath"]) or 0}
        if paths.get("labelSelectorPath"):
            status["selector"] = _get_path(obj, paths["labelSelectorPath"]) or ""
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                             if k in meta},
                "spec": {"replicas": _get_path(obj, paths["specReplicasPath"]) or 0}, "status": status}

    async def _delete(self, t: Target) -> Manifest:
        obj = self._must_get(t)
        meta = obj["metadata"]
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = now_rfc3339()
                meta["deletionGracePeriodSeconds"] = 0
                meta["resourceVersion"] = self._next_rv()
                await self._store(t, obj, "MODIFIED")
            return obj
        meta["resourceVersion"] = self._next_rv()
        await self._store(t, obj, "DELETED")
        if t.plural == "customresourcedefinitions":
            self._unregister_crd(obj)
        return obj

    def _table(self, result: Manifest) -> Manifest:
        """Server-side printing (`kubectl get`): Name, the CRD's printer columns (or Age for built-ins)."""
        items = result.get("items", [result]) if result.get("kind", "").endswith("List") else [result]
        crd = self._crd_for(items[0]) if items else None
        columns = [{"name": "Name", "type": "string", "format": "name", "priority": 0}]
        printer = next((v.get("additionalPrinterColumns") for v in (crd or {}).get("spec", {}).get("versions", [])
                        if v.get("additionalPrinterColumns")), None) or [
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
        columns += [{"name": c["name"], "type": c["type"], "format": "", "priority": c.get("priority", 0),
                     "description": c.get("description", "")} for c in printer]
        rows = [{"cells": [i["metadata"]["name"], *(_cell(i, c) for c in printer)],
                 "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                            "metadata": i["metadata"]}} for i in items]
        return {"kind": "Table", "apiVersion": "meta.k8s.io/v1",
                "metadata": {"resourceVersion": str(self._rv)}, "columnDefinitions": columns, "rows": rows}

    # --- watch -----------------------------------------------------------------------------------

    async def _watch(self, raw: aiohttp.web.BaseRequest, t: Target, info: kmock.ResourceInfo) -> Any:
        q = raw.query
        res = kmock.resource(t.group, t.version, t.plural)
        resp = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(raw)
        since = q.get("resourceVersion")
        position = len(self._events)

        def wanted(obj: Manifest) -> bool:
            meta = obj.get("metadata", {})
            return ((t.namespace is None or meta.get("namespace") == t.namespace)
                    and (t.name is None or meta.get("name") == t.name)
                    and label_match(q.get("labelSelector"), meta.get("labels") or {})
                    and field_match(q.get("fieldSelector"), obj))

        if not since or since == "0" or q.get("sendInitialEvents") == "true":
            for item in self._list(t, info, q)["items"]:
                if wanted(item):
                    await resp.write(json.dumps({"type": "ADDED", "object": item}).encode() + b"\n")
            if q.get("sendInitialEvents") == "true":
                bookmark = {"kind": info.kind, "apiVersion": t.api_version, "metadata": {
                    "resourceVersion": str(self._rv), "annotations": {"k8s.io/initial-events-end": "true"}}}
                await resp.write(json.dumps({"type": "BOOKMARK", "object": bookmark}).encode() + b"\n")
        else:
            position = next((i for i, (rv, _, _) in enumerate(self._events) if rv > int(since)), len(self._events))
        timeout = float(q.get("timeoutSeconds") or 3600)
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError, RuntimeError):
            await asyncio.wait_for(self._stream(resp, res, position, wanted), timeout)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await resp.write_eof()
        return resp

    async def _stream(self, resp: aiohttp.web.StreamResponse, res: kmock.resource, position: int,
                      wanted: Any) -> None:
        assert self._changed is not None
        while True:
            while position < len(self._events):
                _, event_res, event = self._events[position]
                position += 1
                if event_res == res and wanted(event["object"]):
                    await resp.write(json.dumps(event).encode() + b"\n")
            async with self._changed:
                await self._changed.wait_for(lambda p=position: p < len(self._events))

    # --- CRDs ------------------------------------------------------------------------------------

    def _register_crd(self, crd: Manifest) -> None:
        spec = crd["spec"]
        names = spec["names"]
        crd["status"] = {"acceptedNames": names, "storedVersions": [v["name"] for v in spec["versions"]
                                                                    if v.get("storage")],
                         "conditions": [{"type": t, "status": "True", "reason": "InitialNamesAccepted"
                                         if t == "NamesAccepted" else t, "lastTransitionTime": now_rfc3339()}
                                        for t in ("NamesAccepted", "Established")]}
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            self.resources[kmock.resource(spec["group"], version["name"], names["plural"])] = kmock.ResourceInfo(
                namespaced=spec.get("scope") == "Namespaced", kind=names["kind"],
                singular=names.get("singular", names["kind"].lower()), shortnames=names.get("shortNames", []),
                categories=names.get("categories", []), subresources=set(version.get("subresources") or {}),
                verbs=["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"])

    def _unregister_crd(self, crd: Manifest) -> None:
        spec = crd["spec"]
        for version in spec["versions"]:
            res = kmock.resource(spec["group"], version["name"], spec["names"]["plural"])
            if res in self.resources:
                del self.resources[res]

    def _crd_for(self, obj: Manifest) -> Manifest | None:
        group = obj.get("apiVersion", "").rpartition("/")[0]
        for key, stored in self.objects.items():
            if key[0].plural == "customresourcedefinitions" and not stored.deleted:
                raw = stored.raw
                if raw["spec"]["group"] == group and raw["spec"]["names"]["kind"] == obj.get("kind"):
                    return raw
        return None

    # --- discovery fix -----------------------------------------------------------------------------

    async def _serve_version(self, request: kmock.Request) -> Any:
        payload = await super()._serve_version(request)
        if isinstance(payload, dict):
            if payload.get("groupVersion", "").startswith("/"):
                payload["groupVersion"] = payload["groupVersion"][1:]
            for entry in payload.get("resources", []):
                if "/" in entry["name"]:
                    entry.update(shortNames=[], categories=[])
                if entry["name"].endswith("/scale"):
                    entry.update(kind="Scale", group="autoscaling", version="v1", verbs=["get", "patch", "update"])
                elif "/" in entry["name"]:
                    entry["verbs"] = ["get", "patch", "update"]
        return payload


def _spec_part(obj: Manifest) -> Manifest:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _cell(obj: Manifest, column: Manifest) -> Any:
    value = _json_path(obj, column["jsonPath"])
    if column["type"] == "date" and value:
        age = dt.datetime.now(dt.timezone.utc) - dt.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(
            tzinfo=dt.timezone.utc)
        return f"{int(age.total_seconds())}s"
    return value


def _json_path(obj: Manifest, path: str) -> Any:
    """The JSONPath subset printer columns use: `.a.b` and `.a[?(@.k=="v")].b`."""
    m = re.fullmatch(r'(.*)\[\?\(@\.(\w+)=="([^"]*)"\)\](.*)', path)
    if not m:
        value = _get_path(obj, path)
        return value if value is not None else None
    items = _get_path(obj, m.group(1)) or []
    hit = next((i for i in items if isinstance(i, dict) and i.get(m.group(2)) == m.group(3)), None)
    return _get_path(hit, m.group(4)) if hit is not None else None


def _get_path(obj: Manifest, path: str) -> Any:
    cur: Any = obj
    for part in path.strip(".").split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    return cur


def _set_path(obj: Manifest, path: str, value: Any) -> None:
    parts = path.strip(".").split(".")
    cur = obj
    for part in parts[:-1]:
        cur = cur.setdefault(part, {})
    cur[parts[-1]] = value


# --- running it from synchronous tests -------------------------------------------------------------

@dataclass
class RunningEmulator:
    emulator: KubeEmulator
    url: str
    loop: asyncio.AbstractEventLoop

    def kubeconfig(self, namespace: str = "default") -> str:
        return json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "emulator"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester",
                                                          "namespace": namespace}}],
        })

    def position(self) -> int:
        """A marker for `events_since`: how many watch events the server has produced so far."""
        return len(self.emulator._events)

    def slow_lists(self, plural: str, seconds: float) -> None:
        """From now on, label-selected lists of `plural` take `seconds` (0: fast again)."""
        async def set_() -> None:
            self.emulator.slow_lists[plural] = seconds
        asyncio.run_coroutine_threadsafe(set_(), self.loop).result(10)

    def lists_in_flight(self, plural: str) -> int:
        async def read() -> int:
            return self.emulator.lists_in_flight[plural]
        return asyncio.run_coroutine_threadsafe(read(), self.loop).result(10)

    def events_since(self, position: int, plural: str) -> list[Manifest]:
        """Watch events (`{"type", "object"}`) of one resource produced after `position`, in order."""
        async def read() -> list[Manifest]:
            return [copy.deepcopy(e) for _, res, e in self.emulator._events[position:] if res.plural == plural]
        return asyncio.run_coroutine_threadsafe(read(), self.loop).result(10)

    def history(self, kind_path: str, namespace: str | None, name: str) -> list[Manifest | None]:
        """All stored versions of an object (None marks a deletion), read on the server's loop."""
        async def read() -> list[Manifest | None]:
            key = (kmock.resource(kind_path), namespace, name)
            if key not in self.emulator.objects:
                return []
            return [None if v is None else copy.deepcopy(v.raw) for v in self.emulator.objects[key].history]
        return asyncio.run_coroutine_threadsafe(read(), self.loop).result(10)


@contextlib.contextmanager
def running_emulator() -> Iterator[RunningEmulator]:
    """Serve a fresh emulator on a free loopback port from a background thread's event loop."""
    loop = asyncio.new_event_loop()
    started: dict[str, Any] = {}
    ready = threading.Event()
    stop = asyncio.Event()

    async def main() -> None:
        emulator = KubeEmulator()
        async with emulator, kmock.Server(emulator) as server:
            started.update(emulator=emulator, url=f"http://{server.host}:{server.port}")
            ready.set()
            await stop.wait()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(main())
        except BaseException as exc:  # surface start-up failures to the waiting thread
            started["error"] = exc
            ready.set()

    thread = threading.Thread(target=run, name="kube-emulator", daemon=True)
    thread.start()
    if not ready.wait(30) or "error" in started:
        raise RuntimeError(f"emulator did not start: {started.get('error')!r}")
    try:
        yield RunningEmulator(started["emulator"], started["url"], loop)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)


__all__ = ["KubeEmulator", "RunningEmulator", "Target", "label_match", "parse_target", "running_emulator"]
