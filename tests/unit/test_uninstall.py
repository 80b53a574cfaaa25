"""`chariot operator drain`, the Helm chart's pre-delete hook, against the emulated API server.

What `helm uninstall` relies on: every ModelDeployment in the watched namespaces (only those) is
deleted, the command waits while the operator's finalizer (`chariot.dev/cleanup`) holds them and
returns once the operator has released them all; when the operator does not, it gives up at the
timeout naming the stragglers — and never removes a finalizer itself. The "operator" here is the
injected `sleep`, which releases one deleted ModelDeployment per poll, so the tests are
deterministic and take no wall-clock time. The command line itself runs once as a process against
the emulator, as the hook Job runs it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chariot.operator import crd
from chariot.operator.cli import add_operator_parser
from chariot.operator.kube import Kube, Ref
from chariot.operator.uninstall import FINALIZER, collection_paths, drain, timeout_message
from tests.e2e.kube_emulator import RunningEmulator, running_emulator

ROOT = Path(__file__).resolve().parents[2]


def api_client(kubeconfig: Path) -> Any:
    from kubernetes import client, config

    configuration = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    return client.ApiClient(configuration)


class Api:
    def __init__(self, emulator: RunningEmulator, kubeconfig: Path) -> None:
        self.emulator = emulator
        self.kubeconfig = kubeconfig
        self.kube = Kube(api_client(kubeconfig), timeout_s=10)

    def install_crd(self) -> None:
        self.kube.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd.crd_manifest())

    def add(self, namespace: str, name: str) -> None:
        self.kube.create(Ref(crd.KIND, namespace), {
            "apiVersion": crd.API_VERSION, "kind": crd.KIND,
            "metadata": {"name": name, "namespace": namespace, "finalizers": [FINALIZER]},
            "spec": {"model": {"uri": "preset://tiny"}}})

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.kube.get(Ref(crd.KIND, namespace, name))

    def release_one(self, namespaces: list[str]) -> str | None:
        """What the operator's cleanup handler ends with: drop the finalizer of one deleted object."""
        for ns in namespaces:
            for obj in self.kube.request("GET", Ref(crd.KIND, ns).path()).get("items") or []:
                if obj["metadata"].get("deletionTimestamp"):
                    self.kube.merge_patch(Ref(crd.KIND, ns, obj["metadata"]["name"]),
                                          {"metadata": {"finalizers": None}})
                    return f"{ns}/{obj['metadata']['name']}"
        return None


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    with running_emulator() as emulator:
        kubeconfig = tmp_path / "kubeconfig.json"
        kubeconfig.write_text(emulator.kubeconfig())
        yield Api(emulator, kubeconfig)


class FakeTime:
    """A clock that only moves when `sleep` is called; each sleep first lets `on_sleep` act."""

    def __init__(self, on_sleep: Any = None) -> None:
        self.now = 1000.0
        self.sleeps = 0
        self.on_sleep = on_sleep

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps += 1
        if self.on_sleep:
            self.on_sleep()
        self.now += seconds


def test_collection_paths() -> None:
    assert collection_paths(None) == collection_paths([]) == ["/apis/chariot.dev/v1alpha1/modeldeployments"]
    assert collection_paths(["b", "a", "b"]) == ["/apis/chariot.dev/v1alpha1/namespaces/a/modeldeployments",
                                                 "/apis/chariot.dev/v1alpha1/namespaces/b/modeldeployments"]


