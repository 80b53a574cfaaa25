"""The test kubelet runs probes as a kubelet does, so a probe the operator renders wrong fails a test.

Real processes (a tiny HTTP server whose `/live` answers 200 and `/dead` 503), the real probing code
of `LocalRuntime`; only the API is absent (these pods never reach one: `sync` is called directly).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.kubelet import LocalRuntime, PodReport

SERVER = """
import argparse, http.server
p = argparse.ArgumentParser(); p.add_argument("--port", type=int); port = p.parse_args().port
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/live" else 503); self.end_headers()
    def log_message(self, *args): pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def pod(name: str, liveness_path: str, restart_policy: str, readiness_path: str = "/live") -> dict[str, Any]:
    probe = {"periodSeconds": 1, "failureThreshold": 2}
    container = {"name": "web", "image": "none", "command": [sys.executable, "-c", SERVER], "args": ["--port", "8080"],
                 "ports": [{"containerPort": 8080}],
                 "livenessProbe": {"httpGet": {"path": liveness_path, "port": 8080}, "initialDelaySeconds": 1, **probe},
                 "readinessProbe": {"httpGet": {"path": readiness_path, "port": 8080}, **probe}}
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
            "spec": {"restartPolicy": restart_policy, "containers": [container]}}


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[LocalRuntime]:
    rt = LocalRuntime(kube=None, workdir=tmp_path, chariot=[sys.executable], probe_time_scale=0.5)  # type: ignore[arg-type]
    yield rt
    rt.close()


def watch(runtime: LocalRuntime, manifest: dict[str, Any], seconds: float) -> list[PodReport]:
    reports = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        reports.append(runtime.sync(manifest))
        time.sleep(0.05)
    return reports


def test_a_passing_liveness_probe_keeps_the_container_and_readiness_marks_it_ready(runtime: LocalRuntime) -> None:
    reports = watch(runtime, pod("alive", "/live", "Always"), 4.0)
    assert reports[-1].phase == "Running" and reports[-1].ready and reports[-1].restarts == 0


def test_a_failing_liveness_probe_restarts_the_container_under_restart_policy_always(runtime: LocalRuntime) -> None:
    reports = watch(runtime, pod("dying", "/dead", "Always"), 6.0)
    assert max(r.restarts for r in reports) >= 1 and all(r.phase == "Running" for r in reports[5:])


def test_a_failing_liveness_probe_ends_a_never_restarted_pod(runtime: LocalRuntime) -> None:
    reports = watch(runtime, pod("stage", "/dead", "Never"), 6.0)
    assert reports[-1].phase == "Failed" and not reports[-1].ready


def test_a_failing_readiness_probe_keeps_the_pod_running_but_not_ready(runtime: LocalRuntime) -> None:
    reports = watch(runtime, pod("busy", "/live", "Always", readiness_path="/dead"), 4.0)
    assert reports[-1].phase == "Running" and not any(r.ready for r in reports) and reports[-1].restarts == 0
