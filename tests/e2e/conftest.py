"""End-to-end fixtures (module-scoped): emulated cluster with the CRD and a namespace, a fake-runtime
test kubelet, and the operator process. Helpers live in `tests/e2e/cluster.py`."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.e2e.cluster import Cluster, make_cluster, operator_process  # noqa: E402
from tests.e2e.kubelet import FakeRuntime, TestKubelet  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with make_cluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture(scope="module")
def fake_kubelet(cluster: Cluster) -> Iterator[FakeRuntime]:
    runtime = FakeRuntime(ready_delay_s=0.3)
    with TestKubelet(cluster.kube, cluster.namespace, runtime):
        yield runtime


@pytest.fixture(scope="module")
def operator(cluster: Cluster, fake_kubelet: FakeRuntime,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[bytes]]:
    with operator_process(cluster, tmp_path_factory.mktemp("operator") / "operator.log") as proc:
        yield proc
    assert proc.returncode in (0, -15), f"operator exited with {proc.returncode}"