def test_deletes_only_the_watched_namespaces_and_waits_for_the_operator(api: Api) -> None:
    api.install_crd()
    for ns, name in [("team-a", "one"), ("team-a", "two"), ("team-b", "three"), ("other", "keep-me")]:
        api.add(ns, name)
    released: list[str] = []
    time = FakeTime(lambda: released.append(api.release_one(["team-a", "team-b"]) or ""))

    result = drain(api.kube, ["team-a", "team-b"], timeout_s=60, poll_s=2, clock=time.clock, sleep=time.sleep)

    assert result.ok and not result.crd_missing and result.error is None
    assert result.deleted == ["team-a/one", "team-a/two", "team-b/three"]
    assert sorted(r for r in released if r) == ["team-a/one", "team-a/two", "team-b/three"]
    assert time.sleeps == 3, "it must wait while the finalizer holds each one, and stop once all are gone"
    assert all(api.get(ns, n) is None for ns, n in [("team-a", "one"), ("team-a", "two"), ("team-b", "three")])
    untouched = api.get("other", "keep-me")
    assert untouched is not None and "deletionTimestamp" not in untouched["metadata"]


def test_all_namespaces_by_default(api: Api) -> None:
    api.install_crd()
    api.add("team-a", "one")
    api.add("other", "two")
    time = FakeTime(lambda: api.release_one(["team-a", "other"]))
    result = drain(api.kube, None, timeout_s=60, poll_s=1, clock=time.clock, sleep=time.sleep)
    assert result.ok and sorted(result.deleted) == ["other/two", "team-a/one"]
    assert api.get("team-a", "one") is None and api.get("other", "two") is None


def test_times_out_naming_the_stragglers_and_never_removes_a_finalizer(api: Api) -> None:
    api.install_crd()
    api.add("team-a", "stuck")
    time = FakeTime()  # no operator
    result = drain(api.kube, ["team-a"], timeout_s=30, poll_s=2, clock=time.clock, sleep=time.sleep)
    assert not result.ok
    assert result.remaining == {"team-a/stuck": [FINALIZER]}
    assert time.now == pytest.approx(1030.0), "gives up at the deadline, not later"
    obj = api.get("team-a", "stuck")
    assert obj is not None and obj["metadata"]["finalizers"] == [FINALIZER] and obj["metadata"]["deletionTimestamp"]
    message = timeout_message(result, 30)
    assert "team-a/stuck" in message and FINALIZER in message and "operator" in message


def test_nothing_to_do_without_the_crd(api: Api) -> None:
    time = FakeTime()
    result = drain(api.kube, None, timeout_s=5, clock=time.clock, sleep=time.sleep)
    assert result.ok and result.crd_missing and time.sleeps == 0


def test_an_api_server_that_never_answers_is_a_failure_not_a_success(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig.json"
    with running_emulator() as emulator:
        kubeconfig.write_text(emulator.kubeconfig())
    kube = Kube(api_client(kubeconfig), timeout_s=2)  # the emulator is gone: connection refused
    time = FakeTime()
    result = drain(kube, ["team-a"], timeout_s=6, poll_s=2, clock=time.clock, sleep=time.sleep)
    assert not result.ok and result.error and time.sleeps == 3
    assert "API server" in timeout_message(result, 6)


def test_the_subcommand_is_registered_under_operator() -> None:
    parser = argparse.ArgumentParser(prog="chariot")
    add_operator_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["operator", "drain", "-n", "a", "--namespace", "b", "--timeout-seconds", "5"])
    assert (args.namespace, args.timeout_seconds, args.handler.__name__) == (["a", "b"], 5.0, "_handle_drain")
    plain = parser.parse_args(["operator", "-n", "a"])
    assert (plain.namespace, plain.handler.__name__, plain.operator_command) == (["a"], "_handle", None)


def test_the_command_line_the_hook_runs(api: Api) -> None:
    """`chariot operator drain` as a process (KUBECONFIG → the emulator): 0 when done, 1 on timeout."""
    env = {"KUBECONFIG": str(api.kubeconfig), "PATH": "/usr/bin:/bin", "HOME": str(api.kubeconfig.parent)}
    cmd = [sys.executable, "-m", "chariot.cli", "operator", "drain", "--namespace", "team-a",
           "--timeout-seconds", "1", "--poll-seconds", "0.2"]
    api.install_crd()
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    api.add("team-a", "stuck")
    stuck = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert stuck.returncode == 1, stuck.stderr
    assert "timed out after 1s" in stuck.stderr and "team-a/stuck" in stuck.stderr
