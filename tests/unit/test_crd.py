"""The ModelDeployment CRD: one source of truth, structural, valid, and agreeing with the example.

The chart's YAML must be exactly what `operator/crd.py` generates; the schema must be structural
(what the API server requires for defaulting and pruning); the CRD must validate as an
`apiextensions.k8s.io/v1` object; and the shipped example must pass the schema and the operator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from chariot.operator import crd
from chariot.operator.spec import apply_defaults, parse_spec, schema_errors

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "modeldeployment.yaml"
# The generated copy the chart's templates/crd.yaml renders (not crds/, which `helm upgrade` never
# updates).
CHART_CRD = crd.CHART_CRD_PATH


def walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, schema)]
    for key, sub in (schema.get("properties") or {}).items():
        out += walk(sub, f"{path}.{key}")
    if "items" in schema:
        out += walk(schema["items"], f"{path}[]")
    return out


def version() -> dict[str, Any]:
    (v,) = crd.crd_manifest()["spec"]["versions"]
    return dict(v)


def test_chart_copy_is_generated_from_python() -> None:
    assert (ROOT / CHART_CRD).read_text() == crd.crd_yaml(), \
        f"stale chart CRD: run `python -m chariot.operator.crd > {CHART_CRD}`"
    assert not (ROOT / "charts/chariot/crds").exists(), "Helm would install a second, never-upgraded copy"


def test_names_scope_and_subresources() -> None:
    spec = crd.crd_manifest()["spec"]
    assert (spec["group"], spec["scope"]) == ("chariot.dev", "Namespaced")
    assert spec["names"]["plural"] == "modeldeployments" and spec["names"]["shortNames"] == ["mdep"]
    v = version()
    assert (v["name"], v["served"], v["storage"]) == ("v1alpha1", True, True)
    assert v["subresources"]["status"] == {}
    assert v["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                          "statusReplicasPath": ".status.replicas",
                                          "labelSelectorPath": ".status.selector"}


def test_printer_columns() -> None:
    columns = [c["name"] for c in version()["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["Ready", "Replicas", "Stages", "Policy", "Age"]


def test_schema_is_structural_with_descriptions() -> None:
    root = version()["schema"]["openAPIV3Schema"]
    for path, node in walk(root["properties"]["spec"], ".spec") + walk(root["properties"]["status"], ".status"):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        assert node.get("description"), f"{path} has no description"
        if node.get("type") == "object":  # fields, a typed map (never both), or explicitly open
            assert ("properties" in node) + ("additionalProperties" in node) == 1 or \
                node.get("x-kubernetes-preserve-unknown-fields"), path
            extra = node.get("additionalProperties")
            assert extra is None or extra.get("type") or extra.get("x-kubernetes-int-or-string"), path
        if "anyOf" in node:  # structural: anyOf may only restate types, next to int-or-string
            assert node.get("x-kubernetes-int-or-string") and all(set(a) == {"type"} for a in node["anyOf"]), path


def test_schema_declares_defaults_minimums_and_enums() -> None:
    spec = dict(walk(version()["schema"]["openAPIV3Schema"]["properties"]["spec"], ".spec"))
    assert spec[".spec.replicas"]["default"] == 1 and spec[".spec.replicas"]["minimum"] == 0
    assert spec[".spec.parallelism.pipeline"]["minimum"] == 1
    assert spec[".spec.scheduler.policy"]["enum"] == ["sarathi", "vllm", "orca", "fastertransformer"]
    assert spec[".spec.model.dtype"]["enum"] == ["auto", "float32", "float16", "bfloat16"]
    assert spec[".spec.resources.gpusPerStage"]["minimum"] == 0
    assert spec[".spec"]["required"] == ["model"] and spec[".spec.model"]["required"] == ["uri"]


def test_every_default_satisfies_its_own_schema() -> None:
    schema = crd.spec_schema()
    defaulted = apply_defaults(schema, {"model": {"uri": "preset://tiny"}})
    assert schema_errors(schema, defaulted, "spec") == []
    assert defaulted["scheduler"] == {"policy": "sarathi", "maxBatchSize": 128, "prefillOrder": "fcfs"}
    assert defaulted["resources"] == {"gpusPerStage": 1, "cpu": "2", "memory": "8Gi", "shmSize": "1Gi"}


def test_crd_validates_as_a_kubernetes_object() -> None:
    kubernetes_validate.validate(crd.crd_manifest(), "1.32", strict=True)


def test_example_passes_the_schema_and_the_operator() -> None:
    example = yaml.safe_load(EXAMPLE.read_text())
    assert "namespace" not in example["metadata"]
    assert (example["apiVersion"], example["kind"]) == (crd.API_VERSION, crd.KIND)
    jsonschema.validate(example["spec"], crd.spec_schema())  # the schema as plain JSON Schema, too
    spec = parse_spec(example["spec"], example["metadata"]["name"])
    assert (spec.pipeline, spec.replicas, spec.model.uri) == (2, 1, "preset://tiny")


@pytest.mark.parametrize("bad", [{"replicas": -1}, {"scheduler": {"policy": "lifo"}}, {"model": {"uri": "s3://x"}},
                                 {"parallelism": {"pipeline": 65}}, {"resources": {"cpu": "two"}},
                                 {"template": {"spec": {"containers": [{"image": "x"}]}}},
                                 {"template": {"metadata": {"labels": {"a": 1}}}},
                                 {"router": {"template": {"spec": {"tolerations": [{"effect": "Sometimes"}]}}}},
                                 {"parallelism": {"rendezvousTimeoutSeconds": 5}}, {"rollout": {"maxSurge": -1}},
                                 {"model": {"uri": "hf://no-org"}}, {"model": {"uri": "hf://a/b@"}},
                                 {"model": {"uri": "hf://a/b", "tokenSecret": {"key": "t"}}},
                                 {"resources": {"shmSize": "lots"}}, {"runtimeClassName": "Not_A_Name"},
                                 {"kernelCache": {}}, {"kernelCache": {"claimName": "a", "hostPath": "/a"}},
                                 {"kernelCache": {"hostPath": "relative/dir"}}])
def test_schema_rejects_what_it_can(bad: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"model": {"uri": "preset://tiny"}, **bad}, crd.spec_schema())
