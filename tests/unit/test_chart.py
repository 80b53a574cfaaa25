"""The Helm chart, rendered and linted with helm-python-sdk (Helm's Go SDK; no `helm` binary here).

For default and non-default values: lint is clean; every rendered manifest and the CRD validate
against the Kubernetes schemas (kubernetes-validate, offline); RBAC grants what the operator does and
nothing more, cluster-wide only when it watches all namespaces; the dashboards ConfigMap carries the
Grafana sidecar label and panels whose PromQL uses only the metric names of docs/observability.md.
The CRD is a template (upgraded by `helm upgrade`, kept by `helm uninstall`) rendered from the file
`python -m chariot.operator.crd` generates; the pre-delete hook drains ModelDeployments with its own
least-privilege identity and a command the image's CLI has; values.schema.json types every value and
rejects bad ones; the operator's PodDisruptionBudget never blocks a node drain.
(That the PromQL returns data from a Prometheus scraping a running Chariot is checked in
tests/e2e/test_local_e2e.py.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from chariot.operator import crd as crd_module

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


def is_hook(doc: dict[str, Any]) -> bool:
    return "helm.sh/hook" in (doc["metadata"].get("annotations") or {})


def release_objects(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What `helm install` creates and tracks (hooks are created only at their event)."""
    return [d for d in docs if not is_hook(d)]


def hooks(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if is_hook(d)]


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
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # not a built-in schema; checked below
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    assert {d["kind"] for d in docs} >= {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment",
                                         "ConfigMap", "CustomResourceDefinition", "PodDisruptionBudget", "Job"}


def test_defaults_watch_all_namespaces_with_a_cluster_role() -> None:
    docs = release_objects(render({}))
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
    docs = release_objects(render(CUSTOM))
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
    ("policy", "poddisruptionbudgets"): {"get", "list", "create", "patch", "delete"},
    ("", "events"): {"create", "patch"},
    ("autoscaling", "horizontalpodautoscalers"): {"list"},
}


@pytest.mark.parametrize("values", VALUES)
def test_rbac_is_least_privilege(values: dict[str, Any]) -> None:
    docs = release_objects(render(values))
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
def test_cluster_wide_rules_are_read_only(values: dict[str, Any]) -> None:
    """Discovery (CRDs, namespaces) and the nodes of its stage pods (drains), nothing else, nothing written."""
    (role,) = [r for r in by_kind(release_objects(render(values)), "ClusterRole")
               if r["metadata"]["name"].endswith("-discovery")]
    granted = {(group, resource): set(rule["verbs"])
               for rule in role["rules"] for group in rule["apiGroups"] for resource in rule["resources"]}
    assert granted == {("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
                       ("", "namespaces"): {"get", "list", "watch"}, ("", "nodes"): {"get"}}


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
                   "chariot_kv_cache_usage", "chariot_batch_tokens", "chariot_stage_idle_time_seconds_total",
                   "chariot_prefix_cache_hits_total", "chariot_router_prefix_hit_tokens_total",
                   "chariot_router_routed_total", "chariot_offered_load_tokens", "chariot_replica_capacity"):
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
    assert "ARG BASE_IMAGE=python:3.11-slim" in text and "download.pytorch.org/whl/cpu" in text
    assert 'ENTRYPOINT ["chariot"]' in text
    # The GPU image's torch is PyPI's (the CUDA build on Linux x86-64: no such index as .../cu124 has
    # 2.13.0); the final stage keeps the compilers Triton's launcher and the CPU kernel need at start-up.
    assert "TORCH_INDEX_URL=https://pypi.org/simple" in text and "cu124" not in text
    assert re.search(r"apt-get install .*\bgcc\b.*\bg\+\+", text)


def test_skaffold_tags_by_input_digest_and_its_gpu_profile_builds_the_cuda_image() -> None:
    config = yaml.safe_load((ROOT / "skaffold.yaml").read_text())
    assert config["build"]["tagPolicy"] == {"inputDigest": {}}
    (release,) = config["deploy"]["helm"]["releases"]
    image_var = config["build"]["artifacts"][0]["image"].replace("/", "_").replace(".", "_").replace("-", "_")
    assert release["setValueTemplates"]["image.tag"] == \
        f"{{{{.IMAGE_TAG_{image_var}}}}}@{{{{.IMAGE_DIGEST_{image_var}}}}}"  # pods run exactly what was pushed
    (gpu,) = [p for p in config["profiles"] if p["name"] == "gpu"]
    assert gpu["patches"][0]["value"].startswith("make image-cuda ")  # tests/unit/test_images.py


