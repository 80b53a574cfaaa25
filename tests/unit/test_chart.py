"""The Helm chart, rendered and linted with helm-python-sdk (Helm's Go SDK; no `helm` binary here).

For default and non-default values: lint is clean; every rendered manifest and the CRD validate
against the Kubernetes schemas (kubernetes-validate, offline); RBAC grants what the operator does and
nothing more, cluster-wide only when it watches all namespaces; the dashboards ConfigMap carries the
Grafana sidecar label and panels whose PromQL uses only the metric names of docs/observability.md.
(That the PromQL returns data from a Prometheus scraping a running Chariot is checked in
tests/e2e/test_local_e2e.py.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "chariot"
KUBE_VERSION = "1.32"
CUSTOM = {
    "watchNamespaces": ["team-a", "team-b"],
    "image": {"repository": "registry.example.com/chariot", "tag": "1.2.3"},
    "redis": {"url": "redis://redis.cache:6379/0"},
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
    "serviceAccount": {"name": "chariot-op"},
    "operator": {"verbose": True, "resyncSeconds": 10, "tolerations": [{"key": "ops", "operator": "Exists"}]},
    "dashboards": {"namespace": "monitoring"},
}
VALUES = [pytest.param({}, id="defaults"), pytest.param(CUSTOM, id="custom")]


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="serve", namespace="chariot-system")
    docs = []
    for path, text in files.items():
        if path.endswith(".txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def documented_metrics() -> set[str]:
    """Prometheus names from docs/observability.md's table, with the histogram series suffixes."""
    text = (ROOT / "docs" / "observability.md").read_text()
    names = set()
    for row in re.findall(r"^\|[^|]+\|\s*(\w+)\s*\|[^|]*\|\s*`([a-z_]+)`\s*\|", text, flags=re.M):
        kind, name = row
        names |= {name} if kind != "histogram" else {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    assert len(names) > 20, "the metrics table of docs/observability.md was not found"
    return names


@pytest.mark.parametrize("values", VALUES)
def test_lint_is_clean(values: dict[str, Any]) -> None:
    report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE_VERSION}.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values", VALUES)
def test_rendered_manifests_validate_against_kubernetes_schemas(values: dict[str, Any]) -> None:
    docs = render(values)
    with helm.Chart.load(str(CHART)) as chart:
        docs += [yaml.safe_load(c["data"]) for c in chart.crds]
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # not a built-in schema; checked below
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    assert {d["kind"] for d in docs} >= {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment",
                                         "ConfigMap", "CustomResourceDefinition"}


