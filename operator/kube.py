"""A small JSON-over-REST Kubernetes client: the only place the operator talks to the API server.

Why not the typed `kubernetes` APIs: the operator handles five kinds the same way (get, list by
label, create, merge-patch, delete), and plain camelCase dicts are what the pure renderers produce
and the tests read. The `kubernetes` package still does the hard part — in-cluster service-account
or KUBECONFIG credentials, TLS, proxies, exec plugins — through its `ApiClient`; this module uses only
the parts of it that every supported release shares (its `configuration`: host and bearer token,
refreshed by exec plugins; its urllib3 pool with the TLS settings), not the generated request
helpers, whose signatures changed between releases (`ApiClient.param_serialize` exists from 37 on).
The floor in pyproject is tested: `tests/e2e/test_kube_floor.py` runs this client from a virtualenv
holding the oldest supported `kubernetes` against the API emulator.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import urllib3

from chariot.operator import crd

Manifest = dict[str, Any]

# kind -> (API prefix, plural)
KINDS: dict[str, tuple[str, str]] = {
    "Pod": ("/api/v1", "pods"),
    "Service": ("/api/v1", "services"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "Node": ("/api/v1", "nodes"),  # cluster-scoped: a Ref with namespace ""
    "Event": ("/api/v1", "events"),
    "HorizontalPodAutoscaler": ("/apis/autoscaling/v2", "horizontalpodautoscalers"),
    crd.KIND: (f"/apis/{crd.API_VERSION}", crd.PLURAL),
}
MERGE_PATCH = "application/merge-patch+json"


class ApiError(Exception):
    """A non-2xx answer from the API server (`status` 0: no answer at all)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status

    @property
    def transient(self) -> bool:
        return self.status in (0, 409, 429) or self.status >= 500


@dataclass(frozen=True)
class Ref:
    kind: str
    namespace: str
    name: str | None = None

    def path(self, subresource: str | None = None) -> str:
        prefix, plural = KINDS[self.kind]
        out = f"{prefix}/namespaces/{quote(self.namespace)}/{plural}" if self.namespace else f"{prefix}/{plural}"
        if self.name:
            out += f"/{quote(self.name)}"
        return out + (f"/{subresource}" if subresource else "")


def load_api_client() -> Any:
    """In-cluster service-account credentials when running in a pod, else KUBECONFIG / ~/.kube/config."""
    from kubernetes import client, config

    if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        config.load_incluster_config()
    else:
        config.load_kube_config()
    return client.ApiClient()


class Kube:
    """Synchronous calls through a `kubernetes.client.ApiClient` (thread-safe: kopf runs sync handlers
    in a thread pool)."""

    def __init__(self, api_client: Any, timeout_s: float = 30.0) -> None:
        self.api = api_client
        self.timeout_s = timeout_s

    def request(self, method: str, path: str, body: Any = None, query: dict[str, str] | None = None,
                content_type: str = "application/json") -> Manifest:
        config = self.api.configuration
        url = config.host.rstrip("/") + path + (f"?{urlencode(query)}" if query else "")
        headers = {"Accept": "application/json", "Content-Type": content_type, "User-Agent": "chariot-operator"}
        for auth in config.auth_settings().values():  # the bearer token (refreshed by exec plugins)
            if auth.get("in") == "header" and auth.get("value"):
                headers[auth["key"]] = auth["value"]
        data = None if body is None else body if isinstance(body, (str, bytes)) else json.dumps(body)
        try:
            resp = self.api.rest_client.pool_manager.request(
                method, url, body=data, headers=headers, timeout=urllib3.Timeout(total=self.timeout_s),
                preload_content=True)
        except Exception as exc:  # connection refused, TLS, timeouts: all "no answer"
            raise ApiError(0, f"{method} {path}: {exc}") from exc
        text = (resp.data or b"").decode("utf-8", "replace")
        if not 200 <= resp.status < 300:
            raise ApiError(resp.status, f"{method} {path}: {_message(text)}")
        return json.loads(text) if text.strip() else {}

    def get(self, ref: Ref) -> Manifest | None:
        try:
            return self.request("GET", ref.path())
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, ref: Ref, label_selector: str) -> list[Manifest]:
        """Objects matching `label_selector` (also filtered here, so a server that ignores selectors is fine)."""
        items = self.request("GET", ref.path(), query={"labelSelector": label_selector}).get("items") or []
        return [i for i in items if matches(label_selector, (i.get("metadata") or {}).get("labels") or {})]

    def create(self, ref: Ref, body: Manifest) -> Manifest | None:
        """Create; None when it already exists (a concurrent or earlier pass made it)."""
        try:
            return self.request("POST", ref.path(), body)
        except ApiError as exc:
            if exc.status == 409:
                return None
            raise

    def merge_patch(self, ref: Ref, body: Manifest, subresource: str | None = None) -> Manifest:
        return self.request("PATCH", ref.path(subresource), body, content_type=MERGE_PATCH)

    def delete(self, ref: Ref, propagation: str = "Background") -> bool:
        """Delete; False when it was already gone."""
        try:
            self.request("DELETE", ref.path(), {"propagationPolicy": propagation})
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise


def matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based label selectors (`a=b,c!=d,e,!f`), the only kind the operator writes."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _message(text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500]
    return str(body.get("message") or body)[:500] if isinstance(body, dict) else text[:500]