def test_an_image_pinned_by_digest_reaches_the_operator_and_its_workers() -> None:
    pinned = "0.1.0@sha256:" + "ab" * 32
    (deploy,) = [d for d in by_kind(render({"image": {"tag": pinned}}), "Deployment")]
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == f"ghcr.io/chariot-serving/chariot:{pinned}"
    assert f"--image=ghcr.io/chariot-serving/chariot:{pinned}" in container["args"]


def test_skaffold_builds_the_image_and_deploys_the_chart() -> None:
    config = yaml.safe_load((ROOT / "skaffold.yaml").read_text())
    (artifact,) = config["build"]["artifacts"]
    assert (ROOT / artifact["custom"]["dependencies"]["dockerfile"]["path"]).is_file()
    (release,) = config["deploy"]["helm"]["releases"]
    assert (ROOT / release["chartPath"] / "Chart.yaml").is_file()
    image_var = artifact["image"].replace("/", "_").replace(".", "_").replace("-", "_")
    assert release["setValueTemplates"]["image.repository"] == f"{{{{.IMAGE_REPO_{image_var}}}}}"


# --- the CRD: a template, generated, kept --------------------------------------------------------

def test_crd_is_a_kept_template_rendered_from_the_generated_file() -> None:
    with helm.Chart.load(str(CHART)) as chart:
        assert chart.crds == [], "a CRD under crds/ is never upgraded by Helm and would clash with the template"
    docs = render({})
    (crd,) = by_kind(docs, "CustomResourceDefinition")
    assert not is_hook(crd), "a release object: upgraded by `helm upgrade`, diffed, owned by the release"
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert crd["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    expected = crd_module.crd_manifest()
    assert crd["metadata"]["name"] == expected["metadata"]["name"]
    assert crd["metadata"]["labels"].items() >= expected["metadata"]["labels"].items()
    assert crd["spec"] == expected["spec"], "the template must carry operator/crd.py's definition unchanged"


def test_crd_can_be_left_to_helm_uninstall_or_not_installed() -> None:
    (crd,) = by_kind(render({"crds": {"keep": False}}), "CustomResourceDefinition")
    assert "helm.sh/resource-policy" not in (crd["metadata"].get("annotations") or {})
    assert by_kind(render({"crds": {"install": False}}), "CustomResourceDefinition") == []


# --- helm uninstall: the pre-delete hook ---------------------------------------------------------

def hook_weight(doc: dict[str, Any]) -> int:
    return int(doc["metadata"]["annotations"]["helm.sh/hook-weight"])


@pytest.mark.parametrize("values", VALUES)
def test_uninstall_hook_drains_model_deployments_with_its_own_identity(values: dict[str, Any]) -> None:
    from chariot.cli.main import parser

    docs = render(values)
    hook_docs = hooks(docs)
    assert {d["metadata"]["name"] for d in hook_docs} == {"serve-chariot-uninstall"}
    for doc in hook_docs:
        annotations = doc["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-delete", doc["kind"]
        assert set(annotations["helm.sh/hook-delete-policy"].split(",")) == {"before-hook-creation", "hook-succeeded"}
    (job,) = by_kind(hook_docs, "Job")
    identity = [d for d in hook_docs if d is not job]
    assert all(hook_weight(d) < hook_weight(job) for d in identity), "RBAC must exist before the Job runs"

    namespaces = values.get("watchNamespaces", [])
    (account,) = by_kind(hook_docs, "ServiceAccount")
    roles = by_kind(hook_docs, "Role" if namespaces else "ClusterRole")
    bindings = by_kind(hook_docs, "RoleBinding" if namespaces else "ClusterRoleBinding")
    assert sorted(r["metadata"].get("namespace", "*") for r in roles) == (sorted(namespaces) or ["*"])
    assert {d["kind"] for d in identity} == {"ServiceAccount", roles[0]["kind"], bindings[0]["kind"]}
    for role in roles:
        assert role["rules"] == [{"apiGroups": ["chariot.dev"], "resources": ["modeldeployments"],
                                  "verbs": ["get", "list", "delete"]}]
    for binding in bindings:
        assert binding["roleRef"]["name"] == "serve-chariot-uninstall"
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                        "namespace": "chariot-system"}]

    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"] and pod["restartPolicy"] == "Never"
    assert job["spec"]["activeDeadlineSeconds"] > 240
    (container,) = pod["containers"]
    (operator,) = by_kind(docs, "Deployment")
    assert container["image"] == operator["spec"]["template"]["spec"]["containers"][0]["image"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True and pod["securityContext"]["runAsNonRoot"]
    # The command exists in the image's CLI and means what the chart says.
    assert container["command"][0] == "chariot"
    args = parser().parse_args(container["command"][1:] + container["args"])
    assert args.handler.__name__ == "_handle_drain"
    assert (args.namespace or [], args.timeout_seconds) == (namespaces, 240.0)
    # Its pods are not the operator's: the operator's selector (and PDB) must not count them.
    selector = operator["spec"]["selector"]["matchLabels"]
    assert not selector.items() <= job["spec"]["template"]["metadata"]["labels"].items()


def test_uninstall_hook_without_rbac_or_disabled() -> None:
    docs = hooks(render({"rbac": {"create": False}, "serviceAccount": {"name": "ops"},
                         "uninstall": {"timeoutSeconds": 90}}))
    (job,) = docs
    assert job["kind"] == "Job" and job["spec"]["template"]["spec"]["serviceAccountName"] == "ops"
    assert "--timeout-seconds=90" in job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert hooks(render({"uninstall": {"deleteModelDeployments": False}})) == []


# --- the operator's PodDisruptionBudget ----------------------------------------------------------

def test_operator_pdb_allows_node_drains() -> None:
    docs = render({})
    (pdb,) = by_kind(docs, "PodDisruptionBudget")
    (deployment,) = by_kind(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": deployment["spec"]["selector"]}
    assert deployment["spec"]["selector"]["matchLabels"].items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items()
    assert by_kind(render({"operator": {"podDisruptionBudget": {"enabled": False}}}), "PodDisruptionBudget") == []


# --- values.schema.json --------------------------------------------------------------------------

def schema() -> dict[str, Any]:
    return dict(json.loads((CHART / "values.schema.json").read_text()))


def leaves(values: dict[str, Any], path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for key, value in values.items():
        out += leaves(value, (*path, key)) if isinstance(value, dict) and value else [(*path, key)]
    return out


def schema_at(node: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any] | None:
    for key in path:
        props = node.get("properties") or {}
        if key in props:
            node = props[key]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            return None
    return node


def test_schema_is_draft_07_and_types_every_value() -> None:
    s = schema()
    assert s["$schema"] == "http://json-schema.org/draft-07/schema#" and s["additionalProperties"] is False
    jsonschema.Draft7Validator.check_schema(s)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    for path in leaves(defaults):
        node = schema_at(s, path)
        assert node is not None and "type" in node, f"values.schema.json does not type {'.'.join(path)}"
    for key, node in s["properties"].items():
        assert node.get("description"), key
        if node["type"] == "object" and "properties" in node:
            assert node.get("additionalProperties") is False, f"{key}: unknown keys must be rejected"


@pytest.mark.parametrize("values", VALUES)
def test_default_and_custom_values_pass_the_schema(values: dict[str, Any]) -> None:
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)  # Helm's own validator
        merged = chart.merge_values(values)
    jsonschema.Draft7Validator(schema()).validate(merged)


BAD_VALUES = [
    pytest.param({"operator": {"resyncSeconds": "fast"}}, id="wrong-type"),
    pytest.param({"operator": {"replicas": 2}}, id="unknown-nested-key"),
    pytest.param({"replicaCount": 2}, id="unknown-top-level-key"),
    pytest.param({"uninstall": {"timeoutSeconds": -5}}, id="negative-timeout"),
    pytest.param({"operator": {"restartBackoffSeconds": 0}}, id="zero-backoff"),
    pytest.param({"operator": {"podDisruptionBudget": {"maxUnavailable": 0}}}, id="pdb-blocking-drains"),
    pytest.param({"image": {"pullPolicy": "Sometimes"}}, id="bad-enum"),
    pytest.param({"watchNamespaces": ["Team_A"]}, id="bad-namespace"),
    pytest.param({"crds": {"install": "yes"}}, id="string-for-boolean"),
    pytest.param({"metrics": {"serviceMonitor": {"interval": "15 seconds"}}}, id="bad-duration"),
]


@pytest.mark.parametrize("bad", BAD_VALUES)
def test_bad_values_are_rejected_by_the_schema_and_by_helm(bad: dict[str, Any]) -> None:
    with helm.Chart.load(str(CHART)) as chart:
        merged = chart.merge_values(bad)
        with pytest.raises(helm.HelmError):
            chart.render(bad, name="serve", namespace="chariot-system")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema()).validate(merged)