def test_defaults_watch_all_namespaces_with_a_cluster_role() -> None:
    docs = render({})
    assert by_kind(docs, "Role") == [] and by_kind(docs, "RoleBinding") == []
    assert sorted(r["metadata"]["name"] for r in by_kind(docs, "ClusterRole")) == \
        ["serve-chariot-operator", "serve-chariot-operator-discovery"]
    (deployment,) = by_kind(docs, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["chariot", "operator"]
    assert not any(a.startswith("--namespace") for a in container["args"])
    assert container["image"] == "ghcr.io/chariot-serving/chariot:0.1.0"
    assert "--image=ghcr.io/chariot-serving/chariot:0.1.0" in container["args"]
    assert by_kind(docs, "ServiceMonitor") == []


def test_watched_namespaces_get_roles_and_no_cluster_wide_write_access() -> None:
    docs = render(CUSTOM)
    assert sorted(r["metadata"]["namespace"] for r in by_kind(docs, "Role")) == ["team-a", "team-b"]
    assert [r["metadata"]["name"] for r in by_kind(docs, "ClusterRole")] == ["serve-chariot-operator-discovery"]
    (cluster_role,) = by_kind(docs, "ClusterRole")
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in cluster_role["rules"])
    for binding in by_kind(docs, "RoleBinding") + by_kind(docs, "ClusterRoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "chariot-op", "namespace": "chariot-system"}]
    container = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    assert {"--namespace=team-a", "--namespace=team-b", "--redis-url=redis://redis.cache:6379/0", "--verbose",
            "--resync-seconds=10"} <= set(container["args"])
    assert container["image"] == "registry.example.com/chariot:1.2.3"
    (monitor,) = by_kind(docs, "ServiceMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"http", "metrics"}
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert by_kind(docs, "ConfigMap")[0]["metadata"]["namespace"] == "monitoring"


REQUIRED = {  # what the operator (and kopf) call, per (apiGroup, resource)
    ("chariot.dev", "modeldeployments"): {"get", "list", "watch", "patch"},
    ("chariot.dev", "modeldeployments/status"): {"get", "patch"},
    ("chariot.dev", "modeldeployments/finalizers"): {"update"},
    ("", "pods"): {"get", "list", "watch", "create", "delete"},
    ("", "services"): {"get", "create", "patch", "delete"},
    ("", "configmaps"): {"get", "create", "patch", "delete"},
    ("apps", "deployments"): {"get", "list", "watch", "create", "patch", "delete"},
    ("networking.k8s.io", "networkpolicies"): {"get", "list", "create", "patch", "delete"},
    ("", "events"): {"create", "patch"},
}


@pytest.mark.parametrize("values", VALUES)
def test_rbac_is_least_privilege(values: dict[str, Any]) -> None:
    docs = render(values)
    roles = [r for r in by_kind(docs, "ClusterRole") + by_kind(docs, "Role")
             if not r["metadata"]["name"].endswith("-discovery")]
    for role in roles:
        granted: dict[tuple[str, str], set[str]] = {}
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    granted.setdefault((group, resource), set()).update(rule["verbs"])
        assert granted == REQUIRED, f"{role['kind']} {role['metadata']['name']} grants more or less than needed"


@pytest.mark.parametrize("values", VALUES)
def test_operator_pod_is_hardened(values: dict[str, Any]) -> None:
    (deployment,) = by_kind(render(values), "Deployment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = pod["containers"][0]
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["requests"]


def dashboards(values: dict[str, Any]) -> list[dict[str, Any]]:
    (cm,) = [c for c in by_kind(render(values), "ConfigMap") if c["metadata"]["name"].endswith("-dashboards")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    return [json.loads(text) for text in cm["data"].values()]


def metric_names(promql: str) -> set[str]:
    """Metric names read by a PromQL expression (label matchers and grouping labels removed)."""
    bare = re.sub(r"\{[^}]*\}", "", promql)
    bare = re.sub(r"\b(?:by|without)\s*\([^)]*\)", "", bare)
    bare = re.sub(r"label_values\(([^,)]+),[^)]*\)", r"\1", bare)
    return set(re.findall(r"\b(?:gen_ai|chariot)_[a-z_]+\b", bare))


def panel_exprs(dashboard: dict[str, Any]) -> dict[str, list[str]]:
    return {p["title"]: [t["expr"] for t in p["targets"]] for p in dashboard["panels"]}


def test_dashboard_panels_cover_the_serving_metrics() -> None:
    (dashboard,) = dashboards({})
    exprs = panel_exprs(dashboard)
    flat = " ".join(e for es in exprs.values() for e in es)
    for quantile, metric in [("0.5", "time_to_first_token"), ("0.9", "time_to_first_token"),
                             ("0.99", "time_to_first_token"), ("0.5", "time_per_output_token"),
                             ("0.99", "time_per_output_token")]:
        assert re.search(rf"histogram_quantile\({quantile}, [^;]*gen_ai_server_{metric}_seconds_bucket", flat)
    for needle in ("gen_ai_server_request_duration_seconds_count", "chariot_admission_decisions_total",
                   "chariot_kv_cache_usage", "chariot_batch_tokens", "chariot_stage_idle_time_seconds_total"):
        assert needle in flat, needle
    assert dashboard["uid"] == "chariot-serving" and dashboard["title"] == "Chariot serving"


def test_dashboard_queries_use_only_documented_metrics() -> None:
    documented = documented_metrics()
    for dashboard in dashboards({}):
        for title, exprs in panel_exprs(dashboard).items():
            assert exprs, f"panel {title!r} has no query"
            for expr in exprs:
                used = metric_names(expr)
                assert used, f"{title}: {expr} reads no Chariot metric"
                assert used <= documented, f"{title}: undocumented {used - documented}"
        for variable in dashboard["templating"]["list"]:
            assert metric_names(variable.get("definition", "")) <= documented


def test_dashboards_can_be_disabled() -> None:
    assert not any(c["metadata"]["name"].endswith("-dashboards") for c in by_kind(render(
        {"dashboards": {"enabled": False}}), "ConfigMap"))


def test_dockerfile_builds_one_slim_non_root_image() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^USER 10001", text, flags=re.M), "must run as the pods' non-root uid"
    assert "python:${PYTHON_VERSION}-slim" in text and "download.pytorch.org/whl/cpu" in text
    assert 'ENTRYPOINT ["chariot"]' in text


def test_skaffold_builds_the_image_and_deploys_the_chart() -> None:
    config = yaml.safe_load((ROOT / "skaffold.yaml").read_text())
    (artifact,) = config["build"]["artifacts"]
    assert (ROOT / artifact["docker"]["dockerfile"]).is_file()
    (release,) = config["deploy"]["helm"]["releases"]
    assert (ROOT / release["chartPath"] / "Chart.yaml").is_file()
    image_var = artifact["image"].replace("/", "_").replace(".", "_").replace("-", "_")
    assert release["setValueTemplates"]["image.repository"] == f"{{{{.IMAGE_REPO_{image_var}}}}}"
