"""A small JSON-over-REST Kubernetes client: the only place the operator talks to the API server.

Why not the typed `kubernetes` APIs: the operator handles five kinds the same way (get, list by
label, create, merge-patch, delete), and plain camelCase dicts are what the pure renderers produce
and the tests read. The `kubernetes` package still does the hard part — in-cluster service-account
or KUBECONFIG credentials, TLS, exec plugins — through its `ApiClient`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from chariot.operator import crd

Manifest = dict[str, Any]

# kind -> (API prefix, plural)
KINDS: dict[str, tuple[str, str]] = {
    "Pod": ("/api/v1", "pods"),
    "Service": ("/api/v1", "services"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
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
        out = f"{prefix}/namespaces/{quote(self.namespace)}/{plural}"
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
        headers = {"Accept": "application/json", "Content-Type": content_type}
        m, url, h, b, _ = self.api.param_serialize(method=method, resource_path=path,
                                                   query_params=list((query or {}).items()) or None,
                                                   header_params=headers, body=body, auth_settings=["BearerToken"])
        try:
            resp = self.api.call_api(m, url, header_params=h, body=b, _request_timeout=self.timeout_s)
            resp.read()
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
