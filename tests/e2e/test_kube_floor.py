"""The oldest `kubernetes` client pyproject allows is one the operator's API client runs on.

`make test` builds `build/kube-floor-venv` with exactly that release (and nothing of Chariot's other
dependencies); this test runs `chariot.operator.kube` from it — create, conflict, merge-patch, get,
list by label, delete, a 404 — against the API emulator, as the operator does against a cluster.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tests.e2e.cluster import make_cluster

ROOT = Path(__file__).resolve().parents[2]
FLOOR_VENV = ROOT / "build" / "kube-floor-venv"

SCRIPT = """
import json, sys
import kubernetes
from kubernetes import client, config
from chariot.operator.kube import Kube, Ref
cfg = client.Configuration()
config.load_kube_config(config_file=sys.argv[1], client_configuration=cfg)
kube, ns = Kube(client.ApiClient(cfg), timeout_s=10), sys.argv[2]
cm = {"apiVersion": "v1", "kind": "ConfigMap", "data": {"a": "1"},
      "metadata": {"name": "floor", "namespace": ns, "labels": {"app": "floor"}}}
out = {"version": kubernetes.__version__, "created": kube.create(Ref("ConfigMap", ns), cm)["data"],
       "conflict": kube.create(Ref("ConfigMap", ns), cm)}
kube.merge_patch(Ref("ConfigMap", ns, "floor"), {"data": {"b": "2"}})
out["got"] = kube.get(Ref("ConfigMap", ns, "floor"))["data"]
out["listed"] = [m["metadata"]["name"] for m in kube.list(Ref("ConfigMap", ns), "app=floor")]
out["deleted"] = kube.delete(Ref("ConfigMap", ns, "floor"))
out["gone"] = kube.get(Ref("ConfigMap", ns, "floor"))
print(json.dumps(out))
"""


def floor_version() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if re.match(r"kubernetes\b", d)]
    match = re.fullmatch(r"kubernetes>=([\d.]+)", spec.replace(" ", ""))
    assert match, f"expected a plain floor for kubernetes in pyproject, got {spec!r}"
    return match.group(1)


def test_the_operators_api_client_runs_on_the_kubernetes_floor(tmp_path: Path) -> None:
    python = FLOOR_VENV / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{FLOOR_VENV} is missing: `make kube-floor` (part of `make test`) builds it", pytrace=False)
    # Only the operator's modules and what they import, under the `chariot.` names pyproject maps.
    package = tmp_path / "src" / "chariot"
    package.mkdir(parents=True)
    for folder in ("operator", "contracts"):
        (package / folder).symlink_to(ROOT / folder)
    with make_cluster(tmp_path) as cluster:
        result = subprocess.run([str(python), "-c", SCRIPT, str(cluster.kubeconfig), cluster.namespace],
                                env={"PYTHONPATH": str(tmp_path / "src"), "PATH": "/usr/bin:/bin"},
                                capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    floor = floor_version()
    assert out["version"] == floor or out["version"].startswith(f"{floor}."), out["version"]
    assert out["created"] == {"a": "1"} and out["conflict"] is None
    assert out["got"] == {"a": "1", "b": "2"} and out["listed"] == ["floor"]
    assert out["deleted"] is True and out["gone"] is None
    assert sys.version_info >= (3, 11)
